"""Fits per mode mixed by the modes' weights, against a two-mode posterior known exactly."""

import math

import pyro
import pytest
import torch

from pyro_implicit import (
    ImplicitGuide,
    ModeMixture,
    MultimodalPosteriorWarning,
    Preconditioner,
    SteinScoreELBO,
    fit_per_mode,
)


def test_one_fit_per_mode_mixed_by_weight_is_the_posterior(two_modes):
    """Masses 0.30 / 0.70: one ``SteinScoreELBO`` fit started in each mode, their draws
    mixed by the modes' weights, give the exact mean and sd of ``a`` and its mass
    below zero. One fit from the heaviest mode alone missed the lighter mode's 30%."""
    model, exact = two_modes(0.3)

    def build(model, precondition):
        return ImplicitGuide(model, precondition=precondition), SteinScoreELBO()

    with pytest.warns(MultimodalPosteriorWarning):
        mixture = fit_per_mode(model, build, num_steps=500, progress=False)
    assert len(mixture.guides) == 2
    assert mixture.weights[1] == pytest.approx(exact["minor_mass"], abs=0.01)
    a = mixture.sample_posterior(4000)["a"]
    assert a.shape == (4000,)
    assert (a < 0).double().mean().item() == pytest.approx(exact["below_zero"], abs=0.02)
    assert abs(a.mean().item() - exact["mean"]) < 0.05 * exact["sd"]
    assert a.std().item() == pytest.approx(exact["sd"], rel=0.05)


class _Draws:
    """A stand-in for a fitted guide: draws of a 1-D mixture, ``inside`` of them from
    N(2, 1) and the rest from N(-2, 1)."""

    def __init__(self, inside):
        self.inside = inside

    def sample_unconstrained(self, num_samples):
        near = torch.rand(num_samples) < self.inside
        return torch.where(near, 2.0, -2.0)[:, None] + torch.randn(num_samples, 1)

    def unpack(self, u):
        return {"x": u[:, 0]}


def test_each_fit_gives_only_its_modes_draws_and_a_fit_that_left_is_refused():
    """Two modes at -2 and 2, weights 0.25 / 0.75. A fit for the mode at 2 whose draws lie
    half in the other mode gives only those in its own; a fit with almost none there is
    refused by name."""
    modes = [Preconditioner(torch.tensor([m]), scale=torch.ones(1)) for m in (2.0, -2.0)]
    state = pyro.get_param_store().get_state()
    mixture = ModeMixture([_Draws(0.5), _Draws(0.0)], [state, state], modes, [0.75, 0.25])
    x = mixture.sample_posterior(2000)["x"]
    # the modes' border, where 0.75 N(x; 2, 1) = 0.25 N(x; -2, 1)
    border = -math.log(3.0) / 4
    assert (x > border).double().mean().item() == 0.75
    assert x[x > border].mean().item() == pytest.approx(2.0, abs=0.1)
    leaving = ModeMixture([_Draws(0.01), _Draws(0.0)], [state, state], modes, [0.75, 0.25])
    with pytest.raises(RuntimeError, match="mode 0 left it"):
        leaving.sample_posterior(2000)


def test_compare_takes_a_mode_mixture_as_a_fitted_row():
    """``compare(model, methods={label: mixture})`` draws the row from the mixture, by the
    modes' weights (the way to set ``fit_per_mode`` beside NUTS and the other methods)."""
    from pyro_implicit.diagnostics import compare

    def model():
        pyro.sample("x", pyro.distributions.Normal(0.0, 3.0))

    modes = [Preconditioner(torch.tensor([m]), scale=torch.ones(1)) for m in (2.0, -2.0)]
    state = pyro.get_param_store().get_state()
    mixture = ModeMixture([_Draws(1.0), _Draws(0.0)], [state, state], modes, [0.75, 0.25])
    result = compare(
        model,
        methods={"per mode": mixture},
        nuts=False,
        num_samples=1000,
        progress=False,
        diagnostics=False,
    )
    x = result.methods["per mode"].samples["x"]
    assert x.shape == (1000,)
    assert (x > -math.log(3.0) / 4).double().mean().item() == 0.75
