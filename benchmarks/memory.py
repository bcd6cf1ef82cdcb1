"""Memory a cache reports, really holds, and peaks at: PagedCache (fp and quantized) against DynamicCache.

    python benchmarks/memory.py                 # both runs, every cache type; ~10-15 min on 2 CPU cores
    python benchmarks/memory.py --quick         # a 1024-token batch-1 run only (a smoke run)
    python benchmarks/memory.py --store-padding # PagedCache stores left padding (no `cache.set_padding`)

Each (run, cache type) is measured in its own process, so allocator state and peaks do not leak between them:
the model (the bundled SmolLM2-135M-Instruct, fp32) is loaded and warmed up, the peak is reset, then one
`generate` runs (a prefill plus `--new` decode steps, greedy). Columns:

- reported: `pool.stats().bytes_in_use` (PagedCache) at the end of `generate`;
- real: the bytes of every storage tensor the pool owns (PagedCache: each store's `tensors()`, which
  `bytes_reserved` must equal; DynamicCache: its key/value tensors);
- peak: the growth of the process's peak RSS over its RSS before `generate` (Linux `VmHWM`, reset through
  `/proc/self/clear_refs`), and `torch.cuda.max_memory_allocated` growth where the model runs on CUDA;
- slots / real tokens: token slots of the blocks in use (`blocks_in_use * block_size`, the pad block counted once)
  and the real tokens the cache holds (the prompts without padding plus the generated tokens but the last).

A PagedCache is told the batch's padding (`cache.set_padding(attention_mask)`), so whole blocks of left padding
name the pool's one pad block; `--store-padding` leaves that out (padding stored as tokens).

Runs: batch 1 with a 4096-token prompt, and a left-padded batch 8 of prompts of 300-1000 tokens (seeded random
token ids). Tokens must be identical to DynamicCache's (fp) or the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_pagedkv import PagedCache, cache_kwargs  # noqa: E402
from hf_pagedkv.tools.verify import dynamic_cache_bytes  # noqa: E402

MiB = 2**20
CACHES = ("dynamic", "fp", "k8v8", "k8v4", "k4v4")


def prompts(run: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a run: "b1-<n>" (one prompt of n tokens) or "b8-padded"."""
    g = torch.Generator().manual_seed(0)
    if run.startswith("b1-"):
        n = int(run[3:])
        x = torch.randint(100, vocab, (1, n), generator=g)
        return x, torch.ones_like(x)
    lengths = torch.randint(300, 1001, (8,), generator=g).tolist()
    width = max(lengths)
    x = torch.zeros((8, width), dtype=torch.long)
    mask = torch.zeros_like(x)
    for r, n in enumerate(lengths):  # left padding, as generate() expects for a decoder-only model
        x[r, width - n:] = torch.randint(100, vocab, (n,), generator=g)
        mask[r, width - n:] = 1
    return x, mask


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (the peak RSS) to the current RSS
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def pool_real_bytes(pool) -> int:
    return sum(t.untyped_storage().nbytes() for g in pool.groups for t in g.store.tensors())


def measure(run: str, cache_type: str, new: int, threads: int, store_padding: bool = False) -> dict:
    """One measurement, in this process."""
    from hf_pagedkv.tools.models import load_model
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    model, _ = load_model()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    x, mask = (t.to(device) for t in prompts(run, model.config.vocab_size))

    def make():
        return DynamicCache() if cache_type == "dynamic" else PagedCache(quant=cache_type)

    def generate(cache, inputs, attention):
        if isinstance(cache, PagedCache) and not store_padding:
            cache.set_padding(attention)  # whole blocks of left padding cost nothing
        with torch.no_grad():
            return model.generate(inputs, attention_mask=attention, **cache_kwargs(cache), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False)

    warm = make()  # warm-up: one-time allocations (kernels, generate's setup) do not count as the cache's peak
    generate(warm, x[:, -32:], mask[:, -32:])
    if isinstance(warm, PagedCache):
        warm.release()
    del warm
    proc = psutil.Process()
    before = proc.memory_info().rss
    exact_peak = _reset_peak()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_before = torch.cuda.memory_allocated()
    cache = make()
    out = generate(cache, x, mask)
    result = {"run": run, "cache": cache_type, "tokens": out[:, x.shape[1]:].tolist(),
              "peak_rss": (_peak_rss() if exact_peak else proc.memory_info().rss) - before,
              "peak_exact": exact_peak, "device": str(device),
              "real_tokens": int(mask.sum()) + x.shape[0] * (new - 1)}
    if device.type == "cuda":
        result["peak_cuda"] = torch.cuda.max_memory_allocated() - cuda_before
    if isinstance(cache, PagedCache):
        s = cache.pool.stats()
        result.update(reported=s.bytes_in_use, reserved=s.bytes_reserved, real=pool_real_bytes(cache.pool),
                      slots=s.blocks_in_use * s.block_size, tokens_stored=s.tokens_stored)
        cache.release()
    else:
        result.update(reported=None, reserved=None, real=dynamic_cache_bytes(cache))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one 1024-token batch-1 run only")
    ap.add_argument("--new", type=int, default=64, help="decode steps after the prefill")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    ap.add_argument("--caches", default=",".join(CACHES), help="comma-separated: dynamic, fp, k8v8, k8v4, k4v4")
    ap.add_argument("--store-padding", action="store_true", help="do not call cache.set_padding (store padding)")
    ap.add_argument("--runs", help="comma-separated runs (default: b1-4096,b8-padded; --quick: b1-1024)")
    ap.add_argument("--one", nargs=2, metavar=("RUN", "CACHE"), help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(*args.one, new=args.new, threads=args.threads, store_padding=args.store_padding)))
        return 0
    runs = args.runs.split(",") if args.runs else ["b1-1024"] if args.quick else ["b1-4096", "b8-padded"]
    caches = args.caches.split(",")
    print(f"SmolLM2-135M-Instruct fp32, {args.new} decode steps, {args.threads} thread(s) per process, "
          f"{os.cpu_count()} CPUs; one process per row; padding {'stored' if args.store_padding else 'not stored'}")
    print("| run | cache | reported MiB | real MiB | peak RSS MiB | peak / DynamicCache | slots / real tokens "
          "| tokens |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    ok = True
    for run in runs:
        ref = None
        for cache_type in caches:
            cmd = [sys.executable, __file__, "--one", run, cache_type, "--new", str(args.new), "--threads",
                   str(args.threads)] + (["--store-padding"] if args.store_padding else [])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            if cache_type == "dynamic":
                ref = r
            same = "-" if ref is None or r is ref else ("same" if r["tokens"] == ref["tokens"] else "differ")
            if cache_type == "fp" and same == "differ":
                ok = False
            ratio = f"{r['peak_rss'] / ref['peak_rss']:.2f}x" if ref and ref["peak_rss"] > 0 else "-"
            reported = "-" if r["reported"] is None else f"{r['reported'] / MiB:.1f}"
            peak = f"{r['peak_rss'] / MiB:.0f}" + ("" if r["peak_exact"] else " (RSS at end)")
            if "peak_cuda" in r:
                peak += f" (CUDA {r['peak_cuda'] / MiB:.0f})"
            slots = f"{r['slots']:,} / {r['real_tokens']:,}" if r.get("slots") is not None else "-"
            real = f"{r['real'] / MiB:.1f}"
            print(f"| {run} | {cache_type} | {reported} | {real} | {peak} | {ratio} | {slots} | {same} |", flush=True)
            if r.get("reserved") is not None and r["reserved"] != r["real"]:
                print(f"  bytes_reserved {r['reserved']} != real {r['real']}", file=sys.stderr)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
