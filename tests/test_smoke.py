import torch
from transformers import DynamicCache

from hf_pagedkv import PagedCache
from tests.conftest import ids, tiny_model


def test_greedy_matches_dynamic_cache():
    model = tiny_model("llama")
    x = ids(1, 21)
    ref = model.generate(x, past_key_values=DynamicCache(), max_new_tokens=12, do_sample=False)
    with PagedCache(block_size=4, debug=True) as cache:
        out = model.generate(x, past_key_values=cache, max_new_tokens=12, do_sample=False)
        assert cache.get_seq_length() == 21 + 12 - 1
    assert torch.equal(ref, out)
    assert cache.pool.stats().blocks_in_use == 0
