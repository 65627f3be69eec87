"""Conjugate models whose posteriors are known exactly, for checking every method's
defaults (the exact-posterior benchmark of the preconditioning work).

Each builder returns an :class:`ExactProblem`: a vectorisation-safe Pyro model, its
arguments, and the exact posterior as a torch distribution over one latent site, so a
fit's draws can be scored in posterior-sd units (:func:`score_draws`). The data are
synthetic, drawn from a fixed seed.

* ``normal``: Normal mean with known noise, Normal prior (1-D);
* ``gamma_poisson``: Poisson rate with a Gamma prior (a positive site);
* ``beta_bernoulli``: Bernoulli probability with a Beta prior (a unit-interval site);
* ``correlated_blr``: Bayesian linear regression, 5 coefficients, correlated predictors;
* ``raw_blr``: the same on raw predictors whose scales span five orders of magnitude
  (0.01 to 1000) with priors scaled to match, as unstandardised real data come;
* ``wide_blr``: the correlated regression with 150 coefficients and 400 rows, beyond the
  sizes where the defaults change (``LinearizedGuide``'s noise size below D above 64
  latents, ``SteinScoreELBO``'s 100 draws above 100);
* ``wider_blr``: the same with 300 coefficients and 800 rows, beyond 256 latents (where a
  generator's default noise was a network's size unless the preconditioner was dense;
  since bf92596 only a network's weights get it).
"""

import dataclasses

import pyro
import pyro.distributions as dist
import torch

__all__ = [
    "EXACT_PROBLEMS",
    "ExactProblem",
    "WIDE_PROBLEMS",
    "exact_problem",
    "linear_regression",
    "score_draws",
]


@dataclasses.dataclass
class ExactProblem:
    """A model with an exact posterior over its one latent site ``site``."""

    name: str
    model: object
    args: tuple
    site: str
    posterior: torch.distributions.Distribution
    max_plate_nesting: int = 1


def _normal(gen):
    y = 1.5 + torch.randn(10, generator=gen)
    prior_sd, noise = 2.0, 1.0

    def model(y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(()), prior_sd))
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Normal(mu, noise), obs=y)

    precision = 1 / prior_sd**2 + y.numel() / noise**2
    mean = (y.sum() / noise**2) / precision
    return model, (y,), "mu", dist.Normal(mean, precision**-0.5)


def _gamma_poisson(gen):
    y = torch.poisson(torch.full((8,), 3.0), generator=gen)
    a, b = 2.0, 1.0

    def model(y):
        rate = pyro.sample("rate", dist.Gamma(torch.tensor(a), b))
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Poisson(rate), obs=y)

    return model, (y,), "rate", dist.Gamma(a + y.sum(), b + y.numel())


def _beta_bernoulli(gen):
    y = (torch.rand(20, generator=gen) < 0.3).to(torch.get_default_dtype())
    a, b = 2.0, 2.0

    def model(y):
        p = pyro.sample("p", dist.Beta(torch.tensor(a), b))
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Bernoulli(p), obs=y)

    return model, (y,), "p", dist.Beta(a + y.sum(), b + y.numel() - y.sum())


def _blr(gen, scales, num=50):
    noise = 0.5
    d = len(scales)
    x = torch.randn(num, d, generator=gen)
    x[:, 1] = 0.8 * x[:, 0] + 0.6 * x[:, 1]
    x[:, 3] = 0.9 * x[:, 2] + 0.44 * x[:, 3]
    scale = torch.tensor(scales)
    x = x * scale
    prior_sd = 2.0 / scale
    beta = torch.randn(d, generator=gen) / scale
    y = (x * beta).sum(-1) + noise * torch.randn(num, generator=gen)

    def model(x, y):
        beta = pyro.sample("beta", dist.Normal(torch.zeros(d), prior_sd).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal((x * beta).sum(-1), noise), obs=y)

    precision = x.T @ x / noise**2 + torch.diag(prior_sd.pow(-2))
    cov = torch.linalg.inv(precision)
    cov = 0.5 * (cov + cov.T)
    mean = cov @ (x.T @ y) / noise**2
    return model, (x, y), "beta", dist.MultivariateNormal(mean, covariance_matrix=cov)


def linear_regression(scales, seed=0):
    """Bayesian linear regression on predictors with the given scales (two correlated
    pairs), priors scaled to match: its exact Gaussian posterior over ``"beta"``."""
    model, args, site, posterior = _blr(torch.Generator().manual_seed(seed), tuple(scales))
    return ExactProblem(f"blr{tuple(scales)}", model, args, site, posterior)


_BUILDERS = {
    "normal": _normal,
    "gamma_poisson": _gamma_poisson,
    "beta_bernoulli": _beta_bernoulli,
    "correlated_blr": lambda gen: _blr(gen, (1.0,) * 5),
    "raw_blr": lambda gen: _blr(gen, (0.01, 0.1, 1.0, 100.0, 1000.0)),
    "wide_blr": lambda gen: _blr(gen, (1.0,) * 150, num=400),
    "wider_blr": lambda gen: _blr(gen, (1.0,) * 300, num=800),
}

#: names of the problems of the issue's acceptance grid, in order of difficulty
EXACT_PROBLEMS = ("normal", "gamma_poisson", "beta_bernoulli", "correlated_blr", "raw_blr")
#: problems beyond that grid, for the defaults' limits (``exact_problem`` builds them too)
WIDE_PROBLEMS = ("wide_blr", "wider_blr")


def exact_problem(name, seed=0):
    """Build the named problem (data drawn from ``seed``, in the default dtype)."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown problem {name!r}; choose from {tuple(_BUILDERS)}") from None
    model, args, site, posterior = builder(torch.Generator().manual_seed(seed))
    return ExactProblem(name, model, args, site, posterior)


def score_draws(draws, posterior):
    """Distances of draws ``(S, d)`` or ``(S,)`` from an exact posterior, in its sd units:
    the largest standardised mean error, the smallest and largest sd ratio, and the largest
    absolute error of a correlation (0 for one coordinate). Moments of the posterior are
    exact; the draws' are sample moments.

    :return: ``{"mean_error", "sd_ratio_min", "sd_ratio_max", "correlation_error"}``.
    """
    draws = draws.reshape(draws.shape[0], -1).to(torch.float64)
    mean = posterior.mean.reshape(-1).to(torch.float64)
    if isinstance(posterior, dist.MultivariateNormal):
        cov = posterior.covariance_matrix.to(torch.float64)
    else:
        cov = torch.diag(posterior.variance.reshape(-1).to(torch.float64))
    sd = cov.diagonal().sqrt()
    ratio = draws.std(0) / sd
    result = {
        "mean_error": ((draws.mean(0) - mean) / sd).abs().max().item(),
        "sd_ratio_min": ratio.min().item(),
        "sd_ratio_max": ratio.max().item(),
        "correlation_error": 0.0,
    }
    if draws.shape[1] > 1:
        exact = cov / sd[:, None] / sd
        result["correlation_error"] = (torch.corrcoef(draws.T) - exact).abs().max().item()
    return result
