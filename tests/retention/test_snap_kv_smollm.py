"""`SnapKV` through `generate()` on the real SmolLM2-135M-Instruct: a 1k-token document with a passkey, the question
at the end of the prompt, half the prompt evicted -- the answer is kept and half the memory is given back."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import SnapKV
from tests.eval_helpers import passkey_example

pytestmark = pytest.mark.model


def test_generate_keeps_the_passkey_with_half_the_prompt_evicted(smollm):
    model, tok = smollm
    ex = passkey_example(tok, 1024, depth=50)
    x = torch.tensor([ex["context_ids"] + ex["question_ids"]])
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    try:
        pool = BlockPool(block_size=16)
        cache = PagedCache(pool=pool, config=model.config, retention=SnapKV(compression_ratio=0.5), debug=True)
        with torch.no_grad():
            out = model.generate(x, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    finally:
        model.set_attn_implementation(before)
    answer = tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)
    assert str(ex["key"]) in answer
    stats = cache.retention_stats()
    kept = int(x.shape[1] * 0.5)
    assert (stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (x.shape[1] + 5, kept + 5, 1)
    assert pool.stats().blocks_in_use == -(-(kept + 5) // 16)  # the kept tokens' blocks only
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
