"""The prefix-index key: a model's weights and the pool's storage format decide it, so two models (or two formats)
never share prefix blocks, while copies of the same weights do."""

from __future__ import annotations

import copy

import torch

import hf_pagedkv
from hf_pagedkv import BlockPool
from hf_pagedkv.pool.fingerprint import model_fingerprint, prefix_key
from tests.conftest import _tiny, ids
from tests.prefix_utils import assert_same_output, fresh_generate, tiny_single_thread  # noqa: F401 (autouse)

B = 4
_MODELS: dict[int, torch.nn.Module] = {}


def llama(seed: int):
    """A tiny random Llama (the conftest one), initialised from `seed`: same config, different weights per seed."""
    if seed not in _MODELS:
        torch.manual_seed(seed)
        _MODELS[seed] = _tiny("llama")
    return _MODELS[seed]


def run(model, pool, x):
    """hf_pagedkv.generate on the shared pool; returns (output, tokens the lookup hit)."""
    before = pool.stats().hit_tokens
    out = hf_pagedkv.generate(model, x, pool=pool, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                              output_logits=True)
    pool.check_invariants()
    return out, pool.stats().hit_tokens - before


def test_same_config_different_weights_never_share_prefix_blocks():
    a, b = llama(1), llama(2)
    assert a.config.to_json_string() == b.config.to_json_string()  # only the weights tell them apart
    assert model_fingerprint(a) != model_fingerprint(b)
    pool = BlockPool(block_size=B, prefix_caching=True, debug=True)
    x = ids(1, 14, seed=3)  # 13 tokens are hashed (one is always computed): 3 full blocks, 12 tokens

    out_a, hit = run(a, pool, x)
    assert hit == 0
    published = pool.groups[0].prefix_index.num_published_blocks
    assert published == 4  # the 3 prompt blocks and one more of prompt + generated tokens (18 cached tokens)

    out_b, hit = run(b, pool, x)
    assert hit == 0  # the same tokens, another model: nothing of A's may be read
    assert_same_output(fresh_generate(b, x, max_new_tokens=5), out_b, tol=0.0)  # same steps: bit for bit
    assert not torch.equal(out_a.sequences, out_b.sequences)  # (so a wrong hit would have shown in the tokens)
    assert pool.groups[0].prefix_index.num_published_blocks == 2 * published  # B published its own copies

    out_a2, hit = run(a, pool, x)
    assert hit == 3 * B  # A still finds its own blocks
    assert_same_output(fresh_generate(a, x, max_new_tokens=5), out_a2)  # the hit computes 2 tokens in a step
    assert torch.equal(out_a2.sequences, out_a.sequences)
    assert pool.stats().blocks_in_use == 0


def test_copies_of_the_same_weights_have_the_same_fingerprint():
    a = llama(1)
    assert model_fingerprint(copy.deepcopy(a)) == model_fingerprint(a)
    torch.manual_seed(1)
    rebuilt = _tiny("llama")  # a new object with the same weights (same seed)
    assert rebuilt is not a and model_fingerprint(rebuilt) == model_fingerprint(a)
    assert model_fingerprint(a) == model_fingerprint(a)  # and stable for one object
    assert len(model_fingerprint(a)) == 20


def test_an_in_place_weight_change_changes_the_fingerprint():
    model = copy.deepcopy(llama(1))
    first = model_fingerprint(model)
    weight = model.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        weight.add_(1e-3)  # bumps the parameter's version counter: the cached digest is stale
    second = model_fingerprint(model)
    assert second != first
    with torch.no_grad():
        model.model.norm.weight[5] = 1.5  # one element of one parameter is enough
    assert model_fingerprint(model) not in (first, second)


def test_a_replaced_parameter_or_data_changes_the_fingerprint():
    """Swapping a tensor in, rather than writing into it, leaves the version counter alone (a new Parameter starts
    at version 0 again, and `p.data = t` keeps p's counter): the fingerprint must notice anyway."""
    model = copy.deepcopy(llama(1))
    first = model_fingerprint(model)
    proj = model.model.layers[0].self_attn.v_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach() * 2)  # a fresh Parameter, version 0 like the old one
    assert proj.weight._version == 0
    second = model_fingerprint(model)
    assert second != first
    old = proj.weight._version
    proj.weight.data = proj.weight.detach() + 1  # `.data =` does not bump the version
    assert proj.weight._version == old
    assert model_fingerprint(model) not in (first, second)


def test_prefix_key_separates_storage_formats_and_models():
    a, b = llama(1), llama(2)
    fp, fp2 = BlockPool(prefix_caching=True), BlockPool(block_size=8, prefix_caching=True)
    k8v4, k4v4 = BlockPool(prefix_caching=True, quant="k8v4"), BlockPool(prefix_caching=True, quant="k4v4")
    assert prefix_key(fp, a) == prefix_key(fp2, a)  # the block size is in the hashes' chunking, not the key
    assert prefix_key(fp, a) != prefix_key(k8v4, a)  # quantized blocks hold other K/V than full-precision ones
    assert prefix_key(k8v4, a) != prefix_key(k4v4, a)
    assert prefix_key(k8v4, a) == prefix_key(BlockPool(prefix_caching=True, quant="k8v4"), copy.deepcopy(a))
    assert prefix_key(fp, a) != prefix_key(fp, b)
    # a config alone identifies the model only by its config: A and B collide there, hence `model=` in the docs
    assert prefix_key(fp, config=a.config) == prefix_key(fp, config=b.config) != prefix_key(fp, a)
    assert len(prefix_key(fp, a)) == 16


def test_a_quantized_pool_and_a_full_precision_pool_publish_under_different_hashes():
    """One model, one prompt, published in a full-precision and a quantized pool: each pool's index is keyed by its
    format, so the same hashes are not in the other one (a shared index would otherwise serve quantized K/V)."""
    a = llama(1)
    x = ids(1, 14, seed=3)
    fp, q = BlockPool(block_size=B, prefix_caching=True), BlockPool(block_size=B, prefix_caching=True, quant="k8v8")
    run(a, fp, x)
    run(a, q, x)
    fp_hashes = set(fp.groups[0].prefix_index.published().values())
    q_hashes = set(q.groups[0].prefix_index.published().values())
    assert len(fp_hashes) == len(q_hashes) == 4 and not fp_hashes & q_hashes
