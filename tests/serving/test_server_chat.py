"""POST /v1/chat/completions through the `openai` client: the tokenizer's chat template, greedy tokens equal solo
`generate`'s on the templated prompt, streaming (role first, then content, then the finish reason), text parts,
max_completion_tokens, and a tokenizer without a template."""

import pytest

from tests.serving.server_helpers import (MODEL, model_and_tokenizer, openai, post, running_server, solo,
                                          tiny_single_thread)  # noqa: F401

MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Where is the river?"}]


@pytest.fixture(scope="module")
def srv():
    with running_server() as running:
        yield running


def templated(messages) -> list[int]:
    _, tokenizer = model_and_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_chat_greedy_equals_solo_generate_on_the_templated_prompt(srv):
    _, tokenizer = model_and_tokenizer()
    r = srv.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True})
    ids = templated(MESSAGES)
    choice = r.choices[0]
    assert choice.prompt_token_ids == ids
    assert choice.token_ids == solo(ids, 12)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(choice.token_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(choice.token_ids))
    srv.wait_idle()


def test_streamed_chat_sends_the_role_then_the_content(srv):
    kw = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0)
    whole = srv.client.chat.completions.create(**kw).choices[0]
    chunks = list(srv.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    deltas = [c.choices[0] for c in chunks[:-1]]
    assert deltas[0].delta.role == "assistant" and all(d.delta.role is None for d in deltas[1:])
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(d.delta.content or "" for d in deltas) == whole.message.content
    assert deltas[-1].finish_reason == whole.finish_reason
    srv.wait_idle()


def test_text_parts_and_developer_role(srv):
    parts = [{"role": "developer", "content": [{"type": "text", "text": "You answer "},
                                               {"type": "text", "text": "briefly."}]},
             MESSAGES[1]]
    a = srv.client.chat.completions.create(model=MODEL, messages=parts, max_tokens=8, temperature=0)
    b = srv.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content  # developer is the system role
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]"):
        srv.client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}])
    status, body, _ = post(srv.port, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                               "max_tokens": 4, "max_completion_tokens": 4})
    assert status == 400 and body["error"]["param"] == "max_completion_tokens"
    srv.wait_idle()


def test_chat_without_a_template_is_a_400_naming_messages():
    model, tokenizer = model_and_tokenizer()
    template = tokenizer.chat_template
    tokenizer.chat_template = None
    try:
        with running_server() as srv:
            with pytest.raises(openai.BadRequestError, match="no chat template") as e:
                srv.client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert e.value.body["param"] == "messages"
            assert srv.pool.stats().num_blocks == 0  # nothing reached the pool
    finally:
        tokenizer.chat_template = template


def test_a_tool_message_with_its_tool_call_id_reaches_the_template(srv):
    """A ``tool`` message carries `tool_call_id` (as OpenAI's API requires); a template that reads it gets it."""
    from transformers import AutoTokenizer

    from tests.eval_helpers import tiny_model_dir

    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Calling add."},
                {"role": "tool", "content": "4", "tool_call_id": "call_7"}]
    r = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"return_token_ids": True})
    assert r.choices[0].prompt_token_ids == templated(messages)  # a template without tool_call_id ignores it
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m.get('tool_call_id', '') }}:"
                               "{{ m['content'] }}\n{% endfor %}<|assistant|>")
    served = srv.service.tokenizer
    srv.service.tokenizer = tokenizer
    try:
        r = srv.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                               extra_body={"return_token_ids": True})
    finally:
        srv.service.tokenizer = served
    text = "<|user|>:What is 2 + 2?\n<|assistant|>:Calling add.\n<|tool|>call_7:4\n<|assistant|>"
    assert r.choices[0].prompt_token_ids == tokenizer(text, add_special_tokens=False).input_ids
    srv.wait_idle()
