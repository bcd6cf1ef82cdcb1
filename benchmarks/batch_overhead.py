"""Per-step overhead with many rows: decode CPU time of PagedCache against DynamicCache at batch 1-64, one run.

    python benchmarks/batch_overhead.py                         # batch 1, 8, 32, 64 at 64-token contexts
    python benchmarks/batch_overhead.py --batches 8 --steps 4   # a smoke run

Both caches run the bundled SmolLM2-135M-Instruct (30 layers, 3 KV heads x 64, fp32) on the same random prompts:
an untimed prefill of `--context` tokens per row, one untimed warm-up step, then `--steps` greedy decode steps
timed with `time.process_time` (this process's CPU time, steadier than wall time on a shared machine). The two
caches alternate within each round and the best of `--rounds` rounds is kept. The table gives ms per decode step,
PagedCache minus DynamicCache (the cache-side overhead, since the model's work is the same), and the speed ratio
(DynamicCache time / PagedCache time: above 1.0 means PagedCache is faster). Tokens must be identical (exit 1
otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_pagedkv import PagedCache, cache_kwargs  # noqa: E402
from hf_pagedkv.tools.models import load_model  # noqa: E402


def decode(model, prompt: torch.Tensor, make_cache, steps: int) -> tuple[float, torch.Tensor]:
    """(CPU seconds per decode step, the generated tokens `[batch, steps]`)."""
    cache = make_cache()
    out = []
    with torch.inference_mode():
        tok = model(prompt, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
        tok = model(tok, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)  # warm-up
        t0 = time.process_time()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(cache), logits_to_keep=1).logits[:, -1:].argmax(-1)
            out.append(tok)
        dt = (time.process_time() - t0) / steps
    if isinstance(cache, PagedCache):
        cache.release()
    return dt, torch.cat(out, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64", help="batch sizes, comma-separated")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per case")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the best per case is kept")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model()
    g = torch.Generator().manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: torch.randint(100, model.config.vocab_size, (b, args.context), generator=g) for b in batches}
    caches = {"DynamicCache": lambda: DynamicCache(config=model.config),
              "PagedCache": lambda: PagedCache(config=model.config)}
    best: dict[tuple, float] = {}
    status = 0
    for r in range(args.rounds):
        for b in batches:
            names = list(caches) if r % 2 == 0 else list(caches)[::-1]
            tokens = {}
            for name in names:
                dt, tokens[name] = decode(model, prompts[b], caches[name], args.steps)
                best[(name, b)] = min(best.get((name, b), float("inf")), dt)
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
    return status


if __name__ == "__main__":
    sys.exit(main())
