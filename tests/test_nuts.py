import math
import time

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_implicit.diagnostics.nuts import (
    NUTSResult,
    _full_data_kernel,
    _full_data_space,
    check_continuous_latents,
    run_nuts,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def normal_normal(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def test_normal_normal_posterior():
    y = torch.linspace(-0.5, 2.5, 10)
    # Conjugate posterior: precision 1 + n, mean sum(y) / (1 + n).
    post_mean = float(y.sum()) / 11.0
    post_sd = 1.0 / math.sqrt(11.0)

    start = time.perf_counter()
    result = run_nuts(
        normal_normal,
        y,
        num_samples=300,
        warmup_steps=200,
        num_chains=2,
        seed=0,
        max_plate_nesting=1,
        progress_bar=False,
    )
    elapsed = time.perf_counter() - start

    assert isinstance(result, NUTSResult)
    assert set(result.samples) == {"mu"}
    assert result.samples["mu"].shape == (600,)
    assert result.samples_by_chain["mu"].shape == (2, 300)
    assert torch.equal(result.samples["mu"][300:], result.samples_by_chain["mu"][1])
    diag = result.diagnostics["mu"]
    assert diag["r_hat"].shape == () and diag["ess"].shape == ()
    assert abs(float(diag["r_hat"]) - 1.0) < 0.05
    ess = float(diag["ess"])
    assert ess > 100

    # Four Monte Carlo standard errors: sd / sqrt(ESS) for the mean and, for a Gaussian,
    # 1 / sqrt(2 ESS) relative error for the sd.
    mu = result.samples["mu"]
    assert abs(float(mu.mean()) - post_mean) < 4 * post_sd / math.sqrt(ess)
    assert abs(float(mu.std()) / post_sd - 1.0) < 4 / math.sqrt(2 * ess)
    assert result.max_r_hat == float(diag["r_hat"]) and result.min_ess == float(diag["ess"])
    assert result.num_divergences == sum(result.divergences_by_chain) == 0
    assert len(result.seeds) == 2 and result.seeds[0] != result.seeds[1]
    assert 0.0 < result.wall_time <= elapsed


def test_run_nuts_is_reproducible_and_leaves_global_rng_alone():
    y = torch.tensor([0.3, -0.1, 0.8])
    kwargs = dict(num_samples=20, warmup_steps=20, num_chains=1, max_plate_nesting=1)
    pyro.set_rng_seed(123)
    state = torch.get_rng_state()
    a = run_nuts(normal_normal, y, seed=5, progress_bar=False, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)
    b = run_nuts(normal_normal, y, seed=5, progress_bar=False, **kwargs)
    assert torch.equal(a.samples["mu"], b.samples["mu"])


def test_constrained_sites_and_model_kwargs():
    def model(y, scale=1.0):
        sigma = pyro.sample("sigma", dist.HalfNormal(scale))
        theta = pyro.sample("theta", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with pyro.plate("data", y.shape[0]):
            pyro.sample("obs", dist.Normal(theta.sum(), sigma), obs=y)

    y = torch.tensor([0.5, 1.0, 1.5])
    result = run_nuts(
        model, y, scale=2.0, num_samples=30, warmup_steps=30, num_chains=2, progress_bar=False
    )
    assert result.samples["sigma"].shape == (60,)
    assert result.samples_by_chain["theta"].shape == (2, 30, 2)
    assert bool((result.samples["sigma"] > 0).all())  # returned in the constrained space
    assert result.diagnostics["theta"]["r_hat"].shape == (2,)


def test_discrete_latent_site_raises():
    def mixture(y):
        z = pyro.sample("z", dist.Bernoulli(0.5))
        pyro.sample("obs", dist.Normal(2.0 * z, 1.0), obs=y)

    with pytest.raises(ValueError, match="NUTS cannot sample discrete site 'z'"):
        run_nuts(mixture, torch.tensor(1.0), num_samples=10, warmup_steps=10, progress_bar=False)

    def poisson_latent(y):
        with pyro.plate("data", y.shape[0]):
            k = pyro.sample("k", dist.Poisson(3.0))
            pyro.sample("obs", dist.Normal(k, 1.0), obs=y)

    with pytest.raises(ValueError, match="discrete site 'k'"):
        check_continuous_latents(poisson_latent, torch.ones(4))


def test_observed_discrete_and_subsample_sites_are_allowed():
    def model(y):
        p = pyro.sample("p", dist.Beta(1.0, 1.0))
        with pyro.plate("data", y.shape[0], subsample_size=2) as ind:
            pyro.sample("obs", dist.Bernoulli(p), obs=y[ind])

    check_continuous_latents(model, torch.tensor([1.0, 0.0, 1.0]))


@pytest.mark.parametrize("bad", [dict(num_samples=3), dict(num_chains=0), dict(warmup_steps=-1)])
def test_invalid_counts(bad):
    with pytest.raises(ValueError):
        run_nuts(normal_normal, torch.zeros(3), progress_bar=False, **bad)


def subsampled_normal(y, subsample_size=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[0], subsample_size=subsample_size) as idx:
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y[idx])


def test_subsampled_model_is_sampled_on_its_full_data():
    """NUTS on a model that subsamples its likelihood samples the full-data posterior
    (conjugate: precision 1 + n), not a minibatch one."""
    y = torch.linspace(-0.5, 2.5, 12)
    result = run_nuts(
        subsampled_normal,
        y,
        num_samples=400,
        warmup_steps=200,
        num_chains=2,
        seed=0,
        progress_bar=False,
        subsample_size=4,
    )
    draws = result.samples["mu"]
    assert draws.shape == (800,)
    post_mean, post_sd = float(y.sum()) / 13.0, 1.0 / math.sqrt(13.0)
    ess = result.min_ess
    assert abs(float(draws.mean()) - post_mean) < 4 * post_sd / math.sqrt(ess)
    assert float(draws.std()) == pytest.approx(post_sd, rel=0.15)


def test_a_subsampled_models_potential_and_its_gradient_come_from_the_traced_graph():
    """NUTS's potential on a subsampled model is minus the full-data log-density, its
    gradient minus the score, both from the space's traced graph (the minibatches stacked)."""
    y = torch.linspace(-0.5, 2.5, 12)
    kwargs = {"subsample_size": 4}
    space = _full_data_space(subsampled_normal, (y,), kwargs, None)
    kernel, initial = _full_data_kernel(space, (y,), kwargs, {})
    u = torch.tensor([0.7], requires_grad=True)
    energy = kernel.potential_fn({"u": u})
    (grad,) = torch.autograd.grad(energy, u)
    # the conjugate full data: log N(mu; 0, 1) + sum_i log N(y_i; mu, 1)
    exact = dist.Normal(0.0, 1.0).log_prob(u) + dist.Normal(u, 1.0).log_prob(y).sum()
    (exact_grad,) = torch.autograd.grad(exact, u)
    assert energy.item() == pytest.approx(-exact.item(), rel=1e-10)
    assert grad.item() == pytest.approx(-exact_grad.item(), rel=1e-10)
    stats = space.compiled.stats
    assert space.compiled.active and stats["calls"] >= 1 and stats["stacked_traces"] == 1


def test_a_local_latent_in_a_subsampled_plate_is_refused_with_the_rewrite():
    """NUTS on the full data packs the latents in one vector, as the guides do: a local
    latent of a subsampled plate (its draws would be subsample_size slots reused for
    every minibatch) is refused, as the guides refuse it."""

    def model(y, subsample_size=None):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", y.shape[0], subsample_size=subsample_size) as idx:
            z = pyro.sample("z", dist.Normal(mu, 1.0))
            pyro.sample("obs", dist.Normal(z, 1.0), obs=y[idx])

    with pytest.raises(NotImplementedError, match="'z' is a local latent.*subsampled plate"):
        run_nuts(model, torch.zeros(12), num_samples=4, progress_bar=False, subsample_size=4)


def test_constant_coordinates_have_no_r_hat_and_weak_runs_say_why():
    """An LKJ factor's fixed entries are constant in every chain: their R-hat is nan and
    is left out of max_r_hat; a short run says why it is weak."""
    by_chain = {"x": torch.randn(2, 50, 2)}
    by_chain["x"][..., 1] = 1.0  # a constant coordinate
    result = NUTSResult(
        samples={"x": by_chain["x"].reshape(100, 2)},
        samples_by_chain=by_chain,
        diagnostics={
            "x": {
                "r_hat": torch.tensor([1.002, float("nan")]),
                "ess": torch.tensor([90.0, float("nan")]),
            }
        },
        num_divergences=0,
        wall_time=1.0,
    )
    assert result.max_r_hat == pytest.approx(1.002) and result.min_ess == pytest.approx(90.0)
    assert result.weakness() == "min ESS 90 < 400"


def test_chains_start_at_their_initial_points_and_one_per_chain_is_needed():
    """Two narrow modes 27 sds apart, which NUTS never crosses: each chain stays in the
    mode it was started in (a constrained site, so the points are unconstrained ones)."""

    def two_narrow_modes():
        scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
        terms = [dist.Normal(m, 0.3).log_prob(torch.log(scale)) for m in (-4.0, 4.0)]
        pyro.factor("modes", torch.stack(terms).logsumexp(0))

    starts = [torch.tensor([4.0]), torch.tensor([-4.0])]
    result = run_nuts(
        two_narrow_modes,
        num_samples=20,
        warmup_steps=20,
        num_chains=2,
        progress_bar=False,
        initial_points=starts,
    )
    log_scale = result.samples_by_chain["scale"].log()
    assert (log_scale[0] > 2).all() and (log_scale[1] < -2).all()
    with pytest.raises(ValueError, match="one point per chain"):
        run_nuts(two_narrow_modes, num_chains=3, progress_bar=False, initial_points=starts)
