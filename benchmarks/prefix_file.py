"""Prefix cache on disk, on the real model (SmolLM2-135M-Instruct, fp32, CPU by default).

Two ratios, measured in one run:

1. time to first token for a 2048-token prefix plus a 32-token suffix in a fresh process: served from a prefix-cache
   file saved by an earlier process (`BlockPool.load_prefix_cache` + `PagedCache.from_prefix`) versus recomputing
   the whole prompt; target <= 0.15x. Each measurement is its own Python process (model loading and a short
   warm-up forward are not timed, in both modes); the file mode's time includes the model fingerprint (computed
   once per process), reading and verifying the file and copying its blocks into the pool, and is also given
   without the fingerprint (a server that fingerprints its model at startup);
2. the file's bytes per cached token versus the planner's bytes per token (`hf_pagedkv.tools.planning`).

The first token of both modes is checked to be the same.

    python benchmarks/prefix_file.py --threads 1          # ~3 minutes on 2 CPU cores
    python benchmarks/prefix_file.py --quant k8v4 --block-size 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.pool.fingerprint import model_fingerprint
from hf_pagedkv.tools.models import load_model
from hf_pagedkv.tools.planning import ModelShape, plan_capacity
from prefix_cache import DATA, corpus_tokens, prompt


def request(args, tokenizer) -> torch.Tensor:
    doc, suffixes, _ = corpus_tokens(tokenizer, args.data)
    return prompt(doc[: args.prefix_tokens], suffixes[args.suffix_index], args.suffix_tokens)


@torch.inference_mode()
def child(args) -> None:
    """One fresh-process measurement; prints one JSON line."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    x = request(args, tokenizer)
    warm = PagedCache(config=model.config, block_size=args.block_size, quant=args.quant)
    model(x[:, :16], **cache_kwargs(warm))  # kernels warm, as in both modes of a running server
    warm.release()
    out = {}
    start = time.perf_counter()
    if args.child == "recompute":
        cache = PagedCache(config=model.config, block_size=args.block_size, quant=args.quant)
        logits = model(x, **cache_kwargs(cache)).logits[0, -1]
    else:
        model_fingerprint(model)
        out["fingerprint_s"] = time.perf_counter() - start
        pool = BlockPool.load_prefix_cache(args.file, model=model)
        out["load_s"] = time.perf_counter() - start - out["fingerprint_s"]
        cache = PagedCache.from_prefix(pool, x, model=model)
        hit = cache.get_seq_length()
        logits = model(x[:, hit:], **cache_kwargs(cache)).logits[0, -1]
        out["hit_tokens"] = hit
    out["ttft_s"] = time.perf_counter() - start
    out["token"] = int(logits.argmax())
    print(json.dumps(out))


def run_child(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--file", args.file, "--threads", str(args.threads),
           "--block-size", str(args.block_size), "--quant", args.quant, "--prefix-tokens", str(args.prefix_tokens),
           "--suffix-tokens", str(args.suffix_tokens), "--suffix-index", str(args.suffix_index), "--data", args.data]
    if args.model:
        cmd += ["--model", args.model]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model id/path (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=DATA, help="folder holding wikitext-2-raw/ and tinyshakespeare/")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quant", default="fp", help="storage format of the pool (fp, k8v4, ...)")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--suffix-index", type=int, default=1, help="which suffix the timed request uses")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--file", default=None, help="where to write the prefix-cache file (default: a temporary one)")
    p.add_argument("--child", choices=["recompute", "file"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    torch.set_num_threads(args.threads)
    tmp = None
    if args.file is None:
        tmp = tempfile.TemporaryDirectory()
        args.file = os.path.join(tmp.name, "prefix.safetensors")
    model, tokenizer = load_model(args.model)
    doc, suffixes, source = corpus_tokens(tokenizer, args.data)
    with torch.inference_mode():  # an earlier process serves a request with the prefix, then saves its pool
        pool = BlockPool(block_size=args.block_size, prefix_caching=True, quant=args.quant)
        hf_pagedkv.generate(model, prompt(doc[: args.prefix_tokens], suffixes[0], args.suffix_tokens), pool=pool,
                            max_new_tokens=1, do_sample=False)
    blocks = pool.save_prefix_cache(args.file)
    size = os.path.getsize(args.file)
    shape = ModelShape.from_config(model.config, "model")
    planned = plan_capacity(shape, args.prefix_tokens, 1, quant=args.quant, dtype=str(model.dtype).split(".")[-1],
                            block_size=args.block_size).bytes_per_token
    per_token = size / (blocks * args.block_size)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"({args.threads} threads), load average {os.getloadavg()[0]:.1f}, {type(model).__name__} {model.dtype}, "
          f"block_size={args.block_size}, quant={args.quant}, text: {source}")
    print(f"file: {blocks} blocks ({blocks * args.block_size} tokens), {size / 2**20:.1f} MiB, {per_token:.0f} bytes "
          f"per token; planner {planned:.0f} bytes per token: {per_token / planned:.3f}x")
    del model
    runs = {"recompute": [], "file": []}
    for _ in range(args.repeats):  # alternate, so a change in machine load hits both modes
        for mode in runs:
            runs[mode].append(run_child(args, mode))
    med = {mode: statistics.median(r["ttft_s"] for r in rs) for mode, rs in runs.items()}
    fp = statistics.median(r["fingerprint_s"] for r in runs["file"])
    load = statistics.median(r["load_s"] for r in runs["file"])
    same = len({r["token"] for rs in runs.values() for r in rs}) == 1
    print(f"TTFT {args.prefix_tokens}+{args.suffix_tokens} tokens, fresh process (median of {args.repeats}): "
          f"recompute {med['recompute']:.3f} s; from the file {med['file']:.3f} s (model fingerprint {fp:.3f} s, "
          f"load + verify {load:.3f} s, {runs['file'][0]['hit_tokens']} tokens hit); first token identical: {same}")
    print(f"SUMMARY ttft_file/recompute={med['file'] / med['recompute']:.3f}x (target <= 0.15), without the "
          f"fingerprint {(med['file'] - fp) / med['recompute']:.3f}x; file bytes/token / planner bytes/token="
          f"{per_token / planned:.3f}x")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
