"""`CacheRetention`: the retention side of one `PagedCache`: its `Evictor` and what the evictor works through."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from hf_pagedkv.adapter.evictor import Evictor
from hf_pagedkv.adapter.paged_layer import PagedLayer
from hf_pagedkv.retention.policy import RetentionPolicy
from hf_pagedkv.retention.retention_stats import RetentionStats

if TYPE_CHECKING:  # type-only: the runner owns this object and imports this module
    from hf_pagedkv.adapter.row_tables import RowTables
    from hf_pagedkv.adapter.step_runner import StepRunner


class CacheRetention:
    """A cache's retention policy at work: the `Evictor` (the policy and what it evicted) and the `RetentionOwner`
    it and `WindowRealign` act through (the cache's full-attention and sliding-window tables and layers, reads, and
    `set_held`), plus the steps around an eviction: the one transformers' mask sizes ask for (`mask_sizes`), and
    KVzip's context scoring (`begin_context_scoring` .. `end_context_scoring`, which `hf_pagedkv.compress_context`
    runs).

    Invariant: every layer of the cache has evicted `num_evicted` tokens (`StepRunner.check_invariants`).

    Args:
        evictor (`Evictor`): the retention state (a new one, or a fork's copy).
        runner (`StepRunner`): the cache's runner, held weakly (it owns this object).
    """

    def __init__(self, evictor: Evictor, runner: StepRunner) -> None:
        self.evictor = evictor  # fixed
        self._runner = weakref.proxy(runner)  # the owner; weak, so the cache's parts form no cycle
        self.rows = runner.rows  # the cache's CacheRows; fixed
        self.pool = runner.pool  # fixed
        self.block_size = runner.block_size  # fixed

    @property
    def policy(self) -> RetentionPolicy:
        return self.evictor.policy

    @property
    def seq_id(self) -> int:
        """The cache's name in the pool's event log."""
        return self.rows.owner

    @property
    def num_evicted(self) -> int:
        """Tokens evicted per row."""
        return self.evictor.num_evicted

    @property
    def num_intact_blocks(self) -> int | None:
        """Leading logical blocks still at their original positions (None: all): only those may be published."""
        return self.evictor.num_intact_blocks

    # -- the RetentionOwner the Evictor and WindowRealign act through --------------------------------------------------
    def retention_tables(self) -> list[RowTables]:
        """The block tables a retention policy acts on: the full-attention layer groups (one, or one per tier of
        a tiered policy such as `PyramidKV`, tier 0 first); empty before a cache built without config has seen its
        first layer."""
        return self.rows.full_tables()

    def retention_layers(self) -> list[PagedLayer]:
        """The layers a retention policy scores and compacts: the full-attention ones."""
        return [layer for layer in self._runner.paged_layers() if not layer.is_sliding]

    def sliding_tables(self) -> list[RowTables]:
        """The sliding-window layer groups' tables: after an eviction they keep their window at the new logical
        positions (`WindowRealign`)."""
        return self.rows.sliding_tables()

    def sliding_layers(self) -> list[PagedLayer]:
        return [layer for layer in self._runner.paged_layers() if layer.is_sliding]

    def read_layer(self, layer: PagedLayer, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `lo ..` that `layer` holds, `[batch, num_kv_heads, seq_len, head_dim]` each."""
        return self._runner.read_layer(layer, lo)

    def set_held(self, held: int, evicted: int) -> None:
        """After an eviction (`StepRunner.set_held`)."""
        self._runner.set_held(held, evicted)

    # -- around each step -------------------------------------------------------------------------------------------
    def before_step(self, new: int) -> None:
        """The first layer of a step adding `new` tokens, with the pool's lock held (`Evictor.before_step`)."""
        self.evictor.before_step(self, new)

    def offer_queries(self, keys: torch.Tensor, layer_idx: int) -> None:
        """`Evictor.offer_queries`."""
        self.evictor.offer_queries(keys, layer_idx)

    def mask_sizes(self, query_length: int, layer) -> tuple[int, int] | None:
        """`PagedCache.get_mask_sizes` of `layer` (a `PagedLayer`, a `DummyLayer` or None): evict first, between steps
        (transformers builds the mask from these sizes before any layer runs, so they must describe what stays); then
        the sizes when the cache has retention tiers, else None (the layer's own sizes)."""
        runner = self._runner
        if query_length and all(lay.num_tokens == self.rows.num_tokens for lay in runner.paged_layers()):
            with self.pool.lock:
                self.evictor.evict(self, query_length)
            runner.after_change()
        tiers = self.retention_tables()
        if isinstance(layer, PagedLayer) and not layer.is_sliding and len(tiers) > 1 and layer.is_initialized:
            # NOTE: transformers builds one mask for every full-attention layer from these sizes, so they describe
            # the retention tier that holds the most (each tier holds the last positions of the same span; the
            # "hf_pagedkv" attention reads the mask's last columns for a tier holding fewer)
            lo = min(rt.window_start(layer.num_tokens) for rt in tiers)
            return layer.num_tokens - lo + query_length, layer.num_evicted + lo
        return None

    # -- row operations ---------------------------------------------------------------------------------------------
    def select_rows(self, idx: list[int]) -> None:
        """`Evictor.select_rows`."""
        self.evictor.select_rows(idx)

    def check_crop(self, new_len: int) -> None:
        """`Evictor.check_crop`."""
        self.evictor.check_crop(new_len)

    def reset(self) -> None:
        """`Evictor.reset`."""
        self.evictor.reset()

    # -- KVzip: scoring by a reconstruction pass (`hf_pagedkv.compress_context`) ------------------------------------
    def begin_context_scoring(self, key_valid: torch.Tensor | None = None) -> None:
        """From the next forward step on, the ``"hf_pagedkv"`` attention of every layer scores the tokens held now
        (the context) by the attention they receive (`ContextScores`), until `end_context_scoring`.

        Args:
            key_valid (`torch.BoolTensor` of shape `[batch, positions]`, *optional*): for a left-padded batch,
                False at the padding of the context and of the steps to come (the attention mask they get);
                padding then scores 0 and is kept only where a row has fewer real tokens than the budget.

        Raises:
            ValueError: a policy that is not scored by a reconstruction pass (`KVzip`), an empty cache, or one that
                already evicted tokens; `key_valid` not `[batch, >= held]` bool.
            CacheReleasedError: the cache was released.
        """
        self.rows.check_usable()
        held, num_rows = self.rows.num_tokens, self.rows.num_rows
        if not held:
            raise ValueError("compress_context: the cache holds no tokens; prefill the context first, e.g. "
                             "model(context_ids, past_key_values=cache).")
        if key_valid is not None and (key_valid.dtype != torch.bool or key_valid.dim() != 2
                                      or key_valid.shape[0] != num_rows or key_valid.shape[1] < held):
            raise ValueError(f"begin_context_scoring: key_valid must be a [{num_rows}, >= {held}] "
                             f"bool mask (rows, positions), got {key_valid.dtype} of shape {tuple(key_valid.shape)}.")
        self.evictor.begin_scoring(held, key_valid)

    def end_context_scoring(self, tokens_to_remove: int, compress: bool = True) -> dict[int, torch.Tensor]:
        """End what `begin_context_scoring` started: crop the `tokens_to_remove` tokens added since (the
        reconstruction pass), then, if `compress`, compact every (row, layer, KV head) to the policy's best-scored
        tokens (`KVzip.keep_for`) in fresh blocks and free the old ones.

        Returns:
            The scores per layer index, `torch.Tensor` `[batch, num_kv_heads, context]` float32 each (the highest
            attention weight each context token received).

        Raises:
            ValueError: a layer scored nothing (the model's attention is not ``"hf_pagedkv"``); nothing was evicted
                then (the crop is done).
            PoolExhaustedError: the compaction needs fresh blocks a fixed pool does not have (nothing evicted).
        """
        self.rows.check_usable()
        scores, valid = self.evictor.end_scoring()
        if tokens_to_remove:
            self._runner.crop(-tokens_to_remove)
        if compress:
            with self.pool.lock:
                self.evictor.compress(self, scores, valid)
            self._runner.after_change()
        return scores

    # -- stats and checks -------------------------------------------------------------------------------------------
    def stats(self) -> RetentionStats:
        """Tokens seen vs held per row, and what the policy evicted (per layer, with retention tiers)."""
        held = self.rows.num_tokens
        if len(self.retention_tables()) < 2:
            return self.evictor.stats(held)
        runner = self._runner
        return self.evictor.stats(held, tuple(layer.num_tokens - runner.first_held(layer)
                                              for layer in runner.paged_layers()))

    def check_scoring(self) -> list[str]:
        """What breaks the reconstruction scores' invariant (`Evictor.check_scoring`); empty when none are kept."""
        return self.evictor.check_scoring(self, self.rows.num_rows)
