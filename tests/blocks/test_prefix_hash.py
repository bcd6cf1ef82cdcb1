"""`hash_blocks`: the chain hash that names a full block by its whole prefix (pure Python, no tensors). The prefix
index on a pool is tested in tests/pool/test_prefix_index.py."""

import pytest

from hf_pagedkv.blocks.prefix_index import BlockHash, hash_blocks

pytestmark = pytest.mark.bookkeeping

B = 4
KEY = b"model-a"


def test_chain_hash_names_the_whole_prefix():
    a = hash_blocks(list(range(12)), B, KEY)
    assert [h.num_tokens for h in a] == [4, 8, 12] and all(isinstance(h, BlockHash) for h in a)
    assert len(hash_blocks(list(range(11)), B, KEY)) == 2  # the partial block is never hashed
    # same tokens in block 1, different block 0: the chain makes block 1's hash differ too
    b = hash_blocks([99] + list(range(1, 12)), B, KEY)
    assert a[1] != b[1] and a[2] != b[2]
    # anything else that changes the K/V (model, quantization) is part of the key
    assert hash_blocks(list(range(12)), B, b"model-b")[0] != a[0]
    assert hash_blocks(list(range(12)), B, KEY) == a  # deterministic
