"""`eval.long_context` on a tiny random model: the run directory, the metrics it reduces, the passkey generator."""

from __future__ import annotations

import json
import math

import pytest

from eval.long_context import policy_for, report_text, run, scored_chunks
from eval.long_context_config import LongContextConfig
from eval.tasks.passkey import metrics as passkey_metrics
from eval.tasks.passkey.prepare import make_examples
from tests.eval_helpers import DATA_DIR, tiny_model


@pytest.fixture(scope="module")
def tiny(one_thread):
    return tiny_model()


def test_streaming_perplexity_run(tiny, tmp_path):
    model, tokenizer = tiny
    cfg = LongContextConfig(num_windows=1, context_len=320, budgets=[96], chunk=32, score_stride=2, recent_tokens=16,
                            data_dir=str(DATA_DIR), output_dir=str(tmp_path))
    assert scored_chunks(cfg, 96) == [96, 160, 224]  # after the budget, every 2nd chunk with a next token
    metrics = run(cfg, model, tokenizer)
    row = metrics["perplexity"]["96"]
    assert set(row) == {"full", "sink_window", "window_only", "key_norm", "key_diff", "recompute"}
    assert all(m["scored_tokens"] == 96 and math.isfinite(m["ppl"]) for m in row.values())
    assert row["full"]["tokens_held"] == 320 and row["sink_window"]["tokens_held"] <= 96 + 32 + 15
    assert row["key_norm"]["bytes_in_use"] < row["full"]["bytes_in_use"] / 2  # the evicted blocks were freed
    assert len({round(m["ppl"], 6) for m in row.values()}) > 1
    run_dir = cfg.run_dir()
    assert {p.name for p in run_dir.iterdir()} >= {"config.yaml", "predictions.jsonl", "metrics.json", "report.md"}
    assert "| 96 | sink_window |" in (run_dir / "report.md").read_text()
    assert json.loads((run_dir / "metrics.json").read_text()) == run(cfg)  # a finished run is read back, not redone


def test_memory_matched_columns(tiny, tmp_path):
    model, tokenizer = tiny
    cfg = LongContextConfig(num_windows=1, context_len=256, budgets=[96], chunk=32, score_stride=2, recent_tokens=16,
                            methods=["full", "key_diff", "recompute"], quants=["fp", "k8v4"], data_dir=str(DATA_DIR),
                            output_dir=str(tmp_path))
    row = run(cfg, model, tokenizer)["perplexity"]["96"]
    assert list(row) == ["full", "key_diff", "recompute", "full+k8v4", "key_diff+k8v4"]
    assert row["key_diff+k8v4"]["bytes_in_use"] < row["key_diff"]["bytes_in_use"] < row["full"]["bytes_in_use"]
    assert row["full+k8v4"]["bytes_in_use"] < row["full"]["bytes_in_use"]
    assert "Memory-matched" in (cfg.run_dir() / "report.md").read_text()
    with pytest.raises(ValueError, match="k9"):
        LongContextConfig(quants=["k9"])


def test_passkey_examples_and_run(tiny, tmp_path):
    model, tokenizer = tiny
    cfg = LongContextConfig(task="passkey", methods=["full", "sink_window", "key_norm", "snap_kv", "kv_zip",
                                                     "kv_zip_recent", "kv_zip_pooled"],
                            contexts=[256],
                            depths=[10, 90], ratios=[0.5], num_keys=2, recent_tokens=16, data_dir=str(DATA_DIR),
                            output_dir=str(tmp_path))
    from eval.config import EvalConfig
    from eval.data import load_text

    text = load_text(EvalConfig(data_dir=str(DATA_DIR)))
    examples = make_examples(cfg, tokenizer, text)
    assert len(examples) == 4 and examples == make_examples(cfg, tokenizer, text)  # seeded
    for ex in examples:
        context = tokenizer.decode(ex["context_ids"])
        assert f"The pass key is {ex['key']}." in context and abs(len(ex["context_ids"]) - 256) <= 2
        at = context.index("The pass key")
        assert (at / len(context) < 0.3) == (ex["depth"] == 10)
    assert passkey_metrics.is_correct(" 12345. The", 12345) and not passkey_metrics.is_correct(" 1234", 12345)
    before = model.config._attn_implementation
    metrics = run(cfg, model, tokenizer)
    assert model.config._attn_implementation == before  # snap_kv's "hf_pagedkv" attention was only for the run
    assert set(metrics["passkey"]) == {"full", "sink_window@0.5", "key_norm@0.5", "snap_kv@0.5", "kv_zip@0.5",
                                       "kv_zip_recent@0.5", "kv_zip_pooled@0.5"}
    assert all(0 <= m["accuracy"] <= 1 and m["examples"] == 4 for m in metrics["passkey"].values())
    records = [json.loads(line) for line in open(cfg.run_dir() / "predictions.jsonl")]
    full = [r for r in records if r["method"] == "full"]
    snap = [r for r in records if r["method"] == "snap_kv"]
    # every method attached to the shared context and compressed all of it before the question
    assert all(r["tokens_held"] == len(ex["context_ids"]) + len(ex["question_ids"]) for r, ex in zip(full, examples))
    assert all(r["tokens_held"] == int(len(ex["context_ids"]) * 0.5) + len(ex["question_ids"])
               for r, ex in zip(snap, examples))
    assert all(s["bytes_in_use"] < f["bytes_in_use"] for s, f in zip(snap, full))
    zipped = [r for r in records if r["method"] == "kv_zip"]  # compressed by its reconstruction pass, then the question
    assert all(r["tokens_held"] == int(len(ex["context_ids"]) * 0.5) + len(ex["question_ids"])
               for r, ex in zip(zipped, examples))
    assert all(z["bytes_in_use"] == s["bytes_in_use"] for z, s in zip(zipped, snap))  # the same budget's blocks
    for variant in ("kv_zip_recent", "kv_zip_pooled"):  # H2O's split, pooled scores: the same budget, other tokens
        split = [r for r in records if r["method"] == variant]
        assert [(r["tokens_held"], r["bytes_in_use"]) for r in split] == [(r["tokens_held"], r["bytes_in_use"])
                                                                           for r in zipped]
    assert policy_for("kv_zip_recent", cfg, ratio=0.5, context=256).recent_share == cfg.recent_share == 0.5
    pooled = policy_for("kv_zip_pooled", cfg, ratio=0.5, context=256)
    settings = pooled.settings
    assert (settings.kernel_size, settings.pooling) == (cfg.kv_zip_kernel, cfg.kv_zip_pooling) == (7, "max")
    avg = LongContextConfig(**{**cfg.to_dict(), "kv_zip_pooling": "avg"})
    assert policy_for("kv_zip_pooled", avg, ratio=0.5, context=256).settings.pooling == "avg"
    assert "kv_zip_pooled: kernel 7, avg-pooling" in report_text(avg, {"environment": {"seconds": 1.0}, "passkey": {}})
    assert pooled.recent_share == cfg.kv_zip_recent_share == 0  # by default the pooled scores choose alone
    split = LongContextConfig(**{**cfg.to_dict(), "kv_zip_recent_share": 0.25})
    split_pooled = policy_for("kv_zip_pooled", split, ratio=0.5, context=256)
    assert (split_pooled.recent_share, split_pooled.settings.kernel_size, split_pooled.settings.pooling) == (
        0.25, 7, "max")
    assert policy_for("kv_zip_recent", split, ratio=0.5, context=256).recent_share == 0.5  # its own share
    assert "kv_zip_pooled: kernel 7, recent share 0.25" in report_text(split, {"environment": {"seconds": 1.0},
                                                                               "passkey": {}})
    shared = LongContextConfig(**{**cfg.to_dict(), "kv_zip_share_heads": True})
    assert policy_for("kv_zip_global", shared, ratio=0.5, context=256).settings.share_heads
    assert not policy_for("kv_zip_global", cfg, ratio=0.5, context=256).settings.share_heads
    assert shared.run_dir() != cfg.run_dir()  # a new setting, and the runs before it keep their names
    assert "heads share their tokens" in report_text(shared, {"environment": {"seconds": 1.0}, "passkey": {}})
    with pytest.raises(ValueError, match="kv_zip_share_heads"):
        LongContextConfig(**{**cfg.to_dict(), "kv_zip_share_heads": "yes"})
    weighted = LongContextConfig(**{**cfg.to_dict(), "kv_zip_value_weighted": True})
    assert policy_for("kv_zip_global", weighted, ratio=0.5, context=256).settings.value_weighted
    assert policy_for("kv_zip_pooled", weighted, ratio=0.5, context=256).settings.value_weighted
    assert not policy_for("kv_zip_global", cfg, ratio=0.5, context=256).settings.value_weighted
    assert weighted.run_dir() != cfg.run_dir()  # a new setting, and the runs before it keep their names
    assert "scores weighted by value norms" in report_text(weighted, {"environment": {"seconds": 1.0},
                                                                      "passkey": {}})
    with pytest.raises(ValueError, match="kv_zip_value_weighted"):
        LongContextConfig(**{**cfg.to_dict(), "kv_zip_value_weighted": 1})
    squared = LongContextConfig(**{**weighted.to_dict(), "kv_zip_value_power": 2.0})
    assert policy_for("kv_zip_global", squared, ratio=0.5, context=256).settings.value_power == 2.0
    assert policy_for("kv_zip_global", weighted, ratio=0.5, context=256).settings.value_power == 1.0
    assert squared.run_dir() != weighted.run_dir()  # and at 1 the runs before it keep their names
    assert "value norms to the power 2.0" in report_text(squared, {"environment": {"seconds": 1.0}, "passkey": {}})
    for bad in (0, -2.0, float("nan"), True, 9.0):
        with pytest.raises(ValueError, match=r"kv_zip_value_power \(--kv-zip-value-power\) must be a number in"):
            LongContextConfig(**{**weighted.to_dict(), "kv_zip_value_power": bad})
    with pytest.raises(ValueError, match="set kv_zip_value_weighted"):  # the exponent of a weighting that is off
        LongContextConfig(**{**cfg.to_dict(), "kv_zip_value_power": 2.0})
    plain = policy_for("kv_zip", cfg, ratio=0.5, context=256)
    assert (plain.recent_share, plain.settings.kernel_size) == (0, 1)
    assert "kv_zip_recent: recent share 0.5; kv_zip_pooled: kernel 7" in (cfg.run_dir() / "report.md").read_text()
    assert "kvpress's convention" in (cfg.run_dir() / "report.md").read_text()
    inside = LongContextConfig(**{**cfg.to_dict(), "question_in_prompt": True, "methods": ["full", "snap_kv"]})
    assert "-qin-" in inside.run_dir().name and "-qin-" not in cfg.run_dir().name
    run(inside, model, tokenizer)
    records = [json.loads(line) for line in open(inside.run_dir() / "predictions.jsonl")]
    for r, ex in zip([r for r in records if r["method"] == "snap_kv"], examples):  # the question compressed too
        assert r["tokens_held"] == int((len(ex["context_ids"]) + len(ex["question_ids"])) * 0.5)
