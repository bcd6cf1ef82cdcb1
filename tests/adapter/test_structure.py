"""The adapter's shape: `PagedCache` is the transformers face and its collaborators use the parts it owns."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import hf_pagedkv
from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv._compat import Cache
from hf_pagedkv.adapter.cache_rows import CacheRows
from hf_pagedkv.adapter.step_runner import StepRunner

ADAPTER = Path(hf_pagedkv.__file__).parent / "adapter"
MAX_CLASS_LINES = 400

# the face: transformers' `Cache` API, the hf_pagedkv API (prefix caching, forks, host tier, stats) and nothing that
# only the cache's collaborators call (they use `cache.rows`, `cache.runner`, `cache.retention`)
FACE = {
    "update", "get_seq_length", "get_mask_sizes", "activate_past_recording", "set_padding", "crop", "reorder_cache",
    "batch_select_indices", "batch_repeat_interleave", "reset", "fork", "from_prefix", "publish", "release",
    "offload", "prefetch", "check_invariants", "block_tables", "retention_stats",
}


def test_no_adapter_class_is_over_400_lines():
    sizes = {}
    for path in sorted(ADAPTER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                sizes[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert "paged_cache.py:PagedCache" in sizes and "step_runner.py:StepRunner" in sizes
    assert {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES} == {}


def test_paged_cache_public_methods_are_exactly_the_face():
    own = {name for name, value in vars(PagedCache).items() if not name.startswith("_")
           and (inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod)))}
    assert own == FACE
    # every other public method comes from transformers' Cache, unchanged
    inherited = {name for name in dir(PagedCache) if not name.startswith("_") and name not in FACE
                 and callable(inspect.getattr_static(PagedCache, name))}
    assert {name for name in inherited if inspect.getattr_static(PagedCache, name)
            is not inspect.getattr_static(Cache, name, None)} == set()


def test_collaborators_get_the_owned_parts():
    cache = PagedCache(block_size=4)
    try:
        assert isinstance(cache.rows, CacheRows) and isinstance(cache.runner, StepRunner)
        assert cache.runner.rows is cache.rows and cache.runner.layers is cache.layers
        assert cache.retention is None and cache.rows.owner == cache.seq_id
    finally:
        cache.release()


def test_constructor_is_keyword_only_and_forwards_new_pool_settings():
    with pytest.raises(TypeError, match="positional"):
        PagedCache(16)
    cache = PagedCache(block_size=8, num_blocks=6, prefix_caching=True, quant="k8v4")
    try:
        assert (cache.pool.block_size, cache.pool.growable, cache.pool.prefix_caching) == (8, False, True)
        assert cache.pool.quant.name == "k8v4" and cache.block_size == 8
    finally:
        cache.release()
    with pytest.raises(TypeError, match=r"PagedCache got 'blocksize': neither a PagedCache argument"):
        PagedCache(blocksize=8)
    pool = BlockPool(block_size=4)
    with pytest.raises(ValueError, match="`host_memory`/`prefix_caching` configure a new pool; set them on the"):
        PagedCache(pool=pool, prefix_caching=True, host_memory="1MiB")
    assert pool.stats().blocks_in_use == 0
