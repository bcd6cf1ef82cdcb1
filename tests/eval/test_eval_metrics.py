"""The drift metrics against hand-computed values, and the local `evaluate` modules against the suite's definitions."""

import math
import os

import numpy as np
import pytest
import torch

from eval.tasks.perplexity import metrics as M
from eval.tasks.summarization.metrics import rouge_l
from tests.eval_helpers import REPO

LN3 = math.log(3.0)


def test_kl_nll_top1_by_hand():
    base = torch.tensor([[0.0, LN3], [5.0, 1.0]], dtype=torch.float64)  # softmax: [1/4, 3/4], and peaked
    cfg = torch.tensor([[0.0, 0.0], [5.0, 1.0]], dtype=torch.float64)  # softmax: [1/2, 1/2], then as the baseline
    kl = M.token_kl(base, cfg)
    assert kl.dtype == torch.float64
    assert kl[0].item() == pytest.approx(0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5), abs=1e-12)
    assert kl[1].item() == 0.0  # identical logits: exactly zero, not merely small
    nll = M.token_nll(base, torch.tensor([1, 0]))
    assert nll[0].item() == pytest.approx(-math.log(0.75), abs=1e-12)
    assert nll[1].item() == pytest.approx(-(5.0 - math.log(math.exp(5.0) + math.exp(1.0))), abs=1e-12)
    assert M.top1_match(base, cfg).tolist() == [False, True]  # argmax 1 vs 0 (tie resolves to the first), then equal


@pytest.mark.parametrize("base, other, expected", [
    ([1, 2, 3, 4], [1, 2, 3, 4], (1.0, 4)),
    ([1, 2, 3, 4], [1, 2, 9, 4], (0.75, 2)),  # a later re-agreement counts in the rate, not in the position
    ([1, 2, 3], [1, 2], (2 / 3, 2)),  # the shorter one stopped (EOS): the missing token is a mismatch
    ([7], [8, 9], (0.0, 0)),
    ([], [], (1.0, 0)),
])
def test_greedy_agreement(base, other, expected):
    rate, first = M.greedy_agreement(base, other)
    assert (rate, first) == (pytest.approx(expected[0]), expected[1])


def test_error_terms_by_hand():
    written = torch.ones(1, 2, 4, 3)
    err, ref = M.error_terms(written, written * 1.1)
    assert ref == 24.0 and err == pytest.approx(24 * 0.01)  # relative error sqrt(0.01) = 10%
    # a sliding-window cache gives back only its last tokens: those are compared
    written[:, :, :2] = 100.0
    err, ref = M.error_terms(written, torch.ones(1, 2, 2, 3))
    assert (err, ref) == (0.0, 12.0)


def _rec(nll, kl, top1, gen, first, match, kerr, kref, bytes_, tokens):
    return {"nll": np.array(nll), "kl": np.array(kl), "top1": np.array(top1), "gen": gen, "first_div": first,
            "gen_match": match, "k_sq_err": kerr, "k_sq_ref": kref, "v_sq_err": kerr, "v_sq_ref": kref,
            "bytes": bytes_, "tokens": tokens}


def test_reduce_pools_windows_exactly():
    base = [_rec([1.0, 2.0], [], [], [5, 6], 2, 1.0, [0, 0], [1, 1], 1000, 10),
            _rec([3.0, 2.0], [], [], [5, 6], 2, 1.0, [0, 0], [1, 1], 1000, 10)]
    cfg = [_rec([1.0, 3.0], [0.0, 0.1], [True, False], [5, 6], 2, 1.0, [1.0, 4.0], [100.0, 100.0], 300, 10),
           _rec([3.0, 3.0], [0.2, 0.5], [True, True], [5, 7], 1, 0.5, [3.0, 0.0], [300.0, 100.0], 200, 10)]
    m = M.reduce(cfg, base)
    assert m["ppl"] == pytest.approx(math.exp(10.0 / 4)) and m["ppl_baseline"] == pytest.approx(math.exp(2.0))
    assert m["delta_ppl"] == pytest.approx(math.exp(2.5) - math.exp(2.0))
    assert m["kl_mean"] == pytest.approx(0.2) and m["kl_max"] == 0.5
    assert m["kl_p95"] == pytest.approx(0.2 + 0.85 * 0.3)  # linear interpolation at rank 0.95 * 3 = 2.85
    assert m["top1"] == 0.75
    assert (m["gen_match"], m["first_div_mean"], m["first_div_median"], m["windows_identical"]) == (0.75, 1.5, 1.5, 1)
    # per layer: sqrt(sum of squared errors / sum of squared norms) over windows
    assert m["k_err_per_layer"] == pytest.approx([math.sqrt(4.0 / 400.0), math.sqrt(4.0 / 200.0)])
    assert m["k_err_max"] == pytest.approx(math.sqrt(0.02))
    assert m["bytes_per_token"] == 25.0 and m["bytes_ratio"] == 0.25


def test_rouge_l_by_hand():
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    # LCS("the cat", "the cat sat") = 2 words: precision 2/2, recall 2/3, F1 = 0.8
    assert rouge_l("the cat", "the cat sat") == pytest.approx(0.8)
    assert rouge_l("", "the cat") == 0.0


@pytest.fixture(scope="module")
def evaluate_offline():
    evaluate = pytest.importorskip("evaluate")
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # local modules must load without the Hub
    yield evaluate
    if old is None:
        os.environ.pop("HF_HUB_OFFLINE")
    else:
        os.environ["HF_HUB_OFFLINE"] = old


def test_evaluate_modules_match_the_suite(evaluate_offline):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 50, generator=g, dtype=torch.float64)
    cfg = base + 0.3 * torch.randn(40, 50, generator=g, dtype=torch.float64)
    cfg[:5] = base[:5]
    kl = evaluate_offline.load(str(REPO / "eval/metrics/kl_divergence"))
    out = kl.compute(predictions=cfg.tolist(), references=base.tolist())
    want = M.token_kl(base, cfg).numpy()
    assert out["kl_mean"] == pytest.approx(want.mean(), rel=1e-9)
    assert out["kl_p99"] == pytest.approx(np.quantile(want, 0.99), rel=1e-9)
    top1 = evaluate_offline.load(str(REPO / "eval/metrics/top1_agreement"))
    assert top1.compute(predictions=cfg.tolist(), references=base.tolist())["top1"] == \
        pytest.approx(M.top1_match(base, cfg).double().mean().item())
    gm = evaluate_offline.load(str(REPO / "eval/metrics/greedy_match"))
    out = gm.compute(predictions=[[5, 6, 7, 8], [1, 2]], references=[[5, 6, 9, 8], [1, 2, 3]])
    assert out == {"match_rate": pytest.approx((0.75 + 2 / 3) / 2), "first_divergence_mean": 2.0,
                   "first_divergence_median": 2.0}
