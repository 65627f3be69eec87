import math

import numpy as np
import pytest
import scipy.stats
import torch

from pyro_implicit.diagnostics import metrics
from pyro_implicit.diagnostics.metrics import (
    compare_samples,
    correlation_error,
    correlation_rmse,
    energy_distance,
    flatten_samples,
    mmd_rbf,
    sd_ratio,
    standardized_mean_error,
    wasserstein_1d,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def normal_quantile_grid(n):
    """Deterministic 'sample' of N(0, 1): the quantiles at (i - 1/2) / n."""
    p = (torch.arange(n) + 0.5) / n
    return torch.distributions.Normal(0.0, 1.0).icdf(p)


def energy_distance_unit_shift():
    """Closed form of the 1-D energy distance between N(0, 1) and N(1, 1)."""
    # X - Y ~ N(1, 2): E|X - Y| = sqrt(2) (2 phi(a) + a (2 Phi(a) - 1)), a = 1 / sqrt(2).
    a = 1.0 / math.sqrt(2.0)
    phi = math.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + math.erf(a / math.sqrt(2.0)))
    e_xy = math.sqrt(2.0) * (2.0 * phi + a * (2.0 * cdf - 1.0))
    e_xx = 2.0 / math.sqrt(math.pi)  # X - X' ~ N(0, 2)
    return 2.0 * e_xy - 2.0 * e_xx


def test_gaussian_offset_known_answers():
    g = gen(1)
    n = 20000
    ref = torch.randn(n, 3, generator=g)
    draws = 0.5 + 2.0 * torch.randn(n, 3, generator=g)
    # Monte Carlo sd of the mean difference is sqrt(4/n + 1/n) ~ 0.016.
    assert torch.allclose(standardized_mean_error(draws, ref), torch.full((3,), 0.5), atol=0.06)
    assert torch.allclose(sd_ratio(draws, ref), torch.full((3,), 2.0), atol=0.06)
    # Equal sds: W1 between N(m1, s^2) and N(m2, s^2) is |m1 - m2|.
    shifted = 0.5 + torch.randn(n, 3, generator=g)
    w1 = wasserstein_1d(shifted, ref)
    assert torch.allclose(w1, torch.full((3,), 0.5), atol=0.05)
    # Standardisation is by the reference sd.
    assert torch.allclose(wasserstein_1d(3 * shifted, 3 * ref), w1, rtol=1e-10)
    raw = wasserstein_1d(shifted, ref, standardize=False)
    assert torch.allclose(wasserstein_1d(3 * shifted, 3 * ref, standardize=False), 3 * raw)


def test_identical_samples_give_zero():
    g = gen(2)
    x = torch.randn(500, 4, generator=g) @ torch.randn(4, 4, generator=g)
    assert torch.equal(standardized_mean_error(x, x), torch.zeros(4))
    assert torch.allclose(sd_ratio(x, x), torch.ones(4))
    assert torch.equal(wasserstein_1d(x, x), torch.zeros(4))
    assert float(correlation_error(x, x)) < 1e-12
    assert float(correlation_rmse(x, x)) < 1e-12
    # U-statistic within terms: exactly -2 mean|X - X'| / n for a set against itself.
    ed = float(energy_distance(x, x))
    assert -0.02 < ed <= 0.0
    assert abs(float(mmd_rbf(x, x))) < 0.01


def test_same_distribution_energy_distance_near_zero():
    g = gen(3)
    x = torch.randn(500, 3, generator=g)
    y = torch.randn(500, 3, generator=g)
    assert abs(float(energy_distance(x, y))) < 0.01
    assert abs(float(mmd_rbf(x, y))) < 0.01
    assert float(energy_distance(x, y + 0.5)) > 0.1
    assert float(mmd_rbf(x, y + 0.5)) > 0.02


@pytest.mark.parametrize(
    "metric",
    [
        standardized_mean_error,
        sd_ratio,
        wasserstein_1d,
        energy_distance,
        mmd_rbf,
        correlation_error,
        correlation_rmse,
    ],
)
def test_permutation_invariance(metric):
    g = gen(4)
    draws = torch.randn(300, 3, generator=g) * 1.5 + 0.2
    ref = torch.randn(250, 3, generator=g) @ torch.randn(3, 3, generator=g)
    shuffled_draws = draws[torch.randperm(300, generator=g)]
    shuffled_ref = ref[torch.randperm(250, generator=g)]
    expected = metric(draws, ref)
    actual = metric(shuffled_draws, shuffled_ref)
    assert torch.allclose(actual, expected, rtol=1e-9, atol=1e-12)


def test_energy_distance_closed_form_quantile_grid():
    # Quantile grids are near-exact samples, so the tolerance can be tight.
    q = normal_quantile_grid(1000)
    exact = energy_distance_unit_shift()
    ed = energy_distance((q + 1.0).unsqueeze(-1), q.unsqueeze(-1), standardize=False)
    assert abs(float(ed) - exact) < 0.005
    # The reference grid has sd ~ 1, so standardising changes little.
    ed = energy_distance((q + 1.0).unsqueeze(-1), q.unsqueeze(-1))
    assert abs(float(ed) - exact) < 0.01


def test_energy_distance_closed_form_monte_carlo():
    g = gen(5)
    x = torch.randn(1000, 1, generator=g)
    y = 1.0 + torch.randn(1000, 1, generator=g)
    # Monte Carlo sd of the estimate at n = 1000 is ~0.05.
    assert abs(float(energy_distance(y, x, standardize=False)) - energy_distance_unit_shift()) < 0.2


def test_energy_distance_chunking_and_subsampling(monkeypatch):
    g = gen(6)
    x = torch.randn(300, 4, generator=g)
    y = torch.randn(200, 4, generator=g) + 0.3
    full = energy_distance(x, y)
    monkeypatch.setattr(metrics, "_MAX_CHUNK_ELEMENTS", 1000)
    assert torch.allclose(energy_distance(x, y), full, rtol=1e-10)
    monkeypatch.undo()
    # Subsampling is deterministic in the seed and leaves the global RNG alone.
    state = torch.get_rng_state()
    a = energy_distance(x, y, max_samples=100, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, energy_distance(x, y, max_samples=100, seed=1))
    assert not torch.equal(a, energy_distance(x, y, max_samples=100, seed=2))


@pytest.mark.parametrize("sizes", [(7, 5), (100, 37), (1, 4), (250, 1000)])
def test_wasserstein_matches_scipy(sizes):
    s, r = sizes
    g = gen(7)
    draws = torch.randn(s, 3, generator=g)
    ref = 1.0 + 2.0 * torch.randn(r, 3, generator=g)
    w1 = wasserstein_1d(draws, ref, standardize=False)
    expected = [scipy.stats.wasserstein_distance(draws[:, d], ref[:, d]) for d in range(3)]
    np.testing.assert_allclose(w1.numpy(), expected, rtol=1e-12, atol=1e-12)
    std = wasserstein_1d(draws, ref)
    np.testing.assert_allclose(std.numpy(), (w1 / ref.std(0)).numpy(), rtol=1e-12)


def test_correlation_error_bivariate():
    g = gen(8)
    n, rho = 5000, 0.8
    z = torch.randn(n, 2, generator=g)
    correlated = torch.stack([z[:, 0], rho * z[:, 0] + math.sqrt(1 - rho**2) * z[:, 1]], -1)
    independent = torch.randn(n, 2, generator=g)
    assert abs(float(correlation_error(correlated, independent)) - rho) < 0.05
    # With D = 2 both off-diagonal entries differ by the same amount.
    assert abs(float(correlation_rmse(correlated, independent)) - rho) < 0.05
    assert float(correlation_error(correlated[:, :1], independent[:, :1])) == 0.0
    assert float(correlation_rmse(correlated[:, :1], independent[:, :1])) == 0.0


def test_degenerate_reference_coordinates():
    g = gen(9)
    ref = torch.cat([torch.randn(50, 1, generator=g), torch.zeros(50, 1)], -1)
    draws = ref.clone()
    assert torch.equal(standardized_mean_error(draws, ref), torch.zeros(2))
    assert torch.equal(sd_ratio(draws, ref), torch.ones(2))
    draws[:, 1] = 1.0
    assert standardized_mean_error(draws, ref)[1] == math.inf
    assert wasserstein_1d(draws, ref)[1] == math.inf
    assert math.isfinite(float(energy_distance(draws, ref)))
    assert math.isfinite(float(correlation_error(draws, ref)))


def test_input_validation():
    with pytest.raises(ValueError, match="D=3"):
        standardized_mean_error(torch.zeros(5, 2), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="shape"):
        sd_ratio(torch.zeros(5, 2, 2), torch.zeros(5, 2, 2))
    # 1-D inputs are a single coordinate.
    assert wasserstein_1d(torch.arange(4.0), torch.arange(4.0) + 1).shape == (1,)


def test_flatten_samples_names_and_order():
    samples = {
        "mu": torch.arange(4.0),
        "theta": torch.arange(12.0).reshape(4, 3),
        "beta": torch.arange(16.0).reshape(4, 2, 2),
    }
    x, names = flatten_samples(samples)
    assert x.shape == (4, 8) and x.dtype == torch.float64
    assert names == [
        "mu",
        "theta[0]",
        "theta[1]",
        "theta[2]",
        "beta[0,0]",
        "beta[0,1]",
        "beta[1,0]",
        "beta[1,1]",
    ]
    assert torch.equal(x[:, 5], samples["beta"][:, 0, 1])
    by_chain = {k: v.reshape((2, 2) + v.shape[1:]) for k, v in samples.items()}
    x2, names2 = flatten_samples(by_chain, sample_dims=2)
    assert torch.equal(x2, x) and names2 == names
    with pytest.raises(ValueError, match="sample shape"):
        flatten_samples({"a": torch.zeros(4), "b": torch.zeros(5)})


def test_compare_samples_report():
    g = gen(10)
    n = 1000
    reference = {"mu": torch.randn(n, generator=g), "theta": torch.randn(n, 3, generator=g)}
    samples = {
        "mu": 0.5 + torch.randn(n, generator=g),
        "theta": 2.0 * torch.randn(n, 3, generator=g),
        "obs": torch.randn(n, 10, generator=g),  # only in the approximation: ignored
    }
    report = compare_samples(samples, reference)
    assert list(report["sites"]) == ["mu", "theta"]
    assert report["ignored"] == ["obs"]
    mu, theta, joint = report["sites"]["mu"], report["sites"]["theta"], report["joint"]
    assert mu["num_coords"] == 1 and theta["num_coords"] == 3 and joint["num_coords"] == 4
    assert abs(mu["mean_error_max"] - 0.5) < 0.1
    assert abs(mu["sd_ratio_median"] - 1.0) < 0.1
    assert theta["mean_error_max"] < 0.15
    assert 1.8 < theta["sd_ratio_min"] <= theta["sd_ratio_median"] <= theta["sd_ratio_max"] < 2.2
    assert joint["sd_ratio_min"] == pytest.approx(mu["sd_ratio_min"])
    assert joint["w1_max"] == max(mu["w1_max"], theta["w1_max"])
    assert joint["energy_distance"] > 0.1
    assert joint["correlation_error_max"] < 0.1
    assert all(isinstance(v, float) for v in mu.values() if not isinstance(v, int))

    only_mu = compare_samples(samples, reference, sites=["mu"])
    assert list(only_mu["sites"]) == ["mu"] and only_mu["ignored"] == ["obs", "theta"]


def test_compare_samples_errors():
    a = {"mu": torch.zeros(10), "theta": torch.zeros(10, 3)}
    with pytest.raises(ValueError, match="share no sites"):
        compare_samples(a, {"sigma": torch.zeros(10)})
    with pytest.raises(ValueError, match=r"site 'theta' has shape \(3,\).*\(2,\)"):
        compare_samples(a, {"theta": torch.zeros(10, 2)})
    with pytest.raises(ValueError, match=r"\['theta'\] are missing from reference"):
        compare_samples(a, {"mu": torch.zeros(10)}, sites=["mu", "theta"])
