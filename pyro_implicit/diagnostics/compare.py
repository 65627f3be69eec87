"""One call that fits several posterior approximations to a Pyro model and scores each
against NUTS.

:func:`compare` fits every named method (or takes one already fitted), draws posterior
samples from it, runs NUTS (or reuses a run, or a Pyro ``MCMC`` object) and summarises
:func:`~pyro_implicit.diagnostics.metrics.compare_samples` per method in a
:class:`ComparisonResult`, whose :meth:`~ComparisonResult.table` is meant to be read by a
person::

    from pyro_implicit.diagnostics.compare import compare
    from pyro_implicit.models import load_model

    m = load_model("eight_schools")
    result = compare(m.model, *m.args, max_plate_nesting=m.max_plate_nesting)
    print(result.table())

Methods are named from the registry :data:`~pyro_implicit.diagnostics.methods.METHODS`
(:mod:`pyro_implicit.diagnostics.methods`); the result types are in
:mod:`pyro_implicit.diagnostics.results`.

SVI methods use ``ClippedAdam`` with their own initial learning rate, particle methods
Adam-style ``ClippedAdam`` too; every learning rate decays geometrically to a tenth of it
over the run so the final iterate is not dominated by gradient noise.

Already-fitted approximations can be passed instead of names, as ``methods={"label":
object}``: any Pyro ``AutoGuide`` (ours included), a ``pyro.infer.SVGD``, a
:class:`~pyro_implicit.particles.ParticleInference`, or a dict of posterior draws
``{site: (S, *site_shape)}``. Their row's time covers drawing only.
"""

import copy
import inspect
import math
import numbers
import sys
import time
import warnings
from collections.abc import Mapping

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.ops.stats import effective_sample_size, split_gelman_rubin
from pyro.poutine.messenger import Messenger

from ..elbo.base import DivergenceError, check_observed_finite, check_vectorized_log_joint
from ..latent import (
    LatentSpace,
    Preconditioner,
    PreconditionerWarning,
    check_precondition,
    completed_model,
    no_latent_sites_error,
    plate_nesting,
    significant_modes,
)
from .draws import (
    guess_max_plate_nesting,
    latent_shapes,
    latent_shapes_of,
    posterior_draws,
    prior_trace,
    source_kind,
)
from .importance import (
    K_HAT_THRESHOLD,
    UnreliableFitWarning,
    has_log_density,
    psis_diagnostic,
)
from .memory import PeakMemory
from .methods import DEFAULT_METHODS, METHODS, NUM_PARTICLES, resolve_name
from .metrics import compare_samples
from .nuts import NUTSResult, check_trace_continuous, run_nuts, weigh_by_modes
from .results import NUTS_ROW, ComparisonResult, MethodResult
from .stein import model_preconditioner, stein_discrepancy

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "NUM_PARTICLES",
    "NUTS_ROW",
    "ComparisonResult",
    "MethodResult",
    "compare",
    "guess_max_plate_nesting",
    "latent_shapes",
    "nuts_result_from_mcmc",
    "posterior_draws",
]


def nuts_result_from_mcmc(mcmc):
    """A :class:`~pyro_implicit.diagnostics.nuts.NUTSResult` from a finished Pyro ``MCMC``
    run (its wall time is unknown: ``nan``).

    :param pyro.infer.MCMC mcmc: after ``run``.
    :rtype: NUTSResult
    """
    by_chain = {k: v.detach() for k, v in mcmc.get_samples(group_by_chain=True).items()}
    diag = mcmc.diagnostics()
    div = diag.get("divergences", {})
    acc = diag.get("acceptance rate", {})
    chains = next(iter(by_chain.values())).shape[0]
    diverging = [list(div.get(f"chain {c}", [])) for c in range(chains)]
    divergences = [len(d) for d in diverging]
    return NUTSResult(
        samples={k: v.reshape((-1,) + v.shape[2:]) for k, v in by_chain.items()},
        samples_by_chain=by_chain,
        diagnostics={
            k: {
                "r_hat": split_gelman_rubin(v, chain_dim=0, sample_dim=1),
                "ess": effective_sample_size(v, chain_dim=0, sample_dim=1),
            }
            for k, v in by_chain.items()
        },
        num_divergences=sum(divergences),
        wall_time=math.nan,
        divergences_by_chain=divergences,
        acceptance_rate_by_chain=[float(acc.get(f"chain {c}", math.nan)) for c in range(chains)],
        diverging_draws=diverging,
    )


# ---------------------------------------------------------------------------------------
# fitting
# ---------------------------------------------------------------------------------------


def _say(progress, message):
    if progress:
        print(message, file=sys.stderr, flush=True)


def _steps(name, num_steps, progress):
    if not progress:
        return range(num_steps)
    from tqdm.auto import tqdm

    # disable=None: no bar where stderr is not a terminal (a log file gets the one-line
    # summaries, not thousands of carriage-return updates)
    return tqdm(
        range(num_steps),
        desc=f"  {name}",
        file=sys.stderr,
        leave=False,
        mininterval=0.5,
        dynamic_ncols=True,
        disable=None,
    )


def _fit(name, model, args, kwargs, num_steps, lr, mpn, progress, precondition=True, trace=None):
    """Fit method ``name``; returns ``(approximation, trace)`` (the per-step values are
    appended to ``trace`` as they come, so a fit that stops keeps them)."""
    method = METHODS[name]
    # Decay to lr / 10 over the run: large early steps, a quiet final iterate.
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1.0 / max(num_steps, 1))})
    if method.kind == "particles":
        fitted = method.build(model, mpn, optim, precondition=precondition)
        step = fitted.step
    else:
        fitted, loss = method.build(model, mpn, precondition=precondition)
        step = SVI(model, fitted, optim, loss).step
    trace = [] if trace is None else trace
    bar = _steps(name, num_steps, progress)
    for i in bar:
        out = step(*args, **kwargs)
        if isinstance(out, dict):
            # SVGD reports diagnostics, not a loss
            out = -out["log_joint"] if "log_joint" in out else sum(out.values())
        trace.append(float(out))
        if progress and (i % 25 == 0 or i == num_steps - 1):
            bar.set_postfix_str(f"{trace[-1]:.4g}", refresh=False)
    return fitted, trace


def _warm_up(model, args, kwargs, mpn):
    """One throw-away SVI step before anything is timed or measured: the first fit in a
    process otherwise carries torch's and Pyro's one-off costs (about 85 MB of memory on
    eight schools, whatever the method)."""
    pyro.clear_param_store()
    loss = Trace_ELBO(max_plate_nesting=mpn)
    with poutine.block():
        SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 1e-3}), loss).step(*args, **kwargs)
    pyro.clear_param_store()


def _resolve(methods):
    """``{label: spec}`` from a sequence of names or a mapping of labels to names/objects."""
    if isinstance(methods, str):
        methods = [methods]
    if isinstance(methods, Mapping):
        specs = dict(methods)
    else:
        methods = list(methods)
        if len(set(methods)) != len(methods):
            raise ValueError(f"methods must be distinct, got {methods}")
        specs = {m: m for m in methods}
    # an old name keeps its label (the caller's code reads its row by it) and fits the
    # method of its new name, with a FutureWarning at the caller's compare() line
    specs = {
        label: resolve_name(s, stacklevel=4) if isinstance(s, str) else s
        for label, s in specs.items()
    }
    names = [s for s in specs.values() if isinstance(s, str)]
    if not isinstance(methods, Mapping) and len(set(names)) != len(names):
        raise ValueError(
            f"methods must be distinct, got {methods} (old and new names of one method)"
        )
    if not specs:
        raise ValueError("no methods given")
    unknown = [s for s in specs.values() if isinstance(s, str) and s not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(METHODS)}"
        )
    for spec in specs.values():
        if not isinstance(spec, str):
            source_kind(spec)  # raises a TypeError naming what is accepted
    return specs


def _model_keywords(model, kwargs, model_kwargs, options):
    """The model's keyword arguments: ``kwargs`` and ``model_kwargs`` together. Without
    ``model_kwargs``, an option of :func:`compare` given a value, whose name the model
    also takes, is refused: it is read as compare's, and the model would silently run at
    its default. With ``model_kwargs`` (the command line always passes it) the caller
    has said which are the model's."""
    if model_kwargs is not None:
        if not isinstance(model_kwargs, dict):
            raise TypeError(f"model_kwargs must be a dict, got {type(model_kwargs).__name__}")
        both = sorted(set(model_kwargs) & set(kwargs))
        if both:
            raise ValueError(f"{both} given in model_kwargs and as keywords: give them once")
        return {**model_kwargs, **kwargs}
    try:
        takes = inspect.signature(model).parameters
    except (TypeError, ValueError):  # a callable without a signature: nothing to check
        takes = {}
    shared = [
        name for name, (value, default) in options.items() if name in takes and value is not default
    ]
    if shared:
        raise ValueError(
            f"the model takes {shared}, which are compare's own options too, and the "
            "values given are read as compare's: pass the model's keyword arguments as "
            f"model_kwargs={{{', '.join(repr(n) + ': ...' for n in shared)}}} (and "
            "compare's as before)"
        )
    return kwargs


def _learning_rates(lr, specs):
    """Each fitted row's learning rate: its method's default, or ``lr`` (a float for
    every row, or a dict whose keys are row labels or method names)."""
    lrs = {label: METHODS[s].lr for label, s in specs.items() if isinstance(s, str)}
    if isinstance(lr, dict):
        unknown = sorted(str(k) for k in lr if k not in lrs and k not in specs.values())
        if unknown:
            raise ValueError(
                f"lr names {unknown}, which no fitted row is: use row labels "
                f"{sorted(lrs)} or method names {sorted(set(specs[k] for k in lrs))}"
            )
        for key, value in lr.items():
            for label in lrs:
                if key == label or (key not in lrs and specs[label] == key):
                    lrs[label] = value
    elif lr is not None:
        lrs = dict.fromkeys(lrs, lr)
    for label, value in lrs.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"lr of {label!r} must be a positive number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"lr of {label!r} must be finite, got {value!r}")
    return {label: float(value) for label, value in lrs.items()}


def compare(
    model,
    *args,
    methods=DEFAULT_METHODS,
    num_steps=1000,
    num_samples=2000,
    nuts=None,
    nuts_kwargs=None,
    seed=0,
    max_plate_nesting=None,
    progress=True,
    lr=None,
    precondition=True,
    diagnostics=True,
    model_kwargs=None,
    **kwargs,
):
    """Fit each method to ``model`` (or take it fitted) and compare its posterior with NUTS.

    Every method is fitted from ``pyro.set_rng_seed(seed)`` on an empty parameter store,
    so its result does not depend on which other methods run. The model's preconditioner
    is searched once per Gaussian-fit estimator the methods ask for (their losses'
    :attr:`~pyro_implicit.elbo.base.ImplicitELBO.preconditioner_vi_estimator`; once in
    all where the Laplace passes its check and no fit runs) and given to every method of
    the library that asks for it (each would otherwise repeat the same search). Wall
    times include the posterior draws and, for the library's methods, their search's
    seconds, as a fit of the method alone would pay; their peak memory does not include
    the search's, which ``settings["preconditioner"]`` records (``{estimator: {source,
    kind, seconds, peak_mb}}``). Where the search found several modes, each holding at
    least :data:`~pyro_implicit.latent.MINOR_MODE_WEIGHT` of the mass, NUTS runs
    ``num_chains`` chains started in each, and its draws are resampled to the modes'
    weights (:func:`~pyro_implicit.diagnostics.nuts.weigh_by_modes`): chains that
    stay in their modes cannot weigh them. On a two-mode posterior (masses 0.78 / 0.22)
    that reference was 0.013 exact sds off, where two chains from NUTS's own start had
    sat one in each mode (R-hat 8.3).
    The model must be vectorisation-safe (all methods draw their particles under a
    plate) and have continuous latent sites only.

    :param callable model: a Pyro model.
    :param args: positional arguments of ``model``.
    :param methods: names from :data:`METHODS` (an old name, e.g. ``"implicit"`` for
        ``"kivi"``, fits its method and keeps its label, with a ``FutureWarning``), or a
        dict ``label -> name or fitted
        approximation`` (a Pyro guide, a ``pyro.infer.SVGD``, a
        :class:`~pyro_implicit.particles.ParticleInference`, or a dict of draws
        ``{site: (S, *shape)}``).
    :param int num_steps: optimisation steps per method.
    :param int num_samples: posterior draws per guide (particle methods give their
        particles).
    :param nuts: a reference to reuse: a :class:`~pyro_implicit.diagnostics.nuts.NUTSResult`
        or a finished ``pyro.infer.MCMC``; ``None`` runs
        :func:`~pyro_implicit.diagnostics.nuts.run_nuts`; ``False`` runs no NUTS (for
        models where it is too slow): the table then has the KSD and k-hat columns only.
    :param dict nuts_kwargs: keyword arguments of ``run_nuts`` (default
        ``num_samples=500, warmup_steps=300, num_chains=2``).
    :param int seed: seed of every fit and of NUTS.
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param bool progress: progress on stderr (tqdm bars, one line per finished method).
    :param lr: initial learning rate: a float for every method, a dict name -> float, or
        ``None`` for each method's default (:data:`METHODS`).
    :param precondition: ``True`` (default): fit the library's methods in the coordinates
        of the model's automatic preconditioner (:mod:`pyro_implicit.latent`), found once
        per estimator and shared; ``False``: in the raw unconstrained space, as the papers
        do; or a :class:`~pyro_implicit.latent.Preconditioner` of one's own, given to every
        method. Pyro's own guides and ``pyro.infer.SVGD`` are unaffected.
    :param bool diagnostics: add the checks that need no NUTS to every row: the kernel
        Stein discrepancy of its draws (:func:`~pyro_implicit.diagnostics.stein_discrepancy`,
        all rows in the coordinates of the model's automatic preconditioner, its Gaussian
        fit by the exact-entropy estimate whichever the methods ask for, so that a row's
        KSD does not depend on the other rows; or of the one given as ``precondition``;
        NUTS's row too) and, for guides with a
        log-density, PSIS k-hat (:func:`~pyro_implicit.diagnostics.psis_diagnostic`, 1000
        draws); one
        :class:`~pyro_implicit.diagnostics.importance.UnreliableFitWarning` names the
        guides whose k-hat exceeds 0.7.
    :param dict model_kwargs: keyword arguments of ``model``, for names that are also
        this function's (``lr``, ``seed``, ...): given as ``**kwargs`` they would be read
        as its own.
    :param kwargs: keyword arguments of ``model``.
    :rtype: ComparisonResult
    :raises ValueError: for an unknown method name, a bad count or learning rate, a
        keyword both the model and this function take (pass the model's as
        ``model_kwargs``), or a model with a discrete latent site (the message is
        NUTS's).
    """
    specs = _resolve(methods)
    options = {
        "methods": (methods, DEFAULT_METHODS),
        "num_steps": (num_steps, 1000),
        "num_samples": (num_samples, 2000),
        "nuts": (nuts, None),
        "nuts_kwargs": (nuts_kwargs, None),
        "seed": (seed, 0),
        "max_plate_nesting": (max_plate_nesting, None),
        "progress": (progress, True),
        "lr": (lr, None),
        "precondition": (precondition, True),
        "diagnostics": (diagnostics, True),
    }
    kwargs = _model_keywords(model, kwargs, model_kwargs, options)
    model = completed_model(model)  # every row, Pyro's and NUTS's too, sees one model
    for name, value, least in (("num_steps", num_steps, 1), ("num_samples", num_samples, 2)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
            raise ValueError(f"need an integer {name} >= {least}, got {value!r}")
    lrs = _learning_rates(lr, specs)
    run_kwargs = {"num_samples": 500, "warmup_steps": 300, "num_chains": 2}
    run_kwargs.update(nuts_kwargs or {})

    pyro.set_rng_seed(seed)
    # one prior run tells the latent shapes, the plate nesting and the model's parameters,
    # and refuses discrete latents and NaN data before anything runs (NUTS takes seconds to
    # minutes); a model that mixes particles under a plate is refused here too
    trace = prior_trace(model, args, kwargs)
    check_trace_continuous(trace)
    check_observed_finite(trace)
    shapes = latent_shapes_of(trace)
    if not shapes:
        raise no_latent_sites_error("compare")
    if max_plate_nesting is None:
        max_plate_nesting = plate_nesting(trace)
    mpn = max_plate_nesting
    check_vectorized_log_joint(model, None, args, kwargs, mpn + 1)
    model, held = _hold_model_parameters(model, trace)
    if held:
        _say(
            progress,
            "model parameters held at these values in every row (NUTS cannot "
            "learn them): " + ", ".join(f"{k} = {v}" for k, v in held.items()),
        )

    _warm_up(model, args, kwargs, mpn)
    shared, search = _shared_preconditioner(
        precondition, specs, model, args, kwargs, mpn, progress, seed
    )
    pyro.set_rng_seed(seed)

    # Draw from fitted objects first: clearing the param store for the fits below would
    # wipe pyro.infer.SVGD's global "svgd_particles".
    results = {}
    for label, spec in specs.items():
        if isinstance(spec, str):
            continue
        start = time.perf_counter()
        samples, kind = posterior_draws(spec, model, args, kwargs, num_samples, mpn, shapes)
        results[label] = MethodResult(
            label,
            samples,
            None,
            time.perf_counter() - start,
            [],
            math.nan,
            description=f"{type(spec).__name__} passed in fitted",
            kind=kind,
            loss_label="",
            fitted_here=False,
            approximation=None if kind == "samples" else spec,
        )

    if nuts is False:
        ran_nuts = False
        nuts_memory = PeakMemory()
        nuts = None
    elif nuts is None:
        ran_nuts = True
        modes, weights = _modes_of(shared, run_kwargs)
        per_mode = run_kwargs["num_chains"]
        starts = {}
        if modes:
            starts = {
                "num_chains": per_mode * len(modes),
                "initial_points": [mode.loc for mode in modes for _ in range(per_mode)],
            }
            if len(modes) == 1:
                _say(
                    progress,
                    "NUTS: the search found modes that are relabellings of one another "
                    "(label switching): its chains start in the labelling the methods fit",
                )
            else:
                _say(
                    progress,
                    f"NUTS: the search found {len(modes)} modes (weights "
                    + ", ".join(f"{w:.2f}" for w in weights)
                    + f"), which its chains do not cross: {per_mode} chain(s) start in each",
                )
        _say(
            progress,
            f"NUTS: {starts.get('num_chains', per_mode)} chain(s) x "
            f"{run_kwargs['num_samples']} draws, {run_kwargs['warmup_steps']} warmup",
        )
        with PeakMemory() as nuts_memory:
            nuts = run_nuts(
                model,
                *args,
                seed=seed,
                max_plate_nesting=mpn,
                progress_bar=progress,
                **{**run_kwargs, **starts},
                **kwargs,
            )
        if len(modes) > 1:
            space = LatentSpace.from_model(model, args, kwargs, mpn)
            try:
                nuts = weigh_by_modes(nuts, space, modes, weights, seed)
            except ValueError as e:
                # a mode's chains all left it: the valley is crossed, and the chains'
                # own mix stands
                _say(progress, f"  draws not weighted by the modes: {e}")
        _say(progress, f"  done in {nuts.wall_time:.1f} s")
        if nuts.weakness():
            _say(progress, f"  weak reference: {nuts.weakness()}")
    else:
        ran_nuts = False
        nuts_memory = PeakMemory()  # not measured: peak_mb stays nan
        if not isinstance(nuts, NUTSResult):
            nuts = nuts_result_from_mcmc(nuts)
    sites = [s for s in shapes if nuts is None or s in nuts.samples]

    for label, spec in specs.items():
        if not isinstance(spec, str):
            continue
        method = METHODS[spec]
        _say(progress, f"{label}: {num_steps} steps, lr {lrs[label]:g}")
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        trace = []
        with PeakMemory() as memory:
            start = time.perf_counter()
            try:
                fitted, trace = _fit(
                    spec,
                    model,
                    args,
                    kwargs,
                    num_steps,
                    lrs[label],
                    mpn,
                    progress,
                    precondition=_method_precondition(shared, method),
                    trace=trace,
                )
                samples, kind = posterior_draws(
                    fitted, model, args, kwargs, num_samples, mpn, shapes
                )
                failure = None
            except DivergenceError as e:
                # one diverged method is a result, not the end of the comparison
                fitted, samples, kind = None, {}, "failed"
                failure = f"diverged at step {len(trace) + 1}: {str(e).splitlines()[0]}"
            wall = time.perf_counter() - start
        if method.preconditioned and search is not None:
            wall += search[method.vi_estimator]["seconds"]
        results[label] = MethodResult(
            label,
            samples,
            None,
            wall,
            trace,
            lrs[label],
            description=method.description,
            kind=kind,
            loss_label=method.trace_label,
            approximation=fitted,
            peak_mb=memory.peak_mb,
            failure=failure,
        )
        if failure:
            _say(progress, f"  {failure}")
            continue
        window = trace[-max(1, num_steps // 10) :]
        _say(
            progress,
            f"  done in {wall:.1f} s; last {len(window)} steps' mean "
            f"{method.trace_label.split(' (')[0]}: {sum(window) / len(window):.4g}",
        )
    pyro.clear_param_store()

    ordered = {}
    for label in specs:
        r = results[label]
        if r.failure is None and nuts is not None:
            r.metrics = compare_samples(r.samples, nuts.samples, sites=sites)
        ordered[label] = r
    nuts_ksd = None
    if diagnostics:
        _say(
            progress,
            "diagnostics: kernel Stein discrepancy of every row, PSIS k-hat of "
            "guides with a log-density",
        )
        nuts_ksd = _add_diagnostics(model, args, kwargs, ordered, nuts, mpn, seed, shared)

    settings = {
        "methods": {
            label: s if isinstance(s, str) else type(s).__name__ for label, s in specs.items()
        },
        "num_steps": num_steps,
        "num_samples": num_samples,
        "nuts_kwargs": run_kwargs if ran_nuts else {},
        "seed": seed,
        "max_plate_nesting": mpn,
        "lr": lrs,
        "nuts": nuts is not None,
        "diagnostics": bool(diagnostics),
        "held_model_parameters": held,
        "preconditioner": search,
    }
    return ComparisonResult(
        ordered,
        nuts,
        None if nuts is None else _split_metrics(nuts),
        settings,
        nuts_peak_mb=nuts_memory.peak_mb,
        nuts_ksd=nuts_ksd,
    )


class _HeldParameters(Messenger):
    """Answers the model's ``pyro.param`` calls with fixed values and hides them from
    every outer handler, so that no optimiser trains them."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def _pyro_param(self, msg):
        if msg["name"] in self.values:
            msg["value"] = self.values[msg["name"]]
            msg["done"] = True
            msg["stop"] = True


def _hold_model_parameters(model, trace):
    """``(model, {name: value})``: a model with ``pyro.param`` sites (in its ``trace``) gets
    them fixed at their values now (the parameter store's, else their initial ones) and
    hidden from every optimiser, so that every row, NUTS (which cannot learn them)
    included, uses the same values."""
    values = {
        name: site["value"].detach().clone()
        for name, site in trace.nodes.items()
        if site["type"] == "param"
    }
    if not values:
        return model, {}
    return _HeldParameters(values)(model), {k: _short(v) for k, v in values.items()}


def _short(value):
    value = torch.as_tensor(value).detach()
    if value.numel() == 1:
        return float(value)
    return f"tensor of shape {tuple(value.shape)}"


def _shared_preconditioner(precondition, specs, model, args, kwargs, mpn, progress, seed):
    """``(precondition, record)``: what the methods of the library are built with, and a
    record of the search (``None`` where none ran). ``precondition=True`` becomes the
    model's preconditioners, found here once per Gaussian-fit estimator the methods ask
    for (:attr:`~pyro_implicit.diagnostics.methods.Method.vi_estimator`) instead of once
    per method, as ``{estimator: Preconditioner}`` (each search from the prior medians
    drawn at ``seed``, as the KSD's coordinates are), and the record ``{estimator: {source,
    kind, seconds, peak_mb}}``; ``False`` and a given
    :class:`~pyro_implicit.latent.Preconditioner` pass through."""
    # checked here, before NUTS runs, not by the first fit after it
    given = isinstance(precondition, Preconditioner)
    dim = LatentSpace.from_model(model, args, kwargs, mpn).latent_dim if given else None
    check_precondition(precondition, dim)
    if precondition is not True:
        return precondition, None
    wanted = [METHODS[s] for s in specs.values() if isinstance(s, str)]
    estimators = sorted({m.vi_estimator for m in wanted if m.preconditioned})
    found, record = {}, {}
    first = None  # the first search's estimator
    for estimator in estimators:
        if first is not None and not _ran_gaussian_fit(found[first]):
            # the Laplace passed its check: no Gaussian fit ran, so the other estimator's
            # search (deterministic given its seed) would find the same preconditioner
            found[estimator], record[estimator] = found[first], record[first]
            continue
        first = first or estimator
        with PeakMemory() as memory:
            start = time.perf_counter()
            pre = model_preconditioner(
                model, *args, max_plate_nesting=mpn, vi_estimator=estimator, seed=seed, **kwargs
            )
            seconds = time.perf_counter() - start
        what = "none found" if pre.is_identity else f"{pre.source}, {pre.kind}"
        _say(progress, f"preconditioner ({what}, Gaussian fit by {estimator}): {seconds:.1f} s")
        found[estimator] = pre
        record[estimator] = {
            "source": pre.source,
            "kind": pre.kind,
            "seconds": seconds,
            "peak_mb": memory.peak_mb,
        }
    return (found, record) if found else (precondition, None)


def _modes_of(shared, run_kwargs):
    """``(modes, weights)`` for NUTS to start in: the shared search's
    :func:`~pyro_implicit.latent.significant_modes`, where NUTS's start is its own (no
    ``init_strategy`` given); else ``([], [])``. Where the search kept one labelling of
    modes that are relabellings of one another (label switching) and found no other
    mode, that one mode: the chains then start in the labelling the methods fit, and
    are not split between labellings (R-hat of several, a reference that averages the
    labels away)."""
    if not isinstance(shared, dict) or "init_strategy" in run_kwargs:
        return [], []
    pre = next(iter(shared.values()))
    modes, weights = significant_modes(pre)
    found = getattr(pre, "diagnostics", None) or {}
    if not modes and found.get("mode_relabellings"):
        return found["modes"][:1], [1.0]
    return modes, weights


def _ran_gaussian_fit(pre):
    return any(k.startswith("gaussian_vi") for k in (getattr(pre, "diagnostics", None) or {}))


def _method_precondition(shared, method):
    """What ``method`` is built with: its estimator's preconditioner (a copy: a guide keeps
    its last draw on its preconditioner), or ``shared`` itself when it is not a dict."""
    if isinstance(shared, dict):
        shared = shared.get(method.vi_estimator, True)
    return copy.deepcopy(shared) if isinstance(shared, Preconditioner) else shared


def _add_diagnostics(model, args, kwargs, results, nuts, mpn, seed, shared=None):
    """Fill each row's ``ksd`` and ``k_hat`` (module docstring); return NUTS's KSD. The
    KSD's coordinates are the model's automatic preconditioner with its Gaussian fit by
    the exact-entropy estimate, whichever the methods asked for (so a row's KSD does not
    depend on which other rows run): taken from ``shared`` where it holds it (or where
    its search ran no Gaussian fit, which the estimate does not change), else searched;
    or ``shared`` itself where it is one's own preconditioner."""
    rng = pyro.util.get_rng_state()
    try:
        if isinstance(shared, dict):
            any_found = next(iter(shared.values()))
            shared = shared.get("entropy", None if _ran_gaussian_fit(any_found) else any_found)
        if isinstance(shared, Preconditioner):
            coordinates = shared
        else:
            with warnings.catch_warnings():
                # only coordinates: a fallback in the search still gives valid (if less
                # even) ones, and the fits have warned about it already
                warnings.simplefilter("ignore", PreconditionerWarning)
                coordinates = model_preconditioner(
                    model, *args, max_plate_nesting=mpn, seed=seed, **kwargs
                )

        def ksd(draws):
            return stein_discrepancy(
                model, draws, *args, preconditioner=coordinates, max_plate_nesting=mpn, **kwargs
            )

        unreliable = []
        for name, r in results.items():
            if r.failure is not None:
                continue
            r.ksd = ksd(r.samples)
            if has_log_density(r.approximation):
                pyro.set_rng_seed(seed)
                r.k_hat = psis_diagnostic(
                    model, r.approximation, *args, num_samples=1000, max_plate_nesting=mpn, **kwargs
                )
                if not r.k_hat <= K_HAT_THRESHOLD:
                    unreliable.append(f"{name} ({r.k_hat:.2f})")
        if unreliable:
            warnings.warn(
                f"PSIS k-hat > {K_HAT_THRESHOLD} for {', '.join(unreliable)}: importance "
                "weights cannot correct these guides, whose tails are too light somewhere; "
                "read their error columns (or KSD) with care and consider a richer guide "
                "or longer training",
                UnreliableFitWarning,
                stacklevel=3,
            )
        return None if nuts is None else ksd(nuts.samples)
    finally:
        pyro.util.set_rng_state(rng)


def _split_metrics(nuts):
    """The NUTS draws' first half against their second half."""
    num = next(iter(nuts.samples.values())).shape[0]
    half = num // 2
    first = {k: v[:half] for k, v in nuts.samples.items()}
    second = {k: v[half : 2 * half] for k, v in nuts.samples.items()}
    return compare_samples(first, second)
