"""Drift of quantization presets, the perplexity task's windows decoded as one batch (a developer probe).

The same windows (`eval.tasks.perplexity.prepare`), prefill and teacher-forced scoring as `python -m eval.drift`, and
the same metrics (mean / p99 KL, top-1 agreement, perplexity change, bytes per token), but every window is one row
of a single batch and the quantized caches are read in place by the ``"hf_pagedkv"`` attention (equal to `sdpa`
over the de-quantized K/V up to fp32 rounding), so a config costs one batched decode instead of one per window.
No greedy continuation and no per-layer K/V error: use `eval.drift` for those.

A config is a preset name (`QuantConfig.preset`), optionally with ``:g<n>`` for another `value_group_size`,
``:s<n>`` for another `sink_tokens` and ``:minmax``, ``:lsq`` or ``:mse`` for another `value_range_fit`
(``k8v4rv:g32``, ``k8v4rv:s4``, ``k8v4rv:minmax``), or ``qc-fp8``: transformers' `QuantizedCache(backend="fp8")`
(per-tensor e4m3, its scale set by the prefill; read by `sdpa`, its bytes counted as `eval.caches.bytes_held` does).

    python benchmarks/dev/batched_drift.py --num-windows 5 --configs k8v4 k8v4r k4v4 k4v4r k8v4rv:g32 qc-fp8
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eval.caches import bytes_held  # noqa: E402
from eval.config import EvalConfig  # noqa: E402
from eval.tasks.perplexity.prepare import load_examples  # noqa: E402
from hf_pagedkv import PagedCache, QuantConfig, cache_kwargs  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402


@torch.inference_mode()
def scored_logits(model, cache, windows: torch.Tensor, prefill_len: int, prefill_kv=None) -> torch.Tensor:
    """Prefill `windows[:, :prefill_len]` `[N, L]`, then feed one token at a time; logits `[N, L - prefill_len - 1,
    vocab]` predicting ``windows[:, prefill_len + 1:]``.

    `prefill_kv` (`[(keys, values)]` per layer, `[N, num_kv_heads, prefill_len, head_dim]`): the prefill's K/V,
    written through `cache.update` layer by layer instead of running the prefill again. NOTE: the same cache state
    as the model's prefill: a prefill attends to its own tokens in full precision in every cache, so every config's
    prefill K/V equal the baseline's."""
    if prefill_kv is None:
        model(input_ids=windows[:, :prefill_len], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    for i, (k, v) in enumerate(prefill_kv or []):  # (an empty list: `cache` holds the prefill already)
        cache.update(k, v, i)
    out = []
    for t in range(prefill_len, windows.shape[1] - 1):
        step = model(input_ids=windows[:, t: t + 1], **cache_kwargs(cache), use_cache=True)
        out.append(step.logits[:, -1].float())
    return torch.stack(out, 1)


def make_cache(name: str, model):
    """A fresh cache for config `name` (see the module docstring) and the attention implementation that reads it."""
    if name == "qc-fp8":
        from transformers import QuantizedCache

        return QuantizedCache(backend="fp8", config=model.config), "sdpa"
    preset, *options = name.split(":")
    fields = {"g": "value_group_size", "s": "sink_tokens"}
    fits = {o for o in options if o in ("minmax", "lsq", "mse")}
    quant = QuantConfig.preset(preset, **{fields[o[0]]: int(o[1:]) for o in options if o not in fits},
                               **{"value_range_fit": fit for fit in fits})
    return PagedCache(config=model.config, quant=quant), "hf_pagedkv"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-windows", type=int, default=5)
    p.add_argument("--prefill-len", type=int, default=1983)
    p.add_argument("--score-len", type=int, default=64)
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model-prefill", action="store_true", help="run each config's prefill through the model "
                   "(default: write the baseline's prefill K/V, the same cache state)")
    p.add_argument("--rotation-seed", type=int, default=0, help="seed of the Hadamard rotation's signs (a noise "
                   "probe: the stored format fixes `ROTATION_SEED`, 0; another seed gives another realization of the "
                   "same quantization error)")
    p.add_argument("--output-dir", default="eval/runs", help="where the run folder is made: "
                   "perplexity-batched-...-<hash>/ with config.yaml, metrics.json (one entry per config, kept across "
                   "runs of the same settings) and predictions.jsonl (per window and config)")
    args = p.parse_args(argv)
    if args.rotation_seed:
        from hf_pagedkv.storage.codecs import rotation

        seeded = rotation.hadamard_rotation  # (looked up by `RotatedCodec.matrix` at each call)
        rotation.hadamard_rotation = lambda dim, seed=args.rotation_seed: seeded(dim, seed)
    torch.set_num_threads(args.threads)
    cfg = EvalConfig(num_windows=args.num_windows, prefill_len=args.prefill_len, score_len=args.score_len)
    model, tokenizer = load_model()
    windows = torch.tensor([w["ids"] for w in load_examples(cfg, tokenizer)])  # [N, prefill + score + 1]
    targets = windows[:, args.prefill_len + 1:]  # [N, score_len]
    settings = {"task": "perplexity", "dataset": cfg.dataset_name, "model": "SmolLM2-135M-Instruct",
                "num_windows": args.num_windows, "prefill_len": args.prefill_len, "score_len": args.score_len,
                "dtype": "float32", "attention": "hf_pagedkv (configs), sdpa (DynamicCache baseline)",
                "value_range_fit": "lsq with rotated values, else minmax",  # the presets' (`QuantConfig.value_fit`)
                **({"rotation_seed": args.rotation_seed} if args.rotation_seed else {})}
    digest = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:6]
    out = Path(args.output_dir) / (f"perplexity-batched-wiki.test-SmolLM2-135M-Instruct-w{args.num_windows}"
                                   f"-p{args.prefill_len}-s{args.score_len}-{digest}")
    out.mkdir(parents=True, exist_ok=True)
    path, preds = out / "metrics.json", out / "predictions.jsonl"
    results = json.loads(path.read_text()) if path.exists() else {}
    (out / "config.yaml").write_text(yaml.safe_dump({**settings, "configs": sorted({*results, *args.configs}),
                                                     "command": "python benchmarks/dev/batched_drift.py "
                                                                + " ".join(sys.argv[1:] if argv is None else argv)},
                                                    sort_keys=False))
    model.set_attn_implementation("sdpa")
    dc = DynamicCache()
    with torch.inference_mode():
        model(input_ids=windows[:, :args.prefill_len], past_key_values=dc, use_cache=True, logits_to_keep=1)
        prefill_kv = [(layer.keys.clone(), layer.values.clone()) for layer in dc.layers]
    base = torch.log_softmax(scored_logits(model, dc, windows, args.prefill_len, prefill_kv=[]).double(), -1)
    base_nll = -base.gather(-1, targets[..., None]).squeeze(-1)  # [N, score_len]
    for name in args.configs:
        t0 = time.time()
        cache, impl = make_cache(name, model)
        model.set_attn_implementation(impl)
        try:
            logits = scored_logits(model, cache, windows, args.prefill_len,
                                   None if args.model_prefill else prefill_kv)
            held = bytes_held(cache) / (windows.shape[0] * (windows.shape[1] - 1))
            fit = cache.pool.quant.value_fit if isinstance(cache, PagedCache) else None
        finally:
            if isinstance(cache, PagedCache):
                cache.release()
            del cache
        logp = torch.log_softmax(logits.double(), -1)
        kl = (base.exp() * (base - logp)).sum(-1).flatten().numpy()  # [N * score_len] nats
        nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
        ppl, ppl0 = math.exp(float(nll.mean())), math.exp(float(base_nll.mean()))
        results[name] = {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
                         "top1": float((logp.argmax(-1) == base.argmax(-1)).double().mean()),
                         "ppl_change": ppl / ppl0 - 1, "bytes_per_token": held,
                         "bytes_vs_fp32": held / (2 * model.config.num_hidden_layers * model.config.num_key_value_heads
                                                  * (model.config.hidden_size // model.config.num_attention_heads) * 4),
                         "value_range_fit": fit, "num_windows": args.num_windows, "prefill_len": args.prefill_len,
                         "score_len": args.score_len}
        print(f"{name:12s} KL {results[name]['kl_mean']:.3e} p99 {results[name]['kl_p99']:.2e} "
              f"top1 {results[name]['top1']:.4f} ppl {results[name]['ppl_change']:+.4%} "
              f"bytes {results[name]['bytes_vs_fp32']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        path.write_text(json.dumps(results, indent=1, sort_keys=True))
        old = [line for line in preds.read_text().splitlines() if json.loads(line)["config"] != name] \
            if preds.exists() else []
        kl_rows = kl.reshape(windows.shape[0], -1)
        new = [json.dumps({"example": i, "config": name, "kl": [round(float(x), 8) for x in kl_rows[i]],
                           "top1": float((logp[i].argmax(-1) == base[i].argmax(-1)).double().mean())})
               for i in range(windows.shape[0])]
        preds.write_text("\n".join(old + new) + "\n")


if __name__ == "__main__":
    main()
