"""Why a batch read through the default `sdpa` path cannot beat `DynamicCache`: both copy the history, one layer.

    OMP_NUM_THREADS=1 python benchmarks/dev/read_vs_cat.py                  # batch 64, 80 tokens, 3 KV heads x 64
    OMP_NUM_THREADS=1 python benchmarks/dev/read_vs_cat.py --batch 32 --tokens 2048

Times (best process time of `--reps` rounds of `--calls` calls, one thread, microseconds per call) of what each
cache does to hand attention a contiguous `[batch, heads, tokens, head_dim]` fp32 tensor: `DynamicCache`'s
`torch.cat` of the history and the new token; `PageStore.read_blocks`'s `index_select` of one `head_dim` row per
token from a pool laid out `[heads * slots, head_dim]` (rows of a batch `block_size`-aligned and apart, as a
prefill lays them out); the same by whole blocks; and `.contiguous()` of a strided view of the same pool. All four
move the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.dev.code_attention_parts import best  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    B, H, T, D, bs = args.batch, args.heads, args.tokens, args.head_dim, args.block_size
    per_row = -(-(T + bs) // bs) * bs  # slots per row, whole blocks with room to grow
    slots = B * per_row
    old, new = torch.randn(B, H, T - 1, D), torch.randn(B, H, 1, D)
    pool = torch.randn(H * slots, D)  # [heads * slots, head_dim]: one storage segment of a page store
    rows = (torch.arange(H).view(1, H, 1) * slots + torch.arange(B).view(B, 1, 1) * per_row
            + torch.arange(T).view(1, 1, T)).reshape(-1)
    nb = -(-T // bs)
    blocks = pool.view(H * slots // bs, bs * D)
    block_rows = (torch.arange(H).view(1, H, 1) * (slots // bs) + torch.arange(B).view(B, 1, 1) * (per_row // bs)
                  + torch.arange(nb).view(1, 1, nb)).reshape(-1)
    view = pool.view(H, B, per_row, D)[:, :, :T].transpose(0, 1)  # [B, H, T, D], strided
    print(f"batch {B}, {T} tokens, {H} heads x {D}, fp32, one thread: us per call (best of {args.reps} x "
          f"{args.calls}, process time)")
    for name, fn in (("DynamicCache: torch.cat(history, new token)", lambda: torch.cat([old, new], 2)),
                     ("PagedCache: index_select of token rows", lambda: pool.index_select(0, rows)),
                     ("index_select of whole blocks", lambda: blocks.index_select(0, block_rows)),
                     ("strided view .contiguous()", lambda: view.contiguous())):
        fn()
        print(f"  {name}: {best(fn, args.calls, args.reps):.1f}")


if __name__ == "__main__":
    main()
