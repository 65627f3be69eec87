"""Checking a posterior approximation against NUTS.

* :mod:`.compare`: :func:`compare` fits methods (or takes fitted ones) and scores each
  against NUTS in one :class:`ComparisonResult` (table, DataFrame, JSON-able dict).
* :mod:`.metrics`: the sample-based discrepancies behind the table.
* :mod:`.stein`: :func:`stein_discrepancy`, how far any draws (an implicit guide's,
  particles, NUTS's) are from the posterior, from the model's score alone: no NUTS needed.
* :mod:`.importance`: PSIS for guides with a log-density: :func:`psis_diagnostic`
  (k-hat), :func:`importance_weights` and :func:`importance_refine`.
* :mod:`.draws`: :func:`posterior_draws` from any fitted approximation.
* :mod:`.methods`: the method registry :data:`METHODS` (what ``compare`` and the command
  line build by name); :mod:`.results`: :class:`MethodResult` and
  :class:`ComparisonResult`.
* :mod:`.nuts`: :func:`run_nuts`, the reference sampler.
* :mod:`.memory`: :class:`PeakMemory`, the peak-memory column of comparisons and benchmarks.
* :mod:`.arviz`: :func:`to_inference_data` for NUTS, guides, particles and draws, so
  ``az.summary``, ``az.loo`` and ``az.compare`` work on every method.
* :mod:`.plots`: pair plots over NUTS, loss curves, regression predictive bands
  (matplotlib, imported only when a plot is made).
"""

from .arviz import comparison_to_inference_data, predictive_samples, to_inference_data
from .compare import compare
from .draws import posterior_draws
from .importance import (
    ImportanceResult,
    UnreliableFitWarning,
    UnreliableWeightsError,
    importance_refine,
    importance_weights,
    psis_diagnostic,
)
from .memory import PeakMemory
from .methods import METHODS
from .metrics import compare_samples
from .nuts import NUTSResult, run_nuts
from .results import ComparisonResult, MethodResult
from .stein import SteinDiscrepancy, stein_discrepancy

__all__ = [
    "METHODS",
    "ComparisonResult",
    "ImportanceResult",
    "MethodResult",
    "NUTSResult",
    "PeakMemory",
    "SteinDiscrepancy",
    "UnreliableFitWarning",
    "UnreliableWeightsError",
    "compare",
    "compare_samples",
    "comparison_to_inference_data",
    "importance_refine",
    "importance_weights",
    "posterior_draws",
    "predictive_samples",
    "psis_diagnostic",
    "run_nuts",
    "stein_discrepancy",
    "to_inference_data",
]
