"""The regression matrix for block boundaries: block sizes {1, 4, 16, 32, 64} x prompt lengths {1, B-1, B, B+1, 2B}
(plus 2048 at B=16), batch 1 and 3, decoding across at least one boundary.

For every case: the same tokens and logits as `DynamicCache`; after every forward step, every row owns exactly
``ceil(n / B)`` blocks (``k``, never ``k + 1``, at ``n = k * B``) and the pool invariants hold; release frees every
block; the freed (NaN-poisoned) blocks are then reused by an unrelated sequence whose output equals a fresh run.
"""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache
from tests.conftest import ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZES = [1, 4, 16, 32, 64]


def cases():
    for B in BLOCK_SIZES:
        for n in sorted({1, B - 1, B, B + 1, 2 * B} - {0}):
            for batch in (1, 3):
                yield pytest.param(B, n, batch, id=f"B{B}-n{n}-batch{batch}")


def new_tokens_across_a_boundary(n: int, B: int) -> int:
    """New tokens so that the cache (n + new - 1 tokens) passes the next multiple of B, and by one more token."""
    return (B - n % B) % B + 2


def generate(model, x, cache, new):
    return model.generate(x, past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)


def assert_same_output(out, ref):
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


class BlockCountWatcher:
    """A forward hook checking, after every step, that each row owns exactly ceil(len / B) blocks."""

    def __init__(self, model, cache: PagedCache):
        self.cache, self.lengths = cache, []
        self.handle = model.register_forward_hook(self)

    def __call__(self, *args):
        n = self.cache.get_seq_length()
        want = math.ceil(n / self.cache.block_size)
        assert [len(row) for row in self.cache.block_tables()] == [want] * self.cache.num_rows, (n, want)
        self.cache.pool.check_invariants()
        self.lengths.append(n)

    def __exit__(self, *exc):
        self.handle.remove()

    def __enter__(self):
        return self


@pytest.mark.parametrize("B,n,batch", cases())
def test_block_boundary(B, n, batch):
    model = tiny_model("llama")
    new = new_tokens_across_a_boundary(n, B)
    x = ids(batch, n, seed=n)
    ref = generate(model, x, DynamicCache(), new)

    pool = BlockPool(block_size=B, debug=True)
    cache = PagedCache(pool=pool, debug=True)
    with BlockCountWatcher(model, cache) as watch:
        out = generate(model, x, cache, new)
    assert_same_output(out, ref)
    # The steps covered the prompt, an exact multiple of B, and one token past it.
    total = n + new - 1
    assert watch.lengths == [n] + list(range(n + 1, total + 1))
    assert any(m % B == 0 for m in watch.lengths)
    assert math.ceil(total / B) > math.ceil(n / B)  # at least one block boundary crossed
    # Distinct prompts share nothing: batch x ceil(total / B) blocks.
    used = {b for row in cache.block_tables() for b in row}
    assert pool.stats().blocks_in_use == len(used) == batch * math.ceil(total / B)
    assert pool.stats().tokens_stored == batch * total

    # Release: no block is in use, and the freed blocks are poisoned.
    cache.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0
    num_blocks = pool.num_blocks

    # Reuse the freed blocks for an unrelated sequence (other tokens, other length): same output as a fresh run.
    y = ids(batch, n, seed=1000 + n)
    new_y = max(2, new - 1)  # n + new_y - 1 <= n + new - 1 tokens: fits in the freed blocks
    reused = PagedCache(pool=pool, debug=True)
    with BlockCountWatcher(model, reused):
        out_y = generate(model, y, reused, new_y)
    assert_same_output(out_y, generate(model, y, DynamicCache(), new_y))
    assert {b for row in reused.block_tables() for b in row} <= used  # it really ran in the freed blocks
    assert pool.num_blocks == num_blocks
    reused.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_long_prompt_2048_at_block_16():
    model = tiny_model("llama")
    B, n, new = 16, 2048, 3
    x = ids(1, n, seed=2048)
    ref = generate(model, x, DynamicCache(), new)
    cache = PagedCache(block_size=B, debug=True)
    with BlockCountWatcher(model, cache) as watch:
        out = generate(model, x, cache, new)
    assert_same_output(out, ref)
    assert watch.lengths == [2048, 2049, 2050]
    assert cache.block_tables() == [list(range(129))]  # consecutive ids: the row is read as a view
    assert cache.pool.stats().tokens_stored == 2050
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0
    cache.pool.check_invariants()
