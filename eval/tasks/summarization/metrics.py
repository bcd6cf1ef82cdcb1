"""Drift metrics of the summarisation task: ROUGE-L against the baseline's summary and the reference."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

DEFINITIONS = """\
- **Summaries**: each QMSum query's prompt (its relevant transcript turns + the query, in the model's chat
  template) is prefilled and the summary generated greedily (argmax) through the cache, up to `gen_len` tokens or
  the end-of-sequence token.
- **ROUGE-L vs baseline**: ROUGE-L F1 (longest common subsequence of words, Porter stemming; Google's `rouge-score`
  package, which `evaluate`'s `rouge` wraps) of the config's summary against the baseline's summary; 1.0 when
  they are the same text. **ROUGE-L vs ref**: against QMSum's reference answer (the baseline row shows its own).
  Means over examples.
- **Greedy match / first divergence**: the summaries' tokens compared position by position (see the perplexity
  task), mean over examples.
- **Bytes/token**: K/V bytes the cache holds after generating, divided by the tokens it holds.
"""


@lru_cache(maxsize=1)
def _scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError as exc:
        from hf_pagedkv.errors import install_hint

        raise ImportError(f"task=summarization needs rouge-score: {install_hint('eval', repr('rouge-score>=0.1.2'))}"
                          ) from exc
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 of `prediction` against `reference` (0.0 when either has no words)."""
    return float(_scorer().score(reference, prediction)["rougeL"].fmeasure)


def reduce(records: list[dict], baseline: list[dict]) -> dict:
    """Metrics of one config from its per-example records (keys `rougeL_vs_baseline`, `rougeL_vs_reference`,
    `gen_match`, `first_div`, `bytes`, `tokens`), sorted by example."""
    first = np.array([r["first_div"] for r in records], dtype=np.float64)
    bpt = sum(r["bytes"] for r in records) / sum(r["tokens"] for r in records)
    base_bpt = sum(r["bytes"] for r in baseline) / sum(r["tokens"] for r in baseline)
    return {
        "num_windows": len(records),
        "rougeL_vs_baseline": float(np.mean([r["rougeL_vs_baseline"] for r in records])),
        "rougeL_vs_reference": float(np.mean([r["rougeL_vs_reference"] for r in records])),
        "gen_match": float(np.mean([r["gen_match"] for r in records])),
        "first_div_mean": float(first.mean()),
        "first_div_median": float(np.median(first)),
        "windows_identical": int(sum(r["gen_match"] == 1.0 for r in records)),
        "bytes_per_token": bpt,
        "bytes_ratio": bpt / base_bpt,
    }


def reduce_baseline(baseline: list[dict]) -> dict:
    bpt = sum(r["bytes"] for r in baseline) / sum(r["tokens"] for r in baseline)
    return {"num_windows": len(baseline), "rougeL_vs_reference": float(np.mean([r["rougeL_vs_reference"]
                                                                                 for r in baseline])),
            "bytes_per_token": bpt, "bytes_ratio": 1.0}
