"""`hf_pagedkv.generate_batch`: transformers' `generate_batch` contract (inputs, output fields, request ids) on the
engine; outputs equal solo `generate`; a `max_memory` pool is sized before the first admission."""

import pytest
import torch
from transformers import GenerationConfig

import hf_pagedkv
from hf_pagedkv import BlockPool
from hf_pagedkv.serving import RequestOutput, RequestStatus
from tests.conftest import tiny_model
from tests.serving.engine_helpers import BLOCK, prompt, solo, tiny_single_thread  # noqa: F401


def test_outputs_mirror_transformers_and_equal_solo():
    model = tiny_model("llama")
    prompts = [prompt(n, seed=n) for n in (4, 13, 21)]
    config = GenerationConfig(max_new_tokens=7, do_sample=False, eos_token_id=2)  # the model's eos, as solo
    out = hf_pagedkv.generate_batch(model, prompts, config, pool=BlockPool(block_size=BLOCK, debug=True),
                                    max_batch_tokens=16, progress_bar=False)
    assert list(out) == ["req_0", "req_1", "req_2"]
    for (rid, o), p in zip(out.items(), prompts):
        assert isinstance(o, RequestOutput) and o.request_id == rid and o.prompt_ids == p
        assert o.status == RequestStatus.FINISHED and o.is_finished() and o.error is None
        assert o.generated_tokens == solo("llama", p, 7)
        assert len(o.timestamps) == 7 and o.timestamps == sorted(o.timestamps)
        assert o.created_time <= o.lifespan[0] <= o.timestamps[0] <= o.lifespan[1]


def test_max_length_default_and_a_too_large_request():
    model = tiny_model("llama")
    prompts = [prompt(6, 1), prompt(41, 2), prompt(8, 3)]
    pool = BlockPool(block_size=BLOCK, num_blocks=10, debug=True)  # 40 tokens
    config = GenerationConfig(max_length=14, do_sample=False, eos_token_id=2)  # max_new = 14 - prompt, >= 1
    out = hf_pagedkv.generate_batch(model, prompts, config, pool=pool, progress_bar=False)
    assert out["req_0"].generated_tokens == solo("llama", prompts[0], 8)
    assert out["req_2"].generated_tokens == solo("llama", prompts[2], 6)
    # 41 prompt tokens + 1 new: 41 tokens stored, 11 blocks of 4 > 10
    assert out["req_1"].status == RequestStatus.FAILED and "needs 11 KV blocks" in out["req_1"].error
    assert pool.stats().blocks_in_use == 0


def test_max_memory_pool_is_sized_before_admission():
    model = tiny_model("llama")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_key_value_heads * head_dim * 4 * BLOCK * cfg.num_hidden_layers  # K+V fp32, all layers
    pool = BlockPool(block_size=BLOCK, max_memory=12 * per_block)
    prompts = [prompt(n, seed=n) for n in (9, 14, 5)]
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=2)  # the keyword's 8 wins
    out = hf_pagedkv.generate_batch(model, prompts, config, pool=pool, progress_bar=False, max_new_tokens=8)
    assert pool.num_blocks == 12
    assert [o.generated_tokens for o in out.values()] == [solo("llama", p, 8) for p in prompts]


def test_bad_prompt_raises_before_anything_runs():
    pool = BlockPool(block_size=BLOCK, debug=True)
    with pytest.raises(ValueError, match="req_1.*empty"):
        hf_pagedkv.generate_batch(tiny_model("llama"), [[5, 6], []], pool=pool, progress_bar=False)
    assert pool.stats().blocks_in_use == 0 and pool.stats().lookups == 0


def test_a_dict_generation_config_changes_the_models_settings():
    model = tiny_model("llama")
    prompts = [prompt(7, 61), prompt(11, 62)]
    pool = BlockPool(block_size=BLOCK, debug=True)
    out = hf_pagedkv.generate_batch(model, prompts, {"max_new_tokens": 5}, pool=pool, progress_bar=False)
    assert [o.generated_tokens for o in out.values()] == [solo("llama", p, 5) for p in prompts]
    with pytest.raises(ValueError, match="no setting 'max_new_tokenz'"):
        hf_pagedkv.generate_batch(model, prompts, {"max_new_tokenz": 5}, pool=pool, progress_bar=False)
    assert pool.stats().blocks_in_use == 0


def test_num_return_sequences_gives_transformers_child_ids_sharing_the_prompt():
    model = tiny_model("llama")
    prompts = [prompt(2 * BLOCK + 1, 71), prompt(5, 72)]
    pool = BlockPool(block_size=BLOCK, prefix_caching=True, debug=True)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, top_k=0, eos_token_id=[], num_return_sequences=3)
    torch.manual_seed(0)
    out = hf_pagedkv.generate_batch(model, prompts, config, pool=pool, progress_bar=False)
    assert list(out) == ["req_0__child#0", "req_0__child#1", "req_0", "req_1__child#0", "req_1__child#1", "req_1"]
    for rid, o in out.items():
        assert o.prompt_ids == prompts[int(rid[4])] and len(o.generated_tokens) == 6 and o.error is None
    assert len({tuple(out[f"req_0{c}"].generated_tokens) for c in ("__child#0", "__child#1", "")}) > 1  # own seeds
    assert pool.stats().hit_tokens >= 2 * 2 * BLOCK  # two of the first prompt's copies attached to its 2 full blocks
    assert pool.stats().blocks_in_use == 0


def test_beam_search_is_refused_by_name_before_anything_runs():
    pool = BlockPool(block_size=BLOCK, debug=True)
    with pytest.raises(ValueError, match="num_beams=3.*PagedCache"):
        hf_pagedkv.generate_batch(tiny_model("llama"), [[5, 6]], GenerationConfig(num_beams=3, max_new_tokens=2),
                                  pool=pool, progress_bar=False)
    with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1"):
        hf_pagedkv.generate_batch(tiny_model("llama"), [[5, 6]], {"num_return_sequences": 0}, pool=pool,
                                  progress_bar=False)
    assert pool.stats().blocks_in_use == 0 and pool.stats().lookups == 0
