"""Quantized KV storage on SmolLM2 / WikiText-2: memory, drift against the unquantized cache, and decode speed.

Drift: every scored token is predicted by a decode step whose whole context is read from the cache under test --
prefill `--prefill` tokens, then `--decode` teacher-forced single-token steps -- and compared with `DynamicCache` on
the same windows (seeded): mean and p99 KL(p_fp || p_quant), top-1 agreement, perplexity of the true next tokens.
Memory: bytes the cache holds at a `--context`-token sequence, relative to the same tokens in fp16
(tokens * layers * 2 * kv_heads * head_dim * 2 bytes; the model itself runs fp32). Speed: decode tokens/s at
`--context` tokens (`--steps` steps after a prefill, best of `--rounds` interleaved rounds). transformers'
`QuantizedCache` (quanto and HQQ, int4, its defaults: residual 128, group 64) runs side by side on the same windows.

    python benchmarks/quant_drift.py                  # 2 windows; ~10 min on 2 CPU cores
    python benchmarks/quant_drift.py --windows 8 --methods k8v8,k8v4,k4v4,quanto-int4
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import torch
from transformers import DynamicCache, QuantizedCache

from eval.caches import bytes_held, release
from eval.config import resolve_data_dir
from eval.tasks.perplexity.metrics import token_kl, token_nll, top1_match
from hf_pagedkv import PagedCache, QuantConfig, cache_kwargs
from hf_pagedkv.tools.models import load_model

DATA = str(resolve_data_dir() / "wikitext-2-raw" / "wiki.test.raw")  # eval/data, or $HF_PAGEDKV_DATA_DIR
PAGED = ["fp", "v8", "k8v8", "k8v4", "k4v4", "k4v2", "k2v2", "k4v16", "k16v4"]  # k4v16 / k16v4: K-only / V-only
# any PAGED name + "-nosink": the same preset with QuantConfig.sink_tokens=0 (the attention-sink ablation)
EXTERNAL = ["quanto-int4", "hqq-int4", "quanto-int2"]
DEFAULT_DRIFT = "v8,k8v8,k8v4,k4v4,k4v2,k2v2,k4v16,k16v4,quanto-int4,hqq-int4"
DEFAULT_SPEED = "dynamic,fp,k8v4,k4v4,quanto-int4,hqq-int4"


def make_cache(method: str, model):
    if method == "dynamic":
        return DynamicCache(config=model.config)
    if method in PAGED:
        return PagedCache(config=model.config, quant=method)
    if method.removesuffix("-nosink") in PAGED:
        return PagedCache(config=model.config, quant=QuantConfig.preset(method.removesuffix("-nosink"), sink_tokens=0))
    backend, bits = method.split("-int")
    return QuantizedCache(backend=backend, config=model.config, nbits=int(bits))


@torch.inference_mode()
def score(model, method: str, window: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits `[decode, vocab]` of decode steps `prefill .. len - 2`, each reading its context from the cache."""
    cache = make_cache(method, model)
    model(window[:, :prefill], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    out = [model(window[:, t: t + 1], **cache_kwargs(cache), use_cache=True).logits[:, -1].float()
           for t in range(prefill, window.shape[1] - 1)]
    release(cache)
    return torch.cat(out)


@torch.inference_mode()
def decode_run(model, method: str, ids: torch.Tensor, context: int, steps: int, clock=time.perf_counter
               ) -> tuple[int, float]:
    """(bytes held after a `context`-token prefill, decode tokens/s over the next `steps` steps, timed by `clock`)."""
    cache = make_cache(method, model)
    model(ids[:, :context], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    held = bytes_held(cache)
    model(ids[:, context: context + 1], **cache_kwargs(cache), use_cache=True)  # warm-up step
    t0 = clock()
    for t in range(context + 1, context + 1 + steps):
        model(ids[:, t: t + 1], **cache_kwargs(cache), use_cache=True)
    seconds = clock() - t0
    release(cache)
    return held, steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=2, help="text windows for the drift measurement")
    parser.add_argument("--prefill", type=int, default=1024, help="tokens prefilled before the scored decode steps")
    parser.add_argument("--decode", type=int, default=256, help="teacher-forced decode steps scored per window")
    parser.add_argument("--methods", default=DEFAULT_DRIFT, help=f"drift methods, from {PAGED + EXTERNAL}")
    parser.add_argument("--speed-methods", default=DEFAULT_SPEED, help="memory/speed methods ('' to skip)")
    parser.add_argument("--context", type=int, default=2048, help="sequence length for memory and speed")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps (QuantizedCache re-quantizes "
                        "its history every 128)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved speed rounds; the best one counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--data", default=DATA, help="text file the windows are cut from (default: WikiText-2 "
                        "test in eval/data)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time decode by wall clock, or by this process's CPU time (steadier on a shared machine; "
                             "use with --threads 1)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model, tokenizer = load_model()
    cfg = model.config
    with open(args.data, encoding="utf-8") as fh:
        ids = tokenizer(fh.read(), return_tensors="pt").input_ids  # the whole file as one string
    rng = random.Random(args.seed)
    span = args.prefill + args.decode + 1
    starts = [rng.randrange(0, ids.shape[1] - max(span, args.context + args.steps + 2)) for _ in range(args.windows)]
    methods = [m for m in args.methods.split(",") if m]
    speed_methods = [m for m in args.speed_methods.split(",") if m]
    rows: dict[str, dict] = {m: {} for m in ["dynamic"] + methods + speed_methods}

    # -- drift ---------------------------------------------------------------------------------------------------
    base, logits_of = [], {m: [] for m in methods}
    for w, start in enumerate(starts):
        window = ids[:, start: start + span]
        base.append(score(model, "dynamic", window, args.prefill))
        for m in methods:
            logits_of[m].append(score(model, m, window, args.prefill))
        print(f"window {w + 1}/{len(starts)} (tokens {start}..{start + span - 1}) done", flush=True)
    if starts:
        targets = torch.cat([ids[:, s + args.prefill + 1: s + span] for s in starts], 1).reshape(-1)
        base_logits = torch.cat(base)
        rows["dynamic"].update(ppl=float(token_nll(base_logits, targets).mean().exp()))
        for m in methods:  # the metric definitions of the eval suite (eval/tasks/perplexity/metrics.py)
            logits = torch.cat(logits_of[m])
            kl = token_kl(base_logits, logits)
            rows[m].update(kl=float(kl.mean()), kl99=float(torch.quantile(kl, 0.99)),
                           top1=float(top1_match(base_logits, logits).double().mean()),
                           ppl=float(token_nll(logits, targets).mean().exp()))

    # -- memory and speed ----------------------------------------------------------------------------------------
    fp16 = args.context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) * 2
    long_ids = ids[:, starts[0]:] if starts else ids
    for _ in range(args.rounds):
        for m in speed_methods:
            held, tps = decode_run(model, m, long_ids, args.context, args.steps, clock)
            rows[m]["mem"] = held / fp16
            rows[m]["tps"] = max(tps, rows[m].get("tps", 0.0))

    # -- one summary table -----------------------------------------------------------------------------------------
    print(f"\nSmolLM2-135M-Instruct (fp32) on WikiText-2 test ({os.path.basename(args.data)}, whole file as one "
          f"string); drift: {len(starts)} windows x {args.decode} decode steps after a {args.prefill}-token prefill, "
          f"seed {args.seed}; memory/speed at {args.context} tokens, {args.steps} steps, best of {args.rounds} "
          f"({args.clock} clock); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads)")
    ppl0 = rows["dynamic"].get("ppl")
    tps_dyn, tps_quanto = rows["dynamic"].get("tps"), rows.get("quanto-int4", {}).get("tps")
    cols = [("method", 12, lambda m, r: m), ("bytes/fp16", 10, lambda m, r: r.get("mem") and f"{r['mem']:.3f}"),
            ("mean KL", 9, lambda m, r: r.get("kl") is not None and f"{r['kl']:.2e}"),
            ("p99 KL", 9, lambda m, r: r.get("kl99") is not None and f"{r['kl99']:.2e}"),
            ("top-1", 7, lambda m, r: r.get("top1") is not None and f"{100 * r['top1']:.2f}%"),
            ("ppl", 7, lambda m, r: r.get("ppl") and f"{r['ppl']:.3f}"),
            ("d ppl", 7, lambda m, r: m != "dynamic" and r.get("ppl") and f"{r['ppl'] - ppl0:+.3f}"),
            ("tok/s", 6, lambda m, r: r.get("tps") and f"{r['tps']:.2f}"),
            ("xDynamic", 8, lambda m, r: r.get("tps") and tps_dyn and f"{r['tps'] / tps_dyn:.2f}"),
            ("xquanto4", 8, lambda m, r: r.get("tps") and tps_quanto and f"{r['tps'] / tps_quanto:.2f}")]
    print("  ".join(f"{name:>{w}s}" if i else f"{name:{w}s}" for i, (name, w, _) in enumerate(cols)))
    for m, r in rows.items():
        if r:
            cells = [get(m, r) or "-" for _, _, get in cols]
            print("  ".join(f"{c:>{w}s}" if i else f"{c:{w}s}" for i, (c, (_, w, _)) in enumerate(zip(cells, cols))))

if __name__ == "__main__":
    main()
