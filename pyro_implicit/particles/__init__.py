"""Particle posteriors: weight-space SVGD and function-space particle optimisation (f-POVI).

* :class:`WeightSpaceSVGD`: SVGD (and w-SGLD, pi-SGLD, GFSF) on a Pyro model's packed
  unconstrained latents, particle-major, in :math:`O(N^2 + N D)` memory;
* :class:`FunctionSpaceSVGD`: the same particles, moved by a function-space update pulled
  back through the network (Wang, Ren, Zhu & Zhang, ICLR 2019);
* :mod:`~pyro_implicit.particles.prior_score`: function-space prior score estimators.
"""

from .function_svgd import FunctionSpaceSVGD, KDEInputs
from .prior_score import GaussianPriorScore, GPPriorScore, RBFCovariance, moment_matched_score
from .svgd import METHODS, ParticleInference, SteinDirection, WeightSpaceSVGD, stein_direction

__all__ = [
    "METHODS",
    "FunctionSpaceSVGD",
    "GPPriorScore",
    "GaussianPriorScore",
    "KDEInputs",
    "ParticleInference",
    "RBFCovariance",
    "SteinDirection",
    "WeightSpaceSVGD",
    "moment_matched_score",
    "stein_direction",
]
