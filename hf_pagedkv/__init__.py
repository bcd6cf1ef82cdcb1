"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers."""

from .block_pool import BlockPool, PoolStats
from .cache import PagedCache
from .config import QuantConfig
from .errors import CacheReleasedError, InvariantError, PoolExhaustedError
from .layer import PagedLayer

__all__ = [
    "BlockPool",
    "CacheReleasedError",
    "InvariantError",
    "PagedCache",
    "PagedLayer",
    "PoolExhaustedError",
    "PoolStats",
    "QuantConfig",
]
__version__ = "0.1.0"
