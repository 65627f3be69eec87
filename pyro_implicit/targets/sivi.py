r"""The toy targets of SIVI (Yin & Zhou 2018, Sec. 5.1, Table 1, Fig. 1) as Pyro models.

Each target is a normalised density :math:`p(z)` with an exact sampler. :func:`toy_model`
writes it as a Pyro model whose posterior is :math:`p` (a reference prior plus a
``pyro.factor``, see :func:`~pyro_implicit.targets.base.density_model`); the Gamma target
lives on :math:`z > 0`, so its latent site has positive support and a guide sees it
through ``biject_to`` (a Gaussian conditional in :math:`\log z` is the paper's log-normal
conditional).

Targets (second arguments of :math:`\mathcal N` are variances):

=============== ===== ===============================================================
name            dim   density
=============== ===== ===============================================================
``laplace``     1     :math:`\mathrm{Laplace}(0, b = 2)`, :math:`\tfrac14 e^{-|z|/2}`
``gmm1d``       1     :math:`0.3\,\mathcal N(-2, 1) + 0.7\,\mathcal N(2, 1)`
``gamma``       1     :math:`\mathrm{Gamma}(2, 1)`, :math:`z e^{-z}` on :math:`z > 0`
``gmm2d``       2     :math:`0.5\,\mathcal N((-2, 0), I) + 0.5\,\mathcal N((2, 0), I)`
``banana``      2     :math:`z_2 \sim \mathcal N(0, 4)`, :math:`z_1 \mid z_2 \sim
                      \mathcal N(z_2^2/4, 1)`
``xshape``      2     :math:`0.5\,\mathcal N(0, [[2, 1.8], [1.8, 2]]) +
                      0.5\,\mathcal N(0, [[2, -1.8], [-1.8, 2]])`
=============== ===== ===============================================================

The 2-D mixture means are :math:`(\pm 2, 0)` (the paper writes :math:`\pm 2`; the
authors' code uses :math:`(\pm 2, 0)`); the banana follows the paper's axes.
"""

import pyro
import pyro.distributions as dist
import torch

from .base import density_model

__all__ = ["SIVI_TOY_TARGETS", "toy_distribution", "toy_model"]

#: name -> dimension, in the order of the paper's Table 1
SIVI_TOY_TARGETS = {
    "laplace": 1,
    "gmm1d": 1,
    "gamma": 1,
    "gmm2d": 2,
    "banana": 2,
    "xshape": 2,
}


class _Banana(dist.TorchDistribution):
    """:math:`z_2 \\sim \\mathcal N(0, 4)`, :math:`z_1 \\mid z_2 \\sim \\mathcal N(z_2^2/4,
    1)` on :math:`(z_1, z_2)`."""

    arg_constraints = {}
    support = dist.constraints.real_vector

    def __init__(self, dtype=None):
        self._dtype = dtype or torch.get_default_dtype()
        super().__init__(torch.Size(), torch.Size([2]), validate_args=False)

    def sample(self, sample_shape=()):
        z2 = 2.0 * torch.randn(sample_shape, dtype=self._dtype)
        z1 = z2.pow(2) / 4 + torch.randn(sample_shape, dtype=self._dtype)
        return torch.stack([z1, z2], -1)

    def log_prob(self, z):
        z1, z2 = z[..., 0], z[..., 1]
        return dist.Normal(0.0, 2.0).log_prob(z2) + dist.Normal(z2.pow(2) / 4, 1.0).log_prob(z1)


def _mixture(weights, components):
    dtype = torch.get_default_dtype()
    return dist.MixtureSameFamily(dist.Categorical(torch.tensor(weights, dtype=dtype)), components)


def toy_distribution(name):
    """The exact target as a distribution (``sample`` and ``log_prob``; event shape
    ``(dim,)``).

    :param str name: a key of :data:`SIVI_TOY_TARGETS`.
    """
    t = torch.get_default_dtype()
    if name == "laplace":
        return dist.Laplace(torch.zeros(1, dtype=t), 2.0).to_event(1)
    if name == "gmm1d":
        comps = dist.Normal(torch.tensor([[-2.0], [2.0]], dtype=t), 1.0).to_event(1)
        return _mixture([0.3, 0.7], comps)
    if name == "gamma":
        return dist.Gamma(torch.full((1,), 2.0, dtype=t), 1.0).to_event(1)
    if name == "gmm2d":
        comps = dist.Normal(torch.tensor([[-2.0, 0.0], [2.0, 0.0]], dtype=t), 1.0).to_event(1)
        return _mixture([0.5, 0.5], comps)
    if name == "banana":
        return _Banana(t)
    if name == "xshape":
        cov = torch.tensor([[[2.0, 1.8], [1.8, 2.0]], [[2.0, -1.8], [-1.8, 2.0]]], dtype=t)
        return _mixture([0.5, 0.5], dist.MultivariateNormal(torch.zeros(2, 2, dtype=t), cov))
    raise ValueError(f"unknown SIVI toy target {name!r}; choose from {list(SIVI_TOY_TARGETS)}")


def toy_model(name):
    """A Pyro model (no arguments, one latent site ``"z"`` of shape ``(dim,)``) whose
    posterior is the named target of Yin & Zhou (2018), Table 1.

    Real-valued targets use :func:`~pyro_implicit.targets.base.density_model`; the Gamma
    target draws ``z`` from a ``LogNormal(0, 1)`` reference (positive support) and adds
    ``log p(z) - log r(z)`` as a ``pyro.factor``. The models broadcast over particle plates.
    """
    target = toy_distribution(name)
    if name != "gamma":
        return density_model(target.log_prob, SIVI_TOY_TARGETS[name], name="z")

    def model():
        reference = dist.LogNormal(torch.zeros(()), 1.0).expand([1]).to_event(1)
        z = pyro.sample("z", reference)
        pyro.factor("z_target", target.log_prob(z) - reference.log_prob(z))

    model.__doc__ = "Posterior over ``z`` (1-D, positive) equal to Gamma(2, 1)."
    return model
