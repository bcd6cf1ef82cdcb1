"""`EngineService`: what the HTTP endpoints ask of the engine: prompts tokenized and checked, generations started,
admission (429 past the queue limit, 503 while draining; a 400 for a request whose choices alone pass it), drain
and shutdown (the prefix-cache file saved).

Checks that keep a request out of the engine (a 4xx, the pool untouched): another model's name; a prompt that is
empty or holds token ids outside the vocabulary; `max_tokens` < 1; a prompt plus `max_tokens` past the model's
context (`max_position_embeddings`) or, in a fixed pool, needing more KV blocks than the whole pool holds (the
engine's own admission rule: such a request could never run).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.errors import counted
from hf_pagedkv.serving.engine import Engine
from hf_pagedkv.serving.request_retention import held_blocks_bound
from hf_pagedkv.serving.server.engine_runner import EngineRunner, QueueFull
from hf_pagedkv.serving.server.errors import ApiError, bad_request
from hf_pagedkv.serving.server.generation import ChoiceSettings, Generation
from hf_pagedkv.serving.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's default)
RETRY_AFTER_S = 1  # the Retry-After of a 429 or a 503


class EngineService:
    """The engine behind the HTTP endpoints (module docstring). Endpoints call it from the event loop's thread,
    except `check_model`, `completion_prompts`, `chat_prompt` and `settings` (worker threads: tokenizing is slow).

    Args:
        engine (`Engine`): the engine (not started; its pool should have ``prefix_caching=True`` for `n` > 1
            to share prompts and for `prefix_cache_file`).
        tokenizer (`PreTrainedTokenizerBase`): the model's tokenizer (its chat template serves the chat endpoint).
        model_name (`str`): the name clients give as ``model``; any other is a 404.
        max_queue (`int`, *optional*): requests waiting for the engine at most (past it: 429); None: no limit.
        prefix_cache_file (`str`, *optional*): where `close()` saves the pool's prefix cache (atomically).
    """

    def __init__(self, engine: Engine, tokenizer, model_name: str, *, max_queue: int | None = None,
                 prefix_cache_file: str | None = None) -> None:
        self.engine = engine  # fixed
        self.pool = engine.pool  # fixed
        self.tokenizer = tokenizer  # fixed
        self.model_name = model_name  # fixed
        self.runner = EngineRunner(engine, max_queue)  # fixed
        self.prefix_cache_file = prefix_cache_file  # fixed
        self.created = int(time.time())  # the model's "created" in /v1/models; fixed
        config = engine.model.config
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)  # fixed
        self.eos_ids = _eos_ids(engine.generation_config.eos_token_id)  # stop tokens unless ignore_eos; fixed
        self.vocab_size = engine.model.get_input_embeddings().num_embeddings  # fixed
        self.draining = False  # new requests get 503; set by `begin_drain` only
        self.num_open_generations = 0  # API requests being answered; the endpoints only

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping (the engine sized a fixed pool when it was built)."""
        self.runner.start()

    def begin_drain(self) -> None:
        """From now on new requests get 503; those in flight go on."""
        if not self.draining:
            logger.info("hf_pagedkv server: draining (%d requests in flight)", self.runner.num_tracked)
        self.draining = True

    @property
    def is_idle(self) -> bool:
        """No request in the engine and no answer being written."""
        return self.runner.num_tracked == 0 and self.num_open_generations == 0

    async def drain(self, poll: float = 0.02) -> None:
        """`begin_drain`, then wait until every request in flight has been answered."""
        self.begin_drain()
        while not self.is_idle:
            await asyncio.sleep(poll)

    def close(self) -> None:
        """Stop the engine (unfinished requests are cancelled, their blocks freed) and save the prefix cache to
        `prefix_cache_file`, atomically (a failed save leaves the previous file)."""
        self.runner.close()
        if self.prefix_cache_file is not None and self.pool.prefix_caching:
            try:
                with torch.inference_mode():  # the engine's blocks were written in inference mode (engine_runner.py)
                    n = self.pool.save_prefix_cache(self.prefix_cache_file, model=self.engine.model)
                logger.info("hf_pagedkv server: saved %d prefix blocks to %s", n, self.prefix_cache_file)
            except (OSError, ValueError) as e:
                logger.error("hf_pagedkv server: could not save the prefix cache to %s: %s",
                             self.prefix_cache_file, e)

    # -- requests -----------------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model `{name}` does not exist on this server; it serves `{self.model_name}` "
                                "(GET /v1/models).", "model", "model_not_found")

    def admit(self, num_requests: int) -> None:
        """503 while draining, 429 past the queue limit."""
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining:
            raise ApiError(503, "The server is shutting down and takes no new requests.", headers=retry)
        try:
            self.runner.check_room(num_requests)
        except QueueFull as e:
            raise ApiError(429, f"Too many requests are waiting: {e}", code="queue_full", headers=retry) from None

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The prompts of a completion request as token ids."""
        p = body.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(x, str) for x in p)):
            texts = [p] if isinstance(p, str) else p
            prompts = [self.tokenizer(t).input_ids for t in texts]
            where = ["prompt"] if isinstance(p, str) else [f"prompt[{i}]" for i in range(len(texts))]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompts, where = [list(p)], ["prompt"]
        else:
            prompts, where = [list(x) for x in p], [f"prompt[{i}]" for i in range(len(p))]
        if not prompts:
            raise bad_request("`prompt` is an empty list; give a string or token ids.", "prompt")
        for ids, name in zip(prompts, where):
            self._check_ids(ids, name)
        return prompts

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The chat messages through the tokenizer's chat template, as token ids (ending with the assistant's
        turn)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request(f"The tokenizer of `{self.model_name}` has no chat template; use /v1/completions "
                              "with a prompt you format yourself.", "messages")
        messages = [m.template_dict(f"messages[{i}]") for i, m in enumerate(body.messages)]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles in order, ...)
            raise bad_request(f"The chat template refused these messages: {e}", "messages") from None
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        self._check_ids(ids, "messages")
        return ids

    def settings(self, body, prompts: list[list[int]], default_max_tokens: int | None) -> ChoiceSettings:
        """The choices' settings; `max_tokens` checked against the context and the pool for every prompt."""
        max_tokens, name = body.max_tokens, "max_tokens"
        if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
            if max_tokens is not None:
                raise bad_request("Give `max_tokens` or `max_completion_tokens`, not both.", "max_completion_tokens")
            max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
        longest = max(len(p) for p in prompts)
        limit = self._token_limit(longest)
        if limit < 1:
            where = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            raise bad_request(f"The prompt is {counted(longest, 'token')}, which leaves no room for a new token: "
                              f"{self._limit_reason(longest)}.", where, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit if default_max_tokens is None else min(default_max_tokens, limit)
        if max_tokens < 1:
            raise bad_request(f"`{name}` must be >= 1, got {max_tokens}.", name)
        if max_tokens > limit:
            raise bad_request(f"`{name}` is {max_tokens}, but with the prompt's {counted(longest, 'token')} at most "
                              f"{limit} fit: {self._limit_reason(longest)}. Lower `{name}` or shorten the prompt.",
                              name, "context_length_exceeded")
        stop_ids = frozenset(body.stop_token_ids or ())
        bad = sorted(t for t in stop_ids if not 0 <= t < self.vocab_size)
        if bad:
            raise bad_request(f"`stop_token_ids` holds {bad[0]}, outside the vocabulary [0, {self.vocab_size}).",
                              "stop_token_ids")
        return ChoiceSettings(
            max_new_tokens=max_tokens, do_sample=body.temperature > 0, temperature=body.temperature,
            top_p=body.top_p, seed=body.seed, stop=tuple(body.stop_strings()),
            stop_token_ids=stop_ids | (frozenset() if body.ignore_eos else self.eos_ids),
            hidden_ids=stop_ids - self.eos_ids)

    def generate(self, prompts: list[list[int]], n: int, settings: ChoiceSettings) -> Generation:
        """Start the choices (admission checked first: 503 / 429, or a 400 for more choices than `--max-queue`
        lets wait at once: such a request could never be admitted)."""
        choices, limit = len(prompts) * n, self.runner.max_queue
        if limit is not None and choices > limit:
            shape = f"{counted(len(prompts), 'prompt')} x n={n}" if len(prompts) > 1 else f"n={n}"
            raise bad_request(f"This request asks for {choices} choices ({shape}), more than the {limit} requests "
                              f"this server lets wait at once (--max-queue {limit}), so it could never be admitted. "
                              f"Send at most {limit} choices per request, or raise --max-queue.",
                              "n" if n > 1 else "prompt", "too_many_choices")
        self.admit(choices)
        generation = Generation(self.runner, prompts, n, settings, self.tokenizer)
        try:
            generation.start()
        except ValueError as e:  # the engine's own checks of a request
            raise bad_request(str(e)) from None
        return generation

    # -- limits -------------------------------------------------------------------------------------------------
    def _check_ids(self, ids: list[int], where: str) -> None:
        if not ids:
            raise bad_request(f"`{where}` is empty (no tokens); give some text.", where)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"`{where}` holds token id {bad}, outside the vocabulary [0, {self.vocab_size}).",
                              where)

    def _capacities(self) -> list[int]:
        """Blocks a request may hold in each full-attention layer group of a fixed pool (its blocks less the pad
        block): the engine's admission limit."""
        stats = self.pool.stats()
        return [g.num_blocks - (self.pool.groups[i].pad_block is not None)
                for i, g in enumerate(stats.groups) if g.window is None]

    def _limits(self, prompt_len: int) -> list[tuple[int, str]]:
        """(new tokens a prompt of `prompt_len` tokens may ask for at most, why) for each limit that applies."""
        limits = []
        if self.context_length:
            limits.append((self.context_length - prompt_len, f"the model's context is {self.context_length} tokens"))
        if not self.pool.growable:
            caps = [c for c in self._capacities() if c > 0]
            if caps:  # the engine stores prompt + new - 1 tokens: what its retention holds of them must fit
                most = self._pool_limit(prompt_len, min(caps))
                if most is not None:
                    policy = self.engine.retention
                    held = "" if policy is None else f", holding what --retention {policy!r} keeps"
                    limits.append((most, f"the KV pool holds {counted(min(caps), 'block')} of "
                                         f"{counted(self.pool.block_size, 'token')} for one request{held} "
                                         "(raise --max-memory)"))
        return limits

    def _pool_limit(self, prompt_len: int, cap: int) -> int | None:
        """The most new tokens a prompt of `prompt_len` tokens may ask for with `cap` blocks (the scheduler's
        admission rule, `held_blocks_bound`); None when the engine's retention bounds it below `cap` however long
        it runs."""
        policy, B, step = self.engine.retention, self.pool.block_size, self.engine.max_batch_tokens
        if policy is None:
            return cap * B - prompt_len + 1
        fits = lambda new: held_blocks_bound(policy, prompt_len + new - 1, step, B) <= cap  # noqa: E731
        lo, hi = 0, 2 ** 31  # (non-decreasing in new: the largest new that fits, by bisection)
        if fits(hi):
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def _token_limit(self, prompt_len: int) -> int:
        """New tokens a prompt of `prompt_len` tokens may ask for at most."""
        return min((n for n, _ in self._limits(prompt_len)), default=2**31)

    def _limit_reason(self, prompt_len: int) -> str:
        """Why `_token_limit(prompt_len)` is what it is: the limits that bind."""
        limits = self._limits(prompt_len)
        least = min((n for n, _ in limits), default=None)
        return " and ".join(why for n, why in limits if n == least)


def _eos_ids(eos) -> frozenset[int]:
    if eos is None:
        return frozenset()
    return frozenset(t for t in ([eos] if isinstance(eos, int) else eos) if t >= 0)


__all__ = ["EngineService"]
