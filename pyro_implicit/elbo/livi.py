r"""``LIVI_ELBO``: the linearised implicit-VI bounds of Uppal et al. (NeurIPS 2023).

For LIVI's guide :math:`u = g_\gamma(z) + \sigma\xi`
(:class:`~pyro_implicit.guides.LinearizedGuide`) the entropy of the marginal
:math:`q_\gamma(u)` is intractable. Linearising :math:`g_\gamma` around the z that
produced each draw turns :math:`q_\gamma` locally into the Gaussian
:math:`\mathcal N(g(z) - Jz,\ JJ^\top + \sigma^2 I_D)` (eqs. 8-12), and in the
small-:math:`\sigma` limit of App. A

.. math::
    H[q_\gamma] \approx \tfrac12\,\mathbb E_z \log\det\big(J(z)J(z)^\top + \sigma^2 I_D\big)
        + \tfrac D2 (1 + \log 2\pi) \qquad\text{(eq. 14)},

with :math:`J = \partial g_\gamma / \partial z \in \mathbb R^{D\times d}`. For a linear
generator eq. 14 is the exact entropy for every :math:`\sigma`; for a non-injective
:math:`g_\gamma` it over-estimates it, so the bounds below are approximations, not
guaranteed lower bounds of :math:`\log p(x)`.

* **L'** (``bound="det"``, eq. 15): the log-determinant at noise size d via Sylvester's
  identity, :math:`\log\det(JJ^\top + \sigma^2 I_D) = \log\det(J^\top J + \sigma^2 I_d) +
  (D - d)\log\sigma^2` (eq. 16; the :math:`D \times D` form when :math:`d > D`). Whole
  Jacobians per draw: :math:`O(Dd)` memory, :math:`O(Dd^2 + d^3)` time.
* **L''** (``bound="svd"``, eqs. 17-18): every singular value replaced by the smallest,
  :math:`s_1`: :math:`\tfrac d2\log(s_1^2 + \sigma^2) + \tfrac{D - d}{2}\log\sigma^2`
  (the printed eq. 18 drops the second term, which has no gradient; it is restored here so
  that the value is eq. 17's bound).
  :math:`s_1` comes from a few LOBPCG iterations on :math:`J^\top J` (App. C) built only
  from Jacobian-vector and vector-Jacobian products, so J is never formed: memory
  :math:`O(D + d)` per draw.

References

[1] `Implicit Variational Inference for High-Dimensional Posteriors`, Anshuk Uppal,
    Kristoffer Stensbo-Smidt, Wouter Boomsma, Jes Frellsen, NeurIPS 2023
    (arXiv:2310.06643), eqs. 14-18, App. A-C.
"""

import math
import warnings

import torch
from pyro.distributions.util import scale_and_mask
from torch.func import jvp, vjp

from ..compiled import BACKENDS
from ..contract import JACOBIAN
from ..guides.base import implicit_site_info
from ..guides.linearized import LinearizedGuide
from ..latent import preconditioner_of
from .base import (
    ImplicitELBO,
    auxiliary_site_value,
    implicit_guide_sites,
    packed_particles,
    particle_sum,
)

__all__ = ["LIVI_ELBO", "jacobian", "linearized_entropy", "smallest_singular_value"]

_BOUNDS = ("det", "svd")
#: largest S * D * d for which :func:`smallest_singular_value` forms the Jacobians of a
#: generator that offers them (16 MB in float32: UCI-sized networks); beyond it, L'' keeps
#: to matrix-free products and its O(D + d) memory per draw
_EXPLICIT_JACOBIAN_MAX = 2**22
_forward_ad_ready = False


def _prepare_forward_ad():
    """Import torch.func.jvp's decompositions once, silencing their one-off warning.

    On first use ``torch.func.jvp`` imports ``torch._decomp.decompositions_for_jvp``, which
    calls the deprecated ``torch.jit.script`` (a ``DeprecationWarning`` since torch 2.9,
    an error under ``-W error``); it is torch-internal, so it is silenced here.
    """
    global _forward_ad_ready
    if _forward_ad_ready:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script", category=DeprecationWarning)
        try:
            import torch._decomp.decompositions_for_jvp  # noqa: F401
        except ImportError:  # a future torch without it has nothing to prepare
            pass
    _forward_ad_ready = True


def _output_dim(generator, z):
    out_dim = getattr(generator, "out_dim", None)
    if out_dim is None:
        with torch.no_grad():
            out_dim = generator(z[:1]).shape[-1]
    return int(out_dim)


def jacobian(generator, z):
    r"""The Jacobian :math:`\partial g / \partial z` at every row of ``z``, ``(S, D, d)``,
    differentiable with respect to the generator's parameters.

    Forward mode (d JVPs) when :math:`d \le D`, reverse mode (D VJPs) otherwise, with the
    basis vectors batched alongside the draws in one :func:`torch.func.jvp` /
    :func:`torch.func.vjp` call (measured twice as fast as ``vmap(jacfwd(g))``);
    ``generator`` must map rows independently.

    A generator with a ``jacobian(z)`` method (e.g.
    :class:`~pyro_implicit.guides.MLPGenerator`, which builds J layer by layer) gives it
    directly: the same matrix, about twice as fast per LIVI step.

    :param generator: ``(..., d) -> (..., D)``, row-wise.
    :param torch.Tensor z: ``(S, d)``.
    """
    explicit = getattr(generator, "jacobian", None)
    if callable(explicit):
        return explicit(z.detach())
    _prepare_forward_ad()
    z = z.detach()
    num, d = z.shape
    out_dim = _output_dim(generator, z)
    if d <= out_dim:
        basis = torch.eye(d, dtype=z.dtype, device=z.device).unsqueeze(1).expand(d, num, d)
        primal = z.expand(d, num, d).contiguous()
        return jvp(generator, (primal,), (basis,))[1].movedim(0, -1)
    basis = torch.eye(out_dim, dtype=z.dtype, device=z.device).unsqueeze(1)
    primal = z.expand(out_dim, num, d).contiguous()
    rows = vjp(generator, primal)[1](basis.expand(out_dim, num, out_dim))[0]
    return rows.movedim(0, 1)


class _HalfLogDetGram(torch.autograd.Function):
    r""":math:`\tfrac12\log\det(A^\top A + v I)` of each matrix of an ``(S, m, k)`` batch,
    in float64, with the gradient :math:`A (A^\top A + v I)^{-1}` taken from the forward
    pass's Cholesky factor :math:`L L^\top = A^\top A + v I`: two triangular solves per
    draw, :math:`A L^{-\top} L^{-1}`, solved from the right. Autograd through the Cholesky
    factorisation costs about twice as much (measured on 100 draws of 40 x 40 Jacobians),
    and LIVI's step pays it on every draw; ``torch.cholesky_solve`` on the transposed
    problem (the same two solves from the left) took 2.0 ms against 1.3 ms here (best of
    15, 100 draws of 40 x 40, one CPU thread)."""

    @staticmethod
    def forward(ctx, a, var):
        a64 = a.to(torch.float64)
        gram = a64.mT @ a64
        gram.diagonal(dim1=-2, dim2=-1).add_(var)
        # float64 Cholesky: sigma^2 ~ 1e-6 sits next to O(1) eigenvalues
        chol = torch.linalg.cholesky(gram)
        ctx.save_for_backward(a64, chol)
        ctx.dtype = a.dtype
        return chol.diagonal(dim1=-2, dim2=-1).log().sum(-1).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a64, chol = ctx.saved_tensors
        solve = torch.linalg.solve_triangular
        a_chol_inv_t = solve(chol.mT, a64, upper=True, left=False)  # A L^{-T}
        a_gram_inv = solve(chol, a_chol_inv_t, upper=False, left=False)
        return (grad.to(torch.float64)[..., None, None] * a_gram_inv).to(ctx.dtype), None


def _log_det_entropy(generator, z, sigma, out_dim):
    """``0.5 log det(J J^T + sigma^2 I_D)`` per row of ``z``, from whole Jacobians."""
    if torch.is_tensor(sigma) and sigma.requires_grad:
        raise ValueError("sigma must be a fixed number: this entropy passes no gradient to it")
    d = z.shape[-1]
    var = float(sigma) ** 2
    jac = jacobian(generator, z)  # (S, D, d)
    if d <= out_dim:
        # Sylvester: det(J J^T + s I_D) = det(J^T J + s I_d) s^(D - d), a d x d matrix
        half_log_det = _HalfLogDetGram.apply(jac, var)
        rest = out_dim - d
    else:
        # more noise than outputs: J J^T has full rank, use it directly (D x D)
        half_log_det = _HalfLogDetGram.apply(jac.mT, var)
        rest = 0
    return half_log_det + 0.5 * rest * math.log(var)


def smallest_singular_value(generator, z, num_iterations=5, return_info=False):
    r"""The smallest of the :math:`k = \min(d, D)` singular values of each draw's Jacobian
    :math:`J(z_s) = \partial g / \partial z\,|_{z_s}`, matrix-free (LIVI App. C).

    Block LOBPCG with one vector, its residual and the previous search direction (Knyazev
    2001) on the :math:`k \times k` Gram matrix (:math:`J^\top J` when :math:`d \le D`,
    else :math:`JJ^\top`), using only :func:`torch.func.jvp` and :func:`torch.func.vjp`
    (or, for a generator with a ``jacobian(z)`` method and S D d at most
    ``_EXPLICIT_JACOBIAN_MAX``, products with its explicit Jacobians: the same
    iterations, faster at UCI size); the Rayleigh-Ritz step takes the smallest right
    singular vector of :math:`J V` for the orthonormal basis V (never squaring J's
    condition number). All draws are solved
    together: ``generator`` must map rows independently.

    Only the last product :math:`\|J v\|` is differentiable, with the eigenvector v
    detached: for a simple :math:`s_1` and a converged v this is the exact gradient
    (Hellmann-Feynman). With too few iterations the Ritz value over-estimates
    :math:`s_1`, and L'' is then not guaranteed to lie below L'; ``return_info`` reports
    the residual.

    :param generator: ``(..., d) -> (..., D)``, row-wise.
    :param torch.Tensor z: ``(S, d)`` noise values.
    :param int num_iterations: LOBPCG iterations (the authors' code: 5).
    :return: ``(S,)`` tensor :math:`s_1` (differentiable w.r.t. the generator's
        parameters); with ``return_info`` also a dict with the residual
        :math:`\|J^\top J v - s_1^2 v\|` per draw (some eigenvalue of :math:`J^\top J`
        lies within it of :math:`s_1^2`).
    """
    d = z.shape[-1]
    out_dim = _output_dim(generator, z)
    z = z.detach()
    explicit = getattr(generator, "jacobian", None)
    final = None  # the differentiable J x (J^T x when d > D); else ``apply`` with graph
    if callable(explicit) and z.shape[0] * out_dim * d <= _EXPLICIT_JACOBIAN_MAX:
        # J at hand for little cost: every product is a batched matrix-vector product
        jac = explicit(z)  # (S, D, d), with the graph for the one differentiable product
        if d > out_dim:
            jac = jac.mT
        matrix = jac.detach()

        # einsum: one batched product over the draws (broadcasting ``@`` would copy the
        # S matrices once per leading vector)
        def apply(v):  # (..., S, size) -> (..., S, out)
            return torch.einsum("sab,...sb->...sa", matrix, v)

        def adjoint(w):
            return torch.einsum("sab,...sa->...sb", matrix, w)

        def final(v):
            return torch.einsum("sab,sb->sa", jac, v)

        size = min(d, out_dim)
    elif d <= out_dim:
        _prepare_forward_ad()

        def apply(v):  # J v
            zz = z.expand(v.shape[:-1] + (d,)).contiguous()
            return jvp(generator, (zz,), (v,))[1]

        def adjoint(w):  # J^T w
            return vjp(generator, z)[1](w)[0]

        size = d
    else:
        _prepare_forward_ad()

        def apply(w):  # J^T w
            zz = z.expand(w.shape[:-1] + (d,)).contiguous()
            return vjp(generator, zz)[1](w)[0]

        def adjoint(v):  # J v
            return jvp(generator, (z,), (v,))[1]

        size = out_dim

    num = z.shape[0]
    if size <= 2:  # the first basis [x, residual] already spans R^size
        num_iterations = min(num_iterations, size - 1)
    with torch.no_grad():
        x = torch.randn(num, size, dtype=z.dtype, device=z.device)
        x = x / x.norm(dim=-1, keepdim=True)
        jx = apply(x)
        direction = None
        for _ in range(num_iterations):
            lam = jx.pow(2).sum(-1, keepdim=True)
            residual = adjoint(jx) - lam * x
            columns = [x, residual] + ([direction] if direction is not None else [])
            basis = torch.linalg.qr(torch.stack(columns, -1)).Q  # (S, k, m), orthonormal
            j_basis = apply(basis.movedim(-1, 0)).movedim(0, -1)  # (S, out, m)
            # Rayleigh-Ritz: the smallest right singular vector of J V, via the R factor
            r_factor = torch.linalg.qr(j_basis, mode="r").R
            coef = torch.linalg.svd(r_factor).Vh[..., -1, :].unsqueeze(-1)  # (S, m, 1)
            x = (basis @ coef).squeeze(-1)
            jx = (j_basis @ coef).squeeze(-1)  # by linearity: no extra product
            direction = (basis[..., 1:] @ coef[..., 1:, :]).squeeze(-1)
        x = x / x.norm(dim=-1, keepdim=True)
    # the one differentiable product, eigenvector held fixed (Hellmann-Feynman)
    jx = (final or apply)(x)
    s1 = jx.norm(dim=-1)
    if not return_info:
        return s1
    with torch.no_grad():
        jx = jx.detach()
        residual = adjoint(jx) - jx.pow(2).sum(-1, keepdim=True) * x
    return s1, {"residual": residual.norm(dim=-1), "num_iterations": num_iterations}


def linearized_entropy(generator, z, sigma, bound="det", num_iterations=5, return_info=False):
    r"""LIVI's entropy approximation per draw, including every constant.

    * ``bound="det"``: eq. 14, :math:`\tfrac12\log\det(J J^\top + \sigma^2 I_D) +
      \tfrac D2(1 + \log 2\pi)`, with the determinant computed at size
      :math:`\min(d, D)` (Sylvester, eq. 16).
    * ``bound="svd"``: eq. 17 plugged into eq. 14, :math:`\tfrac k2\log(s_1^2 + \sigma^2)
      + \tfrac{D - k}{2}\log\sigma^2 + \tfrac D2(1 + \log 2\pi)`, :math:`k = \min(d, D)`,
      :math:`s_1` from :func:`smallest_singular_value`.

    Differentiable with respect to the generator's parameters.

    :param generator: ``(..., d) -> (..., D)``, row-wise.
    :param torch.Tensor z: ``(S, d)`` base noise of the draws.
    :param float sigma: the guide's output noise, a fixed number (``"det"`` passes it no
        gradient, and refuses a tensor that asks for one).
    :return: ``(S,)`` tensor; with ``return_info`` also a dict of diagnostics.
    """
    if bound not in _BOUNDS:
        raise ValueError(f"bound must be one of {_BOUNDS}, got {bound!r}")
    out_dim = _output_dim(generator, z)
    const = 0.5 * out_dim * (1 + math.log(2 * math.pi))
    info = {}
    if bound == "det":
        entropy = _log_det_entropy(generator, z, sigma, out_dim) + const
    else:
        k = min(z.shape[-1], out_dim)
        s1, info = smallest_singular_value(generator, z, num_iterations, return_info=True)
        log_det = k * torch.log(s1.pow(2) + sigma**2) + (out_dim - k) * math.log(sigma**2)
        entropy = 0.5 * log_det + const
        info["smallest_singular_value"] = s1.detach()
        # relative error bound on s1^2 + sigma^2 (Weyl): the log-det term is accurate
        # for the eigenvalue found when this is small
        info["residual"] = info["residual"] / (s1.detach().pow(2) + sigma**2)
    return (entropy, info) if return_info else entropy


class LIVI_ELBO(ImplicitELBO):
    r"""LIVI's objective (Uppal et al. 2023, eq. 15 or eq. 18, reparameterised as in
    App. B) as a Pyro loss, for guides exposing ``generator`` and ``sigma`` such as
    :class:`~pyro_implicit.guides.LinearizedGuide`.

    Per step, in one vectorised trace of S particles :math:`u_s = g(z_s) + \sigma\xi_s`
    (model sites :math:`\theta_s` = ``biject_to`` of the pieces of :math:`u_s`):

    .. math::
        \hat{\mathcal L} = \frac1S \sum_{s=1}^S \Big[\log p(x, \theta_s)
            - \log\big|\tfrac{\partial u}{\partial\theta}\big|_s + \hat H(z_s)\Big],

    * :math:`\log p(x, \theta_s)`: every model site (latents' prior, observations,
      factors) with Pyro's plate and ``poutine.scale`` scaling, so ``subsample_size``
      minibatches are unbiased (the paper's (N/B) scaling);
    * :math:`\log|\partial u / \partial\theta|`: the log-density of the guide's
      ``biject_to`` Delta sites (and of any explicit guide site), subtracted as a guide
      log-density, which gives the entropy of q on the constrained space,
      :math:`H[q(\theta)] = H[q(u)] + \mathbb E\log|\partial\theta/\partial u|`;
    * :math:`\hat H(z_s)`: eq. 14 (``bound="det"``, L') or its eq. 17 lower bound
      (``bound="svd"``, L''), **with all constants** (:math:`\tfrac D2(1 + \log 2\pi)` and
      :math:`\tfrac{D - d}2\log\sigma^2`), at the z of the same draw, multiplied by the
      latent site's ``poutine.scale``. There is no :math:`\log q(z)` term: the base
      density enters eq. 14 only through :math:`\mathbb E[z^\top z] = d` (App. A).

    **What the returned loss is.** :math:`-\hat{\mathcal L}`, a Monte Carlo estimate of
    :math:`-\mathcal L'` (eq. 15) or :math:`-\mathcal L''` (eq. 18 with the constant of
    eq. 17 restored), on the same scale as :math:`-\log p(x)`. For a linear generator
    :math:`\mathcal L'` is the exact ELBO, so the loss is at least :math:`-\log p(x)` in
    expectation; for a non-linear generator eq. 14 is an approximation (it can
    over-estimate the entropy, e.g. of a non-injective g) and the value is not a
    guaranteed bound. Value and gradient are those of the estimate itself (pathwise through
    :math:`u_s`, and through J for the entropy; for L'' through :math:`\|Jv\|` with the
    LOBPCG eigenvector detached). :attr:`diagnostics` holds the last evaluation's
    ``elbo``, mean ``entropy`` and, for L'', the mean ``smallest_singular_value`` and the
    largest relative eigen-``residual`` (large values mean ``num_iterations`` is too
    small and :math:`s_1` is over-estimated).

    **The guide's layers.** A guide of this library built by this loss (its first call,
    ``parametrization="auto"``, in whitened coordinates) gets ntk generator layers
    (:class:`~pyro_implicit.guides.networks.ScaledLinear` with 1/sqrt(fan-in) multipliers,
    the output's included). With standard layers, under ``Adam(1e-2)`` the fit's final
    iterate kept moving near the exact-posterior bar: 4 of 20 default fits of the exact
    posteriors missed it at seeds 0-3 (correlation errors up to 0.112). With ntk layers
    all 20 passed, as with scaled ones, whose output multiplier of 1/fan-in made q slow to
    widen into a funnel or a banana. On the stiff posteriors at seeds 0-3 (mean error
    over four seeds, standard / scaled / ntk): the centred eight schools 0.21 / 0.35 /
    0.12, stochastic volatility 0.40 / 0.27 / 0.27, the banana 0.29 / 0.42 / 0.33, Neal's
    funnel 0.05 / 0.15 / 0.14; the other four within 0.05 of each other
    (``benchmarks/results/livi_parametrization.md``). On a funnel-shaped posterior build
    the guide with ``parametrization="standard"``, or non-centre the model. The papers'
    raw-space generators (``precondition=False``) keep standard layers.

    **Guide protocol** (capability ``"jacobian"``): the implicit latent site's
    ``infer["pyro_implicit"]`` record names its guide and, under ``"base_site"``, an
    auxiliary site holding the z of each draw (shape ``(..., d)``); the guide exposes
    ``generator`` (``(..., d) -> (..., D)``, mapping rows independently) and ``sigma``.
    Several such sites (e.g. in an ``AutoGuideList``) each add their own entropy. A guide
    without an implicit site (e.g. ``AutoNormal``) has an exact density; the loss is then
    the ordinary vectorised ELBO.

    **Paper vs official code.** The authors' code optimises a re-weighted objective
    (entropy and prior multiplied by ad-hoc factors, ``d log(s + sigma^2)`` in place of
    :math:`\tfrac d2\log(s^2 + \sigma^2)`, per-datapoint mean likelihoods). This class
    implements the paper's ELBO. ``entropy_weight`` and ``prior_weight`` reproduce the
    code's two weights (its ``jacobi_down_weight`` and ``prob_down_weight``); they default
    to 1 (off) and warn when changed.

    :param int num_particles: S, draws per step (default 8; the paper uses 1-2 for
        images: with 2 and a constant learning rate of 1e-2 the final iterate of a
        Beta-Bernoulli fit was 0.28 posterior sd off, with 8 it settles).
    :param str bound: ``"det"`` (L', eq. 15, whole Jacobians, :math:`O(Dd)` memory) or
        ``"svd"`` (L'', eq. 18, matrix-free, :math:`O(D + d)` memory).
    :param int num_iterations: LOBPCG iterations for ``bound="svd"`` (the authors' code:
        5).
    :param float entropy_weight: multiplies the entropy term (tempering; default 1).
    :param float prior_weight: multiplies the latents' prior log-density (tempering;
        default 1).
    :param int max_plate_nesting: the model's plate nesting (guessed if omitted).
    :param bool check_vectorization: check once that the model is safe under the
        particle plate (see :func:`~pyro_implicit.elbo.base.check_vectorized_log_joint`).
    :param compile: ``"fx"`` (default): after the first step, which traces the model and the guide
        through Pyro and checks them, a whole :class:`~pyro_implicit.guides.LinearizedGuide` is
        drawn directly and its draws scored by a traced graph of the model's log-density
        (:meth:`~pyro_implicit.latent.LatentSpace.compile`), then the linearised entropy at the same
        noise: the same loss, step for step, to float rounding; ``"inductor"`` also compiles that
        graph; ``False`` traces every step. Guide lists, a latent site under ``poutine.scale``,
        models with their own ``pyro.param`` and ``prior_weight`` other than 1 keep Pyro's traces.

    References

    [1] `Implicit Variational Inference for High-Dimensional Posteriors`, Anshuk Uppal,
        Kristoffer Stensbo-Smidt, Wouter Boomsma, Jes Frellsen, NeurIPS 2023
        (arXiv:2310.06643), eqs. 14-18, App. A-C.
    """

    required_capability = JACOBIAN
    pairing_hint = (
        "LIVI_ELBO needs a guide with a differentiable generator u = g(z) + sigma xi, "
        "i.e. LinearizedGuide; for a guide that can only be sampled (e.g. ImplicitGuide) "
        "use KernelRatioELBO."
    )
    min_particles = 1  # each draw's linearised entropy stands alone

    # ntk layers: with standard ones the final iterate wandered near the exact-posterior
    # bar, scaled ones were slow to widen (see the class docstring;
    # benchmarks/results/livi_parametrization.md)
    guide_parametrization = "ntk"

    # the STL Gaussian fit: see ImplicitELBO.preconditioner_vi_estimator
    preconditioner_vi_estimator = "stl"

    def __init__(
        self,
        num_particles=8,
        bound="det",
        num_iterations=5,
        entropy_weight=1.0,
        prior_weight=1.0,
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
        compile="fx",
    ):
        if compile not in (None, False) and compile not in BACKENDS:
            raise ValueError(f"compile must be False or one of {BACKENDS}, got {compile!r}")
        if bound not in _BOUNDS:
            raise ValueError(f"bound must be one of {_BOUNDS}, got {bound!r}")
        if num_iterations < 1:
            raise ValueError(f"num_iterations must be positive, got {num_iterations}")
        for name, weight in (("entropy_weight", entropy_weight), ("prior_weight", prior_weight)):
            if not weight > 0:
                raise ValueError(f"{name} must be positive, got {weight}")
            if weight != 1:
                warnings.warn(
                    f"LIVI_ELBO with {name}={weight}: this tempers the objective (as the "
                    "authors' code does) and is not the paper's ELBO (Uppal et al. 2023, "
                    "eq. 15/18); the fitted q is no longer a variational posterior.",
                    UserWarning,
                    stacklevel=2,
                )
        super().__init__(num_particles, max_plate_nesting, check_vectorization, retain_graph)
        self.bound = bound
        self.num_iterations = int(num_iterations)
        self.entropy_weight = float(entropy_weight)
        self.prior_weight = float(prior_weight)
        #: backend of the traced log-density of the steps after the first (``None``: every
        #: step traces the model and the guide through Pyro)
        self.compile = compile or None
        self._fast_spaces = {}  # (id(model), id(guide)) -> compiled LatentSpace, or None

    def _site_entropy(self, guide_trace, site):
        guide = implicit_site_info(site)["guide"]
        n, mpn = self.num_particles, self.max_plate_nesting
        z = packed_particles(auxiliary_site_value(guide_trace, site, "base_site"), n, mpn)
        entropy, details = linearized_entropy(
            guide.generator, z, guide.sigma, self.bound, self.num_iterations, return_info=True
        )
        # the generator draws whitened z; u = m + L z adds log |det L| to the entropy
        return entropy + preconditioner_of(guide).log_abs_det(), details

    def _loss_and_surrogate(self, model, guide, args, kwargs):
        key = (id(model), id(guide))
        if self._fast_spaces.get(key) is not None:
            out = self._fast_loss_and_surrogate(self._fast_spaces[key], guide, args, kwargs)
            if out is not None:
                return out
        out = self._traced_loss_and_surrogate(model, guide, args, kwargs)
        if self.compile and self.prior_weight == 1 and key not in self._fast_spaces:
            self._fast_spaces[key] = self._direct_space(model, guide, LinearizedGuide, args, kwargs)
        return out

    def _fast_loss_and_surrogate(self, space, guide, args, kwargs):
        """A step without Pyro traces: the guide drawn directly (its two noise draws, as its
        trace would consume the random stream, then ``g(z) + sigma xi``), the draws scored
        by the compiled graph, then the linearised entropy at the same z. ``None`` where
        the graph is unavailable or a draw is not finite (the traced step then runs and
        names the sites if the fit has diverged)."""
        if not space.compiled.active:
            return None
        n = self.num_particles
        with guide.drawing_directly():
            z = guide.standard_normal(n, guide.noise_dim)
            xi = guide.standard_normal(n, guide.latent_dim)
            u = guide.preconditioner.unwhiten(guide.generator(z) + guide.sigma * xi)
        log_target = self._compiled_log_target(space, u, args, kwargs)
        if log_target is None:
            return None
        self._last_traces = None
        entropy, details = linearized_entropy(
            guide.generator, z, guide.sigma, self.bound, self.num_iterations, return_info=True
        )
        entropy = entropy + preconditioner_of(guide).log_abs_det()
        return self._elbo_and_diagnostics(log_target, entropy, {"latent": details})

    def _elbo_and_diagnostics(self, log_target, entropy, diagnostics):
        """``(loss, surrogate)`` from the per-particle log target and entropy; records
        :attr:`diagnostics`."""
        elbo = (log_target + self.entropy_weight * entropy).mean()
        self.diagnostics = {"elbo": elbo.item(), "bound": self.bound}
        if torch.is_tensor(entropy):
            self.diagnostics["entropy"] = entropy.mean().item()
        if self.bound == "svd" and diagnostics:
            s1 = torch.cat([d["smallest_singular_value"] for d in diagnostics.values()])
            res = torch.cat([d["residual"] for d in diagnostics.values()])
            self.diagnostics["smallest_singular_value"] = s1.mean().item()
            self.diagnostics["residual"] = res.max().item()
        # the estimate is differentiable as it stands: value and surrogate coincide
        return -elbo.detach(), -elbo

    def _traced_loss_and_surrogate(self, model, guide, args, kwargs):
        model_trace, guide_trace = self._traces(model, guide, args, kwargs)
        n, mpn = self.num_particles, self.max_plate_nesting
        log_joint = self.log_joint_particles(model_trace)
        if self.prior_weight != 1:
            log_prior = sum(
                particle_sum(site["log_prob"], n, mpn) for site in self.latent_sites(model_trace)
            )
            log_joint = log_joint + (self.prior_weight - 1) * log_prior
        log_guide = self.explicit_guide_log_prob(guide_trace)
        entropy = 0.0
        diagnostics = {}
        for site in implicit_guide_sites(guide_trace):
            site_entropy, details = self._site_entropy(guide_trace, site)
            entropy = entropy + scale_and_mask(site_entropy, site["scale"], site["mask"])
            diagnostics[site["name"]] = details
        return self._elbo_and_diagnostics(log_joint - log_guide, entropy, diagnostics)
