"""Normalized entropy, AUC and calibration against hand-computed cases and plain-Python references."""

from __future__ import annotations

import math
import random

import pytest
import torch

from loka_train.data import auc, calibration, normalized_entropy


def _ne_reference(logits: list[float], labels: list[int]) -> float:
    bce = 0.0
    for z, y in zip(logits, labels):
        p = 1.0 / (1.0 + math.exp(-z))
        bce -= y * math.log(p) + (1 - y) * math.log(1.0 - p)
    bce /= len(labels)
    q = sum(labels) / len(labels)
    return bce / -(q * math.log(q) + (1 - q) * math.log(1 - q))


def _auc_reference(scores: list[float], labels: list[int]) -> float:
    """P(score of a positive > score of a negative) + 0.5 P(tie), over all pairs."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_ne_hand_computed() -> None:
    # Predicting p = 0.5 on balanced labels: BCE = ln 2 = entropy of the mean label.
    assert normalized_entropy(torch.zeros(4), torch.tensor([0.0, 1.0, 1.0, 0.0])) == pytest.approx(
        1.0
    )
    # Predicting the base rate 1/4 exactly gives NE = 1 for any batch with that rate.
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert normalized_entropy(torch.full((4,), math.log(1 / 3)), labels) == pytest.approx(1.0)
    # logits (2, -1) on labels (1, 0): BCE = ln(1 + e^-2) and ln(1 + e^-1); entropy ln 2.
    want = (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1))) / 2 / math.log(2)
    assert normalized_entropy(torch.tensor([2.0, -1.0]), torch.tensor([1, 0])) == pytest.approx(
        want
    )
    # Confident and right is far below 1; confident and wrong far above.
    assert normalized_entropy(torch.tensor([8.0, -8.0]), torch.tensor([1.0, 0.0])) < 0.01
    assert normalized_entropy(torch.tensor([-8.0, 8.0]), torch.tensor([1.0, 0.0])) > 10


def test_ne_matches_reference_on_random_data() -> None:
    rng = random.Random(0)
    logits = [rng.gauss(-1.0, 2.0) for _ in range(500)]
    labels = [int(rng.random() < 0.3) for _ in range(500)]
    got = normalized_entropy(
        torch.tensor(logits, dtype=torch.float64).view(20, 25), torch.tensor(labels).view(20, 25)
    )
    assert got == pytest.approx(_ne_reference(logits, labels), rel=1e-9)


def test_auc_hand_computed() -> None:
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(
        0.75
    )
    # Ties: (pos 1 vs neg 1) counts 1/2, (pos 2 vs neg 1) counts 1 -> 0.75.
    assert auc(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([0, 1, 1])) == pytest.approx(0.75)
    assert auc(torch.tensor([3.0, 3.0, 3.0, 3.0]), torch.tensor([0, 1, 1, 0])) == pytest.approx(0.5)
    assert auc(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0, 1, 1])) == pytest.approx(1.0)
    assert auc(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1, 0, 0])) == pytest.approx(0.0)
    assert auc(torch.tensor([2.0, 1.0, 0.0]), torch.tensor([0, 1, 1])) == pytest.approx(0.0)


def test_auc_matches_reference_with_many_ties() -> None:
    rng = random.Random(1)
    scores = [float(rng.randint(0, 9)) for _ in range(300)]  # about 30 samples per tied value
    labels = [int(rng.random() < 0.2 + 0.05 * s) for s in scores]
    got = auc(torch.tensor(scores), torch.tensor(labels, dtype=torch.float32))
    assert got == pytest.approx(_auc_reference(scores, labels), abs=1e-12)
    assert 0.6 < got < 0.95


def test_calibration_hand_computed() -> None:
    # Predicting the base rate on every sample is perfectly calibrated.
    labels = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert calibration(torch.full((4,), math.log(1 / 3)), labels) == pytest.approx(1.0)
    # p = 0.5 on four samples with one click: 2 predicted clicks / 1 actual.
    assert calibration(torch.zeros(2, 2), labels.view(2, 2)) == pytest.approx(2.0)
    # logits (2, -1, 0) on labels (1, 1, 0): (sigmoid(2) + sigmoid(-1) + 1/2) / 2.
    sig = [1.0 / (1.0 + math.exp(-z)) for z in (2.0, -1.0, 0.0)]
    got = calibration(torch.tensor([2.0, -1.0, 0.0]), torch.tensor([1, 1, 0]))
    assert got == pytest.approx(sum(sig) / 2, rel=1e-12)
    # Under-predicting: far below 1.
    assert calibration(torch.full((3,), -6.0), torch.tensor([1.0, 1.0, 0.0])) < 0.01


def test_metric_errors() -> None:
    with pytest.raises(ValueError, match="both classes"):
        normalized_entropy(torch.zeros(3), torch.ones(3))
    with pytest.raises(ValueError, match="both classes"):
        auc(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="one logit per label"):
        auc(torch.zeros(3), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="empty"):
        normalized_entropy(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="NaN or inf"):
        auc(torch.tensor([float("nan"), 1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="0 or 1"):
        normalized_entropy(torch.zeros(2), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="without positive labels"):
        calibration(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="NaN or inf"):
        calibration(torch.tensor([float("inf"), 1.0]), torch.tensor([0, 1]))
