import math

import pytest
import torch

from pyro_implicit.diagnostics.classification import (
    auroc,
    classification_scores,
    expected_calibration_error,
)


def test_ece_by_hand():
    # two bins used: confidence 0.9 (2 right of 2 -> |1 - 0.9|) and 0.6 (1 right of 2 -> 0.1)
    probs = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 0])
    assert expected_calibration_error(probs, labels) == pytest.approx(0.5 * 0.1 + 0.5 * 0.1)
    # one-hot and right: perfectly calibrated
    assert expected_calibration_error(torch.eye(3), torch.arange(3)) == 0.0


def test_ece_of_calibrated_draws_is_small():
    # labels drawn from the predicted probabilities: calibrated in expectation
    g = torch.Generator().manual_seed(0)
    p = torch.rand(200_000, generator=g, dtype=torch.float64)
    probs = torch.stack([p, 1 - p], -1)
    labels = (torch.rand(200_000, generator=g, dtype=torch.float64) > p).long()
    assert expected_calibration_error(probs, labels) < 0.01
    overconfident = torch.stack([p.round(), 1 - p.round()], -1).clamp(1e-6, 1 - 1e-6)
    assert expected_calibration_error(overconfident, labels) > 0.2


def test_auroc_closed_forms():
    assert auroc(torch.tensor([2.0, 3.0]), torch.tensor([0.0, 1.0])) == 1.0
    assert auroc(torch.tensor([0.0, 1.0]), torch.tensor([2.0, 3.0])) == 0.0
    assert auroc(torch.ones(5), torch.ones(7)) == 0.5  # ties count one half
    # two unit-variance Gaussians a distance delta apart: AUROC = Phi(delta / sqrt(2))
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4000, generator=g) + 1.0
    b = torch.randn(4000, generator=g)
    exact = 0.5 * (1 + math.erf(0.5))
    assert auroc(a, b) == pytest.approx(exact, abs=0.015)


def test_classification_scores():
    probs = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.6, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1])
    s = classification_scores(probs, labels)
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["nll"] == pytest.approx(-(math.log(0.7) + math.log(0.8) + math.log(0.4)) / 3)
    assert s["confidence"] == pytest.approx((0.7 + 0.8 + 0.6) / 3)
    with pytest.raises(ValueError, match="labels must have shape"):
        classification_scores(probs, labels[:2])
