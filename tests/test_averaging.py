"""``Averaged`` (``benchmarks/_averaging.py``) against closed forms: the averaging weights, the
stationary noise of SGD on a quadratic that the average removes, and an exact posterior."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal


@pytest.fixture(scope="module")
def Averaged(load_benchmark):
    """The benchmarks' iterate-averaging optimiser (``benchmarks/_averaging.py``)."""
    return load_benchmark("_averaging").Averaged


def _run_sgd(optim, grad_fn, steps, size):
    theta = pyro.param("theta", torch.zeros(size))
    p = theta.unconstrained()
    for t in range(1, steps + 1):
        p.grad = grad_fn(p.detach(), t)
        optim([p])
        p.grad = None
    return p


@pytest.mark.parametrize(
    "eta, expected", [(0.0, lambda t: (t + 1) / 2), (1.0, lambda t: (2 * t + 1) / 3)]
)
def test_the_average_has_the_polynomial_decay_weights(Averaged, eta, expected):
    # theta_t = t (SGD at lr 1 on a gradient of -1); eta = 0 averages them uniformly,
    # (T + 1) / 2, eta = 1 with weights proportional to t, (2T + 1) / 3
    optim = Averaged(pyro.optim.SGD({"lr": 1.0}), eta=eta)
    p = _run_sgd(optim, lambda p, t: -torch.ones_like(p), 50, 1)
    assert p.item() == pytest.approx(50.0)
    assert optim.averages[p][0].item() == pytest.approx(expected(50), rel=1e-10)


def test_the_average_removes_sgds_stationary_noise_on_a_quadratic(Averaged):
    # f = h theta^2 / 2 with gradient noise sd s: SGD at lr a has the stationary variance
    # a s^2 / (h (2 - a h)) around the optimum 0; 4000 independent chains, one tensor
    a, h, s, size = 0.1, 1.0, 1.0, 4000
    optim = Averaged(pyro.optim.SGD({"lr": a}))
    gen = torch.Generator().manual_seed(0)
    p = _run_sgd(optim, lambda p, t: h * p + s * torch.randn(size, generator=gen), 2000, size)
    stationary = a * s**2 / (h * (2 - a * h))
    assert p.detach().var().item() == pytest.approx(stationary, rel=0.1)
    assert optim.averages[p][0].var().item() < stationary / 20


def test_the_averaged_guide_is_closer_to_the_exact_posterior(Averaged):
    # 500 replicas of mu ~ N(0, 1), y ~ N(mu, 1), y = 1: each replica's posterior is
    # N(0.5, 1/2); AutoNormal at Adam's constant lr jitters around it, its average does not
    replicas = 500

    def model():
        with pyro.plate("replicas", replicas):
            mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
            pyro.sample("y", dist.Normal(mu, 1.0), obs=torch.ones(replicas))

    guide = AutoNormal(model)
    optim = Averaged(pyro.optim.Adam({"lr": 1e-2}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(2000):
        svi.step()
    sd = 0.5**0.5
    last = ((guide.locs.mu - 0.5).abs() / sd).mean().item()
    with optim.averaged():
        averaged = ((guide.locs.mu - 0.5).abs() / sd).mean().item()
        scale = (guide.scales.mu / sd).mean().item()
    assert averaged < 0.035 and last > 0.05  # seeds 0-2: 0.023-0.024 and 0.067-0.069
    assert scale == pytest.approx(1.0, abs=0.05)


def test_the_block_swaps_the_averages_in_and_back(Averaged):
    def model():
        pyro.sample("mu", dist.Normal(0.0, 1.0))
        pyro.sample(
            "y", dist.Normal(pyro.sample("z", dist.Normal(0.0, 1.0)), 1.0), obs=torch.tensor(1.0)
        )

    guide = AutoNormal(model)
    optim = Averaged(pyro.optim.Adam({"lr": 1e-1}))
    svi = SVI(model, guide, optim, Trace_ELBO())
    for _ in range(20):
        svi.step()
    raw = {p: p.detach().clone() for p in optim.averages}
    with optim.averaged():
        for p, (average, _) in optim.averages.items():
            assert torch.equal(p.detach(), average)
        with pytest.raises(RuntimeError, match="leave the block"):
            svi.step()
    for p, value in raw.items():
        assert torch.equal(p.detach(), value)
    # the wrapped optimiser's state is the checkpoint
    assert set(optim.get_state()) == set(optim.optim.get_state())
    assert optim.optim_objs is optim.optim.optim_objs


def test_bad_arguments_are_refused(Averaged):
    with pytest.raises(TypeError, match="Averaged wraps a pyro.optim.PyroOptim"):
        Averaged(torch.optim.Adam)
    with pytest.raises(TypeError, match="already Averaged"):
        Averaged(Averaged(pyro.optim.Adam({"lr": 1e-2})))
    with pytest.raises(ValueError, match="eta"):
        Averaged(pyro.optim.Adam({"lr": 1e-2}), eta=-1.0)
