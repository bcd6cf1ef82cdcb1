"""Exceptions raised by hf_pagedkv."""


class PoolExhaustedError(RuntimeError):
    """A fixed-size `BlockPool` has too few free blocks for a request.

    The pool is left exactly as it was before the request. The message says how many blocks were needed,
    how many were free, and which setting to change (`num_blocks` / `max_memory`, or `num_blocks=None` to grow).
    """


class InvariantError(RuntimeError):
    """`BlockPool.check_invariants()` found broken bookkeeping; the message names the invariant and the block ids."""


class CacheReleasedError(RuntimeError):
    """A `PagedCache` was used after `release()`; create a new cache (or `fork()` before releasing)."""
