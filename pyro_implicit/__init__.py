"""Implicit, semi-implicit, linearised and particle posteriors for any Pyro model.

The public API is re-exported here; each name lives in one module with its paper reference.
"""

import logging

from . import contract, errors, kernels, particles, reparam
from .elbo import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    KernelRatioELBO,
    SteinScoreELBO,
    VectorizationError,
)
from .errors import (
    DataError,
    DivergenceError,
    FewParticlesWarning,
    LabelSwitchingWarning,
    ModelError,
    MultimodalPosteriorWarning,
    PairingError,
    PyroImplicitError,
    RunawayWarning,
    UnsupportedModelError,
    UnsupportedPairError,
)
from .guides import (
    ImplicitAutoGuide,
    ImplicitGuide,
    LinearizedGuide,
    SemiImplicitEncoder,
    SemiImplicitGuide,
)
from .latent import LatentSpace, Preconditioner, PreconditionerWarning
from .modes import ModeMixture, fit_per_mode
from .particles import FunctionSpaceSVGD, WeightSpaceSVGD

__version__ = "0.1.0"

logging.getLogger("pyro_implicit").addHandler(logging.NullHandler())

__all__ = [
    "DataError",
    "DivergenceError",
    "FewParticlesWarning",
    "LabelSwitchingWarning",
    "ModeMixture",
    "ModelError",
    "MultimodalPosteriorWarning",
    "PairingError",
    "PyroImplicitError",
    "RunawayWarning",
    "UnsupportedModelError",
    "UnsupportedPairError",
    "contract",
    "errors",
    "AmortizedSVGD_ELBO",
    "GPVI_ELBO",
    "FunctionSpaceSVGD",
    "WeightSpaceSVGD",
    "particles",
    "reparam",
    "ImplicitAutoGuide",
    "ImplicitGuide",
    "KernelRatioELBO",
    "LIVI_ELBO",
    "LatentSpace",
    "LinearizedGuide",
    "Preconditioner",
    "PreconditionerWarning",
    "SIVI_ELBO",
    "SemiImplicitEncoder",
    "SemiImplicitGuide",
    "SteinScoreELBO",
    "VectorizationError",
    "kernels",
    "fit_per_mode",
]
