"""Messages count in good grammar: `hf_pagedkv.errors.counted` puts a noun in the singular for one, and the
messages that use it say "1 block", never "1 blocks"."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_pagedkv.errors import counted

ROOT = Path(__file__).resolve().parents[1] / "hf_pagedkv"


@pytest.mark.parametrize("args, kwargs, text", [
    ((0, "block"), {}, "0 blocks"),
    ((1, "block"), {}, "1 block"),
    ((2, "block"), {}, "2 blocks"),
    ((1, "KV head"), {}, "1 KV head"),
    ((4, "KV head"), {}, "4 KV heads"),
    ((1200, "token"), {"spec": ","}, "1,200 tokens"),
    ((1, "entry", "entries"), {}, "1 entry"),
    ((2, "entry", "entries"), {}, "2 entries"),
])
def test_counted(args, kwargs, text):
    assert counted(*args, **kwargs) == text


def test_no_message_puts_a_count_before_a_plural_noun_it_may_pluralize_wrongly():
    """Counts that can be 1 go through `counted`: a literal like ``f"{n} blocks needed"`` would say "1 blocks"."""
    pattern = re.compile(r"\{(len\([^{}]*\)|n|need|num_\w+|self\.num_\w+|rows|q|start|new_len|total)\} "
                         r"(blocks|tokens|rows|layers|requests|evictions|KV heads) (needed|per row|of ids|holds)")
    hits = [f"{p.relative_to(ROOT.parent)}:{i}" for p in ROOT.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
