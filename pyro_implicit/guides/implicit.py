"""``ImplicitGuide``: a generator network as a Pyro guide, ``u = g_phi(eps)``."""

import math

from pyro.infer.autoguide.initialization import init_to_median

from .base import ImplicitAutoGuide, default_noise_dim
from .networks import BlockGenerator, MatrixGenerator, MLPGenerator

__all__ = ["ImplicitGuide"]


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
        returning an ``nn.Module`` generator (see :mod:`~pyro_implicit.guides.networks`).
    :param int noise_dim: noise size (default scaled to D: D up to 64, then slowly
        growing). With ``per_site=True`` it is the noise size per site (default scaled to
        each site).
    :param tuple hidden_dims: MLP hidden widths (default two layers of
        ``clip(2 max(d, min(D, 256)), 32, 512)``).
    :param str activation: MLP activation (``"relu"``, KIVI's choice).
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
    ):
        if isinstance(generator, str) and generator not in ("mlp", "mmnn"):
            raise ValueError(f"generator must be 'mlp', 'mmnn' or a callable, got {generator!r}")
        if noise_dim is not None and noise_dim < 1:
            raise ValueError(f"noise_dim must be a positive integer, got {noise_dim}")
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
        )

    # ------------------------------------------------------------------ building
    def _mlp(self, out_dim, noise_dim=None, hidden_dims=None):
        d = noise_dim or self._noise_dim_arg or default_noise_dim(out_dim)
        hidden = hidden_dims if hidden_dims is not None else self._hidden_dims
        if hidden is None:
            hidden = _default_hidden(d, out_dim)
        # whitened: a residual on the identity, so q starts at the preconditioner's Gaussian
        return MLPGenerator(d, out_dim, hidden, self._activation, skip=self.whitened)

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
            d = self._noise_dim_arg or default_noise_dim(self.latent_dim)
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
