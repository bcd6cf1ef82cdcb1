"""`LeftPadding`: how many leading padding tokens each row of a prompt has, read from its attention mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_pagedkv.errors import counted


@dataclass(frozen=True)
class LeftPadding:
    """The left padding of a batch of prompts (`PagedCache.set_padding`): row `r` starts with `tokens[r]` padding
    tokens, then only real ones. Immutable; the cache drops it once its steps planned the padding.

    Outputs do not change when whole blocks of padding name the pool's pad block: they are bit-identical to
    `DynamicCache` in fp32 (attention masks padding, and zeros keep the masked softmax exact; `layers[i].keys` read
    zeros at those positions where `DynamicCache` holds the model's pad K/V); with ``attn_implementation="eager"``,
    whose mask is a finite minimum, only the logits at padding positions, which nothing reads, may differ. Padding
    is never published to the prefix index (`publish` skips rows that hold it). Rows expanded by `generate`
    (`num_return_sequences`, `num_beams`) take the padding of the row they copy.
    """

    tokens: tuple[int, ...]  # leading padding tokens per row of the mask
    length: int = 0  # the mask's columns: the prompt's tokens per row (padding included)

    @classmethod
    def from_mask(cls, attention_mask) -> LeftPadding:
        """Read a left-padding attention mask.

        Args:
            attention_mask (`torch.Tensor` of shape `[batch, seq_len]`): 1 (or True) for real tokens, 0 for padding.

        Raises:
            ValueError: not 2-D, values other than 0 and 1, not left padding (0s then 1s in each row), or a row
                without a real token.
        """
        if attention_mask is None or isinstance(attention_mask, (str, bytes)):
            raise ValueError(f"set_padding: attention_mask={attention_mask!r}; pass the [batch, seq_len] mask of 0s "
                             "and 1s that generate() gets (tokenizer(..., padding=True).attention_mask).")
        mask = torch.as_tensor(attention_mask).detach()
        if mask.dim() != 2 or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"set_padding: attention_mask must be a [batch, seq_len] mask of 0s and 1s, got "
                             f"{mask.dtype} of shape {tuple(mask.shape)}.")
        real = mask.to("cpu").bool()  # [batch, seq_len]
        if real.shape[1] == 0 or bool((real[:, :-1] & ~real[:, 1:]).any()) or not bool(real[:, -1].all()):
            raise ValueError("set_padding: attention_mask must describe left padding (0s then 1s in each row, the "
                             "last column all 1s); right padding, holes and rows without a real token are not "
                             "supported.")
        return cls(tuple((~real).sum(1).tolist()), mask.shape[1])

    @property
    def num_tokens(self) -> int:
        """The most padding tokens of any row: steps past it add no padding."""
        return max(self.tokens, default=0)

    def for_batch(self, batch: int, num_new: int | None = None) -> list[int]:
        """Padding tokens of each of `batch` rows: the mask's rows, or each repeated `k` times for ``batch = k *
        rows`` (as `generate` expands them for `num_return_sequences` and `num_beams`).

        Raises:
            ValueError: `batch` is not a multiple of the mask's rows; the prefill's first step has more tokens per
                row (`num_new`) than the mask has columns (the mask is not this prompt's). A first step with fewer
                tokens is read as the first chunk of a chunked prefill of the mask's length.
        """
        if num_new is not None and self.length and num_new > self.length:
            raise ValueError(f"set_padding got an attention_mask of {self.length} columns, but the prefill step has "
                             f"{counted(num_new, 'token')} per row: pass the attention mask of this very prompt (the "
                             "attention_mask of the input_ids given to generate or to the model). Nothing was stored.")
        rows = len(self.tokens)
        if batch % rows:
            raise ValueError(f"set_padding got an attention_mask of {counted(rows, 'row')}, but the forward step has a "
                             f"batch of {batch}; it must be the same rows (or each repeated k times, as "
                             "num_return_sequences and num_beams do).")
        return [p for p in self.tokens for _ in range(batch // rows)]


__all__ = ["LeftPadding"]
