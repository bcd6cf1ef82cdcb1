"""`compress_context(..., attention_mask=)` on a left-padded batch: padding scores 0 and is never kept while a real
token could be, and each row scores, keeps and answers as the same row compressed alone (checked against solo runs
of the same rows, which ran other shapes: a tolerance, not bit-equality)."""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip, KVzipScoring
from tests.conftest import ids
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4
N = 24  # context tokens per row (padding included)
PROMPT = [5, 6, 7]
PAD = 1  # the pad token (any id: it is masked)
#: scores and keys of a row run in a batch with another row, against the row alone: the same fp32 softmax and
#: matmuls over other shapes (other BLAS tilings), a few ulps of values in [0, 1] (keys: of order 1)
ATOL = 1e-5


def positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions `generate` gives a left-padded prompt `[batch, n]`."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def prefill(model, x, policy, mask=None) -> PagedCache:
    cache = PagedCache(block_size=B, config=model.config, retention=policy, debug=True)
    extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions(mask)}
    with torch.no_grad():
        model(x, **cache_kwargs(cache), **extra)
    return cache


def ask(model, cache, question, mask=None) -> torch.Tensor:
    """Logits `[batch, q, vocab]` of `question` after the (compressed) context, at the positions `generate` gives."""
    extra = {}
    if mask is not None:
        full = torch.cat([mask, torch.ones_like(question)], 1)
        extra = {"attention_mask": full, "position_ids": positions(full)[:, mask.shape[1]:]}
    with torch.no_grad():
        return model(question, **cache_kwargs(cache), **extra).logits


@pytest.mark.parametrize("pads", [5, 18])  # row 1 holds 19 real tokens (above the budget), or 6 (below it)
# pooled over 9 tokens, a row's first real tokens have padding in their window: averaged over its real tokens only,
# as alone; (a max is not changed by padding's 0)
@pytest.mark.parametrize("pooling", [dict(), dict(kernel_size=9, pooling="avg"), dict(kernel_size=9, pooling="max")])
def test_a_padded_row_scores_keeps_and_answers_as_alone(llama, pads, pooling):
    policy = KVzip(budget=10, sink_tokens=1, recent_tokens=3, scoring=KVzipScoring(**pooling))
    real = [ids(1, N, seed=31)[0], ids(1, N - pads, seed=32)[0]]
    x = torch.stack([real[0], torch.cat([torch.full((pads,), PAD), real[1]])])  # [2, N]
    mask = (x != PAD).long()
    mask[0] = 1
    question = ids(2, 4, seed=33)

    cache = prefill(llama, x, policy, mask)
    scores = compress_context(llama, cache, x, prompt_ids=PROMPT, attention_mask=mask)
    cache.check_invariants()
    kept = [layer.keys.clone() for layer in cache.layers]  # [2, H, 10, d] each
    assert [k.shape[2] for k in kept] == [10] * len(kept)
    logits = ask(llama, cache, question, mask)

    for r, row in enumerate(real):
        solo = prefill(llama, row[None], policy)
        solo_scores = compress_context(llama, solo, row[None], prompt_ids=PROMPT)
        solo.check_invariants()
        first, held = N - row.shape[0], min(10, row.shape[0])  # the row's padding in the batch; what it keeps
        for layer, s in scores.items():
            assert torch.equal(s[r, :, :first], torch.zeros_like(s[r, :, :first]))  # padding scores exactly 0
            torch.testing.assert_close(s[r, :, first:], solo_scores[layer][0], atol=ATOL, rtol=0)
            # [H, 10, d]: padding (if any) first, then what the row alone keeps
            torch.testing.assert_close(kept[layer][r, :, 10 - held:], solo.layers[layer].keys[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[r], ask(llama, solo, question[r: r + 1])[0],
                                   atol=CROSS_STEP_LOGIT_ATOL, rtol=0)
        solo.release()
    cache.check_invariants()
    cache.release()


def test_padding_is_kept_last_by_the_ranking_across_layers(llama):
    # layer_budgets="global": the per-layer budgets are ranked over both rows; whatever a layer keeps, a row with
    # more real tokens than that keeps no padding (the pad keys are all alike: one token at one position)
    policy = KVzip(compression_ratio=0.5, sink_tokens=2, recent_tokens=2, scoring=KVzipScoring(layer_budgets="global"))
    x = ids(2, N, seed=34)
    x[1, :6] = PAD
    mask = (x != PAD).long()
    mask[0] = 1
    cache = prefill(llama, x, policy, mask)
    pad_keys = [layer.keys[1, :, 0].clone() for layer in cache.layers]  # [H, d]
    scores = compress_context(llama, cache, x, prompt_ids=PROMPT, attention_mask=mask)
    cache.check_invariants()
    assert all(bool((s[1, :, :6] == 0).all()) for s in scores.values())
    assert cache.retention_stats().tokens_held < N
    for layer, pad in zip(cache.layers, pad_keys):
        kept = layer.keys[1]  # [H, keep, d]
        assert kept.shape[1] <= N - 6
        assert not bool(((kept - pad[:, None]).abs().amax(-1) < ATOL).any()), f"layer {layer.layer_idx} kept a pad"
    assert torch.isfinite(ask(llama, cache, ids(2, 2, seed=35), mask)).all()
    cache.release()


@pytest.mark.parametrize("bad, message", [
    (lambda m: m[:, 1:], "attention_mask has shape"),  # another context's mask
    (lambda m: m.flip(-1), "left padding"),  # right padding
    (lambda m: m * 2, "0s and 1s"),
    (lambda m: m[0], "0s and 1s"),  # 1-D
    (lambda m: m.to("meta"), "meta"),  # no values to read
])
def test_a_wrong_mask_is_refused_and_nothing_is_evicted(llama, bad, message):
    x = ids(2, N, seed=36)
    x[1, :5] = PAD
    mask = (x != PAD).long()
    mask[0] = 1
    cache = prefill(llama, x, KVzip(budget=10, sink_tokens=2, recent_tokens=3, scoring="plain"), mask)
    before = [layer.keys.clone() for layer in cache.layers]
    with pytest.raises(ValueError, match=message):
        compress_context(llama, cache, x, prompt_ids=PROMPT, attention_mask=bad(mask))
    cache.check_invariants()
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (N, N)
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, before))
    compress_context(llama, cache, x, prompt_ids=PROMPT, attention_mask=mask)  # the right one still works
    assert cache.retention_stats().tokens_held == 10
    cache.check_invariants()
    cache.release()


def test_a_mask_without_padding_changes_nothing(llama):
    x = ids(2, N, seed=37)
    policy = KVzip(budget=10, sink_tokens=2, recent_tokens=3, scoring="plain")
    plain, masked = prefill(llama, x, policy), prefill(llama, x, policy)
    a = compress_context(llama, plain, x, prompt_ids=PROMPT)
    b = compress_context(llama, masked, x, prompt_ids=PROMPT, attention_mask=torch.ones_like(x))
    assert all(torch.equal(a[i], b[i]) for i in a)  # the same steps: bit-identical
    assert all(torch.equal(p.keys, m.keys) for p, m in zip(plain.layers, masked.layers))
    plain.release()
    masked.release()


def test_generate_after_a_padded_compression_answers_as_each_row_alone(llama):
    # the user's path: prefill, compress_context with the mask, then generate(context + question, mask + 1s); generate
    # gives the question its positions from the mask. Greedy tokens of each row equal the row compressed alone (the
    # logits agree to 1e-4, far inside the gaps between a random model's top logits)
    policy = KVzip(budget=10, sink_tokens=2, recent_tokens=3, scoring="plain")
    real = [ids(1, N, seed=38)[0], ids(1, N - 7, seed=39)[0]]
    x = torch.stack([real[0], torch.cat([torch.full((7,), PAD), real[1]])])
    mask = (x != PAD).long()
    mask[0] = 1
    question = ids(2, 3, seed=40)
    cache = prefill(llama, x, policy, mask)
    compress_context(llama, cache, x, prompt_ids=PROMPT, attention_mask=mask)
    full = torch.cat([mask, torch.ones_like(question)], 1)
    out = llama.generate(torch.cat([x, question], 1), attention_mask=full, **cache_kwargs(cache), max_new_tokens=4,
                         do_sample=False, pad_token_id=PAD)
    cache.check_invariants()
    for r, row in enumerate(real):
        solo = prefill(llama, row[None], policy)
        compress_context(llama, solo, row[None], prompt_ids=PROMPT)
        alone = llama.generate(torch.cat([row, question[r]])[None], **cache_kwargs(solo), max_new_tokens=4,
                               do_sample=False, pad_token_id=PAD)
        assert out[r, -4:].tolist() == alone[0, -4:].tolist()
        solo.release()
    cache.release()
