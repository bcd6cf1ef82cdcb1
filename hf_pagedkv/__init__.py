"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers.

The names below are the whole top-level API. Retention policies live in `hf_pagedkv.retention` (`SinkWindow`,
`SnapKV`, `KVzip`, ...), the other errors in `hf_pagedkv.errors`, and every other class in the module it is named
after (`hf_pagedkv.adapter.paged_layer.PagedLayer`, `hf_pagedkv.observe.pool_stats.PoolStats`, ...).
"""

from hf_pagedkv._compat import cache_kwargs
from hf_pagedkv import attention  # noqa: F401  registers the "hf_pagedkv" attention implementation
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.adapter.paged_cache import PagedCache
from hf_pagedkv.config import QuantConfig
from hf_pagedkv.errors import CacheReleasedError, PoolExhaustedError
from hf_pagedkv.adapter.generation import generate
from hf_pagedkv.adapter.compress import compress_context
from hf_pagedkv import retention
from hf_pagedkv.serving import Engine, generate_batch

__all__ = [
    "BlockPool",
    "CacheReleasedError",
    "Engine",
    "PagedCache",
    "PoolExhaustedError",
    "QuantConfig",
    "cache_kwargs",
    "compress_context",
    "generate",
    "generate_batch",
    "retention",
]
__version__ = "0.1.0"
