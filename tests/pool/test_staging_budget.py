"""A quantized pool with `max_memory` holds its full-precision stages (each row's partial last block) inside the
budget: the bytes of every tensor it owns, stages and sinks included, stay within `max_memory`; a row that cannot
get a stage raises `PoolExhaustedError` with nothing changed; the serving engine runs a tight quantized budget to
the end within it."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import LlamaConfig

from hf_pagedkv import BlockPool, Engine, PagedCache
from hf_pagedkv.errors import PoolExhaustedError
from hf_pagedkv.pool.staging_budget import stage_capacity
from hf_pagedkv.storage.quantized_store import ROW_BLOCKS
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, run_checked, tiny_single_thread  # noqa: F401

CFG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64, vocab_size=96)
LAYERS, HEADS, DIM = 2, 2, 16
TOKEN = LAYERS * 2 * HEADS * DIM * 4  # one token, all layers, keys and values, fp32: 512 bytes
STAGE = 32 * TOKEN  # one stage of a 32-token block (the quantized default), all layers: 16 KiB
BUDGET = 136 * 1024  # 4 stages, each with ROW_BLOCKS (4) encoded blocks of 3.3-4.1 KiB, and the rest blocks


def tensor_bytes(pool: BlockPool) -> int:
    """Bytes of every tensor of every store of the pool: codes, scales, stages and sink stages."""
    return sum(t.nbytes for g in pool.groups for t in g.store.tensors())


def add_row(pool: BlockPool, tokens: int, seed: int, batch: int = 1) -> PagedCache:
    cache = PagedCache(pool=pool, config=CFG)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k = torch.randn(batch, HEADS, tokens, DIM, generator=g)
        cache.update(k, -k, layer)
    return cache


@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_many_short_rows_stay_within_max_memory_stages_included(quant):
    pool = BlockPool(quant=quant, max_memory=BUDGET, debug=True)
    caches = [add_row(pool, 5, seed=0)]  # sizes the pool: one stage per ROW_BLOCKS blocks, the rest blocks
    store = pool.groups[0].store
    per_block = sum(store.budget_block_bytes(spec) for spec in store.specs.values())  # codes, scales, a sink stage
    assert store.stage_capacity() == BUDGET // (STAGE + ROW_BLOCKS * per_block) == 4 and stage_capacity(pool) == 4
    assert pool.num_blocks == (BUDGET - 4 * STAGE) // per_block
    for i in range(1, 4):  # a 40-token row holds one encoded block and its partial last block (a stage)
        caches.append(add_row(pool, 40 if i % 2 else 5, seed=i))
    assert store.staging.num_used == 4
    s = pool.stats()
    assert s.bytes_reserved == tensor_bytes(pool) <= BUDGET
    assert s.bytes_in_use > s.blocks_in_use * s.bytes_per_block  # the stages in use are counted in use
    # a fifth row needs a stage none is left for: refused before anything changes
    before = (s.blocks_in_use, store.staging.num_used, store.sinks.num_used, tensor_bytes(pool))
    with pytest.raises(PoolExhaustedError, match=r"1 full-precision stage needed, 0 of 4 available"):
        add_row(pool, 5, seed=9)
    pool.check_invariants()
    s = pool.stats()
    assert (s.blocks_in_use, store.staging.num_used, store.sinks.num_used, tensor_bytes(pool)) == before
    # a batch of two rows with one stage free: refused whole
    caches.pop().release()
    with pytest.raises(PoolExhaustedError, match=r"2 full-precision stages needed, 1 of 4 available"):
        add_row(pool, 5, seed=10, batch=2)
    pool.check_invariants()
    assert store.staging.num_used == 3
    # decode every row past block boundaries: the pending stage of a completed block returns at the next step
    caches.append(add_row(pool, 5, seed=11))
    for t in range(70):
        for cache in caches:
            for layer in range(LAYERS):
                k = torch.randn(1, HEADS, 1, DIM)
                cache.update(k, -k, layer)
        assert tensor_bytes(pool) <= BUDGET
    pool.check_invariants()
    for cache in caches:
        cache.release()
    assert pool.stats().blocks_in_use == 0 and store.staging.num_used == 0
    assert pool.stats().bytes_reserved == tensor_bytes(pool) <= BUDGET


def test_a_budget_below_two_stages_and_a_block_is_refused():
    with pytest.raises(ValueError, match=r"max_memory=32768 bytes cannot hold a quantized pool: it needs at least "
                                         r"\d+ bytes, 2 full-precision stages of 32 tokens \(16384 bytes each"):
        add_row(BlockPool(quant="k8v4", max_memory=2 * STAGE), 5, seed=0)


def test_full_precision_and_unbudgeted_pools_have_no_stage_limit():
    assert stage_capacity(BlockPool(max_memory=BUDGET)) is None
    pool = BlockPool(quant="k8v4")  # growable: stages grow with the rows, as before
    caches = [add_row(pool, 5, seed=i) for i in range(9)]
    store = pool.groups[0].store
    assert store.stage_capacity() is None and store.staging.num_used == 9 and stage_capacity(pool) is None
    fixed = BlockPool(quant="k8v4", num_blocks=40)
    more = [add_row(fixed, 5, seed=i) for i in range(9)]
    assert fixed.groups[0].store.staging.num_used == 9
    for cache in caches + more:
        cache.release()


@pytest.mark.parametrize("quant", ["k8v4", "k4v4"])
def test_engine_finishes_every_request_within_a_tight_quantized_budget(quant, caplog):
    model = tiny_model("llama")  # 3 layers, 2 KV heads, head_dim 16, fp32: a 4-token stage is 3 KiB
    stage = 3 * 2 * 2 * 16 * 4 * BLOCK
    budget = 20 * stage  # 6 stages (a decoding request holds one, a prefilling one up to two), the rest blocks
    pool = BlockPool(block_size=BLOCK, quant=quant, max_memory=budget, debug=True)
    engine = Engine(model, pool, max_batch_tokens=16)
    prompts = [prompt(n, seed=700 + n) for n in (5, 9, 12, 17, 22, 3, 8, 14)]
    rids = [engine.add_request(p, max_new_tokens=9) for p in prompts]
    peak, steps, most = 0, 0, 0
    while engine.has_unfinished:
        engine.step()
        pool.check_invariants()
        peak = max(peak, tensor_bytes(pool), pool.stats().bytes_reserved)
        assert pool.groups[0].store.staging.num_used <= stage_capacity(pool) == 6
        most = max(most, pool.stats().num_sequences)
        steps += 1
        assert steps < 2000, "the engine made no progress"
    assert most >= 4  # decoding requests hold one stage each: more run at once than half the stages
    assert "interrupted" not in caplog.text  # no step ran out of stages (nor blocks) half-way
    outs = [engine.output(r) for r in rids]
    assert [len(o.generated_tokens) for o in outs] == [9] * len(prompts)
    assert all(o.error is None for o in outs)
    assert 0 < peak <= budget
    assert engine.stats().kv_bytes_peak <= budget
    assert pool.stats().blocks_in_use == 0


def test_requests_swapped_back_in_leave_the_stage_count_of_the_step_right(caplog):
    """With a host tier the engine swaps preempted requests out and back; a step that swaps one back in and then
    admits new ones counts the stages of both, so no step takes more stages than the budget holds."""
    model = tiny_model("llama")
    stage = 3 * 2 * 2 * 16 * 4 * BLOCK
    pool = BlockPool(block_size=BLOCK, quant="k8v4", max_memory=20 * stage, host_memory="1MiB", debug=True)
    engine = Engine(model, pool, max_batch_tokens=16)
    prompts = [prompt(n, seed=900 + n) for n in (5, 9, 12, 17, 22, 3, 8, 14, 6, 11)]
    rids = [engine.add_request(p, max_new_tokens=24) for p in prompts]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        pool.check_invariants()
        assert pool.groups[0].store.staging.num_used <= stage_capacity(pool)
        steps += 1
        assert steps < 2000, "the engine made no progress"
    assert engine.stats().num_preemptions > 0  # swapped out and back in
    assert "interrupted" not in caplog.text  # no step ran out of stages (nor blocks) half-way
    outs = [engine.output(r) for r in rids]
    assert all(o.error is None for o in outs) and [len(o.generated_tokens) for o in outs] == [24] * len(prompts)
    assert pool.stats().blocks_in_use == 0


def test_compaction_of_a_budgeted_quantized_pool_never_exceeds_its_stages():
    """A moved open block's stage is copied before the old one returns: with every stage in use, `compact` moves
    nothing in that group (all or nothing) instead of raising; with stages free it moves the blocks."""
    pool = BlockPool(quant="k8v4", max_memory=BUDGET, debug=True)
    store = pool.groups[0].store
    first, long, *late = [add_row(pool, n, seed=i) for i, n in enumerate((5, 100, 40, 40))]  # 1, 4, 2, 2 blocks
    long.release()  # 4 free ids below the late rows: compaction would move them down
    caches = [first, add_row(pool, 5, seed=9)]  # every stage in use again (one per row)
    assert store.staging.num_used == 4 and pool.stats().blocks_trapped > 0
    in_use = pool.stats().blocks_in_use
    assert pool.compact(100) == 0
    pool.check_invariants()
    assert tensor_bytes(pool) <= BUDGET and store.staging.num_used == 4 and pool.stats().blocks_in_use == in_use
    for cache in caches:
        cache.release()  # two stages free: the late rows' open blocks can be copied
    assert pool.compact(100) > 0
    pool.check_invariants()
    assert tensor_bytes(pool) <= BUDGET and store.staging.num_used == 2
    for cache in late:
        cache.release()


def test_generate_swaps_idle_caches_out_when_the_stages_are_exhausted():
    """`generate(swap_on_exhaustion=True)` treats a pool out of stages as any exhausted pool: idle caches go to the
    host tier (their stages return) and the request runs, with the output of an unbudgeted quantized pool."""
    import hf_pagedkv
    from tests.prefix_utils import GEN

    model = tiny_model("llama")
    stage = 3 * 2 * 2 * 16 * 4 * BLOCK  # 3 KiB: 20 of them buy 6 stages and 26 blocks
    pool = BlockPool(block_size=BLOCK, quant="k8v4", max_memory=20 * stage, host_memory="1MiB", debug=True)
    idle = []
    with torch.no_grad():
        for i in range(6):  # six idle caches, each with a partial last block: every stage in use
            cache = PagedCache(pool=pool, config=model.config)
            model(torch.tensor([prompt(5, seed=900 + i)]), past_key_values=cache)
            idle.append(cache)
    assert pool.groups[0].store.staging.num_used == 6 == stage_capacity(pool)
    x = torch.tensor([prompt(7, seed=950)])
    in_use = pool.stats().blocks_in_use
    with pytest.raises(PoolExhaustedError, match="full-precision stage"):
        hf_pagedkv.generate(model, x, pool=pool, **GEN)
    pool.check_invariants()
    assert pool.stats().blocks_in_use == in_use and pool.groups[0].store.staging.num_used == 6
    out = hf_pagedkv.generate(model, x, pool=pool, swap_on_exhaustion=True, **GEN)
    pool.check_invariants()
    assert any(cache.is_offloaded for cache in idle)
    ref = hf_pagedkv.generate(model, x, pool=BlockPool(block_size=BLOCK, quant="k8v4"), **GEN)
    assert torch.equal(out.sequences, ref.sequences)
    for cache in idle:
        cache.release()


@pytest.mark.parametrize("quant, batch", [("k8v4", 3), ("k4v4", 1), ("k8v4", 200)])
def test_plan_counts_the_stages_inside_the_quantized_budget(quant, batch):
    """`hf-pagedkv plan`'s max_memory for a quantized pool holds the planned blocks and two stages per row (at most
    the pool's 256), all inside it: pool_bytes is max_memory."""
    from hf_pagedkv.tools.planning import ModelShape, plan_capacity

    model = tiny_model("llama")
    plan = plan_capacity(ModelShape.from_config(model.config), max_seq_len=70, batch=batch, quant=quant,
                         dtype="float32")
    assert plan.pool_bytes == plan.pool_max_memory and plan.num_stages == min(256, max(2 * batch, plan.num_stages))
    assert plan.stage_bytes == 3 * 2 * 2 * 16 * 4 * 32  # a 32-token block of every layer in fp32
    pool = BlockPool(quant=quant, max_memory=plan.pool_max_memory)
    with PagedCache(pool=pool, config=model.config) as cache:
        model(torch.tensor([prompt(5, seed=1)]), past_key_values=cache)
        assert pool.num_blocks == plan.pool_blocks >= -(-70 // 32) * batch
        assert pool.groups[0].store.stage_capacity() == plan.num_stages >= min(2 * batch, 256)


@functools.lru_cache(maxsize=None)
def _head_dim_64_model():
    """A 2-layer Llama with SmolLM2's head shape (1 KV head of 64): quantized blocks as small as SmolLM2's, relative
    to a full-precision stage (fp32)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=128, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, vocab_size=96)
    return LlamaForCausalLM(config).eval()


def _run_budgeted(pool: BlockPool, prompts: list[list[int]], new: int) -> tuple[int, int, list]:
    """Step an engine on `pool` until every request is done, checking the budget after each step. Returns the most
    requests held at once, the steps, and the outputs."""
    engine = Engine(_head_dim_64_model(), pool, max_batch_tokens=128)
    rids = [engine.add_request(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
    most = steps = 0
    while engine.has_unfinished:
        engine.step()
        pool.check_invariants()
        assert pool.stats().bytes_reserved == tensor_bytes(pool) <= pool.max_memory
        most = max(most, pool.stats().num_sequences)
        steps += 1
        assert steps < 500, "the engine made no progress"
    assert engine.stats().num_preemptions == 0 or not pool.quant.is_quantized
    return most, steps, [engine.output(r) for r in rids]


def test_quantized_engine_runs_more_requests_at_once_than_full_precision_in_the_same_budget(caplog):
    """480 KiB hold 30 fp blocks of 16 tokens (three 150-200-token requests at once, with preemptions), or for k8v4
    7 stages and 34 encoded blocks of 32 tokens: six requests at once, none preempted, every one finished."""
    prompts = [prompt(n, seed=800 + n) for n in (150, 180, 120, 200, 160, 140, 170, 130)]
    budget = 480 * 1024
    fp_most, fp_steps, fp_outs = _run_budgeted(BlockPool(16, max_memory=budget, debug=True), prompts, 8)
    pool = BlockPool(quant="k8v4", max_memory=budget, debug=True)
    q_most, q_steps, q_outs = _run_budgeted(pool, prompts, 8)
    assert stage_capacity(pool) == 7 and pool.num_blocks == 34
    assert (fp_most, q_most) == (3, 6) and q_steps < fp_steps
    for outs in (fp_outs, q_outs):
        assert all(o.error is None and len(o.generated_tokens) == 8 for o in outs)
    assert "interrupted" not in caplog.text  # no step ran out of stages (nor blocks) half-way
    assert pool.stats().blocks_in_use == 0 and pool.groups[0].store.staging.num_used == 0
