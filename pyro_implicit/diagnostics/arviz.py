"""ArviZ export for NUTS and for every approximation :mod:`~pyro_implicit.diagnostics.compare`
knows: guides, particle sets and plain draws.

``az.from_pyro`` needs a ``pyro.infer.MCMC`` object, so guide draws cannot go through it;
:func:`to_inference_data` builds the groups itself from one vectorised model run::

    import arviz as az
    from pyro_implicit.diagnostics.arviz import to_inference_data

    idata_vi = to_inference_data(model, args, kwargs, guide, num_samples=2000)
    idata_mc = to_inference_data(model, args, kwargs, mcmc)   # or a NUTSResult
    az.compare({"nuts": idata_mc, "vi": idata_vi})

Groups:

* ``posterior``: latent sites (and ``pyro.deterministic`` sites) with dims ``(chain,
  draw, ...)``. MCMC keeps its chains. A guide's draws are independent and a particle
  set is one fixed set of points: both are exported as **one chain** (no fake chains
  that would make R-hat look meaningful); the group's ``attrs["draws"]`` says which.
  Use ``az.summary(idata, kind="stats")`` for them.
* ``log_likelihood``: the *unscaled* pointwise ``fn.log_prob`` of every observed site
  (as ``az.from_pyro``), so ``az.loo`` and ``az.compare`` can rank NUTS and variational
  fits on one table. LOO on variational draws treats q as if it were the posterior.
* ``posterior_predictive``: the observed sites re-drawn from the likelihood at every
  posterior draw (``poutine.uncondition``: the model needs no ``y=None`` switch).
* ``observed_data``: the observed values.
* ``sample_stats``: ``loss`` over the optimisation steps (dim ``loss_step``, not
  ``(chain, draw)``) when a loss trace is known; ``diverging`` ``(chain, draw)`` for a
  Pyro ``MCMC`` object or a :class:`~pyro_implicit.diagnostics.nuts.NUTSResult`.

Dim names: a batch dim of a site inside ``pyro.plate("schools", 8)`` is called
``"schools"``; other dims ``"<site>_dim_<i>"`` as ArviZ names them.

Versions: built on ArviZ 0.x (``az.InferenceData`` of ``xarray.Dataset`` groups, tested
with 0.23). On ArviZ 1.x (Python >= 3.12) the same groups are wrapped as an
``xarray.DataTree``, the 1.x container; that path is written but untested here.
"""

import datetime
import math
import warnings
from collections.abc import Mapping

import numpy as np
import pyro
import pyro.poutine as poutine
import pyro.util
import torch
from pyro.poutine.uncondition_messenger import UnconditionMessenger
from pyro.poutine.util import site_is_subsample

from .. import __version__
from ..errors import check_count
from ..latent import Preconditioner, completed_model
from .draws import guess_max_plate_nesting, latent_shapes, posterior_draws
from .importance import has_log_density, psis_diagnostic
from .nuts import NUTSResult
from .results import ComparisonResult, MethodResult
from .stein import stein_discrepancy

__all__ = [
    "arviz_major_version",
    "comparison_to_inference_data",
    "predictive_samples",
    "to_inference_data",
]

_DRAWS_NOTE = {
    "mcmc": "MCMC chains (NUTS): r_hat and ESS are convergence diagnostics",
    "iid": "independent draws from a variational approximation, exported as one chain: "
    "r_hat and ESS are not convergence diagnostics (use az.summary(kind='stats'))",
    "particles": "one fixed set of particles (not independent draws), exported as one "
    "chain: r_hat and ESS are not convergence diagnostics (use az.summary(kind='stats'))",
    "samples": "draws handed in as a dict, exported as one chain",
}


def _arviz():
    # ArviZ 0.23 warns once a day on import that 1.x is coming: not the user's concern here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        import arviz

    return arviz


def arviz_major_version():
    """Major version of the installed ArviZ (0 or 1).

    :rtype: int
    """
    return int(_arviz().__version__.split(".")[0])


# ---------------------------------------------------------------------------------------
# dims
# ---------------------------------------------------------------------------------------


def _dim_names(name, site_shape, batch_ndim, frames):
    """Names of a site's dims (after chain, draw): plate names for batch dims that a plate
    of that size sits on, ``<name>_dim_<i>`` otherwise."""
    by_dim = {f.dim: f for f in frames if f.vectorized}
    names = []
    for i, size in enumerate(site_shape):
        dim = i - batch_ndim  # negative for batch dims, counted from the right of the batch
        frame = by_dim.get(dim) if i < batch_ndim else None
        if frame is not None and frame.size == size:
            names.append(frame.name)
        else:
            names.append(f"{name}_dim_{i}")
    return names


def _dataset(arrays, dims, attrs, sample_dims=("chain", "draw")):
    import xarray as xr

    coords = {}
    variables = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        site_dims = list(sample_dims) + list(dims[name])
        for d, size in zip(site_dims, value.shape, strict=True):
            if d in coords and len(coords[d]) != size:
                raise ValueError(
                    f"dim '{d}' has size {len(coords[d])} in one variable and {size} in "
                    f"'{name}': rename one of the plates"
                )
            coords.setdefault(d, np.arange(size))
        variables[name] = (site_dims, value)
    return xr.Dataset(variables, coords=coords, attrs=attrs)


def _model_arguments(args, kwargs, who):
    """``(args, kwargs)`` checked: the model's positional arguments as a tuple and its
    keyword arguments as a dict (a guide or draws passed where they belong is named)."""
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(
            f"{who}(model, args, kwargs, source, ...): kwargs must be a dict of the model's "
            f"keyword arguments (or None), got {type(kwargs).__name__}; pass the fit as "
            "source=..."
        )
    if isinstance(args, (str, Mapping)) or not isinstance(args, (tuple, list)):
        raise TypeError(
            f"{who}: args must be a tuple of the model's positional arguments, got "
            f"{type(args).__name__} (a single argument x is passed as (x,))"
        )
    return tuple(args), dict(kwargs or {})


def _attrs(extra=None):
    attrs = {
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "inference_library": "pyro",
        "inference_library_version": pyro.__version__,
        "creation_library": "pyro_implicit",
        "creation_library_version": __version__,
        "arviz_version": _arviz().__version__,
    }
    attrs.update(extra or {})
    return attrs


# ---------------------------------------------------------------------------------------
# model runs at the draws
# ---------------------------------------------------------------------------------------


def _is_deterministic(site):
    return bool((site.get("infer") or {}).get("_deterministic", False))


def _observed_sites(trace):
    """The observed sites that hold data: not ``pyro.factor``'s (an auxiliary ``Unit``
    site with no data, whose term ArviZ would take for a second pointwise likelihood:
    ``az.loo`` then refuses the group), subsample or deterministic sites."""
    return {
        name: site
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and site["is_observed"]
        and not site["infer"].get("is_auxiliary", False)
        and not site_is_subsample(site)
        and not _is_deterministic(site)
    }


def _plate_aligned(draws, prototype, mpn):
    """``(S, ...)`` draws padded to ``(S, 1, ..., *site shape)`` so that the sample dim lies
    left of the model's plates, which is what a model run under an outer plate expects.
    (Pyro's ``Predictive`` pads event dims as if they were batch dims; issue 2122.)"""
    out = {}
    for name, value in draws.items():
        site = prototype.nodes[name]
        batch_ndim = site["value"].dim() - site["fn"].event_dim
        pad = (1,) * max(0, mpn - batch_ndim)
        out[name] = value.reshape((value.shape[0],) + pad + tuple(site["value"].shape))
    return out


class _UnconditionObserved(UnconditionMessenger):
    """``poutine.uncondition`` that leaves ``pyro.deterministic`` sites alone: re-drawing
    their ``Delta`` under an outer plate would broadcast the value against itself (a
    ``(S, n)`` value comes back ``(S, n, S, n)``), and the model then uses that value."""

    def _pyro_sample(self, msg):
        if _is_deterministic(msg):
            return
        super()._pyro_sample(msg)


def _vectorized_trace(model, args, kwargs, aligned, num, mpn, uncondition=False):
    fn = _UnconditionObserved()(model) if uncondition else model
    fn = poutine.condition(fn, data=aligned)
    plate = pyro.plate("_arviz_draws", num, dim=-mpn - 1)
    with torch.no_grad(), poutine.block(), plate:
        return poutine.trace(fn).get_trace(*args, **kwargs)


def _per_draw(value, num, shape, what):
    value = value.detach()
    if num != 1 and value.numel() == math.prod(shape):
        # does not depend on the draws (e.g. a constant deterministic site)
        value = value.reshape(shape).expand((num,) + tuple(shape))
    if value.numel() != num * math.prod(shape):
        raise ValueError(
            f"{what} has shape {tuple(value.shape)} in the vectorised run, which does not "
            f"give {num} draws of shape {tuple(shape)}: the model must broadcast over an "
            "outer plate (see the README on vectorisation)"
        )
    return value.reshape((num,) + tuple(shape))


def predictive_samples(
    model, args=(), kwargs=None, draws=None, sites=None, max_plate_nesting=None, seed=None
):
    """Sites of one vectorised model run at given posterior draws, observed sites re-drawn
    from the likelihood (``poutine.uncondition``): the posterior predictive at new inputs.

    Unlike ``Predictive(posterior_samples=...)`` this aligns every draw left of the
    model's plates whatever its event shape (Pyro issue 2122).

    :param callable model: a vectorisation-safe Pyro model.
    :param tuple args: its positional arguments (e.g. test inputs).
    :param dict kwargs: its keyword arguments.
    :param dict draws: ``{latent site: (S, *site_shape)}``; latent sites not given are
        drawn from the model (as in ``Predictive``), e.g. ``obs`` of a model called with
        ``y=None``.
    :param list sites: sites to return (default: every sample site not given in
        ``draws``, observed and deterministic ones included).
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param int seed: seed of the likelihood draws (``None``: the current RNG state).
    :return: ``{site: (S, *site_shape)}`` detached.
    :rtype: dict
    """
    args, kwargs = _model_arguments(args, kwargs, "predictive_samples")
    model = completed_model(model)  # flat priors drawable, as in the fits
    prototype = poutine.block(poutine.trace(model).get_trace)(*args, **kwargs)
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    shapes = {n: s for n, s in latent_shapes(model, *args, **kwargs).items() if n in draws}
    unknown = [n for n in draws if n not in shapes]
    if unknown or not shapes:
        raise ValueError(
            f"the model has no latent sites {unknown or list(draws)} at these arguments"
        )
    num = int(next(iter(draws.values())).shape[0])
    flat = {
        n: torch.as_tensor(draws[n]).detach().reshape((num,) + tuple(shapes[n])) for n in shapes
    }
    aligned = _plate_aligned(flat, prototype, max_plate_nesting)
    rng_state = pyro.util.get_rng_state()
    try:
        if seed is not None:
            pyro.set_rng_seed(seed)
        trace = _vectorized_trace(
            model, args, kwargs, aligned, num, max_plate_nesting, uncondition=True
        )
    finally:
        if seed is not None:
            pyro.util.set_rng_state(rng_state)
    if sites is None:
        # everything that was drawn here rather than given
        sites = [
            n
            for n, s in prototype.nodes.items()
            if s["type"] == "sample" and n not in shapes and not site_is_subsample(s)
        ]
    out = {}
    for name in sites:
        if name not in trace.nodes:
            raise ValueError(f"the model has no site {name!r}")
        shape = tuple(prototype.nodes[name]["value"].shape)
        out[name] = _per_draw(trace.nodes[name]["value"], num, shape, f"site '{name}'")
    return out


# ---------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------


def _diverging(by_chain, indices):
    """``(chains, draws)`` booleans from each chain's divergent draw indices."""
    chains, draws = next(iter(by_chain.values())).shape[:2]
    diverging = np.zeros((chains, draws), dtype=bool)
    for c, idx in enumerate(indices):
        diverging[c, list(idx)] = True
    return diverging


def _draws_of(source, model, args, kwargs, num_samples, mpn, shapes):
    """``(by_chain, kind, loss_trace, extra_attrs, sample_stats)``: draws ``(C, S, ...)``."""
    if isinstance(source, NUTSResult):
        attrs = {"num_divergences": int(source.num_divergences)}
        by_chain = dict(source.samples_by_chain)
        stats = {}
        if source.diverging_draws:
            stats["diverging"] = _diverging(by_chain, source.diverging_draws)
        return by_chain, "mcmc", None, attrs, stats
    if isinstance(source, pyro.infer.MCMC):
        by_chain = {k: v.detach() for k, v in source.get_samples(group_by_chain=True).items()}
        indices = source.diagnostics().get("divergences", {}).values()
        return by_chain, "mcmc", None, {}, {"diverging": _diverging(by_chain, indices)}
    if isinstance(source, MethodResult):
        attrs = {
            "method": source.name,
            "method_description": source.description,
            **_diagnostic_attrs(source.ksd, source.k_hat),
        }
        draws = {k: v for k, v in source.samples.items() if k in shapes}
        losses = source.losses or None
        if losses:
            attrs["loss_label"] = source.loss_label
        return {k: v.unsqueeze(0) for k, v in draws.items()}, source.kind, losses, attrs, {}
    draws, kind = posterior_draws(source, model, args, kwargs, num_samples, mpn, shapes)
    attrs = {"method_description": type(source).__name__}
    return {k: v.unsqueeze(0) for k, v in draws.items()}, kind, None, attrs, {}


def to_inference_data(
    model,
    args=(),
    kwargs=None,
    source=None,
    *,
    num_samples=1000,
    loss_trace=None,
    max_plate_nesting=None,
    log_likelihood=True,
    posterior_predictive=True,
    seed=None,
    method=None,
    attrs=None,
    diagnostics=False,
):
    """An ArviZ ``InferenceData`` (``xarray.DataTree`` on ArviZ 1.x) for one fitted method
    or NUTS run.

    :param callable model: the Pyro model (vectorisation-safe: the log-likelihood and the
        posterior predictive come from one model run under an outer plate of draws).
    :param tuple args: the model's positional arguments (the training data).
    :param dict kwargs: its keyword arguments.
    :param source: what to export: a Pyro ``MCMC`` after ``run``, a
        :class:`~pyro_implicit.diagnostics.nuts.NUTSResult`, a
        :class:`~pyro_implicit.diagnostics.compare.MethodResult`, a Pyro guide (ours
        included), a ``pyro.infer.SVGD``, a
        :class:`~pyro_implicit.particles.ParticleInference`, or a dict of draws
        ``{site: (S, *site_shape)}``.
    :param int num_samples: draws from a guide.
    :param loss_trace: the optimisation trace (``sample_stats.loss``); a ``MethodResult``
        brings its own.
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param bool log_likelihood: add the ``log_likelihood`` group.
    :param bool posterior_predictive: add the ``posterior_predictive`` group.
    :param int seed: seed of the guide draws and the predictive draws (``None``: the
        current RNG state, which is then advanced).
    :param str method: a label stored in the posterior's attrs.
    :param dict attrs: more attrs for the posterior group.
    :param bool diagnostics: add the posterior attrs ``ksd``, ``ksd_noise_level`` and
        ``ksd_squared_unbiased`` (:func:`~pyro_implicit.diagnostics.stein_discrepancy` of
        the exported draws, in the fit's own preconditioner coordinates) and, for a guide
        with a log-density, ``pareto_k`` (:func:`~pyro_implicit.diagnostics.psis_diagnostic`).
        A ``MethodResult`` of :func:`compare` carries them already.
    :return: ``arviz.InferenceData`` on ArviZ 0.x, ``xarray.DataTree`` on 1.x.
    :raises ValueError: if the model does not broadcast over the draw plate.
    """
    args, kwargs = _model_arguments(args, kwargs, "to_inference_data")
    if source is None:
        raise TypeError("to_inference_data needs a source: an MCMC, guide, particles or draws")
    check_count("num_samples", num_samples)
    model = completed_model(model)  # flat priors drawable, as in the fits
    prototype = poutine.block(poutine.trace(model).get_trace)(*args, **kwargs)
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    mpn = max_plate_nesting
    shapes = latent_shapes(model, *args, **kwargs)

    rng_state = pyro.util.get_rng_state()
    try:
        if seed is not None:
            pyro.set_rng_seed(seed)
        by_chain, kind, losses, extra, stats = _draws_of(
            source, model, args, kwargs, num_samples, mpn, shapes
        )
        chains, draws = next(iter(by_chain.values())).shape[:2]
        num = chains * draws
        flat = {
            k: v.reshape((num,) + tuple(shapes[k])).detach()
            for k, v in by_chain.items()
            if k in shapes
        }
        aligned = _plate_aligned(flat, prototype, mpn)

        trace = _vectorized_trace(model, args, kwargs, aligned, num, mpn)
        observed = _observed_sites(prototype)
        pp_trace = None
        if posterior_predictive and observed:
            pp_trace = _vectorized_trace(model, args, kwargs, aligned, num, mpn, uncondition=True)
    finally:
        if seed is not None:  # leave the caller's streams as they were
            pyro.util.set_rng_state(rng_state)

    def frames(name):
        return prototype.nodes[name]["cond_indep_stack"]

    def site_dims(name, shape, batch_ndim):
        return _dim_names(name, shape, batch_ndim, frames(name))

    def chained(value, shape):
        return value.reshape((chains, draws) + tuple(shape)).cpu().numpy()

    post, post_dims = {}, {}
    for name, shape in shapes.items():
        if name not in flat:
            continue
        site = prototype.nodes[name]
        post[name] = chained(flat[name], shape)
        post_dims[name] = site_dims(name, shape, site["value"].dim() - site["fn"].event_dim)
    for name, site in prototype.nodes.items():
        if site["type"] == "sample" and _is_deterministic(site):
            shape = tuple(site["value"].shape)
            value = _per_draw(trace.nodes[name]["value"], num, shape, f"deterministic '{name}'")
            post[name] = chained(value, shape)
            post_dims[name] = site_dims(name, shape, site["value"].dim() - site["fn"].event_dim)

    post_attrs = {
        "draws": _DRAWS_NOTE[kind],
        "draws_kind": kind,
        "num_chains": chains,
        "num_draws": draws,
    }
    if method is not None:
        post_attrs["method"] = method
    post_attrs.update(extra)
    if diagnostics and not isinstance(source, MethodResult):
        post_attrs.update(_diagnostics_of(source, model, args, kwargs, flat, mpn, seed))
    post_attrs.update(attrs or {})
    groups = {"posterior": _dataset(post, post_dims, _attrs(post_attrs))}

    if log_likelihood and observed:
        ll, ll_dims = {}, {}
        for name, site in observed.items():
            subsampled = [
                f.name
                for f in site["cond_indep_stack"]
                if f.full_size is not None and f.full_size != f.size
            ]
            if subsampled:
                warnings.warn(
                    f"observed site '{name}' lies in the subsampled plate(s) {subsampled}: "
                    "its log-likelihood would cover a minibatch only and is left out; run "
                    "the model on the full data (subsample_size=None) for LOO",
                    UserWarning,
                    stacklevel=2,
                )
                continue
            vsite = trace.nodes[name]
            batch_shape = tuple(site["fn"].batch_shape)
            value = _per_draw(
                vsite["fn"].log_prob(vsite["value"]),
                num,
                batch_shape,
                f"log-likelihood of '{name}'",
            )
            ll[name] = chained(value, batch_shape)
            ll_dims[name] = site_dims(name, batch_shape, len(batch_shape))
        if ll:
            groups["log_likelihood"] = _dataset(ll, ll_dims, _attrs())

    if pp_trace is not None:
        pp, pp_dims = {}, {}
        for name, site in observed.items():
            shape = tuple(site["value"].shape)
            value = _per_draw(
                pp_trace.nodes[name]["value"], num, shape, f"posterior predictive of '{name}'"
            )
            pp[name] = chained(value, shape)
            pp_dims[name] = site_dims(name, shape, len(shape) - site["fn"].event_dim)
        groups["posterior_predictive"] = _dataset(pp, pp_dims, _attrs())

    if observed:
        obs = {n: s["value"].detach().cpu().numpy() for n, s in observed.items()}
        obs_dims = {
            n: site_dims(n, tuple(s["value"].shape), s["value"].dim() - s["fn"].event_dim)
            for n, s in observed.items()
        }
        groups["observed_data"] = _dataset(obs, obs_dims, _attrs(), sample_dims=())

    loss_trace = losses if loss_trace is None else loss_trace
    if loss_trace is not None and len(loss_trace):
        stats["loss"] = np.asarray([float(x) for x in loss_trace])
    if stats:
        import xarray as xr

        variables = {}
        for k, v in stats.items():
            variables[k] = (["loss_step"], v) if k == "loss" else (["chain", "draw"], v)
        label = extra.get("loss_label") if "loss" in stats else None
        groups["sample_stats"] = xr.Dataset(
            variables, attrs=_attrs({"loss": label} if label else {})
        )
    return _wrap(groups)


def _wrap(groups):
    """The container of the installed ArviZ for ``{group: xarray.Dataset}``."""
    az = _arviz()
    if arviz_major_version() >= 1:  # pragma: no cover - ArviZ 1.x needs Python >= 3.12
        import xarray as xr

        return xr.DataTree.from_dict(groups)
    return az.InferenceData(**groups)


def comparison_to_inference_data(
    result, model, args=(), kwargs=None, max_plate_nesting=None, seed=0
):
    """One export per row of a :class:`~pyro_implicit.diagnostics.compare.ComparisonResult`,
    NUTS included: ready for ``az.compare``.

    :return: ``{"nuts": idata, method: idata, ...}``.
    :rtype: dict
    """
    if not isinstance(result, ComparisonResult):
        raise TypeError(f"expected a ComparisonResult, got {type(result).__name__}")
    if max_plate_nesting is None:
        max_plate_nesting = result.settings.get("max_plate_nesting")
    common = dict(max_plate_nesting=max_plate_nesting, seed=seed)
    out = {}
    if result.nuts is not None:
        attrs = {} if result.nuts_ksd is None else _diagnostic_attrs(result.nuts_ksd)
        out["nuts"] = to_inference_data(
            model, args, kwargs, result.nuts, method="nuts", attrs=attrs, **common
        )
    for name, r in result.methods.items():
        if r.failure is None:  # a fit that stopped has no draws to export
            out[name] = to_inference_data(model, args, kwargs, r, method=name, **common)
    return out


def _diagnostics_of(source, model, args, kwargs, draws, mpn, seed):
    """:func:`_diagnostic_attrs` computed for the exported ``draws`` of ``source``."""
    pre = getattr(source, "preconditioner", None)
    ksd = stein_discrepancy(
        model,
        draws,
        *args,
        max_plate_nesting=mpn,
        preconditioner=pre if isinstance(pre, Preconditioner) else None,
        **kwargs,
    )
    k_hat = math.nan
    if has_log_density(source):
        rng = pyro.util.get_rng_state()
        try:
            if seed is not None:
                pyro.set_rng_seed(seed)
            k_hat = psis_diagnostic(model, source, *args, max_plate_nesting=mpn, **kwargs)
        finally:
            pyro.util.set_rng_state(rng)
    return _diagnostic_attrs(ksd, k_hat)


def _diagnostic_attrs(ksd=None, k_hat=math.nan):
    """Posterior attrs of the checks that need no NUTS (absent ones left out)."""
    attrs = {}
    if ksd is not None:
        attrs.update(
            ksd=ksd.ksd,
            ksd_noise_level=ksd.noise_level,
            ksd_squared_unbiased=ksd.ksd_squared_unbiased,
        )
    if math.isfinite(k_hat):
        attrs["pareto_k"] = k_hat
    return attrs
