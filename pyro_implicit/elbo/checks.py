"""Checks a loss (or particle method) runs before it fits: a model safe under the
vectorised particle plate (:func:`check_vectorized_log_joint`), finite data
(:func:`check_observed_finite`) and a guide that covers every latent site of the model
(:func:`check_guide_covers_model`). Each raises the library's exception of its kind
(:mod:`pyro_implicit.errors`) with a message that names the site and the fix.
"""

import math

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.util import site_is_subsample

from ..errors import DataError, ModelError, VectorizationError
from ..random_streams import random_streams_kept
from .traces import _is_latent, particle_sum

__all__ = [
    "check_guide_covers_model",
    "check_observed_finite",
    "check_space_vectorized",
    "check_vectorized_log_joint",
]


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
                    "NaN for every latent value. Remove them, or let the model sample them as "
                    "missing values: replace them by any finite value and pass "
                    "obs_mask=torch.isfinite(y) to pyro.sample (a poutine.mask alone "
                    "still meets the NaN)."
                )


def check_vectorized_log_joint(
    model,
    guide,
    args,
    kwargs,
    max_plate_nesting,
    num_draws=3,
    rtol=1e-4,
    values=None,
    compare_values=True,
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
    :param bool compare_values: also compare each draw's log-densities alone and together
        (``False``: only that the model runs on the draws together and puts them along the
        particle dim, for a model that may draw sites of its own, e.g. one part of a guide
        list's model under ``poutine.block``, whose fresh draws differ alone and together).
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
            if "collide at dim" in str(e):
                raise  # a max_plate_nesting too small: the loss names the setting
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
        if not compare_values:
            return
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


def check_space_vectorized(space, args, kwargs, init_loc, num_draws=3, compare_values=True):
    """:func:`check_vectorized_log_joint` of the model ``space`` scores, at ``num_draws``
    packed draws around ``init_loc`` (unconstrained noise of sd 0.1), with the random
    streams left as they were: the check for code that scores batches of packed latents
    without a guide (particle methods, a guide's preconditioner search), run before it
    scores any.

    :param LatentSpace space: the packed space (:class:`~pyro_implicit.latent.LatentSpace`).
    :param torch.Tensor init_loc: ``(D,)`` the centre of the draws.
    :param bool compare_values: see :func:`check_vectorized_log_joint`.
    """
    with random_streams_kept():
        with torch.no_grad():
            noise = torch.randn(
                num_draws, init_loc.shape[-1], dtype=init_loc.dtype, device=init_loc.device
            )
            values = space.unpack(init_loc + 0.1 * noise)
        check_vectorized_log_joint(
            space.model,
            None,
            args,
            kwargs,
            space.max_plate_nesting + 1,
            num_draws=num_draws,
            values=values,
            compare_values=compare_values,
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


def check_guide_covers_model(model_trace, guide_trace, who="this loss"):
    """Refuse a guide whose sites are not the model's latent sites.

    * A guide that leaves a latent site of the model out: the model then draws that site
      from its prior on every step (Pyro only warns), and any loss fits the other sites
      against random values of it, a wrong posterior without an error. Typical cause: an
      ``AutoGuideList`` whose parts do not cover every site (e.g. after hiding a discrete
      site, as Pyro's advice on discrete latents suggests).
    * A guide that samples a site the model observes: it was built from a call of the
      model without those data (a prior-predictive look before the fit), so it holds them
      as latents, and the fit would be wrong (Pyro only warns).

    :raises ModelError: naming the sites and the fix.
    """
    observed = [
        name
        for name, site in guide_trace.nodes.items()
        if _is_latent(site) and model_trace.nodes.get(name, {}).get("is_observed", False)
    ]
    if observed:
        raise ModelError(
            f"{who}: the guide samples {observed}, which the model observes: the guide was "
            "built from a call of the model without these data (e.g. Predictive(model, "
            "guide=guide)() before the fit), so it holds them as latent sites. Build a new "
            "guide and make its first call with the data (a look at the prior predictive "
            "needs no guide: Predictive(model, num_samples=...)())."
        )
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
    raise ModelError(
        f"{who}: the guide does not cover the latent site(s) {missing} of the model, so the "
        "model would draw them from its prior on every step and the fit of the other sites "
        "would be wrong. Give every latent site a guide: build one guide over the whole "
        "model, or append a guide for them to the AutoGuideList (e.g. "
        f"AutoNormal(poutine.block(model, expose={missing})))." + hint
    )
