"""Decode speed after a KVzip compression: uniform budgets (one layer group) against the ranking across layers
(`layer_budgets="global"`: one layer group per layer), beside the uncompressed cache, in one run (CPU time, SmolLM2).

    python benchmarks/dev/retention_decode.py                              # a 2,048-token context, ratio 0.5
    python benchmarks/dev/retention_decode.py --length 512 --steps 4 --rounds 1         # a smoke run

Each round, for each method in turn (the order rotating between rounds), prefills a random context of `--length`
tokens through a `PagedCache` under the ``"hf_pagedkv"`` attention, compresses it (`compress_context`, untimed), then
times `--steps` greedy decode steps (`model(next_token, ...)`, after one warm-up step) in this process's CPU time
(`time.process_time`, steadier than wall time on a shared machine); the best of the rounds is kept. Prints ms per
step, the ratio to the uncompressed cache and the KV bytes held.
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_pagedkv import PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip, KVzipScoring
from hf_pagedkv.tools.models import load_model

METHODS = {"full": None, "kv_zip": dict(layer_budgets="uniform"), "kv_zip_global": dict(layer_budgets="global")}


def run(model, tokenizer, method: str, x: torch.Tensor, ratio: float, steps: int) -> tuple[float, int, int]:
    """(CPU seconds of `steps` decode steps, bytes held, layer groups) for one method."""
    kw = METHODS[method]
    policy = None if kw is None else KVzip(compression_ratio=ratio, scoring=KVzipScoring(kernel_size=7, **kw))
    cache = PagedCache(config=model.config, retention=policy)
    with torch.no_grad():
        model(x, **cache_kwargs(cache), logits_to_keep=1)
        if policy is not None:
            compress_context(model, cache, x, tokenizer=tokenizer)
        tok = x[:, -1:]
        tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)  # warm-up step
        t0 = time.process_time()
        for _ in range(steps):
            tok = model(tok, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        dt = time.process_time() - t0
    held, groups = cache.pool.stats().bytes_in_use, cache.num_layer_groups
    cache.release()
    return dt, held, groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2048, help="context tokens (default: %(default)s)")
    ap.add_argument("--ratio", type=float, default=0.5, help="KVzip's compression ratio (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per case (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the best per method is kept (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    model.set_attn_implementation("hf_pagedkv")  # every method under the same attention
    x = torch.randint(100, model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(0))
    names = list(METHODS)
    best: dict[str, tuple[float, int, int]] = {}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            got = run(model, tokenizer, name, x, args.ratio, args.steps)
            if name not in best or got[0] < best[name][0]:
                best[name] = got
    full = best["full"][0]
    print(f"context {args.length} tokens, ratio {args.ratio}, {args.steps} decode steps, best of {args.rounds} rounds, "
          f"{args.threads} thread(s)")
    print("| method | layer groups | ms / step | vs full | KV MiB held |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (dt, held, groups) in best.items():
        print(f"| {name} | {groups} | {1e3 * dt / args.steps:.1f} | {dt / full:.2f}x | {held / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
