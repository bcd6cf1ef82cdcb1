"""The OpenAI response objects: completions and chat completions, whole or as server-sent-event chunks.

Shapes follow what the `openai` client parses: ``text_completion`` / ``chat.completion`` objects with `choices`
and `usage`; streamed, ``data: {chunk}`` lines (``text_completion`` / ``chat.completion.chunk``), one per piece of
text, a last chunk per choice with its `finish_reason`, with ``stream_options.include_usage`` a final chunk with
empty `choices` and the `usage`, then ``data: [DONE]``. An engine failure after the stream began is sent as a
``data: {"error": {...}}`` event (the `openai` client raises `APIError` on it).
"""

from __future__ import annotations

import json
import time
import uuid

from hf_pagedkv.serving.server.generation import ChoiceUpdate, Generation


class ResponseWriter:
    """Builds one request's response objects.

    Args:
        chat (`bool`): a chat completion (else a text completion).
        model (`str`): the model name echoed back.
        return_token_ids (`bool`): add `token_ids` to each choice and `prompt_token_ids` (extension).
    """

    def __init__(self, chat: bool, model: str, return_token_ids: bool = False) -> None:
        self.chat = chat  # fixed
        self.model = model  # fixed
        self.return_token_ids = return_token_ids  # fixed
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex  # fixed
        self.created = int(time.time())  # fixed
        self._role_sent: set[int] = set()  # chat choices whose first chunk (with the role) went out

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(gen: Generation) -> dict:
        p, c = gen.prompt_tokens, gen.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def whole(self, gen: Generation, texts: dict[int, str], reasons: dict[int, str | None]) -> dict:
        """The non-streamed response."""
        choices = []
        for c in gen.choices:
            choice = {"index": c.index, "finish_reason": reasons.get(c.index), "logprobs": None}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": texts.get(c.index, "")}
            else:
                choice["text"] = texts.get(c.index, "")
            if self.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = gen.prompts[c.prompt]
            choices.append(choice)
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": self.usage(gen)}

    def chunk(self, update: ChoiceUpdate, gen: Generation, include_usage: bool) -> str:
        """The SSE event of one update (a chat choice's first also carries the role)."""
        c = gen.choices[update.index]
        if self.chat:
            delta: dict = {}
            if update.index not in self._role_sent:
                self._role_sent.add(update.index)
                delta["role"] = "assistant"
            if update.text or "role" in delta:
                delta["content"] = update.text
            choice = {"index": update.index, "delta": delta, "finish_reason": update.finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": update.index, "text": update.text, "finish_reason": update.finish_reason,
                      "logprobs": None}
        if self.return_token_ids and update.finish_reason is not None:
            choice["token_ids"] = list(c.token_ids)
        obj = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        return sse(obj)

    def usage_chunk(self, gen: Generation) -> str:
        obj = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
               "usage": self.usage(gen)}
        return sse(obj)


def sse(obj) -> str:
    """One server-sent event holding `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(message: str, status: int = 500) -> str:
    """An error after the stream began (the HTTP status is already sent)."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": status}})


__all__ = ["DONE", "ResponseWriter", "error_event", "sse"]
