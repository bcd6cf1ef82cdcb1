"""hf_pagedkv: a paged, refcounted KV cache for Hugging Face transformers.

The names below are the whole top-level API. Retention policies live in `hf_pagedkv.retention` (`SinkWindow`,
`SnapKV`, `KVzip`, ...), the other errors in `hf_pagedkv.errors`, and every other class in the module it is named
after (`hf_pagedkv.adapter.paged_layer.PagedLayer`, `hf_pagedkv.observe.pool_stats.PoolStats`, ...).

NOTE: ``import hf_pagedkv`` loads these names at once, which registers the ``"hf_pagedkv"`` attention implementation
in transformers. Only under the ``hf-pagedkv`` command (the top-level ``hf_pagedkv_cli`` module) does the face load on
first use, so that ``--help`` and argument errors answer without importing torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hf_pagedkv import retention
    from hf_pagedkv._compat import cache_kwargs
    from hf_pagedkv.adapter.compress import compress_context
    from hf_pagedkv.adapter.generation import generate
    from hf_pagedkv.adapter.paged_cache import PagedCache
    from hf_pagedkv.config import QuantConfig
    from hf_pagedkv.errors import CacheReleasedError, PoolExhaustedError
    from hf_pagedkv.pool.block_pool import BlockPool
    from hf_pagedkv.serving import Engine, generate_batch


def _load() -> None:
    """Import the public API into this module (once)."""
    import hf_pagedkv.attention  # noqa: F401  registers the "hf_pagedkv" attention implementation
    from hf_pagedkv._compat import cache_kwargs
    from hf_pagedkv.adapter.compress import compress_context
    from hf_pagedkv.adapter.generation import generate
    from hf_pagedkv.adapter.paged_cache import PagedCache
    from hf_pagedkv.config import QuantConfig
    from hf_pagedkv.errors import CacheReleasedError, PoolExhaustedError
    from hf_pagedkv.pool.block_pool import BlockPool
    from hf_pagedkv.serving import Engine, generate_batch

    retention = importlib.import_module("hf_pagedkv.retention")  # not `from hf_pagedkv import`: no __getattr__ loop
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


if "hf_pagedkv_cli" not in sys.modules:  # a library import; the `hf-pagedkv` command loads on first use
    _load()
