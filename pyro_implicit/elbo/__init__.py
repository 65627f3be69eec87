"""Losses (Pyro ``ELBO`` subclasses) that estimate what an implicit guide cannot evaluate."""

from .base import (
    DivergenceError,
    ImplicitELBO,
    VectorizationError,
    check_guide_covers_model,
    check_observed_finite,
    check_vectorized_log_joint,
)
from .gpvi import GPVI_ELBO, AmortizedSVGD_ELBO
from .kernel_ratio import KernelRatioELBO, kernel_kl, kernel_log_ratio
from .livi import LIVI_ELBO, jacobian, linearized_entropy, smallest_singular_value
from .sivi import SIVI_ELBO, linear_schedule
from .stein_score import (
    SteinScoreELBO,
    default_num_particles,
    default_residual_kernel,
    sample_score,
    stein_residual_score,
)

__all__ = [
    "AmortizedSVGD_ELBO",
    "DivergenceError",
    "GPVI_ELBO",
    "ImplicitELBO",
    "KernelRatioELBO",
    "LIVI_ELBO",
    "SIVI_ELBO",
    "SteinScoreELBO",
    "VectorizationError",
    "check_guide_covers_model",
    "check_observed_finite",
    "check_vectorized_log_joint",
    "default_num_particles",
    "default_residual_kernel",
    "jacobian",
    "kernel_kl",
    "kernel_log_ratio",
    "linear_schedule",
    "linearized_entropy",
    "sample_score",
    "smallest_singular_value",
    "stein_residual_score",
]
