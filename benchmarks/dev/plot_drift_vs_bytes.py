"""Memory-matched drift plot: mean KL and top-1 agreement against the bytes each config holds, every preset and
anchor of the 20-window SmolLM2 protocol on one figure (a developer probe).

Reads the reference eval run (`python -m eval.drift`: the unrotated presets and the `QuantizedCache` int4/int2
anchors) and the batched run (`benchmarks/dev/batched_drift.py`: rotated presets, the `fp8` anchor) of the same
windows; a config in both is taken from the batched run. Writes ``drift_vs_bytes.png`` into the batched run folder.

    python benchmarks/dev/plot_drift_vs_bytes.py \\
        --reference eval/results/perplexity-wiki.test-SmolLM2-135M-Instruct-w20-p1983-s64-g32-62501b \\
        --batched eval/results/perplexity-batched-wiki.test-SmolLM2-135M-Instruct-w20-p1983-s64-55e5e5
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_pagedkv import QuantConfig  # noqa: E402

logging.getLogger("hf_pagedkv.config").disabled = True  # k4v8 (an ablation of the reference run) warns


def points(reference: Path, batched: Path) -> dict[str, tuple[float, float, float]]:
    """config -> (bytes vs the fp32 baseline, mean KL, top-1)."""
    out = {}
    ref = json.loads((reference / "metrics.json").read_text())
    for name, m in ref["configs"].items():
        if m.get("status") == "ok" and name != "fp":
            out[name] = (m["bytes_ratio"], m["kl_mean"], m["top1"])
    for name, m in json.loads((batched / "metrics.json").read_text()).items():
        out[name] = (m["bytes_vs_fp32"], m["kl_mean"], m["top1"])
    return out


def kind(name: str) -> str:
    """The family a config is drawn in: transformers' QuantizedCache, rotated values, rotated keys, plain."""
    if name.startswith(("quanto", "hqq", "qc-")):
        return "QuantizedCache (transformers)"
    quant = QuantConfig.preset(name.split(":")[0])
    if quant.rotate_values:
        return "hf_pagedkv, rotated values" + (" and keys" if quant.rotate_keys else "")
    return "hf_pagedkv, rotated keys" if quant.rotate_keys else "hf_pagedkv"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", type=Path, required=True)
    p.add_argument("--batched", type=Path, required=True)
    p.add_argument("--max-kl", type=float, default=0.5, help="leave out configs above this mean KL (int2 anchors)")
    p.add_argument("--max-bytes", type=float, default=0.3, help="leave out configs above these bytes (v8)")
    args = p.parse_args(argv)
    from matplotlib.figure import Figure

    pts = {n: v for n, v in points(args.reference, args.batched).items() if v[1] <= args.max_kl and v[0] <= args.max_bytes}
    styles = {"hf_pagedkv": ("tab:blue", "o"), "hf_pagedkv, rotated keys": ("tab:orange", "s"),
              "hf_pagedkv, rotated values and keys": ("tab:green", "D"),
              "hf_pagedkv, rotated values": ("tab:purple", "^"),
              "QuantizedCache (transformers)": ("tab:red", "x")}
    fig = Figure(figsize=(15, 6))
    axes = fig.subplots(1, 2)
    for ax, idx, label, log in ((axes[0], 1, "mean KL(baseline || config) [nats]", True),
                                (axes[1], 2, "top-1 agreement with the baseline [%]", False)):
        for fam, (color, marker) in styles.items():
            sel = [(n, v) for n, v in pts.items() if kind(n) == fam]
            if not sel:
                continue
            ys = [v[idx] * (1 if log else 100) for _, v in sel]
            ax.scatter([v[0] for _, v in sel], ys, color=color, marker=marker, label=fam, zorder=3)
            for (name, v), y in zip(sel, ys):
                ax.annotate(name, (v[0], y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("K/V bytes held, relative to the fp32 DynamicCache")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("SmolLM2-135M-Instruct fp32, WikiText-2, 20 windows of 1,983 + 64 tokens (1,280 scored)",
                 fontsize=9)
    fig.savefig(args.batched / "drift_vs_bytes.png", dpi=110, bbox_inches="tight")
    print(args.batched / "drift_vs_bytes.png")


if __name__ == "__main__":
    main()
