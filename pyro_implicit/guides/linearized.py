r"""``LinearizedGuide``: LIVI's Gaussian deep-latent-variable posterior, ``u = g(z) + sigma xi``.

Uppal, Boomsma, Stensbo-Smidt & Frellsen (2023), *Implicit Variational Inference for
High-Dimensional Posteriors*, NeurIPS (LIVI), Sec. 3.1, eqs. 5-6 and App. B. The packed
unconstrained latent ``u`` of the model (see :mod:`pyro_implicit.guides.base`) is drawn as

.. math::
    z \sim \mathcal N(0, I_d),\quad \xi \sim \mathcal N(0, I_D),\quad
    u = g_\gamma(z) + \sigma\,\xi,
    \qquad\text{i.e.}\quad q_\gamma(u \mid z) = \mathcal N(u;\ g_\gamma(z),\ \sigma^2 I_D),

with a generator network :math:`g_\gamma` and a small, fixed :math:`\sigma` (eqs. B.1-B.2).
The marginal :math:`q_\gamma(u)` is intractable; :class:`~pyro_implicit.elbo.LIVI_ELBO`
approximates its entropy by linearising :math:`g_\gamma` at the z of each draw (eq. 14),
which needs the Jacobian :math:`J = \partial g / \partial z` at that z.

Trace layout (in addition to the base layout):

* ``_<name>_noise`` holds z (d values) and ``_<name>_output_noise`` holds
  :math:`\xi` (D values): masked auxiliary sites, so outer plates broadcast them;
* ``_<name>_base`` holds the z of the draw as an auxiliary ``Delta(z, event_dim=1)``; the
  latent site's ``infer["pyro_implicit"]`` names it under ``"base_site"`` (for
  :class:`~pyro_implicit.elbo.LIVI_ELBO`, which differentiates the generator at z) and
  ``"mixing_site"`` (for :class:`~pyro_implicit.elbo.SIVI_ELBO`, which evaluates
  :math:`q(u \mid z)`). It is skipped when ``poutine.get_mask() is False``
  (``Predictive``), where no loss reads it.
"""

import math

import pyro
import pyro.distributions as dist
from pyro import poutine
from pyro.infer.autoguide.initialization import init_to_median

from ..errors import check_count
from ..kernels import squared_distances
from .base import ImplicitAutoGuide
from .networks import MLPGenerator
from .scalable import CorrelatedMatrixGenerator

__all__ = ["LinearizedGuide"]

#: the authors' code default (``--small_noise 0.001``); the paper gives no value
DEFAULT_SIGMA = 1e-3

_PAIRING_HINT = (
    "Train a LinearizedGuide with LIVI_ELBO (the paper's linearised entropy), or with "
    "SIVI_ELBO or KernelRatioELBO"
)


def _default_hidden(noise_dim, out_dim):
    # The paper's toy and UCI generators are one-hidden-layer MLPs (App. E.3-E.4) whose
    # widths are not given; this is ImplicitGuide's width rule with one layer.
    return (int(min(512, max(32, 2 * max(noise_dim, min(out_dim, 256))))),)


class LinearizedGuide(ImplicitAutoGuide):
    r"""LIVI's variational family (Uppal et al. 2023, eqs. 5-6) over the model's packed
    unconstrained latent:

    .. math::
        z \sim \mathcal N(0, I_d),\qquad u = g_\gamma(z) + \sigma\,\xi,\qquad
        \xi \sim \mathcal N(0, I_D),

    a semi-implicit distribution with the Gaussian conditional
    :math:`q(u \mid z) = \mathcal N(g_\gamma(z), \sigma^2 I_D)` (:meth:`conditional_log_prob`)
    and a differentiable generator (:attr:`generator`, whose Jacobian in z the loss
    computes). Every model site is ``biject_to(support)`` of its slice of ``u``, as in
    Pyro's ``AutoContinuous``.

    Train it with :class:`~pyro_implicit.elbo.LIVI_ELBO` (eq. 15 or 18); it also works
    with :class:`~pyro_implicit.elbo.SIVI_ELBO` (as a semi-implicit guide, useful only
    when :math:`\sigma` is comparable to the posterior's spread: ``SIVI_ELBO`` refuses
    :math:`\sigma < 0.1`, whose mixture estimate collapses q) and
    :class:`~pyro_implicit.elbo.KernelRatioELBO` (sampling only). Plain ``Trace_ELBO``
    raises instead of silently dropping the entropy.

    Usage::

        guide = LinearizedGuide(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), LIVI_ELBO())

    :param callable model: a Pyro model with continuous latent sites.
    :param int noise_dim: d, the size of z (default: D, but beyond 256 latents a
        network's size, growing slowly, for a network's weights (sites marked
        :data:`~pyro_implicit.latent.NETWORK_WEIGHTS`, as :mod:`pyro_implicit.bnn` marks
        them) and beyond :data:`~pyro_implicit.latent.DENSE_LIMIT` latents without a dense
        factor: :func:`~pyro_implicit.guides.base.default_noise_dim`; a restored guide,
        the size it was saved with; the
        paper uses 60-85 for its toy, 4 225 for MNIST, 16 900 for CIFAR). With d < D, q is
        a d-dimensional surface widened by :math:`\sigma` only: on a posterior that is not
        low-rank the fit shrinks its marginals (the best of such a family has sds about
        :math:`\sqrt{d/D}` of the posterior's where it is isotropic). On the
        150-coefficient regression ``wide_blr`` (``benchmarks/results/wide_blr_defaults.md``)
        d = 73 (the network rule this default had above 64 latents) ended with sd ratios
        0.54-0.89, d = 150 within the exact-posterior bar. Beyond
        :data:`~pyro_implicit.latent.DENSE_LIMIT` latents without a dense factor, on a
        posterior that is not a network's, pass ``noise_dim=D``, or prefer
        ``SemiImplicitGuide`` or ``ImplicitGuide``. Noise of D makes ``LIVI_ELBO``'s
        default bound form D x D Jacobians: on regressions of D = 300 / 600 / 1000 a step
        took 82 / 387 / 1340 ms against 22 / 42 / 119 ms with a network's noise, which
        left the fit's sd ratios at 0.44-0.62 (``benchmarks/results/audit_probes_s61.md``
        section 5); where that is too slow, ``LIVI_ELBO(bound="svd")`` needs no whole
        Jacobian. A network's weights keep a network's noise: on the ``energy`` BNN (D = 502)
        a step of ``LIVI_ELBO(num_particles=32)`` took 99 ms with 87 noise values and
        1037 ms with 502, which ended no better (test log-likelihood -1.328 and -1.497;
        ``benchmarks/results/preconditioner_start_likelihood.md``). With
        ``generator="scalable"`` z is reshaped to a near-square matrix.
    :param tuple hidden_dims: hidden widths of the MLP generator (default one layer of
        ``clip(2 max(d, min(D, 256)), 32, 512)``; the paper's toy/UCI generators have one
        hidden layer). ``()`` gives a linear generator, for which eq. 14 is exact.
    :param float sigma: the fixed output noise :math:`\sigma` (a standard deviation, in
        unconstrained space). The paper only says "small"; the default 1e-3 is the
        authors' code default.
    :param generator: ``"mlp"`` (default; :class:`~pyro_implicit.guides.MLPGenerator`),
        ``"scalable"`` (the paper's correlated matrix-multiplication generator,
        :class:`~pyro_implicit.guides.scalable.CorrelatedMatrixGenerator`, for D up to
        10^7), or a callable ``f(noise_dim, latent_dim)`` returning an ``nn.Module`` with
        attributes ``noise_dim`` and ``out_dim`` that maps ``(..., d)`` to ``(..., D)``
        row by row (no batch-coupling layers such as BatchNorm).
    :param str activation: MLP activation; ``"elu"`` as in the paper (App. E): the loss
        differentiates the Jacobian, so a smooth activation is preferable.
    :param callable init_loc_fn: per-site initial location (default ``init_to_median``):
        the generator's output is centred there (without preconditioner).
    :param float init_scale: initial spread of :math:`g_\gamma(z)` per coordinate
        (default: the preconditioner's Gaussian; 0.1 in raw units without one).
    :param precondition: ``True`` (default), ``False`` or a
        :class:`~pyro_implicit.latent.Preconditioner`: :math:`u = m + L(g_\gamma(z) +
        \sigma\xi)` (see :class:`~pyro_implicit.guides.base.ImplicitAutoGuide`), with
        :math:`\sigma` in whitened units; the default MLP then has an identity skip, so q
        starts at the preconditioner's Gaussian.
    :param int num_quantile_samples: draws behind :meth:`median` and :meth:`quantiles`.

    References

    [1] `Implicit Variational Inference for High-Dimensional Posteriors`, Anshuk Uppal,
        Kristoffer Stensbo-Smidt, Wouter Boomsma, Jes Frellsen, NeurIPS 2023
        (arXiv:2310.06643), Sec. 3, App. B and D.
    """

    capabilities = frozenset({"sample", "conditional_density", "jacobian"})

    def __init__(
        self,
        model,
        *,
        noise_dim=None,
        hidden_dims=None,
        sigma=DEFAULT_SIGMA,
        generator="mlp",
        activation="elu",
        init_loc_fn=init_to_median,
        init_scale=None,
        num_quantile_samples=1000,
        precondition=True,
        parametrization="auto",
    ):
        if isinstance(generator, str) and generator not in ("mlp", "scalable"):
            raise ValueError(
                f"generator must be 'mlp', 'scalable' or a callable, got {generator!r}"
            )
        if noise_dim is not None:
            check_count("noise_dim", noise_dim)
        if not sigma > 0:
            raise ValueError(f"sigma (the fixed output noise) must be positive, got {sigma}")
        self._generator_spec = generator
        self._noise_dim_arg = noise_dim
        self._hidden_dims = None if hidden_dims is None else tuple(hidden_dims)
        self._activation = activation
        self.sigma = float(sigma)
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
        spec = self._generator_spec
        d = self._noise_dim_arg or self._default_noise_dim(dim)
        if callable(spec) and not isinstance(spec, str):
            gen = spec(d, dim)
            for attr in ("noise_dim", "out_dim"):
                if not hasattr(gen, attr):
                    raise TypeError(f"a custom generator must have attribute {attr!r}")
        elif spec == "scalable":
            gen = CorrelatedMatrixGenerator(d, dim)
        else:
            hidden = self._hidden_dims
            if hidden is None:
                hidden = _default_hidden(d, dim)
            # whitened: a residual on the identity, so q starts at the Gaussian fit
            gen = MLPGenerator(
                d, dim, hidden, self._activation, skip=self.whitened, scaled=self._scaled_keyword()
            )
        if gen.out_dim != dim:
            raise ValueError(
                f"the generator outputs {gen.out_dim} values but the model's packed latent "
                f"has D={dim}"
            )
        gen = gen.to(dtype=init_loc.dtype, device=init_loc.device)
        if hasattr(gen, "init_output"):
            gen.init_output(init_loc, self._init_scale)
        self.generator = gen
        # plain ints: read on every call, kept off PyroModule's attribute machinery
        self._base_dim = int(gen.noise_dim)

    @property
    def noise_dim(self):
        """d, the size of the base noise z (the output noise :math:`\\xi` has size D)."""
        return self._base_dim

    # ------------------------------------------------------------------ densities
    def conditional_log_prob(self, u, z):
        r""":math:`\log q(u \mid z) = \log \mathcal N(u;\ g_\gamma(z),\ \sigma^2 I_D)`,
        summed over the D coordinates; ``u`` and ``z`` broadcast over their leading dims.

        :param torch.Tensor u: ``(..., D)`` packed unconstrained latents.
        :param torch.Tensor z: ``(..., d)`` base noise.
        :return: tensor of the broadcast leading shape.
        """
        white = (self.preconditioner.whiten(u) - self.generator(z)) / self.sigma
        return -0.5 * white.pow(2).sum(-1) - self._log_normaliser()

    def pairwise_conditional_log_prob(self, u, z):
        r""":math:`\log q(u_n \mid z_m)` for all pairs, ``(N, M)``, in
        :math:`O(NM + (N + M)D)` memory (Gram identity).

        :param torch.Tensor u: ``(N, D)``.
        :param torch.Tensor z: ``(M, d)``.
        """
        white = self.preconditioner.whiten(u)
        d2 = squared_distances(white / self.sigma, self.generator(z) / self.sigma)
        return -0.5 * d2 - self._log_normaliser()

    def _log_normaliser(self):
        # the density is of u = m + L_pre (g(z) + sigma xi): log |det L_pre| joins
        return (
            self.latent_dim * (math.log(self.sigma) + 0.5 * math.log(2 * math.pi))
            + self.preconditioner.log_abs_det()
        )

    def sample_mixing(self, num_samples):
        """Draw ``(num_samples, d)`` base noise values z: the mixing variable of this
        semi-implicit guide, in the space of its ``mixing_site`` (for ``SIVI_ELBO``)."""
        self._check_ready()
        return self.standard_normal(num_samples, self.noise_dim)

    # ------------------------------------------------------------------ sampling
    def _latent_from_noise(self, noise):
        """``noise = (z, xi)`` concatenated, ``(..., d + D)``."""
        z, xi = noise[..., : self.noise_dim], noise[..., self.noise_dim :]
        return self.generator(z) + self.sigma * xi

    def sample_whitened(self, num_samples):
        """The whitened draws of :meth:`sample_unconstrained` (with autograd graph to the
        generator): base noise z and output noise xi, ``d + D`` values per draw."""
        self._check_ready()
        noise = self.standard_normal(num_samples, self.noise_dim + self.latent_dim)
        return self._latent_from_noise(noise)

    # ------------------------------------------------------------------ pyro guide
    def _base_site_name(self):
        return f"_{self._pyro_name}_base"

    def _implicit_info(self):
        info = super()._implicit_info()
        info["base_site"] = info["mixing_site"] = self._base_site_name()
        info["hint"] = _PAIRING_HINT
        return info

    def _standard_normal_site(self, name, size):
        zero = self._noise_reference
        return pyro.sample(
            name,
            dist.Normal(zero, 1.0).expand([size]).to_event(1).mask(False),
            infer={"is_auxiliary": True},
        )

    _pairing_hint_text = _PAIRING_HINT

    def _draw_noise(self):
        """Two noise sites: the generator's input z and the output noise xi."""
        z = self._standard_normal_site(f"_{self._pyro_name}_noise", self.noise_dim)
        xi = self._standard_normal_site(f"_{self._pyro_name}_output_noise", self.latent_dim)
        return z, xi

    def _sampler_output(self, noise):
        """``g(z) + sigma xi``, recording the z of the draw for the loss."""
        z, xi = noise
        if poutine.get_mask() is not False:
            # only losses read z (to differentiate g there); Predictive skips the site
            z = pyro.sample(
                self._base_site_name(), dist.Delta(z, event_dim=1), infer={"is_auxiliary": True}
            )
        return self.generator(z) + self.sigma * xi

    def latent_groups(self):
        """One group holding every latent site: q does not factorise across sites."""
        self._check_ready()
        return [list(self._unconstrained_shapes)]
