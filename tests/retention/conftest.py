"""Fixtures shared by the query-aware retention tests (SnapKV, KVzip)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def llama(one_thread):
    """The tiny Llama (4 query heads over 2 KV heads: GQA) with the "hf_pagedkv" attention, restored afterwards.
    (`test_importance.py` and `test_sink_window.py` define their own `llama`, with the default attention.)"""
    model = tiny_model("llama")
    before = model.config._attn_implementation
    model.set_attn_implementation("hf_pagedkv")
    yield model
    model.set_attn_implementation(before)
