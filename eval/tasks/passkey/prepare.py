"""Seeded passkey examples: a local haystack with a five-digit key hidden at a given depth."""

from __future__ import annotations

import random

from ...data import tokenize_prefix

NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def make_examples(cfg, tokenizer, text: str) -> list[dict]:
    """One example per (context length, depth, key index).

    Args:
        cfg (`LongContextConfig`): `contexts` (tokens), `depths` (percent), `num_keys`, `seed`.
        tokenizer: the model's tokenizer.
        text (`str`): the haystack corpus.

    Returns:
        `list[dict]`: `{"example", "context_len", "depth", "key", "context_ids", "question_ids"}`.

    Raises:
        ValueError: the corpus is shorter than the longest context.
    """
    longest = max(cfg.contexts)
    corpus = tokenize_prefix(text, tokenizer, 4 * longest)
    if len(corpus) < 2 * longest:
        raise ValueError(f"the haystack corpus has {len(corpus)} tokens; contexts up to {longest} need "
                         f"{2 * longest}.")
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    examples = []
    for n in cfg.contexts:
        for depth in cfg.depths:
            for k in range(cfg.num_keys):
                rng = random.Random(f"{cfg.seed}-{n}-{depth}-{k}")  # str seeds are hashed stably (sha512)
                key = rng.randrange(10000, 100000)
                needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
                start = rng.randrange(0, len(corpus) - n)
                hay = corpus[start: start + n - len(needle)]
                at = round(len(hay) * depth / 100)
                # move the needle to the nearest line break before its depth, so it does not split a word
                while 0 < at < len(hay) and hay[at - 1: at] != newline and at > round(len(hay) * depth / 100) - 64:
                    at -= 1
                ids = hay[:at] + needle + hay[at:]
                examples.append({"example": len(examples), "context_len": n, "depth": depth, "key": key,
                                 "context_ids": ids, "question_ids": question})
    return examples
