"""The serving layer sits above the cache: nothing below it imports it; its attention name builds no mask."""

import pathlib
import re

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_pagedkv
from hf_pagedkv._compat import register_attention
from tests.conftest import tiny_model

PACKAGE = pathlib.Path(hf_pagedkv.__file__).parent
ABOVE = {"serving", "tools"}  # folders that may import hf_pagedkv.serving (and the package's __init__)


def test_nothing_below_serving_imports_it():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ABOVE or rel == pathlib.Path("__init__.py"):
            continue
        if re.search(r"(from|import)\s+hf_pagedkv\.serving|from\s+hf_pagedkv\s+import\s+.*\bserving\b",
                     path.read_text()):
            offenders.append(str(rel))
    assert offenders == []


def test_attention_registered_without_mask_gets_no_mask():
    # the contract the packed attention relies on: a name with no mask function gets attention_mask=None
    seen = []

    def attend(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, None, **kwargs)

    register_attention("hf_pagedkv_test_nomask", attend, mask=False)
    model = tiny_model("llama")
    model.set_attn_implementation("hf_pagedkv_test_nomask")
    try:
        ids = torch.tensor([[5, 6, 7]])
        model(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1]]))
    finally:
        model.set_attn_implementation("sdpa")
    assert len(seen) == model.config.num_hidden_layers and all(m is None for m in seen)


def test_the_model_keeps_its_attention_after_steps():
    from hf_pagedkv import Engine

    model = tiny_model("llama")
    engine = Engine(model)
    engine.add_request([5, 6, 7], max_new_tokens=2)
    while engine.has_unfinished:
        engine.step()
    assert model.config._attn_implementation == "sdpa"
