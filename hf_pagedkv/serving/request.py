"""`Request`: one generation request inside the `Engine`, and `RequestOutput`, what a caller gets back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from hf_pagedkv.serving.sampling import SamplingParams


class RequestStatus(IntEnum):
    """Where a request is in its life; the values up to `FAILED` are transformers' continuous-batching ones."""

    PENDING = 0  # waiting for admission (never run, or preempted: swapped out, or freed to be recomputed)
    PREFILLING = 1  # admitted; its prompt (or, after a preemption, prompt + generated tokens) is being computed
    DECODING = 2  # admitted; one token per step
    FINISHED = 3  # a stop token or max_new_tokens
    FAILED = 4  # an error (in `error`): too large for the pool, or an exception in its forward step
    CANCELLED = 5  # `Engine.cancel`


@dataclass
class RequestOutput:
    """What a request produced, shaped like transformers' continuous-batching `GenerationOutput` (same field names),
    plus `finish_reason` and `num_preemptions`.

    Times are `time.perf_counter()` seconds, as transformers records them.
    """

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # not computed: always empty (transformers' default too)
    error: str | None = None  # why the request failed, or None
    status: RequestStatus = RequestStatus.PENDING
    created_time: float = 0.0  # when `add_request` took it
    lifespan: tuple[float, float] = (-1, -1)  # (first admitted, finished); -1 until then
    timestamps: list[float] | None = None  # when each generated token was sampled
    finish_reason: str | None = None  # "stop" (a stop token), "length" (max_new_tokens), "cancelled", "error"
    num_preemptions: int = 0  # times its blocks were freed for other requests and its tokens recomputed

    def is_finished(self) -> bool:
        """Whether the request reached a terminal state (finished, failed or cancelled)."""
        return self.status >= RequestStatus.FINISHED


class Request:
    """The engine's state of one request.

    Tokens of a request and what the pool holds of them::

        all_ids:   [ prompt ............ | generated ...... ]
        cache:     [ computed (K/V in blocks) | pending    ]   num_computed = cache.get_seq_length()
                                           the next step computes (a chunk of) the pending tokens; when a step
                                           computes the last of them, its logits give the next token

    Invariants: `cache` is None exactly when the request holds no blocks (pending to be (re)computed, or terminal);
    a pending request with a cache was swapped out (its cache is offloaded to the host tier, `num_computed` kept);
    `num_computed <= len(all_ids) - 1` while it runs (the last token's K/V are computed by the step that samples
    after it); `generated` only grows; a terminal request never runs again.
    """

    def __init__(self, request_id: str, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int], arrival: int, device: torch.device) -> None:
        self.request_id = request_id  # the caller's name for it; fixed
        self.prompt = prompt  # prompt token ids; fixed
        self.max_new_tokens = max_new_tokens  # tokens to generate at most; fixed
        self.sampling = sampling  # greedy or sampling settings; fixed
        self.stop_ids = stop_ids  # token ids that end the request (included in its output); fixed
        self.arrival = arrival  # order of `add_request` calls: the admission and preemption order; fixed
        # draws of a sampled request, seeded once: its state survives preemption, so a resumed request draws the
        # same numbers as one never preempted; set here only
        self.generator: torch.Generator | None = None
        if sampling.do_sample:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(sampling.seed)
        self.generated: list[int] = []  # sampled tokens; appended by the engine only
        self.timestamps: list[float] = []  # perf_counter of each generated token; appended with `generated`
        self.retention = None  # its RetentionPolicy, or None (it keeps every token); set by the engine when added
        self.cache = None  # its PagedCache while it holds blocks (device, or host when swapped); the scheduler only
        self.busy = None  # the pool's busy mark of `cache` (no swapping it out while it runs); with `cache`
        self.num_computed = 0  # tokens of `all_ids` whose K/V the cache holds; set by the engine after a step
        self.num_published = 0  # full prompt blocks published to the prefix index so far; the engine only
        self.num_hit_tokens = 0  # prompt tokens its first admission found cached (prefix hit)
        self.num_preemptions = 0  # times the scheduler freed its blocks; the scheduler only
        self.status = RequestStatus.PENDING  # set through `set_status`
        self.error: str | None = None  # the failure message of a FAILED request
        self.finish_reason: str | None = None  # set when it reaches a terminal state
        self.cancel_requested = False  # `Engine.cancel` during a step that computes it: cancelled after the step
        self.created_time = time.perf_counter()  # add_request
        self.first_admitted: float = -1.0  # first admission (start of `lifespan`)
        self.finished_time: float = -1.0  # terminal state reached

    @property
    def all_ids(self) -> list[int]:
        """Prompt then generated tokens (a new list)."""
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def num_pending(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_terminal(self) -> bool:
        return self.status >= RequestStatus.FINISHED

    @property
    def max_stored_tokens(self) -> int:
        """Tokens whose K/V it holds at most: prompt and generated tokens but the last (never fed back)."""
        return len(self.prompt) + self.max_new_tokens - 1

    def set_status(self, status: RequestStatus, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first_admitted < 0 and status in (RequestStatus.PREFILLING, RequestStatus.DECODING):
            self.first_admitted = now
        if status >= RequestStatus.FINISHED and self.finished_time < 0:
            self.finished_time = now
        self.status = status

    def output(self) -> RequestOutput:
        """A snapshot (copies of the lists)."""
        return RequestOutput(
            request_id=self.request_id, prompt_ids=list(self.prompt), generated_tokens=list(self.generated),
            error=self.error, status=self.status, created_time=self.created_time,
            lifespan=(self.first_admitted, self.finished_time), timestamps=list(self.timestamps),
            finish_reason=self.finish_reason, num_preemptions=self.num_preemptions)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={len(self.prompt)}, "
                f"generated={len(self.generated)}, computed={self.num_computed})")


__all__ = ["Request", "RequestOutput", "RequestStatus"]
