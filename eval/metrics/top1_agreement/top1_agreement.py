"""Top-1 agreement between a baseline's and a config's next-token logits, as a local `evaluate` module."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Fraction of positions where argmax(predictions) == argmax(references): the config's most likely next token equals the
baseline's. Same definition as `eval.tasks.perplexity.metrics.top1_match` (mean over positions).
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (`list[list[float]]`): logits of the config, one row of `vocab` floats per position.
    references (`list[list[float]]`): logits of the baseline at the same positions.
Returns:
    top1 (`float` in [0, 1]).
Example:
    >>> top1 = evaluate.load("eval/metrics/top1_agreement")
    >>> top1.compute(predictions=[[0.0, 1.0], [2.0, 1.0]], references=[[0.0, 1.0], [0.0, 1.0]])["top1"]
    0.5
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Top1Agreement(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64")),
                                        "references": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, predictions, references):
        same = np.asarray(predictions).argmax(-1) == np.asarray(references).argmax(-1)
        return {"top1": float(same.mean())}
