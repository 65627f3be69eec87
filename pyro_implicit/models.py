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

__all__ = [
    "BUILTIN_MODELS",
    "BuiltinModel",
    "banana",
    "eight_schools",
    "load_model",
    "logistic_regression_model",
    "waveform_logistic",
    "yacht_bnn",
]


@dataclasses.dataclass(frozen=True)
class BuiltinModel:
    """A model with the data to condition it on.

    :ivar str name: registry key.
    :ivar callable model: the Pyro model.
    :ivar tuple args: positional arguments of ``model``.
    :ivar dict kwargs: keyword arguments of ``model``.
    :ivar int max_plate_nesting: number of plates the model nests (for ELBOs and NUTS);
        ``None`` (allowed for user models) means: guess it from one model run.
    :ivar str description: one line saying what the model is.
    :ivar dict extras: anything else a plot or report may use (e.g. the BNN object and its
        test split for predictive bands); empty for most models.
    """

    name: str
    model: Callable
    args: tuple
    kwargs: dict
    max_plate_nesting: int
    description: str
    extras: dict = dataclasses.field(default_factory=dict)


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
    zero = y.new_zeros(())  # the priors on the data's device and dtype
    mu = pyro.sample("mu", dist.Normal(zero, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(zero + 5.0))
    with pyro.plate("schools", y.shape[-1], dim=-1):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(zero, 1.0))
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
        args=(
            torch.tensor(EIGHT_SCHOOLS_Y, dtype=dtype),
            torch.tensor(EIGHT_SCHOOLS_SIGMA, dtype=dtype),
        ),
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


# ---------------------------------------------------------------------------------------
# Bayesian logistic regression on waveform
# ---------------------------------------------------------------------------------------


def logistic_regression_model(x, y=None, prior_scale=10.0):
    r"""Bayesian logistic regression, written to broadcast over particle plates:

    .. math::
        \beta \sim \mathcal N(0, s^2 I_D), \qquad
        y_i \sim \mathrm{Bernoulli}(\sigma(x_i^\top \beta)), \quad i = 1..n.

    The intercept, if any, is a column of ones in ``x``.

    :param torch.Tensor x: ``(n, D)`` features.
    :param torch.Tensor y: ``(n,)`` labels in {0, 1}; ``None`` samples them.
    :param float prior_scale: prior standard deviation :math:`s` of every coefficient.
    """
    beta = pyro.sample(
        "beta", dist.Normal(x.new_zeros(()), prior_scale).expand([x.shape[-1]]).to_event(1)
    )
    with pyro.plate("data", x.shape[0], dim=-1):
        # beta is (..., 1, D) under a particle plate: an elementwise product and a sum keep
        # particles apart, where beta @ x.T would mix them.
        logits = (x * beta).sum(-1)
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)


def waveform_logistic():
    """Bayesian logistic regression on the SIVI paper's waveform set (400 training points,
    21 features plus an intercept: ``beta`` has D = 22), prior ``N(0, 100)`` (variance) per
    coefficient as in the SIVI paper (Yin & Zhou 2018, Sec. 4.2).

    Reads ``sivi/waveform.mat`` from the data folder (needs scipy), see
    :func:`pyro_implicit.datasets.load_waveform`.

    :rtype: BuiltinModel
    :raises FileNotFoundError: if the data folder or file is missing.
    """
    from .datasets import load_waveform

    data = load_waveform(dtype=torch.get_default_dtype())
    return BuiltinModel(
        name="waveform_logistic",
        model=logistic_regression_model,
        args=(data.x_train, data.y_train),
        kwargs={"prior_scale": 10.0},
        max_plate_nesting=1,
        description="Bayesian logistic regression on waveform (n = 400, beta[22], "
        "prior N(0, 10^2))",
        extras={"x_test": data.x_test, "y_test": data.y_test},
    )


# ---------------------------------------------------------------------------------------
# a small BNN on yacht
# ---------------------------------------------------------------------------------------

#: hidden width of :func:`yacht_bnn`: small enough for NUTS to finish in minutes
YACHT_HIDDEN = 10


def yacht_bnn(split=0, hidden=YACHT_HIDDEN):
    """A one-hidden-layer BNN regression (:class:`~pyro_implicit.bnn.BNNRegression`, tanh,
    ``N(0, 1)`` weights, ``Gamma(6, 6)`` noise precision) on split ``split`` of UCI yacht
    (277 training points, 6 features; standardised). With ``hidden=10`` the latent has
    ``7*10 + 11*1 + 1 = 82`` coordinates. tanh rather than ReLU: a smooth likelihood keeps
    NUTS's trajectories short.

    Reads ``uci/yacht`` from the data folder, see :func:`pyro_implicit.datasets.load_uci`.

    :param int split: which of the 20 standard splits.
    :param int hidden: hidden-layer width.
    :rtype: BuiltinModel
    :raises FileNotFoundError: if the data folder or files are missing.
    """
    from .bnn import BNNRegression
    from .datasets import load_uci

    data = load_uci("yacht", split, dtype=torch.get_default_dtype())
    bnn = BNNRegression(data.in_dim, hidden_dims=(hidden,), activation="tanh")
    return BuiltinModel(
        name="yacht_bnn",
        model=bnn,
        args=(data.x_train, data.y_train),
        kwargs={},
        max_plate_nesting=1,
        description=f"BNN regression on UCI yacht split {split} (n = {data.n_train}, "
        f"{data.in_dim}-{hidden}-1 tanh, D = {bnn.num_weights + 1})",
        extras={"bnn": bnn, "x_test": data.x_test, "y_test": data.y_test, "y_std": data.y_std},
    )


#: name -> function returning a :class:`BuiltinModel`
BUILTIN_MODELS = {
    "eight_schools": eight_schools,
    "banana": banana,
    "waveform_logistic": waveform_logistic,
    "yacht_bnn": yacht_bnn,
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
