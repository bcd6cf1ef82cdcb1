"""The drift suite end to end on a tiny model and tiny slices of the data in eval/data: zero drift for `fp`, reference
columns, outputs, skipping finished runs, the CLI, and a 2-process sharded run equal to a 1-process run."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

import hf_pagedkv
import hf_pagedkv.tools.cli
from eval import EvalConfig, run
from eval.caches import build, record_writes, release, snapshot, unavailable_reason
from eval.config import PAGED_CONFIGS, resolve
from eval.runner import continue_greedy, decode_teacher_forced, greedy, prefill, teacher_forced_logits
from tests.eval_helpers import DATA_DIR, REPO, tiny_model, tiny_model_dir

SMALL = dict(num_windows=2, prefill_len=64, score_len=16, gen_len=8, qc_group_size=16, qc_residual_length=16,
             data_dir=str(DATA_DIR))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: faster for a tiny model, and the thread count torchrun gives each process."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _cfg(tmp_path, **kw):
    return EvalConfig(**{**SMALL, "model": tiny_model_dir(), "output_dir": str(tmp_path), **kw})


def _available(name, cfg):
    return unavailable_reason(name, cfg, tiny_model()[0].config) is None


def test_teacher_forcing_scores_the_next_tokens():
    """Decoding one token at a time predicts what a full forward pass predicts at the same positions."""
    model, _ = tiny_model()
    window = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    logits = teacher_forced_logits(model, DynamicCache(config=model.config), window, 30)
    assert logits.shape == (9, model.config.vocab_size)
    with torch.inference_mode():
        full = model(window).logits[0, 30:39]
    torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
    want = model.generate(window[:, :30], past_key_values=DynamicCache(config=model.config), max_new_tokens=6,
                          min_new_tokens=6, do_sample=False)[0, 30:].tolist()
    assert greedy(model, DynamicCache(config=model.config), window[:, :30], 6) == want


@pytest.mark.parametrize("name", ["baseline", "fp", "quanto-int4", "hqq-int2"])
def test_greedy_on_a_snapshot_equals_a_fresh_prefill(name, tmp_path):
    """The perplexity pass branches its greedy continuation off the teacher-forced prefill: same tokens as a fresh
    prefill, and the branch neither writes into the original cache nor is recorded."""
    model, _ = tiny_model()
    cfg = _cfg(tmp_path)
    if not _available(name, cfg):
        pytest.skip(f"{name} is not available here")
    window = torch.randint(3, 500, (1, 50), generator=torch.Generator().manual_seed(1))
    fresh = greedy(model, build(name, cfg, model.config), window[:, :40], 9)
    cache = build(name, cfg, model.config)
    written = record_writes(cache)
    last = prefill(model, cache, window[:, :40])
    branch = snapshot(cache)
    assert continue_greedy(model, branch, last, 9) == fresh
    release(branch)
    assert cache.get_seq_length() == 40 and len(written[0]) == 1
    torch.testing.assert_close(decode_teacher_forced(model, cache, window, 40),
                               teacher_forced_logits(model, build(name, cfg, model.config), window, 40),
                               rtol=0, atol=0)


def test_fp_shows_zero_drift_and_writes_the_run(tmp_path):
    configs = ["fp", "k8v4", "k4v4", "quanto-int4", "quanto-int2"]
    cfg = _cfg(tmp_path, configs=configs)
    model, tokenizer = tiny_model()
    m = run(cfg, model, tokenizer)
    fp = m["configs"]["fp"]
    assert fp["status"] == "ok"
    assert (fp["kl_mean"], fp["kl_p99"], fp["kl_max"], fp["top1"], fp["delta_ppl"]) == (0.0, 0.0, 0.0, 1.0, 0.0)
    assert (fp["gen_match"], fp["first_div_mean"], fp["k_err_max"], fp["v_err_max"]) == (1.0, 8.0, 0.0, 0.0)
    assert fp["num_scored_tokens"] == 2 * 16
    # DynamicCache holds 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes per token; PagedCache the same in whole
    # blocks (80 tokens = 5 blocks of 16)
    assert m["baseline"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4 and fp["bytes_ratio"] == 1.0
    k8v4, k4v4 = m["configs"]["k8v4"], m["configs"]["k4v4"]
    # fewer key bits: more key error, fewer bytes; some drift but not much at 8/4 bits
    assert k8v4["status"] == k4v4["status"] == "ok"
    assert 0 < k8v4["k_err_max"] < k4v4["k_err_mean"] and 0 < k8v4["kl_mean"] < 0.1
    assert k4v4["bytes_ratio"] < k8v4["bytes_ratio"] < 1.0
    if _available("quanto-int4", cfg):
        q4, q2 = m["configs"]["quanto-int4"], m["configs"]["quanto-int2"]
        assert 0 < q4["kl_mean"] < q2["kl_mean"] and 0 < q4["k_err_mean"] < q2["k_err_mean"] < 1
        assert q4["top1"] < 1.0 and q2["bytes_ratio"] < q4["bytes_ratio"] < 0.5
    files = sorted(p.name for p in cfg.run_dir().iterdir())
    assert files == ["config.yaml", "drift_vs_bytes.png", "kl_distribution.png", "metrics.json", "per_layer_error.png",
                     "predictions.jsonl", "report.md"]
    lines = [json.loads(x) for x in (cfg.run_dir() / "predictions.jsonl").read_text().splitlines()]
    ran = 1 + sum(c["status"] == "ok" for c in m["configs"].values())
    assert len(lines) == 2 * ran and [x["config"] for x in lines[:2]] == ["baseline", "fp"]
    assert lines[1]["kl"] == [0.0] * 16 and lines[1]["continuation"] == lines[0]["continuation"]
    report = (cfg.run_dir() / "report.md").read_text()
    for name in configs:
        assert f"\n| {name} |" in report
    assert "**KL**: `KL(P_baseline || P_config)" in report and "first divergence" in report


def test_finished_runs_are_skipped_and_the_cli_works(tmp_path, capsys):
    argv = ["--model", tiny_model_dir(), "--num-windows", "1", "--prefill-len", "56", "--score-len", "8",
            "--gen-len", "4", "--configs", "fp", "--data-dir", str(DATA_DIR), "--output-dir", str(tmp_path)]
    assert hf_pagedkv.tools.cli.main(["eval"] + argv) == 0
    out = capsys.readouterr().out
    assert "| fp | 512 | 1.000 |" in out and "run directory:" in out  # 64 tokens: 4 full blocks
    (run_dir,) = tmp_path.iterdir()
    stamp = (run_dir / "metrics.json").stat().st_mtime_ns
    (run_dir / "metrics.json").write_text(json.dumps({"marker": 1}))  # a finished run is read back, not redone
    cfg, _ = resolve(argv)
    assert cfg.run_dir() == run_dir and run(cfg) == {"marker": 1}
    assert (run_dir / "metrics.json").stat().st_mtime_ns != stamp
    assert run(EvalConfig(**{**cfg.to_dict(), "overwrite": True}))["configs"]["fp"]["kl_max"] == 0.0


def test_summarization_fp_matches_baseline(tmp_path):
    cfg = _cfg(tmp_path, task="summarization", num_windows=2, prefill_len=512, gen_len=6,
               configs=["fp", "hqq-int2"])
    m = run(cfg, *tiny_model())
    fp = m["configs"]["fp"]
    assert (fp["rougeL_vs_baseline"], fp["gen_match"], fp["windows_identical"]) == (1.0, 1.0, 2)
    assert fp["rougeL_vs_reference"] == m["baseline"]["rougeL_vs_reference"]
    lines = [json.loads(x) for x in (cfg.run_dir() / "predictions.jsonl").read_text().splitlines()]
    assert lines[0]["config"] == "baseline" and lines[0]["reference"] and lines[0]["query"]
    assert lines[1]["summary"] == lines[0]["summary"]
    if _available("hqq-int2", cfg):
        assert m["configs"]["hqq-int2"]["bytes_ratio"] < 0.5


def test_sharded_run_equals_single_process(tmp_path):
    """torchrun with 2 CPU processes shards the windows; the merged numbers equal a 1-process run exactly."""
    configs = ["fp", "quanto-int4", "hqq-int2"]
    single = run(_cfg(tmp_path / "one", num_windows=3, configs=configs), *tiny_model())
    args = ["--model", tiny_model_dir(), "--num-windows", "3", "--prefill-len", "64", "--score-len", "16",
            "--gen-len", "8", "--qc-group-size", "16", "--qc-residual-length", "16", "--data-dir", str(DATA_DIR),
            "--output-dir", str(tmp_path / "two"), "--configs", *configs]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    # its own session, so that a hang can be ended with the workers torchrun started
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "eval.drift", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    (run_dir,) = (tmp_path / "two").iterdir()
    sharded = json.loads((run_dir / "metrics.json").read_text())
    assert sharded["environment"]["num_processes"] == 2 and single["environment"]["num_processes"] == 1
    for m in (single, sharded):
        m.pop("environment")
    assert sharded == single
    one_dir = next((tmp_path / "one").iterdir())
    assert (run_dir / "predictions.jsonl").read_text() == (one_dir / "predictions.jsonl").read_text()


def test_every_paged_preset_builds_here(tmp_path):
    cfg, config = _cfg(tmp_path), tiny_model()[0].config
    assert {name: unavailable_reason(name, cfg, config) for name in PAGED_CONFIGS} == dict.fromkeys(PAGED_CONFIGS)
    for name in PAGED_CONFIGS:  # and each really builds, quantized as named
        cache = build(name, cfg, config)
        assert type(cache).__name__ == "PagedCache"
        assert cache.pool.quant.name == name and cache.pool.quant.is_quantized == (name != "fp")
        release(cache)


def test_an_interrupted_run_resumes_after_its_last_finished_window(tmp_path, monkeypatch):
    import eval.drift as drift

    model, tokenizer = tiny_model()
    cfg = _cfg(tmp_path / "resumed", num_windows=3, configs=["fp", "hqq-int4"])
    real = drift._perplexity_example
    seen = []

    def flaky(model, tokenizer, cfg, example, names, bar):
        seen.append(example["example"])
        if example["example"] == 2 and len(seen) == 3:
            raise KeyboardInterrupt  # the session ends during the third window
        return real(model, tokenizer, cfg, example, names, bar)

    monkeypatch.setattr(drift, "_perplexity_example", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, model, tokenizer)
    assert sorted(p.name for p in (cfg.run_dir() / "partial").iterdir()) == ["example-00000.pkl", "example-00001.pkl"]
    resumed = run(cfg, model, tokenizer)
    assert seen == [0, 1, 2, 2]  # only the unfinished window ran again
    assert not (cfg.run_dir() / "partial").exists()
    monkeypatch.setattr(drift, "_perplexity_example", real)
    fresh = run(_cfg(tmp_path / "fresh", num_windows=3, configs=["fp", "hqq-int4"]), model, tokenizer)
    for m in (resumed, fresh):
        m.pop("environment")
    assert resumed == fresh
