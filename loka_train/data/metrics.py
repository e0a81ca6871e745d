"""Evaluation metrics for click prediction: normalized entropy, ROC AUC and calibration.

Each takes raw logits (any shape, flattened) and 0/1 labels, computes in float64 on the
tensors' device, and returns a Python float. The Trainer gathers the whole eval set from
every rank first and calls them once, so each figure is exact over the eval set and the
same for any number of ranks.

Why these and not `torchrec.metrics`: they agree with TorchRec's public computations
(`torchrec.metrics.ne.compute_ne`, `torchrec.metrics.auc.compute_auc`,
`torchrec.metrics.calibration.compute_calibration`) to 1e-6 on the same data, which
`tests/unit/test_data_metrics_torchrec.py` checks, and differ where an eval needs them to:

- AUC with tied scores: `compute_auc` sorts by score and integrates the ROC curve one
  sample at a time, so within a group of equal scores the result depends on the order the
  samples arrive in (bf16 logits tie often). `auc` is the Mann-Whitney statistic with
  average ranks, which counts a tied positive-negative pair as one half whatever the order;
  `compute_auc` gives the same figure when each tied group is one weighted sample.
- Whole eval set: `AUCMetric` keeps only the last `window_size` samples (no lifetime AUC)
  and casts probabilities to float32, where sigmoid rounds to 1.0 above a logit of about
  17 and makes new ties; here every eval sample counts and the logits are ranked in
  float64.
- NE from logits: TorchRec computes cross-entropy from probabilities clamped to
  [1e-12, 1 - 1e-12], which caps a confidently wrong sample's loss at about 27.6 nats;
  `normalized_entropy` uses the logits directly.
- The eval is one pass over a fixed held-out set, so the windowed/lifetime state, the
  `RecTaskInfo` and the torchmetrics sync of a `RecMetricModule` would add machinery for no
  figure the Trainer lacks.

Shape legend: N  samples (flattened).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["auc", "calibration", "normalized_entropy"]


def _flat_pair(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits_N = logits.detach().reshape(-1).to(torch.float64)
    labels_N = labels.detach().reshape(-1).to(torch.float64)
    if logits_N.numel() != labels_N.numel():
        raise ValueError(
            f"logits has {logits_N.numel()} elements but labels has {labels_N.numel()}: "
            "pass one logit per label"
        )
    if logits_N.numel() == 0:
        raise ValueError("logits and labels are empty: a metric needs at least one sample")
    if not bool(torch.isfinite(logits_N).all()):
        raise ValueError("logits contain NaN or inf: the metric is undefined")
    if not bool(((labels_N == 0) | (labels_N == 1)).all()):
        raise ValueError("labels must be 0 or 1")
    return logits_N, labels_N


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy divided by the entropy of the mean label (natural log both).

    1.0 is what predicting the base rate achieves; lower is better.

    Args:
        logits: predicted logits (pre-sigmoid), any shape.
        labels: 0/1 labels with as many elements as logits.

    Raises:
        ValueError: if all labels are equal (the base-rate entropy is 0 and NE is undefined),
            on a size mismatch, empty input, non-finite logits or non-binary labels.

    Example:
        >>> normalized_entropy(torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 1.0]))
        1.0
    """
    logits_N, labels_N = _flat_pair(logits, labels)
    p = float(labels_N.mean())
    if p <= 0.0 or p >= 1.0:
        raise ValueError(
            f"normalized entropy is undefined when every label is {int(p)}: evaluate on more "
            "samples (both classes must occur)"
        )
    bce = float(F.binary_cross_entropy_with_logits(logits_N, labels_N))
    base = -(p * math.log(p) + (1.0 - p) * math.log(1.0 - p))
    return bce / base


def auc(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by the Mann-Whitney U statistic; tied scores get their average rank.

    Args:
        logits: scores (any monotone transform gives the same AUC), any shape.
        labels: 0/1 labels with as many elements as logits.

    Raises:
        ValueError: if only one class occurs, or on the input errors of normalized_entropy.

    Example:
        >>> auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        0.75
    """
    logits_N, labels_N = _flat_pair(logits, labels)
    num_pos = float(labels_N.sum())
    num_neg = labels_N.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(
            "AUC is undefined with a single class: evaluate on more samples (both classes must occur)"
        )
    _, inverse_N, counts_U = torch.unique(
        logits_N, sorted=True, return_inverse=True, return_counts=True
    )
    # 1-based rank of a group of tied values: the mean of the ranks it spans.
    counts_U = counts_U.to(torch.float64)
    avg_rank_U = torch.cumsum(counts_U, 0) - (counts_U - 1.0) / 2.0
    rank_sum_pos = float((avg_rank_U[inverse_N] * labels_N).sum())
    u_stat = rank_sum_pos - num_pos * (num_pos + 1.0) / 2.0
    return u_stat / (num_pos * num_neg)


def calibration(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Sum of predicted click probabilities over the number of clicks (sum of labels).

    1.0 means the model predicts as many clicks as happen; above 1 it over-predicts, below 1
    it under-predicts. Read next to NE: a model can rank well (AUC) and still be biased.

    Args:
        logits: predicted logits (pre-sigmoid), any shape.
        labels: 0/1 labels with as many elements as logits.

    Raises:
        ValueError: if no label is 1 (the ratio is undefined), or on the input errors of
            normalized_entropy.

    Example:
        >>> calibration(torch.zeros(4), torch.tensor([0.0, 1.0, 0.0, 0.0]))
        2.0
    """
    logits_N, labels_N = _flat_pair(logits, labels)
    num_pos = float(labels_N.sum())
    if num_pos == 0:
        raise ValueError(
            "calibration is undefined without positive labels: evaluate on more samples "
            "(at least one label must be 1)"
        )
    return float(torch.sigmoid(logits_N).sum()) / num_pos
