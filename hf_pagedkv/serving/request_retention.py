"""`EngineRetention`: the retention policies of an `Engine`'s requests (the engine's default, or a request's own), and
what the scheduler counts of a request whose cache evicts tokens (`held_tokens`, `max_held_blocks` and
`held_blocks_bound`, `step_blocks`).

A request with a policy gets its own `PagedCache(retention=policy)`: the policy evicts before each of the request's
forward steps (at the first layer's `update`, before the step's tokens are written), as it does under
`model.generate` (what `hf-pagedkv generate --retention` runs), and every held key is then visible to every query of
the step (`PackedCache._mask`).
So a request prefilled in one step and never preempted gives the tokens of a solo run with the same policy; a
prompt prefilled in chunks is evicted between its chunks, and a preempted request recomputes its tokens in a fresh
cache (both may then answer differently, as a different prefill would). A request with a policy does not look its
prompt up in the prefix index (an attached prefix would be evicted at other points than its own prefill); its
full prompt blocks are still published for the requests after it.
"""

from __future__ import annotations

from hf_pagedkv.adapter.in_place_reads import IN_PLACE_NAMES
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.retention.importance import ImportancePolicy
from hf_pagedkv.retention.policy import RetentionPolicy
from hf_pagedkv.retention.spec import parse_retention
from hf_pagedkv.serving.request import Request

#: `add_request`'s `retention` when not given: the engine's default policy
ENGINE_DEFAULT = object()


def resolve_retention(retention, where: str) -> RetentionPolicy | None:
    """A policy from what `Engine(retention=...)` or `add_request(retention=...)` takes.

    Args:
        retention (`RetentionPolicy`, `str` or `None`): a policy (`hf_pagedkv.retention`), or a spec as
            ``hf-pagedkv generate --retention`` takes it (``"sink_window:4:1024"``, ``"key_norm:512"``, ...,
            `parse_retention`); None: none (every token kept).
        where (`str`): the call, for the error message.

    Raises:
        ValueError: naming `where`: a bad spec (its part and form), or neither a policy, a str nor None.
    """
    if retention is None or isinstance(retention, RetentionPolicy):
        return retention
    if isinstance(retention, str):
        try:
            return parse_retention(retention)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    raise ValueError(f"{where}: retention must be a hf_pagedkv.retention policy (e.g. SinkWindow(4, 1024)), a spec "
                     f"such as 'sink_window:4:1024', or None; got {type(retention).__name__}.")


def engine_policy_problem(policy: RetentionPolicy, reads_in_place: bool) -> str | None:
    """Why the engine cannot run `policy`, or None.

    Args:
        policy (`RetentionPolicy`): the policy.
        reads_in_place (`bool`): whether the model's attention is ``"hf_pagedkv"`` (it hands the queries to a
            query-aware policy; `sdpa` does not).
    """
    if policy.reconstructs:
        return (f"{policy!r} compresses through a reconstruction pass (hf_pagedkv.compress_context), which the "
                "engine does not run; use a policy that evicts while it generates, e.g. 'sink_window:4:1024' or "
                "'key_norm:512'")
    if policy.is_tiered():
        return (f"{policy!r} gives its tiers of layers layer groups of their own, whose blocks the engine's "
                "scheduler does not count; use an untiered policy, e.g. 'snapkv:0.5' or 'sink_window:4:1024'")
    if policy.needs_queries and not reads_in_place:
        return (f"{policy!r} scores tokens with the queries, which only the 'hf_pagedkv' attention hands to the "
                "cache: load the model with attn_implementation='hf_pagedkv', or use a policy without queries, "
                "e.g. 'key_norm:512'")
    return None


class EngineRetention:
    """The retention policy of each request of one `Engine`: the engine's default, unless `add_request` names one.

    Args:
        model (`PreTrainedModel`): the engine's model (its attention decides whether a query-aware policy can run).
        default (`RetentionPolicy`, `str` or `None`): the engine's default (`resolve_retention`).

    Raises:
        ValueError: a bad default, or one the engine cannot run (`engine_policy_problem`).
    """

    def __init__(self, model, default) -> None:
        self.model = model  # fixed
        self.default = self.check(resolve_retention(default, "Engine"), "Engine")  # fixed

    def for_request(self, retention, request_id: str) -> RetentionPolicy | None:
        """The policy of a new request: `retention` (a policy, a spec or None), or the default when it is
        `ENGINE_DEFAULT`.

        Raises:
            ValueError: naming the request: a bad spec or a policy the engine cannot run.
        """
        if retention is ENGINE_DEFAULT:
            return self.default
        where = f"add_request({request_id!r})"
        return self.check(resolve_retention(retention, where), where)

    def check(self, policy: RetentionPolicy | None, where: str) -> RetentionPolicy | None:
        if policy is not None:
            problem = engine_policy_problem(policy, self.model.config._attn_implementation in IN_PLACE_NAMES)
            if problem is not None:
                raise ValueError(f"{where}: retention={problem}.")
        return policy


# -- what the scheduler counts of a request ---------------------------------------------------------------------------
def held_tokens(req: Request) -> int:
    """Tokens per row `req`'s cache holds now (its computed ones, but those its policy evicted)."""
    if req.retention is None or req.cache is None:
        return req.num_computed
    return req.cache.rows.num_tokens


def max_held_blocks(req: Request, max_batch_tokens: int, block_size: int) -> int:
    """The most blocks per full-attention layer group `req`'s cache holds at once: `held_blocks_bound` of its policy
    and its prompt and new tokens but the last (`Request.max_stored_tokens`)."""
    return held_blocks_bound(req.retention, req.max_stored_tokens, max_batch_tokens, block_size)


def held_blocks_bound(policy: RetentionPolicy | None, stored: int, max_batch_tokens: int, block_size: int) -> int:
    """The most blocks per full-attention layer group a request that stores `stored` tokens in all holds at once
    under `policy`: those of the `stored` tokens, or fewer when the policy bounds what a row holds after a step of
    at most `max_batch_tokens` (`RetentionPolicy.max_held`; a recomputed request's step may be that long); plus, for
    a token-level policy (`ImportancePolicy`), the fresh blocks it compacts the kept tokens into while it still
    holds the old ones. Non-decreasing in `stored`."""
    if policy is None:
        return num_blocks_for(stored, block_size)
    bound = policy.max_held(min(max_batch_tokens, stored), block_size)
    most = stored if bound is None else min(stored, bound)
    copy = min(most, policy.budget or most) if isinstance(policy, ImportancePolicy) else 0
    return num_blocks_for(most, block_size) + num_blocks_for(copy, block_size)


def step_blocks(req: Request, cache, start: int, n: int, block_size: int) -> int:
    """Blocks per layer group the pool must have free for a step of `cache` (`req`'s, holding its tokens
    ``.. start - 1``) computing ``start .. start + n - 1``. Without a policy: those the new tokens open,
    ``ceil((start + n) / B) - ceil(start / B)``. With one, counted from what the cache holds once its policy has
    evicted before the step: those the new tokens open after the held ones (whole blocks a policy drops are not
    counted back: an upper bound); a token-level compaction first takes fresh blocks for the kept tokens, then frees
    the old ones, then the new tokens open theirs, so the most it takes at once is
    ``max(fresh, fresh - old + opened)``."""
    B = block_size
    if req.retention is None:
        return num_blocks_for(start + n, B) - num_blocks_for(start, B)
    held = cache.rows.num_tokens
    evictor = cache.retention.evictor
    if evictor.evicted_at_step != evictor.num_steps:  # (otherwise this step's eviction already ran)
        plan = req.retention.plan(held, start, n, B, step=evictor.num_steps)
        if plan.keep_tokens is not None and 0 < plan.keep_tokens < held:
            keep = plan.keep_tokens
            fresh, opened = num_blocks_for(keep, B), num_blocks_for(keep + n, B) - num_blocks_for(keep, B)
            return max(fresh, fresh - num_blocks_for(held, B) + opened)
        if plan.keep_tokens is None:  # whole blocks freed (the last one never is)
            held -= B * len(plan.drop_positions)
    return num_blocks_for(held + n, B) - num_blocks_for(held, B)


__all__ = ["ENGINE_DEFAULT", "EngineRetention", "engine_policy_problem", "held_blocks_bound", "held_tokens",
           "max_held_blocks", "resolve_retention", "step_blocks"]
