r"""The four 2-D energy potentials of GPVI's density-estimation figures (Ratzlaff et al. 2021,
App. D.1, Figs. 4-7) as Pyro models.

The potentials are Rezende & Mohamed's (2015, Table 1), :math:`p(z) \propto e^{-U(z)}`, with
:math:`w_1(z) = \sin(2\pi z_1 / 4)`, :math:`w_2(z) = 3 \exp(-\tfrac12((z_1 - 1)/0.6)^2)`,
:math:`w_3(z) = 3\,\sigma((z_1 - 1)/0.3)`:

================= ==========================================================================
name              potential
================= ==========================================================================
``twin_moons``    :math:`U_1 = \tfrac12((\|z\| - 2)/0.4)^2 - \ln(e^{-\frac12((z_1-2)/0.6)^2} +
                  e^{-\frac12((z_1+2)/0.6)^2})`
``sinusoid``      :math:`U_2 = \tfrac12((z_2 - w_1)/0.4)^2`
``sin_bisect``    :math:`U_3 = -\ln(e^{-\frac12((z_2 - w_1)/0.35)^2} +
                  e^{-\frac12((z_2 - w_1 + w_2)/0.35)^2})`
``sin_split``     :math:`U_4 = -\ln(e^{-\frac12((z_2 - w_1)/0.4)^2} +
                  e^{-\frac12((z_2 - w_1 + w_3)/0.35)^2})`
================= ==========================================================================

The paper names the figures but gives no formulas; the name-to-formula mapping above is an
assumption (Twin Moons = U1 and Sinusoid = U2 are clear from the shapes; Sin Bisect /
Sin Split = U3 / U4 is a guess).

**Confinement.** :math:`U_2, U_3, U_4` do not grow in :math:`z_1`, so :math:`e^{-U}` is not
normalisable on :math:`\mathbb R^2`; Rezende & Mohamed (and the GPVI figures) show them on
the box :math:`[-4, 4]^2`. Every potential here adds a soft wall
:math:`\tfrac12(\max(|z_1| - 4, 0)/0.25)^2`, which is zero inside the box, so the density
is proper and unchanged on the plotted region (``wall=False`` removes it; ``U_1`` is
proper without it).
"""

import math

import torch

from .base import density_model

__all__ = ["ENERGY_POTENTIALS", "energy_log_density", "energy_model", "energy_potential"]

#: name -> figure number in the GPVI paper
ENERGY_POTENTIALS = {"twin_moons": 4, "sinusoid": 5, "sin_bisect": 6, "sin_split": 7}

#: half-width of the box the potentials are shown on, and the soft wall's length scale
BOX_HALF_WIDTH = 4.0
_WALL_SCALE = 0.25


def _w1(z):
    return torch.sin(2 * math.pi * z[..., 0] / 4)


def _w2(z):
    return 3 * torch.exp(-0.5 * ((z[..., 0] - 1) / 0.6) ** 2)


def _w3(z):
    return 3 * torch.sigmoid((z[..., 0] - 1) / 0.3)


def _log_two_bumps(a, b):
    # -U = ln(exp(a) + exp(b)), evaluated stably
    return torch.logaddexp(a, b)


def energy_potential(name):
    """The potential :math:`U(z)` named ``name``, mapping ``(..., 2)`` to ``(...)``.

    :param str name: a key of :data:`ENERGY_POTENTIALS`.
    """

    def twin_moons(z):
        radius = z.norm(dim=-1)
        modes = _log_two_bumps(
            -0.5 * ((z[..., 0] - 2) / 0.6) ** 2, -0.5 * ((z[..., 0] + 2) / 0.6) ** 2
        )
        return 0.5 * ((radius - 2) / 0.4) ** 2 - modes

    def sinusoid(z):
        return 0.5 * ((z[..., 1] - _w1(z)) / 0.4) ** 2

    def sin_bisect(z):
        r = z[..., 1] - _w1(z)
        return -_log_two_bumps(-0.5 * (r / 0.35) ** 2, -0.5 * ((r + _w2(z)) / 0.35) ** 2)

    def sin_split(z):
        r = z[..., 1] - _w1(z)
        return -_log_two_bumps(-0.5 * (r / 0.4) ** 2, -0.5 * ((r + _w3(z)) / 0.35) ** 2)

    potentials = {
        "twin_moons": twin_moons,
        "sinusoid": sinusoid,
        "sin_bisect": sin_bisect,
        "sin_split": sin_split,
    }
    try:
        return potentials[name]
    except KeyError:
        raise ValueError(
            f"unknown energy potential {name!r}; choose from {sorted(ENERGY_POTENTIALS)}"
        ) from None


def energy_log_density(name, wall=True):
    r"""The unnormalised log-density :math:`-U(z)` (minus the soft wall, see the module
    docstring), mapping ``(..., 2)`` to ``(...)``."""
    potential = energy_potential(name)

    def log_density(z):
        value = -potential(z)
        if wall:
            excess = (z[..., 0].abs() - BOX_HALF_WIDTH).clamp(min=0)
            value = value - 0.5 * (excess / _WALL_SCALE) ** 2
        return value

    log_density.__name__ = name
    return log_density


def energy_model(name, wall=True):
    """A Pyro model (no arguments) whose posterior over the 2-D site ``"z"`` is the energy
    potential ``name`` (built with :func:`~pyro_implicit.targets.base.density_model`).

    :param str name: a key of :data:`ENERGY_POTENTIALS`.
    :param bool wall: add the soft wall at :math:`|z_1| = 4` (see the module docstring).
    """
    return density_model(energy_log_density(name, wall), 2, name="z")
