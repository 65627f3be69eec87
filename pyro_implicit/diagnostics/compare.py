"""One call that fits several variational methods to a Pyro model and scores each against
NUTS.

:func:`compare` fits every named method with Pyro's ``SVI``, draws posterior samples from
it, runs (or reuses) a NUTS reference and summarises :func:`~pyro_implicit.diagnostics.
metrics.compare_samples` per method in a :class:`ComparisonResult`, whose :meth:`~
ComparisonResult.table` is meant to be read by a person::

    from pyro_implicit.diagnostics.compare import compare
    from pyro_implicit.models import load_model

    m = load_model("eight_schools")
    result = compare(m.model, *m.args, max_plate_nesting=m.max_plate_nesting)
    print(result.table())

Methods (:data:`METHODS`):

* ``"implicit"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.KernelRatioELBO` ``(num_particles=100,
  adaptive_contrast="full", regularizer=3e-3)``. Full adaptive contrast is far more
  accurate on small models than the paper's default (prior contrast, ``regularizer=1e-3``);
  3e-3 is a compromise measured in ``benchmarks/results/kivi_settings.md`` (a larger value
  lets heavy-tailed directions such as eight schools' ``tau`` drift wide, a smaller one
  narrows correlated posteriors).
* ``"sivi"``: :class:`~pyro_implicit.guides.SemiImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.SIVI_ELBO` ``(num_particles=50, num_mixing=100)`` (the SIVI
  paper's settings).
* ``"autonormal"``, ``"automvn"``: Pyro's ``AutoNormal`` and ``AutoMultivariateNormal``
  with ``Trace_ELBO(num_particles=8, vectorize_particles=True)``.

Every method uses ``ClippedAdam`` with its own initial learning rate, decayed
geometrically to a tenth of it over the run so the final iterate is not dominated by
gradient noise.
"""

import dataclasses
import math
import sys
import textwrap
import time

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from pyro.poutine.util import site_is_subsample

from ..elbo import SIVI_ELBO, KernelRatioELBO
from ..guides import ImplicitGuide, SemiImplicitGuide
from .metrics import compare_samples
from .nuts import NUTSResult, run_nuts

__all__ = ["METHODS", "ComparisonResult", "MethodResult", "compare", "latent_shapes"]


@dataclasses.dataclass(frozen=True)
class _Method:
    description: str
    lr: float
    build: object  # (model, max_plate_nesting) -> (guide, loss)


def _mpn_kwargs(max_plate_nesting):
    return {} if max_plate_nesting is None else {"max_plate_nesting": max_plate_nesting}


def _build_implicit(model, max_plate_nesting):
    loss = KernelRatioELBO(
        num_particles=100,
        regularizer=3e-3,
        adaptive_contrast="full",
        **_mpn_kwargs(max_plate_nesting),
    )
    return ImplicitGuide(model), loss


def _build_sivi(model, max_plate_nesting):
    loss = SIVI_ELBO(num_particles=50, num_mixing=100, **_mpn_kwargs(max_plate_nesting))
    return SemiImplicitGuide(model), loss


def _autoguide_builder(cls):
    def build(model, max_plate_nesting):
        loss = Trace_ELBO(num_particles=8, vectorize_particles=True,
                          **_mpn_kwargs(max_plate_nesting))
        return cls(model), loss

    return build


#: method name -> how it is built; the keys are the valid ``methods`` of :func:`compare`
METHODS = {
    "implicit": _Method(
        "ImplicitGuide + KernelRatioELBO(num_particles=100, adaptive_contrast='full', "
        "regularizer=3e-3)",
        1e-2,
        _build_implicit,
    ),
    "sivi": _Method(
        "SemiImplicitGuide + SIVI_ELBO(num_particles=50, num_mixing=100)",
        1e-2,
        _build_sivi,
    ),
    "autonormal": _Method(
        "AutoNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoNormal),
    ),
    "automvn": _Method(
        "AutoMultivariateNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoMultivariateNormal),
    ),
}

#: name of the reference row in tables
NUTS_ROW = "nuts"


@dataclasses.dataclass
class MethodResult:
    """One fitted method.

    :ivar str name: method name (a key of :data:`METHODS`).
    :ivar dict samples: site name -> ``(num_samples,) + site shape`` posterior draws.
    :ivar dict metrics: :func:`~pyro_implicit.diagnostics.metrics.compare_samples` against
        the NUTS draws.
    :ivar float wall_time: seconds to fit and sample.
    :ivar list losses: SVI loss of every step.
    :ivar float lr: initial learning rate.
    """

    name: str
    samples: dict
    metrics: dict
    wall_time: float
    losses: list
    lr: float


@dataclasses.dataclass
class ComparisonResult:
    """Output of :func:`compare`.

    :ivar dict methods: name -> :class:`MethodResult`, in the order fitted.
    :ivar NUTSResult nuts: the reference run.
    :ivar dict nuts_metrics: ``compare_samples`` of the first half of the NUTS draws
        against the second half (chain 1 against chain 2 for two chains): the Monte Carlo
        noise floor of every column.
    :ivar dict settings: the arguments the comparison ran with.
    """

    methods: dict
    nuts: NUTSResult
    nuts_metrics: dict
    settings: dict

    def rows(self):
        """One dict per row (the methods, then NUTS) with the joint summaries.

        :return: list of ``{"method", "mean_error_max", "sd_ratio_min", "sd_ratio_max",
            "w1_max", "energy_distance", "correlation_error_max", "seconds"}``.
        :rtype: list[dict]
        """
        out = [_row(name, r.metrics, r.wall_time) for name, r in self.methods.items()]
        out.append(_row(NUTS_ROW, self.nuts_metrics, self.nuts.wall_time))
        return out

    def nuts_summary(self):
        """One line on the NUTS reference: chains, draws, R-hat, ESS, divergences."""
        nuts = self.nuts
        first = next(iter(nuts.samples_by_chain.values()))
        chains, draws = first.shape[:2]
        warmup = self.settings.get("nuts_kwargs", {}).get("warmup_steps")
        warmup = f" after {warmup} warmup" if warmup is not None else ""
        return (
            f"NUTS: {chains} chain(s) x {draws} draws{warmup}; max r_hat "
            f"{nuts.max_r_hat:.3f}, min ESS {nuts.min_ess:.0f}, "
            f"{nuts.num_divergences} divergences, {nuts.wall_time:.1f} s"
        )

    def table(self):
        """The comparison as an aligned plain-text table, with the NUTS summary and a key
        to the columns below it.

        :rtype: str
        """
        cells = [_HEADER] + [_format(row) for row in self.rows()]
        widths = [max(len(r[i]) for r in cells) for i in range(len(_HEADER))]

        def line(r):
            # method name left-aligned, numbers right-aligned
            pairs = enumerate(zip(r, widths, strict=True))
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs).rstrip()

        rule = "  ".join("-" * w for w in widths)
        body = [line(cells[0]), rule] + [line(r) for r in cells[1:]]
        return "\n".join(body + ["", self.nuts_summary()] + textwrap.wrap(_KEY, 100))

    def to_markdown(self):
        """The comparison as a Markdown table followed by the NUTS summary.

        :rtype: str
        """
        lines = ["| " + " | ".join(_HEADER) + " |",
                 "|" + "|".join(["---"] + ["---:"] * (len(_HEADER) - 1)) + "|"]
        lines += ["| " + " | ".join(_format(row)) + " |" for row in self.rows()]
        return "\n".join(lines + ["", self.nuts_summary(), "", _KEY])

    def __str__(self):
        return self.table()


_HEADER = ("method", "mean err", "sd ratio", "W1 max", "energy", "corr err", "seconds")
_KEY = (
    "mean err: max |mean - NUTS mean| / NUTS sd; sd ratio: min-max of sd / NUTS sd; "
    "W1 max: largest marginal 1-Wasserstein in NUTS sds; energy: energy distance of the "
    "standardised joint; corr err: largest correlation difference. Row 'nuts': first half "
    "of its draws against the second half (Monte Carlo noise floor)."
)


def _row(name, metrics, seconds):
    joint = metrics["joint"]
    return {
        "method": name,
        "mean_error_max": joint["mean_error_max"],
        "sd_ratio_min": joint["sd_ratio_min"],
        "sd_ratio_max": joint["sd_ratio_max"],
        "w1_max": joint["w1_max"],
        "energy_distance": joint["energy_distance"],
        "correlation_error_max": joint["correlation_error_max"],
        "seconds": seconds,
    }


def _format(row):
    def f(x, digits=2):
        return f"{x:.{digits}f}" if math.isfinite(x) else str(x)

    return (
        row["method"],
        f(row["mean_error_max"]),
        f"{f(row['sd_ratio_min'])}-{f(row['sd_ratio_max'])}",
        f(row["w1_max"]),
        f(row["energy_distance"], 3),
        f(row["correlation_error_max"]),
        f(row["seconds"], 1),
    )


def latent_shapes(model, *args, **kwargs):
    """Shapes of the model's latent sample sites from one plain (prior) run.

    :return: ``{name: torch.Size}`` in execution order.
    :rtype: dict
    """
    with poutine.block():
        trace = poutine.trace(model).get_trace(*args, **kwargs)
    return {
        name: site["value"].shape
        for name, site in trace.nodes.items()
        if site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)
    }


def _posterior_samples(model, guide, args, kwargs, num_samples, shapes):
    if isinstance(guide, ImplicitGuide):
        draws = guide.sample_posterior(num_samples)
    else:
        # The fits above already need a vectorisation-safe model, so Predictive may draw
        # all samples in one vectorised call (parallel=False takes seconds per method).
        predictive = Predictive(model, guide=guide, num_samples=num_samples,
                                return_sites=list(shapes), parallel=True)
        with torch.no_grad():
            draws = predictive(*args, **kwargs)
    # Predictive pads sites outside the model's plates to (S, 1, ...): drop the padding.
    return {name: draws[name].detach().reshape((num_samples,) + tuple(shape))
            for name, shape in shapes.items()}


def _say(progress, message):
    if progress:
        print(message, file=sys.stderr, flush=True)


def _fit(name, model, args, kwargs, num_steps, lr, max_plate_nesting, progress):
    guide, loss = METHODS[name].build(model, max_plate_nesting)
    # Decay to lr / 10 over the run: large early steps, a quiet final iterate.
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1.0 / max(num_steps, 1))})
    svi = SVI(model, guide, optim, loss)
    losses = []
    report = {max(1, round(num_steps * k / 4)) for k in (1, 2, 3, 4)}
    for step in range(1, num_steps + 1):
        losses.append(float(svi.step(*args, **kwargs)))
        if step in report:
            window = losses[-max(1, num_steps // 10):]
            _say(progress, f"  {name}: step {step}/{num_steps}, "
                           f"loss {sum(window) / len(window):.4g}")
    return guide, losses


def compare(
    model,
    *args,
    methods=("implicit", "autonormal", "automvn"),
    num_steps=1000,
    num_samples=2000,
    nuts=None,
    nuts_kwargs=None,
    seed=0,
    max_plate_nesting=None,
    progress=True,
    lr=None,
    **kwargs,
):
    """Fit each method to ``model`` and compare its posterior with NUTS.

    Every method is fitted from ``pyro.set_rng_seed(seed)`` on an empty parameter store,
    so its result does not depend on which other methods run. Wall times include the
    posterior sampling. The model must be vectorisation-safe (all methods draw their
    particles under a plate).

    :param callable model: a Pyro model with continuous latent sites.
    :param args: positional arguments of ``model``.
    :param methods: names from :data:`METHODS`.
    :param int num_steps: SVI steps per method.
    :param int num_samples: posterior draws per method.
    :param NUTSResult nuts: a reference run to reuse; ``None`` runs
        :func:`~pyro_implicit.diagnostics.nuts.run_nuts`.
    :param dict nuts_kwargs: keyword arguments of ``run_nuts`` (default
        ``num_samples=500, warmup_steps=300, num_chains=2``).
    :param int seed: seed of every fit and of NUTS.
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param bool progress: report progress on stderr.
    :param lr: initial learning rate: a float for every method, a dict name -> float, or
        ``None`` for each method's default (:data:`METHODS`).
    :param kwargs: keyword arguments of ``model``.
    :rtype: ComparisonResult
    :raises ValueError: for an unknown method name or a bad count.
    """
    methods = list(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; choose from: "
            f"{', '.join(METHODS)}"
        )
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods must be distinct, got {methods}")
    if num_steps < 1 or num_samples < 2:
        raise ValueError(f"need num_steps >= 1 and num_samples >= 2, got {num_steps}, "
                         f"{num_samples}")
    lrs = {m: METHODS[m].lr for m in methods}
    if isinstance(lr, dict):
        lrs.update({m: float(v) for m, v in lr.items() if m in lrs})
    elif lr is not None:
        lrs = dict.fromkeys(methods, float(lr))
    run_kwargs = {"num_samples": 500, "warmup_steps": 300, "num_chains": 2}
    run_kwargs.update(nuts_kwargs or {})

    pyro.set_rng_seed(seed)
    shapes = latent_shapes(model, *args, **kwargs)
    ran_nuts = nuts is None
    if ran_nuts:
        _say(progress, f"NUTS: {run_kwargs['num_chains']} chain(s) x "
                       f"{run_kwargs['num_samples']} draws, {run_kwargs['warmup_steps']} warmup")
        nuts = run_nuts(model, *args, seed=seed, max_plate_nesting=max_plate_nesting,
                        progress_bar=False, **run_kwargs, **kwargs)
        _say(progress, f"  done in {nuts.wall_time:.1f} s")

    results = {}
    for name in methods:
        _say(progress, f"{name}: {num_steps} steps, lr {lrs[name]:g}")
        pyro.clear_param_store()
        pyro.set_rng_seed(seed)
        start = time.perf_counter()
        guide, losses = _fit(name, model, args, kwargs, num_steps, lrs[name],
                             max_plate_nesting, progress)
        samples = _posterior_samples(model, guide, args, kwargs, num_samples, shapes)
        wall = time.perf_counter() - start
        metrics = compare_samples(samples, nuts.samples, sites=[s for s in shapes
                                                                if s in nuts.samples])
        results[name] = MethodResult(name, samples, metrics, wall, losses, lrs[name])
        _say(progress, f"  done in {wall:.1f} s")
    pyro.clear_param_store()

    settings = {
        "methods": methods,
        "num_steps": num_steps,
        "num_samples": num_samples,
        "nuts_kwargs": run_kwargs if ran_nuts else {},
        "seed": seed,
        "max_plate_nesting": max_plate_nesting,
        "lr": lrs,
    }
    return ComparisonResult(results, nuts, _split_metrics(nuts), settings)


def _split_metrics(nuts):
    """The NUTS draws' first half against their second half."""
    num = next(iter(nuts.samples.values())).shape[0]
    half = num // 2
    first = {k: v[:half] for k, v in nuts.samples.items()}
    second = {k: v[half:2 * half] for k, v in nuts.samples.items()}
    return compare_samples(first, second)
