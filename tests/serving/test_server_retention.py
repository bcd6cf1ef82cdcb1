"""The server with a retention policy: `hf_pagedkv.serving.server` on an `Engine(retention=...)` answers through the
`openai` client with the tokens of an `Engine` running the same policy (and other tokens than without it, once the
window is passed); `hf-pagedkv serve --retention SPEC` starts and answers."""

from tests.serving.server_helpers import (MODEL, PROMPTS, engine_tokens, model_and_tokenizer, running_server,
                                          tiny_single_thread)  # noqa: F401
from tests.serving.test_server_sigterm import ServeProcess

SPEC = "sink_window:4:8"  # a sink block and two or three blocks of window (block size 4)
NEW = 24


def test_completions_use_the_engine_policy():
    _, tokenizer = model_and_tokenizer()
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    with running_server(retention=SPEC) as srv:
        got = [srv.client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0,
                                             extra_body={"return_token_ids": True, "ignore_eos": True})
               for p in PROMPTS]
        srv.wait_idle()
    expected = engine_tokens(ids, NEW, retention=SPEC, eos_token_id=[])
    assert [r.choices[0].token_ids for r in got] == expected
    assert all(len(tokens) == NEW for tokens in expected)
    assert expected != engine_tokens(ids, NEW, eos_token_id=[])  # the policy changed an answer


def test_serve_command_with_retention_answers():
    server = ServeProcess("--retention", SPEC)
    try:
        answer = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                                  extra_body={"return_token_ids": True, "ignore_eos": True})
        _, tokenizer = model_and_tokenizer()
        ids = tokenizer(PROMPTS[0]).input_ids
        assert answer.choices[0].token_ids == engine_tokens([ids], NEW, retention=SPEC, eos_token_id=[])[0]
        assert server.stop() == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_fixed_pool_takes_requests_longer_than_it_holds_when_the_policy_bounds_them():
    # 12 blocks of 4 tokens: 48 for one request without retention; with sink_window:4:8 a row
    # holds its sinks, its window and one step, so max_tokens past the pool's tokens is answered in full, as an
    # engine of its own answers it, and without the policy it gets the 400 that names the pool
    import openai
    import pytest

    from hf_pagedkv import BlockPool

    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(PROMPTS[0]).input_ids
    long = 80
    with running_server(pool=BlockPool(block_size=4, num_blocks=12, debug=True), max_batch_tokens=8,
                        retention=SPEC) as srv:
        answer = srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=long, temperature=0,
                                               extra_body={"return_token_ids": True, "ignore_eos": True})
        srv.wait_idle()
    assert answer.choices[0].token_ids == engine_tokens([ids], long, retention=SPEC, eos_token_id=[])[0]
    with running_server(pool=BlockPool(block_size=4, num_blocks=12, debug=True), max_batch_tokens=8) as srv:
        with pytest.raises(openai.BadRequestError, match="at most 38 fit: the KV pool holds 12 blocks of 4 tokens for one request"):
            srv.client.completions.create(model=MODEL, prompt=ids, max_tokens=long, temperature=0)
