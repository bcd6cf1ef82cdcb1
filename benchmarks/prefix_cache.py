"""Prefix-caching benchmark on the real model (SmolLM2-135M-Instruct, fp32, CPU by default).

Two ratios, measured in one run:

1. time to first token for a 2048-token shared prefix plus a 32-token suffix: with a prefix hit (the prefix's
   blocks are already in the pool) versus without (a fresh pool); target <= 0.15x;
2. KV memory of 16 live requests sharing a 1024-token prefix (one pool, prefix caching) versus 16
   `DynamicCache`s; target <= 0.15x.

The prefix is real text (the start of WikiText-2 test, from eval/data or `--data`), the suffixes are distinct Tiny
Shakespeare lines. Greedy outputs with a hit are checked against runs without one.

    python benchmarks/prefix_cache.py                # ~1-2 minutes on 2 CPU cores
    python benchmarks/prefix_cache.py --full-baseline   # run all 16 DynamicCache requests instead of 1 x 16
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import hf_pagedkv
from eval.config import resolve_data_dir
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.tools.models import load_model
from hf_pagedkv.tools.verify import dynamic_cache_bytes

DATA = str(resolve_data_dir())  # eval/data in the repository, or $HF_PAGEDKV_DATA_DIR
MiB = 2**20


def corpus_tokens(tokenizer, data_dir: str) -> tuple[list[int], list[list[int]], str]:
    """(document tokens, a list of suffix token lists, where the text came from).

    Raises:
        FileNotFoundError: `data_dir` lacks `wikitext-2-raw/wiki.test.raw` or `tinyshakespeare/input.txt`.
    """
    with open(os.path.join(data_dir, "wikitext-2-raw", "wiki.test.raw"), encoding="utf-8") as fh:
        doc = fh.read(40_000)
    with open(os.path.join(data_dir, "tinyshakespeare", "input.txt"), encoding="utf-8") as fh:
        lines = [line for line in fh.read(200_000).splitlines() if len(line) > 40]
    source = "WikiText-2 test + Tiny Shakespeare"
    doc_ids = tokenizer(doc, add_special_tokens=False).input_ids
    suffixes = [tokenizer(" " + " ".join(lines[i: i + 3]), add_special_tokens=False).input_ids for i in
                range(0, len(lines) - 3, 3)]
    return doc_ids, suffixes, source


def prompt(prefix: list[int], suffix: list[int], n: int) -> torch.Tensor:
    suffix = (suffix * (n // max(len(suffix), 1) + 1))[:n]
    return torch.tensor([prefix + suffix])  # [1, len(prefix) + n]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


@torch.inference_mode()
def ttft(model, doc: list[int], suffixes: list[list[int]], args) -> dict:
    """Seconds to the first token with and without a prefix hit (medians of `args.repeats`)."""
    prefix = doc[: args.prefix_tokens]
    one = {"max_new_tokens": 1, "do_sample": False}
    hit_pool = BlockPool(block_size=args.block_size, prefix_caching=True)
    hf_pagedkv.generate(model, prompt(prefix, suffixes[0], args.suffix_tokens), pool=hit_pool, **one)  # publish
    miss, hit, dyn, same = [], [], [], True
    for i in range(1, args.repeats + 1):
        x = prompt(prefix, suffixes[i], args.suffix_tokens)
        fresh_pool = BlockPool(block_size=args.block_size, prefix_caching=True)
        t_miss, out_miss = timed(lambda x=x, p=fresh_pool: hf_pagedkv.generate(model, x, pool=p, **one))
        t_hit, out_hit = timed(lambda x=x: hf_pagedkv.generate(model, x, pool=hit_pool, **one))
        t_dyn, _ = timed(lambda x=x: model.generate(x, **cache_kwargs(DynamicCache()), **one))
        miss.append(t_miss)
        hit.append(t_hit)
        dyn.append(t_dyn)
        same &= torch.equal(out_miss, out_hit)
    s = hit_pool.stats()
    return {"miss": statistics.median(miss), "hit": statistics.median(hit), "dynamic": statistics.median(dyn),
            "same": same, "hit_tokens_per_request": s.hit_tokens / max(s.lookups - 1, 1)}


@torch.inference_mode()
def memory(model, doc: list[int], suffixes: list[list[int]], args) -> dict:
    """KV bytes of `args.requests` live requests sharing a prefix: one pool versus DynamicCaches."""
    prefix = doc[: args.mem_prefix_tokens]
    gen = {"max_new_tokens": args.new_tokens, "do_sample": False}
    pool = BlockPool(block_size=args.block_size, prefix_caching=True)
    caches, outs = [], []
    for i in range(args.requests):  # all requests stay alive (as in a server) until the measurement
        x = prompt(prefix, suffixes[i], args.suffix_tokens)
        cache = PagedCache.from_prefix(pool, x, model=model)
        out = model.generate(x, **cache_kwargs(cache), **gen)
        cache.publish(x)
        caches.append(cache)
        outs.append(out)
    paged = pool.stats()
    runs = args.requests if args.full_baseline else 1
    dyn_bytes, same = [], True
    for i in range(runs):
        x = prompt(prefix, suffixes[i], args.suffix_tokens)
        ref_cache = DynamicCache(config=model.config)
        ref = model.generate(x, **cache_kwargs(ref_cache), **gen)
        dyn_bytes.append(dynamic_cache_bytes(ref_cache))
        same &= torch.equal(ref, outs[i])
    dynamic_total = sum(dyn_bytes) * (args.requests // runs)  # every request has the same length
    for cache in caches:
        cache.release()
    return {"paged": paged.bytes_in_use, "dynamic": dynamic_total, "same": same, "blocks": paged.blocks_in_use,
            "runs": runs, "per_request": dyn_bytes[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model id/path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=DATA, help="folder holding wikitext-2-raw/ and tinyshakespeare/ "
                   "(default: eval/data, or $HF_PAGEDKV_DATA_DIR)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--mem-prefix-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--full-baseline", action="store_true", help="run every DynamicCache request, not 1 x 16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    doc, suffixes, source = corpus_tokens(tokenizer, args.data)
    with torch.inference_mode():  # warm-up: kernels, and the model fingerprint (computed once per model)
        hf_pagedkv.generate(model, prompt(doc[:64], suffixes[0], 8), pool=BlockPool(prefix_caching=True),
                            max_new_tokens=2, do_sample=False)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), load average {os.getloadavg()[0]:.1f}, {type(model).__name__} "
          f"{model.dtype}, block_size={args.block_size}, text: {source}")
    t = ttft(model, doc, suffixes, args)
    print(f"TTFT {args.prefix_tokens}+{args.suffix_tokens} tokens (median of {args.repeats}): "
          f"no hit {t['miss']:.3f} s, hit {t['hit']:.3f} s ({t['hit_tokens_per_request']:.0f} tokens hit), "
          f"DynamicCache {t['dynamic']:.3f} s; first token identical: {t['same']}")
    m = memory(model, doc, suffixes, args)
    how = "all measured" if m["runs"] > 1 else f"1 measured, {m['per_request'] / MiB:.1f} MiB, x {args.requests}"
    print(f"memory, {args.requests} live requests of {args.mem_prefix_tokens}+{args.suffix_tokens} tokens "
          f"+ {args.new_tokens} generated: one pool {m['paged'] / MiB:.1f} MiB ({m['blocks']} blocks) vs "
          f"{args.requests} DynamicCaches {m['dynamic'] / MiB:.1f} MiB ({how}); outputs identical: {m['same']}")
    print(f"SUMMARY ttft_hit/no_hit={t['hit'] / t['miss']:.3f}x (target <= 0.15) "
          f"memory_pool/dynamic={m['paged'] / m['dynamic']:.3f}x (target <= 0.15)")


if __name__ == "__main__":
    main()
