"""KL divergence between a baseline's and a config's next-token distributions, as a local `evaluate` module."""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Per position, KL(P_ref || P_pred) = sum_v p_ref(v) (log p_ref(v) - log p_pred(v)) in nats, where P = softmax(logits)
computed in float64; returns the mean, p95, p99 (numpy linear-interpolation quantiles) and max over positions.
`references` are the baseline's logits (e.g. DynamicCache), `predictions` the logits of the cache under test at the
same positions. Identical logits give exactly 0. Same definition as `eval.tasks.perplexity.metrics.token_kl`.
"""

_KWARGS_DESCRIPTION = """\
Args:
    predictions (`list[list[float]]`): logits of the config, one row of `vocab` floats per position.
    references (`list[list[float]]`): logits of the baseline at the same positions.
Returns:
    kl_mean, kl_p95, kl_p99, kl_max (`float`, nats).
Example:
    >>> kl = evaluate.load("eval/metrics/kl_divergence")
    >>> kl.compute(predictions=[[0.0, 1.0]], references=[[0.0, 1.0]])["kl_mean"]
    0.0
"""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class KlDivergence(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation="", inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("float64")),
                                        "references": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, predictions, references):
        lq = _log_softmax(np.asarray(predictions, dtype=np.float64))
        lp = _log_softmax(np.asarray(references, dtype=np.float64))
        kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
        return {"kl_mean": float(kl.mean()), "kl_p95": float(np.quantile(kl, 0.95)),
                "kl_p99": float(np.quantile(kl, 0.99)), "kl_max": float(kl.max())}
