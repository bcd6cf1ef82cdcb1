"""Every `hf-pagedkv generate` / `serve` flag that can be checked without the model is checked before it loads,
and those that need no import before torch, transformers and the server's packages are imported: a bad flag
answers in a fraction of a second, not after seconds of imports and a model load."""

from __future__ import annotations

import argparse

import pytest

import hf_pagedkv.tools.models as models
from hf_pagedkv.tools import cli
from tests.tools.test_cli_startup import _run

BIG = "100000"  # tokens per block: past MAX_BLOCK_SIZE (65,536)
TOO_BIG = "`block_size`=100,000 is more than the largest block size, 65,536 tokens"
NO_PATH = "--model '/nonexistent/model-dir': no such path. Give a local directory with config.json"


@pytest.mark.parametrize("argv, shown", [
    (["generate", "--file", "/nonexistent/notes.txt"], "--file '/nonexistent/notes.txt' is not a readable file"),
    (["generate", "--no-chat", "--prompt", " "], "--prompt is empty and --no-chat adds no template"),
    (["generate", "--block-size", BIG], f"--quant/--block-size: {TOO_BIG}"),
    (["generate", "--model", "/nonexistent/model-dir"], f"hf-pagedkv generate: {NO_PATH}"),
    (["generate", "--model", "weights/missing.gguf"], "--model 'weights/missing.gguf': no such GGUF file"),
    (["serve", "--block-size", BIG], f"--quant/--block-size/--max-memory/--host-memory: {TOO_BIG}"),
    (["serve", "--block-size", "0"], "`block_size` must be a positive int, got 0"),
    (["serve", "--model", "/nonexistent/model-dir"], f"hf-pagedkv serve: {NO_PATH}"),
])
def test_a_bad_flag_fails_before_any_heavy_import(argv, shown):
    code, heavy, _, stderr = _run(argv)
    assert code == 2 and shown in stderr, stderr
    assert heavy == []  # neither torch nor transformers nor the server's packages were imported


@pytest.fixture
def no_model_load(monkeypatch):
    """`load_model` fails the test if called (both commands' references to it)."""
    def refuse(*args, **kwargs):
        pytest.fail("the model must not be loaded")

    monkeypatch.setattr(cli, "load_model", refuse)
    monkeypatch.setattr(models, "load_model", refuse)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_block_size_the_codecs_cannot_pack_fails_before_the_model_loads(command, no_model_load, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--quant", "k4v4", "--block-size", "3"])
    assert e.value.code == 2
    assert "4-bit codes pack 2 tokens together: block_size=3 must be a multiple of 2" in capsys.readouterr().err


def test_generate_with_a_file_that_is_not_text_fails_before_the_model_loads(tmp_path, no_model_load, capsys):
    path = tmp_path / "notes.bin"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert cli.main(["generate", "--file", str(path)]) == 2
    assert f"--file {str(path)!r} is not UTF-8 text (invalid start byte at byte 0)" in capsys.readouterr().err


@pytest.mark.parametrize("name, missing", [
    (None, False), (models.DEFAULT_MODEL, False), ("HuggingFaceTB/SmolLM2-135M", False),  # may be Hub ids
    ("/nonexistent/model-dir", True), ("./nope", True), ("a/b/c", True), ("~/nope-model", True),
    ("nope.gguf", True),
])
def test_missing_model_path_flags_only_what_can_only_be_a_local_path(name, missing):
    assert (models.missing_model_path(name) is not None) == missing


def test_an_existing_local_path_passes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert models.missing_model_path(str(tmp_path)) is None
    assert models.missing_model_path(str(tmp_path / "m.gguf")) is None
    assert "no such GGUF file" in models.missing_model_path(str(tmp_path / "other.gguf"))


def test_ctrl_c_in_a_tool_command_is_one_line_and_status_130(capsys):
    from hf_pagedkv.tools import cli_tools

    def interrupted(args, parser):
        raise KeyboardInterrupt

    parser = argparse.ArgumentParser()
    args = argparse.Namespace(command="plan", verbose=False, run=interrupted)
    assert cli_tools.run_tool(args, parser) == 130
    assert capsys.readouterr().err == "hf-pagedkv plan: interrupted\n"
