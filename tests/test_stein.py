"""The kernel Stein discrepancy against closed forms and an independent Stein kernel."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_implicit import ImplicitGuide, KernelRatioELBO, WeightSpaceSVGD
from pyro_implicit.diagnostics import stein_discrepancy
from pyro_implicit.diagnostics.stein import imq_stein_kernel_sums
from pyro_implicit.latent import Preconditioner


def autograd_stein_kernel(x, y, sx, sy, c=1.0, beta=-0.5):
    """k_p(x, y) of one pair from the base kernel's derivatives taken by autograd (not
    from the closed form the library uses)."""
    x = x.clone().requires_grad_(True)
    y = y.clone().requires_grad_(True)
    k = (c**2 + (x - y).pow(2).sum()).pow(beta)
    (gx, gy) = torch.autograd.grad(k, (x, y), create_graph=True)
    trace = sum(torch.autograd.grad(gx[i], y, retain_graph=True)[0][i] for i in range(len(x)))
    return (sx @ sy) * k.detach() + sx @ gy.detach() + sy @ gx.detach() + trace.detach()


def test_kernel_sums_match_autograd_stein_kernel():
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(12, 3, generator=g) + 10  # far from 0: the centring must hold
    s = torch.randn(12, 3, generator=g)
    total, diagonal = imq_stein_kernel_sums(x, s)
    pairs = torch.stack(
        [
            torch.stack([autograd_stein_kernel(x[i], x[j], s[i], s[j]) for j in range(12)])
            for i in range(12)
        ]
    )
    assert total.item() == pytest.approx(pairs.sum().item(), rel=1e-10)
    assert diagonal.item() == pytest.approx(pairs.diagonal().sum().item(), rel=1e-10)


def normal_model(loc=0.0, scale=1.0):
    def model():
        pyro.sample("x", dist.Normal(torch.tensor(loc), scale))

    return model


def test_population_ksd_matches_quadrature():
    """1-D target N(0, 1), draws from N(0.5, 0.8^2): the U-statistic of 3000 draws against
    KSD^2 = E k_p(x, y) by 40 x 40 Gauss-Hermite quadrature of the autograd Stein kernel."""
    mu, sd = 0.5, 0.8
    nodes, weights = (torch.from_numpy(a) for a in np.polynomial.hermite_e.hermegauss(40))
    weights = weights / weights.sum()
    pts = mu + sd * nodes
    population = 0.0
    for i in range(40):
        for j in range(40):
            kp = autograd_stein_kernel(
                pts[i : i + 1], pts[j : j + 1], -pts[i : i + 1], -pts[j : j + 1]
            )
            population += weights[i] * weights[j] * kp
    draws = {"x": mu + sd * torch.randn(3000)}
    result = stein_discrepancy(normal_model(), draws)
    assert population > 0.02  # far enough from 0 for a relative check
    assert result.ksd_squared_unbiased == pytest.approx(float(population), rel=0.15)


def test_exact_draws_tend_to_zero_and_wrong_draws_do_not():
    scale = torch.tensor([1.0, 2.0, 0.5])

    def model():
        pyro.sample("x", dist.Normal(torch.zeros(3), scale).to_event(1))
        pyro.sample("y", dist.LogNormal(0.0, 1.0))

    def draws(num, shift=0.0, spread=1.0):
        return {
            "x": spread * scale * torch.randn(num, 3) + shift * scale,
            "y": torch.randn(num).exp(),
        }

    small, large = (stein_discrepancy(model, draws(n)) for n in (100, 1600))
    # rate 1/sqrt(S): 16x the draws, a quarter of the discrepancy
    assert large.ksd / small.ksd == pytest.approx(0.25, rel=0.3)
    assert 0.75 < large.ratio_to_noise < 1.3
    assert abs(large.ksd_squared_unbiased) < 3 * large.noise_level**2
    shifted = stein_discrepancy(model, draws(1600, shift=0.5))
    narrow = stein_discrepancy(model, draws(1600, spread=0.6))
    for wrong in (shifted, narrow):
        assert wrong.ratio_to_noise > 3
        assert wrong.ksd_squared_unbiased > 10 * large.noise_level**2


def test_invariant_to_a_constraint_transform():
    """Computed in unconstrained space: a Normal site and a LogNormal site with the same
    unconstrained draws give the same discrepancy."""
    u = 0.3 + 1.2 * torch.randn(500)

    def lognormal_model():
        pyro.sample("x", dist.LogNormal(torch.tensor(0.0), 1.0))

    real = stein_discrepancy(normal_model(), {"x": u})
    positive = stein_discrepancy(lognormal_model, {"x": u.exp()})
    assert positive.ksd == pytest.approx(real.ksd, rel=1e-8)


def test_preconditioner_coordinates():
    """A coordinate with posterior sd 1000, whitened by a preconditioner of scale 1000,
    scores as the unit-scale problem does in raw coordinates."""
    z = torch.randn(400) + 0.2
    unit = stein_discrepancy(normal_model(), {"x": z})
    wide = normal_model(scale=1000.0)
    pre = Preconditioner(loc=torch.zeros(1), scale=torch.tensor([1000.0]))
    whitened = stein_discrepancy(wide, {"x": 1000.0 * z}, preconditioner=pre)
    raw = stein_discrepancy(wide, {"x": 1000.0 * z})
    assert whitened.whitened and not raw.whitened
    assert whitened.ksd == pytest.approx(unit.ksd, rel=1e-8)
    # raw units hide the shift (at the noise level): why the coordinates matter
    assert raw.ratio_to_noise < 1.1 and unit.ratio_to_noise > 2


def test_model_preconditioner_is_the_same_whatever_ran_before(quartic_model):
    """The coordinates' search starts from prior medians drawn at ``seed``: the random
    streams' state beforehand moved its location (by 4e-6 on this model, enough for a
    row's KSD in ``compare`` to depend on the rows run before it), and it leaves them as
    they were."""
    from pyro_implicit.diagnostics.stein import model_preconditioner

    found = []
    for stream in (1, 2):
        pyro.set_rng_seed(stream)
        before = torch.randn(1)
        pyro.set_rng_seed(stream)
        found.append(model_preconditioner(quartic_model, max_plate_nesting=0))
        assert torch.equal(torch.randn(1), before)
    assert torch.equal(found[0].loc, found[1].loc)
    assert torch.equal(found[0].scale_tril, found[1].scale_tril)
    other = model_preconditioner(quartic_model, max_plate_nesting=0, seed=1)
    assert not torch.equal(other.loc, found[0].loc)


def test_guides_and_particles():
    """Draws of an implicit guide and of a particle set are scored in their own
    preconditioner's coordinates; nonsense input is refused."""
    y = torch.tensor([0.5, 1.5, 1.0])

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 1.0))
        with pyro.plate("data", 3):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    guide = ImplicitGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), KernelRatioELBO())
    svi.step(y)
    result = stein_discrepancy(model, guide, y, num_samples=200)
    assert result.num_draws == 200 and result.whitened and math.isfinite(result.ksd)

    particles = WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}), num_particles=20)
    particles.step(y)
    result = stein_discrepancy(model, particles, y)
    assert result.num_draws == 20 and result.whitened

    with pytest.raises(ValueError, match="at least 2 draws"):
        stein_discrepancy(model, {"mu": torch.zeros(1)}, y)
    with pytest.raises(TypeError, match="Preconditioner"):
        stein_discrepancy(model, {"mu": torch.zeros(5)}, y, preconditioner="laplace")


def test_nonfinite_draws_give_infinity():
    draws = {"x": torch.tensor([0.0, 1.0, float("nan")])}
    result = stein_discrepancy(normal_model(), draws)
    assert result.ksd == math.inf and result.num_nonfinite == 1
