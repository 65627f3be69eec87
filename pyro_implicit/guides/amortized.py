r"""``SemiImplicitEncoder``: an amortised semi-implicit posterior for local latents (SIVAE).

Yin & Zhou (2018), *Semi-Implicit Variational Inference*, Sec. 4 (eq. 12) and App. C. For
a data point :math:`x` the encoder injects noise into a network that also sees :math:`x`,

.. math::
    \ell_t = T_t(\ell_{t-1}, \epsilon_t, x),\ \epsilon_t \sim \mathcal N(0, I),\
    t = 1..M, \qquad \psi(x) = f(\ell_M, x), \qquad
    z \mid \psi \sim \mathcal N\big(\psi(x),\ \mathrm{diag}\,\sigma^2(x)\big),

so :math:`h(z \mid x) = \mathbb E_\psi q(z \mid \psi, x)` is semi-implicit. As in the
authors' code the conditional scale :math:`\sigma(x)` comes from a separate deterministic
network (it is not mixed), and, unlike the paper's binary salt-and-pepper noise, the
injected noise is Gaussian (any reparameterisable noise is allowed by Sec. 2.2).

Use it inside a hand-written guide, in the same plates as the model's local latent::

    encoder = SemiImplicitEncoder(data_dim=784, latent_dim=32)

    def guide(x, batch_size=None):
        pyro.module("encoder", encoder)
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            encoder.sample("z", x[idx])

and train it with :class:`~pyro_implicit.elbo.SIVI_ELBO`, which reads the generating
:math:`\psi` from the trace, draws K extra :math:`\psi^{(k)}` **per data point** with
:meth:`SemiImplicitEncoder.sample_mixing` and applies the plate's subsampling scale to
:math:`\log \tilde h_K(z \mid x)`. Only real-valued latents (e.g. a ``Normal`` prior) are
supported: the sample is the model's value itself.
"""

import math

import pyro
import pyro.distributions as dist
import torch
from torch import nn

from .base import IMPLICIT_FLAG, ImplicitDelta
from .networks import _activation

__all__ = ["SemiImplicitEncoder"]

_HINT = "Train a SemiImplicitEncoder with SIVI_ELBO (Yin & Zhou 2018, eq. 9)"


def _mlp(in_dim, hidden_dims, out_dim, activation):
    layers, width = [], in_dim
    for h in hidden_dims:
        layers += [nn.Linear(width, h), _activation(activation)]
        width = h
    layers.append(nn.Linear(width, out_dim))
    return nn.Sequential(*layers)


class SemiImplicitEncoder(nn.Module):
    r"""Amortised semi-implicit encoder :math:`h(z \mid x)` (Yin & Zhou 2018, eq. 12).

    Stochastic layer t maps :math:`[\ell_{t-1}, \epsilon_t, x]` through an MLP with
    ``hidden_dims`` to :math:`\ell_t` (width ``hidden_dims[-1]``); the last layer's MLP
    outputs the conditional mean :math:`\psi` (``latent_dim``). A deterministic MLP maps
    :math:`x` to :math:`\log \sigma(x)`.

    :param int data_dim: size of a data point x.
    :param int latent_dim: size of z.
    :param tuple noise_dims: sizes of :math:`\epsilon_1..\epsilon_M` (M = its length;
        the paper's App. C uses (150, 100, 50)).
    :param tuple hidden_dims: hidden widths of each stochastic layer's MLP and of the
        scale network.
    :param str activation: hidden activation (ReLU, as the authors' code).
    :param float init_log_scale: initial bias of :math:`\log \sigma(x)`.
    """

    # no "sample": KernelRatioELBO handles packed global latents only, so it must refuse
    capabilities = frozenset({"conditional_density", "local"})

    def __init__(
        self,
        data_dim,
        latent_dim,
        noise_dims=(32, 32),
        hidden_dims=(256,),
        activation="relu",
        init_log_scale=-1.0,
    ):
        super().__init__()
        if not noise_dims or min(noise_dims) < 1:
            raise ValueError(f"noise_dims must be positive sizes, got {noise_dims}")
        if not hidden_dims:
            raise ValueError("hidden_dims needs at least one hidden layer")
        self.data_dim, self.latent_dim = int(data_dim), int(latent_dim)
        self.noise_dims = tuple(int(g) for g in noise_dims)
        hidden_dims = tuple(int(h) for h in hidden_dims)
        width, first = hidden_dims[-1], hidden_dims[0]
        # The first linear map of each stochastic layer is split into an x part and a
        # (previous layer, noise) part: the x part is computed once per data point and
        # shared by all J + K mixing draws of that point (pure linear algebra, same model).
        self.data_inputs = nn.ModuleList()
        self.noise_inputs = nn.ModuleList()
        self.stochastic_layers = nn.ModuleList()
        prev = 0
        for t, g in enumerate(self.noise_dims):
            out = latent_dim if t == len(self.noise_dims) - 1 else width
            self.data_inputs.append(nn.Linear(data_dim, first))
            self.noise_inputs.append(nn.Linear(prev + g, first, bias=False))
            self.stochastic_layers.append(
                nn.Sequential(
                    _activation(activation), _mlp(first, hidden_dims[1:], out, activation)
                )
            )
            prev = out
        self.log_scale_net = _mlp(data_dim, hidden_dims, latent_dim, activation)
        with torch.no_grad():
            self.log_scale_net[-1].weight.mul_(0.1)
            self.log_scale_net[-1].bias.fill_(init_log_scale)

    @property
    def noise_dim(self):
        """Total size of the injected noise :math:`(\\epsilon_1, \\dots, \\epsilon_M)`."""
        return sum(self.noise_dims)

    # ------------------------------------------------------------------ layers
    def mixing(self, eps, x):
        r""":math:`\psi = T_\phi(\epsilon, x)` (eq. 12): ``eps`` ``(..., noise_dim)`` and
        ``x`` ``(..., data_dim)`` (broadcast) to ``(..., latent_dim)``."""
        hidden = eps.new_zeros(eps.shape[:-1] + (0,))
        layers = zip(self.data_inputs, self.noise_inputs, self.stochastic_layers, strict=True)
        for (data_in, noise_in, rest), noise in zip(
            layers, eps.split(self.noise_dims, -1), strict=True
        ):
            hidden = rest(noise_in(torch.cat([hidden, noise], -1)) + data_in(x))
        return hidden

    def log_scale(self, x):
        r""":math:`\log \sigma(x)`, ``(..., latent_dim)``."""
        return self.log_scale_net(x)

    def sample_mixing(self, num_samples, x):
        r"""``(num_samples, *x.shape[:-1], latent_dim)`` independent mixing draws
        :math:`\psi^{(k)}(x)` for every data point (with autograd graph): SIVI's extra
        draws, drawn per data point (digest pitfall 13)."""
        shape = (num_samples,) + x.shape[:-1] + (self.noise_dim,)
        eps = torch.randn(shape, dtype=x.dtype, device=x.device)
        return self.mixing(eps, x)

    def conditional_log_prob(self, z, psi, x):
        r""":math:`\log \mathcal N(z;\ \psi,\ \mathrm{diag}\,\sigma^2(x))` summed over the
        latent coordinates; all arguments broadcast over leading dims."""
        log_sigma = self.log_scale(x)
        white = (z - psi) * torch.exp(-log_sigma)
        return (
            -0.5 * white.pow(2).sum(-1)
            - log_sigma.sum(-1)
            - 0.5 * self.latent_dim * math.log(2 * math.pi)
        )

    # ------------------------------------------------------------------ pyro
    def sample(self, name, x):
        r"""Emit the model's local latent ``name`` for the data points ``x``
        (``(batch, data_dim)``, the current plate's subsample) inside the caller's plates.

        Records the generating :math:`\psi` as the auxiliary site ``_<name>_mixing`` and
        marks ``name`` for :class:`~pyro_implicit.elbo.SIVI_ELBO` (its value has no
        tractable density: ``Trace_ELBO`` refuses it).

        :return: ``z``, shape ``(..., batch, latent_dim)``.
        """
        zero = x.new_zeros(())
        eps = pyro.sample(
            f"_{name}_noise",
            dist.Normal(zero, 1.0).expand([self.noise_dim]).to_event(1).mask(False),
            infer={"is_auxiliary": True},
        )
        psi = self.mixing(eps, x)
        eta = pyro.sample(
            f"_{name}_conditional_noise",
            dist.Normal(zero, 1.0).expand([self.latent_dim]).to_event(1).mask(False),
            infer={"is_auxiliary": True},
        )
        if pyro.poutine.get_mask() is not False:
            psi = pyro.sample(
                f"_{name}_mixing", dist.Delta(psi, event_dim=1), infer={"is_auxiliary": True}
            )
        z = psi + eta * torch.exp(self.log_scale(x))
        info = {
            "guide": self,
            "capabilities": self.capabilities,
            "mixing_site": f"_{name}_mixing",
            "context": x,
            "hint": _HINT,
        }
        return pyro.sample(
            name, ImplicitDelta(z, event_dim=1, hint=_HINT), infer={IMPLICIT_FLAG: info}
        )
