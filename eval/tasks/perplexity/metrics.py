"""Drift metrics of the perplexity task: per-window raw values (`window_values`), then one exact reduction (`reduce`).

Everything is reduced from raw per-position / per-window values gathered from all processes, so a run sharded
over N processes gives the same numbers as one process. Definitions are in `DEFINITIONS` (copied into each report).
"""

from __future__ import annotations

import math

import numpy as np
import torch

DEFINITIONS = """\
- **Perplexity (PPL)**: `exp(mean NLL)` over every scored token of every window, where the NLL of token `t` is
  `-log softmax(logits_t)[x_t]` (nats). Each window prefills `prefill_len` tokens, then feeds `score_len` tokens
  one at a time through the cache under test (teacher forcing); each of those decode steps predicts the next
  token, so every scored prediction reads its context through the cache (not through one big prefill).
  **ΔPPL** = PPL(config) − PPL(baseline), also given in % of the baseline.
- **KL**: `KL(P_baseline || P_config) = Σ_v p_b(v) (log p_b(v) − log p_c(v))` in nats, per scored position, computed
  in float64 from the two runs' logits at the same position; reported as mean, p95 and p99 over all scored
  positions of all windows (numpy's linear-interpolation quantiles).
- **Top-1**: fraction of scored positions where the config's argmax token equals the baseline's.
- **Greedy match / first divergence**: both caches greedily continue the prefill for `gen_len` tokens; match rate
  is the fraction of positions `i` with the same token (position by position, over the longer of the two), first
  divergence is the first `i` where they differ (`gen_len` when they never do), mean and median over windows.
- **K err / V err**: per layer, `‖K̂ − K‖_F / ‖K‖_F` where `K` are the keys the model wrote into the cache during the
  teacher-forced pass and `K̂` what the cache gives back for them (de-quantized), pooled over windows as
  `sqrt(Σ ‖K̂ − K‖² / Σ ‖K‖²)`; the table shows the mean and the max over layers (same for values).
- **Bytes/token**: bytes of K/V storage the cache holds after the teacher-forced pass, divided by the tokens it
  holds (`prefill_len + score_len`): `PagedCache` counts whole blocks (`pool.stats().bytes_in_use`: codes, scales
  and full-precision partial blocks), `QuantizedCache` its packed codes, scales, zero points and residual window,
  `DynamicCache` its tensors. **×DC** is that over the baseline's bytes/token.
"""


def token_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """`log softmax` in float64 of `[positions, vocab]` logits."""
    return torch.log_softmax(logits.double(), dim=-1)


def token_kl(base_logits: torch.Tensor, cfg_logits: torch.Tensor) -> torch.Tensor:
    """`KL(P_base || P_cfg)` in nats per position, float64 `[positions]`; exactly 0 where the logits are equal."""
    lp, lq = token_log_probs(base_logits), token_log_probs(cfg_logits)
    return (lp.exp() * (lp - lq)).sum(-1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood in nats of `targets` `[positions]` under `logits` `[positions, vocab]`, float64."""
    return -token_log_probs(logits).gather(-1, targets.reshape(-1, 1).to(logits.device)).squeeze(-1)


def top1_match(base_logits: torch.Tensor, cfg_logits: torch.Tensor) -> torch.Tensor:
    """Whether the argmax tokens agree, bool `[positions]`."""
    return base_logits.argmax(-1) == cfg_logits.argmax(-1)


def greedy_agreement(base_tokens: list[int], cfg_tokens: list[int]) -> tuple[float, int]:
    """`(match_rate, first_divergence)` of two greedy continuations.

    Positions are compared one by one over the longer continuation (a missing token is a mismatch); the first
    divergence is the first mismatching position, or the length when the two are identical.
    """
    n = max(len(base_tokens), len(cfg_tokens))
    if n == 0:
        return 1.0, 0
    same = [i < len(base_tokens) and i < len(cfg_tokens) and base_tokens[i] == cfg_tokens[i] for i in range(n)]
    first = same.index(False) if False in same else n
    return sum(same) / n, first


def error_terms(written: torch.Tensor, read: torch.Tensor) -> tuple[float, float]:
    """`(‖read − written‖², ‖written‖²)` in float64 for one layer's keys or values `[batch, heads, seq, head_dim]`.

    When the cache gives back fewer tokens than were written (a sliding-window layer of `DynamicCache` keeps only
    its window), the last `read.shape[-2]` written tokens are compared.
    """
    written = written[..., written.shape[-2] - read.shape[-2]:, :].double()
    return float((read.double() - written).pow(2).sum()), float(written.pow(2).sum())


def quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else math.nan


def reduce(records: list[dict], baseline: list[dict]) -> dict:
    """Metrics of one config from its per-window records and the baseline's (same windows).

    Args:
        records (`list[dict]`): one per window, from `eval.drift` (keys `nll`, `kl`, `top1`, `gen`, `gen_match`,
            `first_div`, `k_sq_err`, `k_sq_ref`, `v_sq_err`, `v_sq_ref`, `bytes`, `tokens`), sorted by window.
        baseline (`list[dict]`): the baseline's records of the same windows.

    Returns:
        `dict` of floats and per-layer lists (see `DEFINITIONS`).
    """
    nll = np.concatenate([r["nll"] for r in records])
    base_nll = np.concatenate([r["nll"] for r in baseline])
    kl = np.concatenate([r["kl"] for r in records])
    top1 = np.concatenate([r["top1"] for r in records]).astype(np.float64)
    ppl, base_ppl = math.exp(nll.mean()), math.exp(base_nll.mean())
    first = np.array([r["first_div"] for r in records], dtype=np.float64)
    per_layer = {}
    for kv in ("k", "v"):
        err = np.sum([r[f"{kv}_sq_err"] for r in records], axis=0)
        ref = np.sum([r[f"{kv}_sq_ref"] for r in records], axis=0)
        per_layer[kv] = np.sqrt(err / np.maximum(ref, np.finfo(np.float64).tiny))
    bytes_per_token = sum(r["bytes"] for r in records) / sum(r["tokens"] for r in records)
    base_bytes_per_token = sum(r["bytes"] for r in baseline) / sum(r["tokens"] for r in baseline)
    return {
        "num_windows": len(records),
        "num_scored_tokens": int(len(nll)),
        "ppl": ppl,
        "ppl_baseline": base_ppl,
        "delta_ppl": ppl - base_ppl,
        "delta_ppl_pct": 100.0 * (ppl - base_ppl) / base_ppl,
        "kl_mean": float(kl.mean()),
        "kl_p95": quantile(kl, 0.95),
        "kl_p99": quantile(kl, 0.99),
        "kl_max": float(kl.max()),
        "top1": float(top1.mean()),
        "gen_match": float(np.mean([r["gen_match"] for r in records])),
        "first_div_mean": float(first.mean()),
        "first_div_median": float(np.median(first)),
        "windows_identical": int(sum(r["first_div"] == len(r["gen"]) and r["gen_match"] == 1.0 for r in records)),
        "k_err_per_layer": per_layer["k"].tolist(),
        "v_err_per_layer": per_layer["v"].tolist(),
        "k_err_mean": float(per_layer["k"].mean()),
        "k_err_max": float(per_layer["k"].max()),
        "v_err_mean": float(per_layer["v"].mean()),
        "v_err_max": float(per_layer["v"].max()),
        "bytes_per_token": bytes_per_token,
        "bytes_ratio": bytes_per_token / base_bytes_per_token,
    }


def reduce_baseline(baseline: list[dict]) -> dict:
    """The baseline's own row: its perplexity and bytes per token."""
    nll = np.concatenate([r["nll"] for r in baseline])
    bpt = sum(r["bytes"] for r in baseline) / sum(r["tokens"] for r in baseline)
    return {"num_windows": len(baseline), "num_scored_tokens": int(len(nll)), "ppl": math.exp(nll.mean()),
            "bytes_per_token": bpt, "bytes_ratio": 1.0}
