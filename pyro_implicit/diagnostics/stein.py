r"""Kernel Stein discrepancy: how far any set of draws is from a model's posterior,
from the score of the log-joint alone.

For draws :math:`x_1, \dots, x_S` of the packed unconstrained latent and the score
:math:`s(x) = \nabla_x \log \tilde p(x)` of the model's unnormalised log-density there, the
kernel Stein discrepancy (Gorham & Mackey 2017, eq. 4 and Thm. 8; Liu, Lee & Jordan 2016)
is

.. math:: \mathrm{KSD}^2 = \frac{1}{S^2} \sum_{i,j} k_p(x_i, x_j), \quad
    k_p(x, y) = s(x)^\top s(y)\, k + s(x)^\top \nabla_y k + s(y)^\top \nabla_x k
    + \operatorname{tr} \nabla_x \nabla_y k,

with the inverse multiquadric base kernel :math:`k(x, y) = (c^2 + \lVert x - y
\rVert^2)^\beta`, :math:`\beta = -1/2`, :math:`c = 1` (Gorham & Mackey's choice: with
:math:`\beta \in (-1, 0)` the KSD detects non-convergence, which the Gaussian kernel does
not, Thm. 6-8). It is zero only for the posterior and needs no density of the
approximation: it scores an :class:`~pyro_implicit.guides.ImplicitGuide`, a particle set
and NUTS draws alike.

The sum is computed from three Gram matrices (:math:`XX^\top`, :math:`SS^\top`,
:math:`SX^\top`) in row blocks: :math:`O(S^2 + SD)` memory, never an
:math:`S \times S \times D` tensor.

Coordinates. The KSD is not invariant to an affine map of the draws (the kernel's length
scale is fixed), so it is computed in the coordinates :math:`z = L^{-1}(u - m)` of a
:class:`~pyro_implicit.latent.Preconditioner` when the fit has one, where the posterior has
roughly unit scale (the score becomes :math:`L^\top s`). Values are comparable only in the
same coordinates: to rank several fits of one model, pass them all the same
``preconditioner`` (:func:`~pyro_implicit.diagnostics.compare.compare` does).

References

[1] `Measuring Sample Quality with Kernels`, Jackson Gorham, Lester Mackey, ICML 2017.
[2] `A Kernelized Stein Discrepancy for Goodness-of-fit Tests`, Qiang Liu, Jason D. Lee,
    Michael Jordan, ICML 2016.
"""

import dataclasses
import math

import torch

from ..guides import ImplicitAutoGuide
from ..latent import LatentSpace, Preconditioner, resolve_precondition
from ..particles import ParticleInference
from ..random_streams import random_streams_kept
from .draws import guess_max_plate_nesting, posterior_draws, source_kind

__all__ = [
    "SteinDiscrepancy",
    "imq_stein_kernel_sums",
    "model_preconditioner",
    "stein_discrepancy",
]

#: rows of the S x S Stein-kernel matrix formed at once
_ROW_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class SteinDiscrepancy:
    """The kernel Stein discrepancy of a set of draws (:func:`stein_discrepancy`).

    :ivar float ksd: :math:`\\sqrt{V}`, the square root of the V-statistic (Gorham &
        Mackey's KSD of the empirical measure of the draws; ``inf`` when some draw has a
        non-finite score). Smaller is better; exact draws give about ``noise_level``.
    :ivar float ksd_squared_unbiased: the U-statistic of :math:`\\mathrm{KSD}^2` (the
        diagonal left out): an unbiased estimate of the population :math:`\\mathrm{KSD}^2`
        of the distribution the draws come from, for iid draws; near zero (either sign)
        for exact ones.
    :ivar float noise_level: :math:`\\sqrt{\\bar k_p / S}` with :math:`\\bar k_p` the mean
        of :math:`k_p(x_i, x_i)`: the KSD that ``S`` exact independent draws would show,
        from the draws' own scores (approximate: exact when the draws are the posterior).
    :ivar int num_draws: ``S``.
    :ivar int num_nonfinite: draws whose value or score is not finite.
    :ivar int latent_dim: ``D``.
    :ivar bool whitened: whether it was computed in a preconditioner's coordinates.
    """

    ksd: float
    ksd_squared_unbiased: float
    noise_level: float
    num_draws: int
    num_nonfinite: int
    latent_dim: int
    whitened: bool

    def __float__(self):
        return self.ksd

    @property
    def ratio_to_noise(self):
        """``ksd / noise_level``: about 1 for exact draws, growing with the error."""
        return self.ksd / self.noise_level if self.noise_level > 0 else math.inf


def imq_stein_kernel_sums(x, score, c=1.0, beta=-0.5):
    r"""The sum of the IMQ Stein kernel over all pairs of rows, and over the diagonal.

    :math:`k_p` of the module docstring with :math:`r = x - y`, :math:`q = c^2 +
    \lVert r \rVert^2`:

    .. math:: k_p = s_x^\top s_y\, q^\beta + 2\beta q^{\beta-1} (s_y - s_x)^\top r
        - 2\beta D q^{\beta - 1} - 4\beta(\beta - 1) q^{\beta - 2} \lVert r \rVert^2,

    every term read off Gram matrices of the (centred) rows, in blocks of rows.

    :param torch.Tensor x: ``(S, D)`` points.
    :param torch.Tensor score: ``(S, D)`` target scores at ``x``.
    :param float c: the kernel's scale.
    :param float beta: its exponent, in ``(-1, 0)``.
    :return: ``(total, diagonal)``: float64 scalars :math:`\sum_{i,j} k_p(x_i, x_j)` and
        :math:`\sum_i k_p(x_i, x_i)`.
    """
    if x.dim() != 2 or x.shape != score.shape:
        raise ValueError(
            f"x and score must both be (S, D), got {tuple(x.shape)} and {tuple(score.shape)}"
        )
    if not -1.0 < beta < 0.0 or c <= 0:
        raise ValueError(f"need beta in (-1, 0) and c > 0, got beta={beta}, c={c}")
    # float64 and centred rows: the Gram identity for |x - y|^2 loses digits otherwise
    x = x.to(torch.float64)
    x = x - x.mean(0)
    score = score.to(torch.float64)
    num, dim = x.shape
    sq = x.pow(2).sum(-1)
    sx_diag = (score * x).sum(-1)  # s_i . x_i
    c2 = c * c
    total = x.new_zeros(())
    for start in range(0, num, _ROW_BLOCK):
        rows = slice(start, min(start + _ROW_BLOCK, num))
        xb, sb = x[rows], score[rows]
        r2 = (sq[rows, None] + sq[None, :] - 2 * xb @ x.T).clamp_min(0.0)
        q = c2 + r2
        # (s_j - s_i) . (x_i - x_j) = s_j.x_i - s_j.x_j - s_i.x_i + s_i.x_j
        cross = (xb @ score.T) - sx_diag[None, :] - sx_diag[rows, None] + (sb @ x.T)
        kp = (
            (sb @ score.T) * q.pow(beta)
            + 2 * beta * q.pow(beta - 1) * (cross - dim)
            - 4 * beta * (beta - 1) * q.pow(beta - 2) * r2
        )
        total = total + kp.sum()
    diagonal = score.pow(2).sum() * c2**beta - num * 2 * beta * dim * c2 ** (beta - 1)
    return total, diagonal


def _draws_in_latent_space(model, source, args, kwargs, num_samples, max_plate_nesting):
    """``(space, u, preconditioner)`` for anything :func:`posterior_draws` accepts."""
    if isinstance(source, ImplicitAutoGuide):
        source._check_ready()
        with torch.no_grad():
            u = source.sample_unconstrained(num_samples)
        return source.latent_space(*args, **kwargs), u, source.preconditioner
    if isinstance(source, ParticleInference):
        if source.particles is None:
            raise ValueError("the particle set has not been stepped yet: call step() first")
        return source.space, source.unconstrained_particles().detach(), source.preconditioner
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    draws, _ = posterior_draws(source, model, args, kwargs, num_samples, max_plate_nesting)
    space = LatentSpace.from_model(model, args, kwargs, max_plate_nesting)
    return space, space.pack(draws), Preconditioner.identity()


def model_preconditioner(
    model, *args, max_plate_nesting=None, vi_estimator="entropy", seed=0, **kwargs
):
    """The model's automatic preconditioner (:func:`~pyro_implicit.latent.find_preconditioner`
    from the prior medians, its Gaussian fit by ``vi_estimator``: the one the methods of
    the library find), to pass as ``preconditioner`` to several :func:`stein_discrepancy`
    calls so that their values are comparable.

    :param int seed: seed of the prior draws whose medians start the search, so that a
        model gets the same coordinates whatever ran before (the caller's random streams
        are left as they were).
    :rtype: ~pyro_implicit.latent.Preconditioner
    """
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    with random_streams_kept(seed):
        space = LatentSpace.from_model(model, args, kwargs, max_plate_nesting)
    return resolve_precondition(
        True, space, space.init_loc, args, kwargs, vi_estimator=vi_estimator
    )


@torch.no_grad()
def stein_discrepancy(
    model,
    source,
    *args,
    num_samples=1000,
    preconditioner=None,
    max_plate_nesting=None,
    full_data=True,
    batch_size=256,
    c=1.0,
    beta=-0.5,
    **kwargs,
):
    """The IMQ kernel Stein discrepancy of posterior draws of ``model`` (module docstring).

    Works for every kind of fit: draws of a guide without a density (``ImplicitGuide``),
    particles, NUTS draws, Pyro's guides.

    :param callable model: the Pyro model.
    :param source: draws ``{site: (S, *site_shape)}`` in constrained space (as
        :func:`~pyro_implicit.diagnostics.compare.posterior_draws` returns, or
        ``mcmc.get_samples()``), a fitted guide (ours or Pyro's) or a particle set
        (:class:`~pyro_implicit.particles.ParticleInference`, ``pyro.infer.SVGD``).
    :param args: the model's positional arguments (its keyword arguments go in
        ``kwargs``; the names below are reserved).
    :param int num_samples: draws taken from a guide (particle sets and dicts give theirs).
    :param preconditioner: the coordinates: ``None`` (default) those of the fit's own
        preconditioner (the identity for draws, particles without one and Pyro's guides);
        a :class:`~pyro_implicit.latent.Preconditioner` to fix them (to compare several
        fits of one model, pass all of them the same one); ``False`` the raw
        unconstrained space.
    :param int max_plate_nesting: the model's plate nesting (read from the model if
        ``None``).
    :param bool full_data: score on the full data (default; a subsampled model is run on
        minibatches covering every index); ``False`` uses one minibatch per score batch,
        which is cheaper on large data but adds the minibatch noise to every score and so
        inflates the KSD.
    :param int batch_size: draws scored per model run (bounds the memory of the run).
    :param float c: the IMQ kernel's scale (in whitened units).
    :param float beta: its exponent.
    :rtype: SteinDiscrepancy
    """
    if source_kind(source) == "samples" and not source:
        raise ValueError("no draws given")
    space, u, own = _draws_in_latent_space(
        model, source, args, kwargs, num_samples, max_plate_nesting
    )
    if preconditioner is None:
        preconditioner = own
    elif preconditioner is False:
        preconditioner = Preconditioner.identity()
    elif not isinstance(preconditioner, Preconditioner):
        raise TypeError(
            "preconditioner must be None, False or a pyro_implicit.latent.Preconditioner, "
            f"got {type(preconditioner).__name__}"
        )
    num = u.shape[0]
    if num < 2:
        raise ValueError(f"the Stein discrepancy needs at least 2 draws, got {num}")
    dim, whitened = space.latent_dim, not preconditioner.is_identity
    # a draw that is not finite, or where the model's density is not, is infinitely far
    # from the posterior (and the model must not see it: validation would reject it)
    bad = int((~torch.isfinite(u).all(-1)).sum())
    if bad:
        return SteinDiscrepancy(math.inf, math.nan, math.nan, num, bad, dim, whitened)
    scores = []
    for start in range(0, num, batch_size):
        _, s = space.score(u[start : start + batch_size], args, kwargs, full_data=full_data)
        scores.append(s)
    z = preconditioner.whiten(u)
    white_score = preconditioner.whiten_score(torch.cat(scores))
    bad = int((~torch.isfinite(white_score).all(-1)).sum())
    if bad:
        return SteinDiscrepancy(math.inf, math.nan, math.nan, num, bad, dim, whitened)
    total, diagonal = imq_stein_kernel_sums(z, white_score, c=c, beta=beta)
    v_stat = float(total) / num**2
    u_stat = float(total - diagonal) / (num * (num - 1))
    return SteinDiscrepancy(
        ksd=math.sqrt(max(v_stat, 0.0)),
        ksd_squared_unbiased=u_stat,
        noise_level=math.sqrt(max(float(diagonal), 0.0) / num) / math.sqrt(num),
        num_draws=num,
        num_nonfinite=0,
        latent_dim=dim,
        whitened=whitened,
    )
