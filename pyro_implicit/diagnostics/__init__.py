"""Checking a posterior approximation against NUTS.

* :mod:`.compare`: :func:`compare` fits methods (or takes fitted ones) and scores each
  against NUTS in one :class:`ComparisonResult` (table, DataFrame, JSON-able dict).
* :mod:`.metrics`: the sample-based discrepancies behind the table.
* :mod:`.nuts`: :func:`run_nuts`, the reference sampler.
* :mod:`.memory`: :class:`PeakMemory`, the peak-memory column of comparisons and benchmarks.
* :mod:`.arviz`: :func:`to_inference_data` for NUTS, guides, particles and draws, so
  ``az.summary``, ``az.loo`` and ``az.compare`` work on every method.
* :mod:`.plots`: pair plots over NUTS, loss curves, regression predictive bands
  (matplotlib, imported only when a plot is made).
"""

from .arviz import comparison_to_inference_data, predictive_samples, to_inference_data
from .compare import METHODS, ComparisonResult, MethodResult, compare, posterior_draws
from .memory import PeakMemory
from .metrics import compare_samples
from .nuts import NUTSResult, run_nuts

__all__ = [
    "METHODS",
    "ComparisonResult",
    "MethodResult",
    "NUTSResult",
    "PeakMemory",
    "compare",
    "compare_samples",
    "comparison_to_inference_data",
    "posterior_draws",
    "predictive_samples",
    "run_nuts",
    "to_inference_data",
]
