"""Tensor parallel for real: 2 CPU processes (gloo) load a tiny Llama with `tp_plan="auto"`, generate with PagedCache.

`tp_generate.py` (beside this file) is what each rank runs; here it is launched with torchrun and its per-rank results
are compared with each other and with one process running the same generations through `DynamicCache`.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_pagedkv.tools.planning import ModelShape, plan_capacity
from tests.conftest import tiny_model
from tests.integration import tp_generate as tp
from tests.integration.tp_launch import WORLD_SIZE, skip_without_gloo, torchrun_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_generate.py")
TIMEOUT_S = 300  # about 30 s on a busy 2-core machine: two processes load the model and run the scenarios twice

pytestmark = skip_without_gloo


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Save the tiny Llama, run `tp_generate.py` on 2 ranks with torchrun, return (model, [rank0, rank1] results)."""
    model = tiny_model("llama")  # 3 layers, 4 heads, 2 KV heads of head_dim 16, fp32
    assert model.config.num_key_value_heads % WORLD_SIZE == 0
    results = torchrun_ranks(SCRIPT, model, tmp_path_factory.mktemp("tp"), TIMEOUT_S)
    return model, results


@pytest.fixture(scope="module")
def reference(tp_run):
    """The same scenarios in one process, through DynamicCache."""
    from transformers import DynamicCache

    model, _ = tp_run
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tp.run_scenarios(model, lambda name: DynamicCache(config=model.config))
    finally:
        torch.set_num_threads(before)


def test_each_rank_sizes_its_pool_from_its_own_kv_heads(tp_run):
    model, results = tp_run
    cfg = model.config
    local_heads = cfg.num_key_value_heads // WORLD_SIZE  # 1 of the config's 2
    per_block = cfg.num_hidden_layers * local_heads * (2 * cfg.head_dim) * 4 * tp.BLOCK_SIZE  # 3*1*32*4*4 = 1536
    for res in results:
        assert res["world_size"] == WORLD_SIZE
        for name in ("greedy", "beams"):
            assert res[name]["kv_heads"] == [local_heads] * cfg.num_hidden_layers
            assert res[name]["bytes_per_block"] == per_block == 1536
        # max_memory is this rank's budget for its own heads: 100,000 // 1536 = 65 blocks (sizing from the config's
        # num_key_value_heads would give 100,000 // 3072 = 32)
        assert res["greedy"]["num_blocks"] == tp.MAX_MEMORY // per_block == 65
    # `hf-pagedkv plan --tp 2` counts what each rank's pool holds
    plan = plan_capacity(ModelShape.from_config(cfg), max_seq_len=8, batch=1, block_size=tp.BLOCK_SIZE,
                         dtype="float32", tp=WORLD_SIZE)
    assert plan.kv_heads_per_rank == local_heads and plan.bytes_per_token * tp.BLOCK_SIZE == per_block


def test_tp_generation_equals_single_process_dynamic_cache(tp_run, reference):
    _, results = tp_run
    ref_logits = reference["greedy_logits"]  # [MAX_NEW, batch, vocab]
    # NOTE: the TP ranks compute o_proj and down_proj as two partial sums joined by an all-reduce, so the fp32
    # logits differ from one process's in the last bits (reordered sums; measured: 1.2e-7 at |logits| <= 0.52,
    # about 2 ulps). The tolerance is 64 fp32 unit roundoffs (2**-24) times max(1, largest |logit|): 3.8e-6 here.
    tol = 64 * 2**-24 * max(1.0, ref_logits.abs().max().item())
    top2 = ref_logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 10 * tol  # so a TP rounding difference cannot flip a greedy token
    diff = max((res["greedy_logits"] - ref_logits).abs().max().item() for res in results)
    print(f"TP ranks vs one process: max |logit difference| {diff:.2g} (max |logit| "
          f"{ref_logits.abs().max().item():.2g}, tolerance {tol:.2g})")  # what docs/results.md quotes (pytest -s)
    for res in results:
        assert res["dynamic_equal"] == {"greedy_sequences": True, "greedy_logits": True, "beam_sequences": True}
        assert torch.equal(res["greedy_sequences"], reference["greedy_sequences"])
        assert torch.equal(res["beam_sequences"], reference["beam_sequences"])
        assert res["greedy_logits"].shape == ref_logits.shape == (tp.MAX_NEW, 2, ref_logits.shape[-1])
        torch.testing.assert_close(res["greedy_logits"], ref_logits, rtol=0, atol=tol)
    assert torch.equal(results[0]["greedy_logits"], results[1]["greedy_logits"])  # gathered: the same on each rank


def test_ranks_make_the_same_allocation_decisions(tp_run):
    _, (r0, r1) = tp_run
    assert r0["hash_of_str"] != r1["hash_of_str"]  # each rank ran with its own PYTHONHASHSEED
    for name in ("greedy", "beams"):
        assert r0[name]["tables"] == r1[name]["tables"] and r0[name]["tables"]
        assert r0[name]["num_blocks"] == r1[name]["num_blocks"]
        kinds = {e["kind"] for e in r0[name]["events"]}
        assert {"allocate", "free"} <= kinds  # a real log, not an empty one
        assert r0[name]["events"] == r1[name]["events"]  # every allocate/fork/free/cow, with block ids, in order
    assert "fork" in {e["kind"] for e in r0["beams"]["events"]}


def test_prefix_caching_hits_and_evicts_alike_on_every_rank(tp_run):
    model, (r0, r1) = tp_run
    with torch.inference_mode():
        plain = [model.generate(torch.tensor([r]), do_sample=False, max_new_tokens=tp.MAX_NEW)[0].tolist()
                 for r in tp.PREFIX_REQUESTS]
    for res in (r0, r1):
        assert res["prefix"]["sequences"] == plain
        assert res["prefix"]["hit_tokens"] > 0 and res["prefix"]["evictions"] > 0
    assert r0["prefix"]["events"] == r1["prefix"]["events"]
    assert {"hit", "publish", "evict"} <= {e["kind"] for e in r0["prefix"]["events"]}
