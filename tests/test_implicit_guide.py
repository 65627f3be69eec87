"""ImplicitGuide as a Pyro guide, and ImplicitGuide + KernelRatioELBO against exact posteriors."""

import functools
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal, init_to_value

from pyro_implicit import (
    ImplicitGuide,
    KernelRatioELBO,
    LinearizedGuide,
    SteinScoreELBO,
    VectorizationError,
)
from pyro_implicit.guides import ImplicitDelta


def fit(model, guide, *args, steps=1000, lr=1e-2, final_lr=2e-3, **elbo_kwargs):
    """SVI with a learning rate decaying geometrically to ``final_lr`` (as Pyro's own
    exactness tests do), so the last iterate is not dominated by gradient noise."""
    elbo_kwargs.setdefault("num_particles", 100)
    elbo = KernelRatioELBO(**elbo_kwargs)
    decay = (final_lr / lr) ** (1.0 / steps)
    svi = SVI(model, guide, pyro.optim.ClippedAdam({"lr": lr, "lrd": decay}), elbo)
    for _ in range(steps):
        svi.step(*args)
    return elbo


# accurate settings for small models (docs/choosing_settings.md: "Exact sites and the contrast")
ACCURATE = dict(adaptive_contrast="full", regularizer=1e-2)


# --------------------------------------------------------------------------- models
def normal_normal(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def shapes_model():
    pyro.sample("a", dist.Normal(0.0, 1.0))
    pyro.sample("b", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("p", 3):
        pyro.sample("c", dist.LogNormal(0.0, 1.0))
    pyro.sample("d", dist.MultivariateNormal(torch.zeros(2), torch.eye(2)))
    pyro.sample("e", dist.Dirichlet(torch.ones(4)))
    pyro.sample("f", dist.LKJCholesky(3, 1.0))
    pyro.sample("g", dist.Beta(2.0, 2.0).mask(False))


# --------------------------------------------------------------------------- contract
def test_trace_structure_and_scores():
    y = torch.randn(5)
    guide = ImplicitGuide(normal_normal)
    trace = poutine.trace(guide).get_trace(y)
    noise = trace.nodes[f"_{guide._pyro_name}_noise"]
    latent = trace.nodes[f"_{guide._pyro_name}_latent"]
    assert noise["infer"]["is_auxiliary"] and latent["infer"]["is_auxiliary"]
    assert isinstance(latent["fn"], ImplicitDelta)
    assert latent["infer"]["pyro_implicit"]["guide"] is guide
    with pytest.raises(NotImplementedError, match="no tractable density"):
        latent["fn"].log_prob(latent["value"])
    assert trace.nodes["mu"]["fn"].log_prob(trace.nodes["mu"]["value"]).item() == 0.0


def test_trace_elbo_refuses_instead_of_collapsing():
    guide = ImplicitGuide(normal_normal)
    svi = SVI(normal_normal, guide, pyro.optim.Adam({"lr": 0.01}), Trace_ELBO())
    with pytest.raises(NotImplementedError, match="KernelRatioELBO"):
        svi.step(torch.randn(5))


@pytest.mark.parametrize("generator", ["mlp", "mmnn"])
def test_shapes_and_constraints(generator):
    guide = ImplicitGuide(shapes_model, generator=generator)
    elbo = KernelRatioELBO(num_particles=10, max_plate_nesting=1)
    loss = SVI(shapes_model, guide, pyro.optim.Adam({"lr": 0.01}), elbo).step()
    assert math.isfinite(loss)
    draws = guide.sample_posterior(6)
    assert draws["c"].shape == (6, 3) and (draws["c"] > 0).all()
    assert torch.allclose(draws["e"].sum(-1), torch.ones(6))
    assert draws["f"].shape == (6, 3, 3)
    assert draws["g"].shape == (6,) and ((draws["g"] > 0) & (draws["g"] < 1)).all()


@pytest.mark.parametrize("parallel", [False, True])
def test_predictive_shapes(parallel):
    y = torch.randn(4)
    guide = ImplicitGuide(normal_normal)
    guide(y)
    pred = Predictive(normal_normal, guide=guide, num_samples=7, parallel=parallel)(y)
    assert pred["obs"].shape == (7, 4)
    assert pred["mu"].reshape(-1).shape == (7,)


def test_replay_under_plate_stack():
    guide = ImplicitGuide(shapes_model)
    guide()
    with pyro.plate_stack("particles", (5, 4), rightmost_dim=-2):
        trace = poutine.trace(guide).get_trace()
    assert trace.nodes["c"]["value"].shape == (5, 4, 3)
    model_trace = poutine.trace(poutine.replay(shapes_model, trace)).get_trace()
    assert model_trace.nodes["e"]["value"].shape == (5, 4, 1, 4)


def test_median_and_quantiles():
    guide = ImplicitGuide(shapes_model, init_scale=0.5)
    guide()
    median = guide.median()
    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    for name, q in quantiles.items():
        assert not q.requires_grad
        assert q.shape == (3,) + median[name].shape
        torch.testing.assert_close(q[1], median[name])  # to float rounding: another lerp
        if name not in ("e", "f"):  # elementwise monotone transforms: per coordinate
            assert (q[0] <= q[1]).all() and (q[1] <= q[2]).all()
    # simplex and Cholesky factor: per-coordinate quantiles of u mapped into the support
    assert torch.allclose(quantiles["e"].sum(-1), torch.ones(3))
    assert (quantiles["e"] > 0).all()
    rows = quantiles["f"].pow(2).sum(-1)  # rows of a correlation Cholesky factor: unit norm
    assert torch.allclose(rows, torch.ones_like(rows))
    assert (quantiles["c"] > 0).all()
    # the same draws whatever ran before (they moved with the global stream), and the
    # global stream is left where it was
    torch.randn(3)
    state = torch.get_rng_state()
    again = guide.median()
    assert torch.equal(torch.get_rng_state(), state)
    for name, value in median.items():
        assert torch.equal(again[name], value)


def test_init_loc_fn_is_honoured():
    guide = ImplicitGuide(
        normal_normal,
        precondition=False,
        init_loc_fn=init_to_value(values={"mu": torch.tensor(2.5)}),
        init_scale=0.05,
    )
    guide(torch.randn(3))
    mu = guide.sample_posterior(2000)["mu"]
    assert mu.mean().item() == pytest.approx(2.5, abs=0.02)
    assert mu.std().item() == pytest.approx(0.05, rel=0.3)


def test_state_dict_round_trip_and_serialization(assert_round_trip):
    y = torch.randn(5)
    guide = ImplicitGuide(normal_normal)
    fit(normal_normal, guide, y, steps=5, max_plate_nesting=1)
    assert_round_trip(guide, ImplicitGuide(normal_normal), (y,), "mu")


def test_seeded_runs_are_reproducible():
    y = torch.randn(5)
    losses = []
    for _ in range(2):
        pyro.clear_param_store()
        pyro.set_rng_seed(3)
        guide = ImplicitGuide(normal_normal)
        svi = SVI(
            normal_normal,
            guide,
            pyro.optim.Adam({"lr": 0.01}),
            KernelRatioELBO(num_particles=20, max_plate_nesting=1),
        )
        losses.append([svi.step(y) for _ in range(3)])
    assert losses[0] == losses[1]


# --------------------------------------------------------------------------- bad input
def test_discrete_latent_site_is_named():
    def model():
        pyro.sample("k", dist.Poisson(3.0))
        pyro.sample("x", dist.Normal(0.0, 1.0))

    with pytest.raises(ValueError, match="'k'"):
        ImplicitGuide(model)()


def test_subsampled_local_latent_is_refused():
    def model(y):
        with pyro.plate("data", len(y), subsample_size=5) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y[idx])

    with pytest.raises(NotImplementedError, match="'z'.*subsampled plate 'data'"):
        ImplicitGuide(model)(torch.randn(20))


def test_sequential_plate_is_refused():
    def model():
        for i in pyro.plate("seq", 2):
            pyro.sample(f"z{i}", dist.Normal(0.0, 1.0))

    with pytest.raises(NotImplementedError, match="sequential.*with pyro.plate"):
        ImplicitGuide(model)()


def test_nan_in_data_is_an_error():
    y = torch.tensor([0.1, float("nan"), 0.3])
    guide = ImplicitGuide(normal_normal)
    with pytest.raises(ValueError, match="obs"):
        fit(normal_normal, guide, y, steps=1, num_particles=5, max_plate_nesting=1)


def test_non_vectorisable_model_is_detected():
    x = torch.randn(12, 3)
    y = torch.randn(12)

    def model(x, y):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        mean = beta @ x.T  # shifts the particle dim: particles meet each other's sigma
        with pyro.plate("data", 12):
            pyro.sample("obs", dist.Normal(mean, sigma), obs=y)

    with pytest.raises(VectorizationError, match=r"\(x \* beta\).sum\(-1\)"):
        fit(model, ImplicitGuide(model), x, y, steps=1, num_particles=4, max_plate_nesting=1)

    def fixed(x, y):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        with pyro.plate("data", 12):
            pyro.sample("obs", dist.Normal((x * beta).sum(-1), sigma), obs=y)

    fit(fixed, ImplicitGuide(fixed), x, y, steps=1, num_particles=4, max_plate_nesting=1)


def test_a_guide_checks_vectorisation_before_its_search(monkeypatch):
    # a centred hierarchical regression whose regression term keeps a particle dim of its
    # own: the draws' log-likelihoods are summed over every draw's predictions. Called
    # outside a loss, the guide's search would fit that wrong density with no error.
    group = torch.arange(12) % 4
    x = torch.randn(12, 2)
    y = torch.randn(12)

    def model(x, group, y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("groups", 4):
            a = pyro.sample("a", dist.Normal(mu, 1.0))
        with pyro.plate("data", 12):
            mean = a[..., group] + (x * beta.unsqueeze(-2)).sum(-1)
            pyro.sample("y", dist.Normal(mean, 1.0), obs=y)

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran before the check")

    monkeypatch.setattr("pyro_implicit.guides.base.resolve_precondition", no_search)
    with pytest.raises(VectorizationError, match=r"'y'.*precondition=False"):
        ImplicitGuide(model)(x, group, y)
    # without a search nothing scores batches before a loss
    ImplicitGuide(model, precondition=False)(x, group, y)


def test_custom_generator_must_match_latent_size():
    from pyro_implicit.guides import MLPGenerator

    guide = ImplicitGuide(normal_normal, generator=lambda d, D: MLPGenerator(d, D + 1))
    with pytest.raises(ValueError, match="D=1"):
        guide(torch.randn(3))


# --------------------------------------------------------------------------- exact posteriors
def test_normal_normal_posterior():
    y = torch.randn(10) + 1.0
    post_var = 1.0 / (1.0 + len(y))
    post_mean = post_var * y.sum()
    guide = ImplicitGuide(normal_normal)
    fit(normal_normal, guide, y, steps=1000, max_plate_nesting=1, **ACCURATE)
    mu = guide.sample_posterior(10000)["mu"]
    assert mu.mean().item() == pytest.approx(post_mean.item(), abs=0.15 * post_var**0.5)
    assert mu.std().item() == pytest.approx(post_var**0.5, rel=0.15)


def test_normal_normal_posterior_paper_estimator():
    # KIVI's own estimator (prior samples). At the paper's lambda = 1e-3 it is unstable on
    # this 1-D model (the spread collapses and recovers; docs/choosing_settings.md, "Exact
    # sites and the contrast"); at lambda = 0.1 it is stable with the lambda-dependent
    # shrinkage the paper discusses.
    y = torch.randn(10) + 1.0
    post_var = 1.0 / (1.0 + len(y))
    post_mean = post_var * y.sum()
    guide = ImplicitGuide(normal_normal)
    fit(normal_normal, guide, y, steps=1000, max_plate_nesting=1, regularizer=0.1)
    mu = guide.sample_posterior(10000)["mu"]
    assert abs(mu.mean().item() - post_mean.item()) < 1.0 * post_var**0.5
    assert 0.5 < mu.std().item() / post_var**0.5 < 1.3


def blr_problem(d=5, n=20):
    torch.manual_seed(0)
    mix = 0.5 * torch.randn(d, d) + torch.eye(d)
    x = torch.randn(n, d) @ mix
    y = x @ torch.randn(d) + torch.randn(n)

    def model(x, y):
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal((x * beta).sum(-1), 1.0), obs=y)

    cov = torch.linalg.inv(torch.eye(d) + x.T @ x)
    return model, x, y, cov @ x.T @ y, cov


def _corr(cov):
    sd = cov.diagonal().sqrt()
    return cov / sd[:, None] / sd


def test_bayesian_linear_regression_captures_correlation_autonormal_cannot():
    model, x, y, mean, cov = blr_problem()
    sd = cov.diagonal().sqrt()
    guide = ImplicitGuide(model)
    fit(model, guide, x, y, steps=1500, max_plate_nesting=1, **ACCURATE)
    beta = guide.sample_posterior(20000)["beta"]
    q_cov = torch.cov(beta.T)
    assert ((beta.mean(0) - mean) / sd).abs().max() < 0.25
    ratio = q_cov.diagonal().sqrt() / sd
    assert ((ratio > 0.7) & (ratio < 1.2)).all(), ratio
    implicit_error = (_corr(q_cov) - _corr(cov)).abs().max()

    pyro.clear_param_store()
    mean_field = AutoNormal(model)
    svi = SVI(
        model,
        mean_field,
        pyro.optim.Adam({"lr": 0.02}),
        Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1),
    )
    for _ in range(300):  # its correlations are zero by construction, at any step
        svi.step(x, y)
    draws = Predictive(model, guide=mean_field, num_samples=5000, return_sites=["beta"])(x, y)
    mf_error = (_corr(torch.cov(draws["beta"].reshape(5000, -1).T)) - _corr(cov)).abs().max()
    assert mf_error > 0.8  # mean field cannot represent the 0.9 correlation
    assert implicit_error < 0.3 and implicit_error < 0.5 * mf_error


def test_gamma_poisson_constrained_posterior():
    counts = torch.tensor([3.0, 5.0, 2.0, 6.0, 4.0])

    def model(counts):
        rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", len(counts)):
            pyro.sample("obs", dist.Poisson(rate), obs=counts)

    guide = ImplicitGuide(model)
    fit(model, guide, counts, steps=1000, max_plate_nesting=1, **ACCURATE)
    rate = guide.sample_posterior(10000)["rate"]
    exact = dist.Gamma(2.0 + counts.sum(), 1.0 + len(counts))
    assert rate.mean().item() == pytest.approx(exact.mean.item(), abs=0.15 * exact.stddev.item())
    # the kernel KL estimate is biased upward by ~0.1 nat here, which narrows q by up to
    # ~15% (measured over seeds 0-2); 20% separates that from a wrong entropy term
    assert rate.std().item() == pytest.approx(exact.stddev.item(), rel=0.2)


def test_beta_bernoulli_constrained_posterior():
    flips = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])

    def model(flips):
        p = pyro.sample("p", dist.Beta(2.0, 2.0))
        with pyro.plate("data", len(flips)):
            pyro.sample("obs", dist.Bernoulli(p), obs=flips)

    guide = ImplicitGuide(model)
    fit(model, guide, flips, steps=1000, max_plate_nesting=1, **ACCURATE)
    p = guide.sample_posterior(10000)["p"]
    exact = dist.Beta(2.0 + flips.sum(), 2.0 + len(flips) - flips.sum())
    assert p.mean().item() == pytest.approx(exact.mean.item(), abs=0.15 * exact.stddev.item())
    assert p.std().item() == pytest.approx(exact.stddev.item(), rel=0.2)
    assert (p > 0).all() and (p < 1).all()


def test_subsampled_likelihood_gives_the_full_batch_posterior():
    torch.manual_seed(1)
    y = torch.randn(40) + 0.5

    def model(y, subsample_size=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y), subsample_size=subsample_size) as idx:
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])

    post_var = 1.0 / (1.0 + len(y))
    post_mean = post_var * y.sum()
    guide = ImplicitGuide(model)
    fit(model, guide, y, 10, steps=2000, final_lr=5e-4, max_plate_nesting=1, **ACCURATE)
    mu = guide.sample_posterior(10000)["mu"]
    # minibatch noise in the gradient: tolerances are wider than the full-batch test's
    assert mu.mean().item() == pytest.approx(post_mean.item(), abs=0.3 * post_var**0.5)
    assert mu.std().item() == pytest.approx(post_var**0.5, rel=0.25)


def test_torch_native_training_through_elbo_module():
    # Pyro's ELBOModule path: elbo(model, guide) is an nn.Module trained with torch.optim
    y = torch.randn(5) + 2.0
    guide = ImplicitGuide(normal_normal)
    module = KernelRatioELBO(num_particles=100, max_plate_nesting=1, **ACCURATE)(
        normal_normal, guide
    )
    module(y)
    optim = torch.optim.Adam(module.parameters(), lr=0.02)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.1 ** (1 / 800))
    for _ in range(800):
        optim.zero_grad()
        module(y).backward()
        optim.step()
        schedule.step()
    post_mean, post_sd = (y.sum() / 6).item(), 6**-0.5
    mu = guide.sample_posterior(4000)["mu"]
    assert mu.mean().item() == pytest.approx(post_mean, abs=0.3 * post_sd)
    assert mu.std().item() == pytest.approx(post_sd, rel=0.25)


def _two_coefficients():
    pyro.sample("x", dist.Normal(torch.zeros(2), torch.tensor([1.0, 3.0])).to_event(1))


@pytest.mark.parametrize(
    "loss, precondition, parametrization, layers",
    [
        ("KernelRatioELBO", True, "auto", "scaled"),  # the ratio estimate asks for them
        ("SteinScoreELBO", True, "auto", "standard"),
        ("KernelRatioELBO", False, "auto", "standard"),  # raw space: the paper's generator
        ("KernelRatioELBO", True, "standard", "standard"),
        ("SteinScoreELBO", True, "scaled", "scaled"),
        ("SteinScoreELBO", True, "ntk", "ntk"),
    ],
)
def test_the_loss_that_builds_the_guide_picks_its_layers(
    loss, precondition, parametrization, layers
):
    pyro.clear_param_store()
    guide = ImplicitGuide(
        _two_coefficients, precondition=precondition, parametrization=parametrization
    )
    _check_built_layers(guide, loss, layers)


def _check_built_layers(guide, loss, layers, evaluate_first=False):
    """The guide, first run by the loss named ``loss`` (a ``loss()`` evaluation, then one
    SVI step, with ``evaluate_first``; else the step alone), has ``layers``, in its
    attribute, in the parameters it stored and in its generator's output multiplier."""
    import pyro_implicit

    elbo = getattr(pyro_implicit, loss)(num_particles=10)
    if evaluate_first:
        elbo.loss(_two_coefficients, guide)  # a first call that only evaluates builds it too
        assert guide.layers == layers
    SVI(_two_coefficients, guide, pyro.optim.Adam({"lr": 1e-2}), elbo).step()
    assert guide.layers == layers
    assert guide.scaled_layers is (layers != "standard")
    names = list(pyro.get_param_store().keys())
    assert any(n.endswith("raw_weight") for n in names) is (layers != "standard")
    generator = getattr(guide.generator, "net", guide.generator)  # gpvi's skip generator
    width = generator.output.in_features
    expected = {"standard": None, "scaled": 1.0 / width, "ntk": width**-0.5}[layers]
    assert getattr(generator.output, "multiplier", None) == pytest.approx(expected)


@pytest.mark.parametrize(
    "loss, parametrization, layers",
    [
        ("GPVI_ELBO", "auto", "ntk"),  # GPVI asks for them (stochastic volatility ran away)
        ("GPVI_ELBO", "standard", "standard"),
        ("AmortizedSVGD_ELBO", "auto", "standard"),
    ],
)
def test_a_generator_factory_gets_the_layers_its_loss_asks_for(loss, parametrization, layers):
    """``gpvi_generator()`` is a factory, not the default MLP: the guide passes it the
    parametrization it resolved, so GPVI's skip generator gets scaled layers as well."""
    from pyro_implicit.guides.implicit import gpvi_generator

    pyro.clear_param_store()
    guide = ImplicitGuide(
        _two_coefficients, generator=gpvi_generator(), parametrization=parametrization
    )
    _check_built_layers(guide, loss, layers, evaluate_first=True)


@pytest.mark.parametrize(
    "parametrization, layers",
    [("auto", "ntk"), ("standard", "standard"), ("scaled", "scaled")],
)
def test_livi_asks_its_linearized_guide_for_ntk_layers(parametrization, layers):
    """LIVI's generator, whose Jacobian enters the entropy, gets its own layers."""
    pyro.clear_param_store()
    guide = LinearizedGuide(_two_coefficients, parametrization=parametrization)
    _check_built_layers(guide, "LIVI_ELBO", layers, evaluate_first=True)


@pytest.mark.parametrize(
    "guide_name, loss, layers",
    [
        ("ImplicitGuide", "KernelRatioELBO", "scaled"),
        ("LinearizedGuide", "LIVI_ELBO", "ntk"),
        ("ImplicitGuide", "SteinScoreELBO", "standard"),
    ],
)
def test_a_guide_looked_at_before_its_loss_gets_the_loss_layers(guide_name, loss, layers):
    """A guide called first outside any loss (here by ``Predictive``, as a user looks at
    it) is rebuilt by its first loss with that loss's layers, as if the loss had built
    it (KIVI's fit of the conjugate Normal ended 0.22 sds off with standard layers,
    ``called_first.md``), in the same parameter tensors."""
    import pyro_implicit

    pyro.clear_param_store()
    guide = getattr(pyro_implicit, guide_name)(_two_coefficients)
    Predictive(_two_coefficients, guide=guide, num_samples=3)()
    assert guide.layers == "standard"
    looked_at = list(guide.parameters())  # e.g. handed to a torch optimiser
    _check_built_layers(guide, loss, layers)
    store = pyro.get_param_store()
    assert all(store._params[n] is p for n, p in guide._param_store_names().items())
    assert all(a is b for a, b in zip(guide.parameters(), looked_at, strict=True))


@pytest.mark.parametrize("change", ["a step", "in place"])
def test_a_changed_guide_keeps_its_layers_under_another_loss(change):
    """Once anything has changed its weights (a loss's step, one's own optimiser), a
    guide keeps its layers, whatever the next loss asks for: the weights are the fit."""
    pyro.clear_param_store()
    guide = ImplicitGuide(_two_coefficients)
    guide()  # built outside any loss: standard layers
    optim = pyro.optim.Adam({"lr": 1e-2})
    if change == "a step":
        SVI(_two_coefficients, guide, optim, SteinScoreELBO(num_particles=10)).step()
    else:
        with torch.no_grad():
            next(iter(guide.parameters())).add_(0.01)
    weights = guide._param_store_names()
    SVI(_two_coefficients, guide, optim, KernelRatioELBO(num_particles=10)).step()
    assert guide.layers == "standard"
    assert all(p is weights[n] for n, p in guide._param_store_names().items())


def _kivi_trained_guide():
    """An ``ImplicitGuide`` after one ``KernelRatioELBO`` step: built with scaled layers."""
    pyro.clear_param_store()
    guide = ImplicitGuide(_two_coefficients)
    SVI(
        _two_coefficients,
        guide,
        pyro.optim.Adam({"lr": 1e-2}),
        KernelRatioELBO(num_particles=10),
    ).step()
    return guide


def _saved_and_loaded_kivi_fit(tmp_path):
    """Five seeded draws of :func:`_kivi_trained_guide`, whose store was then saved,
    cleared and loaded again (as in a fresh process)."""
    guide = _kivi_trained_guide()
    pyro.set_rng_seed(1)
    draws = guide.sample_posterior(5)["x"]
    pyro.get_param_store().save(tmp_path / "store.pt")
    pyro.clear_param_store()
    pyro.get_param_store().load(tmp_path / "store.pt")
    return draws


def test_a_restored_guide_keeps_the_layers_it_was_trained_with(tmp_path):
    draws = _saved_and_loaded_kivi_fit(tmp_path)
    restored = ImplicitGuide(_two_coefficients)
    restored()  # built outside any loss: the store says scaled
    assert restored.scaled_layers
    pyro.set_rng_seed(1)
    torch.testing.assert_close(restored.sample_posterior(5)["x"], draws)
    with pytest.raises(ValueError, match="parametrization must be one of"):
        ImplicitGuide(_two_coefficients, parametrization="mup")


def test_a_guide_loaded_from_a_state_dict_keeps_its_scaled_layers():
    guide = _kivi_trained_guide()
    state = guide.state_dict()
    pyro.clear_param_store()
    restored = ImplicitGuide(_two_coefficients)
    restored.load_state_dict(state)  # before its first call, outside any loss
    restored()
    assert restored.scaled_layers
    pyro.set_rng_seed(1)
    draws = guide.sample_posterior(5)["x"]
    pyro.set_rng_seed(1)
    torch.testing.assert_close(restored.sample_posterior(5)["x"], draws)


def _livi_trained_guide():
    """A ``LinearizedGuide`` after one ``LIVI_ELBO`` step: built with ntk layers."""
    from pyro_implicit import LIVI_ELBO

    pyro.clear_param_store()
    guide = LinearizedGuide(_two_coefficients)
    SVI(_two_coefficients, guide, pyro.optim.Adam({"lr": 1e-2}), LIVI_ELBO()).step()
    assert guide.layers == "ntk"
    return guide


def _saved_and_restored(guide, build, path, tmp_path, *args):
    """``guide``'s seeded draws, and a fresh guide from ``build()`` restored from its state
    by ``path`` (the param store through a file, or ``state_dict``), called on ``args``
    (outside any loss)."""
    pyro.set_rng_seed(1)
    draws = guide.sample_posterior(5)
    state = guide.state_dict()
    pyro.get_param_store().save(tmp_path / "store.pt")
    pyro.clear_param_store()
    restored = build()
    if path == "param_store":
        pyro.get_param_store().load(tmp_path / "store.pt")
    else:
        restored.load_state_dict(state)
    restored(*args)
    return draws, restored


def _assert_seeded_draws(guide, draws):
    pyro.set_rng_seed(1)
    for name, value in guide.sample_posterior(5).items():
        torch.testing.assert_close(value, draws[name])


@pytest.mark.parametrize("path", ["param_store", "state_dict"])
def test_a_restored_guide_keeps_its_ntk_layers(path, tmp_path):
    # scaled and ntk layers store the same parameter names: the saved code tells them apart
    build = functools.partial(LinearizedGuide, _two_coefficients)
    draws, restored = _saved_and_restored(_livi_trained_guide(), build, path, tmp_path)
    assert restored.layers == "ntk"
    _assert_seeded_draws(restored, draws)


@pytest.mark.parametrize("guide_class", [ImplicitGuide, LinearizedGuide])
@pytest.mark.parametrize("path", ["param_store", "state_dict"])
def test_a_restored_guide_rebuilds_the_noise_it_was_saved_with(guide_class, path, tmp_path):
    """A guide built with other noise than its default (here a network's, whose weights
    are marked) rebuilds the size it was saved with when restored, not the default for
    the restored model (here unmarked: noise of D), and draws as the saved guide did."""
    from pyro_implicit.guides.base import network_noise_dim
    from pyro_implicit.latent import NETWORK_WEIGHTS, Preconditioner

    dim = 300
    x, y = torch.randn(20, dim), torch.randn(20)

    def wide(network):
        def model(x, y):
            prior = dist.Normal(0.0, 1.0).expand([dim]).to_event(1)
            beta = pyro.sample("beta", prior, infer={NETWORK_WEIGHTS: network})
            with pyro.plate("data", y.shape[-1]):
                pyro.sample("obs", dist.Normal((x * beta).sum(-1), 1.0), obs=y)

        return model

    fit = Preconditioner(torch.zeros(dim), scale_tril=0.1 * torch.eye(dim), source="gaussian_vi")
    pyro.clear_param_store()
    guide = guide_class(wide(True), precondition=fit)
    guide(x, y)
    assert guide.noise_dim == network_noise_dim(dim)
    build = functools.partial(guide_class, wide(False))
    draws, restored = _saved_and_restored(guide, build, path, tmp_path, x, y)
    assert restored.noise_dim == guide.noise_dim
    _assert_seeded_draws(restored, draws)


@pytest.mark.parametrize("precondition", [False, "another"])
def test_weights_saved_around_a_preconditioner_refuse_a_guide_without_it(precondition, tmp_path):
    """Weights act in their preconditioner's coordinates: a guide built with
    ``precondition=False`` (or another preconditioner) on a loaded store drew from them as
    if raw, far from the saved fit, with no error."""
    from pyro_implicit.latent import Preconditioner

    draws = _saved_and_loaded_kivi_fit(tmp_path)
    if precondition == "another":
        precondition = Preconditioner(torch.zeros(2), scale=torch.ones(2))
    with pytest.raises(ValueError, match="precondition=True"):
        ImplicitGuide(_two_coefficients, precondition=precondition)()
    restored = ImplicitGuide(_two_coefficients)
    restored()
    pyro.set_rng_seed(1)
    torch.testing.assert_close(restored.sample_posterior(5)["x"], draws)


def test_weights_saved_with_other_layers_are_refused(tmp_path):
    state = _livi_trained_guide().state_dict()
    pyro.get_param_store().save(tmp_path / "store.pt")
    pyro.clear_param_store()
    restored = LinearizedGuide(_two_coefficients, parametrization="scaled")
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match="parametrization='ntk'"):
        restored()
    pyro.clear_param_store()  # the same through a loaded param store
    pyro.get_param_store().load(tmp_path / "store.pt")
    with pytest.raises(ValueError, match="parametrization='ntk'"):
        LinearizedGuide(_two_coefficients, parametrization="scaled")()
    built = _kivi_trained_guide()  # scaled layers, built: the check after the first call
    with pytest.raises(ValueError, match="'ntk' layers"):
        built.load_state_dict({**built.state_dict(), "layer_code": state["layer_code"]})


def _hierarchical_normal():
    """Normal means with a known group scale, ``theta_j ~ N(mu, tau^2)``, and their exact
    Gaussian posterior over ``(mu, theta)``."""
    y = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    sigma = torch.tensor([1.0, 0.5, 2.0, 1.0], dtype=torch.float64)
    prior_sd, tau = 3.0, 2.0

    def model():
        mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0, dtype=torch.float64), prior_sd))
        with pyro.plate("groups", len(y)):
            theta = pyro.sample("theta", dist.Normal(mu, tau))
            pyro.sample("obs", dist.Normal(theta, sigma), obs=y)

    num = len(y) + 1  # (mu, theta_1..J): prior covariance, then Bayes' rule
    prior_cov = torch.full((num, num), prior_sd**2, dtype=torch.float64)
    prior_cov[1:, 1:] += tau**2 * torch.eye(len(y), dtype=torch.float64)
    noise = torch.cat([torch.zeros(1, dtype=torch.float64), sigma.pow(-2)])
    cov = torch.linalg.inv(torch.linalg.inv(prior_cov) + torch.diag(noise))
    mean = cov @ torch.cat([torch.zeros(1, dtype=torch.float64), y / sigma**2])
    return model, mean, cov


def test_a_non_centred_model_gives_the_exact_posterior_of_its_original_sites():
    """Pyro's own non-centring (``poutine.reparam`` with ``AutoReparam(centered=0.0)``, the
    README's advice for funnels) turns ``mu`` and ``theta`` into deterministic functions of
    new latents: the guide must fit those, and ``Predictive`` must return the original
    sites with their exact posterior (measured at seeds 0-2: mean error 0.04-0.05 sd, sd
    ratios 0.93-0.97; the same draws are 0.82-0.85 sd off the posterior of tau = 1
    instead of 2)."""
    from pyro.infer.reparam.strategies import AutoReparam

    from pyro_implicit import SteinScoreELBO

    model, mean, cov = _hierarchical_normal()
    non_centred = poutine.reparam(model, config=AutoReparam(centered=0.0))
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = ImplicitGuide(non_centred)
    svi = SVI(non_centred, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(1000):
        svi.step()
    assert set(guide._unconstrained_shapes) == {"mu_decentered", "theta_decentered"}
    with torch.no_grad():
        out = Predictive(non_centred, guide=guide, num_samples=4000, return_sites=["mu", "theta"])()
    draws = torch.cat([out["mu"].reshape(-1, 1), out["theta"].reshape(4000, -1)], dim=-1)
    sd = cov.diagonal().sqrt()
    assert ((draws.mean(0) - mean).abs() / sd).max() < 0.15
    ratio = draws.std(0) / sd
    assert 0.85 < ratio.min() and ratio.max() < 1.15
