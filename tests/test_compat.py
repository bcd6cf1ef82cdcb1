"""Contract test: PagedCache/PagedLayer answer the transformers Cache API exactly as DynamicCache/DynamicLayer do.

This covers every piece of transformers behaviour `_compat.py` and the cache rely on, so a transformers upgrade that
changes it fails here first.
"""

import inspect
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_pagedkv import BlockPool, PagedCache
from hf_pagedkv._compat import (CACHE_KWARG, CACHE_KWARG_NAMES, PAST_RECORDING_KWARGS, TRANSFORMERS_VERSION, DummyLayer,
                                cache_kwargs, layer_plan, seq_length_layer_idx)
from tests.conftest import VOCAB, ids, tiny_model

GEMMA = Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=4, sliding_window=6)


def test_layer_plan_reads_layer_types_and_windows():
    assert layer_plan(GEMMA) == [("sliding_attention", 6), ("full_attention", None)] * 2
    llama = LlamaConfig(num_hidden_layers=3)
    assert layer_plan(llama) == [("full_attention", None)] * 3


def test_layer_plan_rejects_unsupported_layer_types_by_name():
    cfg = LlamaConfig(num_hidden_layers=2)
    cfg.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="'linear_attention'.*layer 1"):
        PagedCache(config=cfg)


def _kv(batch, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, n, 4, generator=g), torch.randn(batch, 1, n, 4, generator=g)


def _assert_same(paged, dyn, steps):
    for idx in range(len(dyn.layers)):
        pl, dl = paged.layers[idx], dyn.layers[idx]
        assert pl.get_seq_length() == dl.get_seq_length()
        assert pl.get_max_length() == dl.get_max_length()
        assert pl.is_sliding == dl.is_sliding
        for q in (1, 3):
            assert pl.get_mask_sizes(q) == dl.get_mask_sizes(q), (idx, q, steps)
        assert paged.get_mask_sizes(2, idx) == dyn.get_mask_sizes(2, idx)
    assert paged.get_seq_length() == dyn.get_seq_length()
    assert paged.is_sliding == dyn.is_sliding


@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_same_answers_as_dynamic_cache_through_the_cache_api(block_size):
    paged = PagedCache(block_size=block_size, config=GEMMA, debug=True)
    dyn = DynamicCache(config=GEMMA)
    batch = 2
    steps = [5, 1, 1, 3, 1, 1, 1, 2]  # prefill, decode across the window (6) and several blocks, a chunk
    for s, n in enumerate(steps):
        for idx in range(4):
            k, v = _kv(batch, n, seed=100 * s + idx)
            pk, pv = paged.update(k, v, idx)
            dk, dv = dyn.update(k, v, idx)
            assert torch.equal(pk, dk) and torch.equal(pv, dv), (s, idx)
        _assert_same(paged, dyn, s)
    # Full-attention layers expose their whole K/V like DynamicLayer; sliding ones the last window - 1 tokens, too.
    assert torch.equal(paged.layers[1].keys, dyn.layers[1].keys)
    assert torch.equal(paged.layers[0].values, dyn.layers[0].values)
    # Beam reordering and batch selection, then one more step.
    for op, arg in (("reorder_cache", torch.tensor([1, 1])), ("batch_repeat_interleave", 2),
                    ("batch_select_indices", torch.tensor([0, 3, 2]))):
        getattr(paged, op)(arg)
        getattr(dyn, op)(arg)
        n_rows = 4 if op == "batch_repeat_interleave" else (3 if op == "batch_select_indices" else 2)
        for idx in range(4):
            k, v = _kv(n_rows, 1, seed=7 + idx)
            pk, pv = paged.update(k, v, idx)
            dk, dv = dyn.update(k, v, idx)
            assert torch.equal(pk, dk) and torch.equal(pv, dv), (op, idx)
        _assert_same(paged, dyn, op)
    # crop: DynamicCache's sliding layers cannot crop past their window, so compare on the full layers. The sliding
    # group keeps the last step's tokens (what assisted decoding takes back; tests/adapter/test_layer_groups.py goes deeper).
    paged.crop(-1)
    assert paged.get_seq_length() == dyn.get_seq_length() - 1
    assert torch.equal(paged.layers[1].keys, dyn.layers[1].keys[:, :, :-1])
    paged.reset()
    assert paged.get_seq_length() == 0 and paged.pool.stats().blocks_in_use == 0
    paged.release()


def test_layer_level_cache_wide_ops_point_to_the_cache():
    cache = PagedCache()
    cache.update(*_kv(1, 3, 0), 0)
    with pytest.raises(NotImplementedError, match="PagedCache.crop"):
        cache.layers[0].crop(-1)
    with pytest.raises(NotImplementedError, match="PagedCache.reorder_cache"):
        cache.layers[0].reorder_cache(torch.tensor([0]))
    assert not cache.is_compileable and cache.is_croppable
    cache.release()


def test_lazy_cache_matches_lazy_dynamic_cache():
    paged, dyn = PagedCache(block_size=2), DynamicCache()
    for s, n in enumerate([4, 1, 1]):
        for idx in range(3):
            k, v = _kv(1, n, 10 * s + idx)
            assert all(torch.equal(a, b) for a, b in zip(paged.update(k, v, idx), dyn.update(k, v, idx)))
    assert len(paged.layers) == len(dyn.layers) == 3
    assert paged.get_seq_length() == dyn.get_seq_length() == 6
    paged.release()


# -- the cache keyword: `past_key_values` up to 5.23, `cache` from 5.24 ------------------------------------------------

def _forward_params(model_cls) -> set[str]:
    return set(inspect.signature(model_cls.forward).parameters)


def test_cache_kwarg_is_the_name_the_installed_models_take():
    assert CACHE_KWARG == ("cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values")
    assert cache_kwargs(None) == {CACHE_KWARG: None}
    assert CACHE_KWARG in CACHE_KWARG_NAMES
    # the version decides the name; the models' own signatures must agree with it
    for model_cls in (LlamaForCausalLM, Gemma2ForCausalLM):
        params = _forward_params(model_cls)
        assert CACHE_KWARG in params and not (set(CACHE_KWARG_NAMES) - {CACHE_KWARG}) & params, model_cls.__name__


def test_accelerate_skips_the_cache_keyword_when_placing_inputs():
    # with a device_map, accelerate's hooks move every input to the layer's device except these keys: the cache
    # must be passed under a skipped name, or accelerate would try to move a PagedCache
    assert CACHE_KWARG in tiny_model("llama")._skip_keys_device_placement


def test_generate_and_forward_take_the_cache_under_cache_kwarg_without_a_warning(one_thread):
    model, prompt = tiny_model("llama"), ids(1, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = PagedCache(config=model.config)
        out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=4, do_sample=False)
        ref = model.generate(prompt, **cache_kwargs(DynamicCache(config=model.config)), max_new_tokens=4,
                             do_sample=False)
        assert torch.equal(out, ref)
        assert cache.get_seq_length() == 7 + 4 - 1  # the cache was used: the last token is never fed back
        cache.release()
        cache = PagedCache(config=model.config)
        step = model(prompt, **cache_kwargs(cache), use_cache=True)
        assert step[CACHE_KWARG] is cache and cache.get_seq_length() == 7  # the output names it the same way
        cache.release()


@pytest.mark.skipif(TRANSFORMERS_VERSION < (5, 24), reason="`past_key_values` is the current name before 5.24")
def test_past_key_values_still_works_from_5_24_but_warns(one_thread):
    model, prompt = tiny_model("llama"), ids(1, 5)
    cache = PagedCache(config=model.config)
    with pytest.warns(FutureWarning, match="past_key_values"):
        model.generate(prompt, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.get_seq_length() == 6
    with pytest.warns(FutureWarning, match="past_key_values"):
        model(prompt[:, -1:], past_key_values=cache)
    assert cache.get_seq_length() == 7
    cache.release()


def test_update_accepts_the_attention_kwargs_models_pass():
    # from 5.24 attention layers call `cache.update(k, v, layer_idx, kwargs=kwargs)`; PagedCache takes and ignores them
    paged, dyn = PagedCache(block_size=2), DynamicCache()
    extra = {"position_ids": torch.arange(3)[None], "output_attentions": False}
    for n in (3, 1):
        k, v = _kv(1, n, n)
        assert all(torch.equal(a, b) for a, b in zip(paged.update(k, v, 0, kwargs=extra),
                                                     dyn.update(k, v, 0, kwargs=extra)))
    paged.release()


class _TinyTokenizer:
    """Just what `hf-pagedkv generate --no-chat` asks of a tokenizer: a fixed prompt in, token ids out."""

    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=ids(1, 9, seed=3))

    def decode(self, token_ids, skip_special_tokens=False):
        return " ".join(map(str, token_ids.tolist()))


def test_our_generate_paths_raise_no_deprecation_warning(one_thread, monkeypatch, capsys):
    """hf_pagedkv.generate, `hf-pagedkv generate --check` and the eval runner pass the cache under its current name."""
    import hf_pagedkv
    from eval import runner
    from hf_pagedkv.tools import cli

    model = tiny_model("llama")
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (model, _TinyTokenizer()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        pool = BlockPool(block_size=4, prefix_caching=True)
        for _ in range(2):  # a miss, then a hit on the published prompt
            out = hf_pagedkv.generate(model, ids(1, 10), pool=pool, max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 13) and pool.stats().hit_rate > 0
        assert cli.main(["generate", "--no-chat", "--prompt", "x", "--max-new-tokens", "3", "--check"]) == 0
        assert "IDENTICAL to DynamicCache" in capsys.readouterr().out
        cache = PagedCache(config=model.config)
        assert runner.prefill(model, cache, ids(1, 6)).shape == (VOCAB,)
        cache.release()
    stray = PagedCache()
    for name in CACHE_KWARG_NAMES:
        with pytest.raises(ValueError, match=f"do not pass `{name}`"):
            hf_pagedkv.generate(model, ids(1, 5), pool=pool, **{name: stray})
    stray.release()


# -- past recording: `activate_past_recording()` up to 5.24, `(recurrent_states_to_keep=...)` from 5.25 --------------

def _keyword_names(function) -> set[str]:
    return {name for name, p in inspect.signature(function).parameters.items()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and name != "self"}


def test_activate_past_recording_signatures_match_past_recording_kwargs():
    from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

    base = inspect.signature(Cache.activate_past_recording).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in base.values())
    assert PAST_RECORDING_KWARGS == (("recurrent_states_to_keep",) if TRANSFORMERS_VERSION >= (5, 25) else ())
    assert takes_kwargs == bool(PAST_RECORDING_KWARGS) and _keyword_names(Cache.activate_past_recording) == set()
    # the layers that use the keyword name it: the linear-attention ones
    assert _keyword_names(LinearAttentionCacheLayerMixin.activate_past_recording) == set(PAST_RECORDING_KWARGS)
    paged = inspect.signature(PagedCache.activate_past_recording).parameters
    assert any(p.kind is p.VAR_KEYWORD for p in paged.values())  # any keyword a later version adds is taken too


class _RecordingCache(PagedCache):
    """A PagedCache that notes the keyword arguments of each `activate_past_recording` call."""

    def activate_past_recording(self, **kwargs):
        self.calls.append(kwargs)
        super().activate_past_recording(**kwargs)


class _StrictCache(PagedCache):
    """An override written for 5.23/5.24: no keyword arguments."""

    def activate_past_recording(self):
        pass


@pytest.mark.parametrize("mode", ["assisted", "prompt_lookup"])
def test_generate_activates_past_recording_with_past_recording_kwargs(mode, one_thread):
    model, prompt = tiny_model("llama"), torch.cat([ids(1, 6, seed=13)] * 3, dim=1)
    extra = ({"assistant_model": tiny_model("qwen2")} if mode == "assisted" else {"prompt_lookup_num_tokens": 3})
    gen = dict(max_new_tokens=8, do_sample=False, **extra)
    cache = _RecordingCache(config=model.config)
    cache.calls = []
    out = model.generate(prompt, **cache_kwargs(cache), **gen)
    ref = model.generate(prompt, **cache_kwargs(DynamicCache(config=model.config)), **gen)
    assert torch.equal(out, ref)
    assert cache.calls and all(set(call) == set(PAST_RECORDING_KWARGS) for call in cache.calls), cache.calls
    if PAST_RECORDING_KWARGS:
        assert all(isinstance(call["recurrent_states_to_keep"], int) for call in cache.calls)
    assert cache.get_seq_length() == out.shape[1] - 1  # what was drafted and rejected was cropped
    cache.release()
    # an override without **kwargs breaks exactly on the versions that pass a keyword
    strict = _StrictCache(config=model.config)
    if PAST_RECORDING_KWARGS:
        with pytest.raises(TypeError, match="recurrent_states_to_keep"):
            model.generate(prompt, **cache_kwargs(strict), **gen)
    else:
        assert torch.equal(model.generate(prompt, **cache_kwargs(strict), **gen), ref)
    strict.release()


def test_activate_past_recording_changes_nothing():
    cache = PagedCache(block_size=2)
    cache.update(*_kv(1, 5, 0), 0)
    blocks = cache.pool.stats().blocks_in_use
    assert cache.activate_past_recording(recurrent_states_to_keep=4) is None
    assert cache.activate_past_recording() is None
    assert cache.get_seq_length() == 5 and cache.pool.stats().blocks_in_use == blocks
    cache.update(*_kv(1, 2, 1), 0)
    cache.crop(-2)  # take back the last step, as assisted decoding does
    assert cache.get_seq_length() == 5 and cache.pool.stats().blocks_in_use == blocks
    cache.release()


# -- a first layer without attention: `get_seq_length` skips it up to 5.24, not from 5.25 ---------------------------

def _config_with_layer_types(*layer_types) -> LlamaConfig:
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=len(layer_types),
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    cfg.layer_types = list(layer_types)
    return cfg


def test_a_first_layer_without_attention_is_skipped_by_get_seq_length():
    cfg = _config_with_layer_types("mlp", "full_attention", "moe", "full_attention")
    assert [kind for kind, _ in layer_plan(cfg)] == ["dummy", "full_attention", "dummy", "full_attention"]
    paged, dyn = PagedCache(block_size=2, config=cfg), DynamicCache(config=cfg)
    dummies = [isinstance(layer, DummyLayer) for layer in paged.layers]
    assert dummies == [isinstance(layer, DummyLayer) for layer in dyn.layers] == [True, False, True, False]
    assert seq_length_layer_idx(paged.layers) == 1 and seq_length_layer_idx(paged.layers, 3) == 3
    for s, n in enumerate([5, 1]):
        for idx in (1, 3):
            k, v = _kv(1, n, 10 * s + idx)
            assert all(torch.equal(a, b) for a, b in zip(paged.update(k, v, idx), dyn.update(k, v, idx)))
    assert paged.get_seq_length() == paged.get_seq_length(0) == paged.get_seq_length(1) == 6
    with pytest.raises(ValueError, match="layer 2 is a DummyLayer"):
        paged.get_seq_length(2)
    if TRANSFORMERS_VERSION >= (5, 25):
        # what PagedCache works around: transformers' own answer asks the DummyLayer itself
        with pytest.raises(AttributeError, match="get_seq_length"):
            dyn.get_seq_length()
    else:
        assert dyn.get_seq_length() == 6
        with pytest.raises(ValueError, match="layer index 2"):
            dyn.get_seq_length(2)
    paged.crop(-1)
    assert paged.get_seq_length() == 5
    paged.release()


def test_only_layers_without_attention_is_an_error_by_name():
    cache = PagedCache(config=_config_with_layer_types("mlp", "moe"))
    with pytest.raises(ValueError, match="none of the 2 layers holds attention"):
        cache.get_seq_length()
    cache.release()


def test_a_linear_attention_first_layer_is_refused_by_name():
    with pytest.raises(ValueError, match="'linear_attention'.*layer 0"):
        PagedCache(config=_config_with_layer_types("linear_attention", "full_attention"))
