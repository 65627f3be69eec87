"""Kernels shared by every kernel-based method in the library.

One module serves KIVI's density-ratio estimator, SVGD-type particle updates and the
sample-based discrepancies of :mod:`pyro_implicit.diagnostics`. Two rules hold throughout:

* pairwise squared distances use the Gram identity
  :math:`\\|a - b\\|^2 = \\|a\\|^2 + \\|b\\|^2 - 2 a^\\top b` on centred inputs, so memory is
  :math:`O(N M + (N + M) D)` and never :math:`O(N M D)`;
* the bandwidth is a *statistic of the samples*, computed without gradient (the kernel is a
  fixed function of its evaluation points; see KIVI eq. 7 and SVGD's median heuristic).

**The one bandwidth rule.** :func:`median_bandwidth` returns the median of the off-diagonal
pairwise Euclidean distances of the pooled samples. :class:`RBFKernel` uses it as the length
scale :math:`\\sigma` in :math:`k(a, b) = \\exp(-\\|a - b\\|^2 / (2\\sigma^2))` (KIVI, Sec. 3.2).
Methods that want the SVGD convention :math:`h = \\mathrm{med}^2 / \\log N` (Liu & Wang 2016)
pass ``bandwidth_factor`` so that :math:`2\\sigma^2 = h`, i.e.
``bandwidth_factor = 1 / sqrt(2 log N)``; :func:`svgd_bandwidth_factor` computes it.
:class:`MultiScaleRBFKernel` averages RBF kernels at several multiples of the same median.
"""

import math

import numpy as np
import torch

__all__ = [
    "IMQKernel",
    "MultiScaleRBFKernel",
    "RBFKernel",
    "kernel_and_derivative",
    "median_bandwidth",
    "median_from_squared_distances",
    "solve_kernel_system",
    "squared_distances",
    "svgd_bandwidth_factor",
]


def squared_distances(x, y=None):
    """Pairwise squared Euclidean distances by the Gram identity.

    Both inputs are centred on a common (detached) mean first: distances are translation
    invariant and centring removes most of the cancellation in
    :math:`\\|a\\|^2 + \\|b\\|^2 - 2a^\\top b` when D is large and the samples sit far from
    the origin. The result is clamped at zero.

    The gradient is exact and finite everywhere, including the diagonal of ``x`` against
    a detached copy of itself (where ``(x - y).norm()`` would give NaN).

    :param torch.Tensor x: ``(..., N, D)`` points.
    :param torch.Tensor y: ``(..., M, D)`` points; ``x`` if omitted.
    :return: ``(..., N, M)`` squared distances.
    :rtype: torch.Tensor
    """
    if y is None:
        y = x
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"dimension mismatch: x has D={x.shape[-1]}, y has D={y.shape[-1]}")
    if y is x:  # one set against itself: one centring, one norm
        x = x - x.detach().mean(-2, keepdim=True)
        x2 = x.pow(2).sum(-1, keepdim=True)
        d2 = x2 + x2.transpose(-1, -2) - 2 * x @ x.transpose(-1, -2)
        return d2.clamp(min=0)
    center = torch.cat([x.detach(), y.detach()], dim=-2).mean(-2, keepdim=True)
    x = x - center
    y = y - center
    x2 = x.pow(2).sum(-1, keepdim=True)
    y2 = y.pow(2).sum(-1, keepdim=True)
    d2 = x2 + y2.transpose(-1, -2) - 2 * x @ y.transpose(-1, -2)
    return d2.clamp(min=0)


@torch.no_grad()
def median_bandwidth(*samples, eps=1e-12):
    """The median heuristic: median of the off-diagonal pairwise Euclidean distances of
    the pooled samples. Computed without gradient.

    :param torch.Tensor samples: one or more ``(N_i, D)`` tensors, pooled.
    :param float eps: floor, so identical samples still give a usable length scale.
    :return: a 0-dim tensor.
    """
    z = torch.cat([s.detach().reshape(-1, s.shape[-1]) for s in samples], dim=0)
    return median_from_squared_distances(squared_distances(z), eps)


@torch.no_grad()
def median_from_squared_distances(d2, eps=1e-12):
    """Median of the off-diagonal Euclidean distances given a symmetric ``(N, N)`` matrix
    of squared distances (the value behind :func:`median_bandwidth`).

    For an even number of pairs the two middle values are averaged (as numpy does;
    torch's ``median`` would return the lower one). Selection, not sorting, over the
    N(N-1)/2 pairs of the upper triangle: O(N^2).
    """
    n = d2.shape[-1]
    if n < 2:
        return torch.ones((), dtype=d2.dtype, device=d2.device)
    # each pair once: the full matrix holds every pair twice, and selection among those
    # ties is slower (numpy, N = 200: 0.41 ms on the full matrix, 0.07 ms on the pairs)
    pairs = d2.reshape(-1).take(_upper_triangle(n, d2.device))
    m = pairs.numel()
    ranks = [(m + 1) // 2]
    if m % 2 == 0:
        ranks.append(m // 2 + 1)
    middle = _kth_smallest(pairs, ranks)
    return middle.sqrt().mean().clamp(min=eps)


_UPPER = {}


def _upper_triangle(n, device):
    """Flat indices of the strict upper triangle of an ``(n, n)`` matrix (cached)."""
    key = (n, str(device))
    if key not in _UPPER:
        rows, cols = torch.triu_indices(n, n, 1, device=device)
        if len(_UPPER) > 64:  # particle counts of one process are few; stay bounded
            _UPPER.clear()
        _UPPER[key] = rows * n + cols
    return _UPPER[key]


def _kth_smallest(flat, ranks):
    """The ``ranks``-th smallest values (1-based) of a 1-D tensor, as a tensor.

    On the CPU numpy's introselect does it, at every rank in one partition: torch's
    ``kthvalue``, once per rank, took 2.4-2.8x as long on the 19 900 pairs of 200
    particles (0.087 ms against 0.031 ms; with tied pairs 0.114 against 0.047). Selection
    is exact, so both give the same values.
    """
    if flat.device.type == "cpu" and flat.dtype in (torch.float32, torch.float64):
        try:
            values = flat.detach().numpy()
        except RuntimeError:  # a tensor numpy cannot see (e.g. inside torch.func.vmap)
            pass
        else:
            kth = [rank - 1 for rank in ranks]
            return torch.from_numpy(np.partition(values, kth)[kth])
    return torch.stack([flat.kthvalue(r).values for r in ranks])


def solve_kernel_system(system, rhs):
    """``system^{-1} rhs`` for a kernel system (a Gram matrix plus a ridge): by Cholesky,
    positive definite for a positive-definite kernel and a positive ridge, and by LU where
    it is not (a kernel of one's own, a zero ridge with a singular Gram). With it and one
    product fewer the Stein residual at 200 draws took 0.88 ms instead of 1.12
    (``benchmarks/results/stein_residual_cholesky.md``)."""
    chol, failed = torch.linalg.cholesky_ex(system)
    if failed.item():
        return torch.linalg.solve(system, rhs)
    return torch.cholesky_solve(rhs, chol)


def kernel_and_derivative(kernel, d2, bandwidth):
    r"""``(k, dk/dr)`` of ``kernel`` at squared distances ``d2``: one pass where the kernel
    offers ``value_and_derivative`` (the library's do), else its
    ``from_squared_distances`` and ``derivative_wrt_squared_distance`` (a kernel of one's
    own that has only those)."""
    both = getattr(kernel, "value_and_derivative", None)
    if both is not None:
        return both(d2, bandwidth)
    return (
        kernel.from_squared_distances(d2, bandwidth),
        kernel.derivative_wrt_squared_distance(d2, bandwidth),
    )


def svgd_bandwidth_factor(num_particles):
    """Factor turning the median length scale into the SVGD bandwidth
    :math:`h = \\mathrm{med}^2 / \\log N` (Liu & Wang, 2016): ``1 / sqrt(2 log N)``."""
    return 1.0 / math.sqrt(2.0 * math.log(max(num_particles, 2)))


class RBFKernel:
    """Gaussian kernel :math:`k(a, b) = \\exp(-\\|a - b\\|^2 / (2\\sigma^2))`.

    :param float bandwidth: fixed length scale :math:`\\sigma`; ``None`` (default) uses the
        median heuristic (:func:`median_bandwidth`) of the samples passed to
        :meth:`bandwidth`, times ``bandwidth_factor``.
    :param float bandwidth_factor: multiplies the median length scale.
    """

    def __init__(self, bandwidth=None, bandwidth_factor=1.0):
        if bandwidth is not None and bandwidth <= 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth}")
        if bandwidth_factor <= 0:
            raise ValueError(f"bandwidth_factor must be positive, got {bandwidth_factor}")
        self.fixed_bandwidth = bandwidth
        self.bandwidth_factor = bandwidth_factor

    def bandwidth(self, *samples):
        """Length scale for these samples (no gradient)."""
        if self.fixed_bandwidth is not None:
            ref = samples[0]
            return torch.tensor(self.fixed_bandwidth, dtype=ref.dtype, device=ref.device)
        return median_bandwidth(*samples) * self.bandwidth_factor

    def bandwidth_from_squared_distances(self, d2):
        """Length scale from the pooled samples' ``(N, N)`` squared distances."""
        if self.fixed_bandwidth is not None:
            return torch.tensor(self.fixed_bandwidth, dtype=d2.dtype, device=d2.device)
        return median_from_squared_distances(d2) * self.bandwidth_factor

    def from_squared_distances(self, d2, bandwidth):
        """Kernel values from squared distances and a length scale."""
        return torch.exp(-0.5 * d2 / bandwidth**2)

    def derivative_wrt_squared_distance(self, d2, bandwidth):
        r"""Derivative :math:`\partial k / \partial r` with :math:`r = \|a - b\|^2`, so that
        :math:`\nabla_b k(a, b) = 2 (b - a) \partial k / \partial r`."""
        return -0.5 * self.from_squared_distances(d2, bandwidth) / bandwidth**2

    def value_and_derivative(self, d2, bandwidth):
        r"""``(k, dk/dr)``: :meth:`from_squared_distances` and
        :meth:`derivative_wrt_squared_distance` at once (for the RBF kernel
        :math:`\partial k / \partial r = -k / (2\sigma^2)`: one exponential, not two)."""
        k = self.from_squared_distances(d2, bandwidth)
        return k, -0.5 * k / bandwidth**2

    def __call__(self, x, y=None, bandwidth=None):
        """Gram matrix ``(N, M)``; the bandwidth is computed from ``x`` and ``y`` if omitted."""
        if bandwidth is None:
            bandwidth = self.bandwidth(x) if y is None else self.bandwidth(x, y)
        return self.from_squared_distances(squared_distances(x, y), bandwidth)

    def stein_terms(self, x, bandwidth=None):
        """Kernel matrix and the SVGD repulsion :math:`\\sum_j \\nabla_{x_j} k(x_j, x_i)`
        in :math:`O(N^2 + N D)` memory.

        For the RBF kernel :math:`\\nabla_{x_j} k(x_j, x_i) = k_{ij} (x_i - x_j) / \\sigma^2`,
        so the sum is :math:`(x_i \\sum_j k_{ij} - \\sum_j k_{ij} x_j) / \\sigma^2`: two matrix
        products, no ``(N, N, D)`` tensor.

        :param torch.Tensor x: ``(N, D)`` particles (treated as constants).
        :return: ``(K, repulsion, bandwidth)`` with ``K`` of shape ``(N, N)`` and
            ``repulsion`` of shape ``(N, D)``.
        """
        x = x.detach()
        if bandwidth is None:
            bandwidth = self.bandwidth(x)
        k = self.from_squared_distances(squared_distances(x), bandwidth)
        repulsion = (x * k.sum(-1, keepdim=True) - k @ x) / bandwidth**2
        return k, repulsion, bandwidth


class IMQKernel(RBFKernel):
    """Inverse multi-quadric kernel
    :math:`k(a, b) = (1 + \\|a - b\\|^2 / (2\\sigma^2))^{\\beta}`, :math:`\\beta \\in (-1, 0)`.

    Heavier-tailed than the RBF kernel, so far-apart particles still interact (Gorham &
    Mackey, 2017). The length scale follows the same median rule as :class:`RBFKernel`.

    :param float beta: exponent, default ``-0.5``.
    """

    def __init__(self, bandwidth=None, bandwidth_factor=1.0, beta=-0.5):
        super().__init__(bandwidth, bandwidth_factor)
        if not -1.0 < beta < 0.0:
            raise ValueError(f"IMQ exponent beta must lie in (-1, 0), got {beta}")
        self.beta = beta

    def from_squared_distances(self, d2, bandwidth):
        return (1.0 + 0.5 * d2 / bandwidth**2).pow(self.beta)

    def derivative_wrt_squared_distance(self, d2, bandwidth):
        base = 1.0 + 0.5 * d2 / bandwidth**2
        return 0.5 * self.beta * base.pow(self.beta - 1.0) / bandwidth**2

    def value_and_derivative(self, d2, bandwidth):
        base = 1.0 + 0.5 * d2 / bandwidth**2
        k = base.pow(self.beta)
        return k, 0.5 * self.beta * k / base / bandwidth**2

    def stein_terms(self, x, bandwidth=None):
        """As :meth:`RBFKernel.stein_terms`; for the IMQ kernel
        :math:`\\nabla_{x_j} k(x_j, x_i) = \\beta (1 + r/2\\sigma^2)^{\\beta - 1}
        (x_j - x_i) / \\sigma^2`."""
        x = x.detach()
        if bandwidth is None:
            bandwidth = self.bandwidth(x)
        base = 1.0 + 0.5 * squared_distances(x) / bandwidth**2
        k = base.pow(self.beta)
        w = -self.beta * base.pow(self.beta - 1.0)  # positive weights
        repulsion = (x * w.sum(-1, keepdim=True) - w @ x) / bandwidth**2
        return k, repulsion, bandwidth


class MultiScaleRBFKernel(RBFKernel):
    r"""Equal mixture of RBF kernels at several length scales,
    :math:`k(a, b) = \frac1S \sum_s \exp(-\|a - b\|^2 / (2 (c_s \sigma)^2))`, with
    :math:`\sigma` the median distance (or ``bandwidth``) and :math:`c_s` the
    ``bandwidth_factors``.

    A sum of positive-definite kernels is positive definite, and each RBF term is
    characteristic, so the mixture is a valid Stein kernel (Ai et al. 2021 weigh such
    terms; here they count alike). The narrow term resolves a curved or narrow shape, the
    wide one keeps far-apart points interacting: the default of
    :class:`~pyro_implicit.elbo.AmortizedSVGD_ELBO` joins Liu & Wang's length scale to the
    median distance itself (``benchmarks/results/asvgd_multiscale.md``).

    :param tuple bandwidth_factors: the :math:`c_s`, each positive.
    :param float bandwidth: fixed :math:`\sigma` instead of the median distance.

    References

    [1] `Stein Variational Gradient Descent with Multiple Kernel`, Qingzhong Ai, Shiyu
        Liu, Lirong He, Zenglin Xu, arXiv:2107.09338, 2021.
    """

    def __init__(self, bandwidth_factors, bandwidth=None):
        super().__init__(bandwidth=bandwidth)
        factors = tuple(float(c) for c in bandwidth_factors)
        if not factors or min(factors) <= 0:
            raise ValueError(
                f"bandwidth_factors must be one or more positive numbers, got {bandwidth_factors}"
            )
        self.bandwidth_factors = factors

    def _terms(self, d2, bandwidth):
        # each term's value and its derivative in r = |a - b|^2 (-k_s / 2 sigma_s^2)
        for c in self.bandwidth_factors:
            inv = 0.5 / (c * bandwidth) ** 2
            k = torch.exp(-d2 * inv)
            yield k, -inv * k

    def from_squared_distances(self, d2, bandwidth):
        return sum(k for k, _ in self._terms(d2, bandwidth)) / len(self.bandwidth_factors)

    def derivative_wrt_squared_distance(self, d2, bandwidth):
        return self.value_and_derivative(d2, bandwidth)[1]

    def value_and_derivative(self, d2, bandwidth):
        k = dk = 0.0
        for k_s, dk_s in self._terms(d2, bandwidth):
            k, dk = k + k_s, dk + dk_s
        n = len(self.bandwidth_factors)
        return k / n, dk / n

    def stein_terms(self, x, bandwidth=None):
        """As :meth:`RBFKernel.stein_terms`: :math:`\\nabla_{x_j} k(x_j, x_i) = 2 (x_j -
        x_i)\\, \\partial k / \\partial r`, summed over ``j`` as two matrix products."""
        x = x.detach()
        if bandwidth is None:
            bandwidth = self.bandwidth(x)
        k, dk = self.value_and_derivative(squared_distances(x), bandwidth)
        repulsion = 2.0 * (dk @ x - x * dk.sum(-1, keepdim=True))
        return k, repulsion, bandwidth
