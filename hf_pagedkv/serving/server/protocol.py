"""The request bodies of the OpenAI endpoints, parsed and checked: `parse_body` (bytes -> dict), then
`CompletionRequest` / `ChatCompletionRequest` (pydantic, strict: ``"5"`` is no int, ``true`` no number).

What is refused, with a 400 naming the field: a ``Content-Type`` other than ``application/json`` (none is taken as
JSON; `check_content_type`); `stream_options` without ``stream: true`` (as OpenAI's API does); a body that is not UTF-8, not JSON, or not a JSON object; NaN or
Infinity; a string holding a lone surrogate (``"\\ud800"``, no text); a field this server does not know; a field of
OpenAI's API that it does not implement, set to anything but its default (`UNSUPPORTED`); a value of the wrong type
or out of range. A body over the server's limit (`MAX_BODY_BYTES` by default, ``--max-body-bytes``) is a 413,
checked before anything is parsed. Nothing here touches the engine.

Extensions of the OpenAI API (as vLLM names them): `stop_token_ids` (extra stop tokens), `ignore_eos` (generate
`max_tokens` tokens whatever the model's end-of-sequence token), `return_token_ids` (each choice carries the
generated `token_ids`, and the response its `prompt_token_ids`).
"""

from __future__ import annotations

import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hf_pagedkv.serving.server.errors import ApiError, bad_request

# request bodies larger than this get a 413 (``hf-pagedkv serve --max-body-bytes``): 4 MiB holds a 128k-token prompt
# as text (about 4 bytes a token) or as JSON token ids (about 7), with room to spare
MAX_BODY_BYTES = 4 * 2**20
MAX_STOP_STRINGS = 16  # `stop` strings per request at most
MAX_N = 64  # choices per prompt at most

# OpenAI fields this server does not implement, and the values that mean "not used" (accepted and ignored)
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1), "echo": (None, False), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]), "audio": (None,),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "verbosity": (None,),
}
# fields accepted and ignored whatever their value (they change nothing in what is generated)
IGNORED = ("user", "prompt_cache_key", "safety_identifier")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False  # a last chunk with `usage` and no choices
    include_obfuscation: bool = False  # accepted; this server adds no obfuscation field


class _Sampling(_Body):
    """Fields common to both endpoints."""

    model: str
    max_tokens: int | None = None  # tokens to generate at most, per choice
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt
    seed: int | None = Field(None, ge=0, lt=2**63)  # choice i samples with (seed + i) mod 2**63
    stop: str | list[str] | None = None  # up to MAX_STOP_STRINGS strings; the text ends before the first one
    stream: bool = False  # server-sent events
    stream_options: StreamOptions | None = None
    # extensions (vLLM's names)
    stop_token_ids: list[int] | None = None  # extra stop tokens (their text is not returned)
    ignore_eos: bool = False  # do not stop at the model's end-of-sequence token(s)
    return_token_ids: bool = False  # choices carry `token_ids`, the response `prompt_token_ids`

    def stop_strings(self) -> list[str]:
        """`stop` as a list, checked (non-empty strings, at most `MAX_STOP_STRINGS`)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"`stop` holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed.", "stop")
        if any(not s for s in stops):
            raise bad_request("`stop` holds an empty string, which would end every answer at once; remove it.",
                              "stop")
        return stops


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of strings (one set of `n` choices each), a list of token
    ids, or a list of lists of token ids."""

    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(_Body):
    """One chat message. A ``tool`` message carries the `tool_call_id` it answers (required, as in OpenAI's API);
    the chat template gets it as ``message["tool_call_id"]`` (a template that does not use it ignores it)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None  # a string, or parts [{"type": "text", "text": ...}]
    name: str | None = None
    tool_call_id: str | None = None  # role "tool" only

    def template_dict(self, where: str) -> dict:
        """The message as the chat template takes it (``developer`` becomes ``system``).

        Raises:
            ApiError: 400 for content that is no text (`text`), a ``tool`` message without `tool_call_id`, or a
                `tool_call_id` on another role.
        """
        if self.role == "tool" and self.tool_call_id is None:
            raise bad_request(f"`{where}.tool_call_id` is required for a message with role tool (the id of the "
                              "tool call it answers).", f"{where}.tool_call_id")
        if self.role != "tool" and self.tool_call_id is not None:
            raise bad_request(f"`{where}.tool_call_id` is only allowed on a message with role tool, got role "
                              f"{self.role}.", f"{where}.tool_call_id")
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text(where)}
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self, where: str) -> str:
        """The message's text: `content`, or its text parts joined."""
        if self.content is None:
            raise bad_request(f"`{where}.content` is missing or null; this server takes text messages only.",
                              f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise bad_request(f"`{where}.content[{i}]` is not a text part ({{\"type\": \"text\", \"text\": "
                                  f"...}}); this server takes text only, got {_short(part)}.",
                                  f"{where}.content[{i}]")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name of `max_tokens` (give one)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


def parse_body(raw: bytes, schema: type[_Sampling], max_bytes: int = MAX_BODY_BYTES) -> _Sampling:
    """The body of a request, checked (module docstring).

    Args:
        raw (`bytes`): the request body.
        schema (`type`): `CompletionRequest` or `ChatCompletionRequest`.
        max_bytes (`int`): the largest body accepted, in bytes.

    Raises:
        ApiError: 413 for a body over `max_bytes` (`body_too_large`); 400 naming what is wrong (and the field)
            otherwise.
    """
    if len(raw) > max_bytes:
        raise body_too_large(str(len(raw)), max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
                          f"({e.reason}); send JSON encoded as UTF-8.") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
        if isinstance(body, dict):
            _check_text(body, "")
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.") from None
    except RecursionError:
        raise bad_request("The request body nests JSON arrays or objects too deeply to read; a request needs at "
                          "most a few levels (messages, content parts).") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got a JSON {type(body).__name__}.")
    for name, defaults in UNSUPPORTED.items():
        if name in body:
            value = body.pop(name)
            if not any(value == d and type(value) is type(d) for d in defaults):
                raise bad_request(f"`{name}` is not supported by this server (got {_short(value)}); leave it out.",
                                  name)
    for name in IGNORED:
        body.pop(name, None)
    try:
        checked = schema.model_validate(body)
    except ValidationError as e:
        raise _field_error(e, schema, body) from None
    if checked.stream_options is not None and not checked.stream:
        raise bad_request("The 'stream_options' parameter is only allowed when 'stream' is enabled: add "
                          "\"stream\": true, or leave `stream_options` out.", "stream_options")
    return checked


def body_too_large(size: str, max_bytes: int) -> ApiError:
    """The 413 of a body of `size` bytes (a number, or "over N") past `max_bytes`."""
    return ApiError(413, f"The request body is {size} bytes; this server accepts at most {max_bytes} bytes "
                         f"({max_bytes / 2**20:.4g} MiB; `hf-pagedkv serve --max-body-bytes` sets it). Send a shorter "
                         "prompt, or split the prompts over several requests.", code="body_too_large")


def check_content_type(value: str | None) -> None:
    """Refuse a body sent as anything but JSON (a 400, code ``unsupported_content_type``, as OpenAI's API answers).

    Args:
        value (`str`, *optional*): the request's ``Content-Type`` header; None (absent) is taken as JSON.

    Raises:
        ApiError: a media type other than ``application/json`` (its parameters, such as ``charset=utf-8``, are
            allowed; case does not matter).
    """
    if value is None or value.split(";")[0].strip().lower() == "application/json":
        return
    raise ApiError(400, f"Unsupported content type: {value!r}. This endpoint takes a JSON body with the header "
                        "'Content-Type: application/json' (with curl: -H 'Content-Type: application/json').",
                   code="unsupported_content_type")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (give a finite number)")


def _check_text(value, where: str) -> None:
    """Every string (keys too) must be text: a lone surrogate cannot be encoded, tokenized or answered."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            field = where or "body"
            raise bad_request(f"`{field}` holds a lone surrogate (\\u{ord(value[e.start]):04x} at character "
                              f"{e.start}), which is no text; send valid Unicode.", where or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


# the names pydantic puts in an error's location for the member of a union that failed (not field names)
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "StreamOptions"}


def _field_error(error: ValidationError, schema: type[_Sampling], body: dict) -> ApiError:
    """The first validation error as a 400 naming the field (``messages[0].role``) and the value received."""
    first = error.errors()[0]
    if first["loc"][0] == "prompt" and first["type"] != "missing":  # a union: pydantic would name its first member
        return bad_request("`prompt` must be a string, a list of strings, a list of token ids (integers), or a list "
                           f"of lists of token ids; got {_short(body.get('prompt'))}.", "prompt")
    path = ""
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" not in part and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    if first["type"] == "extra_forbidden":
        if "." in path or "[" in path:
            return bad_request(f"Unknown field `{path}`; see the OpenAI API reference for what it holds.", path)
        known = ", ".join(sorted(schema.model_fields))
        return bad_request(f"Unknown field `{path}`; this endpoint takes: {known}.", path)
    if first["type"] == "missing":
        return bad_request(f"`{path}` is required.", path)
    if first["type"] == "literal_error" and path.endswith(".role"):
        return bad_request(f"`{path}` must be one of system, developer, user, assistant, tool; got "
                           f"{_short(first['input'])}.", path)
    return bad_request(f"`{path}`: {first['msg']} (got {_short(first['input'])}).", path)


def _short(value, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "MAX_BODY_BYTES", "body_too_large",
           "check_content_type", "parse_body"]
