"""`Engine`: continuous batching on a `BlockPool`: requests join and leave between steps, and each step runs every
running request in one forward.

Layout: **packed varlen, batch 1** (`packed_cache.py`). A step's tokens, one decode token per decoding request plus
prompt chunks of the requests being prefilled, are packed into one row with each token's own position; each
attention layer writes every request's new K/V into that request's own `PagedCache` and attends each request to
exactly its own blocks (`packed_attention.py`). Why packed rather than rows of a batch: rows of a batch must have
equal lengths, so requests of different lengths would need padding (computed, and stored or masked) and a decode
row could not sit next to a prefill chunk; packed, the linear layers see exactly the step's real tokens (at most
`max_batch_tokens`), and attention costs each request its own ``new x held`` tokens, nothing for the others.
Each request keeps its own `PagedCache`, so allocation, copy-on-write, prefix attach and publish and sliding
windows and quantized storage are the cache's own, unchanged.

Scheduling (admission, chunked prefill within `max_batch_tokens`, preemption of the latest arrival, recomputation)
is `scheduler.py`'s. Failures: a forward that raises an `Exception` fails the requests of that step (their outputs
carry the error; their blocks are freed) and the others go on; a `KeyboardInterrupt` (or other `BaseException`)
mid-step, or a `PoolExhaustedError` (another user of the pool took the promised blocks), puts the step's requests
back in the waiting queue to be recomputed exactly, frees their blocks and re-raises (the former) or goes on (the
latter).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from hf_pagedkv._compat import layer_plan
from hf_pagedkv.adapter.paged_cache import PagedCache
from hf_pagedkv.pool.block_pool import BlockPool
from hf_pagedkv.errors import PoolExhaustedError
from hf_pagedkv.retention.policy import RetentionPolicy
from hf_pagedkv.serving.engine_loop import EngineLoop
from hf_pagedkv.serving.engine_stats import EngineStats, LatencyLog, LatencySummary
from hf_pagedkv.serving.packed_forward import PackedForward
from hf_pagedkv.serving.request import Request, RequestOutput, RequestStatus
from hf_pagedkv.serving.request_checks import check_request
from hf_pagedkv.serving.request_retention import ENGINE_DEFAULT, EngineRetention
from hf_pagedkv.serving.sampling import sample
from hf_pagedkv.serving.scheduler import Scheduler, StepBatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 512  # tokens per step by default


class Engine:
    """A continuous-batching engine for one decoder-only model on a `BlockPool` (module docstring: layout, policy).

    Use it step by step (`add_request`, then `step()` until done, or `stream(request_id)`, which steps), or in a
    background thread (`start()` / `stop()`, or ``with Engine(...) as engine:``), where `add_request`, `cancel` and
    `stream` may be called from any thread.

    Args:
        model (`PreTrainedModel`): a decoder-only model. During each step its attention implementation is switched
            to the packed attention and back, so do not run it elsewhere while the engine steps it.
        pool (`BlockPool`, *optional*): where the requests' K/V live; a new growable pool by default. A fixed pool
            (`num_blocks` / `max_memory`) preempts requests when full; ``prefix_caching=True`` shares prompt
            prefixes between requests, in flight.
        generation_config (`GenerationConfig`, *optional*): default stop tokens (`eos_token_id`) and
            `max_new_tokens`; the model's by default.
        max_batch_tokens (`int`, *optional*, defaults to 512): tokens computed per step (decode tokens plus prefill
            chunks).
        compact_blocks (`int`, *optional*, defaults to 256): after each step, move up to this many blocks per layer
            group so that each request's blocks lie consecutively (`BlockPool.compact`): its cache then reads its
            history as a view instead of gathering it, which is most of a decode step's cache work once requests
            interleave their blocks. Done only while every row in the pool is one of the engine's (no other cache's
            forward can run meanwhile); 0: never.
        retention (`RetentionPolicy` or `str`, *optional*): every request's retention policy unless `add_request`
            names one: a `hf_pagedkv.retention` policy or a spec such as ``"sink_window:4:1024"`` (`request_retention`).

    Raises:
        ValueError: `pool` not a `BlockPool`; `max_batch_tokens` not a positive int; `compact_blocks` not an int
            >= 0; a model layer type a `PagedCache` does not store, or a pool holding another model's layers; a bad
            `retention`, or one the engine cannot run (`engine_policy_problem`); a `max_memory` pool that holds less
            than one block of this model (the pool registers the model's layers here: `size_pool`).

    Example:

    ```python
    >>> from hf_pagedkv import BlockPool
    >>> from hf_pagedkv.serving import Engine
    >>> engine = Engine(model, BlockPool(num_blocks=512, prefix_caching=True))
    >>> rid = engine.add_request(tokenizer("Hello").input_ids, max_new_tokens=20)
    >>> tokens = list(engine.stream(rid))      # steps the engine until the request is done
    >>> engine.stats().ttft.p50
    ```
    """

    def __init__(self, model, pool: BlockPool | None = None, *, generation_config=None,
                 max_batch_tokens: int | None = None, compact_blocks: int = 256, retention=None) -> None:
        if pool is None:
            pool = BlockPool()
        if not isinstance(pool, BlockPool):
            raise ValueError(f"Engine: `pool` must be a hf_pagedkv.BlockPool, got {type(pool).__name__}.")
        max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if max_batch_tokens is None else max_batch_tokens
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"Engine: max_batch_tokens must be an int >= 1 (tokens per step), got "
                             f"{max_batch_tokens!r}.")
        if isinstance(compact_blocks, bool) or not isinstance(compact_blocks, int) or compact_blocks < 0:
            raise ValueError(f"Engine: compact_blocks must be an int >= 0 (0: never compact), got {compact_blocks!r}.")
        windows = {window for kind, window in layer_plan(model.config) if kind != "dummy"}  # raises ValueError
        PagedCache(pool=pool, config=model.config).release()  # a pool of another model raises here
        groups = sorted({pool.group_for(w) for w in windows})
        self.model = model  # fixed
        self.pool = pool  # fixed
        # default stop tokens and max_new_tokens; fixed
        self.generation_config = model.generation_config if generation_config is None else generation_config
        self.max_batch_tokens = max_batch_tokens  # fixed
        self.compact_blocks = compact_blocks  # blocks moved per step at most; fixed
        self._device = model.device  # where sampling generators live; fixed
        self._vocab_size = model.get_input_embeddings().num_embeddings  # valid token ids: 0 .. vocab - 1
        self._max_positions = getattr(model.config, "max_position_embeddings", None)  # prompt + max_new_tokens, at most
        self._forward = PackedForward(model, pool)  # runs a scheduled step through the model; fixed
        self._retention = EngineRetention(model, retention)  # the requests' policies (the default); fixed
        self._scheduler = Scheduler(pool, model, groups, [pool.group_for(None)] if None in windows else [],
                                    max_batch_tokens)
        self._lock = threading.RLock()  # guards requests, queues and counters; not held during a forward
        self._cond = threading.Condition(self._lock)  # notified when tokens arrive or requests change
        self._requests: dict[str, Request] = {}  # every request not popped; add_request / pop_output only
        self._in_flight: set[Request] = set()  # requests of the step whose forward runs now
        self._num_added = 0  # requests added (arrival order)
        self._next_default_id = 0  # default ids "req_<n>" take n >= this and >= the arrival: never one given before
        self._counts = {s: 0 for s in (RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED)}
        self._num_steps = 0
        self._num_tokens_computed = 0
        self._num_tokens_generated = 0
        self._kv_peak = 0  # most bytes in use seen after a step
        self._latencies = LatencyLog()
        # the background thread (`start` / `stop`); waits on `_cond` for work
        self._loop = EngineLoop(self.step, lambda: self._scheduler.has_work, self._fail_running, self._cond)
        try:
            self.size_pool()  # a max_memory pool gets its blocks now: one too small for a block is refused here
        except ValueError as e:
            raise ValueError(f"Engine: {e}") from None

    # -- requests ---------------------------------------------------------------------------------------------------
    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None, *,
                    do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                    seed: int | None = None, eos_token_id: int | list[int] | None = None,
                    retention=ENGINE_DEFAULT) -> str:
        """Queue a request; it joins the running batch at a later step. Nothing touches the pool here.

        Args:
            input_ids (`list[int]`, or `torch.LongTensor` of shape `[seq_len]` or `[1, seq_len]`): the prompt.
            request_id (`str`, *optional*): its name; by default ``"req_<n>"``, n the request's arrival number
                (0, 1, ...), or the next one not in use and not given before.
            max_new_tokens (`int`, *optional*): tokens to generate at most (>= 1); the generation config's, or 20.
            do_sample, temperature, top_p, top_k (*optional*): sampling (as `generate`); greedy by default.
            seed (`int`, *optional*): seed of the request's own generator (sampling); drawn from torch's global
                generator when not given (under tensor parallel, seed that alike on every rank: `torch.manual_seed`,
                or the ranks sample different tokens). A preempted request keeps its generator's state, so it
                samples the same tokens as without preemption.
            eos_token_id (`int` or `list[int]`, *optional*): stop tokens (kept in the output); the generation
                config's by default; ``[]`` for none.
            retention (`RetentionPolicy`, `str` or `None`, *optional*): its retention policy or spec; None: none;
                the engine's `retention` by default.

        Returns:
            `str`: the request id.

        Raises:
            ValueError: naming the request: an empty prompt, token ids that are not ints in ``[0, vocab_size)``,
                `max_new_tokens` not an int >= 1, a prompt and max_new_tokens past the model's context, bad sampling
                settings or `retention`, or a request id in use.
        """
        with self._lock:
            arrival = self._num_added
            default_n = max(arrival, self._next_default_id)
            if request_id is None:
                while f"req_{default_n}" in self._requests:  # (a caller's own id of that form)
                    default_n += 1
            rid = f"req_{default_n}" if request_id is None else request_id
            if not isinstance(rid, str):  # (before the lookup below: an unhashable id would raise a TypeError there)
                raise ValueError(f"add_request: request_id must be a str, got {type(rid).__name__} {rid!r}.")
            if rid in self._requests:
                raise ValueError(f"add_request: request id {rid!r} is already in use; pick another (or pop_output "
                                 "the finished one first).")
            req = check_request(rid, input_ids, max_new_tokens, self.generation_config, self._vocab_size,
                                dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k),
                                seed, eos_token_id, arrival, self._device, self._max_positions)
            req.retention = self._retention.for_request(retention, rid)
            self._num_added += 1
            if request_id is None:
                self._next_default_id = default_n + 1
            self._requests[rid] = req
            self._scheduler.add(req)
            self._cond.notify_all()
            return rid

    def cancel(self, request_id: str) -> bool:
        """Stop a request and free its blocks (at the end of the current step if it is computing in it).

        Returns:
            `bool`: False when it had already finished, failed or been cancelled.

        Raises:
            KeyError: an unknown request id.
        """
        with self._lock:
            req = self._get(request_id)
            if req.is_terminal:
                return False
            if req in self._in_flight:
                req.cancel_requested = True
            else:
                self._terminate(req, RequestStatus.CANCELLED, "cancelled")
            return True

    def output(self, request_id: str) -> RequestOutput:
        """A snapshot of the request's output so far (`RequestOutput`). Raises `KeyError` for an unknown id."""
        with self._lock:
            return self._get(request_id).output()

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished, failed or cancelled request, which the engine then forgets.

        Raises:
            KeyError: an unknown id. ValueError: the request has not ended (cancel it first).
        """
        with self._lock:
            req = self._get(request_id)
            if not req.is_terminal:
                raise ValueError(f"pop_output({request_id!r}): the request is still {req.status.name}; wait for it "
                                 "or cancel() it first.")
            del self._requests[request_id]
            return req.output()

    def stream(self, request_id: str):
        """Yield the request's generated tokens (`int`) as they come, from the first; steps the engine itself when
        no background thread runs. Closing the iterator before the request ends (`close()`, or dropping it, as a
        client that goes away) cancels the request and frees its blocks.

        Raises:
            KeyError: an unknown id. RuntimeError: the request failed (after its tokens so far).
        """
        with self._lock:
            req = self._get(request_id)
        sent = 0
        while True:
            with self._cond:
                while len(req.generated) <= sent and not req.is_terminal and self.is_started:
                    self._cond.wait(0.1)
                new, done, threaded = req.generated[sent:], req.is_terminal, self.is_started
            try:
                yield from new
            except GeneratorExit:
                if not req.is_terminal:
                    self.cancel(request_id)
                raise
            sent += len(new)
            if done:
                if req.status == RequestStatus.FAILED:
                    raise RuntimeError(f"request {request_id!r} failed: {req.error}")
                return
            if not new and not threaded:
                self.step()

    @property
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        with self._lock:
            return self._scheduler.has_work

    # -- stepping -----------------------------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one step: schedule (admit, preempt, reject), one forward for every scheduled token, sample, finish.

        Returns:
            `int`: tokens computed (0 when nothing could run).

        Raises:
            KeyboardInterrupt: re-raised after the step's requests were put back in the queue (blocks freed).
        """
        with self._lock:
            batch = self._scheduler.schedule()
            for req in batch.rejected:
                self._terminate(req, RequestStatus.FAILED, "error", error=req.error)
            self._in_flight = {c.request for c in batch.chunks}
            if not batch.chunks:
                self._cond.notify_all()
                return 0
        try:
            logits = self._forward(batch)  # [sampling chunks, vocab]
        except BaseException as error:
            with self._lock:
                self._in_flight = set()
                self._abort(batch, error)
                self._cond.notify_all()
            if not isinstance(error, Exception):
                raise
            return 0
        kv_bytes = self.pool.stats().bytes_in_use  # the step's blocks, before its finished requests free theirs
        with self._lock:
            self._in_flight = set()
            self._kv_peak = max(self._kv_peak, kv_bytes)
            try:
                self._finish_step(batch, logits)
            except BaseException:  # (an interrupt while tokens were applied: recompute, whatever was applied)
                for c in batch.chunks:
                    if not c.request.is_terminal:
                        self._scheduler.requeue(c.request)
                raise
            self._compact()
            self._cond.notify_all()
        return batch.num_tokens

    def _compact(self) -> None:
        """Lay requests' blocks out consecutively again (see `compact_blocks`), between steps, when every row in
        the pool is one of the engine's running requests (each holds one)."""
        if not self.compact_blocks:
            return
        with self.pool.lock:  # no other cache registers between the check and the moves
            if self.pool.stats().num_sequences <= len(self._scheduler.running):
                self.pool.compact(self.compact_blocks)

    def _finish_step(self, batch: StepBatch, logits: torch.Tensor) -> None:
        now = time.perf_counter()
        B = self.pool.block_size
        greedy = logits.float().argmax(-1).tolist()  # [sampling chunks]
        row = 0
        for c in batch.chunks:
            req = c.request
            req.num_computed = c.start + c.num_tokens
            if c.samples:
                logit_row, row = row, row + 1
            if req.cancel_requested:
                self._terminate(req, RequestStatus.CANCELLED, "cancelled")
                continue
            full = min(req.num_computed, len(req.prompt)) // B
            if self.pool.prefix_caching and full > req.num_published:  # in flight: later requests share them now
                req.cache.publish(req.prompt[: full * B], self.model)
                req.num_published = full
            if not c.samples:
                continue
            s = req.sampling
            token = greedy[logit_row] if not s.do_sample else sample(logits[logit_row], s, req.generator)
            req.generated.append(token)
            req.timestamps.append(now)
            self._num_tokens_generated += 1
            if token in req.stop_ids:
                self._terminate(req, RequestStatus.FINISHED, "stop")
            elif len(req.generated) >= req.max_new_tokens:
                self._terminate(req, RequestStatus.FINISHED, "length")
            else:
                req.set_status(RequestStatus.DECODING, now)
        self._num_steps += 1
        self._num_tokens_computed += batch.num_tokens

    def _abort(self, batch: StepBatch, error: BaseException) -> None:
        """The forward raised: free the step's requests' blocks (their caches are mid-step); fail them for an
        `Exception`, queue them again to recompute for an interrupt or a pool another user filled."""
        retry = not isinstance(error, Exception) or isinstance(error, PoolExhaustedError)
        message = f"{type(error).__name__}: {error}"
        if retry:
            logger.warning("Engine step interrupted (%s); its %d requests will be recomputed", message,
                           len(batch.chunks))
        else:
            logger.error("Engine step failed; failing its %d requests", len(batch.chunks), exc_info=error)
        for c in batch.chunks:
            req = c.request
            if req.cancel_requested:
                self._terminate(req, RequestStatus.CANCELLED, "cancelled")
            elif retry:
                self._scheduler.requeue(req)
            else:
                self._terminate(req, RequestStatus.FAILED, "error", error=message)

    def _terminate(self, req: Request, status: RequestStatus, reason: str, error: str | None = None) -> None:
        if status == RequestStatus.FINISHED:
            self._scheduler.finish(req)
        else:
            self._scheduler.remove(req)
        req.error = error
        req.finish_reason = reason
        req.set_status(status)
        self._counts[status] += 1
        if status == RequestStatus.FINISHED:
            self._latencies.record(req.created_time, req.timestamps, req.finished_time)

    def size_pool(self) -> None:
        """Have the pool register the model's layers now (`PackedForward.size_pool`; the engine does it when built):
        a `max_memory` pool gets its blocks then, which admission needs, and a quantized store knows how many layers
        write each step (a packed step's caches interleave layer by layer: `QuantizedBlockStates`). A no-op once
        done.

        Raises:
            ValueError: the pool's `max_memory` holds less than one block of this model.
        """
        groups = [self.pool.groups[g] for g in self._scheduler.groups]
        unsized = not self.pool.growable and not all(g.num_blocks for g in groups)
        if unsized or (self.pool.quant.is_quantized and not all(g.layers for g in groups)):
            self._forward.size_pool(self.pool)

    @property
    def retention(self) -> RetentionPolicy | None:
        """The retention policy of every request that names none (the `retention` this engine was built with)."""
        return self._retention.default

    # -- background thread --------------------------------------------------------------------------------------------
    @property
    def is_started(self) -> bool:
        """Whether the background loop runs."""
        return self._loop.is_started

    def start(self) -> Engine:
        """Step in a background thread until `stop()`; requests may be added, cancelled and streamed meanwhile."""
        with self._lock:
            if not self.is_started and _is_distributed():
                # NOTE: under tensor parallel every rank must step the same requests: the background loop steps as
                # its thread finds them, so a request added to one rank's engine a step before another's splits the
                # ranks' schedules and the model's next all-reduce waits forever. Stepping from one thread (`step`,
                # `stream`, `generate_batch`) with the same calls on every rank keeps them together (docs/serving.md).
                logger.warning("Engine.start() under torch.distributed (world size %d): every rank's engine must get "
                               "the same add_request / cancel calls between the same steps, which a background loop "
                               "does not ensure; step from one thread instead (Engine.step, generate_batch).",
                               torch.distributed.get_world_size())
            self._loop.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """End the background loop after its current step; unfinished requests stay queued (`step` or `start`
        goes on with them)."""
        self._loop.stop(timeout)

    def close(self) -> None:
        """Stop the loop, cancel every unfinished request and free its blocks."""
        self.stop()
        with self._lock:
            for req in list(self._requests.values()):
                if not req.is_terminal:
                    self._terminate(req, RequestStatus.CANCELLED, "cancelled")

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _fail_running(self) -> None:
        """An engine fault outside a forward (the background loop caught it): fail what runs."""
        with self._lock:
            for req in list(self._scheduler.running):
                self._terminate(req, RequestStatus.FAILED, "error", error="engine fault (see the log)")

    # -- observation --------------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Queues, counters, latency percentiles and KV memory now (`EngineStats`)."""
        with self._lock:
            s, log = self._scheduler, self._latencies
            return EngineStats(
                num_waiting=len(s.waiting), num_running=len(s.running),
                num_finished=self._counts[RequestStatus.FINISHED], num_failed=self._counts[RequestStatus.FAILED],
                num_cancelled=self._counts[RequestStatus.CANCELLED], num_preemptions=s.num_preemptions,
                num_swaps=s.num_swaps,
                num_allocation_failures=s.num_allocation_failures, num_steps=self._num_steps,
                num_tokens_computed=self._num_tokens_computed, num_tokens_generated=self._num_tokens_generated,
                ttft=LatencySummary.of(log.ttft), tpot=LatencySummary.of(log.tpot), e2e=LatencySummary.of(log.e2e),
                kv_bytes_in_use=self.pool.stats().bytes_in_use, kv_bytes_peak=self._kv_peak,
                prefix_lookup_tokens=s.num_lookup_tokens, prefix_hit_tokens=s.num_hit_tokens)

    def _get(self, request_id: str) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"no request {request_id!r} in this engine") from None


def _is_distributed() -> bool:
    """Whether this process is one rank of several (torch.distributed initialized, world size > 1)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "Engine"]
