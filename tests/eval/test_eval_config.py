"""EvalConfig layering (defaults < YAML < CLI), validation, data resolution and run-directory naming."""

import dataclasses
import json

import pytest
import yaml

from eval.config import DEFAULT_CONFIGS, EvalConfig, resolve
from eval.data import load_text, resolve_local, tokenize_prefix
from tests.eval_helpers import DATA_DIR, tiny_model


def test_defaults_then_yaml_then_cli(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump({"num_windows": 5, "prefill_len": 4096, "configs": ["fp", "k8v4"], "seed": 3}))
    cfg, _ = resolve([])
    assert (cfg.num_windows, cfg.prefill_len, cfg.configs) == (20, 1792, list(DEFAULT_CONFIGS))
    cfg, _ = resolve(["--config", str(path)])
    assert (cfg.num_windows, cfg.prefill_len, cfg.configs, cfg.seed, cfg.score_len) == (5, 4096, ["fp", "k8v4"], 3, 256)
    # a flag beats the file; settings neither names keep the default
    cfg, _ = resolve(["--config", str(path), "--num-windows", "7", "--configs", "fp,k4v4", "hqq-int2", "--overwrite"])
    assert (cfg.num_windows, cfg.prefill_len, cfg.configs, cfg.overwrite) == (7, 4096, ["fp", "k4v4", "hqq-int2"], True)
    assert cfg.gen_len == 64 and cfg.overwrite is True


@pytest.mark.parametrize("kwargs, match", [
    ({"num_windows": 0}, "num_windows must be a positive int, got 0"),
    ({"prefill_len": "2048"}, "prefill_len must be a positive int"),
    ({"task": "qa"}, "task: 'qa' is not one of perplexity, summarization"),
    ({"configs": ["fp", "int3"]}, "configs: 'int3' is not one of"),
    ({"configs": ["fp", "fp"]}, "names a config twice"),
    ({"configs": []}, "configs is empty"),
    ({"dtype": "float64"}, "dtype: 'float64' is not one of"),
])
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**kwargs)


def test_yaml_unknown_key_is_rejected(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("num_window: 3\n")
    with pytest.raises(SystemExit) as exc:  # argparse's error: usage, the message, exit status 2
        resolve(["--config", str(path)])
    assert exc.value.code == 2
    assert "unknown settings ['num_window']" in capsys.readouterr().err


@pytest.mark.parametrize("content, match", [
    (None, "no such file"),
    ("dir", "a directory"),
    (b"\xff\xfe\x00binary", "not a UTF-8 text file"),
    ("a: [\n", "not valid YAML"),
    ("- 1\n- 2\n", "expected a mapping of settings, got list"),
])
@pytest.mark.parametrize("which", ["drift", "long_context"])
def test_a_config_file_that_is_not_yaml_settings_says_so(tmp_path, capsys, content, match, which):
    from eval.long_context_config import resolve as resolve_long

    path = tmp_path / "settings.yaml"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        (resolve if which == "drift" else resolve_long)(["--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path}: {match}" in err and "Traceback" not in err


def test_a_missing_local_dataset_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # before the model loads, not a traceback from the data loader
        resolve(["--dataset", str(tmp_path / "nope.txt")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "nope.txt'" in err and "no such file" in err and "Traceback" not in err
    cfg, _ = resolve(["--dataset", "wikitext"])  # a `datasets` name is not checked here
    assert cfg.dataset_name == "wikitext"


def test_an_empty_config_file_means_the_defaults(tmp_path):
    from eval.long_context_config import LongContextConfig
    from eval.long_context_config import resolve as resolve_long

    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert resolve(["--config", str(path)])[0] == EvalConfig()
    assert resolve_long(["--config", str(path)])[0] == LongContextConfig()


def test_run_dir_name_follows_the_settings():
    cfg = EvalConfig(num_windows=20, prefill_len=1792, output_dir="out")
    name = cfg.run_dir_name()
    assert name.startswith("perplexity-wiki.test-SmolLM2-135M-Instruct-w20-p1792-s256-g64-")
    assert cfg.run_dir().parent.name == "out"
    # paths and switches do not change the name; anything that changes the numbers does
    assert EvalConfig(output_dir="elsewhere", overwrite=True, data_dir="/d").run_dir_name() == name
    assert EvalConfig(configs=["fp"]).run_dir_name() != name
    assert EvalConfig(qc_group_size=32).run_dir_name() != name
    assert EvalConfig(run_name="mine").run_dir_name() == "mine"
    assert EvalConfig(task="summarization").run_dir_name().startswith("summarization-test-SmolLM2")


def test_data_dir_is_a_setting(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hello world\n" * 10)
    cfg = EvalConfig(dataset="a.txt", data_dir=str(tmp_path))
    assert resolve_local(cfg) == tmp_path / "a.txt"
    assert load_text(cfg) == "hello world\n" * 10
    monkeypatch.setenv("HF_PAGEDKV_DATA_DIR", str(tmp_path))
    assert resolve_local(EvalConfig(dataset="a.txt")) == tmp_path / "a.txt"
    with pytest.raises(ValueError, match="no such file.*--data-dir"):
        resolve_local(EvalConfig(dataset="missing.jsonl", data_dir=str(tmp_path)))


def test_jsonl_rows_are_joined_and_text_field_checked(tmp_path):
    rows = [{"body": "first row"}, {"body": "second row"}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text(EvalConfig(dataset="r.jsonl", data_dir=str(tmp_path), text_field="body")) == \
        "first row\n\nsecond row"
    with pytest.raises(ValueError, match="text_field='text' is not a column"):
        load_text(EvalConfig(dataset="r.jsonl", data_dir=str(tmp_path)))


def test_tokenize_prefix_equals_whole_text_tokenization():
    _, tokenizer = tiny_model()
    text = (DATA_DIR / "wikitext-2-raw" / "wiki.test.raw").read_text()[:60_000]
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    part = tokenize_prefix(text, tokenizer, 1000)
    assert len(part) >= 1000
    assert part == whole[: len(part)]


@pytest.mark.parametrize("which, argv, match", [
    ("drift", ["--num-windows", "0"], "EvalConfig.num_windows must be a positive int"),
    ("long_context", ["--num-windows", "0"], "LongContextConfig.num_windows must be a positive int"),
    ("long_context", ["--task", "bogus"], "LongContextConfig.task must be one of"),
    ("long_context", ["--task", "passkey", "--recent-share", "1.0"], "LongContextConfig.recent_share must be a float"),
    ("long_context", ["--task", "passkey", "--recent-share", "half"], "--recent-share: invalid float value"),
    ("long_context", ["--task", "passkey", "--kv-zip-kernel", "4"], "LongContextConfig.kv_zip_kernel must be odd"),
    ("long_context", ["--task", "passkey", "--kv-zip-kernel", "0"], "LongContextConfig.kv_zip_kernel must be a "),
    ("long_context", ["--task", "passkey", "--kv-zip-pooling", "mean"], "LongContextConfig.kv_zip_pooling must be"),
    ("long_context", ["--task", "passkey", "--kv-zip-recent-share", "1.0"],
     "LongContextConfig.kv_zip_recent_share must be a float"),
    ("long_context", ["--task", "passkey", "--kv-zip-recent-share", "-0.1"],
     "LongContextConfig.kv_zip_recent_share must be a float"),
])
def test_a_setting_out_of_range_on_the_command_line_is_a_usage_error(capsys, which, argv, match):
    from eval.long_context_config import resolve as resolve_long

    with pytest.raises(SystemExit) as exc:
        (resolve if which == "drift" else resolve_long)(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_every_long_context_flag_has_its_docstring_entry_as_help(capsys):
    from eval.long_context_config import LongContextConfig
    from eval.long_context_config import resolve as resolve_long

    with pytest.raises(SystemExit):
        resolve_long(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(LongContextConfig):  # each flag's help starts with its field's entry: name (type...
        assert f"--{f.name.replace('_', '-')}" in flat and f"{f.name} (`" in flat, f.name
    assert "(`KVzipScoring.value_weighted`, VATP)" in flat
    assert "ratios (`list[float]`, defaults to 0.25 0.5 0.75)" in flat


def test_recent_share_is_a_float_flag_and_names_only_the_runs_that_read_it(capsys):
    from eval.long_context_config import resolve as resolve_long

    def refused(extra, setting, readers):  # a setting no chosen method reads: a usage error, not silently ignored
        with pytest.raises(SystemExit):
            resolve_long(extra)
        err = capsys.readouterr().err
        assert f"{setting} set, but none of the methods" in err and f"one of {readers}" in err, err
        assert ("use --task passkey" in err) == ("--task" in extra and "perplexity" in extra), err

    argv = ["--task", "passkey", "--methods", "full", "kv_zip", "--contexts", "1024", "--num-keys", "1"]
    cfg, _ = resolve_long(argv)
    assert cfg.recent_share == 0.5  # the default
    # a run without kv_zip_recent refuses another share; the default is fine (and keeps the runs' names from before)
    refused(argv + ["--recent-share", "0.25"], "recent_share=0.25", "['kv_zip_recent']")
    assert resolve_long(argv + ["--recent-share", "0.5"])[0].run_dir() == cfg.run_dir()
    recent = argv + ["--methods", "full", "kv_zip", "kv_zip_recent"]
    a, b = resolve_long(recent)[0], resolve_long(recent + ["--recent-share", "0.25"])[0]
    assert b.recent_share == 0.25 and a.run_dir() != b.run_dir() != cfg.run_dir()
    refused(argv + ["--kv-zip-kernel", "3"], "kv_zip_kernel=3", "['kv_zip_pooled', 'kv_zip_global']")  # the kernel
    pooled = argv + ["--methods", "full", "kv_zip", "kv_zip_pooled"]
    c, d = resolve_long(pooled)[0], resolve_long(pooled + ["--kv-zip-kernel", "3"])[0]
    assert (c.kv_zip_kernel, d.kv_zip_kernel) == (7, 3) and c.run_dir() != d.run_dir() != cfg.run_dir()
    # the pooling: max (the default) keeps the names of the runs from before it; avg names its own
    e, f = resolve_long(pooled + ["--kv-zip-pooling", "max"])[0], resolve_long(pooled + ["--kv-zip-pooling", "avg"])[0]
    assert (c.kv_zip_pooling, f.kv_zip_pooling) == ("max", "avg") and e.run_dir() == c.run_dir() != f.run_dir()
    refused(argv + ["--kv-zip-pooling", "avg"], "kv_zip_pooling='avg'", "['kv_zip_pooled', 'kv_zip_global']")
    # kv_zip_pooled's recent share: 0 (the default) keeps the names of the runs from before it; a share names its own
    g, h = resolve_long(pooled + ["--kv-zip-recent-share", "0"])[0], resolve_long(
        pooled + ["--kv-zip-recent-share", "0.25"])[0]
    assert (c.kv_zip_recent_share, h.kv_zip_recent_share) == (0, 0.25) and g.run_dir() == c.run_dir() != h.run_dir()
    refused(recent + ["--kv-zip-recent-share", "0.25"], "kv_zip_recent_share=0.25",
            "['kv_zip_pooled', 'kv_zip_global']")
    refused(pooled + ["--kv-zip-safeguard", "0.2"], "kv_zip_safeguard=0.2", "['kv_zip_global']")  # global's only
    assert resolve_long(argv + ["--methods", "kv_zip_global", "--kv-zip-safeguard", "0.2"])[0].kv_zip_safeguard == 0.2
    # the newer flags, and the perplexity task (whose methods read none of them): every unread setting is named
    refused(argv + ["--kv-zip-share-heads", "--kv-zip-value-weighted"],
            "kv_zip_share_heads=True, kv_zip_value_weighted=True", "['kv_zip_pooled', 'kv_zip_global']")
    refused(["--task", "perplexity", "--kv-zip-value-weighted"], "kv_zip_value_weighted=True",
            "['kv_zip_pooled', 'kv_zip_global']")
    refused(argv + ["--kv-zip-value-weighted", "--kv-zip-value-power", "2"],
            "kv_zip_value_weighted=True, kv_zip_value_power=2.0", "['kv_zip_pooled', 'kv_zip_global']")
    squared = pooled + ["--kv-zip-value-weighted", "--kv-zip-value-power"]
    assert resolve_long(squared + ["2"])[0].kv_zip_value_power == 2.0
    assert resolve_long(squared + ["1"])[0].run_dir() == resolve_long(squared[:-1])[0].run_dir()  # 1: the default


def test_every_committed_long_context_run_rebuilds_its_directory_name_from_its_config():
    """A setting added to `LongContextConfig` must leave the committed runs' names as they are (at its default it stays
    out of the name), or the docs' run directories stop matching what the eval would write."""
    from pathlib import Path

    from eval.long_context_config import LongContextConfig

    runs = sorted((Path(__file__).resolve().parents[2] / "eval" / "results").glob("long-*/config.yaml"))
    assert runs, "no committed long-context run under eval/results/"
    for path in runs:
        settings = {**yaml.safe_load(path.read_text()), "output_dir": "eval/results"}
        assert LongContextConfig(**settings).run_dir().name == path.parent.name, path


def test_the_committed_runs_are_exactly_the_runs_the_docs_cite():
    """Every run directory named in README.md or docs/*.md is committed under eval/results/, and every committed run
    is named there: a run no doc cites does not belong in the repository, and a doc must not cite a missing run."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    cited = set(re.findall(r"(?<![\w-])((?:long|perplexity)-[\w.]+(?:-[\w.]+)*-[0-9a-f]{6})\b", text))
    committed = {p.name for p in (root / "eval" / "results").iterdir() if p.is_dir()}
    assert cited, "the docs cite no eval run"
    assert sorted(cited - committed) == [], "cited in the docs but not under eval/results/"
    assert sorted(committed - cited) == [], "committed under eval/results/ but cited by no doc: cite it or git rm it"
    for name in committed:  # what a run directory holds
        files = {p.name for p in (root / "eval" / "results" / name).iterdir()}
        assert {"config.yaml", "metrics.json", "predictions.jsonl"} <= files, name
