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
"""

import math
import warnings

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape
from torch.distributions import biject_to

from ..contract import SAMPLE, check_guide_site
from ..errors import DataError, DivergenceError, ModelError, VectorizationError
from ..guides.base import implicit_site_info

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


#: what to try when a fit diverges (shared by the losses and the particle methods)
DIVERGENCE_ADVICE = (
    "Try a lower learning rate (e.g. pyro.optim.Adam({'lr': 1e-3}), or ClippedAdam), the "
    "preconditioner (precondition=True, the default of this library's guides and of "
    "WeightSpaceSVGD), float64 (torch.set_default_dtype(torch.float64) before building "
    "the data and the guide) or more particles; check that the model's priors are proper "
    "and its data on a sensible scale."
)


def _is_latent(site):
    return (
        site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and not (site.get("infer") or {}).get("is_auxiliary", False)
    )


def particle_sum(log_prob, num_particles, max_plate_nesting):
    """Reduce a site's batch log-density to one value per particle.

    The particle plate is the leftmost batch dim (``dim = -max_plate_nesting``); a tensor
    with fewer dims (or size 1 there) is the same for every particle.
    """
    if not torch.is_tensor(log_prob) or log_prob.dim() < max_plate_nesting:
        total = log_prob.sum() if torch.is_tensor(log_prob) else torch.as_tensor(log_prob)
        return total.expand(num_particles)
    axis = log_prob.dim() - max_plate_nesting
    dims = [d for d in range(log_prob.dim()) if d != axis]
    reduced = log_prob.sum(dims) if dims else log_prob
    return reduced.expand(num_particles)


def unconstrained_particles(site, num_particles, max_plate_nesting, with_log_jacobian=False):
    """A latent site's value mapped to unconstrained space and flattened per particle.

    :return: ``(num_particles, numel per particle)`` tensor, keeping the autograd graph;
        with ``with_log_jacobian`` also the ``(num_particles,)`` log-Jacobian of the
        site's ``biject_to`` transform.
    """
    fn = site["fn"]
    try:
        transform = biject_to(fn.support)
    except NotImplementedError:
        raise ModelError(
            f"Latent site '{site['name']}' has support {fn.support}, which has no bijection "
            "to real space: pyro_implicit guides and losses need continuous latent sites "
            "(marginalise discrete ones out of the model)."
        ) from None
    value = site["value"]
    u = transform.inv(value)
    flat = _flatten_particles(
        u, fn.event_dim + u.dim() - value.dim(), num_particles, max_plate_nesting
    )
    if not with_log_jacobian:
        return flat
    # log |det dT/du| per particle, T = biject_to(support): the density of the site in
    # unconstrained space is p(T(u)) |det dT/du|.
    ladj = transform.log_abs_det_jacobian(u, value)
    axis = value.dim() - fn.event_dim - max_plate_nesting
    if axis < 0 or ladj.dim() <= axis:
        return flat, ladj.sum().expand(num_particles)
    dims = [d for d in range(ladj.dim()) if d != axis]
    return flat, (ladj.sum(dims) if dims else ladj).expand(num_particles)


def _flatten_particles(u, event_dim, num_particles, max_plate_nesting):
    axis = u.dim() - event_dim - max_plate_nesting
    if axis < 0:
        u = u.reshape((1,) * -axis + u.shape)
        axis = 0
    u = u.movedim(axis, 0)
    if u.shape[0] != num_particles:
        u = u.expand((num_particles,) + u.shape[1:])
    return u.reshape(num_particles, -1)


def packed_particles(value, num_particles, max_plate_nesting):
    """``(num_particles, P)`` rows of a packed guide site (the latent ``u`` or an auxiliary
    value such as a mixing draw) whose batch shape is ``(num_particles, 1, ..., 1)``.

    Packed sites sit outside every model plate; anything else is an error, not a reshape.
    """
    axis = value.dim() - 1 - max_plate_nesting
    batch = value.shape[:-1]
    if axis < 0 or any(size != 1 for i, size in enumerate(batch) if i != axis):
        raise ValueError(
            f"expected a packed guide site with batch shape (num_particles, 1, ..., 1), got "
            f"{tuple(batch)}; a packed latent must sit outside every model plate"
        )
    rows = value.movedim(axis, 0).reshape(value.shape[axis], value.shape[-1])
    return rows.expand(num_particles, -1)


def auxiliary_site_value(guide_trace, site, key):
    """The value of the auxiliary guide site that an implicit latent's
    ``infer["pyro_implicit"][key]`` names (e.g. the mixing draw behind each particle)."""
    info = implicit_site_info(site)
    name = info.get(key)
    if name is None or name not in guide_trace.nodes:
        raise ValueError(
            f"{type(info['guide']).__name__} advertises {sorted(info['capabilities'])} but "
            f"its trace has no '{key}': the latent site's infer['pyro_implicit']['{key}'] "
            "must name an auxiliary site holding the value behind each draw."
        )
    return guide_trace.nodes[name]["value"]


def implicit_guide_sites(guide_trace):
    """The sample sites of a guide trace drawn by an implicit guide (flagged through
    ``infer["pyro_implicit"]``), in execution order."""
    return [
        site
        for site in guide_trace.nodes.values()
        if site["type"] == "sample" and implicit_site_info(site) is not None
    ]


class _StopAfter(Exception):
    pass


class _StopAfterLatents(pyro.poutine.messenger.Messenger):
    """Stops a model run once all named latents are drawn, at the first observed site or
    right after the first minibatch (subsample) site: prior samples need no likelihood
    evaluation, and a minibatch model's forward pass (computed between its data plate and
    its observation) is skipped. The minibatch indices are still drawn, so a model whose
    latents all come before its data plate (``pyro_implicit.bnn``) consumes the random
    stream exactly as a run to the first observation would."""

    def __init__(self, names):
        super().__init__()
        self.names = set(names)
        self.seen = set()

    def _pyro_sample(self, msg):
        if msg["is_observed"] and self.seen >= self.names and not site_is_subsample(msg):
            raise _StopAfter()

    def _pyro_post_sample(self, msg):
        if msg["name"] in self.names:
            self.seen.add(msg["name"])
        elif site_is_subsample(msg) and self.seen >= self.names:
            raise _StopAfter()


def prior_particles(model, args, kwargs, names, num_samples, max_plate_nesting):
    """Draw ``num_samples`` joint prior samples of the named latent sites by running the
    model forward under a particle plate, mapped to unconstrained space (no gradient).

    :return: ``{name: (num_samples, numel)}``.
    """
    vectorized = pyro.plate("_prior_particles", num_samples, dim=-max_plate_nesting)(model)
    stopper = _StopAfterLatents(names)
    tracer = poutine.trace(stopper(vectorized))
    with torch.no_grad(), poutine.block():
        try:
            tracer(*args, **kwargs)
        except _StopAfter:
            pass
    trace = tracer.msngr.trace
    missing = [n for n in names if n not in trace.nodes]
    if missing:
        raise RuntimeError(f"latent sites {missing} were not drawn by the model's prior run")
    return {
        n: unconstrained_particles(trace.nodes[n], num_samples, max_plate_nesting).detach()
        for n in names
    }


_VECTORIZATION_FIX = (
    "Write the model so that latent values may carry extra leading batch dims: e.g. "
    "`(x * beta).sum(-1)` instead of `beta @ x.T` or `torch.dot`, `.sum(-1)` instead of "
    "`.sum()`, no `.squeeze()`; or build BNNs with pyro_implicit.bnn. Pass "
    "check_vectorization=False to the loss (or particle method) to skip this check."
)


def _shape(t):
    return tuple(t.shape) if torch.is_tensor(t) else ()


def _batch_shape(site):
    fn = site["fn"]
    return tuple(getattr(fn, "batch_shape", ()))


def _shapes_text(names, alone, together, num_draws, what="value"):
    """``'beta' value (3,) -> (3, 1, 3); ...`` for the named sites found in both traces."""
    parts = []
    for name in names:
        if name not in alone.nodes or name not in together.nodes:
            continue
        a, b = alone.nodes[name], together.nodes[name]
        if what == "value":
            parts.append(f"'{name}' value {_shape(a['value'])} -> {_shape(b['value'])}")
        else:
            parts.append(f"'{name}' batch shape {_batch_shape(a)} -> {_batch_shape(b)}")
    return (
        f"Shapes (one draw alone -> {num_draws} draws together): " + "; ".join(parts)
        if parts
        else ""
    )


def _expected_batch_shape(alone_shape, num_draws, max_plate_nesting):
    """The batch shape a site of batch shape ``alone_shape`` should have under a particle
    plate of ``num_draws`` at ``dim = -max_plate_nesting``, or ``None`` if it cannot."""
    rest = max_plate_nesting - 1 - len(alone_shape)
    if rest < 0:
        return None
    return (num_draws,) + (1,) * rest + tuple(alone_shape)


def check_observed_finite(trace):
    """Raise a :class:`~pyro_implicit.errors.DataError` (a ``ValueError``) naming the
    observed site whose data hold NaN or infinite values (a likelihood of NaN data is NaN
    for every latent value: no fit can mean anything, and the error would otherwise
    surface deep inside a loss)."""
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or not site["is_observed"] or site_is_subsample(site):
            continue
        if (site.get("infer") or {}).get("_deterministic", False):
            continue
        value = site["value"]
        if torch.is_tensor(value) and value.is_floating_point():
            bad = ~torch.isfinite(value)
            if bad.any():
                raise DataError(
                    f"the data of observed site '{name}' hold {int(bad.sum())} non-finite "
                    f"value(s) (NaN or inf) out of {value.numel()}: the log-density is then "
                    "NaN for every latent value. Remove or impute them (or mask them with "
                    "poutine.mask / obs_mask) before fitting."
                )


def check_vectorized_log_joint(
    model, guide, args, kwargs, max_plate_nesting, num_draws=3, rtol=1e-4, values=None
):
    """Compare the model's log-joint of a few draws evaluated under a vectorised particle
    plate with the same draws evaluated one at a time.

    A model that is not written for vectorised sampling (e.g. ``beta @ x.T`` with a
    ``to_event`` latent, ``torch.dot``, ``.sum()`` over all dims, ``squeeze()``) mixes
    particles silently and gives a wrong posterior with no error. This turns that into a
    :class:`VectorizationError` that names the first site whose log-density differs (or
    the last site reached, if the vectorised run crashes) and the shapes alone and
    together, with the fix. Data with NaN or infinite values get a
    :class:`~pyro_implicit.errors.DataError` naming the observed site instead (that is not
    a vectorisation problem), and a log-density that is NaN for a draw evaluated alone a
    :class:`~pyro_implicit.errors.ModelError` (both are ``ValueError``).

    :param guide: the guide whose draws are checked; ``None``: draws of the model's prior
        (for methods without a guide, e.g. NUTS or particle methods).
    :param int max_plate_nesting: plate nesting *including* the particle plate.
    :param dict values: instead of a guide, ``{site: value}`` of ``num_draws`` draws of
        every latent site, already shaped for the particle plate at ``dim =
        -max_plate_nesting`` (as :meth:`pyro_implicit.latent.LatentSpace.unpack` gives).
    """
    dim = -max_plate_nesting
    with torch.no_grad(), poutine.block():
        plate = pyro.plate("_check_particles", num_draws, dim=dim)
        if values is not None:
            vectorized_model = poutine.condition(plate(model), data=values)
        elif guide is not None:
            guide_trace = poutine.trace(plate(guide)).get_trace(*args, **kwargs)
            vectorized_model = poutine.replay(plate(model), trace=guide_trace)
        else:
            vectorized_model = plate(model)
        tracer = poutine.trace(vectorized_model)
        crash = None
        try:
            model_trace = tracer.get_trace(*args, **kwargs)
        except (RuntimeError, ValueError, IndexError) as e:
            crash = e
            model_trace = tracer.msngr.trace
        # one draw alone: an error here is the model's own, not one of vectorisation
        alone = poutine.trace(model).get_trace(*args, **kwargs)
        check_observed_finite(alone)
        names = [name for name, site in alone.nodes.items() if _is_latent(site)]
        shapes = {name: alone.nodes[name]["value"].shape for name in names}
        if crash is None:
            try:
                model_trace.compute_log_prob()
            except (RuntimeError, ValueError, IndexError) as e:
                crash = e
        if crash is not None:
            _raise_if_fails_alone(
                model, args, kwargs, model_trace, names, shapes, max_plate_nesting
            )
            reached = [
                name
                for name, site in model_trace.nodes.items()
                if site["type"] == "sample" and not site_is_subsample(site)
            ]
            last = f"The last site it reached is '{reached[-1]}'; " if reached else ""
            first_line = str(crash).strip().splitlines()[0] if str(crash).strip() else ""
            raise VectorizationError(
                f"The model runs on one draw alone but fails when {num_draws} draws are "
                f"evaluated together under a particle plate at dim {dim} "
                f"({type(crash).__name__}: {first_line}). {last}"
                f"{_shapes_text(names, alone, model_trace, num_draws)}. "
                f"{_VECTORIZATION_FIX}"
            ) from crash
        sites = [
            (name, site)
            for name, site in model_trace.nodes.items()
            if site["type"] == "sample" and not site_is_subsample(site)
        ]
        for name, site in sites:
            log_prob = site["log_prob"]
            size = log_prob.shape[0] if log_prob.dim() == max_plate_nesting else 1
            if log_prob.dim() > max_plate_nesting or size not in (1, num_draws):
                alone_shape = _batch_shape(alone.nodes[name]) if name in alone.nodes else None
                expected = (
                    None
                    if alone_shape is None
                    else _expected_batch_shape(alone_shape, num_draws, max_plate_nesting)
                )
                raise VectorizationError(
                    f"The model is not safe under a vectorised particle plate: with "
                    f"{num_draws} draws together (plate at dim {dim}) site '{name}' has "
                    f"batch shape {_batch_shape(site)}"
                    + (f" where {expected} was expected" if expected is not None else "")
                    + f" (alone: {alone_shape}), so the draws are not along dim {dim} and "
                    "particles are being mixed. "
                    f"{_shapes_text(names, alone, model_trace, num_draws)}. "
                    f"{_VECTORIZATION_FIX}"
                )
        vectorized = {
            name: particle_sum(site["log_prob"], num_draws, max_plate_nesting)
            for name, site in sites
        }
        subsamples = {
            name: site["value"]
            for name, site in model_trace.nodes.items()
            if site_is_subsample(site)
        }
        for i in range(num_draws):
            data = dict(subsamples)
            for name, shape in shapes.items():
                value = model_trace.nodes[name]["value"]
                try:
                    data[name] = _draw(model_trace.nodes[name], i, shape, max_plate_nesting)
                except RuntimeError as e:
                    raise VectorizationError(
                        f"The model is not safe under a vectorised particle plate: latent site "
                        f"'{name}' has value shape {_shape(value)} with {num_draws} draws "
                        f"together (plate at dim {dim}) but {tuple(shape)} alone, so one "
                        f"draw cannot be read off dim {dim}. {_VECTORIZATION_FIX}"
                    ) from e
            single = poutine.trace(poutine.condition(model, data=data)).get_trace(*args, **kwargs)
            single.compute_log_prob()
            for name, site in sites:
                if name not in single.nodes:
                    continue
                expected = single.nodes[name]["log_prob_sum"].item()
                got = vectorized[name][i].item()
                if math.isnan(expected):  # (-inf alone and together is a consistent answer)
                    raise ModelError(
                        f"the log-density of site '{name}' is NaN for a draw of the "
                        f"latents evaluated on its own (not a vectorisation problem): the "
                        "model's density is NaN at "
                        + ", ".join(f"'{n}' = {_short(data[n])}" for n in shapes if n in data)
                        + ". Check the data and the model's parameters (a scale of 0, a "
                        "log of a negative number, an exp that overflows)."
                    )
                tol = rtol * (1 + abs(expected))
                if not math.isclose(got, expected, rel_tol=rtol, abs_tol=tol):
                    alone_shape = _batch_shape(single.nodes[name])
                    expected_shape = _expected_batch_shape(
                        alone_shape, num_draws, max_plate_nesting
                    )
                    raise VectorizationError(
                        "The model is not safe under a vectorised particle plate: at site "
                        f"'{name}' the log-density of the same latent draw is "
                        f"{expected:.6g} when evaluated alone but {got:.6g} when "
                        f"{num_draws} draws are evaluated together (plate at dim {dim}), "
                        "so particles are being mixed and the fitted posterior would be "
                        f"wrong. Site '{name}' has batch shape {alone_shape} alone and "
                        f"{_batch_shape(site)} together"
                        + (
                            f" (expected {expected_shape}: the draws along dim {dim})"
                            if expected_shape is not None
                            else ""
                        )
                        + f"; {_shapes_text(names, single, model_trace, num_draws)}. "
                        f"{_VECTORIZATION_FIX}"
                    )


def _draw(site, index, shape, max_plate_nesting):
    """Draw ``index`` of a latent site's value under the particle plate, shaped ``shape``."""
    value = site["value"]
    axis = value.dim() - site["fn"].event_dim - max_plate_nesting
    moved = value.movedim(max(axis, 0), 0)
    return moved[index if moved.shape[0] > 1 else 0].reshape(shape)


def _raise_if_fails_alone(model, args, kwargs, together, names, shapes, max_plate_nesting):
    """After the vectorised run failed: run the first draw alone, and if the model fails
    there too, say so (the model's own problem at those values, not vectorisation)."""
    data = {}
    for name in names:
        if name not in together.nodes:
            continue
        try:
            data[name] = _draw(together.nodes[name], 0, shapes[name], max_plate_nesting)
        except RuntimeError:
            return  # the draws' own shapes are wrong: a vectorisation problem
    try:
        single = poutine.trace(poutine.condition(model, data=data)).get_trace(*args, **kwargs)
        single.compute_log_prob()
    except (RuntimeError, ValueError, IndexError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            "the model fails at a draw of its latents evaluated on its own (not a "
            f"vectorisation problem): {type(e).__name__}: {first_line}. The draw: "
            + ", ".join(f"'{n}' = {_short(v)}" for n, v in data.items())
            + ". Check the data and the model's parameters at such values."
        ) from e


def _short(t):
    """A tensor in a few characters, for error messages."""
    if not torch.is_tensor(t) or t.numel() == 1:
        return f"{float(t):.4g}"
    flat = t.reshape(-1)
    head = ", ".join(f"{v:.3g}" for v in flat[:3].tolist())
    return f"[{head}{', ...' if flat.numel() > 3 else ''}] (shape {tuple(t.shape)})"


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
        if num_particles < self.min_particles:
            raise ValueError(
                f"{type(self).__name__} estimates the entropy from the particles jointly and "
                f"needs num_particles >= {self.min_particles}, got {num_particles}"
            )
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
        a Delta or a distribution parameter) or, after the first step, at draws the fit
        has moved to, becomes a :class:`DivergenceError` naming the sites."""
        tracer = poutine.trace(fn)
        try:
            return tracer.get_trace(*args, **kwargs)
        except ValueError as e:
            partial = tracer.msngr.trace
            draws = guide_trace if guide_trace is not None else partial
            bad = _nonfinite_sites(draws)
            if not bad and not (self._num_evaluations > 0 and "Expected parameter" in str(e)):
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
        if self.check_vectorization and key not in self._checked:
            check_vectorized_log_joint(model, guide, args, kwargs, self.max_plate_nesting)
            self._checked.add(key)
        return self._get_vectorized_trace(model, guide, args, kwargs)

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

    def _checked_loss_and_surrogate(self, model, guide, args, kwargs):
        """:meth:`_loss_and_surrogate`, stopped with a :class:`DivergenceError` when the
        loss is not finite or a draw has exploded (implemented once for every loss)."""
        loss, surrogate = self._loss_and_surrogate(model, guide, args, kwargs)
        self._check_divergence(loss)
        self._num_evaluations += 1
        return loss, surrogate

    def _check_divergence(self, loss):
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
        detail = _draws_summary(guide_trace) if guide_trace is not None else ""
        site = _first_nonfinite_log_prob(model_trace) if model_trace is not None else None
        if site is not None:
            detail = f"The log-density of site '{site}' is not finite. " + detail
        raise DivergenceError(
            f"{type(self).__name__}: {what} on step {self._num_evaluations + 1}. {detail} "
            f"The fit has diverged. {DIVERGENCE_ADVICE}"
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


def check_guide_covers_model(model_trace, guide_trace, who="this loss"):
    """Refuse a guide that leaves a latent site of the model out.

    The model then draws that site from its prior on every step (Pyro only warns), and
    any loss fits the other sites against random values of it: a wrong posterior without
    an error. Typical cause: an ``AutoGuideList`` whose parts do not cover every site
    (e.g. after hiding a discrete site, as Pyro's advice on discrete latents suggests).

    :raises ValueError: naming the uncovered sites and the fix.
    """
    missing = [
        name
        for name, site in model_trace.nodes.items()
        if _is_latent(site) and name not in guide_trace.nodes
    ]
    if not missing:
        return
    discrete = [
        name
        for name in missing
        if getattr(model_trace.nodes[name]["fn"], "has_enumerate_support", False)
    ]
    hint = (
        f" {discrete} are discrete: marginalise them out of the model (pyro_implicit "
        "needs continuous latent sites)."
        if discrete
        else ""
    )
    raise ValueError(
        f"{who}: the guide does not cover the latent site(s) {missing} of the model, so the "
        "model would draw them from its prior on every step and the fit of the other sites "
        "would be wrong. Give every latent site a guide: build one guide over the whole "
        "model, or append a guide for them to the AutoGuideList (e.g. "
        f"AutoNormal(poutine.block(model, expose={missing})))." + hint
    )


def _site_slices(guide_trace):
    """``[(site name, slice of the packed latent, packed value)]`` of the implicit
    guides in a trace."""
    out = []
    for site in guide_trace.nodes.values():
        if site["type"] != "sample":
            continue
        info = implicit_site_info(site)
        if info is None:
            continue
        shapes = getattr(info["guide"], "_unconstrained_shapes", None) or {}
        start = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            out.append((name, slice(start, start + size), site["value"]))
            start += size
    return out


def _nonfinite_sites(trace):
    """Names of the sample sites of ``trace`` holding NaN or infinite values."""
    bad = []
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        value = site["value"]
        if torch.is_tensor(value) and value.is_floating_point():
            if not torch.isfinite(value).all():
                bad.append(name)
    return bad


def _exploded_sites(guide_trace, limit):
    """``{model site: largest |u|}`` of the implicit guides' draws beyond ``limit`` (or
    not finite)."""
    if limit is None or guide_trace is None:
        return {}
    found = {}
    for name, sl, value in _site_slices(guide_trace):
        part = value.detach()[..., sl]
        if part.numel() == 0:
            continue
        top = part.abs().max().item()
        if not top <= limit:
            found[name] = top
    return found


def _draws_summary(trace):
    """One sentence on the largest draws per site (unconstrained for implicit guides)."""
    if trace is None:
        return ""
    parts = []
    slices = _site_slices(trace)
    if slices:
        for name, sl, value in slices:
            part = value.detach()[..., sl]
            if part.numel():
                finite = bool(torch.isfinite(part).all())
                top = part.abs().max().item()
                parts.append(f"'{name}' {top:.3g}" + ("" if finite else " (not finite)"))
        label = "largest |draw| per site, unconstrained: "
    else:
        for name, site in trace.nodes.items():
            value = site.get("value")
            if site["type"] != "sample" or site["is_observed"] or not torch.is_tensor(value):
                continue
            if value.is_floating_point() and value.numel():
                finite = bool(torch.isfinite(value).all())
                parts.append(
                    f"'{name}' {value.detach().abs().max().item():.3g}"
                    + ("" if finite else " (not finite)")
                )
        label = "largest |draw| per site: "
    return ("The guide's " + label + ", ".join(parts) + ".") if parts else ""


def _sampler_summary(guide, num=8):
    """The largest |draw| per site of the implicit guides inside ``guide`` (itself or the
    parts of an ``AutoGuideList``), from a few fresh draws; "" if it has none."""
    from ..guides.base import ImplicitAutoGuide

    modules = guide.modules() if isinstance(guide, torch.nn.Module) else []
    parts = []
    for module in modules:
        if not isinstance(module, ImplicitAutoGuide) or module.prototype_trace is None:
            continue
        with torch.no_grad():
            u = module.sample_unconstrained(num)
        start = 0
        for name, shape in module._unconstrained_shapes.items():
            part = u[:, start : start + math.prod(shape)]
            start += math.prod(shape)
            finite = bool(torch.isfinite(part).all())
            top = part.abs().max().item() if finite else float("nan")
            parts.append(f"'{name}' {top:.3g}" + ("" if finite else " (not finite)"))
    if not parts:
        return ""
    return "The guide's largest |draw| per site, unconstrained: " + ", ".join(parts) + "."


def _first_nonfinite_log_prob(model_trace):
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or "log_prob" not in site:
            continue
        lp = site["log_prob"]
        if torch.is_tensor(lp) and not torch.isfinite(lp).all():
            return name
    return None
