"""`SamplingParams` (greedy or sampled, per request) and `sample`: the next token from one row of logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its next token: greedy (`do_sample=False`, argmax, as `generate` does) or sampled after
    transformers' warpers in their order (temperature, then top-k, then top-p), from the request's own
    `torch.Generator` seeded with `seed`."""

    do_sample: bool = False
    temperature: float = 1.0  # > 0 (0 too when greedy); divides the logits (sampling only)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p (1.0: all)
    seed: int = 0  # the request generator's seed (sampling only)

    def check(self, where: str) -> None:
        """Raise `ValueError` naming `where` (the request) and the bad setting."""
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"{where}: do_sample must be True or False, got {self.do_sample!r}.")
        greedy_zero = not self.do_sample and self.temperature == 0  # (OpenAI's greedy; ignored, as all settings)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not (self.temperature > 0 or greedy_zero) or self.temperature == float("inf"):
            hint = ("temperature 0 is greedy decoding: give do_sample=False" if self.do_sample and self.temperature == 0
                    else "0 is taken with do_sample=False, greedy decoding")
            raise ValueError(f"{where}: temperature must be a finite number > 0, got {self.temperature!r} ({hint}).")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"{where}: top_k must be an int >= 0 (0 keeps every token), got {self.top_k!r}.")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"{where}: top_p must be in (0, 1] (1.0 keeps every token), got {self.top_p!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"{where}: seed must be an int in [0, 2**63), got {self.seed!r}.")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token of one request.

    Args:
        logits (`torch.Tensor` of shape `[vocab]`): the last position's logits (any float dtype; computed in fp32).
        params (`SamplingParams`): greedy, or the warpers and a draw from `generator`.
        generator (`torch.Generator`, *optional*): the request's generator (sampling only); one multinomial draw.

    Returns:
        `int`: the token id.
    """
    scores = logits.float()
    if not params.do_sample:
        return int(scores.argmax())
    scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        # as transformers' TopPLogitsWarper: drop the least likely tokens whose cumulative probability stays
        # <= 1 - top_p, always keeping the most likely one
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - params.top_p
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


__all__ = ["SamplingParams", "sample"]
