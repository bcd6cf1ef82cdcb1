"""`KVzip` through `generate()` on the real SmolLM2-135M-Instruct, kvpress's convention: a ~300-token document with a
passkey is prefilled, compressed by the reconstruction pass to half, and only then is the question given --
`generate` continues from the compressed cache exactly as steps fed by hand do, and half the context's memory is
given back. (Whether the key survives is the eval's question, `eval.long_context --methods kv_zip`: on this example
it does not, see docs/retention.md.)"""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip
from tests.eval_helpers import passkey_example
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

pytestmark = pytest.mark.model


def test_generate_after_compress_context_continues_from_the_kept_tokens(smollm):
    model, tok = smollm
    ex = passkey_example(tok, 320, depth=50)
    context = torch.tensor([ex["context_ids"]])
    x = torch.tensor([ex["context_ids"] + ex["question_ids"]])
    n, q = context.shape[1], x.shape[1] - context.shape[1]
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    try:
        pools, caches, scores = [], [], []
        for _ in range(2):  # one for generate, one fed by hand
            pools.append(BlockPool(block_size=16))
            caches.append(PagedCache(pool=pools[-1], config=model.config, retention=KVzip(compression_ratio=0.5,
                                                                                          scoring="plain"),
                                     debug=True))
            with torch.no_grad():
                model(context, **cache_kwargs(caches[-1]))
                scores.append(compress_context(model, caches[-1], context, tokenizer=tok))
            assert caches[-1].get_seq_length() == n and caches[-1].retention_stats().tokens_held == n // 2
        with torch.no_grad():
            out = model.generate(x, **cache_kwargs(caches[0]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            step = model(x[:, n:], **cache_kwargs(caches[1]))  # the question as a new step, then greedy by hand
            by_hand, logits = [], [step.logits[:, -1]]
            for _ in range(5):
                by_hand.append(logits[-1].argmax(-1, keepdim=True))
                logits.append(model(by_hand[-1], **cache_kwargs(caches[1])).logits[:, -1])
            by_hand.append(logits[-1].argmax(-1, keepdim=True))
    finally:
        model.set_attn_implementation(before)
    assert all(torch.equal(a, b) for a, b in zip(scores[0].values(), scores[1].values()))  # the same pass
    assert len(scores[0]) == model.config.num_hidden_layers
    assert all(s.shape == (1, model.config.num_key_value_heads, n) and 0 <= s.min() and s.max() <= 1
               for s in scores[0].values())
    assert torch.equal(out.sequences[:, x.shape[1]:], torch.cat(by_hand, 1))  # generate fed only the question
    assert all((a - b).abs().max() < CROSS_STEP_LOGIT_ATOL for a, b in zip(out.logits, logits))
    for cache, pool in zip(caches, pools):
        stats = cache.retention_stats()
        assert (stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (n + q + 5, n // 2 + q + 5, 1)
        assert pool.stats().blocks_in_use == -(-(n // 2 + q + 5) // 16)  # the kept tokens' blocks only
        cache.check_invariants()
        cache.release()
        assert pool.stats().blocks_in_use == 0


def test_a_left_padded_batch_answers_as_each_document_alone(smollm):
    # two passkey documents of different lengths, left-padded into one batch, compressed with their attention mask:
    # each row generates what the same document compressed alone generates (first logits within 1e-3: the same fp32
    # steps over other shapes through 30 layers; the greedy tokens then match, their gaps are far wider)
    model, tok = smollm
    docs = [passkey_example(tok, 320, depth=50), passkey_example(tok, 240, depth=10)]
    question = docs[0]["question_ids"]
    n = max(len(d["context_ids"]) for d in docs)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    context = torch.tensor([[pad] * (n - len(d["context_ids"])) + d["context_ids"] for d in docs])  # [2, n]
    mask = torch.tensor([[0] * (n - len(d["context_ids"])) + [1] * len(d["context_ids"]) for d in docs])
    policy = KVzip(budget=128, scoring="plain")
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    try:
        with torch.no_grad():
            cache = PagedCache(config=model.config, retention=policy, debug=True)
            model(context, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                  **cache_kwargs(cache))
            compress_context(model, cache, context, tokenizer=tok, attention_mask=mask)
            assert cache.retention_stats().tokens_held == 128
            x = torch.cat([context, torch.tensor([question] * 2)], 1)
            full = torch.cat([mask, torch.ones(2, len(question), dtype=mask.dtype)], 1)
            out = model.generate(x, attention_mask=full, **cache_kwargs(cache), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
            cache.check_invariants()
            cache.release()
            for r, d in enumerate(docs):
                alone = PagedCache(config=model.config, retention=policy, debug=True)
                ctx = torch.tensor([d["context_ids"]])
                model(ctx, **cache_kwargs(alone))
                compress_context(model, alone, ctx, tokenizer=tok)
                solo = model.generate(torch.tensor([d["context_ids"] + question]), **cache_kwargs(alone),
                                      max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=pad,
                                      output_logits=True, return_dict_in_generate=True)
                assert out.sequences[r, x.shape[1]:].tolist() == solo.sequences[0, -6:].tolist()
                assert (out.logits[0][r] - solo.logits[0][0]).abs().max() < 1e-3
                alone.release()
    finally:
        model.set_attn_implementation(before)
