"""Our eval metrics against TorchRec's public computations on the same data.

`loka_train.data.metrics` keeps its own NE, AUC and calibration (its module docstring says
why); these tests hold them to `torchrec.metrics.ne.compute_ne`,
`torchrec.metrics.auc.compute_auc` and `torchrec.metrics.calibration.compute_calibration`
to 1e-6 on random sets with balanced and skewed labels and with tied scores, and show where
TorchRec's figures differ: AUC under ties depends on the order of the samples.
"""

from __future__ import annotations

import math

import pytest
import torch
from torchrec.metrics.auc import compute_auc
from torchrec.metrics.calibration import compute_calibration, get_calibration_states
from torchrec.metrics.ne import compute_cross_entropy, compute_ne

from loka_train.data import auc, calibration, normalized_entropy

TOL = 1e-6
ETA = 1e-12
"""The clamp that torchrec's NEMetricComputation passes to compute_cross_entropy/compute_ne."""


def _data_set(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_N, labels_N) in float64; labels drawn from the logits' own probabilities."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    n, mean, std = {
        "balanced": (2000, 0.0, 1.5),
        "rare_clicks": (5000, -4.5, 1.0),  # about 2% positives
        "mostly_clicks": (3000, 4.0, 1.0),  # about 97% positives
        "ties": (2000, -1.0, 1.5),
        "bf16": (4000, -1.5, 2.0),
        "tiny": (7, 0.0, 1.0),
    }[name]
    logits_N = mean + std * torch.randn(n, generator=g, dtype=torch.float64)
    labels_N = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(logits_N)).double()
    if name == "ties":
        logits_N = torch.round(logits_N * 4) / 4  # about 40 distinct scores
    if name == "bf16":
        logits_N = logits_N.to(torch.bfloat16).to(torch.float64)  # as a bf16 eval produces them
    if name == "tiny":
        labels_N = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert 0 < labels_N.sum() < n
    return logits_N, labels_N


ALL_SETS = ["balanced", "rare_clicks", "mostly_clicks", "ties", "bf16", "tiny"]
TIED_SETS = ["ties", "bf16"]


def _ones(x: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(x)


def _torchrec_ne(logits_N: torch.Tensor, labels_N: torch.Tensor) -> float:
    probs_N = torch.sigmoid(logits_N).clone()  # compute_cross_entropy clamps in place
    ce_sum = compute_cross_entropy(labels_N, probs_N, _ones(labels_N), ETA).sum()
    ne = compute_ne(ce_sum, labels_N.new_tensor(float(labels_N.numel())), labels_N.sum(),
                    (1.0 - labels_N).sum(), ETA)
    return float(ne)


def _torchrec_auc(preds_N: torch.Tensor, labels_N: torch.Tensor, weights_N: torch.Tensor) -> float:
    return float(compute_auc(1, [preds_N[None]], [labels_N[None]], [weights_N[None]]))


def _torchrec_auc_tied_groups(logits_N: torch.Tensor, labels_N: torch.Tensor) -> float:
    """compute_auc on the same data with each group of equal scores as one sample: weight the
    group's size, label its fraction of positives. Its trapezoid over that one step credits a
    tied positive-negative pair with one half. A weight-0 sample above every score starts the
    curve at (0, 0), so a tied group at the top keeps its triangle."""
    scores_U, inverse_N, counts_U = torch.unique(logits_N, return_inverse=True, return_counts=True)
    pos_U = torch.zeros_like(scores_U).index_add_(0, inverse_N, labels_N)
    counts_U = counts_U.to(torch.float64)
    preds = torch.cat([torch.tensor([2.0], dtype=torch.float64), torch.sigmoid(scores_U)])
    labels = torch.cat([torch.zeros(1, dtype=torch.float64), pos_U / counts_U])
    weights = torch.cat([torch.zeros(1, dtype=torch.float64), counts_U])
    return _torchrec_auc(preds, labels, weights)


def _tie_mass(logits_N: torch.Tensor, labels_N: torch.Tensor) -> float:
    """The most an ordering within tied groups can move AUC: sum over groups of
    (positives x negatives) / 2, over all positive-negative pairs."""
    _, inverse_N, counts_U = torch.unique(logits_N, return_inverse=True, return_counts=True)
    pos_U = torch.zeros(counts_U.numel(), dtype=torch.float64).index_add_(0, inverse_N, labels_N)
    neg_U = counts_U.to(torch.float64) - pos_U
    num_pos = float(labels_N.sum())
    return float((pos_U * neg_U).sum()) / 2.0 / (num_pos * (labels_N.numel() - num_pos))


@pytest.mark.parametrize("name", ALL_SETS)
def test_ne_agrees_with_torchrec_compute_ne(name: str) -> None:
    logits_N, labels_N = _data_set(name)
    assert normalized_entropy(logits_N, labels_N) == pytest.approx(_torchrec_ne(logits_N, labels_N), abs=TOL)


@pytest.mark.parametrize("name", ALL_SETS)
def test_calibration_agrees_with_torchrec_compute_calibration(name: str) -> None:
    logits_N, labels_N = _data_set(name)
    states = get_calibration_states(labels_N, torch.sigmoid(logits_N), _ones(labels_N))
    want = float(compute_calibration(states["calibration_num"], states["calibration_denom"]))
    assert calibration(logits_N, labels_N) == pytest.approx(want, abs=TOL)


@pytest.mark.parametrize("name", ["balanced", "rare_clicks", "mostly_clicks", "tiny"])
def test_auc_agrees_with_torchrec_compute_auc_on_distinct_scores(name: str) -> None:
    logits_N, labels_N = _data_set(name)
    assert torch.unique(logits_N).numel() == logits_N.numel()
    want = _torchrec_auc(torch.sigmoid(logits_N), labels_N, _ones(labels_N))
    assert auc(logits_N, labels_N) == pytest.approx(want, abs=TOL)


@pytest.mark.parametrize("name", ALL_SETS)
def test_auc_agrees_with_torchrec_compute_auc_with_tied_scores_grouped(name: str) -> None:
    logits_N, labels_N = _data_set(name)
    assert auc(logits_N, labels_N) == pytest.approx(_torchrec_auc_tied_groups(logits_N, labels_N), abs=TOL)


@pytest.mark.parametrize("name", TIED_SETS)
def test_torchrec_auc_on_tied_scores_depends_on_sample_order_and_ours_does_not(name: str) -> None:
    logits_N, labels_N = _data_set(name)
    mass = _tie_mass(logits_N, labels_N)
    assert mass > 100 * TOL  # ties matter here: far above the agreement tolerance
    ours = auc(logits_N, labels_N)
    g = torch.Generator().manual_seed(7)
    theirs, mine = [], []
    for _ in range(4):
        perm_N = torch.randperm(logits_N.numel(), generator=g)
        z_N, y_N = logits_N[perm_N], labels_N[perm_N]
        theirs.append(_torchrec_auc(torch.sigmoid(z_N), y_N, _ones(y_N)))
        mine.append(auc(z_N, y_N))
    assert max(theirs) - min(theirs) > 10 * TOL, theirs  # the same data, several AUCs
    assert all(abs(t - ours) <= mass + TOL for t in theirs), (theirs, ours, mass)
    assert mine == [ours] * 4


def test_torchrec_figures_differ_where_ours_stay_exact() -> None:
    # A confidently wrong sample: TorchRec clamps the probability at 1e-12 (27.6 nats).
    logits_N = torch.tensor([40.0, -40.0, 0.0, 0.0], dtype=torch.float64)
    labels_N = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    exact = (2 * (40.0 + math.log1p(math.exp(-40.0))) + 2 * math.log(2.0)) / 4 / math.log(2.0)
    assert normalized_entropy(logits_N, labels_N) == pytest.approx(exact, rel=1e-12)
    assert _torchrec_ne(logits_N, labels_N) < 0.8 * exact
    # AUCMetric keeps float32 probabilities: logits 18 and 20 become the same score, 1.0.
    probs32 = torch.sigmoid(torch.tensor([18.0, 20.0], dtype=torch.float64)).float()
    assert probs32[0] == probs32[1] == 1.0
    assert auc(torch.tensor([18.0, 20.0]), torch.tensor([0.0, 1.0])) == 1.0
