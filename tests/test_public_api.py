"""The top-level API is a short, pinned list; everything else is imported from the module that defines it."""

import importlib

import pytest

import hf_pagedkv

PUBLIC = ["BlockPool", "CacheReleasedError", "Engine", "PagedCache", "PoolExhaustedError", "QuantConfig",
          "cache_kwargs", "compress_context", "generate", "generate_batch", "retention"]

# names that moved off the top level, and the module each is imported from now
MOVED = {
    "KVzip": "hf_pagedkv.retention", "KeyDiff": "hf_pagedkv.retention", "KeyNorm": "hf_pagedkv.retention",
    "PyramidKV": "hf_pagedkv.retention", "SinkWindow": "hf_pagedkv.retention", "SnapKV": "hf_pagedkv.retention",
    "RetentionPolicy": "hf_pagedkv.retention", "RetentionStats": "hf_pagedkv.retention",
    "CacheOffloadedError": "hf_pagedkv.errors", "InvariantError": "hf_pagedkv.errors",
    "BlockHash": "hf_pagedkv.blocks.prefix_index", "PagedLayer": "hf_pagedkv.adapter.paged_layer",
    "PoolStats": "hf_pagedkv.observe.pool_stats",
}


def test_all_is_pinned():
    # adding a top-level name is an API decision: change PUBLIC here and the README together
    assert sorted(hf_pagedkv.__all__) == sorted(PUBLIC)
    assert len(set(hf_pagedkv.__all__)) == len(hf_pagedkv.__all__)


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from hf_pagedkv import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == sorted(PUBLIC)
    assert namespace["retention"] is importlib.import_module("hf_pagedkv.retention")
    assert namespace["PagedCache"].__module__ == "hf_pagedkv.adapter.paged_cache"


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_come_from_their_module(name):
    assert name not in hf_pagedkv.__all__
    assert getattr(importlib.import_module(MOVED[name]), name).__name__ == name


def test_retention_policies_under_hf_pagedkv_retention():
    policy = hf_pagedkv.retention.SinkWindow(sink_tokens=4, window=16)
    assert isinstance(policy, hf_pagedkv.retention.RetentionPolicy)
    assert (policy.sink_tokens, policy.window) == (4, 16)
