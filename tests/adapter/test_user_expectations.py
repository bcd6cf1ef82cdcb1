"""What a transformers user expects of a cache, checked against `DynamicCache` doing the same.

`copy.deepcopy` (transformers' prompt-reuse recipe), gradients, `del cache`, `torch.inference_mode()` mixed with
other modes on one pool, and quiet ordinary runs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import logging
import pickle
import weakref

import pytest
import torch
from transformers import DynamicCache

import hf_pagedkv
from hf_pagedkv import BlockPool, CacheReleasedError, PagedCache, cache_kwargs
from hf_pagedkv.errors import EMPTY_PROMPT
from tests.conftest import ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, input_ids, cache, **kw):
    return model.generate(input_ids, **cache_kwargs(cache), max_new_tokens=6, do_sample=False, **kw)


# -- copy.deepcopy ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_deepcopy_reuses_a_prompt_cache_as_in_the_transformers_docs(quant):
    """transformers' "re-use a prompt cache" recipe: prefill once, then `copy.deepcopy` the cache per question."""
    model = tiny_model("llama")
    prompt = ids(1, 19, seed=1)
    questions = [ids(1, n, seed=10 + n) for n in (3, 6, 9)]
    block_size = 4 if quant is None else 8
    pool = BlockPool(block_size=block_size, quant=quant)

    def answers(prompt_cache):
        with torch.no_grad():
            prompt_cache = model(prompt, past_key_values=prompt_cache).past_key_values
        outs = []
        for q in questions:
            past_key_values = copy.deepcopy(prompt_cache)
            outs.append(greedy(model, torch.cat([prompt, q], dim=1), past_key_values))
            if isinstance(past_key_values, PagedCache):
                assert past_key_values is not prompt_cache and past_key_values.get_seq_length() > 19
                pool.check_invariants()
                past_key_values.release()
        return prompt_cache, outs

    dyn_cache, want = answers(DynamicCache(config=model.config))
    paged, got = answers(PagedCache(pool=pool, config=model.config))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # the prompt cache is untouched by its copies: same length, same blocks, and still reads the same K/V
    assert paged.get_seq_length() == dyn_cache.get_seq_length() == 19
    if quant is None:
        for layer, ref in zip(paged.layers, dyn_cache.layers, strict=True):
            assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)
    blocks = pool.stats().blocks_in_use
    assert blocks == len(paged.block_tables()[0]) == {4: 5, 8: 3}[block_size]  # ceil(19 / B): the prompt's only
    paged.release()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


def test_deepcopy_is_a_fork_without_tensor_copies():
    model = tiny_model("llama")
    pool = BlockPool(block_size=4)
    cache = PagedCache(pool=pool)
    with torch.no_grad():
        model(ids(1, 10), past_key_values=cache)
    reserved, cow = pool.stats().bytes_reserved, sum(g.num_cow_copies for g in pool.groups)
    for clone in (copy.deepcopy(cache), copy.copy(cache), copy.deepcopy({"past_key_values": cache})["past_key_values"]):
        assert isinstance(clone, PagedCache) and clone is not cache and clone.pool is pool
        assert clone.block_tables() == cache.block_tables() and clone.get_seq_length() == 10
        assert clone.layers[0] is not cache.layers[0]
        clone.release()
    # no block or tensor was copied
    assert sum(g.num_cow_copies for g in pool.groups) == cow and pool.stats().bytes_reserved == reserved
    assert pool.stats().blocks_in_use == 3
    cache.release()
    assert pool.stats().blocks_in_use == 0


def test_deepcopy_of_an_empty_and_of_a_released_cache():
    empty = PagedCache()
    clone = copy.deepcopy(empty)
    assert clone.get_seq_length() == 0 and clone.pool is empty.pool
    model = tiny_model("llama")
    torch.testing.assert_close(greedy(model, ids(1, 5), clone), greedy(model, ids(1, 5), DynamicCache()))
    empty.release()
    with pytest.raises(CacheReleasedError):
        copy.deepcopy(empty)


def test_pickle_says_to_fork():
    cache = PagedCache()
    with pytest.raises(TypeError, match=r"cannot be pickled.*cache\.fork\(\)"):
        pickle.dumps(cache)


# -- gradients --------------------------------------------------------------------------------------------------------
def _grads(model, steps, cache, no_grad_steps=0):
    """Forward `steps` (token ids) one call each through `cache` (the first `no_grad_steps` under no_grad), then
    backward the summed log-likelihood of the grad calls; returns {parameter name: grad or None}."""
    model.zero_grad(set_to_none=True)
    loss = 0
    for i, x in enumerate(steps):
        with torch.set_grad_enabled(i >= no_grad_steps):
            logits = model(x, past_key_values=cache).logits
        if i >= no_grad_steps:
            loss = loss + logits.log_softmax(-1)[..., 5].sum()
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert want[name] is not None, name  # the reference trains every projection, k_proj / v_proj included
        assert got[name] is not None, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("quant", [None, "k8v4"])
@pytest.mark.parametrize("rows", ["one", "two", "identical"])  # identical rows are stored once (deduplicated)
def test_gradients_through_one_forward_equal_dynamic_cache(quant, rows):
    model = tiny_model("llama")
    x = {"one": ids(1, 11, seed=3), "two": ids(2, 11, seed=3), "identical": ids(1, 11, seed=3).repeat(2, 1)}[rows]
    want = _grads(model, [x], DynamicCache())
    cache = PagedCache(block_size=8, quant=quant)
    _assert_same_grads(_grads(model, [x], cache), want)
    assert any("k_proj" in n for n in want)
    cache.pool.check_invariants()


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding-window layers (window 8) read a slice
def test_gradients_after_a_prompt_cached_without_grad_equal_dynamic_cache(arch):
    """A prompt prefilled under no_grad, then a forward with grad: only the new tokens' K/V get gradients."""
    model = tiny_model(arch)
    steps = [ids(1, 13, seed=4), ids(1, 5, seed=5)]
    want = _grads(model, steps, DynamicCache(config=model.config), no_grad_steps=1)
    _assert_same_grads(_grads(model, steps, PagedCache(block_size=4, config=model.config), no_grad_steps=1), want)


def test_backward_into_k_v_cached_with_grad_raises_instead_of_differing():
    model = tiny_model("llama")
    steps = [ids(1, 6, seed=6), ids(1, 1, seed=7)]
    want = _grads(model, steps, DynamicCache())  # DynamicCache backpropagates into the first call's K/V
    assert want["model.layers.0.self_attn.k_proj.weight"].abs().sum() > 0
    pool = BlockPool(block_size=4)
    with pytest.raises(RuntimeError, match=r"no autograd history.*torch\.no_grad\(\).*DynamicCache"):
        _grads(model, steps, PagedCache(pool=pool))
    pool.check_invariants()
    # forward calls with grad that are never backpropagated keep working, with DynamicCache's logits
    x, nxt = steps
    paged, ref = PagedCache(pool=pool), DynamicCache()
    model(x, past_key_values=paged), model(x, past_key_values=ref)
    torch.testing.assert_close(model(nxt, past_key_values=paged).logits, model(nxt, past_key_values=ref).logits,
                               rtol=0, atol=1e-6)


# -- del cache --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_del_cache_frees_its_blocks_without_cyclic_gc(quant):
    """Three requests on an 8-block pool, each cache dropped with `del` (no release()) while cyclic GC is off."""
    model = tiny_model("gemma2")  # sliding-window and full layers, built from the config
    pool = BlockPool(block_size=8, num_blocks=8, quant=quant)
    prompts = [ids(1, 17, seed=s) for s in (1, 2, 3)]  # 17 + 6 new tokens: 3 blocks of 8 each
    gc.collect()
    gc.disable()
    try:
        for x in prompts:
            dyn, paged = DynamicCache(config=model.config), PagedCache(pool=pool, config=model.config)
            want, got = greedy(model, x, dyn), greedy(model, x, paged)
            if quant is None:
                assert torch.equal(got, want)
            full, sliding = pool.stats().groups  # the sliding group holds only its window (8): 2 blocks
            assert (full.blocks_in_use, sliding.blocks_in_use) == (3, 2)
            dead = [weakref.ref(dyn), weakref.ref(paged)]
            del dyn, paged
            assert [r() for r in dead] == [None, None]  # both caches freed at once, DynamicCache and PagedCache
            assert pool.owners.num_pending == 1  # queued by the finalizer, freed by the pool's next operation
            assert pool.groups[0].allocator.num_used_blocks == 3
            block = pool._allocate(1)  # the next allocation drains the queue first
            assert pool.owners.num_pending == 0 and pool.groups[0].allocator.num_used_blocks == 1
            pool._free(block)
            pool.check_invariants()
    finally:
        gc.enable()
    assert pool.stats().blocks_in_use == 0


def test_a_layer_of_a_collected_cache_says_so():
    cache = PagedCache()
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    layer = cache.layers[0]
    del cache
    with pytest.raises(CacheReleasedError, match="garbage collected"):
        layer.keys


# -- torch.inference_mode() -------------------------------------------------------------------------------------------
MODES = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("quant", [None, "k4v4"])
@pytest.mark.parametrize("first, second", list(itertools.product(MODES, MODES)))
def test_one_pool_serves_every_mix_of_inference_mode_no_grad_and_plain(quant, first, second):
    """Requests in one mode, then in another, on one shared pool (which grows in the second mode), and a prompt
    cache filled in the first mode and continued in the second: the tokens of DynamicCache doing the same (for the
    quantized pool, of the same requests on a fresh pool in one mode)."""
    model = tiny_model("llama")
    prompt, question, big = ids(1, 9, seed=1), ids(1, 4, seed=2), ids(10, 100, seed=3)

    def run(make_cache, first, second):
        outs = []
        with MODES[first]():
            outs.append(greedy(model, prompt, make_cache()))
            carried = make_cache()
            model(prompt, past_key_values=carried)  # a prompt cache filled in the first mode ...
        with MODES[second]():
            outs.append(greedy(model, torch.cat([prompt, question], 1), carried))  # ... continued in the second
            outs.append(greedy(model, question, make_cache()))  # storage made in the first mode, written now
            outs.append(greedy(model, big, make_cache()))  # 10 rows x 14 blocks: the pool (and staging) grow
        return outs

    pool = BlockPool(block_size=8, quant=quant)
    got = run(lambda: PagedCache(pool=pool, config=model.config), first, second)
    if quant is None:
        want = run(lambda: DynamicCache(config=model.config), first, second)
    else:
        fresh = BlockPool(block_size=8, quant=quant)
        want = run(lambda: PagedCache(pool=fresh, config=model.config), "no_grad", "no_grad")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert pool.num_blocks > 66  # grew past its first chunk (2 blocks + 64 headroom) in the second mode
    gc.collect()
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0


# -- hf_pagedkv.generate on any pool, empty prompts -------------------------------------------------------------------
@pytest.mark.parametrize("quant", [None, "k8v4"])
def test_generate_works_on_a_pool_without_prefix_caching(quant):
    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=16, quant=quant)
    x = ids(1, 9, seed=1)
    got = hf_pagedkv.generate(model, x, pool=pool, max_new_tokens=6, do_sample=False)
    ref_pool = BlockPool(block_size=4, quant=quant)
    assert torch.equal(got, greedy(model, x, PagedCache(pool=ref_pool, config=model.config)))
    if quant is None:
        assert torch.equal(got, greedy(model, x, DynamicCache()))
    # a left-padded batch: each row as its own unpadded run
    batch = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = (batch != 0).long()
    out = hf_pagedkv.generate(model, batch, pool=pool, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for r in range(2):
        row = batch[r, mask[r].bool()][None]
        assert torch.equal(out[r, 5:], greedy(model, row, PagedCache(pool=ref_pool))[0, row.shape[1]: row.shape[1] + 3])
    pool.check_invariants()
    assert pool.stats().blocks_in_use == 0 and pool.stats().lookups == 0  # nothing looked up, nothing left held


def test_an_empty_prompt_gets_the_same_message_everywhere(monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    model = tiny_model("llama")
    messages = []
    for call in (lambda: PagedCache.from_prefix(BlockPool(prefix_caching=True), [], model=model),
                 lambda: PagedCache.from_prefix(BlockPool(prefix_caching=True), torch.zeros(1, 0, dtype=torch.long),
                                                model=model),
                 lambda: hf_pagedkv.generate(model, torch.zeros(1, 0, dtype=torch.long), pool=BlockPool()),
                 lambda: hf_pagedkv.generate(model, torch.tensor([[0, 0], [5, 6]]), pool=BlockPool(prefix_caching=True),
                                             attention_mask=torch.tensor([[0, 0], [1, 1]]))):
        with pytest.raises(ValueError) as e:
            call()
        messages.append(str(e.value))
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
    assert cli.main(["generate", "--no-chat", "--prompt", ""]) == 2
    messages.append(capsys.readouterr().err)
    assert all(EMPTY_PROMPT in m for m in messages), messages
    assert messages[0].startswith("PagedCache.from_prefix: ") and messages[2].startswith("hf_pagedkv.generate: ")
    assert "(row 0 of 2)" in messages[3] and messages[4].startswith("hf-pagedkv generate: --prompt is empty")


# -- quiet by default -------------------------------------------------------------------------------------------------
def _noisy(caplog, recwarn) -> list[str]:
    """Log records at WARNING or above, and warnings other than DeprecationWarning (ignored project-wide)."""
    return ([f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
            + [str(w.message) for w in recwarn if not issubclass(w.category, DeprecationWarning)])


def test_a_pool_that_fills_and_an_ordinary_generate_print_nothing(capsys, caplog, recwarn):
    from hf_pagedkv import PoolExhaustedError

    model = tiny_model("llama")
    pool = BlockPool(block_size=4, num_blocks=4)  # a one-off small pool
    greedy(model, ids(1, 5), PagedCache(pool=pool))  # 3 of 4 blocks: over the 85% occupancy threshold
    with pytest.raises(PoolExhaustedError):
        greedy(model, ids(1, 30), PagedCache(pool=pool))  # fills the pool: the error is the message
    gc.collect()
    with PagedCache(quant="k8v4") as cache:
        model.generate(ids(2, 40), **cache_kwargs(cache), max_new_tokens=40, do_sample=True, top_p=0.9)
    assert not pool.health().ok  # the alerts did fire: they are there for whoever looks, not on stderr
    assert capsys.readouterr() == ("", "")
    assert _noisy(caplog, recwarn) == []


def test_alerts_are_info_records_on_their_own_logger(caplog):
    caplog.set_level(logging.INFO, logger="hf_pagedkv.observe.alerts")
    pool = BlockPool(block_size=4, num_blocks=2)
    pool._allocate(2)
    assert [a.name for a in pool.health().alerts] == ["occupancy"]
    fired = [r for r in caplog.records if "alert occupancy:" in r.getMessage()]
    assert [(r.name, r.levelno) for r in fired] == [("hf_pagedkv.observe.alerts", logging.INFO)]


def test_model_loading_prints_no_progress_bar(capsys, caplog, recwarn):
    from transformers.utils import logging as hf_logging

    from hf_pagedkv import _compat
    from hf_pagedkv.tools.models import load_model
    from tests.eval_helpers import tiny_model_dir

    path = tiny_model_dir()
    capsys.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    model, _ = load_model(path)
    assert model.config.num_hidden_layers == 2
    assert capsys.readouterr() == ("", "") and _noisy(caplog, recwarn) == []
    assert hf_logging.is_progress_bar_enabled()  # restored after the load
    # the GGUF loader's own bar (it calls tqdm directly) is silenced too, and restored
    gguf = pytest.importorskip(_compat._GGUF_LOADER)
    with _compat.quiet_model_loading():
        list(gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
    assert capsys.readouterr().err == ""
    list(gguf.tqdm(range(3), desc="after"))
    assert "after" in capsys.readouterr().err


@pytest.mark.model  # loads the bundled GGUF once more (~20 s), to see that nothing is printed
def test_loading_the_bundled_gguf_prints_nothing(capsys, caplog, recwarn):
    from hf_pagedkv.tools.models import load_model

    model, tokenizer = load_model()
    assert model.config.num_hidden_layers == 30
    assert capsys.readouterr() == ("", "") and _noisy(caplog, recwarn) == []


def test_an_eval_naming_the_keys_first_ablation_says_so_in_the_report_not_as_a_warning(caplog, monkeypatch):
    from eval import caches
    from eval.config import DEFAULT_CONFIGS, EvalConfig

    monkeypatch.setattr("hf_pagedkv.config._warned", set())  # the library warns once per process: not yet
    assert "k4v8" not in DEFAULT_CONFIGS
    cfg = EvalConfig(configs=["k8v4", "k4v8"])
    cache = caches.build("k4v8", cfg, tiny_model("llama").config)
    assert (cache.pool.quant.key_bits, cache.pool.quant.value_bits) == (4, 8)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert "an ablation" in caches.describe("k4v8", cfg) and "ablation" not in caches.describe("k8v4", cfg)
    cache.release()
