"""What :func:`~pyro_implicit.diagnostics.compare.compare` returns: one
:class:`MethodResult` per fitted method and the :class:`ComparisonResult` that holds them
with the NUTS reference, as a table (plain text, Markdown), a DataFrame or a JSON-able dict.
"""

import dataclasses
import math
import textwrap
from collections.abc import Mapping

import torch

from .nuts import NUTSResult

__all__ = ["NUTS_ROW", "ComparisonResult", "MethodResult"]

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
    :ivar str failure: why the fit stopped (a ``DivergenceError``), or ``None``; a failed
        row has no draws and ``nan`` in every column.
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
    failure: str = None

    @property
    def num_draws(self):
        """Number of posterior draws (particles for a particle method; 0 for a failed fit)."""
        if not self.samples:
            return 0
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
        out = [
            _row(name, r.metrics, r.wall_time, r.peak_mb, r.ksd, r.k_hat)
            for name, r in self.methods.items()
        ]
        if self.has_reference:
            out.append(
                _row(
                    NUTS_ROW,
                    self.nuts_metrics,
                    self.nuts.wall_time,
                    self.nuts_peak_mb,
                    self.nuts_ksd,
                    math.nan,
                )
            )
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
        named = [(n, r.metrics) for n, r in self.methods.items() if r.metrics is not None]
        for name, metrics in named + [(NUTS_ROW, self.nuts_metrics)]:
            for site, m in metrics["sites"].items():
                out.append(
                    {
                        "method": name,
                        "site": site,
                        **m,
                        "nuts_r_hat_max": diag.get(site, {}).get("r_hat_max", math.nan),
                        "nuts_ess_min": diag.get(site, {}).get("ess_min", math.nan),
                    }
                )
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
            return (
                "No NUTS reference (nuts=False): KSD and k-hat are the only checks; "
                "compare a fit's KSD with the others' (same coordinates)."
            )
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
        if nuts.mode_weights:
            weights = ", ".join(f"{w:.2f}" for w in nuts.mode_weights)
            line += (
                f"\nchains started in {len(nuts.mode_weights)} modes, draws weighted "
                f"{weights} by the modes' masses (R-hat and ESS within each mode)"
            )
        weak = nuts.weakness()
        if weak:
            line += (
                f"\nWEAK REFERENCE ({weak}): the error columns are noisy or biased; "
                "run NUTS longer (nuts_kwargs / --nuts-samples, --nuts-warmup)"
            )
        return line

    def _header(self):
        return _HEADER if self.has_reference else _NO_REFERENCE_HEADER

    def _failures(self):
        """One line per fit that stopped, saying why."""
        return [f"{name}: {r.failure}" for name, r in self.methods.items() if r.failure]

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
        return "\n".join(
            body + ["", self.nuts_summary()] + self._failures() + textwrap.wrap(self._key(), 100)
        )

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
        lines = [
            "| " + " | ".join(header) + " |",
            "|"
            + "|".join(
                ["---"] * (2 if per_site else 1) + ["---:"] * (len(header) - (2 if per_site else 1))
            )
            + "|",
        ]
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
        return "\n".join(lines + ["", self.nuts_summary()] + self._failures() + ["", key])

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
                site: {
                    "r_hat": d["r_hat"].reshape(-1).tolist(),
                    "ess": d["ess"].reshape(-1).tolist(),
                }
                for site, d in nuts.diagnostics.items()
            },
            "split_half_metrics": self.nuts_metrics,
            "ksd": None if self.nuts_ksd is None else dataclasses.asdict(self.nuts_ksd),
        }


_HEADER = (
    "method",
    "mean err",
    "sd ratio",
    "W1 max",
    "energy",
    "corr err",
    "KSD",
    "k-hat",
    "seconds",
    "peak MB",
)
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


_SITE_HEADER = (
    "method",
    "site",
    "coords",
    "mean err",
    "sd ratio",
    "W1 max",
    "NUTS r_hat",
    "NUTS ESS",
)
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


_NO_METRICS = dict.fromkeys(
    (
        "mean_error_max",
        "sd_ratio_min",
        "sd_ratio_max",
        "w1_max",
        "energy_distance",
        "correlation_error_max",
    ),
    math.nan,
)


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
        f(row["k_hat"], 3),  # 0.7015 read "0.70" beside a warning of k-hat > 0.7
        f(row["seconds"], 1),
        f(row["peak_mb"], 1),
    )
