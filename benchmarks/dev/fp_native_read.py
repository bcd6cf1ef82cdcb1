"""One layer's full-precision decode read, side by side: the eager in-place read (`paged_attention` on the pool: a
view for one row in consecutive blocks, strided views and gathers for several rows), the C read through the block
table (`NativeCodeAttention.read_fp_view`, ``"hf_pagedkv_compiled"``), and `sdpa` over the same K/V as one
contiguous tensor per row (what a `DynamicCache` step reads); SmolLM2 shapes (3 key/value heads, 9 query heads,
head_dim 64, 16-token blocks), random K/V written the way a prefill and 20 decode steps write them. Median wall time
of `--calls` calls, each once from warm caches ("hot") and once after writing `--flush-mib` MiB ("cold": in a
model's decode step the weights stream through the caches between two layers' reads).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/fp_native_read.py --tokens 2048 4096 --batch 1 8
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.dev.native_read import built_native
from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.attention import PagedView
from hf_pagedkv.attention.paged_attention import paged_attention

H, G, D = 3, 3, 64  # key/value heads, query heads per key/value head, head_dim


def median_us(fn, calls: int, flush: torch.Tensor | None) -> float:
    times = []
    for _ in range(calls):
        if flush is not None:
            flush.add_(1)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--flush-mib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = built_native()
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(args.flush_mib << 20, dtype=torch.uint8)
    print("| tokens | batch | eager hot us | C hot us | sdpa hot us | eager cold us | C cold us | sdpa cold us "
          "| C / eager cold | max abs diff C - sdpa |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        for batch in args.batch:
            cache = PagedCache(pool=BlockPool(block_size=16, num_blocks=batch * (tokens // 16 + 4)))
            with torch.no_grad():
                k = torch.randn(batch, H, tokens - 21, D, generator=g)
                cache.update(k, k + 1, 0)
                for _ in range(21):
                    k = torch.randn(batch, H, 1, D, generator=g)
                    keys, values = cache.update(k, k - 1, 0)
            view = PagedView.of(keys)
            q = torch.randn(batch, H * G, 1, D, generator=g)
            qh = (q * D ** -0.5).view(batch, H, G, 1, D).transpose(0, 1).reshape(H, batch, G, D)
            keys, values = keys.contiguous(), values.contiguous()
            cases = {"eager": lambda: paged_attention(q, view, D ** -0.5),
                     "C": lambda: native.read_fp_view(qh, view, None),
                     "sdpa": lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)}
            hot = {name: median_us(fn, args.calls, None) for name, fn in cases.items()}
            cold = {name: median_us(fn, args.calls, flush) for name, fn in cases.items()}
            want = cases["sdpa"]().transpose(1, 2).reshape(batch, H, G, D)
            diff = (cases["C"]().permute(1, 0, 2, 3) - want).abs().max().item()
            print(f"| {tokens} | {batch} | {hot['eager']:.0f} | {hot['C']:.0f} | {hot['sdpa']:.0f} "
                  f"| {cold['eager']:.0f} | {cold['C']:.0f} | {cold['sdpa']:.0f} | {cold['C'] / cold['eager']:.2f} "
                  f"| {diff:.1e} |", flush=True)
            cache.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
