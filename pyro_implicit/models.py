r"""Built-in example models with their data embedded, for demos, tests and the command line.

Each entry of :data:`BUILTIN_MODELS` is a function with no required arguments returning a
:class:`BuiltinModel`: the Pyro model, the arguments to call it with (tensors built in the
current default dtype, so a float64 run gets float64 data) and its plate nesting. Every
model is vectorisation-safe: latent values may carry extra leading batch dims (a particle
or sample plate), so it works with :class:`~pyro_implicit.elbo.KernelRatioELBO`, Pyro's
vectorised ``Trace_ELBO`` and ``Predictive(parallel=True)``.

Usage::

    from pyro_implicit.models import load_model

    m = load_model("eight_schools")
    m.model(*m.args, **m.kwargs)          # one prior-predictive run
"""

import dataclasses
from collections.abc import Callable

import pyro
import pyro.distributions as dist
import torch

__all__ = ["BUILTIN_MODELS", "BuiltinModel", "banana", "eight_schools", "load_model"]


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A model with the data to condition it on.

    :ivar str name: registry key.
    :ivar callable model: the Pyro model.
    :ivar tuple args: positional arguments of ``model``.
    :ivar dict kwargs: keyword arguments of ``model``.
    :ivar int max_plate_nesting: number of plates the model nests (for ELBOs and NUTS).
    :ivar str description: one line saying what the model is.
    """

    name: str
    model: Callable
    args: tuple
    kwargs: dict
    max_plate_nesting: int
    description: str


# ---------------------------------------------------------------------------------------
# eight schools
# ---------------------------------------------------------------------------------------

#: estimated SAT-coaching effects of the eight schools (Rubin 1981; Gelman et al., BDA 5.5)
EIGHT_SCHOOLS_Y = (28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0)
#: their standard errors
EIGHT_SCHOOLS_SIGMA = (15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0)


def eight_schools_model(y, sigma):
    r"""Eight schools, non-centred parameterisation:

    .. math::
        \mu \sim \mathcal N(0, 5^2), \quad \tau \sim \mathrm{HalfCauchy}(5), \quad
        \tilde\theta_j \sim \mathcal N(0, 1), \quad
        y_j \sim \mathcal N(\mu + \tau \tilde\theta_j, \sigma_j^2), \quad j = 1..8.

    :param torch.Tensor y: ``(J,)`` observed effects.
    :param torch.Tensor sigma: ``(J,)`` their known standard errors.
    """
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", y.shape[-1], dim=-1):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        # mu and tau are (..., 1) under a particle plate, theta_tilde (..., J): broadcasting
        # keeps particles apart.
        pyro.sample("obs", dist.Normal(mu + tau * theta_tilde, sigma), obs=y)


def eight_schools():
    """The eight-schools hierarchical model with its classic data (10 latent coordinates:
    ``mu``, ``tau``, ``theta_tilde[0..7]``).

    :rtype: BuiltinModel
    """
    dtype = torch.get_default_dtype()
    return BuiltinModel(
        name="eight_schools",
        model=eight_schools_model,
        args=(torch.tensor(EIGHT_SCHOOLS_Y, dtype=dtype),
              torch.tensor(EIGHT_SCHOOLS_SIGMA, dtype=dtype)),
        kwargs={},
        max_plate_nesting=1,
        description="eight schools (non-centred; mu, tau, theta_tilde[8]: D = 10)",
    )


# ---------------------------------------------------------------------------------------
# banana
# ---------------------------------------------------------------------------------------


def banana_model(a=2.0, b=0.25):
    r"""A 2-D banana-shaped ("twisted Gaussian", Haario et al. 1999) target written as a
    Normal with a transformed mean:

    .. math::
        x_1 \sim \mathcal N(0, a^2), \qquad x_2 \mid x_1 \sim \mathcal N(b (x_1^2 - a^2), 1),

    i.e. :math:`\log p(x_1, x_2) = -\frac{x_1^2}{2a^2} - \frac{(x_2 - b(x_1^2 - a^2))^2}{2}
    + \mathrm{const}`. Both marginal means are 0; :math:`x_1` and :math:`x_2` are
    uncorrelated but strongly dependent, so a Gaussian approximation cannot bend with it.
    There are no observations: the "posterior" is this density.

    :param float a: scale of :math:`x_1`.
    :param float b: curvature (0 gives an axis-aligned Gaussian).
    """
    x1 = pyro.sample("x1", dist.Normal(0.0, a))
    pyro.sample("x2", dist.Normal(b * (x1.pow(2) - a**2), 1.0))


def banana(a=2.0, b=0.25):
    """The banana target of :func:`banana_model` (2 latent coordinates).

    :rtype: BuiltinModel
    """
    return BuiltinModel(
        name="banana",
        model=banana_model,
        args=(),
        kwargs={"a": float(a), "b": float(b)},
        max_plate_nesting=0,
        description=f"2-D banana: x1 ~ N(0, {a:g}^2), x2 | x1 ~ N({b:g} (x1^2 - {a:g}^2), 1)",
    )


#: name -> function returning a :class:`BuiltinModel`
BUILTIN_MODELS = {
    "eight_schools": eight_schools,
    "banana": banana,
}


def load_model(name):
    """The built-in model called ``name``.

    :param str name: a key of :data:`BUILTIN_MODELS`.
    :rtype: BuiltinModel
    :raises KeyError: for an unknown name; the message lists the choices.
    """
    try:
        factory = BUILTIN_MODELS[name]
    except KeyError:
        raise KeyError(
            f"unknown model {name!r}; choose one of: {', '.join(BUILTIN_MODELS)}"
        ) from None
    return factory()
