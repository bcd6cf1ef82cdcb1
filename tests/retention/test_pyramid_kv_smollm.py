"""`PyramidKV` through `generate()` on the real SmolLM2-135M-Instruct (30 layers in 4 tiers): a ~300-token document
with a passkey and the question at the end of the prompt, a quarter of it evicted on average -- each tier holds
exactly its own budget's blocks, and the answer is kept. (At this length a ratio of 0.5 leaves the top tier ~60
tokens: it lost a digit of this passkey, as SnapKV lost one of another at 0.5; docs/retention.md.)"""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.retention import PyramidKV
from hf_pagedkv.blocks.block_table import num_blocks_for
from tests.eval_helpers import passkey_example

pytestmark = pytest.mark.model


def test_generate_keeps_the_passkey_with_per_tier_budgets(smollm):
    model, tok = smollm
    ex = passkey_example(tok, 300, depth=50)
    x = torch.tensor([ex["context_ids"] + ex["question_ids"]])
    n = x.shape[1]
    policy = PyramidKV(compression_ratio=0.25)
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    try:
        pool = BlockPool(block_size=16)
        cache = PagedCache(pool=pool, config=model.config, retention=policy, debug=True)
        with torch.no_grad():
            out = model.generate(x, **cache_kwargs(cache), max_new_tokens=6, do_sample=False)
    finally:
        model.set_attn_implementation(before)
    answer = tok.decode(out[0, n:], skip_special_tokens=True)
    assert str(ex["key"]) in answer
    tiers = policy.tiers_of(model.config.num_hidden_layers)
    assert [len(t) for t in tiers] == [8, 8, 7, 7]
    keeps = policy.tier_budgets(int(n * 0.75), n, [len(t) for t in tiers], 16)
    assert keeps[0] > keeps[-1] and all((keeps[0] - k) % 16 == 0 for k in keeps)
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.num_evictions) == (n + 5, 1)
    assert stats.tokens_held_per_layer == tuple(keeps[t] + 5 for t, layers in enumerate(tiers) for _ in layers)
    groups = pool.stats().groups
    for t, layers in enumerate(tiers):  # the tier's kept tokens' blocks only
        assert groups[t].layers == tuple(layers) and groups[t].blocks_in_use == num_blocks_for(keeps[t] + 5, 16)
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
