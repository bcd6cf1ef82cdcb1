"""`InPlaceReads`: which forward step of a `PagedCache` has an attention that reads the pool in place."""

from __future__ import annotations

import functools
import weakref

import torch

from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.errors import CacheReleasedError


class InPlaceReads:
    """The hook between a `PagedCache` and the ``"hf_pagedkv"`` attention (issue 15).

    Each layer's `update` makes a `PagedView` of what its attention reads (no tensor work). The first layers of a
    step return their K/V as usual (a view or a gathered / de-quantized copy) with the view attached; when the
    attention function receives such keys and reads in place, it calls the view's `confirm`, and the step's later
    layers return placeholders that hold no history (`PagedView.placeholders`). The confirmation holds for that step
    only: any other attention (a model switched back to `sdpa`, a model without the attention, a prefill step it
    does not read in place) never confirms, so it always gets real K/V.

    Invariant: `_step` is None or the step object of the cache's current or an earlier forward step; placeholders
    are handed out only while it is the current one.
    """

    def __init__(self) -> None:
        self._step = None  # the forward step whose attention confirmed in-place reads; set by `confirm` only
        # the memo the views of one step share (`PagedView`'s `shared`): a new one for each step object, so a
        # mid-step unshare (a new step plan, new tables) never sees the layouts of the tables before it
        self._shared_step, self._shared = None, {}

    def confirm(self, step) -> None:
        """This step's attention reads the pool in place (called through `PagedView.confirm`)."""
        self._step = step

    def confirmed(self, step) -> bool:
        """Whether `step`'s attention said it reads in place."""
        return self._step is step

    def view(self, step, store, layer, table: torch.Tensor, lo: int, end: int, base: int | None,
             new: tuple | None, cache) -> PagedView:
        """The `PagedView` of `layer` (a `PagedLayer`) in `step` (see `PagedView` for the arguments); it materializes
        through ``cache.read_layer(layer, lo, new)``, holding the cache weakly (a tensor kept by the caller must not
        keep the cache, and its blocks, alive)."""
        if step is not self._shared_step:
            self._shared_step, self._shared = step, {}
        return PagedView(store, layer.layer_idx, table, lo, end, base, new,
                         functools.partial(_materialize, weakref.ref(cache), layer, lo, new),
                         functools.partial(self.confirm, step), self._shared)


def _materialize(cache_ref, layer, lo: int, new):
    cache = cache_ref()
    if cache is None:
        raise CacheReleasedError("The PagedCache behind these keys was garbage collected; keep a reference to it.")
    return cache.read_layer(layer, lo, new)
