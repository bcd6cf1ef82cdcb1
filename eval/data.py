"""Loading evaluation text: local `.txt`/`.raw`/`.json`/`.jsonl` files, or any `datasets` name, through `datasets`."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import datasets

from .config import EvalConfig

logger = logging.getLogger(__name__)

_TEXT_SUFFIXES = (".txt", ".raw", ".text")
_JSON_SUFFIXES = (".json", ".jsonl")


def resolve_local(cfg: EvalConfig) -> Path | None:
    """The local file or directory `cfg.dataset_name` names (absolute, relative to the cwd, or to `data_dir`),
    or `None` for a `datasets` name."""
    name = cfg.dataset_name
    for candidate in (Path(name), cfg.resolved_data_dir / name):
        if candidate.exists():
            return candidate
    if name.endswith(_TEXT_SUFFIXES + _JSON_SUFFIXES):
        raise ValueError(
            f"EvalConfig.dataset={name!r}: no such file, neither as given nor under data_dir="
            f"{str(cfg.resolved_data_dir)!r}; set --data-dir (or $HF_PAGEDKV_DATA_DIR) to the folder holding it."
        )
    return None


def load_rows(cfg: EvalConfig) -> datasets.Dataset:
    """The rows of the dataset: one row per document for local text files (`sample_by="document"`), one per JSON
    record for `.json`/`.jsonl`, the `split` of a `datasets` name otherwise.

    Raises:
        ValueError: a local file that does not exist, or a directory with no text or JSON files.
    """
    local = resolve_local(cfg)
    if local is None:
        logger.info("loading datasets %r (config %r, split %r)", cfg.dataset_name, cfg.dataset_config, cfg.split)
        return datasets.load_dataset(cfg.dataset_name, cfg.dataset_config, split=cfg.split)
    files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    texts = [str(p) for p in files if p.suffix in _TEXT_SUFFIXES]
    jsons = [str(p) for p in files if p.suffix in _JSON_SUFFIXES]
    if jsons:
        return datasets.load_dataset("json", data_files=jsons, split="train")
    if texts:
        return datasets.load_dataset("text", data_files=texts, split="train", sample_by="document")
    raise ValueError(f"EvalConfig.dataset={cfg.dataset_name!r}: {local} holds no "
                     f"{' / '.join(_TEXT_SUFFIXES + _JSON_SUFFIXES)} file.")


def load_text(cfg: EvalConfig) -> str:
    """The dataset as one string: the rows' `text_field` joined by blank lines (``"\\n\\n".join(rows)``, the usual
    WikiText convention for row-per-line datasets; a local text file is one row, so it is used as it is).

    Raises:
        ValueError: the rows have no `text_field` column.
    """
    rows = load_rows(cfg)
    if cfg.text_field not in rows.column_names:
        raise ValueError(f"EvalConfig.text_field={cfg.text_field!r} is not a column of {cfg.dataset_name!r}; "
                         f"columns: {rows.column_names}.")
    return "\n\n".join(rows[cfg.text_field])


def tokenize_prefix(text: str, tokenizer, num_tokens: int) -> list[int]:
    """Token ids of the start of `text`, at least `num_tokens` of them when the text is long enough.

    Tokenizes growing prefixes cut at a line break, so a 1 MB corpus is not tokenized whole for a few windows.
    The last 64 tokens of a cut prefix are dropped, since a cut can change the tokens right before it; the ids
    returned are therefore those of tokenizing the whole text (BPE pre-tokenization is local to a word).
    """
    margin = 64
    chars = max(4096, num_tokens * 8)
    while True:
        cut = len(text) if chars >= len(text) else text.rfind("\n", 0, chars) + 1 or chars
        ids = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
        if cut == len(text):
            return ids
        if len(ids) - margin >= num_tokens:
            return ids[: len(ids) - margin]
        chars *= 2


def data_description(cfg: EvalConfig) -> str:
    """One line naming the data a run read, for the report."""
    local = resolve_local(cfg)
    if local is None:
        return f"`datasets` {cfg.dataset_name!r} (config {cfg.dataset_config!r}, split {cfg.split!r})"
    shown = os.path.relpath(local, cfg.resolved_data_dir) if str(local).startswith(str(cfg.resolved_data_dir)) \
        else str(local)
    return f"local `{shown}` (under data_dir)" if shown != str(local) else f"local `{shown}`"
