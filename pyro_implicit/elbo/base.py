"""Shared machinery of the losses that replace a guide's log-density with an estimate.

:class:`ImplicitELBO` subclasses Pyro's :class:`~pyro.infer.elbo.ELBO` and follows
``Trace_ELBO``'s contract: ``loss`` returns a float, ``differentiable_loss`` a tensor whose
value is the loss and whose gradient is the estimator's surrogate gradient,
``loss_and_grads`` back-propagates it. It differs in three places:

* all particles are drawn in one vectorised trace (estimators need them jointly);
* guide sites flagged implicit are never asked for a log-density;
* on the first call for a model/guide pair it checks that the model is safe under the
  vectorised particle plate (:func:`check_vectorized_log_joint`), the most common silent
  failure in Pyro.

Every loss also refuses a guide that leaves a latent site of the model out
(:func:`check_guide_covers_model`; Pyro only warns, and the site would be drawn from its
prior on every step), and stops with a :class:`DivergenceError` that names the sites and
what to try when the loss is not finite, a draw explodes (beyond
:attr:`ImplicitELBO.max_abs_draw`) or the guide or model fails on non-finite draws.

The helpers it shares with the other losses and the particle methods live beside it, one
job each, and are re-exported here: reading particles off a trace in
:mod:`pyro_implicit.elbo.traces`, the checks before a fit in
:mod:`pyro_implicit.elbo.checks`, what a diverged fit says in
:mod:`pyro_implicit.elbo.divergence`.
"""

import contextlib
import math
import numbers
import re
import warnings

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape

from ..contract import SAMPLE, check_guide_site
from ..errors import (
    DivergenceError,
    ModelError,
    PyroImplicitError,
    RunawayWarning,
    VectorizationError,
)
from ..guides.base import implicit_site_info, requested_by_loss
from ..latent import LatentSpace, completed_model
from ..random_streams import random_streams_kept

# the helpers live in modules of their own (one job each); their old home re-exports them
from .checks import (  # noqa: F401
    _VECTORIZATION_FIX,
    _batch_shape,
    _draw,
    _expected_batch_shape,
    _raise_if_fails_alone,
    _shape,
    _shapes_text,
    _short,
    check_guide_covers_model,
    check_observed_finite,
    check_vectorized_log_joint,
)
from .divergence import (  # noqa: F401
    DIVERGENCE_ADVICE,
    _draws_summary,
    _exploded_sites,
    _first_nonfinite_log_prob,
    _nonfinite_sites,
    _sampler_summary,
    _site_slices,
    built_implicit_guides,
)
from .traces import (  # noqa: F401
    _flatten_particles,
    _is_latent,
    _StopAfter,
    _StopAfterLatents,
    auxiliary_site_value,
    implicit_guide_sites,
    packed_particles,
    particle_sum,
    prior_particles,
    unconstrained_particles,
)

__all__ = [
    "DivergenceError",
    "ImplicitELBO",
    "VectorizationError",
    "auxiliary_site_value",
    "check_guide_covers_model",
    "check_observed_finite",
    "check_vectorized_log_joint",
    "implicit_guide_sites",
    "packed_particles",
]


#: how far (in the preconditioner's sds, largest over coordinates) the mean of q's whitened
#: draws may move from the preconditioner's mean before :class:`KernelRatioELBO
#: <pyro_implicit.elbo.KernelRatioELBO>` warns that its kernel ratio is running away. On
#: the eight stiff posteriors the fits of five other methods never went further than 9.5
#: (the centred eight schools, whose Gaussian fit is furthest from the posterior); of 24
#: kernel-ratio fits (the stiff posteriors at two seeds, a too-narrow start on an exact
#: posterior at eight) the 21 that passed 12 ended 0.68-79 000 sds off or diverged, but for
#: two that came back (0.19 and 0.27 sds off) (``benchmarks/results/kivi_drift.md``).
RUNAWAY_DRIFT = 12.0

#: the same bound for the other losses, which have no known runaway of their own: twice
#: :data:`RUNAWAY_DRIFT`, 2.5 times the furthest their fits went on the stiff posteriors
#: (9.5), so only a fit gone far off warns (``LIVI_ELBO`` at ``Adam(1.0)`` on a small BNN:
#: 179)
RUNAWAY_DRIFT_ANY = 2 * RUNAWAY_DRIFT

#: every how many steps the other losses check it, and on how many of the guide's draws
#: (fixed-seed ones: the mean's error is about 1/8 of a posterior sd, far below the bound)
RUNAWAY_CHECK_EVERY = 50
RUNAWAY_CHECK_DRAWS = 64


class ImplicitELBO(ELBO):
    """Base class of losses for guides without a tractable density.

    :param int num_particles: number of joint draws of the guide per step (all drawn in
        one vectorised trace; at least :attr:`min_particles`).
    :param int max_plate_nesting: the model's plate nesting (guessed on the first call if
        omitted, as in Pyro).
    :param bool check_vectorization: run :func:`check_vectorized_log_joint` on the first
        call for each model/guide pair.
    """

    #: the guide capability the loss needs (:mod:`pyro_implicit.contract`)
    required_capability = SAMPLE

    #: what to use instead when a guide lacks :attr:`required_capability` (the end of
    #: the error :func:`pyro_implicit.contract.check_guide_site` raises)
    pairing_hint = "KernelRatioELBO trains every guide that can be sampled."

    #: whether the loss checks its own draws' drift (``KernelRatioELBO``, every step, at
    #: :data:`RUNAWAY_DRIFT`); the others are checked every :data:`RUNAWAY_CHECK_EVERY`
    #: steps at :data:`RUNAWAY_DRIFT_ANY`
    checks_own_runaway = False

    #: fewest draws per step the estimator works with: 2 for estimators that use the draws
    #: jointly (kernels), 1 where each draw's entropy term stands alone
    min_particles = 2

    def __init__(
        self,
        num_particles=2,
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
    ):
        if isinstance(num_particles, bool) or not isinstance(num_particles, numbers.Integral):
            raise ValueError(f"num_particles must be an integer, got {num_particles!r}")
        if num_particles < self.min_particles:
            raise ValueError(
                f"{type(self).__name__} estimates the entropy from the particles jointly and "
                f"needs num_particles >= {self.min_particles}, got {num_particles}"
            )
        if max_plate_nesting is None:  # guessed, as the particle methods take None too
            max_plate_nesting = float("inf")
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            vectorize_particles=True,
            retain_graph=retain_graph,
        )
        if num_particles == 1 and self.max_plate_nesting != float("inf"):
            # Pyro's ELBO adds the particle plate's dim only for several particles, but
            # these losses always draw under it: without this it would collide with the
            # model's outermost plate
            self.max_plate_nesting += 1
        self.check_vectorization = check_vectorization
        self._checked = set()  # ids of (model, guide) pairs already checked
        self._num_evaluations = 0  # loss evaluations so far (for divergence messages)
        self._warned_drift = False  # the runaway warning is given once
        self.diagnostics = {}

    # ------------------------------------------------------------------ traces
    def _guess_max_plate_nesting(self, model, guide, args, kwargs):
        with poutine.block():
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
                *args, **kwargs
            )
        sites = [
            site
            for trace in (prune_subsample_sites(model_trace), prune_subsample_sites(guide_trace))
            for site in trace.nodes.values()
            if site["type"] == "sample"
        ]
        dims = [f.dim for site in sites for f in site["cond_indep_stack"] if f.vectorized]
        self.max_plate_nesting = (-min(dims) if dims else 0) + 1

    def _vectorized_num_particles(self, fn):
        # always the outer particle plate, for one particle too (Pyro's ELBO drops it
        # then), so that every estimator reads the particles off the same dim
        dim = -self.max_plate_nesting
        return pyro.plate("num_particles_vectorized", self.num_particles, dim=dim)(fn)

    def _get_trace(self, model, guide, args, kwargs):
        guide_trace = self._run_traced(guide, args, kwargs, "the guide")
        model_trace = self._run_traced(
            poutine.replay(model, trace=guide_trace), args, kwargs, "the model", guide_trace
        )
        # before Pyro's own check, which only warns: an uncovered site is a wrong answer
        check_guide_covers_model(model_trace, guide_trace, type(self).__name__)
        if is_validation_enabled():
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace = prune_subsample_sites(model_trace)
        check_if_enumerated(guide_trace)
        self._check_guide(guide_trace)
        with warnings.catch_warnings():
            # a NaN density stops the step with a DivergenceError naming the site
            warnings.filterwarnings("ignore", message="Encountered NaN", category=UserWarning)
            model_trace.compute_log_prob()
            guide_trace.compute_log_prob(
                site_filter=lambda name, site: implicit_site_info(site) is None
            )
        if is_validation_enabled():
            for site in model_trace.nodes.values():
                if site["type"] == "sample":
                    check_site_shape(site, self.max_plate_nesting)
        self._last_traces = (model_trace, guide_trace)
        return model_trace, guide_trace

    def _run_traced(self, fn, args, kwargs, what, guide_trace=None):
        """Trace ``fn``; a ``ValueError`` raised at non-finite draws (Pyro's validation of
        a Delta or a distribution parameter) or, after the first step, such an error or a
        failed factorisation (``torch.linalg.LinAlgError``) at draws the fit has moved to,
        becomes a :class:`DivergenceError` naming the sites."""
        tracer = poutine.trace(fn)
        try:
            return tracer.get_trace(*args, **kwargs)
        except (ValueError, torch.linalg.LinAlgError) as e:
            partial = tracer.msngr.trace
            draws = guide_trace if guide_trace is not None else partial
            bad = _nonfinite_sites(draws)
            # after the first step, a parameter out of its support or a factorisation
            # that fails (a covariance no longer positive definite) is a fit that moved
            # where the model breaks; on the first step it is the model's own error
            moved = self._num_evaluations > 0 and (
                isinstance(e, torch.linalg.LinAlgError) or "Expected parameter" in str(e)
            )
            if not bad and not moved:
                raise
            first_line = str(e).strip().splitlines()[0]
            reached = [
                n
                for n, site in partial.nodes.items()
                if site["type"] == "sample" and not site_is_subsample(site)
            ]
            where = f" after site '{reached[-1]}'" if reached else ""
            summary = _draws_summary(draws)
            if guide_trace is None:  # the guide itself failed: ask its samplers
                summary = _sampler_summary(fn) or summary
            raise DivergenceError(
                f"{type(self).__name__}: {what} failed{where} on step "
                f"{self._num_evaluations + 1} ({type(e).__name__}: {first_line}). "
                f"{summary} The fit has diverged. {DIVERGENCE_ADVICE}"
            ) from e

    def _check_guide(self, guide_trace):
        """Reject guides that are not reparameterised or lack the needed capability
        (:func:`pyro_implicit.contract.check_guide_site`)."""
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            check_guide_site(self, name, site)

    def _pairing_hint(self):
        return self.pairing_hint

    def _traces(self, model, guide, args, kwargs):
        if self.max_plate_nesting == float("inf"):
            self._guess_max_plate_nesting(model, guide, args, kwargs)
        key = (id(model), id(guide))
        if not self.check_vectorization or key in self._checked:
            return self._get_vectorized_trace(model, guide, args, kwargs)
        # the check comes after the step's own traces (which build a new guide's weights)
        # and leaves the random streams as they were: a fit draws the same with the check
        # as without it, and a guide wrapped anew each step (checked again under each new
        # id) the same whether an id is reused or not
        try:
            traces = self._get_vectorized_trace(model, guide, args, kwargs)
        except Exception as error:
            # a crash under the particle plate: where the model mixes particles, or its
            # data hold NaN, the check names the site and the fix; otherwise the crash is
            # the error
            try:
                self._check_vectorized(model, guide, args, kwargs)
            except PyroImplicitError as named:
                raise named from error
            except Exception:
                pass
            raise
        self._check_vectorized(model, guide, args, kwargs)
        self._checked.add(key)
        return traces

    def _check_vectorized(self, model, guide, args, kwargs):
        """:func:`check_vectorized_log_joint` of the pair, with the random streams put back
        as they were."""
        with random_streams_kept():
            check_vectorized_log_joint(model, guide, args, kwargs, self.max_plate_nesting)

    def latent_sites(self, model_trace):
        """The model's latent sample sites, in execution order."""
        return [site for site in model_trace.nodes.values() if _is_latent(site)]

    def log_joint_particles(self, model_trace):
        """Per-particle :math:`\\log p(x, z)`: every model sample site, with its plate
        scaling."""
        n, mpn = self.num_particles, self.max_plate_nesting
        return sum(
            particle_sum(site["log_prob"], n, mpn)
            for site in model_trace.nodes.values()
            if site["type"] == "sample"
        )

    def explicit_guide_log_prob(self, guide_trace):
        """Per-particle log-density of the guide's sites that have one: the ``biject_to``
        Jacobian Deltas of a packed guide (:math:`\\log|\\partial u / \\partial z|`) and
        explicit guides beside it. Implicit sites (:func:`implicit_guide_sites`) are left
        to the estimator."""
        n, mpn = self.num_particles, self.max_plate_nesting
        return sum(
            particle_sum(site["log_prob"], n, mpn)
            for site in guide_trace.nodes.values()
            if site["type"] == "sample" and implicit_site_info(site) is None
        )

    def log_likelihood_particles(self, model_trace):
        """Per-particle sum of the (scaled) log-densities of the model's observed sites and
        factors: the part of log p(x, z) that is not the latents' prior."""
        n, mpn = self.num_particles, self.max_plate_nesting
        terms = [
            particle_sum(site["log_prob"], n, mpn)
            for site in model_trace.nodes.values()
            if site["type"] == "sample" and site["is_observed"]
        ]
        if not terms:
            ref = next(s["log_prob"] for s in model_trace.nodes.values() if s["type"] == "sample")
            return ref.new_zeros(n)
        return sum(terms)

    # ------------------------------------------------------------------ ELBO API
    def _loss_and_surrogate(self, model, guide, args, kwargs):
        """Return ``(loss, surrogate_loss)`` tensors; subclasses implement."""
        raise NotImplementedError

    #: largest magnitude of an unconstrained draw before a fit counts as diverged (far
    #: beyond any posterior in sensible units; ``None`` disables the check)
    max_abs_draw = 1e12

    def _direct_space(self, model, guide, guide_type, args, kwargs):
        """After a traced step (:attr:`_last_traces`): the compiled log-density
        (:meth:`~pyro_implicit.latent.LatentSpace.compile` with backend :attr:`compile`)
        that may score the next steps' draws of ``guide`` drawn directly, or ``None`` where
        a step needs Pyro's traces: a guide other than one whole ``guide_type`` (an
        ``AutoGuideList``, a subclass with its own drawing), a latent site under
        ``poutine.scale``, or the model's own parameters."""
        model_trace, guide_trace = self._last_traces
        sites = implicit_guide_sites(guide_trace)
        if (
            type(guide) is not guide_type
            or len(sites) != 1
            or implicit_site_info(sites[0])["guide"] is not guide
            or float(sites[0]["scale"]) != 1.0
            or any(site["type"] == "param" for site in model_trace.nodes.values())
        ):
            return None
        space = LatentSpace.from_guide(guide, args, kwargs, self.max_plate_nesting - 1, model)
        return space.compile(self.compile)

    def _compiled_score(self, space, u, args, kwargs):
        r"""``(log_density, score)`` of the packed draws ``u`` ``(N, D)`` from the compiled
        graph of ``space`` (:meth:`~pyro_implicit.latent.LatentSpace.compile`; one
        minibatch where the model subsamples, as a model trace gives), both detached:
        :math:`\log \tilde p(u) = \log p(x, T(u)) + \log|\det \partial T / \partial u|`,
        the traced path's :meth:`log_joint_particles` minus the guide's ``biject_to``
        Deltas, and its gradient in ``u``. ``None`` where a draw or its log-density is not
        finite, a draw is beyond :attr:`max_abs_draw` or the model fails at the draws (the
        caller then traces, and names the sites if the fit has diverged)."""
        limit = self.max_abs_draw if self.max_abs_draw is not None else math.inf
        if not bool(torch.isfinite(u).all()) or u.detach().abs().max().item() > limit:
            return None
        try:
            out = space.score(u.detach(), args, kwargs, full_data=False)
        except (ValueError, torch.linalg.LinAlgError):
            return None
        if out is None or not bool(torch.isfinite(out[0]).all()):
            return None
        return out

    def _compiled_log_target(self, space, u, args, kwargs):
        r"""Per particle :math:`\log \tilde p(u)` (:meth:`_compiled_score`) with the
        gradient :math:`\nabla_u \log \tilde p \cdot \mathrm d u` through the draws ``u``
        (with graph); ``None`` where :meth:`_compiled_score` is."""
        out = self._compiled_score(space, u, args, kwargs)
        if out is None:
            return None
        log_density, score = out
        path = (score.detach() * u).sum(-1)
        return log_density.detach() + (path - path.detach())

    #: what a guide of this library built during this loss's step (its first call) is
    #: asked to use for ``parametrization="auto"`` (``None``: the guide's own default,
    #: standard layers); see :func:`~pyro_implicit.guides.base.requested_by_loss`
    guide_parametrization = None

    #: the gradient estimate of the Gaussian fit in the automatic preconditioner's
    #: search (:func:`~pyro_implicit.latent.find_preconditioner`'s ``vi_estimator``) of a
    #: guide with ``precondition=True`` built during this loss's step: ``"entropy"``
    #: here; ``"stl"`` for the losses whose fit goes on improving from the better
    #: Gaussian it finds (``KernelRatioELBO``, ``SIVI_ELBO``, ``LIVI_ELBO``, ``GPVI_ELBO``,
    #: ``AmortizedSVGD_ELBO``: nearer NUTS on stochastic volatility at the stiff
    #: benchmark's seeds 0-2 and again at the held-out seeds 3-4,
    #: ``benchmarks/results/stiff_loss_start.md``). Set it on a loss to choose.
    preconditioner_vi_estimator = "entropy"

    def _requests(self):
        """What this loss asks of a guide built during its step
        (:func:`~pyro_implicit.guides.base.requested_by_loss`)."""
        return requested_by_loss(self.guide_parametrization, self.preconditioner_vi_estimator)

    def _checked_loss_and_surrogate(self, model, guide, args, kwargs):
        """:meth:`_loss_and_surrogate`, stopped with a :class:`DivergenceError` when the
        loss is not finite or a draw has exploded (implemented once for every loss)."""
        model = self._completed(model)
        with self._requests(), self._plate_collisions_named():
            loss, surrogate = self._loss_and_surrogate(model, guide, args, kwargs)
        self._check_divergence(loss, guide)
        self._num_evaluations += 1
        if self._num_evaluations % RUNAWAY_CHECK_EVERY == 0:
            self._check_guide_drift(guide)
        return loss, surrogate

    def _check_guide_drift(self, guide):
        """Warn once (:class:`~pyro_implicit.RunawayWarning`) when the mean of an implicit
        guide's draws has moved :data:`RUNAWAY_DRIFT_ANY` of its preconditioner's sds from
        the preconditioner's mean: a fit gone far off with every number finite, which no
        divergence check sees (``LIVI_ELBO`` at ``Adam(1.0)`` on a small BNN: 179 sds,
        its loss from 157 to 2180). The draws are fixed-seed ones, as
        :meth:`~pyro_implicit.guides.base.ImplicitAutoGuide.median`'s, so the caller's
        random streams do not move."""
        if self.checks_own_runaway or self._warned_drift:
            return
        for module in built_implicit_guides(guide):
            if not module.whitened:
                continue
            z = module.preconditioner.whiten(module._fixed_seed_draws(RUNAWAY_CHECK_DRAWS))
            drift = z.mean(0).abs().max().item()
            if not drift > RUNAWAY_DRIFT_ANY:
                continue
            self._warned_drift = True
            warnings.warn(
                f"{type(self).__name__}: after {self._num_evaluations} steps the mean of "
                f"{type(module).__name__}'s draws has moved {drift:.1f} of the "
                "preconditioner's sds from the preconditioner's mean, where posteriors sit "
                f"within {RUNAWAY_DRIFT:.0f}: the fit is running away with every number "
                "finite. The usual cause is a learning rate too large for this loss: lower "
                "it (e.g. pyro.optim.Adam({'lr': 1e-3})) and check the fit before trusting "
                "it.",
                RunawayWarning,
                stacklevel=4,
            )
            return

    @contextlib.contextmanager
    def _plate_collisions_named(self):
        """Pyro's error when a model's plate meets the particle plate (a
        ``max_plate_nesting`` below the model's nesting) names an internal plate and says
        to move the model's: this one names the setting to change."""
        try:
            yield
        except ValueError as e:
            found = re.search(r"collide at dim=(-\d+)", str(e))
            if found is None:
                raise
            raise ModelError(
                f"{type(self).__name__}: a plate of the model uses dim {found.group(1)}, where "
                "this loss puts its particle plate: max_plate_nesting is smaller than the "
                f"model's plate nesting. Pass max_plate_nesting={-int(found.group(1))} (or "
                "more: the number of nested plates the model uses), or leave it out to have "
                "it guessed"
            ) from e

    def _completed(self, model):
        """:func:`~pyro_implicit.latent.completed_model` of ``model``, one wrapper per
        model, so that what is keyed on the model (the vectorisation check, the traced
        graphs) sees one object from step to step."""
        cached = getattr(self, "_completed_model", None)
        if cached is None or cached.model is not model:
            cached = self._completed_model = completed_model(model)
        return cached

    def _check_divergence(self, loss, guide=None):
        traces = getattr(self, "_last_traces", None)
        value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        if math.isfinite(value) and traces is None:
            return
        model_trace, guide_trace = traces if traces is not None else (None, None)
        big = _exploded_sites(guide_trace, self.max_abs_draw) if traces is not None else {}
        if math.isfinite(value) and not big:
            return
        what = (
            f"the loss is {value}"
            if not math.isfinite(value)
            else "the draws have exploded ("
            + ", ".join(f"'{n}' up to {m:.3g}" for n, m in big.items())
            + f" in unconstrained space, beyond max_abs_draw={self.max_abs_draw:g})"
        )
        if guide_trace is not None:
            detail = _draws_summary(guide_trace)
        else:  # a step on a traced graph, without Pyro's traces: a few fresh draws say
            detail = _sampler_summary(guide) if guide is not None else ""
        site = _first_nonfinite_log_prob(model_trace) if model_trace is not None else None
        if site is not None:
            detail = f"The log-density of site '{site}' is not finite. " + detail
        raise DivergenceError(
            " ".join(
                part
                for part in (
                    f"{type(self).__name__}: {what} on step {self._num_evaluations + 1}.",
                    detail,
                    f"The fit has diverged. {DIVERGENCE_ADVICE}",
                )
                if part
            )
        )

    def loss(self, model, guide, *args, **kwargs):
        """The loss value as a float (see the subclass for what it estimates)."""
        with torch.no_grad():
            loss, _ = self._checked_loss_and_surrogate(model, guide, args, kwargs)
        return loss.item()

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """A tensor whose value is :meth:`loss` and whose gradient is the estimator's."""
        loss, surrogate = self._checked_loss_and_surrogate(model, guide, args, kwargs)
        return loss.detach() + (surrogate - surrogate.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Back-propagate the surrogate and return the loss value as a float."""
        loss, surrogate = self._checked_loss_and_surrogate(model, guide, args, kwargs)
        if surrogate.requires_grad:
            surrogate.backward(retain_graph=self.retain_graph)
        return loss.item()
