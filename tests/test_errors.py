"""One exception type per kind of problem (bad model, bad guide-loss pair, bad data), each
also the built-in exception raised before it existed."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI

import pyro_implicit
from pyro_implicit import (
    SIVI_ELBO,
    DataError,
    ImplicitGuide,
    ModelError,
    PairingError,
    PyroImplicitError,
    UnsupportedPairError,
    VectorizationError,
)
from pyro_implicit.elbo import DivergenceError, check_observed_finite
from pyro_implicit.elbo.base import unconstrained_particles


def _model(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_each_kind_is_its_old_builtin_too():
    assert issubclass(ModelError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(PairingError, TypeError)
    assert issubclass(UnsupportedPairError, PairingError)
    assert issubclass(UnsupportedPairError, NotImplementedError)
    assert issubclass(VectorizationError, ModelError)
    for kind in (ModelError, DataError, PairingError, DivergenceError):
        assert issubclass(kind, PyroImplicitError)
    assert pyro_implicit.errors.DivergenceError is DivergenceError


def test_bad_data_bad_model_and_bad_pair_raise_their_kind():
    y = torch.tensor([0.5, float("nan"), 1.0])
    with pytest.raises(DataError, match="observed site 'y'"):
        check_observed_finite(poutine.trace(_model).get_trace(y))

    def discrete():
        pyro.sample("k", dist.Bernoulli(0.5))

    site = poutine.trace(discrete).get_trace().nodes["k"]
    site["value"] = site["value"].reshape(1)
    with pytest.raises(ModelError, match="cannot sample discrete site 'k'"):
        unconstrained_particles(site, 1, 1)

    y = torch.tensor([0.5, 1.0])
    svi = SVI(
        _model,
        ImplicitGuide(_model, precondition=False),
        pyro.optim.Adam({"lr": 0.01}),
        SIVI_ELBO(num_particles=2, num_mixing=2),
    )
    with pytest.raises(PairingError, match="conditional_density.*KernelRatioELBO"):
        svi.step(y)
