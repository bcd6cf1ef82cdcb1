"""Faults: bad input gets a 4xx naming the field and leaves the pool and the engine unchanged; a request that can
never fit a fixed pool gets a 400 while others go on; a client that disconnects (streamed or not) cancels its
request and frees its blocks; past --max-queue a 429 with Retry-After; draining answers 503 while the requests in
flight finish, then the server exits by itself."""

import asyncio
import http.client
import json
import signal
import socket
import threading
import time

import pytest

from hf_pagedkv import BlockPool
from tests.serving.server_helpers import (BLOCK, MODEL, PROMPTS, get, model_and_tokenizer, openai, post,
                                          running_server, tiny_single_thread)  # noqa: F401

OK = {"model": MODEL, "prompt": "The river", "max_tokens": 4}

BAD = [  # (body, status, param, words of the message)
    (b'{"model": "tiny", "prompt": "x",', 400, None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": "caf\xe9"}', 400, None, "not UTF-8"),
    (b'[1, 2]', 400, None, "JSON object"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "too deeply"),
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    (b'{"model": "tiny", "prompt": "\\ud800 lone"}', 400, "prompt", "lone surrogate"),
    ({**OK, "foo": 1}, 400, "foo", "Unknown field"),
    ({**OK, "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    ({**OK, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ({**OK, "max_tokens": 10**12}, 400, "max_tokens", "context is 4096 tokens"),
    ({**OK, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({**OK, "max_tokens": 2.5}, 400, "max_tokens", "valid integer"),
    ({**OK, "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({**OK, "top_p": 0}, 400, "top_p", "greater than 0"),
    ({**OK, "n": 0}, 400, "n", "greater than or equal to 1"),
    ({**OK, "seed": -1}, 400, "seed", "greater than or equal to 0"),
    ({**OK, "stop": ""}, 400, "stop", "empty string"),
    ({**OK, "stop": ["a"] * 17}, 400, "stop", "at most 16"),
    ({**OK, "stop_token_ids": [100000]}, 400, "stop_token_ids", "outside the vocabulary"),
    ({**OK, "prompt": ""}, 400, "prompt", "empty"),
    ({**OK, "prompt": []}, 400, "prompt", "empty"),
    ({**OK, "prompt": [5, 100000]}, 400, "prompt", "token id 100000"),
    ({**OK, "prompt": [[5, 6], []]}, 400, "prompt[1]", "empty"),
    ({**OK, "prompt": "x" * 20000}, 400, "prompt", "leaves no room"),
    ({**OK, "prompt": 5}, 400, "prompt", "must be a string, a list of strings, a list of token ids (integers), or a "
                                         "list of lists of token ids; got 5."),
    ({**OK, "prompt": [1, "a"]}, 400, "prompt", "a list of token ids (integers), or a list of lists of token ids; "
                                                "got [1, \"a\"]."),
    ({**OK, "logprobs": 3}, 400, "logprobs", "not supported"),
    ({**OK, "echo": True}, 400, "echo", "not supported"),
    ({**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed when 'stream' is"),
    ({**OK, "stream": False, "stream_options": {}}, 400, "stream_options", "only allowed when 'stream' is"),
    ({"prompt": "x"}, 400, "model", "required"),
    ({**OK, "model": "gpt-4o"}, 404, "model", "does not exist"),
]


@pytest.fixture(scope="module")
def srv():
    with running_server() as running:
        yield running


def pool_state(srv):
    st, es = srv.pool.stats(), srv.service.engine.stats()
    return (st.num_blocks, st.blocks_in_use, st.blocks_cached, st.lookups, es.num_finished, es.num_failed,
            es.num_cancelled, es.num_waiting, es.num_tokens_computed)


@pytest.mark.parametrize("body, status, param, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_4xx_naming_the_field_and_leaves_the_pool_unchanged(srv, body, status, param, words):
    before = pool_state(srv)
    got, answer, _ = post(srv.port, "/v1/completions", body)
    assert got == status, answer
    assert answer["error"]["param"] == param and words in answer["error"]["message"], answer
    assert pool_state(srv) == before


def test_bad_chat_input(srv):
    for body, param, words in [
            ({"model": MODEL, "messages": []}, "messages", "at least 1"),
            ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "one of"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "x": 1}]}, "messages[0].x", "Unknown"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
             "tools", "not supported"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "4"}]},
             "messages[1].tool_call_id", "required for a message with role tool"),
            ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "tool_call_id": "call_1"}]},
             "messages[0].tool_call_id", "only allowed on a message with role tool, got role user")]:
        before = pool_state(srv)
        status, answer, _ = post(srv.port, "/v1/chat/completions", body)
        assert (status, answer["error"]["param"]) == (400, param) and words in answer["error"]["message"], answer
        assert pool_state(srv) == before
    status, text = get(srv.port, "/v1/completions")
    assert status == 405 and "Method Not Allowed" in text


def test_a_request_that_can_never_fit_gets_a_400_while_others_go_on():
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(PROMPTS[0]).input_ids
    pool = BlockPool(block_size=BLOCK, max_memory="32KiB", prefix_caching=True, debug=True)  # 64 tokens: 16 blocks
    with running_server(pool) as srv:
        assert pool.stats().num_blocks == 16  # sized at start, before any request
        stream = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0, stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
        first = next(iter(stream))
        with pytest.raises(openai.BadRequestError, match="KV pool holds 16 blocks of 4 tokens") as e:
            srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=60, temperature=0)
        assert e.value.body["param"] == "max_tokens" and e.value.body["code"] == "context_length_exceeded"
        assert "model's context" not in e.value.body["message"]  # only the limit that binds is named
        rest = [c.choices[0] for c in stream]
        assert first.choices[0].finish_reason is None
        assert rest[-1].finish_reason == "length" and len(rest[-1].token_ids) == 30
        srv.wait_idle()


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(srv):
    srv.wait_idle()
    before = srv.service.engine.stats()
    stream = srv.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=2000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert srv.pool.stats().blocks_in_use > 0
    stream.close()
    srv.wait_idle()
    after = srv.service.engine.stats()
    assert after.num_cancelled == before.num_cancelled + 1
    assert after.num_tokens_generated - before.num_tokens_generated < 2000


def test_a_client_that_disconnects_before_a_whole_answer_frees_its_blocks(srv):
    srv.wait_idle()
    before = srv.service.engine.stats()
    body = (b'{"model": "tiny", "prompt": "The river", "max_tokens": 2000, "ignore_eos": true}')
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 10
    while srv.pool.stats().blocks_in_use == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sock.close()
    srv.wait_idle()
    after = srv.service.engine.stats()
    assert after.num_cancelled == before.num_cancelled + 1
    assert after.num_tokens_generated - before.num_tokens_generated < 2000


def test_past_max_queue_a_429_with_retry_after():
    with running_server(max_queue=2) as srv:
        srv.service.runner.stop()  # nothing is admitted: requests wait
        results = []

        def client():
            results.append(srv.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5,
                                                         temperature=0))

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while srv.service.runner.num_waiting < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        status, answer, headers = post(srv.port, "/v1/completions", OK)
        assert status == 429 and headers["retry-after"] == "1" and answer["error"]["code"] == "queue_full"
        srv.service.runner.start()
        for t in threads:
            t.join(30)
        assert [r.usage.completion_tokens for r in results] == [5, 5]
        srv.wait_idle()


def test_drain_answers_503_finishes_the_requests_in_flight_then_exits():
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(PROMPTS[0]).input_ids
    with running_server() as srv:
        stream = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=600, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = iter(stream)
        next(chunks)
        srv.service.begin_drain()
        status, answer, headers = post(srv.port, "/v1/completions", OK)
        assert status == 503 and headers["retry-after"] == "1", answer
        assert get(srv.port, "/health")[0] == 503
        rest = [c.choices[0] for c in chunks]
        assert rest[-1].finish_reason == "length" and len(rest[-1].token_ids) == 600
        deadline = time.monotonic() + 10
        while not srv.server.should_exit:  # idle and draining: the server stops by itself
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert srv.pool.stats().blocks_in_use == 0


def test_an_engine_failure_is_a_500_or_an_error_event_and_the_server_goes_on():
    model, _ = model_and_tokenizer()

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    with running_server() as srv:
        model.forward = broken  # the engine's forward raises: the step's requests fail, their blocks are freed
        try:
            with pytest.raises(openai.InternalServerError, match="injected fault"):
                srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
            stream = srv.client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, stream=True)
            with pytest.raises(openai.APIError, match="injected fault"):
                list(stream)
        finally:
            del model.forward
        srv.wait_idle()
        assert srv.service.engine.stats().num_failed == 2
        r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        srv.wait_idle()


def test_a_second_signal_stops_at_once_and_frees_the_blocks():
    with running_server() as srv:
        stream = srv.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2000, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        srv.server.handle_exit(signal.SIGTERM, None)
        assert srv.service.draining and not srv.server.should_exit
        srv.server.handle_exit(signal.SIGTERM, None)
        rest = [c.choices[0] for c in chunks]
        assert rest[-1].finish_reason == "abort"
        assert srv.server.should_exit
        assert srv.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 400), ("application/x-www-form-urlencoded", 400), ("application/jsonl", 400),
    ("application/json", 200), ("Application/JSON; charset=utf-8", 200), (None, 200),
])
def test_a_body_that_is_not_sent_as_json_is_a_400_naming_its_content_type(srv, content_type, status):
    before = pool_state(srv)
    raw = json.dumps({**OK, "max_tokens": 2}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", raw, {} if content_type is None else {"Content-Type": content_type})
        resp = conn.getresponse()
        got, answer = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert got == status, answer
    if status == 400:
        assert answer["error"] == {
            "message": f"Unsupported content type: {content_type!r}. This endpoint takes a JSON body with the header "
                       "'Content-Type: application/json' (with curl: -H 'Content-Type: application/json').",
            "type": "invalid_request_error", "param": None, "code": "unsupported_content_type"}
        assert pool_state(srv) == before  # nothing reached the engine
    else:
        assert answer["usage"]["completion_tokens"] == 2


def test_stream_options_with_stream_true_is_taken(srv):
    stream = srv.client.completions.create(model=MODEL, prompt="The river", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_a_body_over_the_limit_is_a_413_before_it_is_read(srv):
    from hf_pagedkv.serving.server.protocol import MAX_BODY_BYTES

    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        answer = b""
        while b"at most" not in answer:  # the head and the body may come in two reads
            data = sock.recv(4096)
            assert data, answer
            answer += data
    assert answer.startswith(b"HTTP/1.1 413")


def test_one_request_with_more_choices_than_max_queue_is_a_400_not_a_429():
    """On an idle server a request of more choices than --max-queue could never be admitted: a 400 naming both
    numbers (a 429 would be retried forever); a request that fits goes on."""
    with running_server(max_queue=2) as srv:
        before = pool_state(srv)
        for body, param, words in [
                ({**OK, "n": 3}, "n", "asks for 3 choices (n=3), more than the 2 requests this server lets wait at "
                                      "once (--max-queue 2)"),
                ({**OK, "prompt": ["a", "b"], "n": 2}, "n", "asks for 4 choices (2 prompts x n=2)"),
                ({**OK, "prompt": ["a", "b", "c"]}, "prompt", "asks for 3 choices (3 prompts x n=1)")]:
            status, answer, headers = post(srv.port, "/v1/completions", body)
            assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, param, "too_many_choices")
            assert words in answer["error"]["message"] and "retry-after" not in headers, answer
            assert pool_state(srv) == before
        status, answer, _ = post(srv.port, "/v1/completions", {**OK, "n": 2})
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
        srv.wait_idle()


def test_a_body_over_a_set_limit_is_a_413_naming_the_limit():
    body = json.dumps({**OK, "prompt": "a " * 1000}).encode()  # 2,047 bytes
    with running_server(app_kwargs={"max_body_bytes": 1000}) as srv:
        before = pool_state(srv)
        status, answer, _ = post(srv.port, "/v1/completions", body)
        assert status == 413 and answer["error"]["code"] == "body_too_large", answer
        assert answer["error"]["message"].startswith(f"The request body is {len(body)} bytes; this server accepts at "
                                                     "most 1000 bytes (0.0009537 MiB; `hf-pagedkv serve "
                                                     "--max-body-bytes` sets it)")
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)  # no Content-Length: counted as read
        try:
            conn.request("POST", "/v1/completions", iter([body[:900], body[900:]]),
                         {"Content-Type": "application/json"}, encode_chunked=True)
            resp = conn.getresponse()
            answer = json.loads(resp.read())
        finally:
            conn.close()
        assert resp.status == 413 and "is over 1000 bytes; this server accepts at most 1000" in \
            answer["error"]["message"]
        assert pool_state(srv) == before
        status, answer, _ = post(srv.port, "/v1/completions", {**OK, "prompt": "a " * 400})  # under the limit
        assert status == 200 and answer["usage"]["prompt_tokens"] > 400
        srv.wait_idle()


class _GatedTokenizer:
    """The tiny tokenizer, recording where it tokenizes; a prompt starting with "SLOW" waits for `release`."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.loops: list[bool] = []  # per call: whether an event loop runs in the calling thread
        self.entered, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def _record(self) -> None:
        try:
            asyncio.get_running_loop()
            self.loops.append(True)
        except RuntimeError:
            self.loops.append(False)

    def __call__(self, text, **kwargs):
        self._record()
        if text.startswith("SLOW"):
            self.entered.set()
            self.release.wait(20)
            self.finished.set()
        return self._tokenizer(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self._record()
        return self._tokenizer.apply_chat_template(*args, **kwargs)


def test_tokenizing_runs_off_the_event_loop_so_health_answers_meanwhile():
    _, tokenizer = model_and_tokenizer()
    gated = _GatedTokenizer(tokenizer)
    with running_server() as srv:
        srv.service.tokenizer = gated
        results = []
        slow = threading.Thread(target=lambda: results.append(
            post(srv.port, "/v1/completions", {**OK, "prompt": "SLOW prompt"})))
        slow.start()
        assert gated.entered.wait(20)
        assert get(srv.port, "/health") == (200, '{"status":"ok"}')
        answered_while_tokenizing = not gated.finished.is_set()
        other = srv.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=2)
        gated.release.set()
        slow.join(30)
        assert answered_while_tokenizing and other.usage.completion_tokens == 2
        assert results[0][0] == 200 and results[0][1]["usage"]["completion_tokens"] == 4
        assert gated.loops and not any(gated.loops)  # every tokenizer call ran in a thread without an event loop
        srv.wait_idle()
