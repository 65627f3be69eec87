"""Implicit, semi-implicit, linearised and particle posteriors for any Pyro model.

The public API is re-exported here; each name lives in one module with its paper reference.
"""

import logging

from . import kernels
from .elbo import KernelRatioELBO, VectorizationError
from .guides import ImplicitAutoGuide, ImplicitGuide

__version__ = "0.1.0"

logging.getLogger("pyro_implicit").addHandler(logging.NullHandler())

__all__ = [
    "ImplicitAutoGuide",
    "ImplicitGuide",
    "KernelRatioELBO",
    "VectorizationError",
    "kernels",
]
