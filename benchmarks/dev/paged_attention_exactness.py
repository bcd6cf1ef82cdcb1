"""Max |logit difference| between the ``"hf_pagedkv"`` attention and `sdpa` on the tiny test models (the numbers in
docs/paged_attention.md, Exactness): greedy, left-padded batch, beams, forks; fp and quantized pools.

    python benchmarks/dev/paged_attention_exactness.py --tile-tokens 8      # several tiles per read (block size 4)

The reference is the same model with ``attn_implementation="sdpa"`` and the same kind of PagedCache ("de-quantize,
then sdpa" for quantized pools). Tokens must be identical; the script says so when they are not.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hf_pagedkv.attention.attention_function as attention_function  # noqa: E402
from tests.attention.test_paged_attention import decode_forks, run  # noqa: E402
from tests.conftest import VOCAB, tiny_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tile-tokens", type=int, default=attention_function.DEFAULT_TILE_TOKENS)
    args = ap.parse_args(argv)
    attention_function.DEFAULT_TILE_TOKENS = args.tile_tokens
    torch.set_num_threads(1)
    worst = {"fp": 0.0, "quantized": 0.0}
    for name in ["llama", "gemma3"]:
        model = tiny_model(name)
        for quant in [None, "k8v8", "k8v4", "k4v4"]:
            x = torch.randint(3, VOCAB, (1, 21), generator=torch.Generator().manual_seed(1))
            xb = torch.randint(3, VOCAB, (3, 18), generator=torch.Generator().manual_seed(2))
            mask = torch.ones_like(xb)
            mask[0, :5], mask[2, :11] = 0, 0
            xb[mask == 0] = 0
            xs = torch.randint(3, VOCAB, (1, 15), generator=torch.Generator().manual_seed(3))
            res = []
            for label, a, kw in [("greedy", (x,), {}), ("left-padded", (xb, mask), {}),
                                 ("beams", (xs,), dict(num_beams=3))]:
                r, g = run(model, "sdpa", quant, *a, **kw), run(model, "hf_pagedkv", quant, *a, **kw)
                d = (r[1] - g[1]).abs().max().item()
                worst["fp" if quant is None else "quantized"] = max(worst["fp" if quant is None else "quantized"], d)
                res.append(f"{label} {d:.1e}{'' if torch.equal(r[0], g[0]) else ' (TOKENS DIFFER)'}")
            r, g = decode_forks(model, "sdpa", quant), decode_forks(model, "hf_pagedkv", quant)
            d = (r - g).abs().max().item()
            worst["fp" if quant is None else "quantized"] = max(worst["fp" if quant is None else "quantized"], d)
            res.append(f"forks {d:.1e}")
            print(f"{name} {quant or 'fp'}: " + "; ".join(res))
    print(f"max |logit difference|: fp pools {worst['fp']:.1e}, quantized pools {worst['quantized']:.1e} "
          f"(tiles of {args.tile_tokens} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
