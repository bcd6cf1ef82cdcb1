"""Continuous batching under tensor parallel: 2 CPU ranks (gloo) run the serving `Engine` on a tiny Llama loaded
with `tp_plan="auto"`, and make the same scheduling decisions and tokens as each other and as one process.

`tp_engine.py` (beside this file) is what each rank runs; it is launched once for the module with torchrun.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import tiny_model
from tests.integration import tp_engine as te
from tests.integration.tp_launch import WORLD_SIZE, skip_without_gloo, torchrun_ranks

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_engine.py")
TIMEOUT_S = 300  # about 30 s on a busy 2-core machine: two processes load the model and run the scenario once

pytestmark = skip_without_gloo


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Run `tp_engine.py` on 2 ranks with torchrun; return (model, [rank0, rank1] results)."""
    model = tiny_model("llama")  # 3 layers, 4 heads, 2 KV heads of head_dim 16, fp32
    assert model.config.num_key_value_heads % WORLD_SIZE == 0
    return model, torchrun_ranks(SCRIPT, model, tmp_path_factory.mktemp("tp_engine"), TIMEOUT_S)


@pytest.fixture(scope="module")
def one_process(tp_run):
    """The same `run_engine` scenario in this process (the whole model, 2 KV heads)."""
    model, _ = tp_run
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return te.run_engine(model)
    finally:
        torch.set_num_threads(before)


def test_ranks_make_identical_scheduling_decisions(tp_run):
    _, (r0, r1) = tp_run
    assert r0["hash_of_str"] != r1["hash_of_str"]  # each rank ran with its own PYTHONHASHSEED
    for run in ("engine", "batch"):
        steps = r0[run]["steps"]
        assert steps == r1[run]["steps"]  # every step: which requests, which tokens, who was preempted
        assert any(s["preempted"] for s in steps)  # the pool was small enough to preempt
        assert any(start > 0 and n > 1 for s in steps for _, start, n in s["chunks"])  # chunked prefill
        assert r0[run]["pool"]["events"] == r1[run]["pool"]["events"]  # the same block ids, in the same order
        assert {"allocate", "free"} <= {e["kind"] for e in r0[run]["pool"]["events"]}
        assert r0[run]["tokens"] == r1[run]["tokens"]
    assert r0["engine"]["stats"] == r1["engine"]["stats"]
    assert r0["engine"]["stats"]["num_preemptions"] >= 3
    assert r0["engine"]["finish"] == r1["engine"]["finish"]
    assert set(r0["engine"]["finish"].values()) == {"length", "stop"}  # one greedy request met the eos


def test_tokens_equal_one_process_engine_and_solo_generate(tp_run, one_process):
    model, results = tp_run
    # the fixed num_blocks pool counts blocks, not bytes: one process schedules exactly as each rank
    assert one_process["engine"]["steps"] == results[0]["engine"]["steps"]
    for res in results:
        assert res["engine"]["tokens"] == one_process["engine"]["tokens"]  # the sampled requests included
        assert res["batch"]["tokens"] == one_process["batch"]["tokens"]
        assert res["batch"]["errors"] == [None] * len(te.PROMPT_LENGTHS)
    tokens = results[0]["engine"]["tokens"]
    assert tokens["sampled"] != tokens[f"greedy_{te.PROMPT_LENGTHS[5]}"]  # (same prompt) it did sample
    solo = []
    with torch.inference_mode():
        for p in te.prompts(model.config.vocab_size):
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=te.MAX_NEW, eos_token_id=te.EOS,
                                 past_key_values=DynamicCache(config=model.config))
            solo.append(out[0, len(p):].tolist())
    assert [tokens[f"greedy_{n}"] for n in te.PROMPT_LENGTHS] == solo
    assert results[0]["batch"]["tokens"] == solo


def test_each_rank_sizes_its_pool_from_its_heads_and_frees_every_block(tp_run, one_process):
    model, results = tp_run
    cfg = model.config
    local_heads = cfg.num_key_value_heads // WORLD_SIZE
    per_block = cfg.num_hidden_layers * local_heads * 2 * cfg.head_dim * 4 * te.BLOCK_SIZE  # fp32: 1536 bytes
    for res in results:
        assert res["world_size"] == WORLD_SIZE
        for run in ("engine", "batch"):
            pool = res[run]["pool"]
            assert pool["kv_heads"] == [local_heads] * cfg.num_hidden_layers
            assert pool["bytes_per_block"] == per_block == 1536
            assert pool["blocks_in_use"] == pool["num_sequences"] == pool["bytes_in_use"] == 0
            assert pool["blocks_free"] == pool["num_blocks"]
        assert res["engine"]["pool"]["num_blocks"] == te.POOL_BLOCKS
        # max_memory buys each rank blocks of its own heads: twice as many as one process holding both heads
        assert res["batch"]["pool"]["num_blocks"] == te.MAX_MEMORY // per_block == 14
    assert one_process["batch"]["pool"]["num_blocks"] == te.MAX_MEMORY // (2 * per_block) == 7


def test_background_loop_warns_only_under_tensor_parallel(tp_run):
    model, results = tp_run
    for res in results:
        (message,) = res["start_warnings"]
        assert "world size 2" in message and "step from one thread" in message
    assert te.start_warnings(model) == []  # one process: no warning
