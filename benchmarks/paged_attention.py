"""Decode speed of the ``"hf_pagedkv"`` attention (reads blocks and codes in place) against `DynamicCache`, SmolLM2.

    python benchmarks/paged_attention.py --threads 1                       # 2048 and 4096 tokens, batch 1 and 8
    python benchmarks/paged_attention.py --lengths 2048 --batches 1 --rounds 1 --steps 4     # a smoke run
    python benchmarks/paged_attention.py --profile --lengths 2048 --batches 1  # where the time goes, per case
    python benchmarks/paged_attention.py --methods k8v4,k4v4 --compiled    # + "hf_pagedkv_compiled" rows
    python benchmarks/paged_attention.py --paired --steps 16               # all caches live, step by step in turn

Every case runs in one process, side by side: the bundled SmolLM2-135M (fp32) decodes `--steps` greedy steps
(`model(next_token, cache)`) after one warm-up step, from the K/V of one untimed prefill of random tokens (rows
beyond the first are that prompt's K/V plus 1% noise; see `prompt_kv`), written into each case's cache layer by
layer as a prefill step writes them. Cases: `DynamicCache`
with `sdpa` (the baseline); `PagedCache` fp / k8v8 / k8v4 / k4v4 with `sdpa` (materialized reads) and with
``"hf_pagedkv"`` (in-place reads); transformers' `QuantizedCache` (quanto int4) when optimum-quanto is installed.
The order of the cases is shuffled in every round (the machine is shared and noisy); times are this process's CPU
time (`time.process_time`) per step, the median over the rounds is reported, as tokens/s relative to `DynamicCache`.
`--paired` instead keeps every case's cache live at once and runs one decode step of each in turn (a shuffled order
per step), `--steps` times: each case's ratio is the median over the steps of (`DynamicCache`'s step / its step in
the same turn), so a slow minute on the shared machine hits every case alike.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import random
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from hf_pagedkv import PagedCache, cache_kwargs
from hf_pagedkv.tools.models import load_model
from step_clock import clock, use_device  # beside this script

QUANTO = importlib.util.find_spec("optimum.quanto") is not None if importlib.util.find_spec("optimum") else False


def make_cache(method: str, model):
    if method == "dynamic":
        return DynamicCache(config=model.config)
    if method == "quanto-int4":
        from transformers import QuantizedCache

        return QuantizedCache(backend="quanto", config=model.config, nbits=4)
    quant = method.split("/")[0]
    return PagedCache(config=model.config, quant=None if quant == "fp" else quant)


def prefill(model, x: torch.Tensor) -> list:
    """The prompt's K/V per layer, `[1, num_kv_heads, len, head_dim]` each (one model prefill)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, **cache_kwargs(cache))
    return [(layer.keys, layer.values) for layer in cache.layers]


def prompt_kv(kv: list, n: int, batch: int, seed: int) -> list:
    """The first `n` tokens of the prompt's K/V for `batch` rows. NOTE: row 0 is the model's; the other rows add
    1% noise to it (a shortcut: one prefill instead of `batch`, and decode time does not depend on the values;
    the rows differ, so PagedCache stores each one, as for distinct prompts)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, v in kv:
        k, v = k[:, :, :n], v[:, :, :n]
        noise = [torch.randn((batch - 1, *k.shape[1:]), generator=g).to(k.device) for _ in range(2)]
        out.append((torch.cat([k, k + 0.01 * k.std() * noise[0]]), torch.cat([v, v + 0.01 * v.std() * noise[1]])))
    return out


def run_case(model, method: str, kv: list, tok: torch.Tensor, steps: int, profile: bool = False) -> tuple[float, str]:
    """CPU seconds per decode step (and a profile text when asked), from the prompt's K/V written into a new cache
    (one `update` per layer, as a prefill step does)."""
    attn = method.split("/")[-1]
    model.set_attn_implementation({"paged": "hf_pagedkv", "compiled": "hf_pagedkv_compiled"}.get(attn, "sdpa"))
    cache = make_cache(method, model)
    text = ""
    with torch.no_grad():
        for i, (k, v) in enumerate(kv):
            cache.update(k.clone(), v.clone(), i)
        t0 = time.perf_counter()
        tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)  # warm-up step (compiles, if any)
        if attn == "compiled":
            print(f"warm-up step of {method}: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr, flush=True)
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        t0 = clock()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        dt = (clock() - t0) / steps
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
            text = buf.getvalue()
    if isinstance(cache, PagedCache):
        cache.release()
    model.set_attn_implementation("sdpa")
    return dt, text


def run_paired(model, methods: list[str], kv: list, tok: torch.Tensor, steps: int, rng) -> dict[str, tuple]:
    """`{method: (median ms per step, median per-turn ratio to dynamic, q1, q3)}`: every case's cache live at once,
    one decode step of each in turn (the order shuffled every turn), after one untimed warm-up step each."""
    impl = {"paged": "hf_pagedkv", "compiled": "hf_pagedkv_compiled"}
    attn_of = lambda m: impl.get(m.split("/")[-1], "sdpa")  # noqa: E731
    caches, toks, times = {}, {}, {m: [] for m in methods}
    with torch.no_grad():
        for m in methods:
            caches[m] = make_cache(m, model)
            for i, (k, v) in enumerate(kv):
                caches[m].update(k.clone(), v.clone(), i)
            model.set_attn_implementation(attn_of(m))
            t0 = time.perf_counter()
            toks[m] = model(tok, **cache_kwargs(caches[m])).logits[:, -1:].argmax(-1)  # warm-up (compiles, if any)
            if m.endswith("/compiled"):
                print(f"warm-up step of {m}: {time.perf_counter() - t0:.1f} s wall", file=sys.stderr, flush=True)
        for _ in range(steps):
            order = methods[:]
            rng.shuffle(order)
            for m in order:
                model.set_attn_implementation(attn_of(m))
                t0 = clock()
                toks[m] = model(toks[m], **cache_kwargs(caches[m])).logits[:, -1:].argmax(-1)
                times[m].append(clock() - t0)
    model.set_attn_implementation("sdpa")
    for c in caches.values():
        if isinstance(c, PagedCache):
            c.release()
    out = {}
    for m in methods:
        r = sorted(d / t for d, t in zip(times["dynamic"], times[m]))
        q1, q3 = r[len(r) // 4], r[min(len(r) - 1, 3 * len(r) // 4)]
        out[m] = (statistics.median(times[m]) * 1e3, statistics.median(r), q1, q3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--methods", default="fp,k8v8,k8v4,k4v4", help="PagedCache presets, each run with sdpa and paged")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per case")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (shuffled order); the median is reported")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each case (one round)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compiled", action="store_true",
                    help='also run each preset with "hf_pagedkv_compiled" (the C reads, else torch.compile; opt-in)')
    ap.add_argument("--paired", action="store_true",
                    help="all caches live, one step of each in turn; per-turn ratios (least noisy)")
    ap.add_argument("--model", default=None, help="a model id or directory (default: the bundled SmolLM2)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (times are then wall times after a synchronize)")
    args = ap.parse_args(argv)
    use_device(args.device)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, device=args.device)
    attns = ("sdpa", "paged", "compiled") if args.compiled else ("sdpa", "paged")
    methods = ["dynamic"] + [f"{m}/{a}" for m in args.methods.split(",") for a in attns]
    if QUANTO:
        methods.append("quanto-int4")
    else:
        print("optimum-quanto is not installed: no QuantizedCache (quanto int4) row", file=sys.stderr)
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    times: dict[tuple, list[float]] = {}
    lengths = [int(n) for n in args.lengths.split(",")]
    full = prefill(model, torch.randint(100, model.config.vocab_size, (1, max(lengths)), generator=g).to(args.device))
    if args.paired:
        print(f"decode CPU time, {args.threads} thread(s), paired: every cache live, one step of each in turn, "
              f"{args.steps} turns; ratio = median over turns of DynamicCache's step / the case's (q1-q3)")
        print("| tokens | batch | cache | attention | ms/step | tok/s | vs DynamicCache (q1-q3) |")
        print("| ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for n in lengths:
        for batch in map(int, args.batches.split(",")):
            kv = prompt_kv(full, n, batch, args.seed)
            tok = torch.randint(100, model.config.vocab_size, (batch, 1), generator=g).to(args.device)
            if args.paired:
                res = run_paired(model, methods, kv, tok, args.steps, rng)
                for m, (ms, ratio, q1, q3) in res.items():
                    cache, attn = (m.split("/") + ["sdpa"])[:2]
                    print(f"| {n} | {batch} | {cache} | {attn} | {ms:.1f} | {batch / ms * 1e3:.1f} | {ratio:.2f}x "
                          f"({q1:.2f}-{q3:.2f}) |", flush=True)
                continue
            for r in range(1 if args.profile else args.rounds):
                order = methods[:]
                rng.shuffle(order)
                for m in order:
                    dt, text = run_case(model, m, kv, tok, args.steps, args.profile)
                    times.setdefault((n, batch, m), []).append(dt)
                    if text:
                        print(f"== profile: {n} tokens, batch {batch}, {m}: {dt * 1e3:.1f} ms/step\n{text}")
                print(f"{n} tokens, batch {batch}: round {r + 1} done", file=sys.stderr)
            for m in methods:  # this length and batch so far (the full table follows at the end)
                dt = statistics.median(times[(n, batch, m)])
                print(f"partial: {n} tokens, batch {batch}, {m}: {dt * 1e3:.1f} ms/step, "
                      f"{statistics.median(times[(n, batch, 'dynamic')]) / dt:.2f}x", file=sys.stderr, flush=True)
    if args.paired:
        return 0
    print(f"decode tokens/s relative to DynamicCache (CPU time, {args.threads} thread(s), median of "
          f"{1 if args.profile else args.rounds} rounds of {args.steps} steps, SmolLM2-135M fp32)")
    print("| tokens | batch | cache | attention | ms/step | tok/s | vs DynamicCache |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for n in map(int, args.lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            base = statistics.median(times[(n, batch, "dynamic")])
            for m in methods:
                dt = statistics.median(times[(n, batch, m)])
                cache, attn = (m.split("/") + ["sdpa"])[:2]
                print(f"| {n} | {batch} | {cache} | {attn} | {dt * 1e3:.1f} | {batch / dt:.1f} | {base / dt:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
