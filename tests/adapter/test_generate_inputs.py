"""`hf_pagedkv.generate` refuses prompts the model cannot embed, and what is not a model, before anything runs, with
the serving engine's words, and leaves the pool untouched; `Engine.add_request` refuses a request id that is not a
str with a `ValueError`, as its other arguments."""

import pytest
import torch

import hf_pagedkv
from hf_pagedkv import BlockPool, Engine
from tests.conftest import VOCAB, ids, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

OUTSIDE = r"is outside the model's vocabulary \[0, 96\); encode the prompt with the model's own tokenizer"


def _untouched(pool: BlockPool) -> None:
    s = pool.stats()
    assert (pool.num_blocks, s.blocks_in_use, s.lookups, s.num_sequences) == (0, 0, 0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("bad, pos", [(VOCAB, 2), (10**6, 0), (-1, 4)])
def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs(bad, pos, prefix_caching):
    model = tiny_model("llama")
    pool = BlockPool(prefix_caching=prefix_caching)
    prompt = ids(1, 5)
    prompt[0, pos] = bad
    with pytest.raises(ValueError, match=rf"^hf_pagedkv.generate: token id {bad} \(position {pos} of the prompt's "
                                         rf"real tokens\) {OUTSIDE}\.$"):
        hf_pagedkv.generate(model, prompt, pool=pool, max_new_tokens=2, do_sample=False)
    _untouched(pool)
    with pytest.raises(ValueError, match=rf"token id {bad} \(position {pos}\) {OUTSIDE}"):  # the engine's words
        Engine(model, pool=BlockPool()).add_request(prompt[0].tolist(), request_id="r", max_new_tokens=2)


def test_a_bad_id_in_a_later_row_is_named_by_row_and_real_position_and_padding_is_not_checked():
    model = tiny_model("llama")
    pool = BlockPool()
    batch = torch.tensor([[-7, 5, 6, 7], [3, 4, VOCAB + 3, 8]])  # row 0's padding holds an id no model has
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=rf"token id {VOCAB + 3} \(row 1, position 2 of the prompt's real tokens\)"):
        hf_pagedkv.generate(model, batch, pool=pool, attention_mask=mask, max_new_tokens=2, do_sample=False)
    _untouched(pool)
    batch[1, 2] = 9  # every real token in the vocabulary: padding under a 0 mask is never embedded
    out = hf_pagedkv.generate(model, batch, pool=pool, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert out.shape == (2, 6) and torch.equal(out[:, :4], batch)
    assert pool.stats().blocks_in_use == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_token_ids_that_are_not_integers_are_refused(dtype):
    pool = BlockPool()
    with pytest.raises(ValueError, match=rf"`input_ids` must hold integer token ids \(torch.long\), got {dtype}"):
        hf_pagedkv.generate(tiny_model("llama"), ids(1, 4).to(dtype), pool=pool, max_new_tokens=2)
    _untouched(pool)


@pytest.mark.parametrize("model", [None, "llama", torch.nn.Linear(2, 2)])
def test_a_model_that_is_not_a_transformers_model_is_refused(model):
    pool = BlockPool()
    with pytest.raises(ValueError, match=rf"needs `model` a transformers model with .generate and .config .*, got "
                                         rf"{type(model).__name__}\.$"):
        hf_pagedkv.generate(model, ids(1, 4), pool=pool, max_new_tokens=2)
    _untouched(pool)


@pytest.mark.parametrize("request_id", [[1], 7, {"id": 1}])
def test_engine_request_ids_that_are_not_str_are_refused_before_the_lookup(request_id):
    pool = BlockPool()
    engine = Engine(tiny_model("llama"), pool)
    with pytest.raises(ValueError, match=rf"add_request: request_id must be a str, got {type(request_id).__name__}"):
        engine.add_request([5, 6], request_id=request_id)
    assert engine.stats().num_waiting == 0 and not engine.has_unfinished
    _untouched(pool)
    assert engine.add_request([5, 6], max_new_tokens=1) == "req_0"  # the numbering did not move
