"""Reading particles off a vectorised trace: the helpers every loss (and the particle
methods) share to turn trace sites into ``(num_particles, ...)`` rows.

* :func:`particle_sum`: a site's log-density, one value per particle;
* :func:`unconstrained_particles`, :func:`packed_particles`: a latent site's value, or a
  packed guide site's, as rows;
* :func:`implicit_guide_sites`, :func:`auxiliary_site_value`: the sites an implicit guide
  flags (:mod:`pyro_implicit.contract`) and the auxiliary values they name;
* :func:`prior_particles`: joint prior draws of named latents, from one vectorised run.
"""

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.util import site_is_subsample

from ..guides.base import implicit_site_info
from ..latent import support_transform

__all__ = [
    "auxiliary_site_value",
    "implicit_guide_sites",
    "packed_particles",
    "particle_sum",
    "prior_particles",
    "unconstrained_particles",
]


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
    transform = support_transform(site)
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
