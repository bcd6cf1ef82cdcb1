"""Capacity planner and block-size tuner (hf_pagedkv/tools/planning.py)."""

from __future__ import annotations

import json

import pytest
from transformers import Gemma2Config, LlamaConfig

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv.tools.planning import (
    ModelShape,
    kv_bytes_per_head_token,
    load_config,
    plan_capacity,
    tune_block_size,
)
from tests.conftest import ids, tiny_model

GiB, KiB = 2**30, 2**10


def test_textbook_7b_example():
    # 32 layers, 32 KV heads, head_dim 128, fp16 -> 512 KiB per token; 4096 tokens x batch 16 -> 32 GiB
    config = LlamaConfig(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, hidden_size=4096)
    shape = ModelShape.from_config(config, "7B")
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.num_sliding) == (32, 32, 128, 0)
    plan = plan_capacity(shape, max_seq_len=4096, batch=16, dtype="float16", memory=80 * GiB)
    assert plan.bytes_per_token == 512 * KiB
    assert plan.kv_bytes == 32 * GiB == plan.window_kv_bytes
    assert plan.seq_bytes == 2 * GiB
    assert plan.pool_blocks == 4096 // 16 * 16 * 12 // 10 + 1  # ceil(4096 blocks x 1.2)
    assert plan.block_bytes == 16 * 512 * KiB
    assert plan.pool_bytes == plan.pool_max_memory == plan.pool_blocks * 16 * 512 * KiB  # whole blocks
    assert shape.num_params == 6_738_415_616  # LlamaConfig's defaults are Llama-2-7B
    assert plan.weight_bytes == 2 * 6_738_415_616
    assert plan.fits and not plan_capacity(shape, 4096, 16, memory=40 * GiB).fits


def test_byte_formula_per_head_token():
    assert kv_bytes_per_head_token(64, dtype_bytes=2) == 256  # fp16: (64 + 64) x 2
    assert kv_bytes_per_head_token(64, dtype_bytes=4) == 512
    # k8v4, B=16, value groups of 32: keys 64 + one fp16 scale per channel 64*2/16 = 72 (int8 is symmetric);
    # values 32 + 2 groups * (scale + minimum) 4 = 40
    assert kv_bytes_per_head_token(64, 8, 4, block_size=16, value_group_size=32) == 112
    assert kv_bytes_per_head_token(64, None, 8, block_size=16, value_group_size=64) == 128 + 64 + 2
    assert kv_bytes_per_head_token(128, 2, 2, block_size=32, value_group_size=32) == (32 + 16) + (32 + 16)
    with pytest.raises(ValueError, match="`key_bits` must be None"):
        kv_bytes_per_head_token(64, 3, 4)
    with pytest.raises(ValueError, match="`block_size` must be a positive int"):
        kv_bytes_per_head_token(64, 8, 8, block_size=0)


def test_quantized_plan_keeps_the_partial_block_in_full_precision():
    shape = ModelShape("m", num_layers=2, num_sliding=0, sliding_window=None, num_kv_heads=3, head_dim=64,
                       num_params=None)
    plan = plan_capacity(shape, max_seq_len=17, batch=2, quant="k8v4", block_size=16, value_group_size=32)
    # one full block quantized (112 B per head-token); the 1-token partial block holds its encoded slot and a whole
    # fp16 stage; the sink token (the first) is also kept in fp16
    assert plan.seq_bytes == 2 * 3 * 16 * (112 + 112 + 256) + 2 * 3 * 256
    assert plan.kv_bytes == 2 * plan.seq_bytes
    assert plan.bytes_per_token == 2 * 3 * 112
    assert plan_capacity(shape, max_seq_len=17, batch=2, quant="k8v4").block_size == 32  # PagedCache's default
    assert plan.weight_bytes is None and plan.fits is None


def test_sliding_window_layers():
    config = Gemma2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    shape = ModelShape.from_config(config)
    assert (shape.num_layers, shape.num_sliding, shape.sliding_window, shape.head_dim) == (4, 2, 8, 16)
    plan = plan_capacity(shape, max_seq_len=64, batch=1, block_size=4, dtype="float32")
    per_layer_token = 2 * 16 * 2 * 4  # K+V x head_dim x heads x fp32
    # full layers: 64 tokens; sliding layers: the window's 2 blocks (tokens 56..63), exactly the window here
    assert plan.kv_bytes == (2 * 64 + 2 * 8) * per_layer_token
    assert plan.window_kv_bytes == (2 * 64 + 2 * 8) * per_layer_token


@pytest.mark.parametrize("n", [63, 64, 65])
def test_sliding_window_plan_matches_what_a_paged_cache_holds(n):
    """After a decode step, a sliding row holds the blocks from the one holding token n - 8 on: what the planner
    counts, to the byte."""
    model = tiny_model("gemma2")  # window 8, layers 0 and 2 sliding
    cache = PagedCache(block_size=4, config=model.config)
    model.generate(ids(1, n - 4), past_key_values=cache, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert cache.get_seq_length() == n
    plan = plan_capacity(ModelShape.from_config(model.config), max_seq_len=n, batch=1, block_size=4, dtype="float32")
    assert cache.pool.stats().bytes_in_use == plan.kv_bytes
    cache.release()


def test_plan_matches_what_a_paged_cache_holds():
    model = tiny_model("llama")
    shape = ModelShape.from_config(model.config)
    assert shape.num_params == model.num_parameters()
    plan = plan_capacity(shape, max_seq_len=21, batch=3, block_size=4, dtype="float32")
    pool = BlockPool(block_size=4)
    with PagedCache(pool=pool) as cache:
        model(ids(3, 21), past_key_values=cache)
        assert pool.stats().bytes_in_use == plan.kv_bytes
        assert plan.bytes_per_token * 4 == pool.stats().bytes_per_block


@pytest.mark.parametrize("quant", ["v8", "k8v8", "k8v4", "k4v4", "k4v2", "k2v2", "k4v4r", "k8v4rv", "k3v3rv",
                                   "k4ve4m3", "ke5m2ve4m3b"])
def test_quantized_plan_matches_what_the_quantized_store_holds(quant):
    """The planner counts what the store holds: codes, scales, partial blocks and sink tokens, to the byte."""
    model = tiny_model("llama")
    plan = plan_capacity(ModelShape.from_config(model.config), max_seq_len=70, batch=3, quant=quant, dtype="float32")
    with PagedCache(quant=quant) as cache:  # 32-token blocks: 2 encoded + 1 partial per row
        model(ids(3, 70), past_key_values=cache)
        stats = cache.pool.stats()
        assert stats.bytes_in_use == plan.kv_bytes
        assert plan.bytes_per_token * stats.block_size == stats.bytes_per_block


@pytest.mark.parametrize("quant", ["k4v4", {"sliding": None, "full": "k4v4"}, {"sliding": "k8v8", "full": "fp"}])
def test_per_group_plan_matches_what_the_pool_holds(quant):
    """Each kind of layer group counted in its own format, after sliding rows dropped blocks: to the byte."""
    model = tiny_model("gemma2")  # window 8, layers 0 and 2 sliding
    plan = plan_capacity(ModelShape.from_config(model.config), max_seq_len=70, batch=2, quant=quant, dtype="float32")
    assert plan.block_size == 32
    with PagedCache(quant=quant, config=model.config) as cache:
        model.generate(ids(2, 65), past_key_values=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert cache.get_seq_length() == 70
        stats = cache.pool.stats()
        assert stats.bytes_in_use == plan.kv_bytes
        assert stats.bytes_per_block == plan.block_bytes == plan.bytes_per_token * 32
    fp = plan_capacity(ModelShape.from_config(model.config), 70, 2, dtype="float32", block_size=32)
    k4 = plan_capacity(ModelShape.from_config(model.config), 70, 2, quant="k4v4", dtype="float32")
    if quant == {"sliding": None, "full": "k4v4"}:  # half the layers in each format
        assert plan.quant == "sliding=fp,full=k4v4"
        assert plan.block_bytes == (fp.block_bytes + k4.block_bytes) // 2


def test_bad_plan_arguments():
    shape = ModelShape("m", 1, 0, None, 1, 8, None)
    with pytest.raises(ValueError, match="`batch` must be a positive int, got 0"):
        plan_capacity(shape, 16, 0)
    with pytest.raises(ValueError, match="Unknown quantization preset 'k5v5'; use one of fp, v8, k8v8"):
        plan_capacity(shape, 16, 1, quant="k5v5")
    assert plan_capacity(shape, 16, 1, quant="K3V3").quant == "k3v3"  # any preset QuantConfig.preset takes
    with pytest.raises(ValueError, match="unknown layer-group key 'slide'; the keys are 'sliding', 'full'"):
        plan_capacity(shape, 16, 1, quant={"slide": "fp"})
    with pytest.raises(ValueError, match=r"quant\['full'\]='k5v5': give None or a preset name \(Unknown"):
        plan_capacity(shape, 16, 1, quant={"full": "k5v5"})
    with pytest.raises(ValueError, match="`dtype` must be one of"):
        plan_capacity(shape, 16, 1, dtype="int8")


def test_load_config_forms(tmp_path):
    config = LlamaConfig(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    config.save_pretrained(tmp_path)
    for source in (str(tmp_path), str(tmp_path / "config.json")):
        loaded = load_config(source)
        assert (loaded.num_hidden_layers, loaded.num_key_value_heads) == (3, 2)
    assert load_config("llama").num_hidden_layers == 32
    with pytest.raises(ValueError, match="could not read a config"):
        load_config(str(tmp_path / "missing-model"))
    (tmp_path / "broken.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="could not read a config"):
        load_config(str(tmp_path / "broken.json"))


def test_tune_block_size():
    rows, best, reason = tune_block_size([100, 200, 33, 17], candidates=(4, 8, 16, 32))
    by_size = {r.block_size: r for r in rows}
    # B=16: 7 + 13 + 3 + 2 = 25 blocks = 400 slots for 350 tokens
    assert by_size[16].fragmentation == pytest.approx(50 / 400)
    assert by_size[16].mean_entries == 25 / 4 and by_size[16].max_entries == 13
    assert by_size[8].fragmentation == pytest.approx(1 - 350 / (8 * (13 + 25 + 5 + 3)))
    assert best == 8 and "16 would waste 12.5%" in reason
    # sequences of exact multiples of 128 waste nothing at any size: the largest wins
    assert tune_block_size([128, 256, 1024])[1] == 128
    # 3-token sequences: nothing reaches 5%, the smallest candidate is recommended
    rows, best, reason = tune_block_size([3, 3, 3])
    assert best == 4 and "no candidate" in reason
    with pytest.raises(ValueError, match="empty"):
        tune_block_size([])
    with pytest.raises(ValueError, match="positive ints"):
        tune_block_size([10, 0])
