"""One layer's quantized decode read, side by side: the eager `code_attention`, the C read (`NativeCodeAttention`,
``"hf_pagedkv_compiled"``'s first engine) and, for scale, `sdpa` over the same tokens in fp32 (what a
`DynamicCache` step reads); SmolLM2 shapes (3 key/value heads, 3 query rows each, head_dim 64, 32-token blocks),
random codes, best process time of `--reps` runs of `--calls` calls, the three interleaved.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/native_read.py --tokens 96 2048 4096 --batch 1 8
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.dev.code_attention_parts import D, H, R, best, make_read
from hf_pagedkv.attention.native_read import NativeCodeAttention
from hf_pagedkv.attention.paged_attention import code_attention


def built_native() -> NativeCodeAttention:
    """The C reads, built and loaded; exits saying so when they cannot be built here (or are turned off)."""
    native = NativeCodeAttention()
    if native.load() is None:
        raise SystemExit("the native read could not be built here (see the warning above), or "
                         "HF_PAGEDKV_NATIVE_READ=0 turned it off")
    return native


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quants", nargs="+", default=["k8v8", "k8v4", "k4v4"], help="k<bits>v<bits>, bits 8 or 4")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    native = built_native()
    print("| tokens | batch | cache | eager us | C us | sdpa fp32 us | C / sdpa | max abs diff C - eager |")
    print("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        for batch in args.batch:
            for quant in args.quants:
                kbits, vbits = int(quant[1]), int(quant.split("v")[1])
                read = make_read(kbits, vbits, tokens, batch)
                qh = torch.randn(H, batch, R, D, generator=torch.Generator().manual_seed(1)) * 0.3
                k, v = (torch.randn(H, batch, tokens, D) for _ in range(2))
                diff = (native(qh, read, None) - code_attention(qh, read, None, 2048)).abs().max().item()
                t = {name: float("inf") for name in ("eager", "C", "sdpa")}
                for _ in range(args.reps):  # interleaved: the machine's load moves all three alike
                    t["eager"] = min(t["eager"], best(lambda: code_attention(qh, read, None, 2048), args.calls, 1))
                    t["C"] = min(t["C"], best(lambda: native(qh, read, None), args.calls, 1))
                    t["sdpa"] = min(t["sdpa"], best(lambda: F.scaled_dot_product_attention(qh, k, v, scale=1.0),
                                                    args.calls, 1))
                print(f"| {tokens} | {batch} | {quant} | {t['eager']:.1f} | {t['C']:.1f} | {t['sdpa']:.1f} | "
                      f"{t['C'] / t['sdpa']:.2f} | {diff:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
