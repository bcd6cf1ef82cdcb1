"""Per-step overhead with many rows: decode CPU time of PagedCache against DynamicCache at batch 1-64, one run.

    python benchmarks/batch_overhead.py                         # batch 1, 8, 32, 64 at 64-token contexts
    python benchmarks/batch_overhead.py --batches 8 --steps 4   # a smoke run
    python benchmarks/batch_overhead.py --batches 64 --profile  # plus where the time goes (CPU ms per step)
    python benchmarks/batch_overhead.py --python-only           # the cache's Python work per step, no tensor work
    python benchmarks/batch_overhead.py --paired --steps 48     # both caches step by step in turn (least noisy)
    python benchmarks/batch_overhead.py --paired --attention hf_pagedkv   # PagedCache read in place

Both caches run the bundled SmolLM2-135M-Instruct (30 layers, 3 KV heads x 64, fp32) on the same random prompts:
an untimed prefill of `--context` tokens per row, one untimed warm-up step, then `--steps` greedy decode steps
timed with `time.process_time` (this process's CPU time, steadier than wall time on a shared machine). The two
caches alternate within each round and the best of `--rounds` rounds is kept. The table gives ms per decode step,
PagedCache minus DynamicCache (the cache-side overhead, since the model's work is the same), and the speed ratio
(DynamicCache time / PagedCache time: above 1.0 means PagedCache is faster). Tokens must be identical (exit 1
otherwise). `--profile` also prints, per case, the CPU time per decode step inside the cache's `update` (for
PagedCache split into its stores' `read` and `write`) and inside `scaled_dot_product_attention` (the attention
reads what `update` returned); the wrappers that measure it cost a few microseconds per call. `--python-only`
runs no model: it times `PagedCache.update` for every layer of decode steps with the model's K/V shapes (after a
64-token prefill per row, as above) while the page store's `read` and `write` are replaced by stubs that move no
data, so what remains is the cache's own per-step work (planning, bookkeeping, index tensors, checks); it prints the
median and the best step, per batch size. `--paired` keeps both caches live and alternates them step by step (the
order flipped every step), so each pair of steps sees the same machine: it prints the median step time of each, the
mean, and the median and quartiles of the per-step ratio (the number to quote on a shared machine, where whole
rounds minutes apart moved by 20%).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.part_timer import PartTimer  # noqa: E402
from hf_pagedkv import PagedCache, cache_kwargs  # noqa: E402
from hf_pagedkv.storage.page_store import PageStore  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402

#: CPU time inside the cache's `update`, the page store's `read` / `write` and sdpa, counted during the timed steps
#: (only with --profile: `install_profile`)
TIMER = PartTimer(time.process_time, on=False)


def install_profile() -> None:
    for owner, name, part in ((DynamicCache, "update", "update"), (PagedCache, "update", "update"),
                              (PageStore, "read", "store read"), (PageStore, "write", "store write"),
                              (torch.nn.functional, "scaled_dot_product_attention", "sdpa")):
        TIMER.patch(owner, name, part)


def decode(model, prompt: torch.Tensor, make_cache, steps: int) -> tuple[float, torch.Tensor]:
    """(CPU seconds per decode step, the generated tokens `[batch, steps]`)."""
    cache = make_cache()
    out = []
    with torch.inference_mode():
        tok = model(prompt, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
        tok = model(tok, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)  # warm-up
        TIMER.clear()
        TIMER.on = True
        t0 = time.process_time()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
            out.append(tok)
        dt = (time.process_time() - t0) / steps
        TIMER.on = False
    if isinstance(cache, PagedCache):
        cache.release()
    return dt, torch.cat(out, 1)


def python_only(config, batches: list[int], context: int, steps: int) -> None:
    """Print the CPU ms per decode step of `PagedCache.update` over every layer, with the store's `read` and `write`
    stubbed out (no data moved): the cache's own work per step."""
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    read, write = PageStore.read, PageStore.write
    print(f"cache-side CPU ms per decode step without tensor work (store read/write stubbed), {layers} layers, "
          f"{context}-token contexts, {steps} steps")
    print("| batch | median ms | best ms |")
    print("| ---: | ---: | ---: |")
    for b in batches:
        g = torch.Generator().manual_seed(0)
        cache = PagedCache(config=config)
        with torch.inference_mode():
            for layer in range(layers):
                kv = torch.randn(b, heads, context, dim, generator=g)
                cache.update(kv, kv, layer)
            new = torch.randn(b, heads, 1, dim, generator=g)
            out = torch.empty(b, heads, context + 1, dim)  # what the stubbed read returns (its length is not checked)
            PageStore.read, PageStore.write = (lambda self, idx, request: (out, out)), (lambda self, *args: None)
            try:
                times = []
                for _ in range(steps):
                    t0 = time.process_time()
                    for layer in range(layers):
                        cache.update(new, new, layer)
                    times.append(time.process_time() - t0)
            finally:
                PageStore.read, PageStore.write = read, write
        cache.release()
        times.sort()
        print(f"| {b} | {times[len(times) // 2] * 1e3:.2f} | {times[0] * 1e3:.2f} |")


def paired(model, prompts: dict[int, torch.Tensor], caches: dict, steps: int, attention: str = "sdpa") -> int:
    """Print, per batch, both caches' decode step times from one run where they alternate step by step;
    `attention`: PagedCache's attention implementation (DynamicCache's is always ``"sdpa"``)."""
    attn = {"DynamicCache": "sdpa", "PagedCache": attention}
    import statistics
    status = 0
    print(f"decode step CPU time, SmolLM2, paired steps (the caches alternate, order flipped every step), {steps} "
          f"steps per cache; PagedCache with attention {attention!r}")
    print("| batch | DynamicCache median ms | PagedCache median ms | mean ratio | per-step ratio median (q1-q3) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    names = list(caches)
    for b, prompt in prompts.items():
        live = {n: caches[n]() for n in names}
        times: dict[str, list[float]] = {n: [] for n in names}
        tok = {}
        with torch.inference_mode():
            for n, cache in live.items():
                model.set_attn_implementation(attn[n])
                t = model(prompt, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
                tok[n] = model(t, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)  # warm-up
            for s in range(steps):
                for n in (names if s % 2 == 0 else names[::-1]):
                    model.set_attn_implementation(attn[n])  # untimed
                    t0 = time.process_time()
                    tok[n] = model(tok[n], **cache_kwargs(live[n]), logits_to_keep=1).logits[:, -1:].argmax(-1)
                    times[n].append(time.process_time() - t0)
                if not torch.equal(tok[names[0]], tok[names[1]]):
                    print(f"batch {b}: tokens differ between the caches at step {s}", file=sys.stderr)
                    status = 1
        live["PagedCache"].release()
        model.set_attn_implementation("sdpa")
        d, p = times["DynamicCache"], times["PagedCache"]
        ratios = sorted(x / y for x, y in zip(d, p))
        q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
        print(f"| {b} | {statistics.median(d) * 1e3:.1f} | {statistics.median(p) * 1e3:.1f} | {sum(d) / sum(p):.3f}x "
              f"| {statistics.median(ratios):.3f}x ({q(0.25):.3f}-{q(0.75):.3f}) |", flush=True)
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per case")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the best per case is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--profile", action="store_true", help="also print CPU ms per step of update, read, write, sdpa")
    ap.add_argument("--python-only", action="store_true",
                    help="time only the cache's own work per step (store read/write stubbed, no model run)")
    ap.add_argument("--paired", action="store_true",
                    help="alternate the two caches step by step in one run (ratio per step; least noisy)")
    ap.add_argument("--attention", default="sdpa", choices=["sdpa", "hf_pagedkv", "hf_pagedkv_compiled"],
                    help="with --paired: PagedCache's attention implementation (DynamicCache keeps sdpa)")
    args = ap.parse_args(argv)
    if args.attention != "sdpa" and not args.paired:
        ap.error("--attention applies to --paired runs only (the rounds and --python-only use sdpa)")
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be at least 1")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches must be comma-separated integers, e.g. 1,8,32, got {args.batches!r}")
    if min(batches) < 1:
        ap.error(f"--batches must be at least 1, got {args.batches!r}")
    torch.set_num_threads(args.threads)
    if args.python_only:
        model, _ = load_model()
        python_only(model.config, batches, args.context, args.steps)
        return 0
    if args.profile:
        install_profile()
    model, _ = load_model()
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(100, model.config.vocab_size, (b, args.context), generator=g) for b in batches}
    caches = {"DynamicCache": lambda: DynamicCache(config=model.config),
              "PagedCache": lambda: PagedCache(config=model.config)}
    if args.paired:
        return paired(model, prompts, caches, args.steps, args.attention)
    best: dict[tuple, float] = {}
    parts: dict[tuple, dict[str, float]] = {}  # (cache, batch) -> the parts of its best round, ms per step
    status = 0
    for r in range(args.rounds):
        for b in batches:
            names = list(caches) if r % 2 == 0 else list(caches)[::-1]
            tokens = {}
            for name in names:
                dt, tokens[name] = decode(model, prompts[b], caches[name], args.steps)
                if dt < best.get((name, b), float("inf")):
                    best[(name, b)] = dt
                    parts[(name, b)] = {k: v / args.steps * 1e3 for k, v in TIMER.seconds.items()}
            if not torch.equal(tokens["DynamicCache"], tokens["PagedCache"]):
                print(f"batch {b}: tokens differ between the caches", file=sys.stderr)
                status = 1
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"decode step CPU time, SmolLM2, {args.context}-token contexts, {args.threads} thread(s), best of "
          f"{args.rounds} rounds of {args.steps} steps")
    print("| batch | DynamicCache ms | PagedCache ms | overhead ms | speed vs DynamicCache |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for b in batches:
        d, p = best[("DynamicCache", b)] * 1e3, best[("PagedCache", b)] * 1e3
        print(f"| {b} | {d:.1f} | {p:.1f} | {p - d:+.1f} | {d / p:.2f}x |")
    if args.profile:
        print("\nwhere the time goes, CPU ms per decode step (the best round of each case)")
        print("| batch | cache | step | update | store read | store write | sdpa |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        for b in batches:
            for name in caches:
                q = parts[(name, b)]
                cells = " | ".join(f"{q[k]:.1f}" if k in q else "-" for k in ("update", "store read", "store write",
                                                                                 "sdpa"))
                print(f"| {b} | {name} | {best[(name, b)] * 1e3:.1f} | {cells} |")
    return status


if __name__ == "__main__":
    sys.exit(main())
