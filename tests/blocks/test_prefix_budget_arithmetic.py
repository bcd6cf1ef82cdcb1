"""`PrefixCacheBudget`: how many idle cached blocks a budget allows (pure Python, no tensors). The pool's use of it
is tested in tests/pool/test_prefix_budget.py."""

import pytest

from hf_pagedkv.blocks.prefix_budget import PrefixCacheBudget

pytestmark = pytest.mark.bookkeeping


def test_budget_arithmetic():
    assert PrefixCacheBudget("1MiB", growable=True).max_idle_blocks(10, 1000) == 1048
    assert PrefixCacheBudget(None, growable=True).max_idle_blocks(10, 2**20) == 1024
    assert PrefixCacheBudget(None, growable=False).max_idle_blocks(37, 5) == 37
    assert PrefixCacheBudget(0.5, growable=True).max_idle_blocks(37, 5) == 18
    assert PrefixCacheBudget("1GiB", growable=True).max_idle_blocks(10, 0) is None  # no layer known yet
