"""`Generation`: the engine requests of one API request (`n` choices per prompt) and their text, as events.

Choices of one prompt share its blocks through the pool's prefix caching: the first choice is submitted at once,
the others once it has its first token, when its prompt's full blocks are published, so they attach to them
instead of computing the prompt again (the engine publishes prompt blocks as soon as their forward is done).

The text of each choice comes from a `TextStream` (stop strings, multi-byte characters). A choice that reaches a
stop string is cancelled in the engine at once (its blocks freed); `cancel()` (the client went away) cancels all.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hf_pagedkv.serving.request import RequestStatus
from hf_pagedkv.serving.server.engine_runner import EngineRunner, TokenEvent
from hf_pagedkv.serving.server.text_stream import TextStream


@dataclass(frozen=True)
class ChoiceSettings:
    """How every choice of a request generates (engine arguments, stop strings)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    seed: int | None  # choice i samples with (seed + i) mod 2**63; None: a seed drawn by the engine
    stop: tuple[str, ...]  # stop strings
    stop_token_ids: frozenset[int]  # the model's end-of-sequence tokens (unless ignore_eos) and the request's
    hidden_ids: frozenset[int]  # stop tokens whose text is not shown (the request's stop_token_ids)


@dataclass(frozen=True)
class ChoiceUpdate:
    """New text of one choice; `finish_reason` on its last update ("stop", "length", "abort"), `error` when it
    failed in the engine."""

    index: int
    text: str
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class _Choice:
    index: int
    prompt: int  # index of its prompt
    stream: TextStream
    request_id: str | None = None  # its engine request, once submitted
    finish_reason: str | None = None  # set once it ended (for the client)
    num_tokens: int = 0  # tokens generated (counted in usage)
    token_ids: list[int] = field(default_factory=list)


class Generation:
    """The choices of one API request in the engine (module docstring). Use from the event loop's thread.

    Args:
        runner (`EngineRunner`): where requests go.
        prompts (`list[list[int]]`): the prompts' token ids.
        n (`int`): choices per prompt; choice ``p * n + j`` is the `j`-th of prompt `p`.
        settings (`ChoiceSettings`): generation settings of every choice.
        tokenizer: decodes the choices' text.
    """

    def __init__(self, runner: EngineRunner, prompts: list[list[int]], n: int, settings: ChoiceSettings,
                 tokenizer) -> None:
        self._runner = runner  # fixed
        self.prompts = prompts  # fixed
        self._settings = settings  # fixed
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()  # events from the engine thread
        self._loop = asyncio.get_running_loop()  # fixed
        self.choices = [_Choice(p * n + j, p, TextStream(tokenizer, list(settings.stop), settings.hidden_ids))
                        for p in range(len(prompts)) for j in range(n)]
        self._by_id: dict[str, _Choice] = {}  # engine request id -> its choice
        self._n = n  # fixed
        self.started = time.perf_counter()  # fixed
        self.first_token_time: float | None = None  # when the first text or token came
        self.num_open = len(self.choices)  # choices not ended

    # -- submission ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Submit each prompt's first choice (the others follow its first token). Raises `ValueError` as
        `Engine.add_request` does; nothing stays submitted then."""
        try:
            for c in self.choices[:: self._n]:
                self._submit(c)
        except BaseException:
            self.cancel()
            raise

    def _submit(self, c: _Choice) -> None:
        s = self._settings
        seed = None if s.seed is None else (s.seed + c.index) % 2**63  # the engine takes seeds below 2**63
        c.request_id = self._runner.submit(
            self.prompts[c.prompt], self._sink, max_new_tokens=s.max_new_tokens, do_sample=s.do_sample,
            temperature=s.temperature if s.do_sample else 1.0, top_p=s.top_p if s.do_sample else 1.0, seed=seed,
            eos_token_id=sorted(s.stop_token_ids))
        self._by_id[c.request_id] = c

    def _sink(self, event: TokenEvent) -> None:  # the engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        """Cancel every choice still in the engine (their blocks are freed); unsubmitted ones never start."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                self.num_open -= 1
                if c.request_id is not None:
                    self._runner.cancel(c.request_id)

    # -- events -------------------------------------------------------------------------------------------------
    async def updates(self):
        """Yield `ChoiceUpdate`s until every choice has ended; cancels what is left if the consumer stops early."""
        try:
            while self.num_open:
                event = await self._queue.get()
                for update in self._apply(event):
                    yield update
        finally:
            if self.num_open:
                self.cancel()

    def _apply(self, event: TokenEvent) -> list[ChoiceUpdate]:
        c = self._by_id[event.request_id]
        if c.finish_reason is not None:  # ended already (a stop string, or cancelled): the rest is not shown
            return []
        out = []
        if c.index % self._n == 0 and self._n > 1 and all(f.request_id is None for f in self._followers(c)):
            out += self._start_followers(c, event)
        c.token_ids += event.tokens
        text = c.stream.push(event.tokens) if event.tokens else ""
        if event.tokens and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        c.num_tokens = len(c.stream.tokens)
        if c.stream.stopped:
            self._runner.cancel(c.request_id)
            return out + [self._end(c, text, "stop")]
        o = event.output
        if o is None:
            return out + [ChoiceUpdate(c.index, text)] if text else out
        if o.status == RequestStatus.FINISHED:
            out.append(self._end(c, text + c.stream.finish(), o.finish_reason))
        elif o.status == RequestStatus.FAILED:
            out.append(self._end(c, text, None, error=o.error or "the engine failed this request"))
        else:  # cancelled by the server (shutdown)
            out.append(self._end(c, text + c.stream.finish(), "abort"))
        return out

    def _followers(self, leader: _Choice) -> list[_Choice]:
        return self.choices[leader.index + 1: leader.index + self._n]

    def _start_followers(self, leader: _Choice, event: TokenEvent) -> list[ChoiceUpdate]:
        """The leader's prompt blocks are published: submit the other choices of its prompt (they attach)."""
        failed = event.output is not None and event.output.status == RequestStatus.FAILED
        out = []
        for f in self._followers(leader):
            if f.finish_reason is not None:
                continue
            if failed:  # the prompt cannot run: neither can they
                out.append(self._end(f, "", None, error=event.output.error or "the engine failed this request"))
            else:
                self._submit(f)
        return out

    def _end(self, c: _Choice, text: str, reason: str | None, error: str | None = None) -> ChoiceUpdate:
        c.finish_reason = reason or "error"
        self.num_open -= 1
        return ChoiceUpdate(c.index, text, reason, error)

    # -- totals -------------------------------------------------------------------------------------------------
    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens, each prompt counted once (its choices share it)."""
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated for the client, all choices (a choice cut at a stop string: up to it)."""
        return sum(c.num_tokens for c in self.choices)


__all__ = ["ChoiceSettings", "ChoiceUpdate", "Generation"]
