"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers."""

from hf_pagedkv._compat import cache_kwargs
from hf_pagedkv import attention  # noqa: F401  registers the "hf_pagedkv" attention implementation
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
__version__ = "0.1.0"
