"""`PagedLayer`: one layer's view of a `PagedCache` (the `CacheLayerMixin` transformers calls per layer)."""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from hf_pagedkv._compat import CacheLayerMixin
from hf_pagedkv.errors import CacheReleasedError
from hf_pagedkv.storage.page_store import LayerSpec



class LayerRunner(Protocol):
    """What a `PagedLayer` asks of the object that runs its cache's steps (a `StepRunner`): the narrow interface
    between the two, so the layer never reads the cache's state and this module imports neither."""

    def check_usable(self) -> None: ...  # raises CacheReleasedError after release()

    def register_layer(self, layer: PagedLayer, spec: LayerSpec) -> None: ...  # storage for the layer's first K/V

    def update_layer(self, layer: PagedLayer, key_states: torch.Tensor,
                     value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...  # write, then read

    def read_layer(self, layer: PagedLayer, lo: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # tokens lo.. held

    def first_held(self, layer: PagedLayer) -> int: ...  # first token a full-attention layer holds (retention tier)

    def reset(self) -> None: ...  # free the whole cache's blocks


class PagedLayer(CacheLayerMixin):
    """The keys and values of one attention layer, stored in the blocks of its `PagedCache`'s pool.

    The block tables belong to the cache (one per batch row and layer group, shared by the group's layers); a layer
    talks to the cache's `StepRunner`, which writes and reads the blocks, and only knows its group, how many tokens
    it has written (`num_tokens`) and, for sliding-window layers, its window.
    `update` writes the new tokens into their slots and returns what attention reads, with the transformers shapes
    `[batch, num_kv_heads, seq_len, head_dim]`: every token for a full-attention layer; for a sliding-window
    layer the same slice `DynamicSlidingWindowLayer` returns (the last ``sliding_window - 1`` cached tokens plus
    the new ones), so masks and outputs match `DynamicCache(config=...)` exactly. Blocks wholly before the window
    are freed when the next step starts, so `crop` can take back the last step's tokens (assisted decoding), as
    `DynamicSlidingWindowLayer` with past recording does.

    Cache-wide operations (`crop`, `reorder_cache`, `batch_repeat_interleave`, `batch_select_indices`) act on the
    shared block tables and are called on the `PagedCache`, which transformers does.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, runner: LayerRunner, layer_idx: int, sliding_window: int | None = None, group: int = 0) -> None:
        super().__init__()
        # NOTE: a weak reference: the cache holds its runner and its layers, so a strong one would keep the runner (and
        # its rows) alive after the cache, whose blocks go back to the pool when it is dropped without release().
        self._runner_ref = weakref.ref(runner)  # the runner of the owning cache (block tables, pool)
        self.layer_idx = layer_idx  # index in the model; names this layer's storage in the pool
        self.sliding_window = sliding_window  # tokens of the attention window, or None for full attention
        self.group = group  # the pool's layer group holding this layer's blocks; fixed
        self.is_sliding = sliding_window is not None
        self.num_tokens = 0  # tokens this layer holds (written, less any evicted); set by the runner only
        self.num_evicted = 0  # tokens a retention policy evicted before the held ones (the kv offset); runner only
        self.spec: LayerSpec | None = None  # shape/dtype/device, fixed by the first update

    @property
    def _runner(self) -> LayerRunner:
        """The owning cache's runner.

        Raises:
            CacheReleasedError: the cache was garbage collected (its blocks went back to the pool).
        """
        runner = self._runner_ref()
        if runner is None:
            raise CacheReleasedError(f"The PagedCache of layer {self.layer_idx} was garbage collected and its blocks "
                                     "returned to the pool; keep a reference to the cache while using its layers.")
        return runner

    # `CacheLayerMixin.__init__` assigns keys/values; here they are read from the pool on demand.
    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's cached keys, `[batch, num_kv_heads, seq_len, head_dim]` (a copy or a view), or None; for a
        sliding-window layer the last ``sliding_window - 1`` tokens, as `DynamicSlidingWindowLayer` keeps."""
        return self._runner.read_layer(self, self._held_from())[0] if self.num_tokens else None

    @keys.setter
    def keys(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedLayer.keys is read-only: write through PagedCache.update().")

    @property
    def values(self) -> torch.Tensor | None:
        """This layer's cached values, `[batch, num_kv_heads, seq_len, head_dim]` (a copy or a view), or None; for
        a sliding-window layer the last ``sliding_window - 1`` tokens, as `DynamicSlidingWindowLayer` keeps."""
        return self._runner.read_layer(self, self._held_from())[1] if self.num_tokens else None

    def _held_from(self) -> int:
        if self.sliding_window is None:
            return self._runner.first_held(self)
        return max(0, self.num_tokens - (self.sliding_window - 1))

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("PagedLayer.values is read-only: write through PagedCache.update().")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Fix this layer's spec from its first K/V and make sure the pool has storage for it."""
        spec = LayerSpec.of(key_states, value_states)
        self._runner.register_layer(self, spec)
        self.spec = spec
        self.dtype, self.device = spec.dtype, spec.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new K/V and return what attention reads.

        Args:
            key_states (`torch.Tensor` of shape `[batch, num_kv_heads, num_new_tokens, head_dim]`).
            value_states (`torch.Tensor` of shape `[batch, num_kv_heads, num_new_tokens, head_dim]`).

        Returns:
            keys, values of shape `[batch, num_kv_heads, seq_len, head_dim]`.

        Raises:
            ValueError: shapes that do not match each other, or dtype/heads/head_dim/device other than this
                layer's first update.
            PoolExhaustedError: a fixed pool has too few free blocks (nothing was changed).
            CacheReleasedError: the cache was released.
        """
        if key_states.dim() != 4 or value_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                "key_states and value_states must be [batch, num_kv_heads, seq_len, head_dim] with equal first "
                f"three dims; got {tuple(key_states.shape)} and {tuple(value_states.shape)}."
            )
        self._runner.check_usable()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif not self._matches(key_states, value_states):
            raise ValueError(
                f"Layer {self.layer_idx} was created for {self.spec}, but got "
                f"{LayerSpec.of(key_states, value_states)}; a PagedCache serves one model in one dtype."
            )
        return self._runner.update_layer(self, key_states, value_states)

    def _matches(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether new K/V have this layer's spec (compared field by field: no `LayerSpec` built per step)."""
        spec = self.spec
        return (key_states.shape[1] == spec.num_kv_heads and key_states.shape[-1] == spec.key_dim
                and value_states.shape[-1] == spec.value_dim and key_states.dtype == spec.dtype
                and key_states.device == spec.device)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of what the next `update` with `query_length` tokens returns.

        After a retention policy evicted tokens, the held ones are read as if they were the positions just before
        the new tokens (``kv_offset = evicted``): a causal mask then shows every held token to every new one and
        the new ones to each other causally, which is exactly what the cache keeps (keys carry their original RoPE).
        NOTE: a 2D padding mask is indexed by those virtual positions too, so a left-padded batch after an
        eviction may show pad tokens kept in a sink block; retention is exact for unpadded rows. A layer of a
        retention tier that holds fewer tokens (`PyramidKV`) holds the last of the logical positions its group's
        table spans, from `first_held` on; transformers builds one mask for every full-attention layer from the
        first one's sizes, and the ``"hf_pagedkv"`` attention reads its last columns for the others.
        """
        if self.sliding_window is None:
            lo = self._runner.first_held(self)
            return self.num_tokens - lo + query_length, self.num_evicted + lo
        w = self.sliding_window  # (after an eviction its window sits at the logical positions just before the
        # new tokens, `WindowRealign`: the offset adds the evicted tokens back, so the sliding mask sees true positions)
        return min(self.num_tokens, w - 1) + query_length, self.num_evicted + max(self.num_tokens - w + 1, 0)

    def get_seq_length(self) -> int:
        """Tokens seen by this layer (held plus evicted by a retention policy: new tokens get their true positions)."""
        return self.num_tokens + self.num_evicted

    def get_max_length(self) -> int:
        """-1 (no maximum) for full attention, the window for sliding-window layers (as `DynamicCache`)."""
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        """Release the whole cache's blocks (tables are shared by all layers) and keep it usable."""
        self._runner.reset()

    def _cache_wide(self, name: str):
        raise NotImplementedError(
            f"PagedLayer.{name} acts on block tables shared by every layer: call PagedCache.{name} instead."
        )

    def crop(self, tokens_to_remove: int) -> None:
        self._cache_wide("crop")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._cache_wide("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._cache_wide("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._cache_wide("batch_select_indices")

    def offload(self):
        raise NotImplementedError("A PagedCache moves to host memory whole, not layer by layer: use cache.offload() "
                                  "and cache.prefetch() with a BlockPool(host_memory=...).")

    def prefetch(self):
        raise NotImplementedError("A PagedCache moves to host memory whole, not layer by layer: use cache.offload() "
                                  "and cache.prefetch() with a BlockPool(host_memory=...).")

    def __repr__(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        return f"PagedLayer(layer_idx={self.layer_idx}, num_tokens={self.num_tokens}{window})"
