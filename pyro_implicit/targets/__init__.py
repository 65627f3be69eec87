"""Unnormalised densities written as Pyro models, for checking samplers on known targets.

:func:`~pyro_implicit.targets.base.density_model` turns a log-density into a Pyro model
whose posterior is exactly that density. The toy targets of the papers live in one module
each (e.g. ``pyro_implicit.targets.energy`` for GPVI's 2-D energy potentials), and
``pyro_implicit.targets.conjugate`` holds conjugate models with exact posteriors, on which
every method's defaults are checked.
"""

from .base import density_model
from .sivi import SIVI_TOY_TARGETS, toy_distribution, toy_model

__all__ = ["SIVI_TOY_TARGETS", "density_model", "toy_distribution", "toy_model"]
