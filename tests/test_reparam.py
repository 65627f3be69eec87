"""Non-centring (``pyro_implicit.reparam``) against closed forms: the density of the
non-centred model is the original one times the map's Jacobian, given values carry over,
the strategy picks each site's reparameteriser, and a fit of the non-centred model gives
the exact posterior of the original sites."""

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import SVI, Predictive
from pyro.infer.reparam import LocScaleReparam

from pyro_implicit import SIVI_ELBO, SemiImplicitGuide
from pyro_implicit.reparam import MultivariateNormalReparam, NonCentred

STEPS = 3


def _ar1_covariance(phi, sigma, steps=STEPS):
    """A stationary AR(1)'s covariance, sigma^2 phi^|i-j| / (1 - phi^2), batched."""
    lag = (torch.arange(steps)[:, None] - torch.arange(steps)[None, :]).abs()
    phi_, sigma_ = phi[..., None, None], sigma[..., None, None]
    return sigma_.pow(2) * phi_.pow(lag) / (1.0 - phi_.pow(2))


def funnel_path(y):
    """A latent path whose covariance is a latent scale's: an MVN funnel."""
    # neither location-scale nor transformed: only h is reparameterised
    sigma = pyro.sample("sigma", dist.Gamma(torch.tensor(4.0), 4.0))
    phi = pyro.sample("phi", dist.Beta(torch.tensor(4.0), 2.0))
    loc = torch.tensor([0.5, -0.5, 1.0])
    h = pyro.sample("h", dist.MultivariateNormal(loc, _ar1_covariance(phi, sigma)))
    pyro.sample("y", dist.Normal(h, 1.0).to_event(1), obs=y)


Y = torch.tensor([0.3, -1.2, 0.8])


def _log_det_scale_tril(trace, name):
    fn = trace.nodes[name]["fn"]
    return torch.diagonal(fn.scale_tril, dim1=-2, dim2=-1).log().sum(-1)


def test_non_centred_density_is_the_original_times_the_jacobian():
    non_centred = NonCentred()(funnel_path)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        nc = poutine.trace(non_centred).get_trace(Y)
        values = {k: nc.nodes[k]["value"] for k in ("sigma", "phi", "h")}
        centred = poutine.trace(poutine.condition(funnel_path, values)).get_trace(Y)
        # the noise's density N(eps; 0, I) = N(h; loc, L L^T) |det L|, and only there
        expected = centred.log_prob_sum() + _log_det_scale_tril(centred, "h")
        assert torch.allclose(nc.log_prob_sum(), expected, atol=1e-10)
        # and h is the map of the noise: loc + L eps
        fn = centred.nodes["h"]["fn"]
        eps = nc.nodes["h_decentered"]["value"]
        assert torch.allclose(values["h"], fn.loc + fn.scale_tril @ eps, atol=1e-12)


def test_a_low_rank_site_has_the_density_of_its_scale_tril():
    # LowRankMultivariateNormal(loc, W, D): x = loc + L eps with L L^T = W W^T + diag(D)
    def model():
        scale = pyro.sample("scale", dist.Gamma(torch.tensor(4.0), 4.0))
        factor = scale * torch.tensor([[1.0], [0.5], [-0.3]])
        pyro.sample(
            "x",
            dist.LowRankMultivariateNormal(torch.ones(STEPS), factor, scale * torch.ones(STEPS)),
        )

    non_centred = NonCentred()(model)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        nc = poutine.trace(non_centred).get_trace()
        values = {k: nc.nodes[k]["value"] for k in ("scale", "x")}
        centred = poutine.trace(poutine.condition(model, values)).get_trace()
        expected = centred.log_prob_sum() + _log_det_scale_tril(centred, "x")
        assert torch.allclose(nc.log_prob_sum(), expected, atol=1e-10)


def test_a_given_value_of_the_original_site_carries_over():
    # a model conditioned on the original site, then non-centred: the noise maps back to it
    h0 = torch.tensor([1.0, 2.0, -0.5])
    conditioned = poutine.reparam(
        poutine.condition(funnel_path, {"h": h0}), config={"h": MultivariateNormalReparam()}
    )
    trace = poutine.trace(conditioned).get_trace(Y)
    assert torch.allclose(trace.nodes["h"]["value"], h0, atol=1e-12)
    fn = trace.nodes["h"]["fn"]
    assert not isinstance(fn, dist.MultivariateNormal)  # a deterministic site now
    scale_tril = dist.MultivariateNormal(
        torch.zeros(STEPS),
        _ar1_covariance(trace.nodes["phi"]["value"], trace.nodes["sigma"]["value"]),
    ).scale_tril
    eps = trace.nodes["h_decentered"]["value"]
    assert torch.allclose(scale_tril @ eps + torch.tensor([0.5, -0.5, 1.0]), h0, atol=1e-10)
    assert trace.nodes["h_decentered"]["is_observed"]


def test_the_strategy_picks_each_sites_reparameteriser():
    def model(y):
        tau = pyro.sample("tau", dist.HalfCauchy(torch.tensor(1.0)))
        with pyro.plate("groups", 2):
            theta = pyro.sample("theta", dist.Normal(torch.zeros(2), tau))
            path = pyro.sample(
                "path",
                dist.MultivariateNormal(torch.zeros(2, STEPS), tau * torch.eye(STEPS)),
            )
        wrapped = pyro.sample(
            "wrapped", dist.MultivariateNormal(torch.zeros(2, STEPS), torch.eye(STEPS)).to_event(1)
        )
        low_rank = pyro.sample(
            "low_rank",
            dist.LowRankMultivariateNormal(
                torch.zeros(STEPS), tau * torch.ones(STEPS, 1), torch.ones(STEPS)
            ),
        )
        loc = theta[:, None] + path + wrapped + low_rank
        pyro.sample("y", dist.MultivariateNormal(loc, torch.eye(STEPS)).to_event(1), obs=y)

    strategy = NonCentred()
    trace = poutine.trace(strategy(model)).get_trace(torch.zeros(2, STEPS))
    assert isinstance(strategy.config["theta"], LocScaleReparam)
    assert strategy.config["theta"].centered == 0.0
    assert isinstance(strategy.config["path"], MultivariateNormalReparam)
    assert isinstance(strategy.config["wrapped"], MultivariateNormalReparam)
    assert isinstance(strategy.config["low_rank"], MultivariateNormalReparam)
    assert strategy.config["y"] is None  # the likelihood stays as it is
    assert trace.nodes["wrapped_decentered"]["value"].shape == (2, STEPS)
    assert trace.nodes["wrapped_decentered"]["fn"].event_dim == 2
    # Pyro's own strategy leaves the MultivariateNormal sites centred
    auto = pyro.infer.reparam.AutoReparam(centered=0.0)
    poutine.trace(auto(model)).get_trace(torch.zeros(2, STEPS))
    assert not isinstance(auto.config["path"], MultivariateNormalReparam)


def test_the_reparameteriser_refuses_other_distributions():
    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    reparam = poutine.reparam(model, config={"x": MultivariateNormalReparam()})
    with pytest.raises(TypeError, match="not a MultivariateNormal.*LocScaleReparam"):
        reparam()


def test_a_fit_of_the_non_centred_model_gives_the_exact_posterior():
    # x ~ N(m0, K), y ~ N(x, s^2 I): the posterior of x is N(C (K^-1 m0 + y / s^2), C)
    # with C = (K^-1 + I / s^2)^-1, read through Predictive from the deterministic site
    m0 = torch.tensor([1.0, -1.0, 0.0])
    k = torch.tensor([[1.0, 0.8, 0.3], [0.8, 1.0, 0.5], [0.3, 0.5, 1.0]]) * 4.0
    s = 0.7

    def model(y):
        x = pyro.sample("x", dist.MultivariateNormal(m0, k))
        pyro.sample("y", dist.Normal(x, s).to_event(1), obs=y)

    cov = torch.linalg.inv(torch.linalg.inv(k) + torch.eye(3) / s**2)
    mean = cov @ (torch.linalg.solve(k, m0) + Y / s**2)
    non_centred = NonCentred()(model)
    guide = SemiImplicitGuide(non_centred)
    svi = SVI(non_centred, guide, pyro.optim.Adam({"lr": 1e-2}), SIVI_ELBO())
    for _ in range(300):
        svi.step(Y)
    draws = Predictive(non_centred, guide=guide, num_samples=4000, return_sites=["x"])(Y)["x"]
    sd = cov.diagonal().sqrt()
    # the bar for a default fit: 0.2 sds, sd ratios within 15%
    assert ((draws.mean(0) - mean).abs() / sd).max() < 0.2
    assert ((draws.std(0) / sd) - 1.0).abs().max() < 0.15
