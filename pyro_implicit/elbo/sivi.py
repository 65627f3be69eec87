r"""``SIVI_ELBO``: the semi-implicit surrogate bound of Yin & Zhou (2018).

For a semi-implicit guide :math:`h_\phi(u) = \mathbb E_{\psi \sim q_\phi} q_\xi(u \mid \psi)`
the ELBO needs :math:`\log h_\phi(u)`, which has no closed form. SIVI replaces it by a
mixture over the generating mixing draw and K fresh ones (eq. 9):

.. math::
    \underline{\mathcal L}_K = \mathbb E_{\psi \sim q_\phi}\,
        \mathbb E_{u \sim q(u \mid \psi)}\, \mathbb E_{\psi^{(1..K)} \sim q_\phi}
        \log \frac{p(x, u)}{\tfrac{1}{K+1}\big[q(u \mid \psi) +
        \sum_{k=1}^K q(u \mid \psi^{(k)})\big]},

a lower bound of the ELBO of :math:`h_\phi` for every K (proved later, e.g. Sobolev &
Vetrov 2019), non-decreasing in K and asymptotically exact (Prop. 2). Leaving the
generating component out gives the upper bound :math:`\overline{\mathcal L}_K` (eq. 10),
which decreases to the ELBO from above (Prop. 3), so for :math:`K \ge 1`

.. math::
    \underline{\mathcal L}_0 \le \underline{\mathcal L}_K \le
    \mathcal L = \log p(x) - \mathrm{KL}(h_\phi \,\|\, p(\cdot \mid x)) \le
    \overline{\mathcal L}_K \le \overline{\mathcal L}_1 = \overline{\mathcal L}.

(:math:`\overline{\mathcal L}_K` bounds the ELBO, not :math:`\log p(x)`: for large K it
falls below :math:`\log p(x)` whenever :math:`h_\phi` is not the exact posterior.)

:math:`K = 0` is :math:`\underline{\mathcal L}_0 = \mathbb E_\psi \mathrm{ELBO}(q(\cdot
\mid \psi))`, whose maximiser is a point-mass mixing distribution (Prop. 1): vanilla VI.
"""

import math
import numbers
import warnings

import torch
from pyro.distributions.util import scale_and_mask

from ..compiled import BACKENDS
from ..contract import CONDITIONAL_DENSITY
from ..errors import PairingError
from ..guides.base import implicit_site_info
from ..guides.linearized import LinearizedGuide
from ..guides.semi_implicit import SemiImplicitGuide
from .base import (
    ImplicitELBO,
    auxiliary_site_value,
    implicit_guide_sites,
    packed_particles,
)

__all__ = ["SIVI_ELBO", "linear_schedule"]


def linear_schedule(start, end, num_steps):
    """A non-decreasing K schedule for :class:`SIVI_ELBO`: K grows linearly from ``start``
    at step 0 to ``end`` at step ``num_steps`` and stays there.

    The paper only says that :math:`K_t` is non-decreasing and, for its VAE, "gradually
    increased from 1 to 100 during the first 1500 epochs" (Sec. 3.3, 5.5); the linear
    shape is our choice.

    :return: a callable ``step -> K``.
    """
    start, end, num_steps = int(start), int(end), int(num_steps)
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got start={start}, end={end}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be positive, got {num_steps}")

    def schedule(step):
        frac = min(max(step, 0), num_steps) / num_steps
        return start + int(math.floor(frac * (end - start)))

    return schedule


class SIVI_ELBO(ImplicitELBO):
    r"""The SIVI surrogate lower bound (Yin & Zhou 2018, eq. 9 and Algorithm 1) as a Pyro
    loss, for guides with a Gaussian conditional such as
    :class:`~pyro_implicit.guides.SemiImplicitGuide`.

    Per step, in one vectorised trace: J particles :math:`(\psi_j, u_j)`, with
    :math:`\psi_j = T_\phi(\epsilon_j)` and :math:`u_j = f(\eta_j, \xi, \psi_j)` (one u per
    :math:`\psi_j`), and K extra mixing draws :math:`\psi^{(1..K)}` **shared by the J
    particles** (Sec. 3.3 and the authors' code). Then

    .. math::
        \hat{\mathcal L}_K = \frac1J \sum_{j=1}^J \Big[\log p(x, z_j)
            - \log\big|\tfrac{\partial u}{\partial z}\big|_j
            - \log \tilde h_K(u_j)\Big],\quad
        \log \tilde h_K(u_j) = \operatorname{logsumexp}\big(\log q(u_j \mid \psi_j),
            \log q(u_j \mid \psi^{(1)}), \dots\big) - \log(K+1),

    where :math:`z_j` are the model's constrained site values, :math:`\log p(x, z_j)`
    sums every model site (latents' prior, observations, factors) with Pyro's plate and
    ``poutine.scale`` scaling, and the Jacobian term is the log-density of the guide's
    ``biject_to`` Deltas (plus any explicit guide sites, e.g. of an ``AutoGuideList``).
    :math:`\log \tilde h_K` is multiplied by the latent site's ``poutine.scale``.

    **What the returned loss is.** :math:`-\hat{\mathcal L}_K`, an unbiased Monte Carlo
    estimate of :math:`-\underline{\mathcal L}_{K_t}` (eq. 9) at the current
    :math:`K_t`: in expectation it is :math:`\ge -\mathcal L \ge -\log p(x)` (and it
    includes all normalising constants, so it is comparable with ``-log p(x)``). Its
    gradient is the exact gradient of the estimate with respect to every parameter,
    pathwise through :math:`u_j`, the generating :math:`\psi_j` **and** the extra
    :math:`\psi^{(k)}` (nothing is detached, as in the paper's reparameterised case and
    the authors' code), i.e. an unbiased estimate of :math:`\nabla \underline{\mathcal
    L}_{K_t}`. :attr:`diagnostics` holds the last evaluation's ``num_mixing`` and
    ``elbo``.

    **K schedule.** ``num_mixing`` fixes K; or pass ``schedule``, a callable
    ``step -> K`` that must be non-decreasing (:math:`K_{t+1} \ge K_t`, Sec. 3.3), e.g.
    :func:`linear_schedule`. The step counter :attr:`step` advances on every
    :meth:`loss_and_grads` and :meth:`differentiable_loss` call (training steps);
    :meth:`loss` evaluates at the current K without advancing it.

    **Bounds.** :meth:`lower_bound` and :meth:`upper_bound` estimate
    :math:`\underline{\mathcal L}_K` (eq. 9) and :math:`\overline{\mathcal L}_K`
    (eq. 10) with many particles, so the ELBO of the fitted guide can be seen
    sandwiched; :meth:`bound_terms` returns the per-particle terms for standard errors.

    **Guide protocol** (capability ``"conditional_density"``): the implicit latent site's
    ``infer["pyro_implicit"]`` record names its guide and, under ``"mixing_site"``, an
    auxiliary site holding the generating :math:`\psi` (shape ``(..., P)``); the guide
    provides ``conditional_log_prob(u, psi)`` (broadcasting), ``sample_mixing(K)``
    (``(K, P)``, with gradient) and optionally ``pairwise_conditional_log_prob(u, psi)``
    (``(N, M)``, used to avoid an ``(N, M, D)`` tensor).

    **Local latents** (capability ``"local"``, e.g.
    :class:`~pyro_implicit.guides.amortized.SemiImplicitEncoder`, the paper's SIVAE,
    eq. 12): the site lies inside the model's data plate and its record also holds the
    ``"context"`` (the subsample's data points); the guide provides
    ``conditional_log_prob(z, psi, context)`` and ``sample_mixing(K, context)``
    (``(K, *batch, D)``). The K extra draws are drawn per data point and shared by the J
    particles; :math:`\log \tilde h_K` is scaled by the plate's subsampling factor.

    A guide without an implicit site (e.g. ``AutoNormal``) has an exact density; then
    the loss is the ordinary vectorised ELBO. A guide that can only be sampled (e.g.
    ``ImplicitGuide``) is refused with a ``TypeError``: use ``KernelRatioELBO``.

    :param int num_particles: J, the number of :math:`(\psi_j, u_j)` pairs per step (at
        least 2; the paper's BLR uses 50, App. B.4).
    :param int num_mixing: K, extra mixing draws per step (the paper: 100 in App. B.4,
        1000 for the negative binomial, K = 20 "a nice compromise", Sec. 5.2). K = 0
        optimises :math:`\underline{\mathcal L}_0`, which collapses the mixing
        distribution (Prop. 1); a warning says so.
    :param callable schedule: ``step -> K``, non-decreasing; overrides ``num_mixing``.
    :param int max_plate_nesting: the model's plate nesting (guessed if omitted).
    :param bool check_vectorization: check once that the model is safe under the
        particle plate (see :func:`~pyro_implicit.elbo.base.check_vectorized_log_joint`).
    :param compile: ``"fx"`` (default): after the first step, which traces the model and the guide
        through Pyro and checks them, a whole :class:`~pyro_implicit.guides.SemiImplicitGuide` is
        drawn directly and its draws scored by a traced graph of the model's log-density
        (:meth:`~pyro_implicit.latent.LatentSpace.compile`), then its K extra mixing draws: the same
        loss, step for step, to float rounding; ``"inductor"`` also compiles that graph; ``False``
        traces every step. Guide lists, a latent site under ``poutine.scale`` and models with their
        own ``pyro.param`` keep Pyro's traces.

    References

    [1] `Semi-Implicit Variational Inference`, Mingzhang Yin, Mingyuan Zhou, ICML 2018
        (arXiv:1805.11183), eq. 9-10, Prop. 1-3, Algorithm 1.
    """

    required_capability = CONDITIONAL_DENSITY
    pairing_hint = (
        "SIVI_ELBO needs a Gaussian conditional q(u | psi), as in SemiImplicitGuide; "
        "for a guide that can only be sampled (e.g. ImplicitGuide) use KernelRatioELBO."
    )
    min_particles = 1  # the mixture density of each draw uses its own K extra draws

    def __init__(
        self,
        num_particles=50,
        num_mixing=100,
        schedule=None,
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
        compile="fx",
    ):
        super().__init__(num_particles, max_plate_nesting, check_vectorization, retain_graph)
        if compile not in (None, False) and compile not in BACKENDS:
            raise ValueError(f"compile must be False or one of {BACKENDS}, got {compile!r}")
        #: backend of the traced log-density of the steps after the first (``None``: every
        #: step traces the model and the guide through Pyro)
        self.compile = compile or None
        self._fast_spaces = {}  # (id(model), id(guide)) -> compiled LatentSpace, or None
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a callable step -> K, got {schedule!r}")
        if schedule is None:
            _check_num_mixing(num_mixing, "num_mixing")
            if num_mixing == 0:
                warnings.warn(
                    "SIVI_ELBO with num_mixing=0 optimises L_0, whose maximiser is a point-mass "
                    "mixing distribution (Yin & Zhou 2018, Prop. 1): the guide collapses to "
                    "vanilla Gaussian VI. Use num_mixing >= 20.",
                    UserWarning,
                    stacklevel=2,
                )
        self.num_mixing = None if schedule is not None else int(num_mixing)
        self.schedule = schedule
        self.step = 0
        self._last_scheduled = None  # (step, K) of the last schedule evaluation

    # ------------------------------------------------------------------ K schedule
    def current_num_mixing(self):
        """K at the current :attr:`step` (validated against the previous K)."""
        if self.schedule is None:
            return self.num_mixing
        k = self.schedule(self.step)
        _check_num_mixing(k, f"schedule({self.step})")
        k = int(k)
        last = self._last_scheduled
        if last is not None and self.step >= last[0] and k < last[1]:
            raise ValueError(
                f"the K schedule must be non-decreasing (Yin & Zhou 2018, Sec. 3.3), but "
                f"schedule({last[0]}) = {last[1]} and schedule({self.step}) = {k}"
            )
        self._last_scheduled = (self.step, k)
        return k

    #: smallest LinearizedGuide output noise (whitened units) the mixture estimate can use
    min_linearized_sigma = 0.1

    # the STL Gaussian fit: see ImplicitELBO.preconditioner_vi_estimator
    preconditioner_vi_estimator = "stl"

    def _check_guide(self, guide_trace):
        super()._check_guide(guide_trace)
        for site in implicit_guide_sites(guide_trace):
            guide = implicit_site_info(site)["guide"]
            sigma = getattr(guide, "sigma", None)
            if isinstance(guide, LinearizedGuide) and sigma < self.min_linearized_sigma:
                # measured: sd ratios 0.40-0.67 on a Dirichlet-Categorical posterior at
                # the default sigma = 1e-3 (tests/test_conformance.py)
                raise PairingError(
                    f"SIVI_ELBO cannot train a LinearizedGuide with sigma={sigma:g}: each "
                    "draw's own conditional N(g(z), sigma^2 I) dominates the mixture estimate, "
                    "which then cannot see the spread of g(z), and q collapses (too narrow). "
                    "Train it with LIVI_ELBO (or KernelRatioELBO), or give it "
                    f"sigma >= {self.min_linearized_sigma}."
                )

    # ------------------------------------------------------------------ estimator
    def _log_mixture_density(self, guide_trace, site, num_mixing, bound):
        r""":math:`\log \tilde h_K(u_j)` per particle: with the generating component
        (``bound="lower"``, eq. 9) or without it (``"upper"``, eq. 10)."""
        info = implicit_site_info(site)
        if "local" in info["capabilities"]:
            return self._local_log_mixture_density(guide_trace, site, num_mixing, bound)
        guide = info["guide"]
        n, mpn = self.num_particles, self.max_plate_nesting
        u = packed_particles(site["value"], n, mpn)
        psi_own = packed_particles(auxiliary_site_value(guide_trace, site, "mixing_site"), n, mpn)
        parts = []
        if bound == "lower":
            parts.append(guide.conditional_log_prob(u, psi_own).unsqueeze(-1))
        if num_mixing > 0:
            psi_extra = guide.sample_mixing(num_mixing)
            if hasattr(guide, "pairwise_conditional_log_prob"):
                parts.append(guide.pairwise_conditional_log_prob(u, psi_extra))
            else:
                parts.append(guide.conditional_log_prob(u.unsqueeze(-2), psi_extra))
        log_q = torch.cat(parts, dim=-1)
        return torch.logsumexp(log_q, dim=-1) - math.log(log_q.shape[-1])

    def _local_log_mixture_density(self, guide_trace, site, num_mixing, bound):
        r"""Amortised local latents (SIVAE, eq. 12): :math:`\log \tilde h_K(z_{ji} \mid
        x_i)` for every particle j and data point i of the subsample, with K extra draws
        per data point shared by the J particles, summed over the data points after the
        plate's subsampling scale; shape ``(J,)``."""
        info = implicit_site_info(site)
        guide, x = info["guide"], info["context"]
        n, mpn = self.num_particles, self.max_plate_nesting
        z = site["value"]
        psi_own = auxiliary_site_value(guide_trace, site, "mixing_site")
        axis = z.dim() - 1 - mpn  # the particle plate
        if axis < 0:
            raise ValueError(f"site '{site['name']}' lies outside the particle plate")
        z, psi_own = z.movedim(axis, 0), psi_own.movedim(axis, 0)
        parts = []
        if bound == "lower":
            parts.append(guide.conditional_log_prob(z, psi_own, x).unsqueeze(1))
        if num_mixing > 0:
            psi_extra = guide.sample_mixing(num_mixing, x)  # (K, *x_batch, D)
            # align x's batch with z's, which has a singleton for every particle-plate
            # dim left of the data plate: (K, 1, ..., 1, *x_batch, D)
            pad = (1,) * (z.dim() - psi_extra.dim())
            psi_extra = psi_extra.reshape(psi_extra.shape[:1] + pad + psi_extra.shape[1:])
            parts.append(guide.conditional_log_prob(z.unsqueeze(1), psi_extra, x))
        log_q = torch.cat([p.expand((z.shape[0], p.shape[1]) + p.shape[2:]) for p in parts], dim=1)
        log_h = torch.logsumexp(log_q, dim=1) - math.log(log_q.shape[1])  # (J, *batch)
        log_h = scale_and_mask(log_h.expand((n,) + log_h.shape[1:]), site["scale"], site["mask"])
        return log_h.reshape(n, -1).sum(-1)

    def _particle_terms(self, model, guide, args, kwargs, num_mixing, bound="lower"):
        """Per-particle :math:`\\log p(x, z_j) - \\log \\tilde q(z_j)`, shape ``(J,)``."""
        model_trace, guide_trace = self._traces(model, guide, args, kwargs)
        log_guide = self.explicit_guide_log_prob(guide_trace)
        for site in implicit_guide_sites(guide_trace):
            log_h = self._log_mixture_density(guide_trace, site, num_mixing, bound)
            if "local" not in implicit_site_info(site)["capabilities"]:
                # as Trace_ELBO treats a guide density (the local path does it per point)
                log_h = scale_and_mask(log_h, site["scale"], site["mask"])
            log_guide = log_guide + log_h
        return self.log_joint_particles(model_trace) - log_guide

    def _loss_and_surrogate(self, model, guide, args, kwargs):
        num_mixing = self.current_num_mixing()
        key = (id(model), id(guide))
        terms = None
        if self._fast_spaces.get(key) is not None:
            terms = self._fast_particle_terms(
                self._fast_spaces[key], guide, args, kwargs, num_mixing
            )
        if terms is None:
            terms = self._particle_terms(model, guide, args, kwargs, num_mixing)
            if self.compile and key not in self._fast_spaces:
                self._fast_spaces[key] = self._direct_space(
                    model, guide, SemiImplicitGuide, args, kwargs
                )
        elbo = terms.mean()
        self.diagnostics = {"num_mixing": num_mixing, "elbo": elbo.item()}
        # the estimate is differentiable as it stands: value and surrogate coincide
        return -elbo.detach(), -elbo

    def _fast_particle_terms(self, space, guide, args, kwargs, num_mixing):
        """:meth:`_particle_terms` without Pyro traces: the guide drawn directly (its noise,
        then the mixing layer and the conditional, as its trace would consume the random
        stream), the draws scored by the compiled graph, then the K extra mixing draws.
        ``None`` where the graph is unavailable or a draw is not finite (the traced step
        then runs and names the sites if the fit has diverged)."""
        if not space.compiled.active:
            return None
        with guide.drawing_directly():
            eps, eta = guide._split_noise(
                guide.standard_normal(self.num_particles, guide.noise_dim)
            )
            psi_own = guide.mixing(eps)
            u = guide.preconditioner.unwhiten(guide._conditional_sample(psi_own, eta))
        log_target = self._compiled_log_target(space, u, args, kwargs)
        if log_target is None:
            return None
        self._last_traces = None
        parts = [guide.conditional_log_prob(u, psi_own).unsqueeze(-1)]
        if num_mixing > 0:
            parts.append(guide.pairwise_conditional_log_prob(u, guide.sample_mixing(num_mixing)))
        log_q = torch.cat(parts, dim=-1)
        return log_target - (torch.logsumexp(log_q, dim=-1) - math.log(log_q.shape[-1]))

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """A tensor whose value is the loss (see the class docstring) and whose gradient
        is the estimator's; advances :attr:`step`."""
        result = super().differentiable_loss(model, guide, *args, **kwargs)
        self.step += 1
        return result

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Back-propagate the surrogate, advance :attr:`step`, return the loss."""
        result = super().loss_and_grads(model, guide, *args, **kwargs)
        self.step += 1
        return result

    # ------------------------------------------------------------------ bounds
    def _evaluator(self, num_particles, num_mixing):
        nesting = self.max_plate_nesting
        if nesting != float("inf"):
            nesting -= 1  # ELBO.__init__ adds the particle plate again
        evaluator = SIVI_ELBO(
            num_particles=num_particles,
            num_mixing=max(num_mixing, 1),
            max_plate_nesting=nesting,
            check_vectorization=False,
        )
        return evaluator

    def bound_terms(
        self,
        model,
        guide,
        *args,
        num_particles=1000,
        num_mixing=None,
        bound="lower",
        chunk_size=1000,
        **kwargs,
    ):
        r"""Per-particle terms of :math:`\underline{\mathcal L}_K` (``bound="lower"``,
        eq. 9) or :math:`\overline{\mathcal L}_K` (``"upper"``, eq. 10), without gradient.

        Particles are drawn in independent chunks of at most ``chunk_size``, each with its
        own K extra mixing draws (shared within the chunk), to bound memory at
        ``chunk_size * K``. The mean of the result estimates the bound; since particles of
        a chunk share the extra draws, take standard errors over chunk means or repeated
        calls rather than ``std / sqrt(J)`` when K is small.

        :param int num_particles: total J.
        :param int num_mixing: K (default: the current training K; at least 1 for the
            upper bound).
        :return: ``(num_particles,)`` tensor.
        """
        if bound not in ("lower", "upper"):
            raise ValueError(f"bound must be 'lower' or 'upper', got {bound!r}")
        k = self.current_num_mixing() if num_mixing is None else num_mixing
        _check_num_mixing(k, "num_mixing")
        if bound == "upper" and k < 1:
            raise ValueError("the upper bound (eq. 10) needs num_mixing >= 1")
        if num_particles < 2 or chunk_size < 4:
            raise ValueError("num_particles must be at least 2 and chunk_size at least 4")
        if self.max_plate_nesting == float("inf"):
            self._guess_max_plate_nesting(model, guide, args, kwargs)
        sizes = [chunk_size] * (num_particles // chunk_size)
        rest = num_particles % chunk_size
        if rest:
            if rest < 2:  # ImplicitELBO needs two particles: borrow one
                sizes[-1] -= 1
                rest += 1
            sizes.append(rest)
        terms = []
        with torch.no_grad():
            for size in sizes:
                evaluator = self._evaluator(size, k)
                terms.append(evaluator._particle_terms(model, guide, args, kwargs, k, bound))
        return torch.cat(terms)

    def lower_bound(self, model, guide, *args, num_particles=1000, num_mixing=None, **kwargs):
        r"""Monte Carlo estimate of :math:`\underline{\mathcal L}_K` (eq. 9), a float."""
        terms = self.bound_terms(
            model, guide, *args, num_particles=num_particles, num_mixing=num_mixing, **kwargs
        )
        return terms.mean().item()

    def upper_bound(self, model, guide, *args, num_particles=1000, num_mixing=None, **kwargs):
        r"""Monte Carlo estimate of :math:`\overline{\mathcal L}_K` (eq. 10), a float.

        An upper bound of the guide's ELBO :math:`\mathcal L` for every :math:`K \ge 1`,
        decreasing to it as K grows (Prop. 3); with :meth:`lower_bound` at the same K it
        sandwiches :math:`\mathcal L`. It is *not* an upper bound of :math:`\log p(x)`.
        """
        terms = self.bound_terms(
            model,
            guide,
            *args,
            num_particles=num_particles,
            num_mixing=num_mixing,
            bound="upper",
            **kwargs,
        )
        return terms.mean().item()


def _check_num_mixing(k, what):
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise ValueError(f"{what} must be a non-negative integer (K), got {k!r}")
