"""Amortised semi-implicit encoder (SIVAE, Yin & Zhou 2018 eq. 12) trained by SIVI_ELBO,
against the closed-form posterior of a linear-Gaussian latent-variable model."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO

from pyro_implicit import KernelRatioELBO
from pyro_implicit.datasets import data_dir
from pyro_implicit.elbo.sivi import SIVI_ELBO
from pyro_implicit.guides.amortized import SemiImplicitEncoder

LATENT, OBSERVED, NOISE_SD = 2, 3, 0.5


def linear_gaussian(num_points, seed=0):
    """z_i ~ N(0, I_2), x_i | z_i ~ N(W z_i, 0.5^2 I_3): per-point posterior
    N(C W^T x_i / s^2, C) with C = (I + W^T W / s^2)^{-1}."""
    rng = torch.Generator().manual_seed(seed)
    weight = torch.tensor([[1.0, 0.5], [0.8, -0.6], [0.3, 1.2]])
    z = torch.randn(num_points, LATENT, generator=rng)
    x = z @ weight.T + NOISE_SD * torch.randn(num_points, OBSERVED, generator=rng)
    cov = torch.linalg.inv(torch.eye(LATENT) + weight.T @ weight / NOISE_SD**2)
    mean = x @ weight @ cov / NOISE_SD**2  # cov is symmetric

    def model(x, subsample_size=None, subsample=None):
        with pyro.plate(
            "data", x.shape[0], subsample_size=subsample_size, subsample=subsample
        ) as idx:
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([LATENT]).to_event(1))
            loc = (z.unsqueeze(-2) * weight).sum(-1)  # W z, broadcasting over particles
            pyro.sample("x", dist.Normal(loc, NOISE_SD).to_event(1), obs=x[idx])

    def make_guide(encoder):
        def guide(x, subsample_size=None, subsample=None):
            pyro.module("encoder", encoder)
            with pyro.plate(
                "data", x.shape[0], subsample_size=subsample_size, subsample=subsample
            ) as idx:
                encoder.sample("z", x[idx])

        return guide

    return model, make_guide, x, mean, cov


def test_subsampling_scales_every_term_by_n_over_b():
    """Two of four points, subsampled: every per-particle term (likelihood, prior and the
    mixture log-density) is N/B = 2 times the term of the same two points unsubsampled,
    for the same draws."""
    model, make_guide, x, _, _ = linear_gaussian(4)
    encoder = SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(3,), hidden_dims=(8,))
    guide = make_guide(encoder)
    idx = torch.tensor([1, 3])
    elbo = SIVI_ELBO(num_particles=5, num_mixing=7, max_plate_nesting=1)
    pyro.set_rng_seed(1)
    sub = elbo._particle_terms(model, guide, (x,), {"subsample": idx}, 7)
    full_elbo = SIVI_ELBO(num_particles=5, num_mixing=7, max_plate_nesting=1)
    pyro.set_rng_seed(1)
    full = full_elbo._particle_terms(model, guide, (x[idx],), {}, 7)
    assert sub.shape == (5,)
    assert torch.allclose(sub, 2 * full, rtol=1e-10, atol=1e-10)


def test_lower_and_upper_mixtures_are_consistent_per_point():
    """For one data point, (K+1) h_lower(z) = q(z | own psi) + K h_upper(z) with the same
    extra draws (digest Sec. 10.3 item 6): the two code paths agree exactly."""
    model, make_guide, x, _, _ = linear_gaussian(1)
    encoder = SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(3,), hidden_dims=(8,))
    guide = make_guide(encoder)
    elbo = SIVI_ELBO(num_particles=3, num_mixing=4, max_plate_nesting=1)
    _, trace = elbo._traces(model, guide, (x,), {})
    site = trace.nodes["z"]
    own = encoder.conditional_log_prob(site["value"], trace.nodes["_z_mixing"]["value"], x)
    pyro.set_rng_seed(3)
    lower = elbo._local_log_mixture_density(trace, site, 4, "lower")
    pyro.set_rng_seed(3)  # the same extra draws
    upper = elbo._local_log_mixture_density(trace, site, 4, "upper")
    expected = torch.logaddexp(own.reshape(-1), math.log(4.0) + upper) - math.log(5.0)
    assert lower.shape == (3,)
    assert torch.allclose(lower, expected, atol=1e-10)


def test_trace_elbo_refuses_the_encoder():
    model, make_guide, x, _, _ = linear_gaussian(4)
    guide = make_guide(SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(2,), hidden_dims=(4,)))
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
    with pytest.raises(NotImplementedError, match="SIVI_ELBO"):
        svi.step(x)


def test_amortised_guide_recovers_the_per_point_posterior():
    """Trained with subsampling (16 of 64 points per step), the encoder's h(z | x_i)
    matches the exact Gaussian posterior at every point: means within 0.04 (RMS over
    points) and covariance entries within 0.03 of C = [[0.130, -0.022], [-0.022, 0.112]]
    (the same for all x_i)."""
    torch.manual_seed(0)
    model, make_guide, x, mean, cov = linear_gaussian(64)
    encoder = SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(4,), hidden_dims=(32,))
    guide = make_guide(encoder)
    elbo = SIVI_ELBO(num_particles=8, num_mixing=20, max_plate_nesting=1)
    steps = 800
    optim = pyro.optim.ClippedAdam({"lr": 2e-2, "lrd": 0.1 ** (1 / steps)})
    svi = SVI(model, guide, optim, elbo)
    for _ in range(steps):
        svi.step(x, subsample_size=16)
    with torch.no_grad(), poutine.block():
        with pyro.plate("draws", 2000, dim=-2):
            z = poutine.trace(guide).get_trace(x).nodes["z"]["value"]  # (2000, 64, 2)
    centred = z - z.mean(0)
    sample_cov = torch.einsum("sni,snj->nij", centred, centred) / (z.shape[0] - 1)
    mean_error = (z.mean(0) - mean).abs()
    assert mean_error.pow(2).mean().sqrt() < 0.04  # 0.020 when written
    assert mean_error.max() < 0.12  # 0.056: the amortisation gap is largest at the edges
    assert (sample_cov - cov).abs().max() < 0.03  # 0.015 when written


def test_kernel_ratio_elbo_refuses_the_encoder():
    model, make_guide, x, _, _ = linear_gaussian(4)
    guide = make_guide(SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(2,), hidden_dims=(4,)))
    loss = KernelRatioELBO(num_particles=4, max_plate_nesting=1, check_vectorization=False)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    with pytest.raises(TypeError, match="'sample'"):
        svi.step(x)


@pytest.mark.parametrize("parallel", [False, True])
def test_predictive_draws_local_latents_per_point(parallel):
    model, make_guide, x, _, _ = linear_gaussian(10)
    guide = make_guide(SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(3,), hidden_dims=(8,)))
    predictive = Predictive(model, guide=guide, num_samples=7, parallel=parallel)
    out = predictive(x)
    assert out["z"].shape == (7, 10, LATENT) and out["x"].shape == (7, 10, OBSERVED)


def _have_mnist():
    try:
        return (data_dir() / "mnist" / "t10k-images-idx3-ubyte.gz").exists()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _have_mnist(), reason="MNIST t10k files not available")
def test_mnist_benchmark_smoke(load_benchmark):
    module = load_benchmark("sivae_mnist")
    results = module.main(["--smoke"])
    for log_lik, _, _ in results.values():
        assert log_lik.shape == (20,) and torch.isfinite(log_lik).all()


def test_particle_plate_further_left_gives_the_same_terms():
    """A particle plate two dims left of the data plate (max_plate_nesting=2, as with a
    second plate in the model) aligns the K extra draws with z as at nesting 1: same
    draws, same per-particle terms."""
    model, make_guide, x, _, _ = linear_gaussian(4)
    encoder = SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(3,), hidden_dims=(8,))
    guide = make_guide(encoder)
    terms = []
    for nesting in (1, 2):
        pyro.set_rng_seed(1)
        elbo = SIVI_ELBO(num_particles=5, num_mixing=7, max_plate_nesting=nesting)
        terms.append(elbo._particle_terms(model, guide, (x,), {}, 7))
    assert torch.allclose(terms[0], terms[1], rtol=1e-10, atol=1e-10)


def test_masked_points_leave_the_objective():
    """Points masked by poutine.mask in model and guide drop out of every term, the
    mixture log-density included (as Trace_ELBO treats a guide density): changing their
    data changes nothing."""
    weight = torch.tensor([[1.0, 0.5], [0.8, -0.6], [0.3, 1.2]])
    keep = torch.tensor([True, True, False, False])

    def model(x):
        with pyro.plate("data", x.shape[0]), poutine.mask(mask=keep):
            z = pyro.sample("z", dist.Normal(0.0, 1.0).expand([LATENT]).to_event(1))
            loc = (z.unsqueeze(-2) * weight).sum(-1)
            pyro.sample("x", dist.Normal(loc, NOISE_SD).to_event(1), obs=x)

    encoder = SemiImplicitEncoder(OBSERVED, LATENT, noise_dims=(3,), hidden_dims=(8,))

    def guide(x):
        pyro.module("encoder", encoder)
        with pyro.plate("data", x.shape[0]), poutine.mask(mask=keep):
            encoder.sample("z", x)

    x = torch.randn(4, OBSERVED)
    moved = x.clone()
    moved[2:] += 3.0
    terms = []
    for data in (x, moved):
        pyro.set_rng_seed(2)
        elbo = SIVI_ELBO(num_particles=5, num_mixing=7, max_plate_nesting=1)
        terms.append(elbo._particle_terms(model, guide, (data,), {}, 7))
    assert torch.allclose(terms[0], terms[1], rtol=1e-10, atol=1e-10)
