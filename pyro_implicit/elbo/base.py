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
"""

import math

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled
from pyro.poutine.util import prune_subsample_sites, site_is_subsample
from pyro.util import check_if_enumerated, check_model_guide_match, check_site_shape
from torch.distributions import biject_to

from ..guides.base import implicit_site_info

__all__ = [
    "ImplicitELBO",
    "VectorizationError",
    "auxiliary_site_value",
    "check_vectorized_log_joint",
    "implicit_guide_sites",
    "packed_particles",
]


class VectorizationError(ValueError):
    """The model gives different log-densities under a vectorised particle plate than
    when each draw is evaluated on its own."""


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
        raise ValueError(
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


def check_vectorized_log_joint(
    model, guide, args, kwargs, max_plate_nesting, num_draws=3, rtol=1e-4
):
    """Compare the model's log-joint of a few guide draws evaluated under a vectorised
    particle plate with the same draws evaluated one at a time.

    A model that is not written for vectorised sampling (e.g. ``beta @ x.T`` with a
    ``to_event`` latent, ``torch.dot``, ``.sum()`` over all dims, ``squeeze()``) mixes
    particles silently and gives a wrong posterior with no error. This turns that into a
    :class:`VectorizationError` that names the fix.

    :param int max_plate_nesting: plate nesting *including* the particle plate.
    """
    with torch.no_grad(), poutine.block():
        plate = pyro.plate("_check_particles", num_draws, dim=-max_plate_nesting)
        guide_trace = poutine.trace(plate(guide)).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(plate(model), trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        model_trace.compute_log_prob()
        vectorized = sum(
            particle_sum(site["log_prob"], num_draws, max_plate_nesting)
            for site in model_trace.nodes.values()
            if site["type"] == "sample" and not site_is_subsample(site)
        )
        shapes = {
            name: site["value"].shape
            for name, site in poutine.trace(model).get_trace(*args, **kwargs).nodes.items()
            if site["type"] == "sample" and _is_latent(site)
        }
        subsamples = {
            name: site["value"]
            for name, site in model_trace.nodes.items()
            if site_is_subsample(site)
        }
        for i in range(num_draws):
            data = dict(subsamples)
            for name, shape in shapes.items():
                site = model_trace.nodes[name]
                value = site["value"]
                axis = value.dim() - site["fn"].event_dim - max_plate_nesting
                moved = value.movedim(max(axis, 0), 0)
                data[name] = moved[i if moved.shape[0] > 1 else 0].reshape(shape)
            single = poutine.trace(poutine.condition(model, data=data)).get_trace(*args, **kwargs)
            single.compute_log_prob()
            expected = sum(
                site["log_prob_sum"]
                for site in single.nodes.values()
                if site["type"] == "sample" and not site_is_subsample(site)
            )
            got = vectorized[i]
            if not math.isclose(
                got.item(), expected.item(), rel_tol=rtol, abs_tol=rtol * (1 + abs(expected.item()))
            ):
                raise VectorizationError(
                    "The model is not safe under a vectorised particle plate: for the same "
                    f"latent draw its log-joint is {expected.item():.6g} when evaluated alone "
                    f"but {got.item():.6g} when {num_draws} draws are evaluated together, so "
                    "particles are being mixed and the fitted posterior would be wrong. "
                    "Write the model so that latent values may carry extra leading batch "
                    "dims: e.g. `(x * beta).sum(-1)` instead of `beta @ x.T` or "
                    "`torch.dot`, `.sum(-1)` instead of `.sum()`, no `.squeeze()`; or build "
                    "BNNs with pyro_implicit.bnn. Pass check_vectorization=False to the "
                    "loss to skip this check."
                )


class ImplicitELBO(ELBO):
    """Base class of losses for guides without a tractable density.

    :param int num_particles: number of joint draws of the guide per step (all drawn in
        one vectorised trace; at least :attr:`min_particles`).
    :param int max_plate_nesting: the model's plate nesting (guessed on the first call if
        omitted, as in Pyro).
    :param bool check_vectorization: run :func:`check_vectorized_log_joint` on the first
        call for each model/guide pair.
    """

    #: the guide capability the loss needs (see ``ImplicitAutoGuide.capabilities``)
    required_capability = "sample"

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
        self.check_vectorization = check_vectorization
        self._checked = set()  # ids of (model, guide) pairs already checked
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
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(
            *args, **kwargs
        )
        if is_validation_enabled():
            check_model_guide_match(model_trace, guide_trace, self.max_plate_nesting)
        guide_trace = prune_subsample_sites(guide_trace)
        model_trace = prune_subsample_sites(model_trace)
        check_if_enumerated(guide_trace)
        self._check_guide(guide_trace)
        model_trace.compute_log_prob()
        guide_trace.compute_log_prob(
            site_filter=lambda name, site: implicit_site_info(site) is None
        )
        if is_validation_enabled():
            for site in model_trace.nodes.values():
                if site["type"] == "sample":
                    check_site_shape(site, self.max_plate_nesting)
        return model_trace, guide_trace

    def _check_guide(self, guide_trace):
        """Reject guides that are not reparameterised or lack the needed capability."""
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            info = implicit_site_info(site)
            if info is not None and self.required_capability not in info["capabilities"]:
                raise TypeError(
                    f"{type(self).__name__} needs a guide that provides "
                    f"'{self.required_capability}', but {type(info['guide']).__name__} only "
                    f"provides {sorted(info['capabilities'])}. {self._pairing_hint()}"
                )
            if not site["fn"].has_rsample:
                raise NotImplementedError(
                    f"Guide site '{name}' ({type(site['fn']).__name__}) is not "
                    f"reparameterisable; {type(self).__name__} needs reparameterised guides."
                )

    def _pairing_hint(self):
        return "KernelRatioELBO trains every guide that can be sampled."

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

    def loss(self, model, guide, *args, **kwargs):
        """The loss value as a float (see the subclass for what it estimates)."""
        with torch.no_grad():
            loss, _ = self._loss_and_surrogate(model, guide, args, kwargs)
        return loss.item()

    def differentiable_loss(self, model, guide, *args, **kwargs):
        """A tensor whose value is :meth:`loss` and whose gradient is the estimator's."""
        loss, surrogate = self._loss_and_surrogate(model, guide, args, kwargs)
        return loss.detach() + (surrogate - surrogate.detach())

    def loss_and_grads(self, model, guide, *args, **kwargs):
        """Back-propagate the surrogate and return the loss value as a float."""
        loss, surrogate = self._loss_and_surrogate(model, guide, args, kwargs)
        if surrogate.requires_grad:
            surrogate.backward(retain_graph=self.retain_graph)
        return loss.item()
