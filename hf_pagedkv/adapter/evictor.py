"""`Evictor`: applies a cache's retention policy before each forward step, and gives the evicted blocks back."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

import torch

from hf_pagedkv.errors import counted
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.retention.context_scores import ContextScores
from hf_pagedkv.adapter.fresh_rows import install_fresh_rows
from hf_pagedkv.retention.policy import EvictionPlan, RetentionPolicy
from hf_pagedkv.attention.query_window import QueryWindow
from hf_pagedkv.retention.retention_stats import RetentionStats
from hf_pagedkv.retention.spec import parse_retention
from hf_pagedkv.adapter.window_realign import WindowRealign

if TYPE_CHECKING:  # type-only: the owner is a CacheRetention, which imports this module
    from hf_pagedkv.adapter.row_tables import RowTables
    from hf_pagedkv.pool.block_pool import BlockPool


class RetentionOwner(Protocol):
    """What the `Evictor` asks of its owner (a cache's `CacheRetention`), so it never reads the cache's state."""

    pool: BlockPool
    block_size: int
    seq_id: int
    policy: RetentionPolicy

    def retention_tables(self) -> list[RowTables]: ...  # its full-attention layer groups (tier 0 first), if any

    def retention_layers(self) -> list: ...  # its full-attention PagedLayers (those the policy scores)

    def sliding_tables(self) -> list[RowTables]: ...  # its sliding-window layer groups (they follow evictions)

    def sliding_layers(self) -> list: ...  # its sliding-window PagedLayers

    def read_layer(self, layer, lo: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # held K/V of a layer

    def set_held(self, held: int, evicted: int) -> None: ...  # tokens the tables now span / evicted per row


class Evictor:
    """The retention state of one `PagedCache`: its policy and what it evicted.

    A row keeps its tokens in *logical* order: its block table holds `held` tokens in slots ``0 .. held - 1``,
    and ``seen - held`` tokens were evicted (the kv offset transformers' masks get, `PagedLayer.get_mask_sizes`).
    Before each forward step, the policy's `EvictionPlan` either frees whole blocks (`SinkWindow`: the later blocks
    move up, no tensor is touched, every offset inside a block stays) or compacts every (layer, head) to the same
    number of tokens in fresh blocks (importance policies), then frees the old ones. Rows with identical block tables
    (beams before they diverge, `num_return_sequences`) are compacted once and keep sharing the result.

    A tiered policy (`PyramidKV`) splits the full-attention layers into layer groups (`RetentionPolicy.layer_tiers`),
    each with its own tables, and gives each group its own keep count (`RetentionPolicy.tier_budgets`, or for
    `KVzip`'s global layer budgets, `score_budgets`, from the reconstruction scores). The tables span the most any
    tier keeps; a tier keeping ``d * block_size`` fewer tokens writes them at the last logical positions of that
    span and drops its first `d` block positions (as a sliding window does), so every group's table ends at the
    same position, the step planner extends them together, and the blocks beyond each tier's budget are freed.

    Invariants: every row and layer has evicted `num_evicted` tokens; the first `num_intact_blocks` logical blocks
    still hold the tokens of their original positions (only those may be published to the prefix index); a crop
    may not go below `num_held_after_eviction` (evicted tokens cannot come back, and compacted heads differ).

    A query-aware policy (`SnapKV`) also gets, through `offer_queries`, the queries of the steps it `observes`
    (`QueryWindow`, filled by the ``"hf_pagedkv"`` attention); they are dropped once used. `KVzip` instead scores the
    held context while `begin_scoring` .. `compress` run (`ContextScores`, filled by the same attention).
    """

    def __init__(self, policy: RetentionPolicy | str) -> None:
        if isinstance(policy, str):  # a spec, as `Engine`, `generate_batch` and the CLI take it
            policy = parse_retention(policy)
        if not isinstance(policy, RetentionPolicy):
            raise ValueError(f"`retention` must be a retention policy such as hf_pagedkv.retention.SinkWindow(...) or "
                             f"KeyNorm(...), got {type(policy).__name__}.")
        self.policy = policy  # fixed
        self.reset()

    def reset(self) -> None:
        """Forget every eviction (the cache was reset)."""
        self.num_evicted = 0  # tokens evicted per row; changed by `before_step` only
        self.num_steps = 0  # forward steps planned since the last reset
        self.num_evictions = 0  # steps that evicted something
        self.num_blocks_freed = 0  # block references let go by evictions (per row)
        self.num_intact_blocks: int | None = None  # leading logical blocks at their original positions; None: all
        self.num_held_after_eviction = 0  # tokens held right after the last eviction (the lowest crop target)
        self.evicted_at_step = -1  # the step (`num_steps`) whose eviction ran; evict acts once per step
        # the observed steps' last queries per layer, for a query-aware policy (else None); filled by the attention
        self.observed = QueryWindow(self.policy.recent_tokens) if self.policy.needs_queries else None
        self.scoring: ContextScores | None = None  # KVzip's reconstruction scores, between begin_scoring and compress

    def copy(self) -> Evictor:
        """An independent copy (for `PagedCache.fork`)."""
        other = Evictor(self.policy)
        other.__dict__.update(self.__dict__)
        other.observed = None if self.observed is None else self.observed.copy()
        other.scoring = None if self.scoring is None else self.scoring.copy()
        return other

    def offer_queries(self, keys: torch.Tensor, layer_idx: int) -> None:
        """`PagedCache.update` returns `keys` to the attention of layer `layer_idx` in the current step: ask that
        attention for its queries (`QueryWindow.tag`) if the policy needs this step's."""
        if self.observed is not None and self.num_steps and self.policy.observes(self.num_steps - 1):
            self.observed.tag(keys, layer_idx)
        if self.scoring is not None:
            self.scoring.tag(keys, layer_idx)

    def select_rows(self, idx: list[int]) -> None:
        """The cache's rows became copies of rows `idx`: recorded queries follow them."""
        if self.observed is not None:
            self.observed.select_rows(idx)
        if self.scoring is not None:
            self.scoring.select_rows(idx)

    # -- scoring by a reconstruction pass (KVzip, `hf_pagedkv.compress_context`) --------------------------------------
    def begin_scoring(self, held: int, key_valid: torch.Tensor | None = None) -> None:
        """From now on, the attention of every step scores the `held` tokens the rows hold now (`ContextScores`;
        `key_valid`: its padding mask, `[rows, positions]` bool).

        Raises:
            ValueError: the policy is not scored this way (`reconstructs`), or the rows already evicted tokens.
        """
        if not self.policy.reconstructs:
            raise ValueError(f"retention={self.policy!r} does not compress by a reconstruction pass; use "
                             "hf_pagedkv.retention.KVzip(...) for compress_context.")
        if self.num_evictions:  # (not `num_evicted`: a tiered policy's widest tier may keep every token, 0 evicted)
            raise ValueError(f"the cache was already compressed ({counted(self.num_evicted, 'token')} evicted per "
                             "row): compress_context compresses a context once, right after its prefill.")
        self.scoring = ContextScores(held, key_valid)

    def end_scoring(self) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Stop scoring; the scores per layer index, `[batch, num_kv_heads, held]` each (empty if none), and the
        context's padding mask, `[batch, held]` bool (False at padding; None without)."""
        scoring, self.scoring = self.scoring, None
        return ({}, None) if scoring is None else (scoring.scores, scoring.context_valid())

    def compress(self, cache: RetentionOwner, scores: dict[int, torch.Tensor], valid: torch.Tensor | None = None,
                 ) -> None:
        """Compact every (row, layer, head) to the policy's `keep_for(held)` best-`scores` tokens, as `evict` does
        for a compaction; `valid` (`[rows, held]` bool, False at left padding) keeps padding only where a row has
        fewer real tokens than the budget (`ImportancePolicy.select`).

        Raises:
            ValueError: a layer has no scores (its attention is not ``"hf_pagedkv"``), or they (or `valid`) do not
                cover exactly the held tokens of every row (nothing changed then).
            PoolExhaustedError: as `evict`.
        """
        groups = cache.retention_tables()
        if not groups or not groups[0].rows:
            raise ValueError("compress_context: the cache holds no tokens; prefill the context first.")
        rows, held = len(groups[0].rows), groups[0].rows[0].num_tokens
        layers = cache.retention_layers()
        missing = [layer.layer_idx for layer in layers if layer.is_initialized and layer.layer_idx not in scores]
        if missing:
            raise ValueError(
                f"retention={self.policy!r} scores the context by the attention of a reconstruction pass, but the "
                f"attention of layers {missing[:8]}{'...' if len(missing) > 8 else ''} scored nothing: load the "
                'model with attn_implementation="hf_pagedkv" (or call model.set_attn_implementation("hf_pagedkv")). '
                "Nothing was evicted.")
        bad = {tuple(s.shape[::2]) for s in scores.values()} - {(rows, held)}
        if valid is not None and tuple(valid.shape) != (rows, held):
            bad.add(tuple(valid.shape))
        if bad:
            raise ValueError(f"retention={self.policy!r}: scores of (rows, tokens) {sorted(bad)} do not match the "
                             f"{counted(rows, 'row')} of {counted(held, 'token')} the cache holds; nothing was "
                             "evicted.")
        keep = self.policy.keep_for(held)
        if 0 < keep < held:
            if self.policy.reconstructs and self.policy.settings.value_weighted:  # the scores to rank by (not returned)
                scores = {layer.layer_idx: self.policy.weigh(scores[layer.layer_idx], cache.read_layer(layer, 0)[1],
                                                             valid) for layer in layers if layer.is_initialized}
            keeps = self._tier_keeps(cache, groups, keep, held, scores, valid)
            self._compact(cache, groups, keeps, scores, WindowRealign(cache, held, max(keeps)), valid)

    # -- per step ----------------------------------------------------------------------------------------------------
    def before_step(self, cache: RetentionOwner, new: int) -> None:
        """The first layer of a step adding `new` tokens: evict (if `evict` has not already, for the mask) and count
        the step. Called with the pool's lock held, before the step is planned."""
        self.evict(cache, new)
        self.num_steps += 1

    def evict(self, cache: RetentionOwner, new: int) -> None:
        """Evict what the policy says before the next step, which adds `new` tokens to every row, then bound the
        rows' tables for invariant 3. Idempotent until the step runs: `PagedCache.get_mask_sizes` calls it first,
        since transformers builds the step's attention mask from the sizes before any layer runs.

        Raises:
            PoolExhaustedError: a compaction needs fresh blocks a fixed pool does not have (nothing changed).
        """
        groups = cache.retention_tables()
        if not groups or not groups[0].rows:  # nothing stored yet
            return
        B = cache.block_size
        held = groups[0].rows[0].num_tokens  # every tier's table spans the same logical positions
        # once per step: a compaction whose widest tier kept every token evicts none, so the policy's plan alone would
        # compact again at the next call of the same step (the mask of another layer type, then `before_step`)
        done = self.evicted_at_step == self.num_steps
        plan = EvictionPlan() if done else self.policy.plan(held, held + self.num_evicted, new, B, step=self.num_steps)
        if plan.drop_positions:
            assert len(groups) == 1, "only untiered policies drop blocks"
            realign = WindowRealign(cache, held, held - len(plan.drop_positions) * B, plan.drop_positions)
            self._drop(cache, groups[0], plan.drop_positions, realign)
        elif plan.keep_tokens is not None and 0 < plan.keep_tokens < held:
            self._check_observed(cache, len(groups[0].rows))
            keeps = self._tier_keeps(cache, groups, plan.keep_tokens, held)
            self._compact(cache, groups, keeps, realign=WindowRealign(cache, held, max(keeps)))
        if plan.drop_positions or plan.keep_tokens is not None:  # (after success: a refused eviction may be retried)
            self.evicted_at_step = self.num_steps
        if self.observed is not None and not self.policy.observes(self.num_steps):
            self.observed.clear()  # used (or not needed: nothing to compress); the next step records nothing
        bound = self.policy.max_held(new, B)
        for rt in groups:
            for row in rt.rows:
                row.max_positions = None if bound is None else num_blocks_for(bound, B)

    def _check_observed(self, cache: RetentionOwner, num_rows: int) -> None:
        """Raise `ValueError` (before anything changes) if a query-aware policy lacks a layer's queries."""
        if self.observed is None:
            return
        layers = [layer.layer_idx for layer in cache.retention_layers() if layer.is_initialized]
        missing = self.observed.missing(layers)
        if missing:
            raise ValueError(
                f"retention={self.policy!r} scores the prompt by the attention of its last {self.policy.recent_tokens} "
                f"queries, but the attention of layers {missing[:8]}{'...' if len(missing) > 8 else ''} gave none: "
                'load the model with attn_implementation="hf_pagedkv" (or call '
                'model.set_attn_implementation("hf_pagedkv")) so the attention hands its queries to the cache. '
                "Nothing was evicted.")
        bad = {q.shape[0] for q in self.observed.queries.values()} - {num_rows}
        if bad:
            raise ValueError(f"retention={self.policy!r}: the recorded queries have batch {sorted(bad)} but the cache "
                             f"holds {counted(num_rows, 'row')}; nothing was evicted.")

    def _drop(self, cache: RetentionOwner, rt: RowTables, positions: list[int], realign: WindowRealign) -> None:
        """Free whole logical block positions in every row (all full: never the last, partial one); the sliding
        groups follow (`realign`)."""
        pool, B = cache.pool, cache.block_size
        held = rt.rows[0].num_tokens
        assert positions and positions[-1] < num_blocks_for(held, B) - 1, f"drop of {positions} of {held} tokens"
        self._reserve(pool, realign.needs())  # raises before anything changed
        moved = realign.apply()
        freed = []
        for r, row in enumerate(rt.rows):
            ids = row.remove_positions(positions)
            row.num_tokens -= len(positions) * B
            pool._free(ids, rt.group)
            rt.set_row(r, 0)
            freed += ids
        n = len(positions) * B
        # (a copied sliding group's blocks hold other positions' tokens too)
        self.num_intact_blocks = min(x for x in (positions[0], realign.first_position, self.num_intact_blocks)
                                     if x is not None)
        self._evicted(cache, held - n, n, {rt.group: freed, **moved})

    def _tier_keeps(self, cache: RetentionOwner, groups: list[RowTables], keep: int, held: int,
                    scores: dict[int, torch.Tensor] | None = None, valid: torch.Tensor | None = None) -> list[int]:
        """The tokens each of `groups` keeps for a uniform keep count `keep` of `held`: chosen from a
        reconstruction pass's `scores` (`score_budgets`) when the policy does, else `tier_budgets`."""
        layers = [layer for layer in cache.retention_layers() if layer.is_initialized]
        if scores is not None and len(groups) > 1:
            by_tier = [[scores[layer.layer_idx] for layer in layers if layer.group == rt.group] for rt in groups]
            keeps = self.policy.score_budgets(by_tier, keep, held, cache.block_size, valid)
            if keeps is not None:
                return keeps
        sizes = [sum(layer.group == rt.group for layer in layers) for rt in groups]
        return self.policy.tier_budgets(keep, held, sizes, cache.block_size)

    def _compact(self, cache: RetentionOwner, groups: list[RowTables], keeps: list[int],
                 scores: dict[int, torch.Tensor] | None = None, realign: WindowRealign | None = None,
                 valid: torch.Tensor | None = None) -> None:
        """Each (row, layer, head) of group ``groups[i]`` keeps the policy's ``keeps[i]`` tokens, written into fresh
        blocks (slot `j`: the head's `j`-th kept token); then the old blocks are freed. The tables span the most
        any group keeps, and a group keeping ``d * block_size`` fewer drops its first `d` logical block positions
        instead. `scores`
        (layer -> `[rows, num_kv_heads, held]`) are what `select` gets for a policy scored by a reconstruction pass
        (`KVzip`), `valid` their padding mask (`[rows, held]`). The sliding groups follow (`realign`)."""
        pool, B = cache.pool, cache.block_size
        held, span = groups[0].rows[0].num_tokens, max(keeps)
        assert all(0 < k <= span and (span - k) % B == 0 for k in keeps), f"tier budgets {keeps} of {span}"
        by_table: dict[tuple, list[int]] = {}  # identical rows (in every group) are compacted once and share the result
        for r in range(len(groups[0].rows)):
            by_table.setdefault(tuple(tuple(rt.rows[r].blocks) for rt in groups), []).append(r)
        writers = [members[0] for members in by_table.values()]
        need = {rt.group: num_blocks_for(k, B) * len(writers) for rt, k in zip(groups, keeps)}
        self._reserve(pool, {**need, **(realign.needs() if realign is not None else {})})
        freed = realign.apply() if realign is not None else {}
        rows_idx, layers = torch.tensor(writers), cache.retention_layers()
        if valid is not None and len(writers) < valid.shape[0]:  # (the writers' rows, once for every layer)
            valid = valid.index_select(0, rows_idx.to(valid.device))
        for rt, keep in zip(groups, keeps):
            freed[rt.group] = self._compact_group(cache, rt, [layer for layer in layers if layer.group == rt.group],
                                                  keep, span, by_table, rows_idx, scores, valid)
        self.num_intact_blocks = 0
        self._evicted(cache, span, held - span, freed, {rt.group: k for rt, k in zip(groups, keeps)})

    @staticmethod
    def _reserve(pool: BlockPool, need: dict[int, int]) -> None:
        """Reserve `need` (layer group -> blocks) in every group or none: raises `PoolExhaustedError` before any
        reservation when one group cannot serve."""
        for g, n in need.items():
            if not pool.groups[g].can_reserve(n):
                pool._reserve(n, g)
        for g, n in need.items():
            pool._reserve(n, g)

    def _compact_group(self, cache: RetentionOwner, rt: RowTables, layers: list, keep: int, span: int,
                       by_table: dict[tuple, list[int]], rows_idx: torch.Tensor,
                       scores: dict[int, torch.Tensor] | None = None, valid: torch.Tensor | None = None) -> list[int]:
        """`_compact` in one layer group (its blocks reserved): the kept tokens of `layers` into fresh blocks at the
        logical positions ``span - keep .. span - 1``; returns the block ids let go. `valid` (`[writers, held]`): the
        writers' padding mask."""
        pool, B, g = cache.pool, cache.block_size, rt.group
        nb, dropped = num_blocks_for(keep, B), (span - keep) // B
        writers = [members[0] for members in by_table.values()]
        fresh = {}
        for w in writers:
            fresh[w] = pool._allocate(nb, after=fresh[writers[0]][-1] if fresh else None, group=g)
        pos = torch.arange(keep)
        blocks = torch.tensor([fresh[w] for w in writers], dtype=torch.long)  # [writers, nb]
        slots = (blocks[:, pos // B] * B + pos % B).reshape(-1)  # [writers * keep], row-major
        group = pool.groups[g]
        targets, planned = {}, False
        for layer in layers:
            if not layer.is_initialized:
                continue
            device = layer.spec.device
            k, v = cache.read_layer(layer, rt.window_start(layer.num_tokens))  # [batch, heads, held, dim] each
            observed = None
            if scores is not None:
                s = scores[layer.layer_idx]  # [rows, num_kv_heads, held]
                observed = s.index_select(0, rows_idx.to(s.device)) if len(writers) < s.shape[0] else s
            elif self.observed is not None:
                q = self.observed.queries[layer.layer_idx]  # [batch, num_heads, w, head_dim]
                observed = (q.index_select(0, rows_idx.to(q.device)) if len(writers) < q.shape[0] else q,
                            self.observed.scaling[layer.layer_idx])
            if len(writers) < k.shape[0]:
                k, v = k.index_select(0, rows_idx.to(device)), v.index_select(0, rows_idx.to(device))
            idx = self.policy.select(k, keep, observed, valid=valid)  # [writers, num_kv_heads, keep]
            k = k.gather(2, idx[..., None].expand(-1, -1, -1, k.shape[-1]))  # [writers, num_kv_heads, keep, dim]
            v = v.gather(2, idx[..., None].expand(-1, -1, -1, v.shape[-1]))
            if device not in targets:  # (a quantized store encodes the kept tokens in their new blocks)
                targets[device] = group.prepare_write(slots, device, new_step=not planned, start=dropped * B,
                                                      num_new=keep)
                planned = True
            group.write(layer.layer_idx, targets[device], k.contiguous(), v.contiguous())
        fills = [min(B, keep - j * B) for j in range(nb)]
        return install_fresh_rows(pool, rt, by_table, fresh, fills, dropped, span)

    def _evicted(self, cache: RetentionOwner, held: int, n: int, freed: dict[int, list[int]],
                 kept: dict[int, int] | None = None) -> None:
        """`n` tokens evicted per row, `held` spanned by the tables; `freed`: per layer group, the block ids let
        go; `kept`: per group, the tokens it kept (a tier may keep fewer than `held`)."""
        self.num_evicted += n
        self.num_evictions += 1
        self.num_blocks_freed += sum(len(ids) for ids in freed.values())
        self.num_held_after_eviction = held
        cache.set_held(held, self.num_evicted)
        for g, ids in freed.items():  # one event per group (block ids are per group; the group named for tiers)
            tokens = n + (held - kept.get(g, held) if kept else 0)  # what this group's rows let go
            cache.pool.events.emit("evict", sorted(Counter(ids)), seq=cache.seq_id, policy=self.policy.name,
                                   tokens=tokens, group=g if len(freed) > 1 else None)

    # -- checks ------------------------------------------------------------------------------------------------------
    def check_scoring(self, cache: RetentionOwner, num_rows: int) -> list[str]:
        """What breaks the reconstruction scores' invariant (`ContextScores.check`); empty when none are kept."""
        if self.scoring is None:
            return []
        heads = {layer.layer_idx: layer.spec.num_kv_heads for layer in cache.retention_layers() if layer.is_initialized}
        return self.scoring.check(num_rows, heads)

    def check_crop(self, new_len: int) -> None:
        """Raise `ValueError` if a crop to `new_len` held tokens reaches into what an eviction left."""
        if self.num_evictions and new_len < self.num_held_after_eviction:
            raise ValueError(
                f"crop to {counted(new_len, 'held token')} reaches before what the retention policy "
                f"({self.policy.name}) kept at its last eviction ({counted(self.num_held_after_eviction, 'token')}): "
                "evicted tokens cannot come back. Crop at most the tokens added since (assisted decoding crops only "
                "its last step)."
            )

    def stats(self, held: int, per_layer: tuple[int, ...] = ()) -> RetentionStats:
        """`held`: tokens the rows' tables span; `per_layer`: with tiers, what each layer holds (then
        `tokens_held` is their mean, rounded down)."""
        mean = sum(per_layer) // len(per_layer) if per_layer else held
        return RetentionStats(self.policy.name, held + self.num_evicted, mean, self.num_evictions,
                              self.num_blocks_freed, per_layer)
