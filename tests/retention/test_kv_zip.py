"""`KVzip`, the query-agnostic policy: `compress_context` runs a reconstruction pass (a repeat prompt, then the context
again) through the cache, the ``"hf_pagedkv"`` attention scores each context token by the highest attention weight it
receives, the reconstruction tokens are cropped and each (layer, KV head) keeps its best tokens compactly -- checked
against eager attention weights computed without a cache, and against a run whose every layer hides exactly each
head's evicted positions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs, compress_context
from hf_pagedkv.retention import KVzip, KVzipScoring, SnapKV
from hf_pagedkv.blocks.block_table import num_blocks_for
from hf_pagedkv.retention.spec import parse_retention
from tests.conftest import ids
from tests.retention.reference import (kept_heads_reference, reference_kvzip_kept, reference_kvzip_scores,
                                       run_steps)
from tests.tolerances import CROSS_STEP_LOGIT_ATOL

B = 4
N = 24  # context tokens
PROMPT = [5, 6, 7]  # the repeat prompt's ids (any tokens: the tiny model is random)
#: |weight difference| between the scores (fp32 matmul + softmax in the cache) and eager attention's fp32 weights:
#: the same softmax over the same logits, summed in another order; weights are in [0, 1], so fp32 rounding of a few
#: ulps of 1 (1.2e-7 each) stays far below 1e-5
SCORE_ATOL = 1e-5


def prefilled(model, x, policy, **kwargs) -> PagedCache:
    cache = PagedCache(block_size=B, config=model.config, retention=policy, debug=True, **kwargs)
    run_steps(model, x, [x.shape[1]], cache)
    return cache


def test_recent_share_keeps_a_recent_window_and_the_best_scored_rest(llama):
    # H2O's split on KVzip's scores: of 12 kept tokens, the last int(0.5 * 12) = 6 context tokens are kept
    x = ids(2, N, seed=21)
    policy = KVzip(compression_ratio=0.5, sink_tokens=2, recent_tokens=3, recent_share=0.5, scoring="plain")
    cache = prefilled(llama, x, policy)
    full_keys = [layer.keys.clone() for layer in cache.layers]  # [2, H, N, d] each
    compress_context(llama, cache, x, prompt_ids=PROMPT)
    keep = 12
    assert policy.recent_for(keep) == 6
    kept = reference_kvzip_kept(reference_kvzip_scores(llama, x, PROMPT), keep, sink=2, recent=6)
    plain = reference_kvzip_kept(reference_kvzip_scores(llama, x, PROMPT), keep, sink=2, recent=3)
    assert any(not torch.equal(kept[i], plain[i]) for i in kept)  # the window changed the kept sets
    for layer, k in enumerate(full_keys):
        assert (kept[layer][..., -6:] == torch.arange(N - 6, N)).all()  # every head holds the window
        idx = kept[layer][..., None].expand(-1, -1, -1, k.shape[-1])
        assert torch.equal(cache.layers[layer].keys, k.gather(2, idx))
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (N, keep)
    pool = cache.pool.stats()
    assert pool.blocks_in_use == 2 * num_blocks_for(keep, B)
    assert pool.bytes_in_use == pool.blocks_in_use * pool.bytes_per_block
    cache.check_invariants()
    cache.release()


@pytest.mark.parametrize("chunk", [1024, 7, 5])  # one step; steps of 7 (in sdpa) and of 5 (read in place)
def test_scores_equal_eager_attention_weights_and_the_cache_keeps_exactly_the_best(llama, chunk):
    x = ids(2, N, seed=21)  # two different rows
    policy = KVzip(compression_ratio=0.5, sink_tokens=2, recent_tokens=3, chunk_tokens=chunk, scoring="plain")
    cache = prefilled(llama, x, policy)
    full_keys = [layer.keys.clone() for layer in cache.layers]  # [2, H, N, d] each, before the compression
    full_values = [layer.values.clone() for layer in cache.layers]
    scores = compress_context(llama, cache, x, prompt_ids=PROMPT)
    want = reference_kvzip_scores(llama, x, PROMPT)
    assert sorted(scores) == sorted(want)
    for layer in want:
        assert scores[layer].shape == (2, 2, N)
        assert (scores[layer] - want[layer]).abs().max() < SCORE_ATOL, layer
    # the reconstruction tokens are gone; every (row, layer, head) holds its 12 best context tokens, in order
    keep = 12
    kept = reference_kvzip_kept(want, keep, sink=2, recent=3)
    stats = cache.retention_stats()
    assert (cache.get_seq_length(), stats.tokens_seen, stats.tokens_held, stats.num_evictions) == (N, N, keep, 1)
    for layer, (k, v) in enumerate(zip(full_keys, full_values)):
        idx = kept[layer][..., None].expand(-1, -1, -1, k.shape[-1])  # [2, H, keep, d]
        assert torch.equal(cache.layers[layer].keys, k.gather(2, idx))  # the kept keys, bit for bit
        assert torch.equal(cache.layers[layer].values, v.gather(2, idx))
    pool = cache.pool.stats()
    assert pool.blocks_in_use == 2 * num_blocks_for(keep, B)  # the budget's blocks only: the rest went back
    assert pool.bytes_in_use == pool.blocks_in_use * pool.bytes_per_block
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_the_question_after_the_compressed_context_equals_the_head_masked_reference(llama):
    steps = [N, 5, 1, 1, 3]  # the context, a multi-token question, decoding, a multi-token step
    x = ids(2, sum(steps), seed=22)
    policy = KVzip(budget=10, sink_tokens=1, recent_tokens=2, chunk_tokens=8, scoring="plain")
    cache = prefilled(llama, x[:, :N], policy)
    prefill = run_steps(llama, x[:, :N], [N], PagedCache(block_size=B, config=llama.config))
    compress_context(llama, cache, x[:, :N], prompt_ids=PROMPT)
    got = run_steps(llama, x[:, N:], steps[1:], cache, before=lambda c, s, q: c.check_invariants())
    kept = reference_kvzip_kept(reference_kvzip_scores(llama, x[:, :N], PROMPT), 10, sink=1, recent=2)
    want = kept_heads_reference(llama, x, N, kept)
    assert (prefill - want[:, :N]).abs().max() < CROSS_STEP_LOGIT_ATOL  # the reference's context is the plain one
    assert (got - want[:, N:]).abs().max() < CROSS_STEP_LOGIT_ATOL  # every step after the compression
    full = run_steps(llama, x, steps, PagedCache(block_size=B, config=llama.config))
    assert (got - full[:, N:]).abs().max() > 1e-2  # the eviction really changed what attention saw
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (sum(steps), 10 + sum(steps[1:]))
    assert cache.pool.stats().blocks_in_use == 2 * num_blocks_for(10 + sum(steps[1:]), B)
    cache.check_invariants()
    cache.release()


def test_generate_continues_from_the_compressed_cache(llama):
    x = ids(1, N + 4, seed=23)  # the context, then a 4-token question
    cache = prefilled(llama, x[:, :N], KVzip(budget=12, sink_tokens=2, recent_tokens=2, chunk_tokens=10,
                                             scoring="plain"))
    compress_context(llama, cache, x[0, :N], prompt_ids=PROMPT)
    out = llama.generate(x, **cache_kwargs(cache), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    kept = reference_kvzip_kept(reference_kvzip_scores(llama, x[:, :N], PROMPT), 12, sink=2, recent=2)
    want = kept_heads_reference(llama, x, N, kept)[:, -1]  # the question's last logits, head-masked
    assert (out.logits[0] - want).abs().max() < CROSS_STEP_LOGIT_ATOL
    assert out.sequences.shape == (1, N + 7) and torch.equal(out.sequences[:, : N + 4], x)
    stats = cache.retention_stats()
    assert (stats.tokens_seen, stats.tokens_held) == (N + 6, 12 + 6)  # generate fed only the question and 2 tokens
    cache.check_invariants()
    cache.release()


def test_refusals_change_nothing(llama):
    x = ids(1, N, seed=24)
    pool = BlockPool(block_size=B)
    cache = PagedCache(pool=pool, config=llama.config, retention=KVzip(budget=12, recent_tokens=2, scoring="plain"),
                       debug=True)
    with pytest.raises(ValueError, match="holds no tokens"):
        compress_context(llama, cache, x, prompt_ids=PROMPT)
    run_steps(llama, x, [N], cache)
    tables = cache.block_tables()
    llama.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match='attn_implementation="hf_pagedkv"'):
            compress_context(llama, cache, x, prompt_ids=PROMPT)
    finally:
        llama.set_attn_implementation("hf_pagedkv")
    with pytest.raises(ValueError, match="holds 1 row of .* is \\(1, 20\\)"):
        compress_context(llama, cache, x[:, :20], prompt_ids=PROMPT)
    with pytest.raises(ValueError, match="must be"):
        compress_context(llama, cache, torch.zeros(1, 2, 3, dtype=torch.long))
    for bad in ("hello", None, x.float(), [[1.5, 2.0]]):
        with pytest.raises(ValueError, match="`context_ids` must be token ids"):
            compress_context(llama, cache, bad, prompt_ids=PROMPT)
    with pytest.raises(ValueError, match="`prompt_ids` holds token ids outside"):
        compress_context(llama, cache, x, prompt_ids=[-1])
    with pytest.raises(ValueError, match="`context_ids` holds token ids outside"):
        compress_context(llama, cache, torch.full_like(x, llama.config.vocab_size), prompt_ids=PROMPT)
    # a float or bool would be truncated to another token id, silently: refused, as are nested or non-int ids
    for bad in ([1.5], [True], (5, 6.0), "hello", [[1]], [None], torch.tensor([[5, 6]]), torch.tensor([5.0]),
                torch.tensor([True]), 7, [torch.tensor(1.5)], [torch.tensor([1])], [2**70]):
        with pytest.raises(ValueError, match="`prompt_ids` must be a flat sequence of ints"):
            compress_context(llama, cache, x, prompt_ids=bad)
    for bad in (object(), "gpt2", lambda text, **kw: None, lambda text, **kw: {"input_ids": [[1, 2]]}):
        with pytest.raises(ValueError, match="`tokenizer` must be a Hugging Face tokenizer"):  # (not `prompt_ids`)
            compress_context(llama, cache, x, tokenizer=bad)
    class NoDevice:  # a model-like object without `.device`
        config, get_input_embeddings = llama.config, llama.get_input_embeddings

    for bad in (None, "llama", llama.model.layers, NoDevice()):
        with pytest.raises(ValueError, match="runs a transformers causal LM"):
            compress_context(bad, cache, x, prompt_ids=PROMPT)
    assert cache.block_tables() == tables and cache.get_seq_length() == N
    cache.check_invariants()
    compress_context(llama, cache, x, prompt_ids=PROMPT)
    with pytest.raises(ValueError, match="already compressed"):
        compress_context(llama, cache, x, prompt_ids=PROMPT)
    assert cache.retention_stats().tokens_held == 12
    cache.check_invariants()
    cache.release()
    assert pool.stats().blocks_in_use == 0
    for retention in (None, SnapKV(budget=12, recent_tokens=4)):
        other = PagedCache(block_size=B, config=llama.config, retention=retention)
        run_steps(llama, x, [N], other)
        with pytest.raises(ValueError, match="KVzip"):
            compress_context(llama, other, x)
        other.release()
    with pytest.raises(ValueError, match="PagedCache"):
        compress_context(llama, object(), x)


class WidestKeepsAll(KVzip):
    """Global budgets whose widest tier keeps the whole context: 0 tokens evicted per row (the table spans them all),
    yet compressed."""

    def score_budgets(self, scores, keep, held, block_size, valid=None):
        return [held, held - 4 * block_size, held - 5 * block_size]  # 24, 8, 4: 36 tokens, the uniform 3 x 12


def test_a_second_compression_is_refused_when_the_widest_tier_kept_everything(llama):
    # the refusal must not count evicted tokens (0 here): a second pass would fail in its scores and then in its
    # own clean-up, leaving the reconstruction tokens in the cache
    x = ids(1, N, seed=25)
    cache = prefilled(llama, x, WidestKeepsAll(budget=12, sink_tokens=1, recent_tokens=2,
                                               scoring=KVzipScoring(layer_budgets="global")))
    compress_context(llama, cache, x, prompt_ids=PROMPT)
    assert list(cache.retention_stats().tokens_held_per_layer) == [24, 8, 4]
    tables, held = cache.block_tables(), cache.retention_stats()
    with pytest.raises(ValueError, match="already compressed"):
        compress_context(llama, cache, x, prompt_ids=PROMPT)
    assert cache.block_tables() == tables and cache.retention_stats() == held and cache.get_seq_length() == N
    cache.check_invariants()
    q = ids(1, 3, seed=26)
    run_steps(llama, q, [3], cache)  # the cache still serves the question
    cache.check_invariants()
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("form", [tuple, torch.tensor, np.array, lambda p: [np.int64(i) for i in p]])
def test_prompt_ids_as_a_tuple_tensor_or_array_compress_as_the_list_does(llama, form):
    x = ids(1, N, seed=26)
    scores = {}
    for key, prompt in (("list", PROMPT), ("form", form(PROMPT))):
        cache = prefilled(llama, x, KVzip(budget=12, recent_tokens=2, scoring="plain"))
        scores[key] = compress_context(llama, cache, x, prompt_ids=prompt)
        cache.check_invariants()
        cache.release()
    assert scores["list"].keys() == scores["form"].keys()
    assert all(torch.equal(scores["list"][i], scores["form"][i]) for i in scores["list"])  # the same steps: bit-equal


def test_an_error_in_the_reconstruction_pass_crops_it_and_keeps_the_context(llama):
    x = ids(1, N, seed=25)
    cache = prefilled(llama, x, KVzip(budget=12, recent_tokens=2, chunk_tokens=8, scoring="plain"))
    tables = cache.block_tables()
    calls = []

    def fail_second_step(module, args):  # the first step (8 tokens) runs, the second fails in the embedding
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")

    hook = llama.get_input_embeddings().register_forward_pre_hook(fail_second_step)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            compress_context(llama, cache, x, prompt_ids=[5] * 9)
    finally:
        hook.remove()
    assert len(calls) == 2
    assert cache.block_tables() == tables and cache.retention_stats().tokens_held == N  # the 8 tokens were cropped
    cache.check_invariants()
    compress_context(llama, cache, x, prompt_ids=PROMPT)  # and it can still be compressed
    assert cache.retention_stats().tokens_held == 12
    cache.release()


def test_without_compress_context_nothing_is_evicted(llama):
    x = ids(1, N + 3, seed=26)
    cache = prefilled(llama, x[:, :N], KVzip(compression_ratio=0.5, recent_tokens=2, scoring="plain"))
    got = run_steps(llama, x[:, N:], [2, 1], cache)
    want = run_steps(llama, x, [N, 2, 1], PagedCache(block_size=B, config=llama.config))[:, N:]
    assert torch.equal(got, want)  # the same steps as a cache without retention
    assert cache.retention_stats().tokens_evicted == 0
    cache.release()


def test_bad_settings_are_refused_and_the_spec_knows_it():
    with pytest.raises(ValueError, match="exactly one"):
        KVzip(scoring="plain")
    with pytest.raises(ValueError, match="chunk_tokens"):
        KVzip(budget=64, chunk_tokens=0, scoring="plain")
    with pytest.raises(ValueError, match="budget"):
        KVzip(budget=10, sink_tokens=4, recent_tokens=16, scoring="plain")
    with pytest.raises(ValueError, match="compression_ratio"):
        KVzip(compression_ratio=1.5, scoring="plain")
    hundred = KVzip(budget=100, scoring="plain")
    assert hundred.keep_for(300) == 100 and hundred.keep_for(50) == 50
    assert KVzip(compression_ratio=0.75, scoring="plain").keep_for(400) == 100
    assert KVzip(compression_ratio=0.99, sink_tokens=4, recent_tokens=16,
                 scoring="plain").keep_for(400) == 21  # the protected ones
    assert parse_retention("kv_zip:0.5") == KVzip(compression_ratio=0.5, scoring="plain")
    assert parse_retention("kvzip:256") == KVzip(budget=256, scoring="plain")
    assert parse_retention("kv_zip:0.5:0.25") == KVzip(compression_ratio=0.5, recent_share=0.25, scoring="plain")
    assert parse_retention("kv_zip:256:0.5") == KVzip(budget=256, recent_share=0.5, scoring="plain")
    assert parse_retention("kv_zip_global:0.5") == parse_retention("kvzip_global:0.5") == KVzip(compression_ratio=0.5,
                                                                                                scoring="global")
    assert parse_retention("kv_zip_global:256:0.5") == KVzip(budget=256, recent_share=0.5, scoring="global")
    with pytest.raises(ValueError, match="recent_share"):
        parse_retention("kv_zip:0.5:1.5")
    with pytest.raises(ValueError, match="SHARE"):
        parse_retention("kv_zip:0.5:0.25:1")
    with pytest.raises(ValueError, match="reconstruction pass"):
        KVzip(budget=64, scoring="plain").scores(torch.zeros(1, 2, 70, 8), None)
    for bad in (0, 2, 1.0):
        with pytest.raises(ValueError, match="kernel_size"):
            KVzip(budget=64, scoring=KVzipScoring(kernel_size=bad))
    for bad in ("mean", None, "MAX"):
        with pytest.raises(ValueError, match="pooling"):
            KVzip(budget=64, scoring=KVzipScoring(kernel_size=3, pooling=bad))


def test_kernel_size_max_or_avg_pools_the_scores_over_neighbours():
    observed = torch.zeros(1, 2, 8)
    observed[0, 0, 3] = 1.0  # head 0: one high token; head 1: a high token at the start
    observed[0, 1, 0] = 0.5
    keys = torch.zeros(1, 2, 8, 4)
    assert torch.equal(KVzip(budget=64, scoring="plain").scores(keys, observed),
                       observed)  # kernel 1: KVzip's own scores
    pooled = KVzip(budget=64, scoring=KVzipScoring(kernel_size=3)).scores(keys, observed)
    assert pooled[0, 0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # the neighbours of token 3 score as it does
    assert pooled[0, 1].tolist() == [0.5, 0.5, 0, 0, 0, 0, 0, 0]  # per head; the edge is not wrapped
    idx = KVzip(budget=6, sink_tokens=0, recent_tokens=0, scoring=KVzipScoring(kernel_size=3)).select(keys, 3, observed)
    assert idx[0, 0].tolist() == [2, 3, 4]  # the high token kept with both its neighbours
    avg = KVzip(budget=64, scoring=KVzipScoring(kernel_size=3, pooling="avg")).scores(keys, observed)
    assert torch.allclose(avg[0, 0], torch.tensor([0, 0, 1, 1, 1, 0, 0, 0]) / 3)  # the mean of each window
    assert torch.allclose(avg[0, 1], torch.tensor([0.25, 0.5 / 3, 0, 0, 0, 0, 0, 0]))  # the edge: 2 tokens counted
    assert torch.equal(KVzip(budget=64, scoring=KVzipScoring(pooling="avg")).scores(keys, observed),
                       observed)  # kernel 1: no pooling
    # left padding (2 tokens, scoring 0) is left out of the mean as the edge is: the real tokens pool as alone
    padded = torch.cat([torch.zeros(1, 2, 2), observed], -1)  # [1, 2, 10]
    valid = torch.tensor([[False, False] + [True] * 8])
    got = KVzip(budget=64, scoring=KVzipScoring(kernel_size=3, pooling="avg")).scores(
        torch.zeros(1, 2, 10, 4), padded, valid=valid)
    torch.testing.assert_close(got[..., 2:], avg, atol=1e-7, rtol=0)  # (x / 3) / (2 / 3) against x / 2: rounding
    assert torch.equal(got[..., :2], torch.zeros(1, 2, 2))


def test_share_heads_ranks_every_head_of_a_layer_by_the_heads_mean_score():
    observed = torch.tensor([[[0.9, 0.0, 0.1, 0.2, 0.0, 0.3],  # head 0 and head 1 disagree; their mean decides
                              [0.0, 0.8, 0.1, 0.6, 0.0, 0.3]]])
    keys = torch.zeros(1, 2, 6, 4)
    policy = KVzip(budget=64, scoring=KVzipScoring(share_heads=True))
    mean = observed.mean(dim=1)  # [1, 6]: 0.45 0.4 0.1 0.4 0 0.3
    got = policy.scores(keys, observed)
    assert torch.equal(got[0, 0], mean[0]) and torch.equal(got[0, 1], mean[0])
    shared = KVzip(budget=6, sink_tokens=0, recent_tokens=0, scoring=KVzipScoring(share_heads=True))
    idx = shared.select(keys, 3, observed)
    assert idx[0].tolist() == [[0, 1, 3], [0, 1, 3]]  # the same tokens in both heads (ties: the older first)
    alone = KVzip(budget=6, sink_tokens=0, recent_tokens=0, scoring="plain").select(keys, 3, observed)
    assert alone[0].tolist() == [[0, 3, 5], [1, 3, 5]]  # each head its own, without it
    pooled = KVzip(budget=64, scoring=KVzipScoring(kernel_size=3, pooling="avg", share_heads=True)).scores(
        keys, observed)
    want = KVzip(budget=64, scoring=KVzipScoring(kernel_size=3, pooling="avg")).scores(
        keys, mean[:, None].expand(1, 2, 6))
    torch.testing.assert_close(pooled, want, atol=1e-7, rtol=0)  # the mean, then the pooling (one rounding apart)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="share_heads"):
            KVzip(budget=64, scoring=KVzipScoring(share_heads=bad))


def global_setup(llama, seed: int, **settings):
    """Steps, token ids (2 rows) and a cache holding their context, prefilled under `KVzip` with a budget of 10 (1
    sink, 2 recent) ranked across layers, plus `settings`."""
    steps = [N, 5, 1, 3]
    x = ids(2, sum(steps), seed=seed)
    policy = KVzip(budget=10, sink_tokens=1, recent_tokens=2, chunk_tokens=8,
                   scoring=KVzipScoring(layer_budgets="global", **settings))
    return steps, x, prefilled(llama, x[:, :N], policy)


def run_against_global_reference(llama, x, steps, cache, ranked: dict[int, torch.Tensor]):
    """After `compress_context` with a budget of 10 (1 sink, 2 recent) ranked across layers: the layers' budgets
    follow a plain sort of `ranked` (layer -> `[2, H, N]`), every layer keeps its best `ranked` tokens, only their
    blocks are held, and every step after the compression equals the head-masked reference. Returns the steps'
    logits, the kept sets and the budgets."""
    keeps = list(cache.retention_stats().tokens_held_per_layer)
    wanted = plain_global_budgets(ranked, 10, sink=1, recent=2)
    assert all(abs(k - w) < B for k, w in zip(keeps, wanted))  # the ranking across layers
    assert sum(keeps) <= 3 * 10
    kept = {}
    for layer, k in enumerate(keeps):
        kept.update(reference_kvzip_kept({layer: ranked[layer]}, k, sink=1, recent=2))
    assert cache.pool.stats().blocks_in_use == sum(2 * num_blocks_for(k, B) for k in keeps)
    cache.check_invariants()
    got = run_steps(llama, x[:, N:], steps[1:], cache, before=lambda c, s, q: c.check_invariants())
    want = kept_heads_reference(llama, x, N, kept)
    assert (got - want[:, N:]).abs().max() < CROSS_STEP_LOGIT_ATOL  # every step after the compression
    return got, kept, keeps


def test_share_heads_with_global_budgets_equals_the_head_masked_reference(llama):
    steps, x, cache = global_setup(llama, seed=23, share_heads=True)
    compress_context(llama, cache, x[:, :N], prompt_ids=PROMPT)
    want_scores = reference_kvzip_scores(llama, x[:, :N], PROMPT)
    shared = {layer: s.mean(dim=1, keepdim=True).expand(s.shape) for layer, s in want_scores.items()}
    got, kept, _ = run_against_global_reference(llama, x, steps, cache, shared)  # ranked by the heads' means
    assert all(torch.equal(k[:, 0], k[:, 1]) for k in kept.values())  # one token set per layer
    own = prefilled(llama, x[:, :N], KVzip(budget=10, sink_tokens=1, recent_tokens=2, chunk_tokens=8,
                                           scoring=KVzipScoring(layer_budgets="global")))
    compress_context(llama, own, x[:, :N], prompt_ids=PROMPT)
    assert (got - run_steps(llama, x[:, N:], steps[1:], own)).abs().max() > 1e-3  # the sharing changed the kept sets
    for c in (cache, own):
        c.release()
        assert c.pool.stats().blocks_in_use == 0


def test_value_weighted_scores_are_times_the_relative_value_norm_and_padding_is_left_out():
    scores = torch.tensor([[[0.5, 0.5, 0.2, 0.0]]])  # [1, 1, 4]
    values = torch.zeros(1, 1, 4, 2)
    values[0, 0, :, 0] = torch.tensor([1.0, 3.0, 4.0, 4.0])  # norms 1, 3, 4, 4: mean 3
    plain = KVzip(budget=64, scoring="plain")
    assert plain.weigh(scores, values) is scores  # off by default: the pass's own scores
    got = KVzip(budget=64, scoring=KVzipScoring(value_weighted=True)).weigh(scores, values)
    torch.testing.assert_close(got, torch.tensor([[[0.5 / 3, 0.5, 0.8 / 3, 0.0]]]), atol=1e-7, rtol=0)
    valid = torch.tensor([[False, True, True, True]])  # left padding: the mean over the real tokens, 11 / 3
    got = KVzip(budget=64, scoring=KVzipScoring(value_weighted=True)).weigh(scores * valid, values, valid)
    torch.testing.assert_close(got, torch.tensor([[[0.0, 1.5 / 11 * 3, 0.8 / 11 * 3, 0.0]]]), atol=1e-7, rtol=0)
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="value_weighted"):
            KVzip(budget=64, scoring=KVzipScoring(value_weighted=bad))
    squared_policy = KVzip(budget=64, scoring=KVzipScoring(value_weighted=True, value_power=2))
    squared = squared_policy.weigh(scores, values)  # (norm / mean) ** 2
    torch.testing.assert_close(squared, torch.tensor([[[0.5 / 9, 0.5, 0.2 * 16 / 9, 0.0]]]), atol=1e-7, rtol=0)
    norms = values.norm(dim=-1)  # power 1: VATP's plain weighting, scores * norm / mean
    linear = KVzip(budget=64, scoring=KVzipScoring(value_weighted=True, value_power=1.0)).weigh(scores, values)
    torch.testing.assert_close(linear, scores * norms / norms.mean(dim=-1, keepdim=True), atol=1e-7, rtol=1e-6)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "2", 8.5, 1e6):
        with pytest.raises(ValueError, match=r"value_power` must be a number in \(0, 8\]"):
            KVzip(budget=64, scoring=KVzipScoring(value_weighted=True, value_power=bad))
    # a token holding all of a long row's value norm: its relative norm is the row's length, 2 ** 20 here, and
    # (2 ** 20) ** 8 is past float32's range; the weight saturates (its rank kept) instead of becoming inf, and a
    # score of 0 stays 0 instead of 0 * inf = NaN
    held = 2 ** 20
    big = torch.zeros(1, 1, held, 1)
    big[0, 0, 0, 0] = 1.0
    row = torch.full((1, 1, held), 1e-3)
    row[0, 0, 1] = 0.0
    steepest = KVzip(budget=64, scoring=KVzipScoring(value_weighted=True, value_power=8)).weigh(row, big)
    assert torch.isfinite(steepest).all()
    cap = (torch.finfo(torch.float32).max ** (1 / 8) / 2) ** 8  # the weight's ceiling, about 1.3e36
    torch.testing.assert_close(steepest[0, 0, 0], torch.tensor(cap * 1e-3), rtol=1e-5, atol=0)
    assert steepest[0, 0, 1:].eq(0).all()
    with pytest.raises(ValueError, match="value_weighted=True"):  # an exponent of a weighting that is off
        KVzip(budget=64, scoring=KVzipScoring(value_power=2))


def test_value_weighted_global_budgets_equal_the_head_masked_reference(llama):
    steps, x, cache = global_setup(llama, seed=24, value_weighted=True)
    values = {layer: cache.layers[layer].values.clone() for layer in range(len(cache.layers))}  # [2, H, N, d]
    raw = compress_context(llama, cache, x[:, :N], prompt_ids=PROMPT)
    want_scores = reference_kvzip_scores(llama, x[:, :N], PROMPT)
    assert all((raw[layer] - want_scores[layer]).abs().max() < SCORE_ATOL for layer in want_scores)  # returned raw
    norms = {layer: v.norm(dim=-1) for layer, v in values.items()}  # [2, H, N]
    weighted = {layer: s * norms[layer] / norms[layer].mean(-1, keepdim=True) for layer, s in want_scores.items()}
    _, kept, keeps = run_against_global_reference(llama, x, steps, cache, weighted)  # ranked by the weighted scores
    unweighted = {}
    for layer, k in enumerate(keeps):
        unweighted.update(reference_kvzip_kept({layer: want_scores[layer]}, k, sink=1, recent=2))
    assert any(not torch.equal(kept[layer], unweighted[layer]) for layer in kept)  # the weights changed the choice
    cache.release()
    assert cache.pool.stats().blocks_in_use == 0


def test_context_scores_keep_a_running_max_and_check_their_shape():
    from hf_pagedkv.retention.context_scores import ContextScores

    scores = ContextScores(num_context=3)
    keys = torch.zeros(1, 1, 5, 2)  # 3 context keys, then the step's 2 tokens; equal logits: uniform weights
    scores.tag(keys, layer_idx=0)
    from hf_pagedkv.attention.query_window import recorder_of

    recorder_of(keys)(torch.zeros(1, 2, 2, 2), 1.0)  # 2 query heads over 1 KV head, 2 queries
    assert torch.allclose(scores.scores[0], torch.full((1, 1, 3), 1 / 4))  # the first query sees 4 keys: 1/4 each
    assert scores.check(1, {0: 1}) == []
    assert scores.check(2, {0: 1}) and scores.check(1, {0: 3})  # another batch or head count is reported
    with pytest.raises(ValueError, match="must come before"):
        scores.record(0, lambda: torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 2, 2), 1.0)  # 4 keys: 2 are the step's


def test_the_compiled_attention_scores_the_same(llama):
    """"hf_pagedkv_compiled" differs only in quantized decode reads: compress_context scores alike under it."""
    x = ids(1, N, seed=27)
    a = prefilled(llama, x, KVzip(budget=12, recent_tokens=2, scoring="plain"))
    want = compress_context(llama, a, x, prompt_ids=PROMPT)
    llama.set_attn_implementation("hf_pagedkv_compiled")
    try:
        b = prefilled(llama, x, KVzip(budget=12, recent_tokens=2, scoring="plain"))
        got = compress_context(llama, b, x, prompt_ids=PROMPT)
    finally:
        llama.set_attn_implementation("hf_pagedkv")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert a.block_tables() != [] and b.retention_stats() == a.retention_stats()
    for c in (a, b):
        c.release()


def plain_global_budgets(scores: dict[int, torch.Tensor], keep: int, sink: int, recent: int) -> list[float]:
    """KVzip's ranking across layers written out plainly: per row, every (layer, head, token) score between the sinks
    and the recent tokens in one list; the best ``(keep - sink - recent) * pairs`` of them; each layer's share per
    head (its heads' mean over rows), plus the protected tokens."""
    layers = sorted(scores)
    rows, heads, n = scores[layers[0]].shape
    count = {layer: 0 for layer in layers}
    for r in range(rows):
        entries = [(scores[layer][r, h, t].item(), layer) for layer in layers for h in range(heads)
                   for t in range(sink, n - recent)]
        entries.sort(key=lambda e: -e[0])
        for _, layer in entries[: (keep - sink - recent) * len(layers) * heads]:
            count[layer] += 1
    return [sink + recent + count[layer] / (rows * heads) for layer in layers]


def test_global_layer_budgets_follow_the_ranking_across_layers_and_equal_the_head_masked_reference(llama):
    steps = [N, 5, 1, 3]  # the context, a multi-token question, decoding, a multi-token step
    x = ids(2, sum(steps), seed=22)
    policy = KVzip(budget=10, sink_tokens=1, recent_tokens=2, chunk_tokens=8,
                   scoring=KVzipScoring(layer_budgets="global"))
    assert policy.layer_tiers(3) == [0, 1, 2] and policy.is_tiered()
    cache = prefilled(llama, x[:, :N], policy)
    assert len(cache.retention.retention_tables()) == 3  # one layer group per full-attention layer
    scores = compress_context(llama, cache, x[:, :N], prompt_ids=PROMPT)
    want_scores = reference_kvzip_scores(llama, x[:, :N], PROMPT)
    wanted = plain_global_budgets(want_scores, 10, sink=1, recent=2)
    keeps = list(cache.retention_stats().tokens_held_per_layer)
    assert keeps == policy.score_budgets([[scores[i]] for i in range(3)], 10, N, B)
    assert len(set(keeps)) > 1  # the ranking gave the layers different budgets
    span = max(keeps)
    assert all((span - k) % B == 0 and k >= 4 for k in keeps)  # whole blocks below the widest; sinks + recent + 1
    assert sum(keeps) <= 3 * 10  # never more than the uniform budget's tokens
    assert all(abs(k - w) < B for k, w in zip(keeps, wanted))  # each layer near its share of the ranking
    # the blocks held are each layer's budget's, nothing more
    assert cache.pool.stats().blocks_in_use == sum(2 * num_blocks_for(k, B) for k in keeps)
    cache.check_invariants()
    got = run_steps(llama, x[:, N:], steps[1:], cache, before=lambda c, s, q: c.check_invariants())
    kept = {}
    for layer, k in enumerate(keeps):
        kept.update(reference_kvzip_kept({layer: want_scores[layer]}, k, sink=1, recent=2))
    want = kept_heads_reference(llama, x, N, kept)
    assert (got - want[:, N:]).abs().max() < CROSS_STEP_LOGIT_ATOL  # every step after the compression
    uniform = prefilled(llama, x[:, :N], KVzip(budget=10, sink_tokens=1, recent_tokens=2, chunk_tokens=8,
                                               scoring="plain"))
    compress_context(llama, uniform, x[:, :N], prompt_ids=PROMPT)
    other = run_steps(llama, x[:, N:], steps[1:], uniform)
    assert (got - other).abs().max() > 1e-3  # the budgets changed what attention saw
    stats = cache.retention_stats()
    assert stats.tokens_seen == sum(steps)
    assert list(stats.tokens_held_per_layer) == [k + sum(steps[1:]) for k in keeps]
    cache.check_invariants()
    for c in (cache, uniform):
        c.release()
        assert c.pool.stats().blocks_in_use == 0


def test_global_layer_budgets_stay_on_the_block_grid_within_the_uniform_total():
    policy = KVzip(budget=40, sink_tokens=4, recent_tokens=4, scoring=KVzipScoring(layer_budgets="global"))
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        held = 64 + trial * 7
        scores = [[torch.rand(2, 3, held, generator=g) ** (1 + 4 * t)] for t in range(5)]  # layers of other spreads
        keeps = policy.score_budgets(scores, 40, held, 16)
        span = max(keeps)
        assert span <= held and all((span - k) % 16 == 0 and 9 <= k <= span for k in keeps), keeps
        assert sum(keeps) <= 5 * 40, keeps
    uniform = KVzip(budget=40, scoring="plain")
    assert uniform.score_budgets(scores, 40, held, 16) is None  # uniform: the default tier budgets
    # AdaKV's safeguard: every head first keeps a share of its uniform budget; all of it gives the uniform budgets
    plain = policy.score_budgets(scores, 40, held, 16)
    guarded = KVzip(budget=40, sink_tokens=4, recent_tokens=4,
                    scoring=KVzipScoring(layer_budgets="global", safeguard=0.5))
    half = guarded.score_budgets(scores, 40, held, 16)
    full = KVzip(budget=40, sink_tokens=4, recent_tokens=4, scoring=KVzipScoring(layer_budgets="global", safeguard=1.0))
    assert len(set(plain)) > 1 and max(plain) - min(plain) >= max(half) - min(half)
    assert full.score_budgets(scores, 40, held, 16) == [40] * 5
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="safeguard"):
            KVzip(budget=40, scoring=KVzipScoring(layer_budgets="global", safeguard=bad))
    with pytest.raises(ValueError, match='layer_budgets="global"'):
        KVzip(budget=40, scoring=KVzipScoring(safeguard=0.5))  # it would do nothing


def test_global_layer_budgets_never_exceed_the_uniform_total_with_large_blocks():
    # blocks large against the layers' spread, so no tier can give a block back: a rounded-up span would keep 22
    # per layer where the uniform budget is 21 (and 14 + 14 for 11 + 11 below)
    policy = KVzip(budget=11, sink_tokens=3, recent_tokens=0, scoring=KVzipScoring(layer_budgets="global"))
    g = torch.Generator().manual_seed(0)
    scores = [[torch.rand(1, 2, 20, generator=g) ** (1 + 3 * t)] for t in range(2)]
    assert policy.score_budgets(scores, 11, 20, 16) == [11, 11]
    for trial in range(300):
        held, B = 24 + trial % 50, (4, 8, 16)[trial % 3]
        p = KVzip(budget=min(held - 1, 21 + trial % 7),
                  scoring=KVzipScoring(layer_budgets="global", safeguard=(0, 0.2, 0.5)[trial % 3]))
        keep = p.keep_for(held)
        scores = [[torch.rand(2, 2, held, generator=g) ** (1 + 3 * t)] for t in range(3)]
        keeps = p.score_budgets(scores, keep, held, B)
        assert sum(keeps) <= 3 * keep and all((max(keeps) - k) % B == 0 and 0 < k <= held for k in keeps), keeps
    with pytest.raises(ValueError, match="layer_budgets"):
        KVzip(budget=40, scoring=KVzipScoring(layer_budgets="per_head"))
    with pytest.raises(ValueError, match="config=model.config"):
        PagedCache(retention=KVzip(budget=40, scoring=KVzipScoring(layer_budgets="global")))


def test_presets_name_the_measured_settings_and_the_default_is_the_best():
    from hf_pagedkv.retention import KVZIP_PRESETS
    # the default: the passkey eval's best (docs/retention.md), ranked across layers, so its cache needs config=
    best = KVzip(compression_ratio=0.5)
    assert best.scoring == "weighted" and best.settings == KVZIP_PRESETS["weighted"]
    s = best.settings
    assert (s.kernel_size, s.pooling, s.layer_budgets, s.value_weighted, s.value_power) == (
        3, "avg", "global", True, 2.0)
    assert best.is_tiered() and best.layer_tiers(3) == [0, 1, 2]
    with pytest.raises(ValueError, match="config=model.config"):
        PagedCache(retention=best)
    plain = KVzip(compression_ratio=0.5, scoring="plain")  # Kim et al.'s: raw scores, one budget everywhere
    assert plain.settings == KVzipScoring()
    assert not plain.is_tiered() and plain.layer_tiers(3) == [0, 0, 0]
    glob = KVzip(compression_ratio=0.5, scoring="global")
    assert glob.settings == KVzipScoring(kernel_size=7, pooling="max", layer_budgets="global")
    # one spelling per setting: a KVzipScoring equal to a preset is that preset, so the policies compare equal
    spelled = KVzip(compression_ratio=0.5, scoring=KVzipScoring(kernel_size=7, layer_budgets="global"))
    assert spelled == glob and spelled.scoring == "global"
    custom = plain.with_scoring(kernel_size=5, pooling="avg")
    assert custom.scoring == KVzipScoring(kernel_size=5, pooling="avg") and custom.compression_ratio == 0.5
    assert glob.with_scoring(kernel_size=3, pooling="avg", value_weighted=True, value_power=2.0) == best
    for bad in ("best", "", None, 3, {"kernel_size": 3}):
        with pytest.raises(ValueError, match="`scoring` must be one of the presets"):
            KVzip(compression_ratio=0.5, scoring=bad)
    with pytest.raises(ValueError, match="kernel_size"):
        plain.with_scoring(kernel_size=4)
