"""``ImplicitGuide``: a generator network as a Pyro guide, ``u = g_phi(eps)``."""

import inspect
import math

import torch
from pyro.infer.autoguide.initialization import init_to_median
from torch import nn

from ..errors import check_count
from .base import ImplicitAutoGuide, network_noise_dim
from .networks import BlockGenerator, MatrixGenerator, MLPGenerator

__all__ = ["ImplicitGuide", "SkipGenerator", "gpvi_generator"]


def _takes_keyword(fn, name):
    """Whether ``fn`` accepts the keyword argument ``name`` (False when its signature
    cannot be read, e.g. a builtin)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _default_hidden(noise_dim, out_dim):
    width = int(min(512, max(32, 2 * max(noise_dim, min(out_dim, 256)))))
    return (width, width)


class ImplicitGuide(ImplicitAutoGuide):
    r"""Implicit variational posterior: the packed unconstrained latent is the output of a
    generator network applied to standard-normal noise,

    .. math:: u = g_\phi(\epsilon), \qquad \epsilon \sim \mathcal N(0, I_d),

    and the model's sites are ``biject_to(support)`` of the pieces of ``u``. q(u) has no
    density, so train it with a loss that estimates the KL or entropy term, e.g.
    :class:`~pyro_implicit.elbo.KernelRatioELBO` (KIVI, Shi et al. 2018). Plain
    ``Trace_ELBO`` raises instead of silently collapsing the posterior.

    Usage::

        guide = ImplicitGuide(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), KernelRatioELBO())

    :param callable model: a Pyro model with continuous latent sites.
    :param str generator: ``"mlp"`` (default): one MLP over the whole latent, so q can be
        correlated across sites; ``"mmnn"``: KIVI's matrix-multiplication generator for
        every site whose unconstrained value is a matrix (an MLP for the others), one per
        site (implies ``per_site=True``); or a callable ``f(noise_dim, latent_dim)``
        returning an ``nn.Module`` generator (see :mod:`~pyro_implicit.guides.networks`;
        one that also takes ``scaled`` is passed the guide's layers as
        :class:`~pyro_implicit.guides.networks.MLPGenerator`'s ``scaled``, ``False``,
        ``True`` or ``"ntk"``, as :func:`gpvi_generator`'s is).
    :param int noise_dim: noise size (default D, but beyond 256 latents a network's size,
        64 growing slowly, for a network's weights (sites marked
        :data:`~pyro_implicit.latent.NETWORK_WEIGHTS`, as :mod:`pyro_implicit.bnn` marks
        them) and beyond :data:`~pyro_implicit.latent.DENSE_LIMIT` latents without a dense
        factor: :func:`~pyro_implicit.guides.base.default_noise_dim`; a restored guide, the
        size it was saved with). With
        ``per_site=True`` it is
        the noise size per site (default scaled to each site).
    :param tuple hidden_dims: MLP hidden widths (default two layers of
        ``clip(2 max(d, min(D, 256)), 32, 512)``).
    :param str activation: MLP activation: ``"relu"`` (KIVI's choice, the default),
        ``"leaky_relu"``, ``"tanh"``, ``"elu"`` or ``"softplus"``. Under
        ``SteinScoreELBO`` on a near-Gaussian posterior the ReLU units switch off, which
        helps its fits; the loss recycles them when the model's inputs change, and
        ``"leaky_relu"`` keeps them learning where the posterior moves without that
        (docs/choosing_settings.md, "Continuing a fit").
    :param bool per_site: one independent generator per latent site (KIVI's layer-wise
        factorisation); losses then estimate the KL per site.
    :param tuple mmnn_noise_shape: noise matrix of each MMNN (default ``(min(M, 30),
        min(N, 30))`` for an ``M x N`` site; KIVI uses 30 x 30).
    :param list mmnn_hidden_shapes: hidden matrices of each MMNN (default one
        ``(min(M, 64), min(N, 64))`` layer).
    :param dict site_options: per-site overrides with ``per_site=True``, e.g.
        ``{"layer0": {"noise_dim": 20, "hidden_dims": (30,)}}`` (KIVI's Table 3 sizes).
    :param callable init_loc_fn: per-site initial location (default ``init_to_median``).
    :param float init_scale: initial spread of the generator's output (default: the
        preconditioner's Gaussian; 0.1 in raw units without one).
    :param precondition: ``True`` (default), ``False`` or a
        :class:`~pyro_implicit.latent.Preconditioner`: the generator draws whitened
        :math:`z` and :math:`u = m + Lz` (see :class:`~pyro_implicit.guides.base.
        ImplicitAutoGuide`); the default MLP then has an identity skip, so q starts at the
        preconditioner's Gaussian. ``per_site=True`` gets a diagonal :math:`L`.

    References

    [1] `Kernel Implicit Variational Inference`, Jiaxin Shi, Shengyang Sun, Jun Zhu,
        ICLR 2018 (Sec. 3, Algorithm 2).
    """

    def __init__(
        self,
        model,
        *,
        generator="mlp",
        noise_dim=None,
        hidden_dims=None,
        activation="relu",
        per_site=False,
        mmnn_noise_shape=None,
        mmnn_hidden_shapes=None,
        site_options=None,
        init_loc_fn=init_to_median,
        init_scale=None,
        num_quantile_samples=1000,
        precondition=True,
        parametrization="auto",
    ):
        if isinstance(generator, str) and generator not in ("mlp", "mmnn"):
            raise ValueError(f"generator must be 'mlp', 'mmnn' or a callable, got {generator!r}")
        if noise_dim is not None:
            check_count("noise_dim", noise_dim)
        if not isinstance(per_site, bool):
            raise TypeError(f"per_site must be True or False, got {per_site!r}")
        self._generator_spec = generator
        self._noise_dim_arg = noise_dim
        self._hidden_dims = None if hidden_dims is None else tuple(hidden_dims)
        self._activation = activation
        if per_site and callable(generator) and not isinstance(generator, str):
            raise ValueError(
                "per_site=True builds one generator per site, so q factorises across sites; "
                "a custom generator is one network over the whole latent: drop per_site"
            )
        self.per_site = bool(per_site) or generator == "mmnn"
        self._mmnn_noise_shape = mmnn_noise_shape
        self._mmnn_hidden_shapes = mmnn_hidden_shapes
        self._site_options = dict(site_options or {})
        if self._site_options and not self.per_site:
            raise ValueError("site_options configures per-site generators: set per_site=True")
        super().__init__(
            model,
            init_loc_fn=init_loc_fn,
            init_scale=init_scale,
            num_quantile_samples=num_quantile_samples,
            precondition=precondition,
            parametrization=parametrization,
        )

    # ------------------------------------------------------------------ building
    def _mlp(self, out_dim, noise_dim=None, hidden_dims=None):
        d = noise_dim or self._noise_dim_arg or self._default_noise_dim(out_dim)
        hidden = hidden_dims if hidden_dims is not None else self._hidden_dims
        if hidden is None:
            hidden = _default_hidden(d, out_dim)
        # whitened: a residual on the identity, so q starts at the preconditioner's Gaussian
        return MLPGenerator(
            d, out_dim, hidden, self._activation, skip=self.whitened, scaled=self._scaled_keyword()
        )

    def _mmnn(self, shape):
        m, n = shape
        noise_shape = self._mmnn_noise_shape or (min(m, 30), min(n, 30))
        hidden = self._mmnn_hidden_shapes
        if hidden is None:
            hidden = [(min(m, 64), min(n, 64))]
        return MatrixGenerator(noise_shape, (m, n), hidden)

    def _site_generator(self, name):
        shape = tuple(s for s in self._unconstrained_shapes[name] if s != 1)
        numel = math.prod(shape)
        options = self._site_options.get(name, {})
        unknown = set(options) - {"noise_dim", "hidden_dims"}
        if unknown:
            raise ValueError(f"unknown site_options {sorted(unknown)} for site '{name}'")
        if self._generator_spec == "mmnn" and len(shape) == 2:
            if options:
                raise ValueError(
                    f"site_options sizes the MLP generator of a site, but the matrix site "
                    f"'{name}' is drawn by the matrix generator: size it with "
                    "mmnn_noise_shape and mmnn_hidden_shapes"
                )
            return self._mmnn(shape)
        return self._mlp(numel, options.get("noise_dim"), options.get("hidden_dims"))

    def _dense_preconditioner(self):
        # per-site generators factorise q across sites: a dense L would couple them
        return False if self.per_site else None

    def _build_sampler(self, init_loc):
        spec = self._generator_spec
        if callable(spec) and not isinstance(spec, str):
            d = self._noise_dim_arg or self._default_noise_dim(self.latent_dim)
            if _takes_keyword(spec, "scaled"):
                # a factory that can build scaled layers gets the guide's parametrization
                gen = spec(d, self.latent_dim, scaled=self._scaled_keyword())
            else:
                gen = spec(d, self.latent_dim)
            for attr in ("noise_dim", "out_dim"):
                if not hasattr(gen, attr):
                    raise TypeError(f"a custom generator must have attribute {attr!r}")
            if gen.out_dim != self.latent_dim:
                raise ValueError(
                    f"custom generator outputs {gen.out_dim} values but the model's packed "
                    f"latent has D={self.latent_dim}"
                )
        elif self.per_site:
            names = list(self._unconstrained_shapes)
            strangers = sorted(set(self._site_options) - set(names))
            if strangers:
                raise ValueError(
                    f"site_options names {strangers}, which are not latent sites of the model "
                    f"(latent sites: {names})"
                )
            gen = BlockGenerator([self._site_generator(n) for n in names], names)
        else:
            gen = self._mlp(self.latent_dim)
        gen = gen.to(dtype=init_loc.dtype, device=init_loc.device)
        if hasattr(gen, "init_output"):
            scale = self._init_scale
            if self.whitened and getattr(gen, "skip_carries_spread", False):
                # GPVI's f(z) = g(z) + lambda z: the skip already has unit spread
                scale = 0.1 * scale
            gen.init_output(init_loc, scale)
        self.generator = gen
        self._noise_size = int(gen.noise_dim)

    @property
    def noise_dim(self):
        return self._noise_size

    def _latent_from_noise(self, noise):
        return self.generator(noise)

    @property
    def full_rank(self):
        """Whether the generator has at least as many noise values as outputs (per block
        with ``per_site``), so that q can have a density on the whole space."""
        self._check_ready()
        gen = self.generator
        blocks = gen.blocks if hasattr(gen, "blocks") else [gen]
        return all(b.noise_dim >= b.out_dim for b in blocks)

    def latent_groups(self):
        """Groups of site names across which q factorises (one group unless
        ``per_site``); losses may estimate the KL group by group."""
        self._check_ready()
        names = list(self._unconstrained_shapes)
        return [[n] for n in names] if self.per_site else [names]


# ------------------------------------------------------------------ GPVI's generator
class SkipGenerator(nn.Module):
    r"""GPVI's generator :math:`f(z) = g(z^{(:k)}) + \lambda z` (Ratzlaff et al. 2021, eq. 6).

    ``g`` is an MLP reading only the first k noise coordinates, so it stays slim when the
    latent size D is large, while the skip term keeps the Jacobian square,

    .. math:: J_f(z) = \big[\,\partial g / \partial z^{(:k)} \;\big|\; 0_{D \times (D-k)}\big]
        + \lambda I_D \qquad \text{(eq. 7)},

    and invertible for a large enough :math:`\lambda` (the paper uses :math:`\lambda = 1`
    throughout; nothing enforces invertibility during training).

    With k < D, conditionally on :math:`z^{(:k)}` the last D - k outputs are
    :math:`\mathcal N(g_{k:}(z^{(:k)}), \lambda^2 I)`: a noise floor of variance
    :math:`\lambda^2` that a fixed :math:`\lambda` cannot remove (choose ``skip_scale``
    below the posterior's scale for narrow posteriors, e.g. BNN weights). With k = D and a
    linear g (``hidden_dims=()``), :math:`f(z) = (W + \lambda I) z + b` spans every Gaussian.

    :param int dim: D, the size of both the noise and the output.
    :param int active_dim: k, the noise coordinates g reads (default D up to 64, then
        64-128, the library's noise-size rule).
    :param tuple hidden_dims: hidden widths of g (default two layers, as ``ImplicitGuide``).
    :param str activation: hidden activation of g (ReLU in the paper).
    :param float skip_scale: :math:`\lambda` (paper: 1.0); 0 is allowed only when k = D.
    :param scaled: g's layers, as :class:`~pyro_implicit.guides.networks.MLPGenerator`'s
        ``scaled`` (an ``ImplicitGuide`` passes its ``parametrization``).
    """

    def __init__(
        self,
        dim,
        active_dim=None,
        hidden_dims=None,
        activation="relu",
        skip_scale=1.0,
        scaled=False,
    ):
        super().__init__()
        dim = int(dim)
        k = int(active_dim) if active_dim is not None else min(dim, network_noise_dim(dim))
        if not 1 <= k <= dim:
            raise ValueError(f"active_dim must lie in [1, {dim}], got {k}")
        if skip_scale < 0 or (skip_scale == 0 and k < dim):
            raise ValueError(
                "skip_scale (lambda) must be positive when active_dim < dim: without the "
                f"lambda z term the Jacobian has rank at most {k} < {dim}"
            )
        self.noise_dim = self.out_dim = dim
        self.active_dim = k
        self.skip_scale = float(skip_scale)
        hidden = _default_hidden(k, dim) if hidden_dims is None else tuple(hidden_dims)
        self.net = MLPGenerator(k, dim, hidden, activation, scaled=scaled)

    #: the skip term alone gives the output spread lambda per coordinate (a guide that
    #: starts at its preconditioner's Gaussian initialises g small)
    skip_carries_spread = True

    def forward(self, noise):
        return self.net(noise[..., : self.active_dim]) + self.skip_scale * noise

    def head_jacobian_factors(self, noise):
        r"""``(L, W)`` with :math:`\partial g / \partial z^{(:k)} = W L^\top` at every row
        of ``noise``: L ``(..., k, width)`` the transposed Jacobian of g's last hidden layer
        and W ``(D, width)`` g's output weight (:meth:`MLPGenerator.hidden_jacobian`), or
        ``(head_jacobian(noise).mT, None)`` for an affine g. GPVI's k x k solve works
        with the factors: it never forms the D x k block (at D = 752, k = 92 and 512-wide
        layers that product was half of the solve's arithmetic)."""
        head = noise[..., : self.active_dim]
        left = None if self.net.skip else self.net.hidden_jacobian(head)
        if left is None:
            return self.head_jacobian(noise).mT, None
        return left, self.net.output.weight

    def head_jacobian(self, noise):
        r""":math:`\partial g / \partial z^{(:k)}` at every row of ``noise``, ``(..., D,
        k)``: the non-zero block of eq. 7 (:meth:`MLPGenerator.jacobian`, layer by layer).
        With k < D, GPVI's exact solve inverts :math:`J_f` through it (a k x k system per
        row, :func:`~pyro_implicit.elbo.inverse_jacobian.exact_inverse_jvp`)."""
        return self.net.jacobian(noise[..., : self.active_dim])

    def jacobian(self, noise):
        r"""Eq. 7's :math:`J_f` at every row of ``noise``, ``(..., D, D)``: g's layer-by-layer
        Jacobian (:meth:`head_jacobian`) padded with zeros, plus :math:`\lambda I`.
        Differentiable with respect to the parameters; GPVI's exact solve and
        :func:`~pyro_implicit.elbo.livi.jacobian` use it instead of D forward-mode
        products through the network."""
        jac = self.head_jacobian(noise)  # (..., D, k)
        if self.active_dim < self.noise_dim:
            jac = nn.functional.pad(jac, (0, self.noise_dim - self.active_dim))
        eye = torch.eye(self.out_dim, dtype=jac.dtype, device=jac.device)
        return jac + self.skip_scale * eye

    def init_output(self, loc, scale):
        """Centre the output at ``loc``; g's own spread is ``scale`` (the skip term adds
        spread :math:`\\lambda` per coordinate on top)."""
        self.net.init_output(loc, scale)


def gpvi_generator(active_dim=None, hidden_dims=None, activation="relu", skip_scale=1.0):
    """The ``generator=`` argument of :class:`~pyro_implicit.guides.ImplicitGuide` that
    builds a :class:`SkipGenerator` over the whole latent (GPVI's eq. 6); the noise size is
    then always D::

        guide = ImplicitGuide(model, generator=gpvi_generator())

    See :class:`SkipGenerator` for the arguments.
    """

    def build(noise_dim, latent_dim, scaled=False):
        return SkipGenerator(latent_dim, active_dim, hidden_dims, activation, skip_scale, scaled)

    return build
