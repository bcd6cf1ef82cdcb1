"""`Scheduler`: which requests compute which tokens in the next engine step, thinking in blocks as vLLM's does.

Each step has a budget of `max_batch_tokens` tokens. The scheduler fills it in this order:

1. running requests that decode (one token each), oldest first;
2. running requests still prefilling (a chunk each, as much as the budget left allows), oldest first;
3. waiting requests, oldest first (a preempted request keeps its arrival, so it comes back before newer ones),
   each admitted with a first chunk while the budget lasts and its blocks are free; admission stops at the
   first request that does not fit (no overtaking, so a large request is not starved). Nothing is admitted in a
   step that preempted. With prefix caching, a request whose prompt starts with full blocks that a running request
   is still computing waits (it keeps its place; later ones may go first) until they are published, then attaches
   to them: requests that arrive together with the same prefix prefill it once.

Blocks: a request computing tokens ``start .. start + n - 1`` needs ``ceil((start + n) / B) - ceil(start / B)`` new
blocks in each layer group (its cache allocates them in the forward). The scheduler only promises blocks the pool
can reserve (free or cached-idle: `BlockGroup.can_reserve`), summing its promises, so no allocation in the forward
fails. A request with a retention policy (`request_retention`) is counted from what its cache holds: its policy
evicts before each of its steps, so it opens new blocks after the held ones (plus the fresh blocks a token-level
policy compacts into), and it can run when the most it holds at once (`RetentionPolicy.max_held`) fits the pool,
however many tokens it generates. When a running request cannot get its blocks, the scheduler **preempts the
latest-arrived running request** (possibly the one asking) and queues it again (it keeps its arrival):

- **swap**, when the pool has a host tier (`BlockPool(host_memory=...)`) with room: its cache moves there
  (`PagedCache.offload`) and comes back when it is readmitted (`prefetch`), the same K/V bit for bit;
- else **recompute**: with prefix caching its computed full blocks are published first (so its recomputation may
  hit them), then its cache is released, and when it is admitted again its tokens so far (prompt + generated) are
  computed again.

A request whose prompt and new tokens need more blocks than the whole pool holds can never run: it fails at
admission, with an error naming the sizes.

A quantized pool with `max_memory` holds each running request's partial last block in full precision inside its
budget (`staging_budget`): the scheduler admits a request only while the stages the running ones may hold (one per
decoding request, two per prefilling one) leave it what it may hold (one when the step computes its whole prompt, two
when it prefills in chunks), so no step runs out of stages.

Invariants: `waiting` and `running` are sorted by arrival and disjoint; a running request holds a cache on the
device, a waiting one none or an offloaded one (swapped); the blocks promised in a step fit what the pool could
reserve when they were promised.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from hf_pagedkv.adapter.paged_cache import PagedCache
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.pool.staging_budget import stage_capacity, stages_of_rows
from hf_pagedkv.errors import PoolExhaustedError, counted
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.serving.request import Request, RequestStatus
from hf_pagedkv.serving.request_retention import held_tokens, max_held_blocks, step_blocks


@dataclass(frozen=True)
class Chunk:
    """Tokens ``start .. start + num_tokens - 1`` of one request, computed in a step."""

    request: Request
    start: int  # tokens its cache holds before the step
    num_tokens: int  # tokens computed now (1 for a decode step)

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the request's last token, so the step samples its next token."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True)
class StepBatch:
    """What one step does, as scheduled: its chunks (in packed order), and what scheduling changed."""

    chunks: tuple[Chunk, ...]  # oldest request first within decodes, then prefills, then admissions
    preempted: tuple[Request, ...]  # requests whose blocks were freed to make room
    rejected: tuple[Request, ...]  # requests too large for the whole pool (to be failed)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Admission, chunked prefill within a token budget, and preemption (see the module docstring).

    Args:
        pool (`BlockPool`): the pool the requests' caches take their blocks from.
        model (`PreTrainedModel`): the model (its config builds the caches; it keys the prefix index).
        groups (`list[int]`): the pool's layer groups the model's layers use.
        full_groups (`list[int]`): those of full-attention layers (whose blocks grow with the request).
        max_batch_tokens (`int`): tokens per step.
    """

    def __init__(self, pool: BlockPool, model, groups: list[int], full_groups: list[int],
                 max_batch_tokens: int) -> None:
        self.pool = pool  # fixed
        self.model = model  # fixed
        self.groups = groups  # layer groups of the model's layers; fixed
        self.full_groups = full_groups  # the full-attention ones; fixed
        self.max_batch_tokens = max_batch_tokens  # fixed
        self.waiting: list[Request] = []  # not holding blocks, by arrival; add / preempt / schedule change it
        self.running: list[Request] = []  # holding a cache, by arrival; schedule / remove change it
        self.num_preemptions = 0  # requests preempted, all steps
        self.num_swaps = 0  # of those, swapped out to the host tier (the others are recomputed)
        self.num_allocation_failures = 0  # times a request's blocks were not free (preemption or deferral)
        self.num_lookup_tokens = 0  # prompt tokens looked up in the prefix index at first admissions
        self.num_hit_tokens = 0  # of those, tokens found cached

    # -- queues ---------------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=_arrival)

    def remove(self, req: Request) -> None:
        """Take `req` out of the queues and release its blocks (cancelled, failed or finished)."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req, publish=False)

    def finish(self, req: Request) -> None:
        """`req` finished: publish its computed full blocks (prefix caching), release them."""
        self.running.remove(req)
        self._release(req, publish=True)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- capacity ---------------------------------------------------------------------------------------------------
    def capacity(self, group: int) -> int | None:
        """Blocks a request may hold at most in `group`: all of a fixed pool's (less its pad block); None for a
        growable pool."""
        if self.pool.growable:
            return None
        g = self.pool.groups[group]
        return g.num_blocks - (g.pad_block is not None)

    def too_large(self, req: Request) -> str | None:
        """Why `req` can never run in this pool (its prompt and new tokens need more blocks than it holds), or
        None."""
        need = max_held_blocks(req, self.max_batch_tokens, self.pool.block_size)
        for group in self.full_groups:
            cap = self.capacity(group)
            if cap is not None and need > cap:
                policy = "" if req.retention is None else (
                    f", with retention={req.retention!r} and max_batch_tokens={self.max_batch_tokens}")
                return (f"request {req.request_id!r} needs {counted(need, 'KV block')} "
                        f"({counted(len(req.prompt), 'prompt token')} + max_new_tokens={req.max_new_tokens}, "
                        f"block_size={self.pool.block_size}{policy}) but the whole BlockPool holds {cap}: lower "
                        "max_new_tokens or shorten the prompt, or give the pool more blocks (num_blocks / max_memory, "
                        "or num_blocks=None to let it grow).")
        return None

    def _needs(self, req: Request, start: int, n: int, cache=None) -> dict[int, int]:
        """New blocks per layer group for tokens ``start .. start + n - 1`` of `req` (`cache`: its cache, by default
        `req.cache`; with a retention policy, counted from what the cache holds, `step_blocks`). NOTE: a
        sliding-window group frees the blocks that leave its window before it allocates, and an eviction frees
        blocks before the step allocates; they are not counted, so the promise is an upper bound there."""
        new = step_blocks(req, req.cache if cache is None else cache, start, n, self.pool.block_size)
        return {g: new for g in self.groups}

    def _fits(self, promised: Counter, needs: dict[int, int]) -> bool:
        with self.pool.lock:
            return all(self.pool.groups[g].can_reserve(promised[g] + n) for g, n in needs.items() if n)

    # -- one step ---------------------------------------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        """Choose the next step's chunks (module docstring); admits, preempts and rejects as it goes."""
        budget = self.max_batch_tokens
        promised: Counter = Counter()  # group -> blocks promised to this step's chunks
        chunks: dict[Request, tuple[int, dict[int, int]]] = {}  # request -> (tokens, blocks), in packed order
        preempted: list[Request] = []
        order = [r for r in self.running if r.num_pending == 1] + [r for r in self.running if r.num_pending > 1]
        for req in order:
            if budget == 0:
                break
            if req not in self.running:  # preempted for an older request of this step
                continue
            n = min(req.num_pending, budget)
            needs = self._needs(req, req.num_computed, n)
            while not self._fits(promised, needs):
                self.num_allocation_failures += 1
                victim = self.running[-1]  # the latest arrival
                if victim in chunks:  # already scheduled in this step: give its tokens and blocks back
                    tokens, blocks = chunks.pop(victim)
                    budget += tokens
                    promised.subtract(blocks)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chunks[req] = (n, needs)
                promised.update(needs)
                budget -= n
        rejected: list[Request] = []
        stages = stage_capacity(self.pool)  # a quantized max_memory pool's staging area: so many open blocks
        held = self._stages_held() if stages is not None else 0  # stages the running requests may hold
        deferred = 0  # waiting requests at the front left for a prefix in flight (`_prefix_in_flight`)
        while len(self.waiting) > deferred and budget > 0 and not preempted:
            req = self.waiting[deferred]
            if req.cache is None and self._prefix_in_flight(req):
                deferred += 1
                continue
            # one stage (its partial last block) when this step computes all it has pending from a block start;
            # two when it prefills in chunks (`stages_of_rows`) or completes a swapped-in open block and opens another
            whole = req.num_pending <= budget and (req.num_pending == 1 or req.num_computed % self.pool.block_size == 0)
            take = 1 if whole else 2
            if stages is not None and held + take > stages:
                break
            if req.cache is not None:  # swapped out: its blocks come back first
                n = min(req.num_pending, budget)
                needs = self._needs(req, req.num_computed, n)
                blocks = num_blocks_for(held_tokens(req), self.pool.block_size)  # (a sliding group holds fewer)
                if not self._fits(promised, {g: blocks + k for g, k in needs.items()}) or not self._swap_in(req):
                    self.num_allocation_failures += 1
                    break
                self.waiting.pop(deferred)
                chunks[req] = (n, needs)
                promised.update(needs)
                budget -= n
                held += take
                continue
            reason = self.too_large(req)
            if reason is not None:
                self.waiting.pop(deferred)
                req.error = reason
                rejected.append(req)
                continue
            cache = self._attach(req)
            n = min(req.num_tokens - cache.get_seq_length(), budget)
            needs = self._needs(req, cache.get_seq_length(), n, cache)
            if not self._fits(promised, needs):  # (after the attach: reviving cached blocks may use the room up)
                self.num_allocation_failures += 1
                cache.release()
                break
            self.waiting.pop(deferred)
            self._admit(req, cache)
            chunks[req] = (n, needs)
            promised.update(needs)
            budget -= n
            held += take
        batch = tuple(Chunk(req, req.num_computed, n) for req, (n, _) in chunks.items())
        return StepBatch(batch, tuple(preempted), tuple(rejected))

    def _prefix_in_flight(self, req: Request) -> bool:
        """Whether a running request is computing full blocks that `req`'s prompt starts with and has not
        published them yet (with prefix caching, both without a retention policy): `req` had better wait a step
        and attach to them than compute them again."""
        if not self.pool.prefix_caching or req.retention is not None:
            return False
        B = self.pool.block_size
        ids = req.all_ids
        usable = (len(ids) - 1) // B  # `from_prefix` leaves at least the last token to compute
        for other in self.running:
            limit = min(usable, len(other.prompt) // B)  # blocks `other` could still publish that `req` could use
            if other.retention is not None or other.num_published >= limit:
                continue
            shared = 0
            while shared < limit and ids[shared * B:(shared + 1) * B] == other.prompt[shared * B:(shared + 1) * B]:
                shared += 1
            if shared > other.num_published:
                return True
        return False

    def _stages_held(self) -> int:
        """Full-precision stages the running requests may hold at once in a step (`staging_budget.stages_of_rows`)."""
        prefilling = sum(1 for r in self.running if r.num_pending > 1)
        return stages_of_rows(len(self.running) - prefilling, prefilling)

    # -- admission and preemption -----------------------------------------------------------------------------------
    def _attach(self, req: Request) -> PagedCache:
        """A cache for `req`: attached to the longest cached prefix of its tokens with prefix caching, else empty
        (always, with a retention policy: `request_retention`)."""
        if self.pool.prefix_caching and req.retention is None:
            return PagedCache.from_prefix(self.pool, req.all_ids, model=self.model)
        return PagedCache(pool=self.pool, config=self.model.config, retention=req.retention)

    def _admit(self, req: Request, cache: PagedCache) -> None:
        req.cache = cache
        req.busy = self.pool.owner_busy(cache.seq_id)  # not offered for swapping out (hf_pagedkv.generate)
        req.busy.__enter__()
        req.num_computed = cache.get_seq_length()
        req.num_published = req.num_computed // self.pool.block_size
        if req.num_preemptions == 0 and req.first_admitted < 0 and req.retention is None:  # (looked up)
            self.num_lookup_tokens += len(req.prompt)
            self.num_hit_tokens += req.num_computed
            req.num_hit_tokens = req.num_computed
        req.set_status(RequestStatus.PREFILLING if req.num_pending > 1 else RequestStatus.DECODING)
        bisect.insort(self.running, req, key=_arrival)

    def _preempt(self, req: Request) -> None:
        """Swap `req`'s cache out to the host tier, or free its blocks (publishing its computed full blocks first,
        with prefix caching) to recompute its tokens when readmitted; queue it again either way."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.set_status(RequestStatus.PENDING)
        if self.pool.host is not None:
            try:
                req.cache.offload()  # its device blocks are free now; the cache holds host blocks
                self.num_swaps += 1
                self.add(req)
                return
            except PoolExhaustedError:  # the host tier is full: recompute instead
                pass
        self._release(req, publish=True)
        req.num_computed = 0
        self.add(req)

    def _swap_in(self, req: Request) -> bool:
        """Bring a swapped request's cache back (`prefetch`) and run it again; False if its blocks are not free."""
        try:
            req.cache.prefetch()
        except PoolExhaustedError:  # (the promise check counts conservatively; the pool said no: nothing changed)
            return False
        req.set_status(RequestStatus.PREFILLING if req.num_pending > 1 else RequestStatus.DECODING)
        bisect.insort(self.running, req, key=_arrival)
        return True

    def requeue(self, req: Request) -> None:
        """`req`'s step was interrupted (its cache is mid-step): free its blocks without publishing and queue it
        again to recompute, as a preemption does (not counted as one)."""
        if req in self.running:
            self.running.remove(req)
        self._release(req, publish=False)
        req.num_computed = 0
        req.set_status(RequestStatus.PENDING)
        self.add(req)

    def _release(self, req: Request, publish: bool) -> None:
        cache, busy = req.cache, req.busy
        req.cache = req.busy = None
        if cache is None:
            return
        try:
            if publish and self.pool.prefix_caching and req.num_computed >= self.pool.block_size:
                cache.publish(req.all_ids[: req.num_computed], self.model)
        finally:
            busy.__exit__(None, None, None)
            cache.release()


def _arrival(req: Request) -> int:
    return req.arrival


__all__ = ["Chunk", "Scheduler", "StepBatch"]
