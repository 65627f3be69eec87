r"""``SemiImplicitGuide``: a semi-implicit Pyro guide, ``u ~ N(mu(psi), Sigma)``, ``psi = T(eps)``.

Yin & Zhou (2018), *Semi-Implicit Variational Inference* (SIVI), Sec. 2. The packed
unconstrained latent ``u`` of the model (see :mod:`pyro_implicit.guides.base`) is drawn
hierarchically,

.. math::
    \psi = T_\phi(\epsilon),\ \epsilon \sim \mathcal N(0, I_g), \qquad
    u \mid \psi \sim q_\xi(u \mid \psi) = \mathcal N(u;\ \psi,\ \Sigma_\xi),

so the marginal :math:`h_\phi(u) = \mathbb E_{\psi} q_\xi(u \mid \psi)` has no closed form
(the mixing layer :math:`T_\phi` is a neural network, an implicit distribution, eq. 2) but
the conditional is an explicit, reparameterised Gaussian: :math:`u = \psi + \Sigma_\xi^{1/2}
\eta`, :math:`\eta \sim \mathcal N(0, I_D)`. The mixing draw :math:`\psi` is the location of
the conditional (the paper mixes only the location; the covariance :math:`\xi` is a plain
learned parameter, Sec. 3.3 and 5.4). With ``conditional="mixed"`` the mixing layer also
gives each draw its conditional's log-scale, :math:`\psi = (\mu, \rho)` and
:math:`q(u \mid \psi) = \mathcal N(\mu, \mathrm{diag}(\sigma^2 e^{2\rho}))`: the
general :math:`q_\xi(u \mid \psi)` of eq. 2, with the scale mixed too, so that q can
narrow where the posterior does (a funnel's neck).

Trace layout (in addition to the base layout):

* ``_<name>_noise`` holds :math:`(\epsilon, \eta)` concatenated, ``g + D`` values, a masked
  auxiliary site (so outer plates broadcast it);
* ``_<name>_mixing`` holds :math:`\psi` of the draw as an auxiliary
  ``Delta(psi, event_dim=1)``; the latent site's ``infer["pyro_implicit"]["mixing_site"]``
  names it, so :class:`~pyro_implicit.elbo.SIVI_ELBO` can evaluate
  :math:`q(u_j \mid \psi_j)` for the generating :math:`\psi_j`. It is skipped when
  ``poutine.get_mask() is False`` (``Predictive``), where no loss reads it.
"""

import math

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_median
from torch import nn

from ..errors import check_count
from ..kernels import squared_distances
from .base import ImplicitAutoGuide
from .networks import MLPGenerator, shrink_output_rows

__all__ = ["SemiImplicitGuide"]

_CONDITIONALS = ("diagonal", "full", "fixed", "mixed")

#: spread of the mixed log-scale offsets rho at the start, against the locations' spread
_LOG_SCALE_SPREAD = 0.1

# The paper's mixing layers (Table in digest Sec. 5): 10-dim noise and [30, 60, 30] for the
# low-dimensional targets of Sec. 5.1-5.2; 50-dim noise and [100, 200, 100] for Bayesian
# logistic regression (Sec. 5.4, App. B.4).
_SMALL_D, _SMALL_NOISE, _SMALL_HIDDEN = 10, 10, (30, 60, 30)
_LARGE_NOISE, _LARGE_HIDDEN = 50, (100, 200, 100)

_PAIRING_HINT = (
    "Train a SemiImplicitGuide with SIVI_ELBO (the paper's surrogate bound) or with "
    "KernelRatioELBO (which only samples it)"
)


class SemiImplicitGuide(ImplicitAutoGuide):
    r"""Semi-implicit variational posterior over the model's packed unconstrained latent
    (Yin & Zhou 2018, Sec. 2.1-2.2):

    .. math::
        \epsilon \sim \mathcal N(0, I_g),\quad \psi = T_\phi(\epsilon),\quad
        u = \psi + \Sigma_\xi^{1/2}\,\eta,\quad \eta \sim \mathcal N(0, I_D),

    with :math:`T_\phi` an MLP (the implicit *mixing layer*) and a Gaussian *conditional*
    :math:`q_\xi(u \mid \psi) = \mathcal N(\psi, \Sigma_\xi)`. Every model site is
    ``biject_to(support)`` of its slice of ``u``, as in Pyro's ``AutoContinuous``.

    The marginal density is intractable, so train it with
    :class:`~pyro_implicit.elbo.SIVI_ELBO` (the paper's asymptotically exact surrogate,
    eq. 9), which uses :meth:`conditional_log_prob` and :meth:`sample_mixing`; or with
    :class:`~pyro_implicit.elbo.KernelRatioELBO`, which only samples it. Plain
    ``Trace_ELBO`` raises instead of silently dropping the entropy.

    Usage::

        guide = SemiImplicitGuide(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}),
                  SIVI_ELBO(num_particles=50, num_mixing=100))

    :param callable model: a Pyro model with continuous latent sites.
    :param int mixing_noise_dim: :math:`g`, size of the mixing noise :math:`\epsilon`.
        Default: 10 when D <= 10 (the paper's toy and negative-binomial experiments,
        Sec. 5.1-5.2), otherwise 50 (Bayesian logistic regression, App. B.4).
    :param tuple hidden_dims: hidden widths of :math:`T_\phi`. Default: (30, 60, 30) when
        D <= 10 (Sec. 5.1), otherwise (100, 200, 100) (App. B.4).
    :param str activation: activation of :math:`T_\phi` (the paper does not say; the
        authors' code uses ReLU, the default).
    :param str conditional: the conditional covariance :math:`\Sigma_\xi`:
        ``"mixed"`` (:math:`\mathrm{diag}(\sigma^2 e^{2\rho(\epsilon)})`: the mixing layer
        gives each draw a log-scale offset :math:`\rho` beside its location, so
        :math:`\psi = (\mu, \rho)` has 2D entries and the scale is mixed too: eq. 2's
        general :math:`q_\xi(u \mid \psi)`, not the paper's experiments), ``"diagonal"``
        (learned :math:`\mathrm{diag}(\sigma^2)`, the paper's location-only mixing),
        ``"full"`` (learned :math:`LL^\top`, lower-triangular L with positive diagonal; the
        paper's "SIVI-full" for BLR) or ``"fixed"`` (constant :math:`\sigma_0^2 I`, the
        paper's toys, Sec. 5.1, where :math:`\sigma_0^2 = 0.1`). Default (``None``):
        ``"mixed"`` with a preconditioner, ``"diagonal"`` with ``precondition=False`` (the
        paper's raw space and its conditional; until 2026-11-28 always ``"diagonal"``).
        Why "mixed" with a preconditioner: over 12 seeds of the stiff benchmark it is no
        worse than ``AutoMultivariateNormal`` on all eight posteriors, "diagonal" on
        seven (it misses stochastic volatility), and its energy distance to NUTS is lower
        on six of eight (the centred eight schools 0.105 -> 0.035, Neal's funnel 0.204 ->
        0.014); its largest mean error is a little higher on six (the GP 0.076 -> 0.093
        sds, Neal's funnel 0.043 -> 0.140). Why not in the raw space: there the per-draw
        log-scales have no unit scale to start from and can run away (a raw-unit
        regression's fit diverged), and on a correlated BLR it
        ended 0.46 sds off where "diagonal" passed (0.16): ``docs/choosing_settings.md``,
        ``benchmarks/results/sivi_mixed_12seeds.md``, ``exact_defaults_sivi_raw.json``.
    :param float conditional_scale: initial :math:`\sigma` (the constant
        :math:`\sigma_0` for ``"fixed"``). Default ``init_scale / sqrt(2)`` without a
        preconditioner, ``init_scale`` with one.
    :param callable init_loc_fn: per-site initial location (default ``init_to_median``):
        the mixing layer's output is centred there.
    :param float init_scale: initial spread of ``u``: the mixing layer's output starts
        with spread ``init_scale / sqrt(2)`` per coordinate and, by default, so does the
        conditional, so u starts with spread ``init_scale``. With a preconditioner (the
        default) the spread is in its whitened units and the conditional carries it, the
        mixing layer a tenth of it: q starts at the preconditioner's Gaussian. That start
        suits near-Gaussian and stiff posteriors; on small multimodal ones it can stay near
        one Gaussian (the SIVI paper's 2-D targets: 6 of 12 fits at seeds 1-4 against none
        in the raw space, ``benchmarks/results/sivi_toy_start.md``): pass
        ``precondition=False`` there.
    :param int num_quantile_samples: draws behind :meth:`median` and :meth:`quantiles`.

    References

    [1] `Semi-Implicit Variational Inference`, Mingzhang Yin, Mingyuan Zhou, ICML 2018
        (arXiv:1805.11183).
    """

    capabilities = frozenset({"sample", "conditional_density"})

    def __init__(
        self,
        model,
        *,
        mixing_noise_dim=None,
        hidden_dims=None,
        activation="relu",
        conditional=None,
        conditional_scale=None,
        init_loc_fn=init_to_median,
        init_scale=None,
        num_quantile_samples=1000,
        precondition=True,
        parametrization="auto",
    ):
        if conditional is None:
            conditional = "diagonal" if precondition is False else "mixed"
        if conditional not in _CONDITIONALS:
            raise ValueError(f"conditional must be one of {_CONDITIONALS}, got {conditional!r}")
        if mixing_noise_dim is not None:
            check_count("mixing_noise_dim", mixing_noise_dim)
        if conditional_scale is not None and not conditional_scale > 0:
            raise ValueError(f"conditional_scale must be positive, got {conditional_scale}")
        self.conditional = conditional
        self._mixing_noise_dim_arg = mixing_noise_dim
        self._hidden_dims = None if hidden_dims is None else tuple(hidden_dims)
        self._activation = activation
        self._conditional_scale_arg = conditional_scale
        super().__init__(
            model,
            init_loc_fn=init_loc_fn,
            init_scale=init_scale,
            num_quantile_samples=num_quantile_samples,
            precondition=precondition,
            parametrization=parametrization,
        )

    # ------------------------------------------------------------------ building
    def _build_sampler(self, init_loc):
        dim = self.latent_dim
        small = dim <= _SMALL_D
        g = self._mixing_noise_dim_arg or (_SMALL_NOISE if small else _LARGE_NOISE)
        hidden = self._hidden_dims
        if hidden is None:
            hidden = _SMALL_HIDDEN if small else _LARGE_HIDDEN
        mixed = self.conditional == "mixed"
        out_dim = 2 * dim if mixed else dim
        net = MLPGenerator(g, out_dim, hidden, self._activation, scaled=self._scaled_keyword())
        net = net.to(dtype=init_loc.dtype, device=init_loc.device)
        if self.whitened:
            # start at the preconditioner's Gaussian: the conditional carries the spread,
            # the mixing layer a tenth of it (q(z) = N(0, 1.01 init_scale^2 I) at the start)
            mixing_scale = 0.1 * self._init_scale
            sigma = self._conditional_scale_arg or self._init_scale
        else:
            mixing_scale = self._init_scale / math.sqrt(2)
            sigma = self._conditional_scale_arg or self._init_scale / math.sqrt(2)
        if mixed:
            # the log-scale offsets rho start centred at 0 (the conditional's sigma), a
            # tenth as spread as the locations
            net.init_output(
                torch.cat([init_loc.reshape(-1), init_loc.new_zeros(dim)]), mixing_scale
            )
            shrink_output_rows(net, slice(dim, None), _LOG_SCALE_SPREAD)
        else:
            net.init_output(init_loc, mixing_scale)
        self.mixing_net = net
        # plain ints: read on every call, kept off PyroModule's attribute machinery
        self.mixing_noise_dim = int(g)
        self._total_noise_dim = int(g + dim)

        log_scale = torch.full(
            (dim,), math.log(sigma), dtype=init_loc.dtype, device=init_loc.device
        )
        if self.conditional == "fixed":
            self.register_buffer("conditional_log_scale", log_scale)
        else:
            # log-parameterised scale: positive without clamping (digest pitfall 11)
            self.conditional_log_scale = nn.Parameter(log_scale)
        if self.conditional == "full":
            self.conditional_tril = nn.Parameter(torch.zeros_like(log_scale).diag())

    @property
    def noise_dim(self):
        """Size of the whole noise vector :math:`(\\epsilon, \\eta)`: ``g + D``."""
        return self._total_noise_dim

    # ------------------------------------------------------------------ the two layers
    def mixing(self, eps):
        r"""The mixing layer :math:`\psi = T_\phi(\epsilon)`: ``(..., g)`` noise to
        ``(..., D)`` conditional means :math:`\mu(\psi) = \psi` (with autograd graph);
        for ``conditional="mixed"``, ``(..., 2D)``: the means, then the log-scale offsets
        :math:`\rho`."""
        return self.mixing_net(eps)

    def _mixed_loc_log_scale(self, psi):
        r""":math:`(\mu, \log\sigma + \rho)` of a mixed ``psi`` ``(..., 2D)``."""
        dim = self.latent_dim
        return psi[..., :dim], self.conditional_log_scale + psi[..., dim:]

    def sample_mixing(self, num_samples):
        r"""Draw ``(num_samples, D)`` independent mixing values :math:`\psi^{(k)}`
        (``(num_samples, 2D)`` for ``conditional="mixed"``), with autograd graph to
        :math:`\phi`; SIVI's extra draws."""
        self._check_ready()
        ref = self.conditional_log_scale
        eps = torch.randn(num_samples, self.mixing_noise_dim, dtype=ref.dtype, device=ref.device)
        return self.mixing(eps)

    def conditional_scale_tril(self):
        r"""Lower-triangular :math:`L` with :math:`\Sigma_\xi = L L^\top` (``(D, D)``)."""
        if self.conditional == "mixed":
            raise ValueError(
                "conditional='mixed' has a scale per mixing draw, not one Sigma_xi: read "
                "the scales of draws psi = guide.mixing(eps) as "
                "(guide.conditional_log_scale + psi[..., D:]).exp()"
            )
        scale = self.conditional_log_scale.exp()
        if self.conditional == "full":
            return self.conditional_tril.tril(-1) + scale.diag()
        return scale.diag()

    def conditional_covariance(self):
        r""":math:`\Sigma_\xi`, ``(D, D)``."""
        tril = self.conditional_scale_tril()
        return tril @ tril.T

    def _whiten(self, x):
        """``L^{-1} x`` over the last dim of ``x`` (any leading shape)."""
        if self.conditional != "full":
            return x / self.conditional_log_scale.exp()
        tril = self.conditional_scale_tril()
        flat = x.reshape(-1, x.shape[-1]).T
        white = torch.linalg.solve_triangular(tril, flat, upper=False)
        return white.T.reshape(x.shape)

    def _log_normaliser(self, log_scale=None):
        # log det L + (D/2) log 2 pi: must be included, since xi is learned (pitfall 3);
        # plus log |det| of the preconditioner: the density is of u = m + L_pre z
        if log_scale is None:
            log_scale = self.conditional_log_scale
        dim = self.conditional_log_scale.shape[-1]
        return (
            log_scale.sum(-1)
            + 0.5 * dim * math.log(2 * math.pi)
            + self.preconditioner.log_abs_det()
        )

    def conditional_log_prob(self, u, psi):
        r""":math:`\log q_\xi(u \mid \psi) = \log \mathcal N(u;\ \psi,\ \Sigma_\xi)`, summed
        over the D coordinates; ``u`` and ``psi`` broadcast over their leading dims.

        :param torch.Tensor u: ``(..., D)`` packed unconstrained latents.
        :param torch.Tensor psi: ``(..., D)`` mixing draws.
        :return: tensor of the broadcast leading shape.
        """
        z = self.preconditioner.whiten(u)
        if self.conditional == "mixed":
            loc, log_scale = self._mixed_loc_log_scale(psi)
            white = (z - loc) * torch.exp(-log_scale)
            return -0.5 * white.pow(2).sum(-1) - self._log_normaliser(log_scale)
        white = self._whiten(z - psi)
        return -0.5 * white.pow(2).sum(-1) - self._log_normaliser()

    def pairwise_conditional_log_prob(self, u, psi):
        r""":math:`\log q_\xi(u_n \mid \psi_m)` for all pairs, ``(N, M)``, in
        :math:`O(NM + (N + M)D)` memory (Gram identity on whitened, centred points) instead
        of the :math:`O(NMD)` of broadcasting :meth:`conditional_log_prob`.

        :param torch.Tensor u: ``(N, D)``.
        :param torch.Tensor psi: ``(M, D)`` (``(M, 2D)`` for ``conditional="mixed"``).
        """
        z = self.preconditioner.whiten(u)
        if self.conditional == "mixed":
            loc, log_scale = self._mixed_loc_log_scale(psi)
            precision = torch.exp(-2.0 * log_scale)  # (M, D)
            # sum_d (z_nd - loc_md)^2 w_md expanded: three (N, M) products, no (N, M, D)
            d2 = (
                (z * z) @ precision.mT
                - 2.0 * z @ (loc * precision).mT
                + (loc * loc * precision).sum(-1)
            ).clamp(min=0.0)
            return -0.5 * d2 - self._log_normaliser(log_scale)
        d2 = squared_distances(self._whiten(z), self._whiten(psi))
        return -0.5 * d2 - self._log_normaliser()

    def _conditional_sample(self, psi, eta):
        if self.conditional == "mixed":
            loc, log_scale = self._mixed_loc_log_scale(psi)
            return loc + eta * log_scale.exp()
        if self.conditional == "full":
            return psi + eta @ self.conditional_scale_tril().T
        return psi + eta * self.conditional_log_scale.exp()

    def _split_noise(self, noise):
        return noise[..., : self.mixing_noise_dim], noise[..., self.mixing_noise_dim :]

    def _latent_from_noise(self, noise):
        eps, eta = self._split_noise(noise)
        return self._conditional_sample(self.mixing(eps), eta)

    # ------------------------------------------------------------------ pyro guide
    def _mixing_site_name(self):
        return f"_{self._pyro_name}_mixing"

    def _implicit_info(self):
        info = super()._implicit_info()
        info["mixing_site"] = self._mixing_site_name()
        info["hint"] = _PAIRING_HINT
        return info

    _pairing_hint_text = _PAIRING_HINT

    def _sampler_output(self, noise):
        """Draw ``u`` hierarchically; record the generating :math:`\\psi` for the loss."""
        eps, eta = self._split_noise(noise)
        psi = self.mixing(eps)
        if poutine.get_mask() is not False:
            # only losses read psi; Predictive (mask False) skips the site
            psi = pyro.sample(
                self._mixing_site_name(),
                dist.Delta(psi, event_dim=1),
                infer={"is_auxiliary": True},
            )
        return self._conditional_sample(psi, eta)

    def latent_groups(self):
        """One group holding every latent site: q does not factorise across sites."""
        self._check_ready()
        return [list(self._unconstrained_shapes)]
