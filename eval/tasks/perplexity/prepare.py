"""Windows of the perplexity task: consecutive, non-overlapping token windows from the start of the corpus."""

from __future__ import annotations

from ...config import EvalConfig
from ...data import load_text, tokenize_prefix


def window_len(cfg: EvalConfig) -> int:
    """Tokens per window: `prefill_len` prefilled, `score_len` decoded and scored, plus the last scored target."""
    return cfg.prefill_len + cfg.score_len + 1


def load_examples(cfg: EvalConfig, tokenizer) -> list[dict]:
    """The first `num_windows` consecutive windows of `window_len(cfg)` tokens of the dataset's text.

    The text is the rows joined by blank lines (see `eval.data.load_text`), tokenized without special tokens.
    The greedy continuation of a window starts from its first `prefill_len` tokens.

    Returns:
        `list[dict]`: `{"example": i, "start": first token offset in the corpus, "ids": list[int]}` per window.

    Raises:
        ValueError: the corpus holds fewer than `num_windows` windows (says how many fit).
    """
    n = window_len(cfg)
    ids = tokenize_prefix(load_text(cfg), tokenizer, n * cfg.num_windows)
    if len(ids) < n * cfg.num_windows:
        raise ValueError(
            f"{cfg.dataset_name!r} has {len(ids)} tokens: {len(ids) // n} windows of prefill_len + score_len + 1 = "
            f"{n} tokens fit, but num_windows={cfg.num_windows}; lower num_windows or the lengths."
        )
    return [{"example": i, "start": i * n, "ids": ids[i * n: (i + 1) * n]} for i in range(cfg.num_windows)]
