"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers."""

from ._compat import cache_kwargs
from .block_pool import BlockPool, PoolStats
from .cache import PagedCache
from .config import QuantConfig
from .errors import CacheReleasedError, InvariantError, PoolExhaustedError
from .generation import generate
from .layer import PagedLayer
from .prefix_index import BlockHash

__all__ = [
    "BlockHash",
    "BlockPool",
    "CacheReleasedError",
    "InvariantError",
    "PagedCache",
    "PagedLayer",
    "PoolExhaustedError",
    "PoolStats",
    "QuantConfig",
    "cache_kwargs",
    "generate",
]
__version__ = "0.1.0"
