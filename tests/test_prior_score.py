"""Function-space prior score estimators (f-POVI Sec. 3.2) against closed forms."""

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_implicit.particles import (
    FunctionSpaceSVGD,
    GaussianPriorScore,
    GPPriorScore,
    RBFCovariance,
    moment_matched_score,
)


def _random_gaussian(d):
    a = torch.randn(d, d)
    cov = a @ a.T / d + 0.5 * torch.eye(d)
    return torch.randn(d), cov


def test_moment_matched_score_recovers_gaussian_score():
    m, cov = _random_gaussian(4)
    samples = dist.MultivariateNormal(m, cov).sample((100_000,))
    f = m + torch.randn(7, 4)
    expected = -torch.linalg.solve(cov, (f - m).T).T
    got = moment_matched_score(f, samples, eig_min=1e-8)
    assert torch.allclose(got, expected, rtol=0.03, atol=0.03 * expected.abs().max())


def test_moment_matched_score_clips_eigenvalues():
    # k = 3 draws in d = 5 dims: a singular covariance; the clipped precision keeps it finite
    samples = torch.randn(3, 5)
    f = torch.randn(2, 5)
    got = moment_matched_score(f, samples, eig_min=0.1)
    assert torch.isfinite(got).all()
    m = samples.mean(0)
    cov = torch.cov(samples.T)
    vals, vecs = torch.linalg.eigh(cov)
    precision = vecs @ torch.diag(1 / vals.clamp(min=0.1)) @ vecs.T
    assert torch.allclose(got, -(f - m) @ precision)


def test_moment_matched_score_float32_computed_in_float64():
    m, cov = _random_gaussian(3)
    samples = dist.MultivariateNormal(m, cov).sample((500,))
    f = torch.randn(4, 3)
    exact = moment_matched_score(f, samples)
    got = moment_matched_score(f.float(), samples.float())
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_gaussian_prior_score_flattens_outputs():
    # (N, b, F) particle values; the Gaussian is fitted to the flattened b * F dims
    m, cov = _random_gaussian(6)
    draws = dist.MultivariateNormal(m, cov).sample((50,))
    calls = []

    def sample_prior(k):
        calls.append(k)
        return draws[:k].reshape(k, 3, 2)

    f = torch.randn(5, 3, 2)
    got = GaussianPriorScore(num_samples=50, eig_min=1e-3)(f, None, sample_prior)
    assert calls == [50]
    expected = moment_matched_score(f.reshape(5, 6), draws, 1e-3).reshape(5, 3, 2)
    assert torch.allclose(got, expected)


def test_gp_prior_score_matches_dense_solve():
    x = torch.randn(5, 2)
    cov_fn = RBFCovariance(lengthscale=0.7, variance=2.0)
    cov = cov_fn(x, x)
    d2 = torch.cdist(x, x).pow(2)
    assert torch.allclose(cov, 2.0 * torch.exp(-0.5 * d2 / 0.49))
    mean = torch.randn(5, 3)
    f = torch.randn(4, 5, 3)
    score = GPPriorScore(cov_fn, mean=lambda x: mean, jitter=1e-8)(f, x)
    prec = torch.linalg.inv(cov + 1e-8 * torch.eye(5))
    expected = -torch.einsum("ab,nbf->naf", prec, f - mean)
    assert torch.allclose(score, expected, rtol=1e-6, atol=1e-8)


def test_prior_draws_of_a_linear_model_match_its_gp():
    # f(x) = x @ w with w ~ N(0, s^2 I) is a GP with covariance s^2 x x^T: the moment-matched
    # score from FunctionSpaceSVGD's prior draws must approach the analytic GP score
    s = 1.5
    x = torch.randn(30, 3)

    def model(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, s).expand([3]).to_event(1))
        with pyro.plate("data", x.shape[0], dim=-1):
            f = pyro.deterministic("f", (x * w).sum(-1), event_dim=0)
            pyro.sample("obs", dist.Normal(f, 1.0), obs=y)

    gp = GPPriorScore(lambda a, b: s**2 * a @ b.T, jitter=0.0)
    mm = GaussianPriorScore(num_samples=20_000, eig_min=1e-9)
    seen = []

    def both(f, x_p, sample_prior):
        # 2 prior points in 3 input dims: the covariance is full rank
        seen.append((mm(f, x_p, sample_prior), gp(f, x_p)))
        return seen[-1][1]

    svgd = FunctionSpaceSVGD(
        model,
        pyro.optim.SGD({"lr": 0.0}),
        4,
        1,
        prior_score=both,
        prior_batch_size=2,
        nu=None,
    )
    svgd.step(x, torch.zeros(30))
    est, exact = seen[0]
    assert est.shape == exact.shape == (4, 2, 1)
    assert torch.allclose(est, exact, rtol=0.1, atol=0.05 * exact.abs().max())


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_samples"):
        GaussianPriorScore(num_samples=1)
    with pytest.raises(ValueError, match="eig_min"):
        GaussianPriorScore(eig_min=0.0)
    with pytest.raises(ValueError, match="at least 2"):
        moment_matched_score(torch.zeros(2, 3), torch.zeros(1, 3))
    with pytest.raises(ValueError, match="shape"):
        moment_matched_score(torch.zeros(2, 3), torch.zeros(4, 2))
    with pytest.raises(TypeError, match="covariance"):
        GPPriorScore(covariance=None)
    with pytest.raises(ValueError, match="positive"):
        RBFCovariance(lengthscale=0.0)
