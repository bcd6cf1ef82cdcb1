"""The Markdown report and PNG plots of a drift run, and `load_run` to read a run back (for notebooks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

from . import caches
from .config import EvalConfig
from .data import data_description

PLOTS = {"drift_vs_bytes": "drift_vs_bytes.png", "per_layer_error": "per_layer_error.png",
         "kl_distribution": "kl_distribution.png"}


def load_run(run_dir: str | Path) -> dict:
    """Read a finished run directory.

    Returns:
        `dict` with `config` (the resolved settings), `metrics` (`metrics.json`), `predictions` (the lines of
        `predictions.jsonl`) and `dir` (a `Path`).

    Raises:
        FileNotFoundError: `run_dir` has no `metrics.json` (not a finished run).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a finished eval run (no metrics.json).")
    with open(run_dir / "predictions.jsonl", encoding="utf-8") as fh:
        predictions = [json.loads(line) for line in fh if line.strip()]
    return {"dir": run_dir, "config": yaml.safe_load((run_dir / "config.yaml").read_text()),
            "metrics": json.loads((run_dir / "metrics.json").read_text()), "predictions": predictions}


# -- table -------------------------------------------------------------------------------------------------------------
def _num(x, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _sci(x) -> str:
    return "0" if x == 0 else _num(x, ".2e")


def table(metrics: dict) -> str:
    """The results table (Markdown) of a run's `metrics.json` content: the baseline row, then one row per config."""
    base = metrics["baseline"]
    rows = []
    if metrics["task"] == "perplexity":
        head = ["config", "bytes/token", "×DC", "PPL", "ΔPPL", "ΔPPL %", "KL mean", "KL p95", "KL p99", "top-1",
                "greedy match", "first div mean / median", "K err mean / max", "V err mean / max"]
        rows.append([caches.BASELINE + " (DynamicCache)", _num(base["bytes_per_token"], ",.0f"), "1.000",
                     _num(base["ppl"], ".4f")] + ["—"] * (len(head) - 4))
        for name, m in metrics["configs"].items():
            if m["status"] != "ok":
                rows.append([name, m["status"]] + ["—"] * (len(head) - 2))
                continue
            rows.append([name, _num(m["bytes_per_token"], ",.0f"), _num(m["bytes_ratio"], ".3f"), _num(m["ppl"], ".4f"),
                         f"{m['delta_ppl']:+.4f}", f"{m['delta_ppl_pct']:+.3f}", _sci(m["kl_mean"]), _sci(m["kl_p95"]),
                         _sci(m["kl_p99"]), _num(m["top1"], ".4f"), _num(m["gen_match"], ".3f"),
                         f"{m['first_div_mean']:.1f} / {m['first_div_median']:.0f}",
                         f"{_sci(m['k_err_mean'])} / {_sci(m['k_err_max'])}",
                         f"{_sci(m['v_err_mean'])} / {_sci(m['v_err_max'])}"])
    else:
        head = ["config", "bytes/token", "×DC", "ROUGE-L vs baseline", "ROUGE-L vs ref", "greedy match",
                "first div mean / median", "identical summaries"]
        rows.append([caches.BASELINE + " (DynamicCache)", _num(base["bytes_per_token"], ",.0f"), "1.000", "1.000",
                     _num(base["rougeL_vs_reference"], ".4f"), "—", "—", "—"])
        for name, m in metrics["configs"].items():
            if m["status"] != "ok":
                rows.append([name, m["status"]] + ["—"] * (len(head) - 2))
                continue
            rows.append([name, _num(m["bytes_per_token"], ",.0f"), _num(m["bytes_ratio"], ".3f"),
                         _num(m["rougeL_vs_baseline"], ".4f"), _num(m["rougeL_vs_reference"], ".4f"),
                         _num(m["gen_match"], ".3f"), f"{m['first_div_mean']:.1f} / {m['first_div_median']:.0f}",
                         f"{m['windows_identical']} / {m['num_windows']}"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# -- report ------------------------------------------------------------------------------------------------------------
def write_report(run_dir: Path, cfg: EvalConfig, metrics: dict) -> None:
    """Write `report.md` and the PNG plots into `run_dir` (the plots are skipped without matplotlib)."""
    from .tasks.perplexity.metrics import DEFINITIONS as PPL_DEFINITIONS
    from .tasks.summarization.metrics import DEFINITIONS as SUM_DEFINITIONS

    env = metrics["environment"]
    plots = write_plots(run_dir, metrics)
    lengths = (f"{cfg.num_windows} windows of {cfg.prefill_len} prefill + {cfg.score_len} scored tokens "
               f"(context up to {cfg.prefill_len + cfg.score_len} tokens), greedy continuation {cfg.gen_len} tokens"
               if cfg.task == "perplexity" else
               f"{cfg.num_windows} QMSum queries with prompts of {cfg.prefill_len // 4}..{cfg.prefill_len} tokens, "
               f"summaries up to {cfg.gen_len} tokens")
    names = [caches.BASELINE] + list(cfg.configs)
    text = [
        f"# Drift report: `{run_dir.name}`",
        "",
        f"- Task: **{cfg.task}**; model: `{cfg.model or 'SmolLM2-135M-Instruct (bundled GGUF)'}` ({cfg.dtype}); "
        f"data: {data_description(cfg)}.",
        f"- {lengths}; seed {cfg.seed}; every config against the `DynamicCache` baseline on the same examples.",
        f"- Ran on {env['num_processes']} process(es), {env['device']}, {env['processor']} ({env['cpu_count']} CPUs, "
        f"{env['torch_threads']} torch threads/process), torch {env['torch']}, transformers {env['transformers']}, "
        f"hf_pagedkv {env['hf_pagedkv']}; "
        f"{env['seconds']:.0f} s.",
        f"- Reproduce: `python -m eval.drift --config {run_dir / 'config.yaml'} --overwrite` "
        f"(or `torchrun --nproc_per_node N -m eval.drift ...` to shard the examples).",
        "",
        "<!-- table -->",
        table(metrics),
        "<!-- table -->",
        "",
        "## Configs",
        "",
        *[f"- `{n}`: {caches.describe(n, cfg)}" for n in names],
        "",
        "## Metrics",
        "",
        PPL_DEFINITIONS if cfg.task == "perplexity" else SUM_DEFINITIONS,
        "## Notes",
        "",
        "- `PagedCache` keeps each sequence's last, partial block in full precision and encodes a block once, when "
        "it fills; transformers' `QuantizedCache` keeps a residual window of `qc_residual_length` tokens in full "
        "precision and re-quantizes the whole de-quantized history each time the window flushes.",
        "- A row `not available: ...` is a config this environment could not build (missing backend, or a "
        "hf_pagedkv without quantization); the other rows are unaffected.",
        "",
    ]
    if plots:
        text += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    (run_dir / "report.md").write_text("\n".join(text))


# -- plots -------------------------------------------------------------------------------------------------------------
# NOTE: figures are built with `matplotlib.figure.Figure`, not pyplot, so that writing a report never changes the
# caller's backend or leaks figures (notebooks display the returned figures; `write_plots` saves them).
def _ok(metrics: dict) -> dict[str, dict]:
    return {n: m for n, m in metrics["configs"].items() if m["status"] == "ok"}


def write_plots(run_dir: Path, metrics: dict, predictions: list[dict] | None = None) -> list[str]:
    """Write the run's PNG plots and return their file names ([] without matplotlib)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    if predictions is None and (run_dir / "predictions.jsonl").exists():
        with open(run_dir / "predictions.jsonl", encoding="utf-8") as fh:
            predictions = [json.loads(line) for line in fh if line.strip()]
    written = []
    for key, fn in (("drift_vs_bytes", plot_drift_vs_bytes), ("per_layer_error", plot_per_layer_error),
                    ("kl_distribution", plot_kl_distribution)):
        fig = fn(metrics, predictions or [])
        if fig is not None:
            fig.savefig(run_dir / PLOTS[key], dpi=110, bbox_inches="tight")
            written.append(PLOTS[key])
    return written


def _figure_class():
    from matplotlib.figure import Figure

    return Figure


def plot_drift_vs_bytes(metrics: dict, predictions: list[dict] | None = None):
    """Drift (mean KL and ΔPPL %, or 1 − ROUGE-L vs baseline) against bytes per token held, one point per config."""
    ok = _ok(metrics)
    if not ok:
        return None
    base_bpt = metrics["baseline"]["bytes_per_token"]
    if metrics["task"] == "perplexity":
        panels = [("kl_mean", "mean KL(baseline ‖ config) [nats]", True), ("delta_ppl_pct", "ΔPPL [%]", False)]
    else:
        panels = [("rougeL_vs_baseline", "1 − ROUGE-L vs baseline", True), ("gen_match", "1 − greedy match", True)]
    fig = _figure_class()(figsize=(6 * len(panels), 4.2))
    axes = fig.subplots(1, len(panels))
    for ax, (key, label, log) in zip(np.atleast_1d(axes), panels):
        xs = np.array([m["bytes_per_token"] for m in ok.values()]) / 1024
        ys = np.array([m[key] for m in ok.values()], dtype=float)
        if metrics["task"] != "perplexity":
            ys = 1.0 - ys
        if log:
            pos = ys[ys > 0]
            floor = pos.min() / 10 if len(pos) else 1e-6
            shown = np.where(ys > 0, ys, floor)
            ax.set_yscale("log")
        else:
            shown = ys
        ax.scatter(xs, shown, color="tab:blue", zorder=3)
        for name, x, y, raw in zip(ok, xs, shown, ys):
            ax.annotate(name + (" (0)" if log and raw == 0 else ""), (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        ax.axvline(base_bpt / 1024, color="grey", linestyle="--", linewidth=1)
        ax.text(base_bpt / 1024, ax.get_ylim()[1], " DynamicCache", va="top", fontsize=8, color="grey")
        ax.set_xlabel("KiB of K/V held per token")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"Drift vs memory ({metrics['run']})", fontsize=9)
    return fig


def plot_per_layer_error(metrics: dict, predictions: list[dict] | None = None):
    """Relative K and V reconstruction error per layer, one line per config (configs with zero error omitted)."""
    ok = {n: m for n, m in _ok(metrics).items() if "k_err_per_layer" in m}
    if not ok:
        return None
    fig = _figure_class()(figsize=(12, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    exact = []
    for name, m in ok.items():
        if max(m["k_err_max"], m["v_err_max"]) == 0:
            exact.append(name)
            continue
        for ax, key in zip(axes, ("k_err_per_layer", "v_err_per_layer")):
            errs = np.array(m[key])
            ax.plot(np.arange(len(errs)), np.where(errs > 0, errs, np.nan), marker=".", label=name)
    from matplotlib.ticker import MaxNLocator

    for ax, what in zip(axes, ("keys", "values")):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_title(f"{what}: ‖K̂ − K‖ / ‖K‖" if what == "keys" else f"{what}: ‖V̂ − V‖ / ‖V‖", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("relative reconstruction error")
    if any(line for ax in axes for line in ax.get_lines()):
        axes[1].legend(fontsize=8)
    if exact:
        fig.suptitle(f"exact (error 0): {', '.join(exact)}", fontsize=9)
    return fig


def plot_kl_distribution(metrics: dict, predictions: list[dict]):
    """Empirical CDF of the per-position KL(baseline ‖ config) of each config (zeros drawn at the left edge)."""
    per_config: dict[str, list[float]] = {}
    for line in predictions:
        if "kl" in line:
            per_config.setdefault(line["config"], []).extend(line["kl"])
    if not per_config:
        return None
    fig = _figure_class()(figsize=(7, 4.2))
    ax = fig.subplots()
    positive = [x for v in per_config.values() for x in v if x > 0]
    floor = min(positive) / 10 if positive else 1e-6
    for name, values in per_config.items():
        v = np.sort(np.maximum(np.array(values, dtype=float), floor))
        zero = float(np.mean(np.array(values) == 0))
        ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post",
                label=f"{name}" + (f" ({zero:.0%} exactly 0)" if zero else ""))
    ax.set_xscale("log")
    ax.set_xlabel("KL(baseline ‖ config) per scored position [nats]")
    ax.set_ylabel("fraction of positions ≤ x")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"KL distribution ({metrics['run']})", fontsize=9)
    return fig
