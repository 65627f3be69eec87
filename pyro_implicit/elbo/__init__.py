"""Losses (Pyro ``ELBO`` subclasses) that estimate what an implicit guide cannot evaluate."""

from .base import ImplicitELBO, VectorizationError, check_vectorized_log_joint
from .kernel_ratio import KernelRatioELBO, kernel_kl, kernel_log_ratio

__all__ = [
    "ImplicitELBO",
    "KernelRatioELBO",
    "VectorizationError",
    "check_vectorized_log_joint",
    "kernel_kl",
    "kernel_log_ratio",
]
