"""Scores of a classifier's predictive probabilities: accuracy, negative log-likelihood,
expected calibration error and out-of-distribution AUROC.

The LIVI paper (Uppal et al. 2023, App. E.1) reports these for MNIST and CIFAR. Its code's
ECE drops every prediction with confidence of 0.99 or more (an indexing bug noted in our
digest), so we use the standard equal-width-bin ECE (Guo et al. 2017, eq. 3) with 15 bins.
"""

import torch

__all__ = ["auroc", "classification_scores", "expected_calibration_error"]


def _check_probs(probs, labels=None):
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape (n, num_classes), got {tuple(probs.shape)}")
    if labels is not None and labels.shape != probs.shape[:1]:
        raise ValueError(f"labels must have shape ({probs.shape[0]},), got {tuple(labels.shape)}")


def expected_calibration_error(probs, labels, num_bins=15):
    r"""Expected calibration error with equal-width confidence bins:
    :math:`\sum_b \frac{|B_b|}{n} |\mathrm{acc}(B_b) - \mathrm{conf}(B_b)|` (Guo et al. 2017).

    :param torch.Tensor probs: ``(n, num_classes)`` predictive probabilities.
    :param torch.Tensor labels: ``(n,)`` integer labels.
    :param int num_bins: number of bins on [0, 1].
    :rtype: float
    """
    _check_probs(probs, labels)
    confidence, prediction = probs.max(-1)
    correct = (prediction == labels).to(probs.dtype)
    # bin b holds confidences in (b/B, (b+1)/B]; confidence 1 falls in the last bin
    index = (confidence * num_bins).ceil().long().clamp(1, num_bins) - 1
    total = confidence.new_zeros(num_bins)
    total = total.index_add_(0, index, correct - confidence)
    return float(total.abs().sum() / probs.shape[0])


def auroc(scores_in, scores_out):
    """Area under the ROC curve for telling in-distribution inputs (positive) from
    out-of-distribution ones by a score (e.g. the maximum predictive probability): the
    probability that a random in-distribution score exceeds a random OOD one, ties counted
    one half (the Mann-Whitney statistic).

    :rtype: float
    """
    scores_in, scores_out = scores_in.reshape(-1), scores_out.reshape(-1)
    if not (scores_in.numel() and scores_out.numel()):
        raise ValueError("auroc needs at least one score in each group")
    scores = torch.cat([scores_in, scores_out]).double()
    order = scores.argsort()
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=scores.dtype, device=scores.device)
    # average ranks over ties
    unique, inverse = scores.unique(return_inverse=True)
    sums = torch.zeros_like(unique).index_add_(0, inverse, ranks)
    counts = torch.zeros_like(unique).index_add_(0, inverse, torch.ones_like(ranks))
    ranks = (sums / counts)[inverse]
    n_in, n_out = scores_in.numel(), scores_out.numel()
    u = ranks[:n_in].sum() - n_in * (n_in + 1) / 2
    return float(u / (n_in * n_out))


def classification_scores(probs, labels, num_bins=15):
    """Accuracy, mean negative log-likelihood, ECE and mean confidence of predictive
    probabilities.

    :param torch.Tensor probs: ``(n, num_classes)`` predictive probabilities (for a
        Bayesian model: averaged over posterior draws).
    :param torch.Tensor labels: ``(n,)`` integer labels.
    :rtype: dict
    """
    _check_probs(probs, labels)
    picked = probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return {
        "accuracy": float((probs.argmax(-1) == labels).double().mean()),
        "nll": float(-picked.clamp_min(torch.finfo(probs.dtype).tiny).log().mean()),
        "ece": expected_calibration_error(probs, labels, num_bins),
        "confidence": float(probs.max(-1).values.double().mean()),
    }
