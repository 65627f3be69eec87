import importlib.util
import io
import math
import os
import sys
from pathlib import Path

import pyro
import pytest
import torch

# Small models run many times faster on one thread on a shared 2-core machine.
torch.set_num_threads(int(os.environ.get("PYRO_IMPLICIT_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _pyro_state():
    """Fresh parameter store, validation on, float64 and a fixed seed for every test."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    pyro.clear_param_store()
    pyro.enable_validation(True)
    pyro.set_rng_seed(int(os.environ.get("PYRO_IMPLICIT_TEST_SEED", "0")))
    yield
    torch.set_default_dtype(dtype)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """``load(name)``: the script ``benchmarks/<name>.py`` imported as a module, with the
    benchmarks' folder on ``sys.path`` as when it runs (it imports its siblings by name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))

    def load(name):
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def assert_round_trip():
    """``check(guide, fresh, args, site)``: a trained ``guide`` survives ``state_dict`` /
    ``load_state_dict`` into the untrained ``fresh`` (called once on ``args``, as its
    parameters are built lazily) and ``torch.save`` / ``torch.load``: with one seed, all
    three give the same draws of ``site``."""

    def check(guide, fresh, args, site):
        fresh(*args)
        fresh.load_state_dict(guide.state_dict())
        buffer = io.BytesIO()
        torch.save(guide, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        pyro.set_rng_seed(1)
        expected = guide.sample_posterior(10)[site]
        for other in (fresh, loaded):
            pyro.set_rng_seed(1)
            assert torch.equal(other.sample_posterior(10)[site], expected)

    return check


def _quartic():
    # log p(u) = -u^2/2 - u^4: not Gaussian at its mode, so the preconditioner's Laplace
    # fails its importance check and the search fits a Gaussian (best sd 1/2)
    u = pyro.sample("u", pyro.distributions.Normal(0.0, 1.0))
    pyro.factor("quartic", -(u**4))


@pytest.fixture
def quartic_model():
    """A one-coordinate model whose preconditioner search runs its Gaussian fit."""
    return _quartic


def pytest_collection_modifyitems(config, items):
    """The notebooks first (stable otherwise): each runs 10-40 s, and left at the end of
    the collection one of them kept the other ``pytest -n 2`` worker idle while it ran."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/test_tutorials.py"))


def _two_modes(minor):
    """A two-mode posterior known exactly: a ~ N(0, 10^2) times the factor of a mixture,
    ``minor`` of N(-2, 0.3^2) and ``1 - minor`` of N(2, 1), and b ~ N(0, 1) apart. For
    ``minor`` 0.3 the lighter mode is the taller, so a weight read from the density at each
    mode alone picks the wrong one. Returns the model and, for the posterior of ``a``,
    ``{"minor_mass", "below_zero", "mean", "sd"}`` (``below_zero``: the mass of a < 0). That
    posterior is a mixture of the two components times the prior: weights
    ``w_k N(m_k; 0, (s_k^2 + 100)^(1/2))``, means ``100 m_k / (s_k^2 + 100)``, variances
    ``100 s_k^2 / (s_k^2 + 100)``."""
    components = ((minor, -2.0, 0.3), (1.0 - minor, 2.0, 1.0))

    def model():
        a = pyro.sample("a", pyro.distributions.Normal(0.0, 10.0))
        pyro.sample("b", pyro.distributions.Normal(0.0, 1.0))
        terms = [
            torch.log(torch.tensor(w)) + pyro.distributions.Normal(m, s).log_prob(a)
            for w, m, s in components
        ]
        pyro.factor("mixture", torch.stack(terms).logsumexp(0))

    mass = torch.tensor(
        [
            w / (s**2 + 100) ** 0.5 * torch.exp(torch.tensor(-(m**2) / (2 * (s**2 + 100)))).item()
            for w, m, s in components
        ]
    )
    mass = mass / mass.sum()
    means = torch.tensor([100 * m / (s**2 + 100) for _, m, s in components])
    variances = torch.tensor([100 * s**2 / (s**2 + 100) for _, _, s in components])
    mean = (mass * means).sum()
    sd = ((mass * (variances + means**2)).sum() - mean**2).sqrt()
    below = (mass * pyro.distributions.Normal(means, variances.sqrt()).cdf(torch.tensor(0.0))).sum()
    return model, {
        "minor_mass": mass[0].item(),
        "below_zero": below.item(),
        "mean": mean.item(),
        "sd": sd.item(),
    }


@pytest.fixture
def two_modes():
    """``build(minor)``: a two-mode model and its exact posterior (:func:`_two_modes`)."""
    return _two_modes


def _unordered_mixture():
    """An unordered two-component mixture (label switching): y_i ~ 0.5 N(mu_1, 1) +
    0.5 N(mu_2, 1), mu_k ~ N(0, 10^2), 40 points drawn with mu = (-2, 2). Each mode is
    there once per order of the components. Returns the model and its data."""
    gen = torch.Generator().manual_seed(0)
    y = torch.where(torch.rand(40, generator=gen) < 0.5, -2.0, 2.0) + torch.randn(40, generator=gen)

    def mixture(y):
        mu = pyro.sample("mu", pyro.distributions.Normal(0.0, 10.0).expand([2]).to_event(1))
        per_component = pyro.distributions.Normal(mu.unsqueeze(-2), 1.0).log_prob(y.unsqueeze(-1))
        pyro.factor("y", (per_component + math.log(0.5)).logsumexp(-1).sum(-1))

    return mixture, y


@pytest.fixture
def unordered_mixture():
    """``(model, y)``: :func:`_unordered_mixture` (built under the test's default dtype)."""
    return _unordered_mixture()
