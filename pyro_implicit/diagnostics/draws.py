"""Posterior draws from anything a user fits, and the model facts they need.

:func:`posterior_draws` turns a fitted approximation (a Pyro guide, ours or Pyro's, a
particle set, or a dict of draws) into ``{site: (S, *site_shape)}`` draws of the model's
latent sites; :func:`latent_shapes` and :func:`guess_max_plate_nesting` read a model from
one prior run. Used by :func:`~pyro_implicit.diagnostics.compare.compare`, the ArviZ
export and the Stein discrepancy.
"""

import math
from collections.abc import Mapping

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVGD
from pyro.infer.autoguide import AutoGuide
from pyro.poutine.util import site_is_subsample

from ..guides import ImplicitAutoGuide
from ..latent import plate_nesting
from ..particles import ParticleInference

__all__ = [
    "guess_max_plate_nesting",
    "latent_shapes",
    "latent_shapes_of",
    "posterior_draws",
    "prior_trace",
    "source_kind",
]


def prior_trace(model, args=(), kwargs=None):
    """One plain (prior) run of the model, blocked from outer handlers, without gradients:
    what :func:`latent_shapes_of` and :func:`~pyro_implicit.latent.plate_nesting` read."""
    with torch.no_grad(), poutine.block():
        return poutine.trace(model).get_trace(*args, **(kwargs or {}))


def latent_shapes_of(trace):
    """``{name: torch.Size}`` of the latent sample sites of ``trace``, in execution order."""
    return {
        name: site["value"].shape
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }


def latent_shapes(model, *args, **kwargs):
    """Shapes of the model's latent sample sites from one plain (prior) run.

    :return: ``{name: torch.Size}`` in execution order.
    :rtype: dict
    """
    return latent_shapes_of(prior_trace(model, args, kwargs))


def guess_max_plate_nesting(model, *args, **kwargs):
    """The model's plate nesting from one prior run: the deepest vectorised plate dim
    (:func:`~pyro_implicit.latent.plate_nesting`).

    :rtype: int
    """
    return plate_nesting(prior_trace(model, args, kwargs))


def _detached(draws, shapes):
    """``{site: (S,) + shape}`` detached copies, dropping plate padding such as the
    ``(N, 1, ...)`` of ``pyro.infer.SVGD.get_named_particles``."""
    out = {}
    for name, shape in shapes.items():
        value = torch.as_tensor(draws[name]).detach()
        num = value.shape[0]
        if value.numel() != num * math.prod(shape):
            raise ValueError(
                f"draws of site '{name}' have shape {tuple(value.shape)}, which is not "
                f"(num_draws, *{tuple(shape)})"
            )
        out[name] = value.reshape((num,) + tuple(shape)).clone()
    return out


def _guide_draws(guide, args, kwargs, num_samples, shapes, max_plate_nesting):
    """Draws of an ordinary Pyro guide, all at once under an outer plate.

    Pyro's ``Predictive(guide=...)`` is avoided: for a global site with event dims it hands
    the model ``(S, D)`` draws where ``(S, 1, D)`` is needed (pyro issue 2122).
    """
    plate = pyro.plate("_posterior_draws", num_samples, dim=-max_plate_nesting - 1)
    # mask(False) tells guides that no density is needed (Pyro's Predictive does the same).
    with torch.no_grad(), poutine.block(), plate, poutine.mask(mask=False):
        trace = poutine.trace(guide).get_trace(*args, **kwargs)
    try:
        return _detached({n: trace.nodes[n]["value"] for n in shapes}, shapes)
    except ValueError:
        pass
    # a guide that does not broadcast over outer plates: one draw at a time
    draws = {n: [] for n in shapes}
    with torch.no_grad(), poutine.block(), poutine.mask(mask=False):
        for _ in range(num_samples):
            trace = poutine.trace(guide).get_trace(*args, **kwargs)
            for n in shapes:
                draws[n].append(trace.nodes[n]["value"].reshape(shapes[n]))
    return {n: torch.stack(v) for n, v in draws.items()}


def source_kind(source):
    if isinstance(source, (SVGD, ParticleInference)):
        return "particles"
    if isinstance(source, Mapping):
        return "samples"
    if isinstance(source, AutoGuide) or hasattr(source, "sample_posterior") or callable(source):
        return "iid"
    raise TypeError(
        f"cannot draw from {type(source).__name__}: pass a method name, a Pyro guide, a "
        "pyro.infer.SVGD, a pyro_implicit ParticleInference or a dict of draws"
    )


def posterior_draws(
    source, model, args=(), kwargs=None, num_samples=1000, max_plate_nesting=None, shapes=None
):
    """Posterior draws of the model's latent sites from a fitted approximation.

    :param source: a Pyro guide (``ImplicitAutoGuide`` subclasses draw through
        ``sample_posterior``, other guides in one vectorised run), a ``pyro.infer.SVGD``
        or :class:`~pyro_implicit.particles.ParticleInference` (all particles), or a dict
        of draws (checked and returned).
    :param callable model: the Pyro model.
    :param tuple args: its positional arguments.
    :param dict kwargs: its keyword arguments.
    :param int num_samples: draws from a guide (particle sets have their own size).
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param dict shapes: :func:`latent_shapes` of the model, if already known.
    :return: ``(draws, kind)``: ``{site: (S,) + site shape}`` detached, and ``"iid"``,
        ``"particles"`` or ``"samples"``.
    :rtype: tuple
    """
    kwargs = kwargs or {}
    if shapes is None:
        shapes = latent_shapes(model, *args, **kwargs)
    kind = source_kind(source)
    if kind == "samples":
        missing = [n for n in shapes if n not in source]
        if missing:
            raise ValueError(f"the draws lack the latent sites {missing}")
        return _detached(source, shapes), kind
    if kind == "particles":
        return _detached(source.get_named_particles(), shapes), kind
    if isinstance(source, ImplicitAutoGuide) or hasattr(source, "sample_posterior"):
        return _detached(source.sample_posterior(num_samples), shapes), kind
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    return _guide_draws(source, args, kwargs, num_samples, shapes, max_plate_nesting), kind
