"""The engine on the real SmolLM2-135M (fp32): greedy tokens of mixed-length requests in a pool that preempts equal
each prompt's solo `generate`."""

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, Engine, cache_kwargs

pytestmark = pytest.mark.model


def test_smollm_requests_equal_solo_under_preemption(smollm):
    model, _ = smollm
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (15, 16, 17, 40, 63)]
    pool = BlockPool(block_size=16, num_blocks=10, debug=True)  # 160 tokens for 151 prompt + 5 x 5 new
    engine = Engine(model, pool, max_batch_tokens=48)
    rids = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    while engine.has_unfinished:
        engine.step()
        pool.check_invariants()
    assert engine.stats().num_preemptions > 0
    for rid, p in zip(rids, prompts):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             **cache_kwargs(DynamicCache(config=model.config)))
        assert engine.output(rid).generated_tokens == ref[0, len(p):].tolist()
    assert pool.stats().blocks_in_use == 0
