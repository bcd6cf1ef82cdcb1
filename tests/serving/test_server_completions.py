"""POST /v1/completions through the `openai` client: greedy tokens equal an Engine's and solo `generate`'s (fp32,
DynamicCache); streamed text equals the whole answer; n choices share the prompt's blocks; seeded sampling repeats;
stop strings and stop token ids end a choice (its blocks freed); /v1/models and /health."""

import pytest

from tests.serving.server_helpers import (MODEL, PROMPTS, engine_tokens, get, model_and_tokenizer, openai,
                                          running_server, solo, tiny_single_thread)  # noqa: F401

NEW = 10


@pytest.fixture(scope="module")
def srv():
    with running_server() as running:
        yield running


def complete(srv, prompt, **kwargs):
    kwargs.setdefault("max_tokens", NEW)
    kwargs.setdefault("temperature", 0)
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    return srv.client.completions.create(model=MODEL, prompt=prompt, extra_body=extra, **kwargs)


def test_greedy_tokens_equal_the_engine_and_solo_generate(srv):
    _, tokenizer = model_and_tokenizer()
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    got = [complete(srv, p) for p in PROMPTS]
    srv.wait_idle()
    ref = engine_tokens(ids, NEW)
    for p_ids, r, expected in zip(ids, got, ref):
        choice = r.choices[0]
        assert choice.prompt_token_ids == p_ids
        assert choice.token_ids == expected == solo(p_ids, NEW)
        # a character the last token leaves incomplete (U+FFFD in a decode) is dropped
        assert choice.text == tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
        assert choice.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(p_ids), len(expected))
        assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_a_list_of_prompts_and_token_id_prompts(srv):
    _, tokenizer = model_and_tokenizer()
    batch = complete(srv, PROMPTS)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    singles = [complete(srv, tokenizer(p).input_ids) for p in PROMPTS]  # a prompt given as token ids
    assert [c.token_ids for c in batch.choices] == [s.choices[0].token_ids for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    srv.wait_idle()


def test_streamed_text_equals_the_whole_answer(srv):
    whole = complete(srv, PROMPTS[0], max_tokens=24)
    chunks = list(complete(srv, PROMPTS[0], max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    pieces = [c.choices[0] for c in chunks[:-1]]
    assert len(pieces) > 3
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    assert [p.finish_reason for p in pieces[:-1]] == [None] * (len(pieces) - 1)
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason
    assert pieces[-1].token_ids == whole.choices[0].token_ids
    srv.wait_idle()


def test_n_greedy_choices_share_the_prompt_blocks(srv):
    _, tokenizer = model_and_tokenizer()
    prompt = PROMPTS[2]
    ids = tokenizer(prompt).input_ids
    hits = srv.pool.stats().hit_tokens
    r = complete(srv, prompt, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.token_ids for c in r.choices] == [solo(ids, NEW)] * 3
    # choices 1 and 2 attach to choice 0's full prompt blocks (published after its prefill)
    assert srv.pool.stats().hit_tokens - hits >= 2 * (len(ids) // 4) * 4
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 3 * NEW
    srv.wait_idle()


def test_seeded_sampling_repeats_and_choices_use_seed_plus_index(srv):
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(PROMPTS[1]).input_ids
    kw = dict(n=3, temperature=0.9, top_p=0.95, seed=7, max_tokens=12)
    a, b = complete(srv, PROMPTS[1], **kw), complete(srv, PROMPTS[1], **kw)
    tokens = [c.token_ids for c in a.choices]
    assert tokens == [c.token_ids for c in b.choices]
    assert len({tuple(t) for t in tokens}) > 1  # different seeds, different draws
    srv.wait_idle()
    for i, t in enumerate(tokens):
        assert t == engine_tokens([ids], 12, do_sample=True, temperature=0.9, top_p=0.95, seed=7 + i)[0]


def test_stop_strings_end_the_text_before_them(srv):
    whole = complete(srv, PROMPTS[0], max_tokens=24).choices[0]
    text = whole.text
    stop = text[5:8]
    cut = text.index(stop)
    for stream in (False, True):
        r = complete(srv, PROMPTS[0], max_tokens=24, stop=[stop, "never in it \u2603"], stream=stream)
        if stream:
            pieces = [c.choices[0] for c in r]
            got, reason = "".join(p.text for p in pieces), pieces[-1].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert (got, reason) == (text[:cut], "stop")
    srv.wait_idle()  # the stopped choices were cancelled in the engine: no block left in use


def test_stop_token_ids_end_the_choice_and_hide_the_token(srv):
    _, tokenizer = model_and_tokenizer()
    whole = complete(srv, PROMPTS[0], max_tokens=24).choices[0]
    stop_id = whole.token_ids[6]
    first = whole.token_ids.index(stop_id)
    r = complete(srv, PROMPTS[0], max_tokens=24, extra_body={"stop_token_ids": [stop_id]}).choices[0]
    assert r.token_ids == whole.token_ids[: first + 1] and r.finish_reason == "stop"
    assert r.text == tokenizer.decode(whole.token_ids[:first], skip_special_tokens=True).rstrip("\ufffd")
    srv.wait_idle()


def test_default_max_tokens_is_16_and_models_and_health(srv):
    r = srv.client.completions.create(model=MODEL, prompt=PROMPTS[3], temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    assert [m.id for m in srv.client.models.list()] == [MODEL]
    assert srv.client.models.retrieve(MODEL).owned_by == "hf_pagedkv"
    with pytest.raises(openai.NotFoundError):
        srv.client.models.retrieve("gpt-4o")
    assert get(srv.port, "/health") == (200, '{"status":"ok"}')
    srv.wait_idle()


def test_a_quantized_pool_serves():
    from hf_pagedkv import BlockPool

    pool = BlockPool(block_size=16, quant="k8v4", prefix_caching=True)
    with running_server(pool) as q:
        r = complete(q, PROMPTS[0], max_tokens=40, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == len(r.choices[0].token_ids) == 40
        q.wait_idle()


def test_a_seed_at_the_top_of_its_range_wraps_for_later_choices(srv):
    """Choice i samples with (seed + i) mod 2**63: the largest seed with n=2 answers (no 500, no broken stream)."""
    _, tokenizer = model_and_tokenizer()
    ids = tokenizer(PROMPTS[1]).input_ids
    top = 2**63 - 1
    kw = dict(n=2, temperature=0.9, seed=top, max_tokens=6)
    plain = complete(srv, PROMPTS[1], **kw)
    streamed = [c.choices[0] for c in complete(srv, PROMPTS[1], stream=True, **kw)]
    assert len(plain.choices) == 2 and {p.index for p in streamed} == {0, 1}
    srv.wait_idle()
    for i, seed in enumerate([top, 0]):
        assert plain.choices[i].token_ids == engine_tokens([ids], 6, do_sample=True, temperature=0.9, seed=seed)[0]
