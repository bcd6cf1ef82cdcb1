"""Examples of the summarisation task: QMSum specific queries with the transcript turns of their relevant spans."""

from __future__ import annotations

from ...config import EvalConfig
from ...data import load_rows

INSTRUCTION = "Answer the query about the meeting transcript above in a few sentences."


def span_text(turns: list[dict], spans: list[list[str]]) -> str:
    """The turns `spans` name (inclusive `[start, end]` turn indices, as strings) as ``speaker: content`` lines."""
    lines = []
    for start, end in spans:
        for turn in turns[int(start): int(end) + 1]:
            lines.append(f"{turn['speaker']}: {turn['content']}")
    return "\n".join(lines)


def build_prompt(tokenizer, transcript: str, query: str) -> list[int]:
    """Token ids of the prompt: the model's chat template around transcript + query when it has one, else plain text."""
    content = f"Meeting transcript:\n{transcript}\n\nQuery: {query}\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(content + "\nAnswer:", add_special_tokens=False)["input_ids"]


def min_prompt_len(cfg: EvalConfig) -> int:
    """Shortest prompt kept, in tokens: a quarter of `prefill_len`, so that the summaries read long contexts."""
    return cfg.prefill_len // 4


def load_examples(cfg: EvalConfig, tokenizer) -> list[dict]:
    """The first `num_windows` QMSum specific queries (file order) whose prompt has between `min_prompt_len(cfg)`
    and `prefill_len` tokens.

    Returns:
        `list[dict]`: `{"example", "meeting", "query", "reference", "ids"}` per example (`ids`: the prompt).

    Raises:
        ValueError: the rows are not QMSum records, or fewer than `num_windows` queries fit the length range.
    """
    rows = load_rows(cfg)
    needed = {"meeting_transcripts", "specific_query_list"}
    if not needed <= set(rows.column_names):
        raise ValueError(f"task=summarization reads QMSum JSONL records with {sorted(needed)}; "
                         f"{cfg.dataset_name!r} has columns {rows.column_names}.")
    lo, hi = min_prompt_len(cfg), cfg.prefill_len
    examples: list[dict] = []
    seen = 0
    for meeting, row in enumerate(rows):
        for q in row["specific_query_list"]:
            seen += 1
            ids = build_prompt(tokenizer, span_text(row["meeting_transcripts"], q["relevant_text_span"]), q["query"])
            if lo <= len(ids) <= hi:
                examples.append({"example": len(examples), "meeting": meeting, "query": q["query"],
                                 "reference": q["answer"], "ids": ids})
                if len(examples) == cfg.num_windows:
                    return examples
    raise ValueError(f"only {len(examples)} of {seen} QMSum queries have a prompt of {lo}..{hi} tokens "
                     f"(prefill_len={cfg.prefill_len}), but num_windows={cfg.num_windows}.")
