import math

import numpy as np
import pytest
import torch

from pyro_implicit.kernels import (
    IMQKernel,
    MultiScaleRBFKernel,
    RBFKernel,
    kernel_and_derivative,
    median_bandwidth,
    median_from_squared_distances,
    squared_distances,
    svgd_bandwidth_factor,
)


def brute_squared_distances(x, y):
    return ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)


def test_squared_distances_match_brute_force_far_from_origin():
    x = torch.randn(7, 5) + 1e3
    y = torch.randn(4, 5) + 1e3
    assert torch.allclose(squared_distances(x, y), brute_squared_distances(x, y), atol=1e-8)
    assert torch.allclose(squared_distances(x), brute_squared_distances(x, x), atol=1e-8)


def test_squared_distances_of_one_set_have_the_brute_force_gradient():
    # one set against itself takes its own path (one centring, one norm)
    x = (torch.randn(6, 3) + 5.0).requires_grad_(True)
    w = torch.rand(6, 6)
    grad = torch.autograd.grad((w * squared_distances(x)).sum(), x)[0]
    expected = torch.autograd.grad((w * brute_squared_distances(x, x)).sum(), x)[0]
    assert torch.allclose(grad, expected, atol=1e-9)


def test_squared_distance_gradient_is_finite_on_the_diagonal():
    x = torch.randn(6, 3, requires_grad=True)
    d2 = squared_distances(x.detach(), x)
    d2.diagonal().sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.allclose(x.grad, torch.zeros_like(x.grad), atol=1e-10)


@pytest.mark.parametrize("n", [5, 6])
def test_median_bandwidth_matches_numpy_median(n):
    x = torch.randn(n, 3)
    d = brute_squared_distances(x, x).sqrt()
    iu = np.triu_indices(n, 1)
    expected = np.median(d.numpy()[iu])
    assert median_bandwidth(x).item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [60, 61])
def test_median_with_ties_matches_numpy_median(n, dtype):
    # duplicated particles: many tied distances, where selection algorithms differ
    x = torch.randn(n // 3, 4, dtype=dtype).repeat(3, 1)
    x = torch.cat([x, torch.randn(n - x.shape[0], 4, dtype=dtype)])
    d2 = brute_squared_distances(x, x)
    iu = np.triu_indices(n, 1)
    expected = np.median(d2.sqrt().numpy()[iu])
    median = median_from_squared_distances(d2)
    assert median.dtype == dtype and median.shape == ()
    assert median.item() == pytest.approx(expected, rel=1e-6)
    # torch's own selection (the path off the CPU) gives the same value
    half = median_from_squared_distances(d2.to(torch.bfloat16)).float()
    assert half.item() == pytest.approx(expected, rel=2e-2)


def test_median_bandwidth_pools_samples_and_has_no_gradient():
    x = torch.randn(4, 2, requires_grad=True)
    y = torch.randn(3, 2)
    h = median_bandwidth(x, y)
    assert not h.requires_grad
    assert h.item() == pytest.approx(median_bandwidth(torch.cat([x.detach(), y])).item())


def test_rbf_kernel_values():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    k = RBFKernel(bandwidth=5.0)(x)
    assert k[0, 1].item() == pytest.approx(math.exp(-25 / 50))
    assert torch.allclose(k.diagonal(), torch.ones(2))


@pytest.mark.parametrize(
    "kernel",
    [RBFKernel(), IMQKernel(), IMQKernel(beta=-0.3), MultiScaleRBFKernel((0.35, 1.0))],
)
def test_stein_repulsion_matches_autograd(kernel):
    x = torch.randn(8, 4)
    k, repulsion, h = kernel.stein_terms(x)
    # sum_j d/dx_j k(x_j, x_i), by autograd on the first argument
    xj = x.clone().requires_grad_(True)
    gram = kernel.from_squared_distances(squared_distances(xj, x), h)
    expected = torch.stack(
        [torch.autograd.grad(gram[:, i].sum(), xj, retain_graph=True)[0].sum(0) for i in range(8)]
    )
    assert torch.allclose(repulsion, expected, atol=1e-10)
    assert torch.allclose(k, gram.detach())


def test_multi_scale_rbf_kernel_values():
    # |a - b| = 5 at a median of 5: the mean of exp(-25 / (2 (c 5)^2)) over c in (0.5, 2)
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    kernel = MultiScaleRBFKernel((0.5, 2.0))
    assert kernel.bandwidth(x).item() == pytest.approx(5.0)
    k = kernel(x)
    expected = 0.5 * (math.exp(-1 / (2 * 0.25)) + math.exp(-1 / (2 * 4.0)))
    assert k[0, 1].item() == pytest.approx(expected, rel=1e-12)
    assert torch.allclose(k.diagonal(), torch.ones(3))
    # one factor is the RBF kernel at that many median distances
    d2 = torch.rand(4, 3) * 5
    one = MultiScaleRBFKernel((0.7,)).value_and_derivative(d2, torch.tensor(2.0))
    rbf = RBFKernel().value_and_derivative(d2, torch.tensor(1.4))
    assert torch.allclose(one[0], rbf[0], rtol=1e-12) and torch.allclose(one[1], rbf[1])


def test_identical_particles_have_zero_repulsion():
    x = torch.ones(5, 3)
    _, repulsion, _ = RBFKernel().stein_terms(x)
    assert torch.allclose(repulsion, torch.zeros_like(repulsion))


def test_svgd_bandwidth_factor_gives_liu_wang_bandwidth():
    x = torch.randn(20, 2)
    med = median_bandwidth(x)
    kernel = RBFKernel(bandwidth_factor=svgd_bandwidth_factor(20))
    sigma = kernel.bandwidth(x)
    # exp(-r^2 / (2 sigma^2)) == exp(-r^2 / h) with h = med^2 / log N
    assert (2 * sigma**2).item() == pytest.approx((med**2 / math.log(20)).item())


def test_bad_kernel_arguments():
    with pytest.raises(ValueError, match="bandwidth"):
        RBFKernel(bandwidth=-1.0)
    with pytest.raises(ValueError, match="beta"):
        IMQKernel(beta=0.5)
    with pytest.raises(ValueError, match="bandwidth_factors"):
        MultiScaleRBFKernel((1.0, 0.0))
    with pytest.raises(ValueError, match="bandwidth_factors"):
        MultiScaleRBFKernel(())
    with pytest.raises(ValueError, match="dimension"):
        squared_distances(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("kernel", [RBFKernel(), IMQKernel(), MultiScaleRBFKernel((0.35, 1.0))])
def test_derivative_wrt_squared_distance_matches_autograd(kernel):
    d2 = torch.rand(5, 4).mul(3).requires_grad_(True)
    h = torch.tensor(0.7)
    expected = torch.autograd.grad(kernel.from_squared_distances(d2, h).sum(), d2)[0]
    assert torch.allclose(kernel.derivative_wrt_squared_distance(d2.detach(), h), expected)


class _TwoMethodKernel:
    """A kernel of one's own with the two methods only (no ``value_and_derivative``)."""

    def from_squared_distances(self, d2, bandwidth):
        return torch.exp(-d2 / bandwidth)

    def derivative_wrt_squared_distance(self, d2, bandwidth):
        return -torch.exp(-d2 / bandwidth) / bandwidth


@pytest.mark.parametrize(
    "kernel",
    [
        RBFKernel(),
        IMQKernel(),
        IMQKernel(beta=-0.3),
        MultiScaleRBFKernel((0.35, 1.0)),
        _TwoMethodKernel(),
    ],
)
def test_kernel_and_derivative_are_the_two_methods(kernel):
    d2 = torch.rand(5, 4).mul(3)
    h = torch.tensor(0.7)
    k, dk = kernel_and_derivative(kernel, d2, h)
    assert torch.allclose(k, kernel.from_squared_distances(d2, h), rtol=1e-12, atol=0)
    assert torch.allclose(dk, kernel.derivative_wrt_squared_distance(d2, h), rtol=1e-12, atol=0)
