"""Helpers for the HTTP server tests: the server on a free loopback port in a thread, the tiny Llama with its BPE
tokenizer (and a chat template), raw HTTP requests, and the solo reference run."""

from __future__ import annotations

import functools
import http.client
import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from transformers import DynamicCache

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

from hf_pagedkv import BlockPool, cache_kwargs  # noqa: E402
from hf_pagedkv.serving import Engine  # noqa: E402
from hf_pagedkv.serving.server import EngineService, create_app  # noqa: E402
from hf_pagedkv.serving.server.http_server import DrainingServer, bind  # noqa: E402
from tests.eval_helpers import tiny_model, tiny_model_dir  # noqa: E402
from tests.prefix_utils import tiny_single_thread  # noqa: E402, F401 (autouse fixture, for the modules importing it)

MODEL = "tiny"  # the served model name
BLOCK = 4  # block size of the tests' pools: short prompts cross block boundaries
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["The history of the city", "In 1905 the", "A river runs through the valley of", "He"]



@functools.lru_cache(maxsize=1)
def model_and_tokenizer():
    """The eval tests' tiny Llama (vocab 512) and a fresh copy of its tokenizer, given a chat template."""
    from transformers import AutoTokenizer

    model, _ = tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


@dataclass
class Running:
    """A server running in a thread: its base URL, service, engine pool and an `openai` client."""

    url: str
    port: int
    service: EngineService
    server: DrainingServer
    client: object

    @property
    def pool(self) -> BlockPool:
        return self.service.pool

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is in the engine and no block is in use."""
        deadline = time.monotonic() + timeout
        while not (self.service.is_idle and self.pool.stats().blocks_in_use == 0):
            assert time.monotonic() < deadline, f"not idle: {self.service.runner.num_tracked} tracked, " \
                                                 f"{self.pool.stats().blocks_in_use} blocks in use"
            time.sleep(0.01)


@contextmanager
def running_server(pool: BlockPool | None = None, max_batch_tokens: int | None = None, retention=None,
                   app_kwargs: dict | None = None, **service_kwargs):
    """`hf_pagedkv.serving.server` on the tiny model (its engine's `retention`; `app_kwargs` for `create_app`), on a
    free loopback port, in a thread; stopped at exit (and the pool's invariants checked)."""
    model, tokenizer = model_and_tokenizer()
    pool = pool if pool is not None else BlockPool(block_size=BLOCK, prefix_caching=True, debug=True)
    engine = Engine(model, pool, max_batch_tokens=max_batch_tokens, retention=retention)
    service = EngineService(engine, tokenizer, MODEL, **service_kwargs)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = DrainingServer(uvicorn.Config(create_app(service, **(app_kwargs or {})), log_level="warning"), service)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        yield Running(url, port, service, server, client)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()
    pool.check_invariants()


def post(port: int, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """A raw POST (bytes as they are): status, JSON body, headers."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else {}, dict(resp.getheaders())
    finally:
        conn.close()


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def solo(ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of the tiny model's `generate` on `ids` alone with a `DynamicCache` (the reference)."""
    model, tokenizer = model_and_tokenizer()
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, **cache_kwargs(DynamicCache(config=model.config)))
    return out[0, len(ids):].tolist()


def engine_tokens(prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[list[int]]:
    """The tokens an `Engine` of its own gives the prompts, served together."""
    model, _ = model_and_tokenizer()
    engine = Engine(model, BlockPool(block_size=BLOCK, prefix_caching=True))
    rids = [engine.add_request(p, max_new_tokens=max_new_tokens, **kwargs) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    return [engine.output(r).generated_tokens for r in rids]
