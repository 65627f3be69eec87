r"""Pareto-smoothed importance sampling (PSIS) for every guide with a log-density: the
k-hat diagnostic and importance-refined posterior draws.

With draws :math:`u_s \sim q` of the packed unconstrained latent and weights
:math:`w_s = \tilde p(u_s) / q(u_s)` (the model's unconstrained log-density, log-Jacobian
included, over the guide's), the largest weights are replaced by quantiles of a generalised
Pareto distribution fitted to them (Vehtari et al. 2024, Alg. 1). The fitted shape
:math:`\hat k` says how heavy the weights' tail is: below 0.5 the guide's tails cover the
posterior's and weighted estimates converge fast; between 0.5 and 0.7 slowly; above 0.7
the weights cannot be trusted and neither, often, the guide (Yao et al. 2018). The
smoothed weights turn the guide's draws into a refined posterior (self-normalised
importance sampling, as Pyro's ``WeighedPredictive`` and every Pathfinder do).

Which guides have a log-density :math:`q(u)`:

* Pyro's ``AutoContinuous`` guides (``AutoNormal`` as well, through
  ``pyro.infer.importance.vectorized_importance_weights``): exact.
* :class:`~pyro_implicit.guides.SemiImplicitGuide`: the mixture
  :math:`q(u) = \mathbb E_\psi\, q(u \mid \psi)` estimated with ``num_mixing`` extra
  mixing draws shared by all ``u``, without the draw's own :math:`\psi` (SIVI's upper-bound
  estimator, Yin & Zhou 2018, eq. 10). By Jensen's inequality the estimate of
  :math:`\log q` is low on average, most where few mixing draws cover ``u`` (q's tails),
  so weights there come out too large and :math:`\hat k` errs on the pessimistic side;
  it shrinks as ``num_mixing`` grows.
* :class:`~pyro_implicit.guides.LinearizedGuide`: LIVI's linearised density (Uppal et al.
  2023, eq. 11), the Gaussian :math:`\mathcal N(g(z) - J z,\ J J^\top + \sigma^2 I)` of
  the generator linearised at each draw's own noise ``z``: exact for a linear generator,
  an approximation otherwise (its error enters the weights).
* :class:`~pyro_implicit.guides.ImplicitGuide` and particle sets have none: use
  :func:`~pyro_implicit.diagnostics.stein.stein_discrepancy`.

References

[1] `Pareto Smoothed Importance Sampling`, Aki Vehtari, Daniel Simpson, Andrew Gelman,
    Yuling Yao, Jonah Gabry, JMLR 25(72), 2024.
[2] `Yes, but Did It Work?: Evaluating Variational Inference`, Yuling Yao, Aki Vehtari,
    Daniel Simpson, Andrew Gelman, ICML 2018.
"""

import dataclasses
import math

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import (
    AutoContinuous,
    AutoDelta,
    AutoGuide,
    AutoLaplaceApproximation,
)
from pyro.infer.importance import vectorized_importance_weights
from pyro.ops.stats import fit_generalized_pareto

from ..elbo.livi import jacobian
from ..guides import ImplicitAutoGuide, LinearizedGuide, SemiImplicitGuide
from ..latent import LatentSpace
from .draws import guess_max_plate_nesting, latent_shapes

__all__ = [
    "ImportanceResult",
    "UnreliableFitWarning",
    "UnreliableWeightsError",
    "has_log_density",
    "importance_refine",
    "importance_weights",
    "pareto_smooth",
    "psis_diagnostic",
]

#: k-hat above which importance weights are not trusted (Yao et al. 2018)
K_HAT_THRESHOLD = 0.7

#: draws whose linearised density is computed at once (a (B, D, d) Jacobian each)
_JACOBIAN_BLOCK = 128


class UnreliableFitWarning(UserWarning):
    """A fitted guide's PSIS k-hat is above 0.7 (raised once per comparison)."""


class UnreliableWeightsError(ValueError):
    """Importance refinement refused: the weights' Pareto k-hat is above the threshold."""


def pareto_smooth(log_weights):
    r"""Pareto-smoothed, self-normalised log weights and the tail shape :math:`\hat k`.

    The largest :math:`M = \lceil \min(S/5, 3\sqrt S) \rceil` weights are replaced by the
    expected order statistics of a generalised Pareto distribution fitted to them (Pyro's
    :func:`~pyro.ops.stats.fit_generalized_pareto`, Zhang & Stephens' estimate with the
    weak prior of Vehtari et al. 2024; the same tail and fit as
    ``pyro.infer.importance.psis_diagnostic``), capped at the largest raw weight, as ArviZ's
    ``psislw`` does.

    :param torch.Tensor log_weights: ``(S,)`` unnormalised log weights.
    :return: ``(smoothed, k_hat)``: ``(S,)`` log weights with ``logsumexp = 0`` and a float
        (``inf`` when the tail is too short to fit: fewer than 10 weights above the cutoff;
        ``-inf`` when all weights are equal, as for the exact posterior).
    """
    lw = torch.as_tensor(log_weights).detach().to(torch.float64).flatten()
    num = lw.numel()
    if not torch.isfinite(lw).all():
        raise ValueError(
            f"{int((~torch.isfinite(lw)).sum())} of {num} log weights are not finite: a draw "
            "of the guide has zero density under the model (or NaN); the guide's support "
            "does not match the model's"
        )
    lw = lw - lw.max()
    tail_len = math.ceil(min(0.2 * num, 3 * math.sqrt(num)))
    order = torch.argsort(lw)
    cutoff = max(float(lw[order[-tail_len - 1]]) if tail_len < num else -math.inf, math.log(1e-15))
    tail = order[lw[order] > cutoff]
    smoothed = lw.clone()
    if float(lw.min()) > -1e-12:
        # equal weights (the guide is the posterior): no tail at all
        k_hat = -math.inf
    elif tail.numel() < 10:
        k_hat = math.inf
    else:
        excess = lw[tail].exp() - math.exp(cutoff)
        # Pyro's fit makes its grid on the CPU: the tail (a few dozen numbers) goes there
        k_hat, sigma = fit_generalized_pareto(excess.cpu())
        if math.isfinite(k_hat):
            n = tail.numel()
            p = (torch.arange(n, dtype=torch.float64, device=lw.device) + 0.5) / n
            if abs(k_hat) > 1e-10:
                quantile = sigma / k_hat * ((1 - p).pow(-k_hat) - 1)
            else:
                quantile = -sigma * torch.log1p(-p)
            smoothed[tail] = torch.log(quantile + math.exp(cutoff)).clamp_max(0.0)
    return smoothed - torch.logsumexp(smoothed, 0), float(k_hat)


@dataclasses.dataclass
class ImportanceResult:
    """A guide's draws with their Pareto-smoothed importance weights.

    :ivar dict draws: ``{site: (S, *site_shape)}`` constrained draws of the guide.
    :ivar torch.Tensor log_weights: ``(S,)`` smoothed, self-normalised log weights.
    :ivar torch.Tensor raw_log_weights: ``(S,)`` :math:`\\log \\tilde p - \\log q`
        before smoothing.
    :ivar float k_hat: the Pareto shape of the weights' tail (module docstring).
    :ivar float ess: effective sample size :math:`1 / \\sum_s \\bar w_s^2` of the smoothed
        weights.
    :ivar str density: how :math:`q(u)` was computed (``"exact"``, ``"mixture estimate
        (K=...)"``, ``"linearised"``).
    """

    draws: dict
    log_weights: torch.Tensor
    raw_log_weights: torch.Tensor
    k_hat: float
    ess: float
    density: str

    @property
    def num_draws(self):
        return int(self.log_weights.shape[0])

    @property
    def log_evidence(self):
        """:math:`\\log \\frac1S \\sum_s w_s`, the importance estimate of
        :math:`\\log p(x)` (unsmoothed; reliable only when ``k_hat`` is small)."""
        lw = self.raw_log_weights
        return float(torch.logsumexp(lw, 0) - math.log(lw.numel()))

    def _weights(self, value):
        w = self.log_weights.exp().to(value.dtype)
        return w.reshape((-1,) + (1,) * (value.dim() - 1))

    def mean(self):
        """Weighted posterior means, ``{site: site_shape}``."""
        return {k: (self._weights(v) * v).sum(0) for k, v in self.draws.items()}

    def std(self):
        """Weighted posterior standard deviations, ``{site: site_shape}``."""
        means = self.mean()
        return {
            k: (self._weights(v) * (v - means[k]).pow(2)).sum(0).sqrt()
            for k, v in self.draws.items()
        }

    def resample(self, num_samples=None, generator=None):
        """Unweighted draws: ``num_samples`` (default ``S``) indices drawn with replacement
        in proportion to the smoothed weights (sampling importance resampling).

        :param torch.Generator generator: for reproducible resampling.
        :return: ``{site: (num_samples, *site_shape)}``.
        """
        num = self.num_draws if num_samples is None else int(num_samples)
        idx = torch.multinomial(self.log_weights.exp(), num, replacement=True, generator=generator)
        return {k: v[idx.to(v.device)] for k, v in self.draws.items()}


# ---------------------------------------------------------------------------------------
# log q of each kind of guide
# ---------------------------------------------------------------------------------------


def _semi_implicit_draws(guide, num_samples, num_mixing):
    """``(u, log q(u))`` with SIVI's upper-bound mixture estimate of the density."""
    u = guide.sample_unconstrained(num_samples)
    psi = guide.sample_mixing(num_mixing)
    log_q = guide.pairwise_conditional_log_prob(u, psi)
    return u, torch.logsumexp(log_q, -1) - math.log(num_mixing)


def _linearised_draws(guide, num_samples):
    """``(u, log q_lin(u))``: LIVI's Gaussian of the generator linearised at each draw's
    noise, by Woodbury and Sylvester at the noise size d."""
    ref = guide._noise_reference
    d, dim, var = guide.noise_dim, guide.latent_dim, guide.sigma**2
    pre = guide.preconditioner
    us, log_qs = [], []
    for start in range(0, num_samples, _JACOBIAN_BLOCK):
        num = min(_JACOBIAN_BLOCK, num_samples - start)
        z = torch.randn(num, d, dtype=ref.dtype, device=ref.device)
        xi = torch.randn(num, dim, dtype=ref.dtype, device=ref.device)
        white = guide.generator(z) + guide.sigma * xi
        jac = jacobian(guide.generator, z).to(torch.float64)  # (B, D, d)
        resid = (jac @ z.to(torch.float64).unsqueeze(-1)).squeeze(-1)
        resid = resid + guide.sigma * xi.to(torch.float64)  # w - (g(z) - J z)
        eye = torch.eye(d, dtype=torch.float64, device=ref.device)
        chol = torch.linalg.cholesky(jac.mT @ jac + var * eye)
        proj = torch.cholesky_solve((jac.mT @ resid.unsqueeze(-1)), chol).squeeze(-1)
        maha = (
            resid.pow(2).sum(-1) - (jac.mT @ resid.unsqueeze(-1)).squeeze(-1).mul(proj).sum(-1)
        ) / var
        log_det = 2 * chol.diagonal(dim1=-2, dim2=-1).log().sum(-1) + (dim - d) * math.log(var)
        log_q = -0.5 * (maha + log_det + dim * math.log(2 * math.pi))
        us.append(pre.unwhiten(white))
        log_qs.append(log_q.to(ref.dtype) - pre.log_abs_det())
    return torch.cat(us), torch.cat(log_qs)


def _no_density_error(guide):
    return TypeError(
        f"{type(guide).__name__} has no log-density, so PSIS cannot weight its draws: "
        "check it with pyro_implicit.diagnostics.stein_discrepancy(model, guide, *args), "
        "which needs only draws"
    )


def has_log_density(guide):
    """Whether :func:`importance_weights` can weight ``guide``: Pyro's guides (except point
    estimates), :class:`~pyro_implicit.guides.SemiImplicitGuide` and
    :class:`~pyro_implicit.guides.LinearizedGuide`."""
    if isinstance(guide, (SemiImplicitGuide, LinearizedGuide)):
        return True
    if isinstance(guide, (ImplicitAutoGuide, AutoDelta, AutoLaplaceApproximation)):
        return False  # no density, or a point estimate
    return isinstance(guide, AutoGuide)


def _point_estimate_error(guide):
    return TypeError(
        f"{type(guide).__name__} is a point estimate: importance weights of a point mass "
        "say nothing about the posterior's spread; check its draws (if any) with "
        "stein_discrepancy, or fit a guide with a spread"
    )


def _log_weights(model, guide, args, kwargs, num_samples, max_plate_nesting, num_mixing):
    """``(draws, raw log weights, density label)``."""
    if isinstance(guide, ImplicitAutoGuide):
        guide._check_ready()
        if isinstance(guide, SemiImplicitGuide):
            u, log_q = _semi_implicit_draws(guide, num_samples, num_mixing)
            label = f"mixture estimate (K={num_mixing})"
        elif isinstance(guide, LinearizedGuide):
            u, log_q = _linearised_draws(guide, num_samples)
            label = "linearised"
        else:
            raise _no_density_error(guide)
        space = guide.latent_space(*args, **kwargs)
    elif isinstance(guide, AutoDelta):
        raise _point_estimate_error(guide)
    elif isinstance(guide, AutoContinuous):
        if guide.prototype_trace is None:
            raise ValueError(f"{type(guide).__name__} is not set up: fit it (or call it) first")
        posterior = guide.get_posterior(*args, **kwargs)
        if isinstance(posterior, dist.Delta):
            raise _point_estimate_error(guide)
        u = posterior.sample((num_samples,))
        log_q = posterior.log_prob(u)
        space = LatentSpace.from_guide(guide, args, kwargs, max_plate_nesting or 0)
        label = "exact"
    elif callable(guide):
        return _pyro_log_weights(model, guide, args, kwargs, num_samples, max_plate_nesting)
    else:
        raise _no_density_error(guide)
    log_p = space.log_density(u, args, kwargs)
    return space.site_values(u), log_p - log_q, label


def _pyro_log_weights(model, guide, args, kwargs, num_samples, max_plate_nesting):
    """Any other Pyro guide (e.g. ``AutoNormal``): Pyro's own vectorised weights."""
    # the model runs that inspect it leave the random streams as they were, so that the
    # weights are those of pyro.infer.importance.psis_diagnostic under the same seed
    rng = pyro.util.get_rng_state()
    try:
        if max_plate_nesting is None:
            max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    finally:
        pyro.util.set_rng_state(rng)
    for site in trace.nodes.values():
        if site["type"] == "sample" and any(
            f.full_size is not None and f.size != f.full_size for f in site["cond_indep_stack"]
        ):
            raise ValueError(
                f"the model subsamples plate(s) at site '{site['name']}': importance weights "
                f"of {type(guide).__name__} would be minibatch estimates; use an "
                "AutoContinuous guide (e.g. AutoDiagonalNormal), whose weights are computed "
                "on the full data"
            )
    log_w, model_trace, _ = vectorized_importance_weights(
        model,
        guide,
        *args,
        num_samples=num_samples,
        max_plate_nesting=max_plate_nesting,
        normalized=False,
        **kwargs,
    )
    shapes = latent_shapes(model, *args, **kwargs)
    draws = {
        name: model_trace.nodes[name]["value"].reshape((num_samples,) + tuple(shape))
        for name, shape in shapes.items()
    }
    return draws, log_w, "exact"


@torch.no_grad()
def importance_weights(
    model, guide, *args, num_samples=1000, max_plate_nesting=None, num_mixing=1000, **kwargs
):
    """Draws of ``guide`` with their Pareto-smoothed importance weights and k-hat.

    :param callable model: the Pyro model.
    :param guide: a fitted guide with a log-density (module docstring).
    :param args: the model's positional arguments (keyword arguments go in ``kwargs``; the
        names below are reserved).
    :param int num_samples: draws ``S`` (at least 100: the tail fit needs 10 or more).
    :param int max_plate_nesting: the model's plate nesting (read from the model if
        ``None``).
    :param int num_mixing: mixing draws for a ``SemiImplicitGuide``'s density estimate.
    :rtype: ImportanceResult
    :raises TypeError: for a guide without a log-density (naming ``stein_discrepancy``).
    """
    if num_samples < 100:
        raise ValueError(f"PSIS needs num_samples >= 100 for its tail fit, got {num_samples}")
    draws, raw, label = _log_weights(
        model, guide, args, kwargs, num_samples, max_plate_nesting, num_mixing
    )
    raw = raw.detach()
    smoothed, k_hat = pareto_smooth(raw)
    ess = float(1.0 / smoothed.exp().pow(2).sum())
    draws = {k: v.detach() for k, v in draws.items()}
    return ImportanceResult(draws, smoothed.to(raw.dtype), raw, k_hat, ess, label)


def psis_diagnostic(model, guide, *args, **kwargs):
    """Pareto :math:`\\hat k` of ``guide``'s importance weights against ``model``, for every
    guide with a log-density (:func:`importance_weights`' arguments). Below 0.5: good;
    0.5-0.7: usable; above 0.7: do not trust the weights (and check the fit).

    On Pyro's guides this is ``pyro.infer.importance.psis_diagnostic`` (the same weights,
    tail and fit).

    :rtype: float
    """
    return importance_weights(model, guide, *args, **kwargs).k_hat


def importance_refine(model, guide, *args, max_k_hat=K_HAT_THRESHOLD, **kwargs):
    """Importance-refined posterior: the guide's draws with PSIS weights, whose
    :meth:`~ImportanceResult.mean`, :meth:`~ImportanceResult.std` and
    :meth:`~ImportanceResult.resample` correct the guide toward the posterior.

    :param float max_k_hat: refuse above this k-hat (default 0.7).
    :rtype: ImportanceResult
    :raises UnreliableWeightsError: when ``k_hat > max_k_hat``.
    """
    result = importance_weights(model, guide, *args, **kwargs)
    if not result.k_hat <= max_k_hat:
        raise UnreliableWeightsError(
            f"Pareto k-hat = {result.k_hat:.2f} > {max_k_hat}: the guide's tails are much "
            f"lighter than the posterior's (ESS {result.ess:.0f} of {result.num_draws}), so "
            "weighted estimates would be dominated by a few draws and their error cannot be "
            "estimated. Fit longer or with a richer guide, or pass max_k_hat=float('inf') "
            "to get the weights anyway (importance_weights gives them without the check)"
        )
    return result
