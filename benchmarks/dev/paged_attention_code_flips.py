"""Why a quantized pool's logits can differ by more than fp rounding between ``"hf_pagedkv"`` and `sdpa`: the tiny
Llama, k8v8, beam search (3 beams, 15-token prompt, 10 new tokens, block size 4), once per attention.

    python benchmarks/dev/paged_attention_code_flips.py

Prints the max |logit difference| per generated step and, per layer, how many stored codes differ between the two
runs. Each attention call agrees with `sdpa` over the same codes within fp32 rounding (tests/attention checks
1e-5 per call); but the K/V a later step encodes come out of layers whose outputs differ by ~1e-7, and an element
that lies within that distance of a rounding boundary gets the neighbouring code (one step, about absmax / 254 for
int8). From then on the two caches hold different values, and the logits differ by what one code step makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hf_pagedkv import PagedCache, cache_kwargs  # noqa: E402
from tests.conftest import VOCAB, tiny_model  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    model = tiny_model("llama")
    x = torch.randint(3, VOCAB, (1, 15), generator=torch.Generator().manual_seed(3))
    res = {}
    for impl in ("sdpa", "hf_pagedkv"):
        model.set_attn_implementation(impl)
        cache = PagedCache(config=model.config, quant="k8v8", block_size=4, debug=True)
        with torch.no_grad():
            out = model.generate(x, **cache_kwargs(cache), do_sample=False, max_new_tokens=10, output_logits=True,
                                 return_dict_in_generate=True, num_beams=3)
        store = cache.pool.groups[0].store
        codes = {layer: [t.materialize().view(torch.int8).int() for t in store.codes[layer]] for layer in store.specs}
        res[impl] = (out.sequences, torch.stack(out.logits, 1), codes)
        cache.release()
    model.set_attn_implementation("sdpa")
    (s0, l0, c0), (s1, l1, c1) = res["sdpa"], res["hf_pagedkv"]
    print("tokens identical:", torch.equal(s0, s1))
    print("max |logit difference| per step:", " ".join(f"{d:.1e}" for d in (l0 - l1).abs().amax((0, 2)).tolist()))
    for layer in c0:
        for half, name in enumerate(("key", "value")):
            a, b = c0[layer][half], c1[layer][half]
            if not torch.equal(a, b):
                print(f"layer {layer} {name} codes: {int((a != b).sum())} of {a.numel()} differ, by at most "
                      f"{int((a - b).abs().max())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
