"""Guides whose packed latent comes from a sampler instead of a density."""

from .base import ImplicitAutoGuide, ImplicitDelta
from .implicit import ImplicitGuide
from .networks import BlockGenerator, MatrixGenerator, MLPGenerator

__all__ = [
    "BlockGenerator",
    "ImplicitAutoGuide",
    "ImplicitDelta",
    "ImplicitGuide",
    "MLPGenerator",
    "MatrixGenerator",
]
