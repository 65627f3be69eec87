"""Guides whose packed latent comes from a sampler instead of a density."""

from .amortized import SemiImplicitEncoder
from .base import ImplicitAutoGuide, ImplicitDelta
from .implicit import ImplicitGuide, SkipGenerator, gpvi_generator
from .linearized import LinearizedGuide
from .networks import BlockGenerator, MatrixGenerator, MLPGenerator
from .scalable import CorrelatedMatrixGenerator
from .semi_implicit import SemiImplicitGuide

__all__ = [
    "BlockGenerator",
    "CorrelatedMatrixGenerator",
    "ImplicitAutoGuide",
    "ImplicitDelta",
    "ImplicitGuide",
    "LinearizedGuide",
    "MLPGenerator",
    "MatrixGenerator",
    "SemiImplicitEncoder",
    "SemiImplicitGuide",
    "SkipGenerator",
    "gpvi_generator",
]
