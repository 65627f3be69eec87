"""Sample-based discrepancies between an approximate posterior and a reference posterior.

Every metric takes ``draws`` of shape ``(S, D)`` from the approximation and ``reference`` of
shape ``(R, D)`` (typically NUTS draws), both over the same flattened coordinates
(:func:`flatten_samples` builds them from Pyro sample dicts). ``S`` and ``R`` may differ.
Inputs are detached and computed on in float64; per-coordinate metrics return ``(D,)``
float64 tensors and joint metrics 0-dim float64 tensors. :func:`compare_samples` wraps them
into a per-site and joint report of Python floats.

Scale conventions: standard deviations are the unbiased sample ones (``correction=1``) and
every "standardised" quantity is measured in units of the **reference** standard deviation,
so that a metric reads the same whatever the units of the parameter. A reference coordinate
with zero spread is left on its raw scale by the joint metrics; the per-coordinate ratios
give ``0`` (mean error, W1) or ``1`` (sd ratio) when both sides are equally degenerate and
``inf`` otherwise.

Non-finite draws propagate as ``nan``/``inf`` rather than raising, so a diverged
approximation still shows up in a comparison table.
"""

import itertools
import math

import torch

from pyro_implicit.kernels import RBFKernel, squared_distances

__all__ = [
    "compare_samples",
    "correlation_error",
    "correlation_rmse",
    "energy_distance",
    "flatten_samples",
    "mmd_rbf",
    "sd_ratio",
    "standardized_mean_error",
    "wasserstein_1d",
]

# Pairwise matrices larger than this (in elements) are built a block of rows at a time:
# 4e6 float64 values is 32 MB per block.
_MAX_CHUNK_ELEMENTS = 4_000_000


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _as_matrix(x, name, min_rows=1):
    """Detached float64 ``(N, D)`` view of ``x``; a 1-D input is one coordinate."""
    x = torch.as_tensor(x).detach().to(torch.float64)
    if x.dim() == 1:
        x = x.unsqueeze(-1)
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (num_samples, D), got {tuple(x.shape)}")
    if x.shape[0] < min_rows:
        raise ValueError(f"{name} needs at least {min_rows} samples, got {x.shape[0]}")
    return x


def _check_pair(draws, reference, min_draws=1, min_reference=2):
    draws = _as_matrix(draws, "draws", min_draws)
    reference = _as_matrix(reference, "reference", min_reference)
    if draws.shape[1] != reference.shape[1]:
        raise ValueError(
            f"draws have D={draws.shape[1]} coordinates but reference has D={reference.shape[1]}"
        )
    return draws, reference.to(draws.device)


def _ratio(num, den, both_zero):
    """``num / den`` with ``den == 0`` mapped to ``both_zero`` (if ``num == 0``) or ``inf``."""
    out = num / torch.where(den > 0, den, torch.ones_like(den))
    degenerate = torch.where(
        num == 0, torch.full_like(num, both_zero), torch.full_like(num, math.inf)
    )
    return torch.where(den > 0, out, degenerate)


def _sd(x):
    # A single draw has no spread; report 0 rather than torch's nan for correction=1.
    if x.shape[0] < 2:
        return torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    return x.std(dim=0, correction=1)


def _standardize_by_reference(draws, reference):
    """Both sets in reference units: centred on the reference mean, scaled by its sd."""
    loc = reference.mean(0)
    scale = _sd(reference)
    # A constant reference coordinate has no natural unit; leave it on its raw scale.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (draws - loc) / scale, (reference - loc) / scale


def _subsample(x, max_samples, generator):
    """At most ``max_samples`` rows of ``x``, drawn without replacement."""
    if max_samples is None or x.shape[0] <= max_samples:
        return x
    if max_samples < 2:
        raise ValueError(f"max_samples must be at least 2, got {max_samples}")
    idx = torch.randperm(x.shape[0], generator=generator)[:max_samples]
    return x[idx.to(x.device)]


def _pairwise_sum(x, y, fn, exclude_diagonal=False):
    """``sum_ij fn(||x_i - y_j||^2)`` without holding more than ~4e6 pairs at once.

    With ``exclude_diagonal`` (``x`` and ``y`` the same set) the ``i == j`` terms are
    dropped, which is what a U-statistic needs.
    """
    n, m = x.shape[0], y.shape[0]
    rows = max(1, _MAX_CHUNK_ELEMENTS // max(m, 1))
    total = x.new_zeros(())
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        vals = fn(squared_distances(x[start:stop], y))
        if exclude_diagonal:
            local = torch.arange(stop - start, device=x.device)
            vals[local, local + start] = 0.0
        total = total + vals.sum()
    return total


def _reduce(t, op):
    """Python float of a reduction, ``nan`` for an empty tensor."""
    if t.numel() == 0:
        return math.nan
    if op == "median":
        return float(torch.quantile(t, 0.5))  # averages the middle pair, unlike torch.median
    return float(getattr(t, op)())


# ---------------------------------------------------------------------------------------
# per-coordinate metrics
# ---------------------------------------------------------------------------------------


def standardized_mean_error(draws, reference):
    """Per-coordinate error of the mean in reference standard deviations,
    :math:`|\\bar{q}_d - \\bar{r}_d| / \\mathrm{sd}(r_d)`.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :return: ``(D,)`` float64 tensor.
    :rtype: torch.Tensor
    """
    draws, reference = _check_pair(draws, reference)
    err = (draws.mean(0) - reference.mean(0)).abs()
    return _ratio(err, _sd(reference), both_zero=0.0)


def sd_ratio(draws, reference):
    """Per-coordinate ratio of standard deviations :math:`\\mathrm{sd}(q_d)/\\mathrm{sd}(r_d)`.

    Values below 1 mean the approximation is too narrow (the usual failure of
    mean-field VI), above 1 too wide.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws, ``S >= 2``.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :return: ``(D,)`` float64 tensor.
    :rtype: torch.Tensor
    """
    draws, reference = _check_pair(draws, reference, min_draws=2)
    return _ratio(_sd(draws), _sd(reference), both_zero=1.0)


def wasserstein_1d(draws, reference, standardize=True):
    """Per-coordinate 1-Wasserstein distance between the empirical marginals.

    Exact for any sample sizes: :math:`W_1 = \\int_0^1 |F^{-1}(p) - G^{-1}(p)|\\,dp` with the
    empirical quantile functions :math:`F^{-1}(p) = x_{(\\lceil S p \\rceil)}`, which are
    piecewise constant between the levels :math:`\\{i/S\\} \\cup \\{j/R\\}`. The levels are
    kept as integers over the common denominator :math:`S R`, so merging the two grids
    involves no floating-point ties. Cost :math:`O((S + R) D)` memory after sorting.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :param bool standardize: divide by the reference standard deviation (default), so
        the distance reads in reference sds; for equal-shape marginals it then equals the
        standardised mean error.
    :return: ``(D,)`` float64 tensor.
    :rtype: torch.Tensor
    """
    draws, reference = _check_pair(draws, reference)
    s, r = draws.shape[0], reference.shape[0]
    x = draws.sort(dim=0).values
    y = reference.sort(dim=0).values
    device = draws.device
    # Right end points of the constant pieces, in units of 1 / (s * r).
    levels = torch.cat(
        [
            torch.arange(1, s + 1, device=device, dtype=torch.int64) * r,
            torch.arange(1, r + 1, device=device, dtype=torch.int64) * s,
        ]
    ).unique(sorted=True)
    widths = torch.diff(levels, prepend=levels.new_zeros(1)).to(torch.float64) / (s * r)
    # On (a, b] the quantile index is ceil(b / r) - 1 for x and ceil(b / s) - 1 for y,
    # because every multiple of r (resp. s) is itself a level.
    ix = (levels + r - 1) // r - 1
    iy = (levels + s - 1) // s - 1
    w1 = (widths.unsqueeze(-1) * (x[ix] - y[iy]).abs()).sum(0)
    if standardize:
        w1 = _ratio(w1, _sd(reference), both_zero=0.0)
    return w1


# ---------------------------------------------------------------------------------------
# joint metrics
# ---------------------------------------------------------------------------------------


def _joint_pair(draws, reference, standardize, max_samples, seed):
    """The checked (optionally standardised) pair, each subsampled to ``max_samples`` rows
    with a private generator seeded by ``seed``."""
    draws, reference = _check_pair(draws, reference, min_draws=2)
    if standardize:
        draws, reference = _standardize_by_reference(draws, reference)
    generator = torch.Generator().manual_seed(seed)
    return _subsample(draws, max_samples, generator), _subsample(reference, max_samples, generator)


def energy_distance(draws, reference, standardize=True, max_samples=2000, seed=0):
    """Energy distance :math:`2E|X - Y| - E|X - X'| - E|Y - Y'|` between the joint
    distributions (Szekely & Rizzo), with :math:`|\\cdot|` the Euclidean norm.

    Estimator: the cross term is the mean over all :math:`S R` pairs and the two within
    terms are **U-statistics** (mean over distinct pairs), so the estimate is unbiased for
    the population energy distance: about zero for two independent samples of the same
    distribution, and it can come out slightly negative. (For two *identical* sample sets
    it is :math:`-2 \\overline{|X - X'|} / S`, not exactly zero.)

    Distances are computed with the Gram identity (clamped at zero before the square
    root) in blocks of rows, so memory is :math:`O(\\min(S R, 4\\cdot 10^6) + (S + R) D)`.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws, ``S >= 2``.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :param bool standardize: first centre and scale every coordinate by the reference
        mean and sd (default), so no coordinate dominates by its units alone.
    :param int max_samples: each set is randomly subsampled (without replacement) to at
        most this many rows; ``None`` uses all. The cost is quadratic in this. Below
        the cap the estimate is invariant to row order; above it the subset, and so the
        estimate, depends on the order of the rows.
    :param int seed: seed of the private ``torch.Generator`` used for subsampling, so
        the result is deterministic and the global RNG is untouched.
    :return: 0-dim float64 tensor.
    :rtype: torch.Tensor
    """
    x, y = _joint_pair(draws, reference, standardize, max_samples, seed)
    n, m = x.shape[0], y.shape[0]
    xy = _pairwise_sum(x, y, torch.sqrt) / (n * m)
    xx = _pairwise_sum(x, x, torch.sqrt, exclude_diagonal=True) / (n * (n - 1))
    yy = _pairwise_sum(y, y, torch.sqrt, exclude_diagonal=True) / (m * (m - 1))
    return 2.0 * xy - xx - yy


def mmd_rbf(draws, reference, bandwidth=None, standardize=True, max_samples=1000, seed=0):
    """Unbiased squared maximum mean discrepancy with a Gaussian kernel,
    :math:`\\mathrm{MMD}^2_u = \\overline{k(x, x')} + \\overline{k(y, y')} - 2\\overline{k(x, y)}`
    with U-statistics for the within terms (so it can be slightly negative).

    The kernel is :class:`pyro_implicit.kernels.RBFKernel`; by default its length scale is
    the library's median heuristic on the pooled (subsampled) draws.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws, ``S >= 2``.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :param float bandwidth: fixed length scale (in standardised units when
        ``standardize``); ``None`` for the median heuristic.
    :param bool standardize: centre and scale by the reference mean and sd first.
    :param int max_samples: subsample each set to at most this many rows (the median
        heuristic alone needs :math:`O((S + R)^2)` memory); ``None`` uses all.
    :param int seed: seed of the private generator used for subsampling.
    :return: 0-dim float64 tensor.
    :rtype: torch.Tensor
    """
    x, y = _joint_pair(draws, reference, standardize, max_samples, seed)
    n, m = x.shape[0], y.shape[0]
    kernel = RBFKernel(bandwidth=bandwidth)
    h = kernel.bandwidth(x, y)

    def k(d2):
        return kernel.from_squared_distances(d2, h)

    kxx = _pairwise_sum(x, x, k, exclude_diagonal=True) / (n * (n - 1))
    kyy = _pairwise_sum(y, y, k, exclude_diagonal=True) / (m * (m - 1))
    kxy = _pairwise_sum(x, y, k) / (n * m)
    return kxx + kyy - 2.0 * kxy


def _correlation_matrix(x):
    """Pearson correlation matrix of the columns; a constant column correlates 0."""
    xc = x - x.mean(0)
    norm = xc.pow(2).sum(0).sqrt()
    z = xc / torch.where(norm > 0, norm, torch.ones_like(norm))
    return z.T @ z


def _correlation_difference(draws, reference):
    """Off-diagonal entries of ``corr(draws) - corr(reference)``."""
    draws, reference = _check_pair(draws, reference, min_draws=2)
    d = draws.shape[1]
    diff = _correlation_matrix(draws) - _correlation_matrix(reference)
    off = ~torch.eye(d, dtype=torch.bool, device=diff.device)
    return diff[off]


def correlation_error(draws, reference):
    """Largest absolute difference between the off-diagonal entries of the two sample
    correlation matrices. Zero for ``D = 1``.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws, ``S >= 2``.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :return: 0-dim float64 tensor.
    :rtype: torch.Tensor
    """
    diff = _correlation_difference(draws, reference)
    if diff.numel() == 0:
        return diff.new_zeros(())
    return diff.abs().max()


def correlation_rmse(draws, reference):
    """Root-mean-square difference of the off-diagonal correlations,
    :math:`\\|C_q - C_r\\|_F / \\sqrt{D (D - 1)}`. Zero for ``D = 1``.

    :param torch.Tensor draws: ``(S, D)`` approximate-posterior draws, ``S >= 2``.
    :param torch.Tensor reference: ``(R, D)`` reference draws, ``R >= 2``.
    :return: 0-dim float64 tensor.
    :rtype: torch.Tensor
    """
    diff = _correlation_difference(draws, reference)
    if diff.numel() == 0:
        return diff.new_zeros(())
    return diff.pow(2).mean().sqrt()


# ---------------------------------------------------------------------------------------
# sample dictionaries
# ---------------------------------------------------------------------------------------


def _coordinate_names(name, event_shape):
    if len(event_shape) == 0:
        return [name]
    # Row-major order, matching ``reshape``.
    return [
        f"{name}[{','.join(map(str, idx))}]"
        for idx in itertools.product(*(range(n) for n in event_shape))
    ]


def flatten_samples(samples, sample_dims=1):
    """Stack a dict of sample tensors into one ``(S, D)`` float64 matrix.

    :param dict samples: site name -> tensor whose leading ``sample_dims`` dims are sample
        dims (e.g. ``(S, ...)`` from :class:`pyro.infer.Predictive`, or ``(chains, draws,
        ...)`` with ``sample_dims=2``). Every site must have the same sample dims.
    :param int sample_dims: number of leading sample dims, flattened into ``S``.
    :return: ``(x, names)``: ``x`` of shape ``(S, D)`` with the sites in dict order, each
        flattened row-major, and coordinate names such as ``"mu"``, ``"theta[3]"``,
        ``"beta[0,1]"``.
    :rtype: tuple[torch.Tensor, list[str]]
    """
    if not samples:
        raise ValueError("samples is empty")
    if sample_dims < 1:
        raise ValueError(f"sample_dims must be at least 1, got {sample_dims}")
    columns, names = [], []
    sample_shape = None
    for name, value in samples.items():
        value = torch.as_tensor(value).detach()
        if value.dim() < sample_dims:
            raise ValueError(
                f"site '{name}' has shape {tuple(value.shape)}, fewer than "
                f"sample_dims={sample_dims} dims"
            )
        shape = tuple(value.shape[:sample_dims])
        if sample_shape is None:
            sample_shape = shape
        elif shape != sample_shape:
            raise ValueError(
                f"site '{name}' has sample shape {shape} but earlier sites have {sample_shape}"
            )
        event_shape = tuple(value.shape[sample_dims:])
        columns.append(value.reshape(math.prod(shape), math.prod(event_shape)).to(torch.float64))
        names.extend(_coordinate_names(name, event_shape))
    return torch.cat(columns, dim=1), names


def compare_samples(samples, reference, sites=None, sample_dims=1, max_samples=2000, seed=0):
    """Compare approximate-posterior samples with reference samples, site by site and
    jointly.

    :param dict samples: site name -> ``(S, ...)`` tensor of approximate draws.
    :param dict reference: site name -> ``(R, ...)`` tensor of reference (e.g. NUTS)
        draws.
    :param list sites: sites to compare; each must be in both dicts. ``None`` (default)
        compares every site the two dicts share, in ``reference`` order, and lists the
        others under ``"ignored"`` (e.g. observed sites in predictive samples).
    :param int sample_dims: leading sample dims of every tensor in both dicts.
    :param int max_samples: subsampling cap for the energy distance.
    :param int seed: subsampling seed for the energy distance.
    :return: ``{"sites": {name: per-site}, "joint": {...}, "ignored": [...]}`` of Python
        floats. Per site: ``num_coords``, ``mean_error_max`` (standardised mean error,
        max over coordinates), ``sd_ratio_min``, ``sd_ratio_median``, ``sd_ratio_max``,
        ``w1_max`` (standardised W1, max over coordinates). Joint, over all compared
        coordinates: the same summaries plus ``energy_distance`` (standardised),
        ``correlation_error_max`` and ``correlation_error_rms``.
    :rtype: dict
    :raises ValueError: if no site is shared, a requested site is missing, or a site's
        shape differs between the two dicts.
    """
    if sites is None:
        sites = [name for name in reference if name in samples]
        if not sites:
            raise ValueError(
                f"samples and reference share no sites: samples has {sorted(samples)}, "
                f"reference has {sorted(reference)}"
            )
    else:
        sites = list(sites)
        for where, d in (("samples", samples), ("reference", reference)):
            missing = [name for name in sites if name not in d]
            if missing:
                raise ValueError(f"sites {missing} are missing from {where}")
    ignored = sorted((set(samples) | set(reference)) - set(sites))
    for name in sites:
        q_shape = tuple(torch.as_tensor(samples[name]).shape[sample_dims:])
        r_shape = tuple(torch.as_tensor(reference[name]).shape[sample_dims:])
        if q_shape != r_shape:
            raise ValueError(
                f"site '{name}' has shape {q_shape} per sample in samples but {r_shape} "
                "in reference"
            )

    x, _ = flatten_samples({name: samples[name] for name in sites}, sample_dims)
    y, _ = flatten_samples({name: reference[name] for name in sites}, sample_dims)
    mean_err = standardized_mean_error(x, y)
    ratio = sd_ratio(x, y)
    w1 = wasserstein_1d(x, y)

    def summary(cols):
        return {
            "num_coords": int(cols.stop - cols.start),
            "mean_error_max": _reduce(mean_err[cols], "max"),
            "sd_ratio_min": _reduce(ratio[cols], "min"),
            "sd_ratio_median": _reduce(ratio[cols], "median"),
            "sd_ratio_max": _reduce(ratio[cols], "max"),
            "w1_max": _reduce(w1[cols], "max"),
        }

    per_site = {}
    start = 0
    for name in sites:
        size = math.prod(torch.as_tensor(reference[name]).shape[sample_dims:])
        per_site[name] = summary(slice(start, start + size))
        start += size
    joint = summary(slice(0, x.shape[1]))
    if x.shape[1] > 0:
        joint["energy_distance"] = float(energy_distance(x, y, max_samples=max_samples, seed=seed))
    else:
        joint["energy_distance"] = math.nan
    joint["correlation_error_max"] = float(correlation_error(x, y))
    joint["correlation_error_rms"] = float(correlation_rmse(x, y))
    return {"sites": per_site, "joint": joint, "ignored": ignored}
