"""Passkey metrics: is the first five-digit number of an answer the key; accuracy per group."""

from __future__ import annotations

import re


def is_correct(text: str, key: int) -> bool:
    """Whether the first run of digits in `text` is `key` (a model that repeats the key right is correct)."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == str(key)


def accuracy(records: list[dict]) -> float:
    """Fraction of `records` with ``correct`` true (NaN for none)."""
    return sum(r["correct"] for r in records) / len(records) if records else float("nan")
