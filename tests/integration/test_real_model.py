"""Integration tests on the real SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, head_dim 64), loaded once per session."""

import runpy
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_pagedkv import BlockPool, PagedCache, cache_kwargs
from hf_pagedkv.tools.verify import dynamic_cache_bytes
from tests.eval_helpers import DATA_DIR

pytestmark = pytest.mark.model
ROOT = Path(__file__).resolve().parents[2]


def _text(tokenizer, n_tokens: int) -> torch.Tensor:
    """The first `n_tokens` tokens of WikiText-2 test (eval/data)."""
    text = (DATA_DIR / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    return tokenizer(text[: n_tokens * 8], return_tensors="pt").input_ids[:, :n_tokens]


def _gen(model, x, cache, **kw):
    kw.setdefault("max_new_tokens", 12)
    return model.generate(x, **cache_kwargs(cache), do_sample=kw.pop("do_sample", False), return_dict_in_generate=True,
                          output_logits=True, **kw)


def _assert_same(ref, out):
    assert torch.equal(ref.sequences, out.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ref.logits, out.logits)) <= 1e-5


def test_greedy_is_bit_identical_to_dynamic_cache(smollm):
    model, tok = smollm
    x = _text(tok, 300)
    ref = _gen(model, x, DynamicCache(config=model.config), max_new_tokens=20)
    with PagedCache(block_size=16, config=model.config, debug=True) as cache:
        out = _gen(model, x, cache, max_new_tokens=20)
        assert cache.pool.stats().blocks_in_use == -(-(300 + 19) // 16)
    _assert_same(ref, out)
    assert all(torch.equal(a, b) for a, b in zip(ref.logits, out.logits))  # bit-identical in fp32


def test_beam_search_and_samples_match_and_store_the_prompt_once(smollm):
    model, tok = smollm
    x = _text(tok, 256)
    ref = _gen(model, x, DynamicCache(), num_beams=3)
    with PagedCache(block_size=16) as cache:
        _assert_same(ref, _gen(model, x, cache, num_beams=3))
    torch.manual_seed(0)
    ref_cache = DynamicCache()
    ref = _gen(model, x, ref_cache, do_sample=True, num_return_sequences=4, max_new_tokens=8)
    torch.manual_seed(0)
    with PagedCache(block_size=16) as cache:
        _assert_same(ref, _gen(model, x, cache, do_sample=True, num_return_sequences=4, max_new_tokens=8))
        ratio = cache.pool.stats().bytes_in_use / dynamic_cache_bytes(ref_cache)
    assert ratio <= 0.35, ratio


def test_prefilled_cache_expands_itself_for_beams(smollm):
    model, tok = smollm
    x = _text(tok, 200)
    with PagedCache(block_size=16) as cache:
        with torch.no_grad():
            model(x[:, :150], **cache_kwargs(cache))
        held = cache.pool.stats().blocks_in_use
        out = _gen(model, x, cache, num_beams=3, max_new_tokens=6)
        ref = _gen(model, x, DynamicCache(), num_beams=3, max_new_tokens=6)
        assert torch.equal(ref.sequences, out.sequences)
        # the 150-token prefix (9 full blocks + 1 partial) was computed once and is still shared by the 3 beams
        tables = cache.block_tables()
        assert len(tables) == 3 and tables[0][:9] == tables[1][:9] == tables[2][:9]
        assert held == 10


def test_decode_matches_recomputation_without_cache(smollm):
    model, tok = smollm
    x = _text(tok, 120)
    with torch.no_grad(), PagedCache(block_size=16) as cache:
        model(x[:, :100], **cache_kwargs(cache))
        for t in range(100, 120):
            logits = model(x[:, t: t + 1], **cache_kwargs(cache)).logits[0, -1]
        full = model(x, use_cache=False).logits[0, -1]
    assert (logits - full).abs().max().item() <= 1e-4


def test_quickstart_runs(smollm, monkeypatch, capsys):
    import hf_pagedkv.tools.models

    monkeypatch.setattr(hf_pagedkv.tools.models, "load_model", lambda *a, **k: smollm)
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    assert "identical to DynamicCache: True" in capsys.readouterr().out


def test_cli_generate_check_on_the_default_2000_token_input(smollm, monkeypatch, capsys):
    from hf_pagedkv.tools import cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: smollm)
    assert cli.main(["generate", "--max-new-tokens", "4", "--check"]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL to DynamicCache" in out
    n_prompt = int(out.split("prompt: ")[1].split(" tokens")[0])
    assert n_prompt >= 2000


def test_shared_pool_between_models_with_different_dtypes_is_refused(smollm):
    model, tok = smollm
    x = _text(tok, 20)
    pool = BlockPool(block_size=16)
    with torch.no_grad(), PagedCache(pool=pool) as a:
        model(x, **cache_kwargs(a))
        before = pool.stats()
        k = torch.zeros(1, 3, 2, 64, dtype=torch.float16)
        with PagedCache(pool=pool) as b, pytest.raises(ValueError, match="shared only by caches of one model"):
            b.update(k, k, 0)
        assert pool.stats() == before
    assert pool.stats().blocks_in_use == 0
