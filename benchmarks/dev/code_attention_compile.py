"""Whether `torch.compile` (inductor, CPU) pays for the quantized decode read: one layer of SmolLM2 shapes (3
key/value heads, 3 query rows per head, head_dim 64, 32-token blocks), random codes, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/code_attention_compile.py --quant k4v4 --tokens 96 2048 4096 \
        --batch 1 8 --variants whole-fold [--cold]

Variants, each against the eager `code_attention` on the same read (max |diff| of the outputs printed):

- ``whole-mm``: the whole read (keys decoded, scores, softmax, folded value products) in one compiled function;
  inductor fuses the unpack and affine passes into one kernel each and calls a matmul for the products.
- ``whole-red``: the same with the two products written as broadcast multiply + sum, so inductor emits one fused
  reduction loop per product; the decode is repeated for every query row.
- ``whole-fold`` (kept: `hf_pagedkv.attention.compiled_read.fused_code_read`, ``"hf_pagedkv_compiled"``): key
  scales folded into the query per block, both products as reductions over the packed codes' parts (int4: the
  two nibbles; int8: the bytes as offset binary), so no fp32 tile of codes is written.

Both are compiled once with ``dynamic=True`` (the block count grows by one every 32 tokens; one graph must serve
every step): the first call per process is timed as the compile time (inductor's on-disk cache warm or cold, see
``--cold``); steady-state times are the best of `--reps` runs of `--calls` calls, eager and compiled interleaved.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from benchmarks.dev.code_attention_parts import B, D, H, R, best, make_read
from hf_pagedkv.attention.compiled_read import fused_code_read
from hf_pagedkv.attention.paged_attention import NEGLIGIBLE, code_attention


def _unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[H, batch, n, code_size]` (uint8) -> integer values `[H, batch, n, B, D]` as fp32 (token order)."""
    Hh, b, n, _ = codes.shape
    if bits == 8:
        return codes.view(torch.int8).view(Hh, b, n, B, D).float()
    c = codes.view(Hh, b, n, B // 2, D)
    return torch.cat(((c & 15), (c >> 4)), dim=3).float()  # token halves: low nibble first


def _whole(qh, kcodes, kscales, vcodes, vscales, fk, fv, kbits: int, vbits: int, sink: int, reduce: bool):
    Hh, b, n, _ = kcodes.shape
    kq = _unpack(kcodes, kbits)  # [H, b, n, B, D]
    ks = kscales.float()
    if kbits == 8:
        k = kq * ks.unsqueeze(3)
    else:
        s, z = ks.chunk(2, -1)
        k = kq * s.unsqueeze(3) + z.unsqueeze(3)
    k = k.reshape(Hh, b, n * B, D)
    if reduce:
        enc = (qh.unsqueeze(3) * k.unsqueeze(2)).sum(-1)  # [H, b, rows, n * B]
    else:
        enc = torch.matmul(qh, k.transpose(-1, -2))
    scores = torch.cat((enc, torch.matmul(qh, fk.transpose(-1, -2))), -1)  # [.., encoded | tail | sink]
    if sink:
        scores[..., :sink] = float("-inf")
    m = scores.amax(-1, keepdim=True)
    p = torch.where(scores - m < NEGLIGIBLE, 0.0, torch.exp(scores - m))
    l = p.sum(-1, keepdim=True)
    out = torch.matmul(p[..., n * B:], fv)
    vq = _unpack(vcodes, vbits).reshape(Hh, b, n * B, D)
    vs = vscales.float()
    pe = p[..., : n * B]
    if vbits == 8:
        w, z = pe * vs.reshape(Hh, b, 1, n * B), None
    else:
        s, z = vs.chunk(2, -1)
        w = pe * s.reshape(Hh, b, 1, n * B)
    if reduce:
        out = out + (w.unsqueeze(-1) * vq.unsqueeze(2)).sum(3)
    else:
        out = out + torch.matmul(w, vq)
    if z is not None:
        out = out + (pe * z.reshape(Hh, b, 1, n * B)).sum(-1, keepdim=True)
    return out / l


def _compiled(name: str, kbits: int, vbits: int):
    """`name`'s function of `(qh, read)`, compiled once (its own code object: no guard shared between variants)."""
    if name == "whole-mm":
        def fn(qh, r):
            return _whole(qh, *r.codes[:1], *r.scales[:1], r.codes[1], r.scales[1], *r.full, kbits, vbits,
                          r.sink_end, False)
    elif name == "whole-red":
        def fn(qh, r):
            return _whole(qh, *r.codes[:1], *r.scales[:1], r.codes[1], r.scales[1], *r.full, kbits, vbits,
                          r.sink_end, True)
    elif name == "whole-fold":
        def fn(qh, r):
            return fused_code_read(qh, r.codes[0], r.scales[0], r.codes[1], r.scales[1], *r.full, None, kbits,
                                   vbits, B, r.sink_end)
    else:
        raise ValueError(f"unknown variant {name!r}")
    return torch.compile(fn, dynamic=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="k4v4", help="k<bits>v<bits>, bits 8 or 4")
    ap.add_argument("--tokens", type=int, nargs="+", default=[96, 2048, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variants", nargs="+", default=["whole-mm", "whole-red", "whole-fold"])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="a fresh, empty inductor cache directory (cold compile)")
    args = ap.parse_args(argv)
    if args.cold:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    torch.set_num_threads(1)
    kbits, vbits = int(args.quant[1]), int(args.quant.split("v")[1])
    fns = {name: _compiled(name, kbits, vbits) for name in args.variants}
    first = {}
    print(f"{args.quant}, one thread, best of {args.reps} x {args.calls} calls (process time, us per call)")
    print("| tokens | batch | eager us | " + " | ".join(f"{v} us | {v} max diff" for v in args.variants) + " |")
    for tokens in args.tokens:
        for batch in args.batch:
            read = make_read(kbits, vbits, tokens, batch)
            qh = torch.randn(H, batch, R, D)
            ref = code_attention(qh, read, None, 2048)
            row = [f"{tokens}", f"{batch}"]
            res = {}
            for name, fn in fns.items():
                t0 = time.perf_counter()
                out = fn(qh, read)
                dt = time.perf_counter() - t0
                first.setdefault(name, dt)
                res[name] = float((out - ref).abs().max())
            times = {"eager": float("inf"), **{v: float("inf") for v in fns}}
            for _ in range(args.reps):  # interleaved: the load of the shared machine hits every variant alike
                times["eager"] = min(times["eager"], best(lambda: code_attention(qh, read, None, 2048), args.calls, 1))
                for name, fn in fns.items():
                    times[name] = min(times[name], best(lambda: fn(qh, read), args.calls, 1))
            row.append(f"{times['eager']:.1f}")
            for name in fns:
                row += [f"{times[name]:.1f}", f"{res[name]:.1e}"]
            print("| " + " | ".join(row) + " |", flush=True)
    for name, dt in first.items():
        print(f"first call (compile) of {name}: {dt:.1f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
