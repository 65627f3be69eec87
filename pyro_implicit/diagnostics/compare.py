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

Methods (:data:`METHODS`):

Every method of the library runs with its defaults, which include the automatic
preconditioner (:mod:`pyro_implicit.latent`; ``precondition=False`` fits in the raw space).

* ``"implicit"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.KernelRatioELBO` ``()``: 100 particles, the
  preconditioner's Gaussian as the ratio's contrast.
* ``"sivi"``: :class:`~pyro_implicit.guides.SemiImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.SIVI_ELBO` ``(num_particles=50, num_mixing=100)`` (the SIVI
  paper's settings).
* ``"livi"``: :class:`~pyro_implicit.guides.LinearizedGuide` trained with
  :class:`~pyro_implicit.elbo.LIVI_ELBO` ``(bound="det")`` (eq. 15, whole Jacobians: cheap
  at these sizes).
* ``"gpvi"``: :class:`~pyro_implicit.guides.ImplicitGuide` with the skip generator
  ``gpvi_generator()`` trained with :class:`~pyro_implicit.elbo.GPVI_ELBO`
  ``(num_particles=64)`` (its default solves with the exact Jacobian up to D = 64, the
  paper's "exact Jacobian" variant: with the helper network and 1000 steps the
  eight-schools fit was still far too narrow, at learning rates 1e-2 and 1e-3).
* ``"asvgd"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.AmortizedSVGD_ELBO` ``(num_particles=64)`` (Wang & Liu's
  amortised SVGD: the SVGD direction pulled back into the generator).
* ``"autonormal"``, ``"automvn"``: Pyro's ``AutoNormal`` and ``AutoMultivariateNormal``
  with ``Trace_ELBO(num_particles=8, vectorize_particles=True)``.
* ``"svgd"``: Pyro's own ``pyro.infer.SVGD`` with ``RBFSteinKernel()`` and
  ``mode="multivariate"`` (Liu & Wang's SVGD; the default "univariate" mode fails on
  correlated posteriors). Pyro 1.9 packs multi-site particles site-major but reshapes them
  particle-major in ``step()``, so on a model with several latent sites its kernel mixes
  coordinates of different particles: the row shows stock Pyro, defect included.
* ``"wsvgd"``: :class:`~pyro_implicit.particles.WeightSpaceSVGD`, the same algorithm with
  particle-major packing, in the preconditioner's whitened coordinates, with an RBF
  kernel whose length scale is the median distance.

SVI methods use ``ClippedAdam`` with their own initial learning rate, particle methods
Adam-style ``ClippedAdam`` too; every learning rate decays geometrically to a tenth of it
over the run so the final iterate is not dominated by gradient noise.

Already-fitted approximations can be passed instead of names, as ``methods={"label":
object}``: any Pyro ``AutoGuide`` (ours included), a ``pyro.infer.SVGD``, a
:class:`~pyro_implicit.particles.ParticleInference`, or a dict of posterior draws
``{site: (S, *site_shape)}``. Their row's time covers drawing only.
"""

import dataclasses
import math
import sys
import textwrap
import time
import warnings
from collections.abc import Mapping

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVGD, SVI, RBFSteinKernel, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from pyro.ops.stats import effective_sample_size, split_gelman_rubin
from pyro.poutine.messenger import Messenger

from ..elbo import GPVI_ELBO, LIVI_ELBO, SIVI_ELBO, AmortizedSVGD_ELBO, KernelRatioELBO
from ..elbo.base import check_observed_finite, check_vectorized_log_joint
from ..elbo.gpvi import gpvi_generator
from ..guides import ImplicitGuide, LinearizedGuide, SemiImplicitGuide
from ..latent import PreconditionerWarning
from ..particles import WeightSpaceSVGD
from .draws import guess_max_plate_nesting, latent_shapes, posterior_draws, source_kind
from .importance import (
    K_HAT_THRESHOLD,
    UnreliableFitWarning,
    has_log_density,
    psis_diagnostic,
)
from .memory import PeakMemory
from .metrics import compare_samples
from .nuts import NUTSResult, check_continuous_latents, run_nuts
from .stein import model_preconditioner, stein_discrepancy

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "ComparisonResult",
    "MethodResult",
    "compare",
    "guess_max_plate_nesting",
    "latent_shapes",
    "nuts_result_from_mcmc",
    "posterior_draws",
]


@dataclasses.dataclass(frozen=True)
class _Method:
    description: str
    lr: float
    build: object  # svi: (model, mpn) -> (guide, loss); particles: (model, mpn, optim) -> obj
    kind: str = "svi"  # "svi" (a guide: iid draws) or "particles" (a fixed set)
    trace_label: str = "loss (-ELBO estimate)"


def _build_implicit(model, mpn, precondition=True):
    loss = KernelRatioELBO(max_plate_nesting=mpn)
    return ImplicitGuide(model, precondition=precondition), loss


def _build_sivi(model, mpn, precondition=True):
    return SemiImplicitGuide(model, precondition=precondition), SIVI_ELBO(
        num_particles=50, num_mixing=100, max_plate_nesting=mpn
    )


def _build_livi(model, mpn, precondition=True):
    return LinearizedGuide(model, precondition=precondition), LIVI_ELBO(
        num_particles=8, bound="det", max_plate_nesting=mpn
    )


def _build_gpvi(model, mpn, precondition=True):
    loss = GPVI_ELBO(num_particles=64, max_plate_nesting=mpn)
    return ImplicitGuide(model, generator=gpvi_generator(), precondition=precondition), loss


def _build_asvgd(model, mpn, precondition=True):
    return ImplicitGuide(model, precondition=precondition), AmortizedSVGD_ELBO(
        num_particles=64, max_plate_nesting=mpn
    )


def _autoguide_builder(cls):
    def build(model, mpn, precondition=True):
        # Pyro's guides have no preconditioner: the row is the same either way
        return cls(model), Trace_ELBO(num_particles=8, vectorize_particles=True,
                                      max_plate_nesting=mpn)

    return build


#: particles of the two SVGD methods
NUM_PARTICLES = 100


def _build_pyro_svgd(model, mpn, optim, precondition=True):
    return SVGD(model, RBFSteinKernel(), optim, num_particles=NUM_PARTICLES,
                max_plate_nesting=mpn, mode="multivariate")


def _build_wsvgd(model, mpn, optim, precondition=True):
    return WeightSpaceSVGD(model, optim, num_particles=NUM_PARTICLES, max_plate_nesting=mpn,
                           precondition=precondition)


#: method name -> how it is built; the keys are the valid ``methods`` of :func:`compare`
METHODS = {
    "implicit": _Method(
        "ImplicitGuide + KernelRatioELBO() (100 particles, the preconditioner's Gaussian as "
        "contrast)",
        1e-2,
        _build_implicit,
    ),
    "sivi": _Method(
        "SemiImplicitGuide + SIVI_ELBO(num_particles=50, num_mixing=100)",
        1e-2,
        _build_sivi,
    ),
    "livi": _Method(
        "LinearizedGuide + LIVI_ELBO(num_particles=8, bound='det')",
        1e-2,
        _build_livi,
    ),
    "gpvi": _Method(
        "ImplicitGuide(generator=gpvi_generator()) + GPVI_ELBO(num_particles=64) (exact "
        "Jacobian solve up to D = 64)",
        3e-3,
        _build_gpvi,
        trace_label="-(mean log target of the step's draws)",
    ),
    "asvgd": _Method(
        "ImplicitGuide + AmortizedSVGD_ELBO(num_particles=64)",
        1e-2,
        _build_asvgd,
        trace_label="-(mean log target of the step's draws)",
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
    "svgd": _Method(
        f"pyro.infer.SVGD(RBFSteinKernel(), num_particles={NUM_PARTICLES}, "
        "mode='multivariate'), stock Pyro 1.9: multi-site particles are mis-packed",
        5e-2,
        _build_pyro_svgd,
        kind="particles",
        trace_label="Stein force (mean squared particle gradient, summed over sites)",
    ),
    "wsvgd": _Method(
        f"WeightSpaceSVGD(num_particles={NUM_PARTICLES}), particle-major SVGD, RBF kernel with "
        "the median distance as length scale",
        5e-2,
        _build_wsvgd,
        kind="particles",
        trace_label="-(mean log joint of the particles)",
    ),
}

#: what :func:`compare` and the command line run when no methods are named
DEFAULT_METHODS = tuple(METHODS)

#: name of the reference row in tables
NUTS_ROW = "nuts"


@dataclasses.dataclass
class MethodResult:
    """One fitted method.

    :ivar str name: the row label.
    :ivar dict samples: site name -> ``(num_draws,) + site shape`` posterior draws.
    :ivar dict metrics: :func:`~pyro_implicit.diagnostics.metrics.compare_samples` against
        the NUTS draws.
    :ivar float wall_time: seconds to fit and draw (to draw only if passed in fitted).
    :ivar float peak_mb: rise of memory use while fitting and drawing, MiB
        (:class:`~pyro_implicit.diagnostics.memory.PeakMemory`; ``nan`` where it cannot
        be measured).
    :ivar list losses: one value per step (see ``loss_label``); empty if passed in fitted.
    :ivar float lr: initial learning rate (``nan`` if passed in fitted).
    :ivar str description: what the method is.
    :ivar str kind: ``"iid"`` (independent draws of a guide), ``"particles"`` (one fixed
        particle set) or ``"samples"`` (draws handed in as a dict).
    :ivar str loss_label: what ``losses`` holds.
    :ivar bool fitted_here: ``False`` for an approximation passed in already fitted.
    :ivar approximation: the fitted guide or particle object (``None`` for a dict).
    :ivar ksd: the :class:`~pyro_implicit.diagnostics.stein.SteinDiscrepancy` of the draws
        (``None`` with ``diagnostics=False``).
    :ivar float k_hat: PSIS k-hat of the guide (``nan`` where it has no log-density, for
        particles and draws, or with ``diagnostics=False``).
    """

    name: str
    samples: dict = dataclasses.field(repr=False)
    metrics: dict = dataclasses.field(repr=False)
    wall_time: float
    losses: list = dataclasses.field(repr=False)
    lr: float
    description: str = ""
    kind: str = "iid"
    loss_label: str = "loss (-ELBO estimate)"
    fitted_here: bool = True
    approximation: object = dataclasses.field(default=None, repr=False)
    peak_mb: float = math.nan
    ksd: object = None
    k_hat: float = math.nan

    @property
    def num_draws(self):
        """Number of posterior draws (particles for a particle method)."""
        return int(next(iter(self.samples.values())).shape[0])


@dataclasses.dataclass
class ComparisonResult:
    """Output of :func:`compare`.

    :ivar dict methods: name -> :class:`MethodResult`, in the order given.
    :ivar NUTSResult nuts: the reference run (``None`` with ``nuts=False``).
    :ivar dict nuts_metrics: ``compare_samples`` of the first half of the NUTS draws
        against the second half (chain 1 against chain 2 for two chains): the Monte Carlo
        noise floor of every column (``None`` without NUTS).
    :ivar dict settings: the arguments the comparison ran with.
    :ivar float nuts_peak_mb: rise of memory use during the NUTS run, MiB (``nan`` for a
        reused reference).
    :ivar nuts_ksd: the Stein discrepancy of the NUTS draws, in the same coordinates as
        the methods': the yardstick of their KSD column (``None`` without it).
    """

    methods: dict
    nuts: NUTSResult
    nuts_metrics: dict
    settings: dict
    nuts_peak_mb: float = math.nan
    nuts_ksd: object = None

    @property
    def has_reference(self):
        """Whether NUTS ran (or was given): the columns that compare with it exist."""
        return self.nuts is not None

    # ------------------------------------------------------------------ rows
    def rows(self):
        """One dict per row (the methods, then NUTS) with the joint summaries.

        :return: list of ``{"method", "mean_error_max", "sd_ratio_min", "sd_ratio_max",
            "w1_max", "energy_distance", "correlation_error_max", "ksd", "k_hat", "seconds",
            "peak_mb"}`` (the NUTS columns ``nan`` and no NUTS row without a reference).
        :rtype: list[dict]
        """
        out = [_row(name, r.metrics, r.wall_time, r.peak_mb, r.ksd, r.k_hat)
               for name, r in self.methods.items()]
        if self.has_reference:
            out.append(_row(NUTS_ROW, self.nuts_metrics, self.nuts.wall_time,
                            self.nuts_peak_mb, self.nuts_ksd, math.nan))
        return out

    def site_rows(self):
        """One dict per (method, site): the per-site summaries of ``compare_samples``, with
        the NUTS reference's largest R-hat and smallest ESS of that site.

        :return: list of ``{"method", "site", "num_coords", "mean_error_max",
            "sd_ratio_min", "sd_ratio_median", "sd_ratio_max", "w1_max", "nuts_r_hat_max",
            "nuts_ess_min"}``; the NUTS rows compare its two halves.
        :rtype: list[dict]
        """
        if not self.has_reference:
            return []
        diag = self.nuts_diagnostics()
        out = []
        named = [(n, r.metrics) for n, r in self.methods.items()]
        for name, metrics in named + [(NUTS_ROW, self.nuts_metrics)]:
            for site, m in metrics["sites"].items():
                out.append({"method": name, "site": site, **m,
                            "nuts_r_hat_max": diag.get(site, {}).get("r_hat_max", math.nan),
                            "nuts_ess_min": diag.get(site, {}).get("ess_min", math.nan)})
        return out

    def nuts_diagnostics(self):
        """Per-site NUTS convergence diagnostics.

        :return: ``{site: {"r_hat_max", "ess_min"}}`` over the site's coordinates.
        :rtype: dict
        """
        if not self.has_reference:
            return {}
        return {
            site: {"r_hat_max": _reduce_max(d["r_hat"]), "ess_min": -_reduce_max(-d["ess"])}
            for site, d in self.nuts.diagnostics.items()
        }

    # ------------------------------------------------------------------ text
    def nuts_summary(self):
        """One line on the NUTS reference: chains, draws, R-hat, ESS, divergences."""
        if not self.has_reference:
            return ("No NUTS reference (nuts=False): KSD and k-hat are the only checks; "
                    "compare a fit's KSD with the others' (same coordinates).")
        nuts = self.nuts
        first = next(iter(nuts.samples_by_chain.values()))
        chains, draws = first.shape[:2]
        warmup = self.settings.get("nuts_kwargs", {}).get("warmup_steps")
        warmup = f" after {warmup} warmup" if warmup is not None else ""
        line = (
            f"NUTS: {chains} chain(s) x {draws} draws{warmup}; max r_hat "
            f"{nuts.max_r_hat:.3f}, min ESS {nuts.min_ess:.0f}, "
            f"{nuts.num_divergences} divergences, {nuts.wall_time:.1f} s"
        )
        weak = nuts.weakness()
        if weak:
            line += (f"\nWEAK REFERENCE ({weak}): the error columns are noisy or biased; "
                     "run NUTS longer (nuts_kwargs / --nuts-samples, --nuts-warmup)")
        return line

    def _header(self):
        return _HEADER if self.has_reference else _NO_REFERENCE_HEADER

    def _key(self):
        key = (_KEY if self.has_reference else "") + _DIAGNOSTICS_KEY
        if any(not r.fitted_here for r in self.methods.values()):
            key += " *: passed in already fitted; seconds cover drawing only."
        return key

    def table(self):
        """The comparison as an aligned plain-text table, with the NUTS summary and a key
        to the columns below it.

        :rtype: str
        """
        header = self._header()
        cells = [header] + [self._format(row) for row in self.rows()]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

        def line(r):
            # method name left-aligned, numbers right-aligned
            pairs = enumerate(zip(r, widths, strict=True))
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs).rstrip()

        rule = "  ".join("-" * w for w in widths)
        body = [line(cells[0]), rule] + [line(r) for r in cells[1:]]
        return "\n".join(body + ["", self.nuts_summary()] + textwrap.wrap(self._key(), 100))

    def to_markdown(self, per_site=False):
        """The comparison as a Markdown table followed by the NUTS summary.

        :param bool per_site: one row per (method, site) with the site's metrics and the
            NUTS reference's R-hat and ESS for it, instead of one row per method.
        :rtype: str
        """
        if per_site:
            header, rows = _SITE_HEADER, [_format_site(r) for r in self.site_rows()]
            key = _SITE_KEY
        else:
            header, rows = self._header(), [self._format(row) for row in self.rows()]
            key = self._key()
        lines = ["| " + " | ".join(header) + " |",
                 "|" + "|".join(["---"] * (2 if per_site else 1)
                                + ["---:"] * (len(header) - (2 if per_site else 1))) + "|"]
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        return "\n".join(lines + ["", self.nuts_summary(), "", key])

    def __str__(self):
        return self.table()

    def _format(self, row):
        cells = _format(row)
        if not self.has_reference:
            cells = (cells[0],) + cells[-4:]
        r = self.methods.get(row["method"])
        if r is not None and not r.fitted_here:
            cells = cells[:-2] + (cells[-2] + "*", cells[-1])
        return cells

    # ------------------------------------------------------------------ data
    def to_dataframe(self, per_site=False):
        """The rows as a ``pandas.DataFrame`` (pandas is installed with ArviZ).

        :param bool per_site: one row per (method, site) (:meth:`site_rows`) instead of
            one per method (:meth:`rows`).
        :rtype: pandas.DataFrame
        :raises ImportError: if pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - pandas comes with arviz
            raise ImportError("to_dataframe needs pandas: pip install pandas") from e
        if per_site:
            return pd.DataFrame(self.site_rows()).set_index(["method", "site"])
        return pd.DataFrame(self.rows()).set_index("method")

    def to_dict(self):
        """Every number of the comparison as plain Python types (JSON-serialisable, with
        ``NaN``/``Infinity`` for non-finite values as Python's ``json`` writes them).

        :return: ``{"settings", "rows", "methods": {name: {"description", "kind",
            "num_draws", "lr", "wall_time", "fitted_here", "loss_label", "losses",
            "metrics"}}, "nuts": {...}}``.
        :rtype: dict
        """
        return {
            "settings": _plain(self.settings),
            "rows": self.rows(),
            "methods": {
                name: {
                    "description": r.description,
                    "kind": r.kind,
                    "num_draws": r.num_draws,
                    "lr": r.lr,
                    "wall_time": r.wall_time,
                    "peak_mb": r.peak_mb,
                    "fitted_here": r.fitted_here,
                    "loss_label": r.loss_label,
                    "losses": [float(x) for x in r.losses],
                    "metrics": r.metrics,
                    "ksd": None if r.ksd is None else dataclasses.asdict(r.ksd),
                    "k_hat": r.k_hat,
                }
                for name, r in self.methods.items()
            },
            "nuts": self._nuts_dict(),
        }

    def _nuts_dict(self):
        nuts = self.nuts
        if nuts is None:
            return None
        first = next(iter(nuts.samples_by_chain.values()))
        return {
            "num_chains": int(first.shape[0]),
            "num_samples": int(first.shape[1]),
            "wall_time": nuts.wall_time,
            "peak_mb": self.nuts_peak_mb,
            "max_r_hat": nuts.max_r_hat,
            "min_ess": nuts.min_ess,
            "num_divergences": int(nuts.num_divergences),
            "divergences_by_chain": list(nuts.divergences_by_chain),
            "acceptance_rate_by_chain": list(nuts.acceptance_rate_by_chain),
            "seeds": list(nuts.seeds),
            "sites": {
                site: {"r_hat": d["r_hat"].reshape(-1).tolist(),
                       "ess": d["ess"].reshape(-1).tolist()}
                for site, d in nuts.diagnostics.items()
            },
            "split_half_metrics": self.nuts_metrics,
            "ksd": None if self.nuts_ksd is None else dataclasses.asdict(self.nuts_ksd),
        }


_HEADER = ("method", "mean err", "sd ratio", "W1 max", "energy", "corr err", "KSD", "k-hat",
           "seconds", "peak MB")
_NO_REFERENCE_HEADER = ("method", "KSD", "k-hat", "seconds", "peak MB")
_KEY = (
    "mean err: max |mean - NUTS mean| / NUTS sd; sd ratio: min-max of sd / NUTS sd; "
    "W1 max: largest marginal 1-Wasserstein in NUTS sds; energy: energy distance of the "
    "standardised joint; corr err: largest correlation difference. Row 'nuts': first half "
    "of its draws against the second half (NUTS's own Monte Carlo noise; a method's row, "
    "with more draws on each side, has a lower floor). seconds: wall time of "
    "fit and draws; peak MB: rise of the process's peak memory during them. "
)
_DIAGNOSTICS_KEY = (
    "KSD: kernel Stein discrepancy of the draws (IMQ kernel, in the model's preconditioner "
    "coordinates, the same for every row; needs no NUTS); k-hat: PSIS Pareto k of the "
    "guide's importance weights, for guides with a log-density (above 0.7: the weights, "
    "and often the fit, are not to be trusted)."
)


_SITE_HEADER = ("method", "site", "coords", "mean err", "sd ratio", "W1 max", "NUTS r_hat",
                "NUTS ESS")
_SITE_KEY = (
    "Per site: mean err, sd ratio (min-max) and W1 max over the site's coordinates, in NUTS "
    "sds; NUTS r_hat: largest split R-hat of the site's coordinates, NUTS ESS: smallest "
    "effective sample size. Rows 'nuts': first half of its draws against the second half."
)


def _format_site(row):
    def f(x, digits=2):
        return f"{x:.{digits}f}" if math.isfinite(x) else str(x)

    return (
        row["method"],
        row["site"],
        str(row["num_coords"]),
        f(row["mean_error_max"]),
        f"{f(row['sd_ratio_min'])}-{f(row['sd_ratio_max'])}",
        f(row["w1_max"]),
        f(row["nuts_r_hat_max"], 3),
        f(row["nuts_ess_min"], 0),
    )


def _reduce_max(t):
    # constant coordinates (an LKJ factor's fixed entries) have no R-hat or ESS: left out
    t = torch.as_tensor(t).reshape(-1)
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else math.nan


def _plain(x):
    """Settings as JSON-able plain types."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    return repr(x)


_NO_METRICS = dict.fromkeys(("mean_error_max", "sd_ratio_min", "sd_ratio_max", "w1_max",
                             "energy_distance", "correlation_error_max"), math.nan)


def _row(name, metrics, seconds, peak_mb, ksd=None, k_hat=math.nan):
    joint = _NO_METRICS if metrics is None else metrics["joint"]
    return {
        "method": name,
        "mean_error_max": joint["mean_error_max"],
        "sd_ratio_min": joint["sd_ratio_min"],
        "sd_ratio_max": joint["sd_ratio_max"],
        "w1_max": joint["w1_max"],
        "energy_distance": joint["energy_distance"],
        "correlation_error_max": joint["correlation_error_max"],
        "ksd": math.nan if ksd is None else ksd.ksd,
        "k_hat": k_hat,
        "seconds": seconds,
        "peak_mb": peak_mb,
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
        f(row["ksd"], 3),
        f(row["k_hat"]),
        f(row["seconds"], 1),
        f(row["peak_mb"], 1),
    )


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
            k: {"r_hat": split_gelman_rubin(v, chain_dim=0, sample_dim=1),
                "ess": effective_sample_size(v, chain_dim=0, sample_dim=1)}
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
    return tqdm(range(num_steps), desc=f"  {name}", file=sys.stderr, leave=False,
                mininterval=0.5, dynamic_ncols=True, disable=None)


def _fit(name, model, args, kwargs, num_steps, lr, mpn, progress, precondition=True):
    """Fit method ``name``; returns ``(approximation, trace)``."""
    method = METHODS[name]
    # Decay to lr / 10 over the run: large early steps, a quiet final iterate.
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.1 ** (1.0 / max(num_steps, 1))})
    if method.kind == "particles":
        fitted = method.build(model, mpn, optim, precondition=precondition)
        step = fitted.step
    else:
        fitted, loss = method.build(model, mpn, precondition=precondition)
        step = SVI(model, fitted, optim, loss).step
    trace = []
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
    if not specs:
        raise ValueError("no methods given")
    unknown = [s for s in specs.values() if isinstance(s, str) and s not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method(s) {', '.join(map(repr, unknown))}; choose from: "
            f"{', '.join(METHODS)}"
        )
    for spec in specs.values():
        if not isinstance(spec, str):
            source_kind(spec)  # raises a TypeError naming what is accepted
    return specs


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
    **kwargs,
):
    """Fit each method to ``model`` (or take it fitted) and compare its posterior with NUTS.

    Every method is fitted from ``pyro.set_rng_seed(seed)`` on an empty parameter store,
    so its result does not depend on which other methods run. Wall times include the
    posterior draws. The model must be vectorisation-safe (all methods draw their
    particles under a plate) and have continuous latent sites only.

    :param callable model: a Pyro model.
    :param args: positional arguments of ``model``.
    :param methods: names from :data:`METHODS`, or a dict ``label -> name or fitted
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
    :param bool precondition: fit the library's methods in the coordinates of their
        automatic preconditioner (default; :mod:`pyro_implicit.latent`), or, with
        ``False``, in the raw unconstrained space as the papers do. Pyro's own guides and
        ``pyro.infer.SVGD`` are unaffected.
    :param bool diagnostics: add the checks that need no NUTS to every row: the kernel
        Stein discrepancy of its draws (:func:`~pyro_implicit.diagnostics.stein_discrepancy`,
        all rows in the coordinates of the model's automatic preconditioner, NUTS's row
        too) and, for guides with a log-density, PSIS k-hat
        (:func:`~pyro_implicit.diagnostics.psis_diagnostic`, 1000 draws); one
        :class:`~pyro_implicit.diagnostics.importance.UnreliableFitWarning` names the
        guides whose k-hat exceeds 0.7.
    :param kwargs: keyword arguments of ``model``.
    :rtype: ComparisonResult
    :raises ValueError: for an unknown method name, a bad count, or a model with a
        discrete latent site (the message is NUTS's).
    """
    specs = _resolve(methods)
    if num_steps < 1 or num_samples < 2:
        raise ValueError(f"need num_steps >= 1 and num_samples >= 2, got {num_steps}, "
                         f"{num_samples}")
    lrs = {label: METHODS[s].lr for label, s in specs.items() if isinstance(s, str)}
    if isinstance(lr, dict):
        lrs.update({m: float(v) for m, v in lr.items() if m in lrs})
    elif lr is not None:
        lrs = dict.fromkeys(lrs, float(lr))
    run_kwargs = {"num_samples": 500, "warmup_steps": 300, "num_chains": 2}
    run_kwargs.update(nuts_kwargs or {})

    pyro.set_rng_seed(seed)
    check_continuous_latents(model, *args, **kwargs)
    shapes = latent_shapes(model, *args, **kwargs)
    if max_plate_nesting is None:
        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    mpn = max_plate_nesting
    # before anything runs (NUTS takes seconds to minutes): NaN data and a model that
    # mixes particles under a plate are refused with their own message, for every row
    with poutine.block():
        check_observed_finite(poutine.trace(model).get_trace(*args, **kwargs))
    check_vectorized_log_joint(model, None, args, kwargs, mpn + 1)
    model, held = _hold_model_parameters(model, args, kwargs)
    if held:
        _say(progress, "model parameters held at these values in every row (NUTS cannot "
                       "learn them): " + ", ".join(f"{k} = {v}" for k, v in held.items()))

    _warm_up(model, args, kwargs, mpn)
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
            label, samples, None, time.perf_counter() - start, [], math.nan,
            description=f"{type(spec).__name__} passed in fitted", kind=kind,
            loss_label="", fitted_here=False,
            approximation=None if kind == "samples" else spec,
        )

    if nuts is False:
        ran_nuts = False
        nuts_memory = PeakMemory()
        nuts = None
    elif nuts is None:
        ran_nuts = True
        _say(progress, f"NUTS: {run_kwargs['num_chains']} chain(s) x "
                       f"{run_kwargs['num_samples']} draws, {run_kwargs['warmup_steps']} warmup")
        with PeakMemory() as nuts_memory:
            nuts = run_nuts(model, *args, seed=seed, max_plate_nesting=mpn,
                            progress_bar=progress, **run_kwargs, **kwargs)
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
        with PeakMemory() as memory:
            start = time.perf_counter()
            fitted, trace = _fit(spec, model, args, kwargs, num_steps, lrs[label], mpn,
                                 progress, precondition=precondition)
            samples, kind = posterior_draws(fitted, model, args, kwargs, num_samples, mpn,
                                            shapes)
            wall = time.perf_counter() - start
        results[label] = MethodResult(
            label, samples, None, wall, trace, lrs[label], description=method.description,
            kind=kind, loss_label=method.trace_label, approximation=fitted,
            peak_mb=memory.peak_mb,
        )
        window = trace[-max(1, num_steps // 10):]
        _say(progress, f"  done in {wall:.1f} s; last {len(window)} steps' mean "
                       f"{method.trace_label.split(' (')[0]}: {sum(window) / len(window):.4g}")
    pyro.clear_param_store()

    ordered = {}
    for label in specs:
        r = results[label]
        r.metrics = None if nuts is None else compare_samples(r.samples, nuts.samples,
                                                               sites=sites)
        ordered[label] = r
    nuts_ksd = None
    if diagnostics:
        _say(progress, "diagnostics: kernel Stein discrepancy of every row, PSIS k-hat of "
                       "guides with a log-density")
        nuts_ksd = _add_diagnostics(model, args, kwargs, ordered, nuts, mpn, seed)

    settings = {
        "methods": {label: s if isinstance(s, str) else type(s).__name__
                    for label, s in specs.items()},
        "num_steps": num_steps,
        "num_samples": num_samples,
        "nuts_kwargs": run_kwargs if ran_nuts else {},
        "seed": seed,
        "max_plate_nesting": mpn,
        "lr": lrs,
        "nuts": nuts is not None,
        "diagnostics": bool(diagnostics),
        "held_model_parameters": held,
    }
    return ComparisonResult(ordered, nuts, None if nuts is None else _split_metrics(nuts),
                            settings, nuts_peak_mb=nuts_memory.peak_mb, nuts_ksd=nuts_ksd)


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


def _hold_model_parameters(model, args, kwargs):
    """``(model, {name: value})``: a model with ``pyro.param`` sites gets them fixed at
    their values now (the parameter store's, else their initial ones) and hidden from every
    optimiser, so that every row, NUTS (which cannot learn them) included, uses the same
    values."""
    with torch.no_grad(), poutine.block():
        trace = poutine.trace(model).get_trace(*args, **kwargs)
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


def _add_diagnostics(model, args, kwargs, results, nuts, mpn, seed):
    """Fill each row's ``ksd`` and ``k_hat`` (module docstring); return NUTS's KSD."""
    rng = pyro.util.get_rng_state()
    try:
        with warnings.catch_warnings():
            # only coordinates: a fallback in the search still gives valid (if less
            # even) ones, and the fits have warned about it already
            warnings.simplefilter("ignore", PreconditionerWarning)
            coordinates = model_preconditioner(model, *args, max_plate_nesting=mpn, **kwargs)

        def ksd(draws):
            return stein_discrepancy(model, draws, *args, preconditioner=coordinates,
                                     max_plate_nesting=mpn, **kwargs)

        unreliable = []
        for name, r in results.items():
            r.ksd = ksd(r.samples)
            if has_log_density(r.approximation):
                pyro.set_rng_seed(seed)
                r.k_hat = psis_diagnostic(model, r.approximation, *args, num_samples=1000,
                                          max_plate_nesting=mpn, **kwargs)
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
    second = {k: v[half:2 * half] for k, v in nuts.samples.items()}
    return compare_samples(first, second)
