"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers.

NOTE: the package loads on first use, as transformers' own face does: ``import hf_pagedkv`` imports neither torch
nor transformers (so ``hf-pagedkv --help`` answers at once); the first public name read from it
(``from hf_pagedkv import PagedCache``, ``hf_pagedkv.generate``) imports the package, which registers the
``"hf_pagedkv"`` attention implementation in transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hf_pagedkv._compat import cache_kwargs
    from hf_pagedkv.adapter.compress import compress_context
    from hf_pagedkv.adapter.generation import generate
    from hf_pagedkv.adapter.paged_cache import PagedCache
    from hf_pagedkv.adapter.paged_layer import PagedLayer
    from hf_pagedkv.blocks.prefix_index import BlockHash
    from hf_pagedkv.config import QuantConfig
    from hf_pagedkv.errors import CacheOffloadedError, CacheReleasedError, InvariantError, PoolExhaustedError
    from hf_pagedkv.pool.block_pool import BlockPool, PoolStats
    from hf_pagedkv.retention import KVzip, KeyDiff, KeyNorm, PyramidKV, RetentionPolicy, RetentionStats, SinkWindow
    from hf_pagedkv.retention import SnapKV
    from hf_pagedkv.serving import Engine, generate_batch


def _load() -> None:
    """Import the public API into this module (the first read of one of its names does it, once)."""
    import hf_pagedkv.attention  # noqa: F401  registers the "hf_pagedkv" attention implementation
    from hf_pagedkv._compat import cache_kwargs
    from hf_pagedkv.pool.block_pool import BlockPool, PoolStats
    from hf_pagedkv.adapter.paged_cache import PagedCache
    from hf_pagedkv.config import QuantConfig
    from hf_pagedkv.errors import CacheOffloadedError, CacheReleasedError, InvariantError, PoolExhaustedError
    from hf_pagedkv.adapter.generation import generate
    from hf_pagedkv.adapter.paged_layer import PagedLayer
    from hf_pagedkv.blocks.prefix_index import BlockHash
    from hf_pagedkv.adapter.compress import compress_context
    from hf_pagedkv.retention import KVzip, KeyDiff, KeyNorm, RetentionPolicy, RetentionStats, SinkWindow, SnapKV
    from hf_pagedkv.retention import PyramidKV
    from hf_pagedkv.serving import Engine, generate_batch

    globals().update({name: value for name, value in locals().items() if name in __all__})


def __getattr__(name: str):
    if name in __all__:
        _load()
        return globals()[name]
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        _load()  # a subpackage (`hf_pagedkv.serving.Engine` after `import hf_pagedkv`), as when the face was eager
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'hf_pagedkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BlockHash",
    "BlockPool",
    "CacheOffloadedError",
    "CacheReleasedError",
    "Engine",
    "InvariantError",
    "KVzip",
    "KeyDiff",
    "KeyNorm",
    "PagedCache",
    "PagedLayer",
    "PoolExhaustedError",
    "PoolStats",
    "QuantConfig",
    "RetentionPolicy",
    "RetentionStats",
    "SinkWindow",
    "SnapKV",
    "PyramidKV",
    "cache_kwargs",
    "compress_context",
    "generate",
    "generate_batch",
]
