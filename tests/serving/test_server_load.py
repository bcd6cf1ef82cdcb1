"""A bounded load test: 64 concurrent `openai` clients send 192 requests (completions, streams, chat, sampled n=2,
stop strings, and requests too large for the pool) to a server on a small fixed pool (preemption) with a short
queue (429s). Every request completes with the right tokens or gets its documented status (400 too large, 429
queue full); at the end the pool's invariants hold and no block is in use."""

import asyncio
import time

from hf_pagedkv import BlockPool
from tests.serving.server_helpers import (BLOCK, MODEL, PROMPTS, model_and_tokenizer, openai, running_server, solo,
                                          tiny_single_thread)  # noqa: F401

CLIENTS, PER_CLIENT, NEW = 64, 3, 8


async def one(client, i: int, refs: dict):
    """Request `i` of its kind; returns ("ok" | "429" | "400", kind)."""
    kind, prompt = i % 6, PROMPTS[i % len(PROMPTS)]
    try:
        if kind == 0:  # a greedy stream: its tokens equal solo generate's
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                                     stream=True, extra_body={"return_token_ids": True})
            last = [c async for c in stream][-1].choices[0]
            assert last.token_ids == refs[prompt], (prompt, last)
        elif kind == 1:  # a greedy completion
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                                extra_body={"return_token_ids": True})
            assert r.choices[0].token_ids == refs[prompt]
        elif kind == 2:
            r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=NEW, temperature=0)
            assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens <= NEW
        elif kind == 3:
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, n=2, temperature=0.8,
                                                seed=i)
            assert len(r.choices) == 2 and r.usage.completion_tokens <= 2 * NEW
        elif kind == 4:  # too large for the whole pool: a 400 naming max_tokens
            try:
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=500, temperature=0)
            except openai.BadRequestError as e:
                assert e.body["param"] == "max_tokens"
                return "400", kind
            raise AssertionError("a request larger than the pool was accepted")
        else:
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                                stop=["e"])
            assert "e" not in r.choices[0].text
        return "ok", kind
    except openai.RateLimitError as e:
        assert e.response.headers["retry-after"] == "1"
        return "429", kind


def test_64_concurrent_clients_complete_or_get_their_documented_status():
    _, tokenizer = model_and_tokenizer()
    refs = {p: solo(tokenizer(p).input_ids, NEW) for p in PROMPTS}
    pool = BlockPool(block_size=BLOCK, num_blocks=48, prefix_caching=True, debug=True)
    with running_server(pool, max_batch_tokens=64, max_queue=24) as srv:
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def worker(c: int):
            return [await one(client, c * PER_CLIENT + k, refs) for k in range(PER_CLIENT)]

        async def main():
            try:
                return await asyncio.gather(*(worker(c) for c in range(CLIENTS)))
            finally:
                await client.close()

        t0 = time.perf_counter()
        results = [r for rs in asyncio.run(main()) for r in rs]
        seconds = time.perf_counter() - t0
        srv.wait_idle()
        pool.check_invariants()
        assert pool.stats().blocks_in_use == 0
        engine = srv.service.engine.stats()
    assert len(results) == CLIENTS * PER_CLIENT
    outcomes = {o for o, _ in results}
    assert outcomes <= {"ok", "429", "400"}
    assert all(o == "400" for o, kind in results if kind == 4)
    assert sum(o == "ok" for o, _ in results) >= CLIENTS // 2  # the queue limit turns some away, not most
    assert sum(o == "429" for o, _ in results) > 0  # 64 clients against a queue of 24
    assert engine.num_preemptions + engine.num_allocation_failures > 0  # the pool was a limit
    assert engine.num_running == engine.num_waiting == 0
    assert seconds < 60
