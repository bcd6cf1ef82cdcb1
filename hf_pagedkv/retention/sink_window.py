"""`SinkWindow`: keep the attention-sink blocks and the blocks of the last `window` tokens (StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass

from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.retention.policy import EvictionPlan, RetentionPolicy, builtin_numbers, check_int


@dataclass(frozen=True)
class SinkWindow(RetentionPolicy):
    """StreamingLLM's cache (Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv
    2309.17453): the first tokens (the attention sinks most heads attend to) plus a window of recent tokens, so a
    stream of any length holds a bounded cache. Middle blocks are freed whole as the sequence grows, without touching
    a tensor; keys keep the RoPE of their original positions (the cache keeps counting every token seen)::

        logical blocks before a step:  [ sink | m1 | m2 | w1 | w2 | w3 (partial) ]    window 40, block size 16
        freed:                                  m1   m2                        (wholly before the last 39 tokens)
        kept:                          [ sink | w1 | w2 | w3 ] + the step's new tokens

    Eviction is by whole blocks: the first ``ceil(sink_tokens / block_size)`` blocks are kept whole, and the blocks
    holding the last ``window - 1`` tokens before a step, so each new token sees at least the last `window` tokens
    (itself included) and at most ``block_size - 1`` more; every token of a kept block stays visible. With
    ``block_size == sink_tokens`` the sinks are exactly StreamingLLM's. ``sink_tokens=0`` is a plain window (which
    StreamingLLM shows collapsing once the first tokens are gone).

    Args:
        sink_tokens (`int`, *optional*, defaults to 4): tokens at the start of the sequence kept forever (rounded up
            to whole blocks).
        window (`int`): recent tokens kept, at least 1.

    Raises:
        ValueError: `sink_tokens` not an int >= 0, or `window` not an int >= 1.

    Example:

    ```python
    >>> from hf_pagedkv import PagedCache, cache_kwargs
    >>> from hf_pagedkv.retention import SinkWindow
    >>> cache = PagedCache(config=model.config, retention=SinkWindow(sink_tokens=4, window=1024))
    >>> out = model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=4096)
    >>> cache.retention_stats()   # tokens seen vs held
    ```
    """

    sink_tokens: int = 4
    window: int = 1024

    name = "sink_window"

    def __post_init__(self) -> None:
        builtin_numbers(self)
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window", self.window, 1)

    def sink_blocks(self, block_size: int) -> int:
        """Leading blocks kept forever."""
        return num_blocks_for(self.sink_tokens, block_size)

    def plan(self, held: int, seen: int, new: int, block_size: int, step: int = 0) -> EvictionPlan:
        """Free the blocks after the sink blocks that lie wholly before the last ``window - 1`` held tokens (never
        the last block, so a row never becomes empty)."""
        head = self.sink_blocks(block_size)
        lo = min(max(0, held - (self.window - 1)) // block_size, num_blocks_for(held, block_size) - 1)
        return EvictionPlan(drop_positions=list(range(head, lo)))

    def max_held(self, new: int, block_size: int) -> int:
        """Sink blocks, the window's blocks (``window - 1`` tokens plus up to a block of alignment; at least the last
        block, which is never freed) and the step's tokens."""
        kept = max(self.window - 1 + block_size - 1, block_size)
        return self.sink_blocks(block_size) * block_size + kept + new
