r"""Generative particle VI (GPVI) and amortised SVGD: a generator trained by a functional
gradient of :math:`\mathrm{KL}(q \,\|\, p)`.

Ratzlaff, Bai, Fuxin & Xu (2021), *Generative Particle Variational Inference via Estimation
of Functional Gradients*. The guide is a sampler :math:`u = f_\theta(z)`,
:math:`z \sim \mathcal N(0, I_D)`, whose density q is never evaluated. GPVI takes the
gradient of :math:`J(f) = \mathrm{KL}(q \| p)` with respect to the *function* f in an RKHS
over the noise space (Theorem 3.1, eq. 5),

.. math::
    \nabla_f J(f)(z) = \mathbb E_{z'}\big[-\nabla_u \log p(u)\big|_{u=f(z')}\, k(z', z)
        - J_f(z')^{-\top} \nabla_{z'} k(z', z)\big],

and pulls it back to the parameters by the chain rule (eq. 4),
:math:`\nabla_\theta J = \mathbb E_z[(\partial f(z)/\partial\theta)^\top \nabla_f J(f)(z)]`.
The repulsive term needs :math:`J_f(z')^{-\top} v` for every pair of the two batches. A
*helper network* :math:`h_\eta(z'^{(:k)}, v)` estimates it (eq. 9) and is trained online by
one least-squares step per generator step (eqs. 10-11); ``exact_jacobian=True`` forms
:math:`J_f` and solves instead (the paper's "GPVI Exact Jac", App. D.1). The default
solves exactly wherever that is cheap: up to D = 64, and at any D for the skip generator
below with k < D, whose :math:`J_f = \lambda I + [\partial g/\partial z^{(:k)} \mid 0]`
(eq. 7) inverts through a k x k system by the Woodbury identity
(:mod:`pyro_implicit.elbo.inverse_jacobian`); the helper is then an option.

**Transpose.** Eqs. (5), (8) and (10) print :math:`J_f^{-1} v` and :math:`J_f h`, but the
proof (App. A.1, index form) and eq. (11) give :math:`J_f^{-\top} v` and the residual
:math:`J_f^\top h - v`; that is what is implemented. The two differ whenever
:math:`J_f` is not symmetric, and only the transpose has the target as a fixed point.

The Jacobian must be square and invertible, so the generator is
:math:`f(z) = g(z^{(:k)}) + \lambda z` (eq. 6): :class:`SkipGenerator`, built for a guide by
``ImplicitGuide(model, generator=gpvi_generator())``. Any generator with as many noise
inputs as latent outputs and an invertible Jacobian also works (e.g. the paper's linear
toy generators, or the default ``ImplicitGuide`` MLP for 2 <= D <= 64).

:class:`AmortizedSVGD_ELBO` is the paper's main baseline (Wang & Liu 2016; eq. 14): the
same surrogate with the SVGD direction computed on the *outputs* u instead.

Both are losses for Pyro's :class:`~pyro.infer.SVI`; the surrogate's gradient equals the
pulled-back direction, so any Pyro or torch optimiser trains the generator. The helper is
a plain ``nn.Module`` with its own torch optimiser held by the loss, not a Pyro param (so
``SVI`` cannot step it with the generator's gradient); :meth:`GPVI_ELBO.state_dict` saves
it.

The pieces live in modules of one job each and are re-exported here: the helper network
and the exact solve in :mod:`pyro_implicit.elbo.inverse_jacobian`, the machinery both
losses share in :mod:`pyro_implicit.elbo.functional_gradient`, :class:`AmortizedSVGD_ELBO`
in :mod:`pyro_implicit.elbo.amortized_svgd`, the generator in
:mod:`pyro_implicit.guides.implicit`.

References

[1] `Generative Particle Variational Inference via Estimation of Functional Gradients`,
    Roman Ratzlaff, Qinxun Bai, Li Fuxin, Wei Xu, ICML 2021 (arXiv:2103.01291).
[2] `Learning to Draw Samples: With Application to Amortized MLE for Generative
    Adversarial Learning`, Dilin Wang, Qiang Liu, 2016 (amortised SVGD).
"""

import torch

from ..errors import PairingError
from ..guides.implicit import ImplicitGuide, SkipGenerator, gpvi_generator
from ..kernels import kernel_and_derivative, squared_distances
from .amortized_svgd import AmortizedSVGD_ELBO
from .functional_gradient import _FunctionalGradientELBO
from .inverse_jacobian import (
    InverseJacobianNetwork,
    _pairs,
    exact_inverse_jvp,
    exact_kernel_repulsion,
    has_low_rank_jacobian,
    helper_residual,
)
from .livi import jacobian

__all__ = [
    "AmortizedSVGD_ELBO",
    "GPVI_ELBO",
    "InverseJacobianNetwork",
    "SkipGenerator",
    "exact_inverse_jvp",
    "exact_kernel_repulsion",
    "gpvi_generator",
    "helper_residual",
]

#: largest latent size for which ``exact_jacobian="auto"`` solves with the Jacobian
_EXACT_MAX_DIM = 64

#: largest latent size for which the generator's Jacobian is checked for invertibility once
_PROBE_MAX_DIM = 256
#: relative smallest singular value below which a Jacobian counts as singular
_SINGULAR_RTOL = 1e-10


class GPVI_ELBO(_FunctionalGradientELBO):
    r"""Generative particle VI (Ratzlaff et al. 2021, Algorithm 1) as a Pyro loss for an
    :class:`~pyro_implicit.guides.ImplicitGuide` whose generator has a square, invertible
    Jacobian.

    One step (``loss_and_grads`` or ``differentiable_loss``), in the model's packed
    unconstrained space:

    1. draw N particles :math:`u'_a = f(z'_a)` in one vectorised guide trace, run the model
       on them and take the scores :math:`s'_a = \nabla_u \log\tilde p(u'_a)` by autograd,
       where :math:`\log\tilde p(u) = \log p(x, T(u)) + \log|\det\partial T/\partial u|`
       (all observed sites and factors with Pyro's plate scaling, so ``subsample_size``
       gives the M/B likelihood weight; T the ``biject_to`` maps);
    2. draw an independent noise batch :math:`z_b` (``independent_batches``; the paper
       resamples both every step) and the kernel on noise,
       :math:`K_{ab} = k(z'_a, z_b)`, :math:`V_{ab} = \nabla_{z'_a} k(z'_a, z_b)`;
    3. update the helper once on :math:`\|J_f(z'_a)^\top h_\eta(z'^{(:k)}_a, V_{ab}) -
       V_{ab}\|^2` (eqs. 10-11, mean over all entries) with its own optimiser, then
       :math:`Y_{ab} = h_\eta(z'^{(:k)}_a, V_{ab})` with the updated :math:`\eta`
       (Algorithm 1, steps 5-7); or, with ``exact_jacobian``, :math:`Y_{ab} =
       J_f(z'_a)^{-\top} V_{ab}` by a linear solve;
    4. :math:`G_b = -\frac1N \sum_a [s'_a K_{ab} + \beta Y_{ab}]` (eqs. 5/9), with
       :math:`\beta` the latent site's ``poutine.scale`` (1 normally);
    5. the surrogate :math:`\frac1N \sum_b \langle \mathrm{sg}(G_b), f_\theta(z_b)\rangle`,
       whose gradient is the Monte Carlo pullback of eq. (4); the Pyro optimiser steps
       :math:`\theta`.

    The kernel is the RBF kernel on the noise (App. B.2; Sec. 3.5: GPVI's RKHS lives on
    z), :math:`k = \exp(-\|z' - z\|^2 / h)` with the median rule :math:`h = \mathrm{med}^2 /
    \log N` (the paper's "log n"; ``med`` over the pooled batches). The authors' code
    divides by :math:`\log N^2` instead: pass
    ``kernel=RBFKernel(bandwidth_factor=svgd_bandwidth_factor(N * N))``.

    **What the returned loss is.** :math:`-\frac1N\sum_a \log\tilde p(u'_a)`, the mean
    negative log target (unnormalised posterior in unconstrained space) at the step's
    draws: the negative ELBO *without its entropy term*, i.e. :math:`\mathrm{KL}(q\|p) -
    H[q] - \log Z`. GPVI never evaluates q, so no KL or ELBO value exists; this number
    falls as q moves to high-density regions and is not comparable with other losses'
    values. :attr:`diagnostics` holds it as ``log_target`` together with the helper's loss
    before its update (``helper_loss``, it should fall fast and stay small), the kernel
    length scale :math:`\sigma` (``bandwidth``, :math:`h = 2\sigma^2`) and the mean row
    norms of the attractive and repulsive parts of G.

    Usage::

        guide = ImplicitGuide(model, generator=gpvi_generator())
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), GPVI_ELBO(num_particles=64))

    The default ``ImplicitGuide(model)`` also works for 2 <= D <= 64 (its MLP then has D
    noise inputs, so the Jacobian is square and, checked once at random noise points,
    invertible); otherwise the loss names the option to set. Nothing keeps a plain MLP
    injective during training; the skip term of :func:`gpvi_generator` is the paper's
    remedy (Sec. 3.2, App. A.4) and the recommended choice. A linear generator
    (``ImplicitGuide(model, hidden_dims=())``, :math:`q = \mathcal N(b, W W^\top)`) is
    the paper's toy-experiment sampler (Tables 1, 2).

    **The guide's layers.** A guide of this library built by this loss (its first call,
    ``parametrization="auto"``) gets ntk generator layers
    (:class:`~pyro_implicit.guides.networks.ScaledLinear` with 1/sqrt(fan-in) multipliers,
    the output's included; :func:`gpvi_generator` passes them to g). With standard layers
    the fit of the stiff benchmark's stochastic volatility (D = 33) was close for about
    1000 steps, then the generator stretched one direction (its Jacobian's largest
    singular value went from 1.3 to 110) and the fit ended 2.75-3.02 posterior sds off at
    seeds 0-2 (``benchmarks/results/gpvi_parametrization.md``). Scaled layers (output
    multiplier 1/fan-in) and ntk layers both stop that. Over the eight stiff posteriors at
    seeds 0-3 the mean error was 0.589 with standard layers, 0.268 with scaled and 0.252
    with ntk ones (the banana 0.26 -> 0.21 from scaled to ntk, stochastic volatility 0.30
    -> 0.27), and the exact posteriors pass with all three
    (``benchmarks/results/ntk_screen_a.md``, ``ntk_screen_seeds23.md``). Build the guide
    with ``parametrization="standard"`` for the paper's layers.

    Costs per step: one model run on N particles, O(N^2 D) memory for V, and for the helper
    N^2 forward and double-backward passes of the generator (``exact_jacobian``: N
    Jacobians, O(N D^3); with :func:`gpvi_generator`'s k < D, O(N k^3 + N^2 k D) through the
    Woodbury identity; the paper found the exact solve less accurate in 5-D, Table 5).

    :param int num_particles: N, the size of each noise batch (paper: 100 for the toy
        tasks, 10 for large BNNs).
    :param exact_jacobian: ``True``: solve with the formed Jacobian; ``False``: the
        paper's helper network; ``"auto"`` (default): the exact solve up to D = 64
        (where it costs little and needs no helper to catch up with the generator: with
        the helper at its paper learning rate a 2000-step fit of a 5-D Gaussian stayed
        under-dispersed) and at any D for :func:`gpvi_generator`'s skip generator with
        k < D (solved through its k x k block, ``exact_inverse_jvp``), the helper
        otherwise.
    :param int helper_hidden: H, the helper's branch width (default ``clip(4 D, 10,
        512)``; the paper's tables use 10 for D = 3 up to 512-544).
    :param int helper_layers: helper layers after the concatenation (paper: 3).
    :param float helper_lr: the helper's Adam learning rate (paper: 1e-4 in every table,
        over 50k-500k steps). The helper must track the generator: with short runs and a
        fast generator rate raise it (benchmarks/results/gpvi.md: on Bayesian linear
        regression at generator rate 5e-2, helper 1e-3 gave a covariance error of 0.49,
        1e-2 gave 0.095); an under-trained helper shows as under-dispersed samples.
    :param callable helper_optim: ``params -> torch.optim.Optimizer`` replacing Adam.
    :param int helper_steps: helper updates per step on the same batch (paper: 1).
    :param kernel: kernel on the noise (default RBF with the median rule above).
    :param bool independent_batches: draw the batch that carries the gradient
        independently of the scored batch (paper); False reuses z' (half the generator
        work, a correlated estimate).
    :param int max_plate_nesting: the model's plate nesting (guessed if omitted).
    :param bool check_vectorization: check once that the model is safe under the particle
        plate.

    References

    [1] `Generative Particle Variational Inference via Estimation of Functional
        Gradients`, Roman Ratzlaff, Qinxun Bai, Li Fuxin, Wei Xu, ICML 2021.
    """

    # ntk layers: with standard ones the fit on the stiff benchmark's stochastic volatility
    # widened after ~1000 steps and ended 2.75-3.02 sds off at seeds 0-2; scaled and ntk
    # ones stop that, ntk a little closer (see the class docstring)
    guide_parametrization = "ntk"

    # the STL Gaussian fit: see ImplicitELBO.preconditioner_vi_estimator
    preconditioner_vi_estimator = "stl"

    pairing_hint = (
        "GPVI_ELBO needs an ImplicitGuide whose generator maps D noise values to the D "
        "latents with an invertible Jacobian: ImplicitGuide(model, "
        "generator=gpvi_generator()) (Ratzlaff et al., eq. 6). AmortizedSVGD_ELBO and "
        "KernelRatioELBO train any implicit guide."
    )

    def __init__(
        self,
        num_particles=64,
        exact_jacobian="auto",
        helper_hidden=None,
        helper_layers=3,
        helper_lr=1e-4,
        helper_optim=None,
        helper_steps=1,
        kernel=None,
        independent_batches=True,
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
        compile="fx",
    ):
        if helper_steps < 1:
            raise ValueError(f"helper_steps must be positive, got {helper_steps}")
        if not helper_lr > 0:
            raise ValueError(f"helper_lr must be positive, got {helper_lr}")
        super().__init__(
            num_particles,
            kernel,
            independent_batches,
            max_plate_nesting,
            check_vectorization,
            retain_graph,
            compile,
        )
        if exact_jacobian not in (True, False, "auto"):
            raise ValueError(
                f"exact_jacobian must be True, False or 'auto', got {exact_jacobian!r}"
            )
        self.exact_jacobian = exact_jacobian
        self.helper_hidden = helper_hidden
        self.helper_layers = int(helper_layers)
        self.helper_lr = float(helper_lr)
        self.helper_optim = helper_optim
        self.helper_steps = int(helper_steps)
        self.helper = None
        self.helper_optimizer = None
        self._probed = set()

    def _exact(self, gen):
        if self.exact_jacobian == "auto":
            return gen.out_dim <= _EXACT_MAX_DIM or has_low_rank_jacobian(gen)
        return self.exact_jacobian

    # -------------------------------------------------------------- guide checks
    def _check_packed_guide(self, guide, model_trace):
        if not isinstance(guide, ImplicitGuide):
            raise PairingError(
                f"GPVI_ELBO needs u = f(z) with f invertible, but {type(guide).__name__} "
                f"adds noise after its generator. {self._pairing_hint()}"
            )
        gen = guide.generator
        dim = guide.latent_dim
        if gen.noise_dim != dim or gen.out_dim != dim:
            raise ValueError(
                "GPVI needs a square generator Jacobian (Theorem 3.1, Sec. 3.2), but this "
                f"ImplicitGuide maps {gen.noise_dim} noise values to D={dim} latents. Set "
                "ImplicitGuide(model, generator=gpvi_generator()) (f(z) = g(z[:k]) + lambda z, "
                "eq. 6; k defaults to min(D, 64-128)), or noise_dim=D for a small model."
            )
        if id(gen) not in self._probed and dim <= _PROBE_MAX_DIM:
            self._probe_invertible(gen, dim)
            self._probed.add(id(gen))

    def _probe_invertible(self, gen, dim):
        ref = next(gen.parameters(), None)
        dtype = ref.dtype if ref is not None else torch.get_default_dtype()
        z = torch.randn(8, dim, dtype=dtype, device=None if ref is None else ref.device)
        with torch.no_grad():
            sv = torch.linalg.svdvals(jacobian(gen, z))
        ratio = (sv[:, -1] / sv[:, 0]).min()
        if not torch.isfinite(sv).all() or not ratio > _SINGULAR_RTOL:
            raise ValueError(
                f"the generator's Jacobian is singular (smallest/largest singular value "
                f"{ratio.item():.2g} at a random noise point), so q has no density and GPVI's "
                "J^{-T} does not exist. Use an invertible generator: ImplicitGuide(model, "
                "generator=gpvi_generator()) (f(z) = g(z[:k]) + lambda z, lambda > 0)."
            )

    # -------------------------------------------------------------- helper
    def _build_helper(self, active_dim, dim, dtype=None, device=None):
        hidden = self.helper_hidden or int(min(512, max(10, 4 * dim)))
        self.helper = InverseJacobianNetwork(active_dim, dim, hidden, self.helper_layers).to(
            dtype=dtype or torch.get_default_dtype(), device=device
        )
        params = list(self.helper.parameters())
        self.helper_optimizer = (
            self.helper_optim(params)
            if self.helper_optim is not None
            else torch.optim.Adam(params, lr=self.helper_lr)
        )

    def _ensure_helper(self, gen, ref):
        k = getattr(gen, "active_dim", gen.noise_dim)
        if self.helper is None:
            self._build_helper(k, gen.out_dim, ref.dtype, ref.device)
        elif (self.helper.active_dim, self.helper.dim) != (k, gen.out_dim):
            raise ValueError(
                f"this GPVI_ELBO's helper was built for k={self.helper.active_dim}, "
                f"D={self.helper.dim}, but the guide has k={k}, D={gen.out_dim}: use one "
                "GPVI_ELBO per guide"
            )

    def _helper_update(self, gen, z_score, v):
        """Algorithm 1, steps 4-6: one (or ``helper_steps``) least-squares step(s) of the
        helper on this batch; returns the loss before the first update."""
        params = list(self.helper.parameters())
        first = None
        for _ in range(self.helper_steps):
            with torch.enable_grad():
                loss = helper_residual(self.helper, gen, z_score, v).pow(2).mean()
                # only eta: the residual's graph also runs through the generator
                grads = torch.autograd.grad(loss, params)
            self.helper_optimizer.zero_grad(set_to_none=True)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            self.helper_optimizer.step()
            first = loss.item() if first is None else first
        return first

    def inverse_jvp(self, gen, z_score, v):
        r"""The repulsive vectors :math:`Y_{ab} \approx J_f(z'_a)^{-\top} v_{ab}`, ``(A,
        B, D)``, from the exact solve or the current helper (no update, no gradient)."""
        if self._exact(gen):
            return exact_inverse_jvp(gen, z_score, v)
        k = getattr(gen, "active_dim", gen.noise_dim)
        rows, vectors = _pairs(z_score, v)
        with torch.no_grad():
            return self.helper(rows[:, :k], vectors).reshape(v.shape)

    # -------------------------------------------------------------- direction
    def _direction(self, guide, draws, score, scale):
        gen = guide.generator
        z_score = draws.noise.detach()
        n = self.num_particles
        if self.independent_batches:
            z = torch.randn_like(z_score)
            sigma = self._bandwidth(z_score, z)
        else:
            z = z_score
            sigma = self._bandwidth(z_score)
        outputs = gen(z)
        d2 = squared_distances(z_score, z)
        # grad_{z'_a} k(z'_a, z_b) = 2 (z'_a - z_b) dk/dr, r = |z'_a - z_b|^2
        k, dk = kernel_and_derivative(self.kernel, d2, sigma)
        helper_loss = None
        if self._exact(gen):
            repulsion = scale * exact_kernel_repulsion(gen, z_score, z, dk)
        else:
            v = 2.0 * (z_score.unsqueeze(1) - z.unsqueeze(0)) * dk.unsqueeze(-1)  # (N', N, D)
            self._ensure_helper(gen, z_score)
            helper_loss = self._helper_update(gen, z_score, v)
            repulsion = scale * self.inverse_jvp(gen, z_score, v).sum(0)
        attraction = k.T @ score.detach()
        direction = -(attraction + repulsion) / n  # eq. (9): the functional gradient
        self.last_noise = (z_score, z.detach())
        self.diagnostics = {
            "bandwidth": float(sigma),
            "attraction": attraction.norm(dim=-1).mean().item() / n,
            "repulsion": repulsion.norm(dim=-1).mean().item() / n,
        }
        if helper_loss is not None:
            self.diagnostics["helper_loss"] = helper_loss
        return direction, outputs

    # -------------------------------------------------------------- checkpointing
    def state_dict(self):
        """The helper network and its optimiser (``None`` before the first step)."""
        if self.helper is None:
            return {"helper": None}
        return {
            "helper": self.helper.state_dict(),
            "optimizer": self.helper_optimizer.state_dict(),
            "dims": (self.helper.active_dim, self.helper.dim),
            "hidden": self.helper.noise_branch[0].out_features,
        }

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` (builds the helper if no step has run yet)."""
        if state.get("helper") is None:
            self.helper = self.helper_optimizer = None
            return
        ref = next(iter(state["helper"].values()))
        hidden, self.helper_hidden = self.helper_hidden, state["hidden"]
        try:
            self._build_helper(*state["dims"], dtype=ref.dtype, device=ref.device)
        finally:
            self.helper_hidden = hidden or state["hidden"]
        self.helper.load_state_dict(state["helper"])
        self.helper_optimizer.load_state_dict(state["optimizer"])
