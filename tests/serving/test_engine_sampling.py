"""Seeded sampling: each request draws from its own generator, so its tokens do not depend on the batch it runs in,
nor on preemption (its generator's state is kept while it waits to be recomputed)."""

import torch

from hf_pagedkv import BlockPool, Engine
from hf_pagedkv.serving.sampling import SamplingParams, sample
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, tiny_single_thread  # noqa: F401

NEW = 12
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)


def sampled(prompts, num_blocks, max_batch_tokens, seeds):
    pool = BlockPool(block_size=BLOCK, num_blocks=num_blocks, debug=True)
    engine = Engine(tiny_model("llama"), pool, max_batch_tokens=max_batch_tokens)
    rids = [engine.add_request(p, max_new_tokens=NEW, seed=s, **SAMPLING) for p, s in zip(prompts, seeds)]
    run_checked(engine)
    assert pool.stats().blocks_in_use == 0
    return [engine.output(r).generated_tokens for r in rids], engine.stats().num_preemptions


def test_seeded_sampling_is_the_same_with_and_without_preemption():
    prompts = [prompt(n, seed=n) for n in (5, 11, 16, 7, 20)]
    seeds = [1, 2, 3, 4, 5]
    free, p0 = sampled(prompts, None, 64, seeds)
    tight, p1 = sampled(prompts, 14, 7, seeds)
    assert p0 == 0 and p1 > 0
    assert tight == free
    alone = [sampled([p], None, 64, [s])[0][0] for p, s in zip(prompts, seeds)]
    assert alone == free  # and the same as each request run alone
    assert sampled(prompts, None, 64, [s + 10 for s in seeds])[0] != free  # other seeds, other tokens


def test_sample_warpers_follow_transformers():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(), None) == 4  # greedy
    # top_k=2 keeps ids 3 and 4 only
    draws = {sample(logits, SamplingParams(do_sample=True, top_k=2), g) for _ in range(200)}
    assert draws == {3, 4}
    # top_p: p(4) = 0.636, p(3) = 0.234 -> top_p 0.6 keeps only id 4, 0.8 keeps 3 and 4
    assert {sample(logits, SamplingParams(do_sample=True, top_p=0.6), g) for _ in range(100)} == {4}
    assert {sample(logits, SamplingParams(do_sample=True, top_p=0.8), g) for _ in range(300)} == {3, 4}
    # a high temperature flattens: every id shows up
    assert {sample(logits, SamplingParams(do_sample=True, temperature=50.0), g) for _ in range(300)} == set(range(5))
