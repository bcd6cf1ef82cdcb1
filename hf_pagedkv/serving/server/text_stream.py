"""`TextStream`: one choice's generated tokens turned into text as they come, cut at the first stop string.

Detokenizing token by token is wrong in two ways: a multi-byte character split over two tokens decodes as U+FFFD
until its last byte comes, and tokenizers that drop a word's leading space at the start of a text (SentencePiece)
decode a lone token differently from the same token after others. So, as vLLM and TGI do, each new piece is
decoded *with a few tokens before it* and only the part after their text is new, and nothing ending in U+FFFD is
sent until the next token completes it (a character the choice's end cuts off is dropped)::

    tokens:  [ ... prefix_offset | ... read_offset | new tokens ]
    text(prefix_offset .. end) - text(prefix_offset .. read_offset) = the new text

Stop strings: the text sent never contains one; the last ``len(longest stop) - 1`` characters are held back until
the text goes on past them (or the choice ends), so a stop string split over two tokens is still caught.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class TextStream:
    """Text of one choice's tokens, in pieces (`push`, then `finish`).

    Invariants: `sent` is a prefix of the full text; it never contains a stop string; `stopped` is set once, and
    after it `push` takes nothing more.

    Args:
        tokenizer (`PreTrainedTokenizerBase`): decodes with ``skip_special_tokens=True``.
        stop (`list[str]`): stop strings (non-empty).
        hidden_ids (`frozenset[int]`): token ids whose text is never shown (stop token ids that are not special).
    """

    def __init__(self, tokenizer, stop: list[str], hidden_ids: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer  # fixed
        self._stop = stop  # fixed
        self._hold = max((len(s) for s in stop), default=1) - 1  # characters held back while a stop may begin
        self._hidden = hidden_ids  # fixed
        self.tokens: list[int] = []  # every token pushed (the text shown covers them all, less the hidden ones)
        self._prefix_offset = 0  # tokens before `_read_offset` decoded again as context
        self._read_offset = 0  # tokens whose text is in `_text`
        self._text = ""  # the text of the tokens up to `_read_offset`, stop strings not yet cut
        self.sent = ""  # text handed out so far (a prefix of `_text`)
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, tokens: list[int]) -> str:
        """Add generated tokens; return the text that is now certain (possibly "")."""
        if self.stopped:
            return ""
        self.tokens += tokens
        shown = [t for t in self.tokens if t not in self._hidden] if self._hidden else self.tokens
        before = self._decode(shown[self._prefix_offset: self._read_offset])
        after = self._decode(shown[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._text += after[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(shown)
        return self._release(final=False)

    def finish(self) -> str:
        """The choice ended: the rest of the text (what was held back; the bytes of a character cut off by the
        end of the choice, which decode as U+FFFD, are dropped)."""
        if not self.stopped:
            shown = [t for t in self.tokens if t not in self._hidden] if self._hidden else self.tokens
            before = self._decode(shown[self._prefix_offset: self._read_offset])
            after = self._decode(shown[self._prefix_offset:])
            self._text += after[len(before):].rstrip(_REPLACEMENT)
            self._read_offset = len(shown)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        start = max(0, len(self.sent) - self._hold)  # a stop string may start in the held-back characters
        cut = min((i for i in (self._text.find(s, start) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            end = cut
        else:
            end = len(self._text) if final else max(len(self.sent), len(self._text) - self._hold)
        piece = self._text[len(self.sent): end]
        self.sent += piece
        return piece

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=True) if tokens else ""


__all__ = ["TextStream"]
