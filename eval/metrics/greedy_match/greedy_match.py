"""Agreement of greedy continuations (token match rate, first divergence), as a local `evaluate` module."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
For each pair of token sequences (a config's greedy continuation and the baseline's from the same prompt): the match
rate is the fraction of positions holding the same token, compared position by position over the longer sequence
(a missing token is a mismatch); the first divergence is the first mismatching position, or the length when the two
are identical. Returns the mean match rate and the mean and median first divergence. Same definition as
`eval.tasks.perplexity.metrics.greedy_agreement`.
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (`list[list[int]]`): the config's generated token ids, one list per prompt.
    references (`list[list[int]]`): the baseline's generated token ids for the same prompts.
Returns:
    match_rate, first_divergence_mean, first_divergence_median (`float`).
Example:
    >>> gm = evaluate.load("eval/metrics/greedy_match")
    >>> gm.compute(predictions=[[5, 6, 7, 8]], references=[[5, 6, 9, 8]])
    {'match_rate': 0.75, 'first_divergence_mean': 2.0, 'first_divergence_median': 2.0}
"""


def _agreement(base, other):
    n = max(len(base), len(other))
    if n == 0:
        return 1.0, 0
    same = [i < len(base) and i < len(other) and base[i] == other[i] for i in range(n)]
    return sum(same) / n, same.index(False) if False in same else n


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class GreedyMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("int64")),
                                        "references": datasets.Sequence(datasets.Value("int64"))}),
        )

    def _compute(self, predictions, references):
        pairs = [_agreement(list(r), list(p)) for p, r in zip(predictions, references)]
        first = np.array([f for _, f in pairs], dtype=np.float64)
        return {"match_rate": float(np.mean([m for m, _ in pairs])), "first_divergence_mean": float(first.mean()),
                "first_divergence_median": float(np.median(first))}
