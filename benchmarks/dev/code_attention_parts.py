"""Where the time of `code_attention` goes: process time of each part for one layer of SmolLM2 shapes (3 key/value
heads, 3 query rows per head, head_dim 64, 32-token blocks), on random codes, warm caches.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/dev/code_attention_parts.py --quant k4v4 --tokens 2048 --batch 1

Each part is timed alone (best of `--reps` repetitions of `--calls` calls: the machine is shared, and noise only
adds time), so the parts need not sum to the whole call (which also pays Python and dispatch, about 3 us per torch
call here, and memory traffic between parts). "decode" + "q @ decoded k^T" is the key path `code_attention` takes;
"fold" and the table lookup are alternatives measured against it and not kept
(`fold_key_scores`: the per-block key scales folded into the query, ``(q * s_b) . c_t + q . z_b``, one batched
product over every block; int4 unpack by a `[256, 2]` table indexed by the packed byte).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_pagedkv.attention.paged_attention import _exp_scores, code_attention
from hf_pagedkv.storage.code_read import CodeRead
from hf_pagedkv.storage.codecs import make_codec

H, R, D, B = 3, 3, 64, 32  # SmolLM2-135M: key/value heads, query heads per key/value head, head_dim; block size


def best(fn, calls: int, reps: int) -> float:
    """Best process time of one call, in microseconds, over `reps` runs of `calls` calls."""
    out = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        out = min(out, (time.process_time() - t0) / calls * 1e6)
    return out


def fold_key_scores(qh: torch.Tensor, codec, codes: torch.Tensor, scales: torch.Tensor, buf: torch.Tensor,
                    dst: torch.Tensor) -> None:
    """Key scores `[H, batch, rows, nt * B]` into `dst` with the per-channel scales of each block folded into the
    query: ``q . (s_b c_t + z_b) = (q * s_b) . c_t + q . z_b`` (buf: `[H, batch, nt, B, dk]` scratch)."""
    Hh, batch, nt, Bb, _ = buf.shape
    c = codec.unpack(codes, buf)  # [H, batch, nt, B, dk] integer values
    scale, zero = codec.affine(scales, qh.dtype)  # [H, batch, nt, dk] each (zero None: symmetric)
    w = qh.unsqueeze(2) * scale.unsqueeze(3)  # [H, batch, nt, rows, dk]: the query scaled per block
    s = torch.matmul(w, c.transpose(-1, -2))  # [H, batch, nt, rows, B]: one batched product
    out = dst.view(Hh, batch, qh.shape[2], nt, Bb).transpose(2, 3)  # [H, batch, nt, rows, B] view of the scores
    if zero is None:
        out.copy_(s)
    else:
        torch.add(s, torch.matmul(zero, qh.transpose(-1, -2)).unsqueeze(-1), out=out)


def make_read(kbits: int, vbits: int, tokens: int, batch: int) -> CodeRead:
    """A read of `tokens` tokens: whole encoded blocks, then a one-block tail and the sink token in fp32."""
    g = torch.Generator().manual_seed(0)
    kc, vc = make_codec(f"int{kbits}", "channel"), make_codec(f"int{vbits}", "token")
    n = tokens // B - 1
    (kcodes, kscales), (vcodes, vscales) = (c.encode(torch.randn(H, batch, n, B, D, generator=g)) for c in (kc, vc))
    full = tuple(torch.randn(H, batch, tokens - n * B + 1, D, generator=g) for _ in range(2))
    return CodeRead(0, 0, tokens, B, (D, D), (kc, vc), (kcodes, vcodes), (kscales, vscales), full, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="k4v4", help="k<bits>v<bits>, bits 8 or 4")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    kbits, vbits = int(args.quant[1]), int(args.quant.split("v")[1])
    read = make_read(kbits, vbits, args.tokens, args.batch)
    n, T, batch = read.num_encoded, read.num_encoded * B, args.batch
    kc, vc = read.codecs
    qh = torch.randn(H, batch, R, D)
    buf = torch.empty(H, batch, n, B, D)
    t = {}
    run = lambda name, fn: t.__setitem__(name, best(fn, args.calls, args.reps))  # noqa: E731
    codes, sc = read.codes[0], read.scales[0]
    run("keys: unpack codes to fp32", lambda: kc.unpack(codes, buf))
    run("keys: decode (unpack + scale and zero)", lambda: kc.decode(codes, sc, buf))
    if kbits == 4:  # not kept: both nibbles of each byte as floats from a [256, 2] table, one lookup
        table = torch.stack((torch.arange(256) & 15, torch.arange(256) >> 4), 1).float()  # [256, 2]
        run("keys, not kept: int4 unpack by table lookup (index_select)",
            lambda: table.index_select(0, codes.reshape(-1).int()))
    k = buf.view(H, batch, T, D)
    run("keys: q @ decoded k^T", lambda: torch.matmul(qh, k.transpose(-1, -2)))
    scores = torch.empty(H, batch, R, T + 2)
    run("keys, not kept: fold (unpack, q * s_b, batched product, + q . z_b)",
        lambda: fold_key_scores(qh, kc, codes, sc, buf, scores[..., :T]))
    run("softmax (max, exp, sum)", lambda: _exp_scores(scores.clone()))
    vcodes, vsc = read.codes[1], read.scales[1]
    run("values: unpack codes to fp32", lambda: vc.unpack(vcodes, buf))
    v = buf.view(H, batch, T, D)
    p = torch.rand(H, batch, R, T)
    scale, zero = vc.affine(vsc, torch.float32)
    run("values: (p * s) @ c", lambda: torch.matmul(p * scale.reshape(H, batch, 1, T), v))
    if zero is not None:
        run("values: p @ z", lambda: torch.matmul(p, zero.reshape(H, batch, T, 1)))
    run("whole code_attention call", lambda: code_attention(qh, read, None, 2048))
    print(f"code_attention parts, {args.quant}, {args.tokens} tokens, batch {batch}, one thread, best of {args.reps}")
    for name, us in t.items():
        print(f"  {name:66s} {us:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
