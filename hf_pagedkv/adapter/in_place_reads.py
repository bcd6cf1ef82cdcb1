"""`InPlaceReads`: which forward step of a `PagedCache` has an attention that reads the pool in place."""

from __future__ import annotations

import functools
import weakref

import torch

from hf_pagedkv.attention.paged_view import PagedView
from hf_pagedkv.attention.registration import ATTENTION_NAME, COMPILED_ATTENTION_NAME
from hf_pagedkv.errors import CacheReleasedError


#: the name a serving engine's packed attention takes for a step whose decode segments read their requests' pools
#: in place (registered by `hf_pagedkv.serving`; a step that does not read in place takes ``"hf_pagedkv_packed"``)
PACKED_IN_PLACE_NAME = "hf_pagedkv_packed_in_place"

#: the attention implementations (names in transformers' registry) that read a `PagedCache`'s pool in place
IN_PLACE_NAMES = (ATTENTION_NAME, COMPILED_ATTENTION_NAME, PACKED_IN_PLACE_NAME)


class InPlaceReads:
    """The hook between a `PagedCache` and the ``"hf_pagedkv"`` attention.

    Each layer's `update` makes a `PagedView` of what its attention reads (no tensor work). The first layers of a
    step return their K/V as usual (a view or a gathered / de-quantized copy) with the view attached; when the
    attention function receives such keys and reads in place, it calls the view's `confirm`, and the step's later
    layers return placeholders that hold no history (`PagedView.placeholders`). The confirmation holds for that step
    only: any other attention (a model switched back to `sdpa`, a model without the attention, a prefill step it
    does not read in place) never confirms, so it always gets real K/V.

    The first layer too, when the cache knows the model's config (`PagedCache(config=model.config)`) and the model has
    at least two layers (so a wrong step is caught before it ends): a step begins
    confirmed if an earlier step of this cache confirmed and the config still names an attention that reads in
    place (``config._attn_implementation``, which `set_attn_implementation` changes on that object). Then no layer
    reads a copy (the probe cost one de-quantized layer per step: about 1.2 ms at 2,048 tokens, k4v4). The attention
    function claims every placeholder it gets (`PagedView.claim`; one it cannot read in place it materializes), and
    each layer's `view` first checks that the previous placeholder was claimed: one that reached another attention
    (a config object that is not the running model's, a registry entry replaced under the same name) raises instead
    of leaving that step's output silently wrong, and ends the early confirmations for this cache.

    Invariant: `_step` is None or the step object of the cache's current or an earlier forward step; placeholders
    are handed out only while it is the current one; `_handed` is the last placeholder's view until the next `view`.
    """

    def __init__(self, config=None, num_layers: int | None = None) -> None:
        # the model's config (read for its attention's name), or None: no early confirmation. Not for one layer: its
        # placeholder would be checked only at the next step, after that step's output went out
        self._config = config if (num_layers or 0) >= 2 else None
        self._step = None  # the forward step whose attention confirmed in-place reads; set by `confirm` only
        self._handed: PagedView | None = None  # the view whose placeholder was handed out last, until the next view
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
             new: tuple | None, runner) -> PagedView:
        """The `PagedView` of `layer` (a `PagedLayer`) in `step` (see `PagedView` for the arguments); it materializes
        through ``runner.read_layer(layer, lo, new)`` (the cache's `StepRunner`), holding the runner weakly (a tensor
        kept by the caller must not keep the cache's rows, and their blocks, alive)."""
        handed, self._handed = self._handed, None
        if handed is not None and not handed.claimed:
            self._config = None
            raise RuntimeError(
                f"Layer {handed.layer_idx} of this forward step got placeholder K/V from the PagedCache (they hold no "
                "history: only the \"hf_pagedkv\" attention reads them), but its attention did not read them: that "
                "step's output is wrong. The model's attention implementation no longer matches the config the cache "
                "was built with; release() this cache and build a new one with config=model.config of the model "
                "that runs.")
        if step is not self._shared_step:
            self._shared_step, self._shared = step, {}
            if self._step is not None and self._step is not step and self._config_reads_in_place():
                self._step = step  # an earlier step confirmed, and the model's attention is still one that reads
        return PagedView(store, layer.layer_idx, table, lo, end, base, new,
                         functools.partial(_materialize, weakref.ref(runner), layer, lo, new),
                         functools.partial(self.confirm, step), self._shared)

    def hand_out(self, view: PagedView) -> tuple[torch.Tensor, torch.Tensor]:
        """`view.placeholders()`, remembered so that the next `view` checks the attention claimed them."""
        self._handed = view
        return view.placeholders()

    def _config_reads_in_place(self) -> bool:
        """Whether the model's config names an attention that reads the pool in place."""
        return self._config is not None and getattr(self._config, "_attn_implementation", None) in IN_PLACE_NAMES


def _materialize(runner_ref, layer, lo: int, new):
    runner = runner_ref()
    if runner is None:
        raise CacheReleasedError("The PagedCache behind these keys was garbage collected; keep a reference to it.")
    return runner.read_layer(layer, lo, new)
