"""A model split over two devices with `device_map`: PagedCache keeps each layer's blocks on that layer's device, sizes
`max_memory` over both, and generates exactly what `DynamicCache` does on the same model.

The two-GPU case needs two CUDA devices; the CPU case runs the same test with both halves on the CPU (one device, so
it checks the loading, the outputs and the budget arithmetic, not the placement). `tests/storage/test_device_budget.py`
checks the placement and the per-device refusal on the CPU alone, with ``cpu`` and ``meta`` as the two devices.
"""

from __future__ import annotations

import pytest
import torch

from hf_pagedkv import PagedCache
from hf_pagedkv.storage.device_budget import device_shares
from tests.conftest import ids, tiny_model

BLOCK_SIZE = 4
MAX_MEMORY = 60_000  # bytes: 19 blocks of the tiny Llama's 3 layers (3,072 bytes a block)

TWO_GPUS = pytest.param(
    ("cuda:0", "cuda:1"), id="two-gpus",
    marks=[pytest.mark.gpu, pytest.mark.skipif(
        torch.cuda.device_count() < 2,
        reason=f"needs two CUDA devices to split the layers with device_map; this machine has "
               f"{torch.cuda.device_count()}")],
)


@pytest.mark.parametrize("devices", [pytest.param(("cpu", "cpu"), id="cpu"), TWO_GPUS])
def test_device_map_split_layers(devices, tmp_path):
    from transformers import AutoModelForCausalLM, DynamicCache

    first, second = devices
    tiny_model("llama").save_pretrained(tmp_path)  # 3 layers, 2 KV heads of head_dim 16, fp32
    # what device_map="auto" produces when the model does not fit one device: layer 0 on the first, 1-2 on the second
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "model.layers.0": first,
                  "model.layers.1": second, "model.layers.2": second, "model.norm": second, "lm_head": second}
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map=device_map, dtype=torch.float32).eval()
    x = ids(2, 9).to(first)
    gen = {"do_sample": False, "max_new_tokens": 8, "return_dict_in_generate": True, "output_logits": True}
    cache = PagedCache(block_size=BLOCK_SIZE, config=model.config, max_memory=MAX_MEMORY, debug=True)
    with torch.inference_mode():
        out = model.generate(x, past_key_values=cache, **gen)
        ref = model.generate(x, past_key_values=DynamicCache(config=model.config), **gen)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))  # the same forward steps: bit-identical

    pool = cache.pool
    layer_devices = [torch.device(first), torch.device(second), torch.device(second)]
    assert [pool.groups[0].store.keys[i].device for i in range(3)] == layer_devices
    assert [pool.groups[0].store.values[i].device for i in range(3)] == layer_devices
    per_layer_block = 2 * (16 + 16) * 4 * BLOCK_SIZE  # KV heads x (key_dim + value_dim) x fp32 x tokens = 1024 B
    assert pool.num_blocks == MAX_MEMORY // (3 * per_layer_block) == 19
    shares = device_shares(pool.groups[0].store.specs.values(), pool.groups[0].store.block_bytes, pool.num_blocks)
    if first == second:
        assert shares == {torch.device(first): 3 * 19 * per_layer_block}
    else:  # one layer's blocks on the first device, two layers' on the second
        assert shares == {torch.device(first): 19 * per_layer_block, torch.device(second): 2 * 19 * per_layer_block}
    with torch.inference_mode():
        cache.release()
    pool.check_invariants()
