r"""GPVI's inverse-Jacobian products :math:`J_f(z)^{-\top} v` (Ratzlaff et al. 2021,
Sec. 3.3): the helper network that estimates them (eq. 9), its least-squares residual
(eqs. 10-11), and the exact solve ("GPVI Exact Jac", App. D.1). Pure functions and a
plain ``nn.Module``: :class:`~pyro_implicit.elbo.gpvi.GPVI_ELBO` uses them, and they can
be tested and reused alone.
"""

import torch
from torch import nn

from .livi import jacobian

__all__ = [
    "InverseJacobianNetwork",
    "exact_inverse_jvp",
    "exact_kernel_repulsion",
    "has_low_rank_jacobian",
    "helper_residual",
]


class InverseJacobianNetwork(nn.Module):
    r"""GPVI's helper network :math:`h_\eta(z'^{(:k)}, v) \approx J_f(z')^{-\top} v`
    (Sec. 3.3, eq. 9; architecture of App. B.1).

    One fully connected ReLU layer on each input (the k leading noise coordinates, on which
    the Jacobian of eq. 7 depends, and the D-vector v); the two branches are concatenated
    and passed through ``num_layers`` ReLU layers of width 2H and a linear output of size D.
    No batch norm, no weight decay (App. B.1: they hurt, the target being an exact
    solution).

    :param int active_dim: k.
    :param int dim: D.
    :param int hidden_dim: H, the width of each branch.
    :param int num_layers: hidden layers after the concatenation (paper: 3).
    """

    def __init__(self, active_dim, dim, hidden_dim, num_layers=3):
        super().__init__()
        self.active_dim, self.dim = int(active_dim), int(dim)
        self.noise_branch = nn.Sequential(nn.Linear(self.active_dim, hidden_dim), nn.ReLU())
        self.vector_branch = nn.Sequential(nn.Linear(self.dim, hidden_dim), nn.ReLU())
        layers, width = [], 2 * hidden_dim
        for _ in range(num_layers):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.trunk = nn.Sequential(*layers, nn.Linear(width, self.dim))

    def forward(self, noise_head, vector):
        joint = torch.cat([self.noise_branch(noise_head), self.vector_branch(vector)], dim=-1)
        return self.trunk(joint)


def _pairs(z, v):
    """Repeat each row of ``z`` ``(A, D)`` for the ``B`` vectors of ``v`` ``(A, B, D)``."""
    a, b, d = v.shape
    return z.detach().unsqueeze(1).expand(a, b, z.shape[-1]).reshape(a * b, -1), v.reshape(-1, d)


def helper_residual(helper, generator, z, v):
    r"""The residual :math:`J_f(z_a)^\top h_\eta(z_a^{(:k)}, v_{ab}) - v_{ab}` of the helper's
    least-squares loss (eqs. 10-11), whose minimiser is :math:`h = J_f^{-\top} v`.

    :math:`J_f^\top h` is one vector-Jacobian product through the generator (eq. 11; for a
    :class:`SkipGenerator` autograd gives exactly :math:`\mathrm{pad}(J_g^\top h) + \lambda
    h`), kept differentiable in h (``create_graph``) so the loss can be differentiated with
    respect to :math:`\eta`. Differentiate only with respect to the helper's parameters
    (``torch.autograd.grad``): the graph also runs through the generator's parameters.

    :param helper: an :class:`InverseJacobianNetwork`.
    :param generator: ``(..., D) -> (..., D)``, row-wise.
    :param torch.Tensor z: ``(A, D)`` noise points z'.
    :param torch.Tensor v: ``(A, B, D)`` vectors, B per noise point.
    :return: ``(A, B, D)`` residuals.
    """
    k = getattr(generator, "active_dim", z.shape[-1])
    rows, vectors = _pairs(z, v)
    with torch.enable_grad():
        rows = rows.requires_grad_()
        y = helper(rows.detach()[:, :k], vectors.detach())
        (jty,) = torch.autograd.grad(generator(rows), rows, grad_outputs=y, create_graph=True)
    return (jty - vectors.detach()).reshape(v.shape)


_SINGULAR = (
    "the generator's Jacobian is singular at a noise point, so J^{-T} v does not exist; GPVI "
    "needs an invertible generator: use ImplicitGuide(model, generator=gpvi_generator()) "
    "(f(z) = g(z[:k]) + lambda z, lambda > 0)"
)


def has_low_rank_jacobian(generator):
    r"""Whether ``generator`` is a skip generator :math:`f(z) = g(z^{(:k)}) + \lambda z`
    with k < D (:class:`~pyro_implicit.guides.implicit.SkipGenerator`, eq. 6), whose
    Jacobian the exact solve inverts through a k x k system (:func:`exact_inverse_jvp`)."""
    k = getattr(generator, "active_dim", None)
    return (
        callable(getattr(generator, "head_jacobian_factors", None))
        and k is not None
        and k < generator.out_dim
        and getattr(generator, "skip_scale", 0.0) > 0
    )


def _inverse_transposes(generator, z):
    r""":math:`J_f(z_a)^{-\top}` for every row of ``z``, ``(A, D, D)``, in ``z``'s dtype.

    Inverted in float64: a Jacobian far from orthogonal loses digits in float32."""
    with torch.no_grad():
        jac = jacobian(generator, z.detach())  # (A, D, D), rows = outputs
        try:
            return torch.linalg.inv(jac.mT.to(torch.float64)).to(jac.dtype)
        except torch.linalg.LinAlgError as e:
            raise ValueError(_SINGULAR) from e


def _low_rank_factors(generator, z):
    r"""``(L, W, C)`` for a skip generator with k < D: :math:`U_a = \partial g / \partial
    z^{(:k)}` at row a of ``z`` in factors, :math:`U_a^\top = L_a W^\top` (L ``(A, k, h)``,
    W ``(D, h)``, or ``None`` for the identity with h = D:
    ``SkipGenerator.head_jacobian_factors``), and :math:`C_a = (\lambda I_k +
    U_a^{(:k)\top})^{-1}`, ``(A, k, k)`` (inverted in float64).

    :math:`J_a^\top = \lambda I_D + E U_a^\top` with E the first k columns of
    :math:`I_D` (eq. 7), so by the Woodbury identity

    .. math:: J_a^{-\top} x = \big(x - E\, C_a U_a^\top x\big) / \lambda,

    one k x k inverse per row instead of a D x D one, and :math:`\det J_a =
    \lambda^{D-k} \det C_a^{-1}`: :math:`J_a` is singular exactly when :math:`C_a^{-1}` is.
    """
    k = generator.active_dim
    with torch.no_grad():
        left, right = generator.head_jacobian_factors(z.detach())
        block = left[..., :k] if right is None else left @ right[:k].mT  # U_a^(:k)T
        eye = torch.eye(k, dtype=torch.float64, device=left.device)
        try:
            c = torch.linalg.inv(generator.skip_scale * eye + block.to(torch.float64))
        except torch.linalg.LinAlgError as e:
            raise ValueError(_SINGULAR) from e
    return left, right, c.to(left.dtype)


def _low_rank_head(factors, x):
    r""":math:`C_a U_a^\top x`: ``(A, k, B)`` for ``x`` ``(A, B, D)`` (a batch per row) or
    ``(B, D)`` (the same batch for every row)."""
    left, right, c = factors
    y = x if right is None else x @ right  # W^T x: (A, B, h) or (B, h)
    return c @ (left @ y.mT)


def _low_rank_solve(generator, factors, x):
    r""":math:`J_a^{-\top} x_{ab}` for ``x`` ``(A, B, D)`` from :func:`_low_rank_factors`."""
    k = generator.active_dim
    out = x.clone()
    out[..., :k] -= _low_rank_head(factors, x).mT
    return out / generator.skip_scale


def exact_inverse_jvp(generator, z, v):
    r""":math:`J_f(z_a)^{-\top} v_{ab}` by a linear solve with the generator's Jacobian
    (GPVI "Exact Jac", App. D.1). Not differentiable.

    A skip generator with k < D (eq. 6) is solved through its k x k block
    (:func:`_low_rank_factors`, the Woodbury identity): one k x k inverse per noise point
    and products through the Jacobian's k non-zero columns, in factors, instead of a D x D
    inverse and :math:`O(A B D^2)` products, which makes the exact solve affordable at
    BNN sizes. Any other generator: one D x D inverse per noise point.

    :param generator: ``(..., D) -> (..., D)``, row-wise.
    :param torch.Tensor z: ``(A, D)``.
    :param torch.Tensor v: ``(A, B, D)``.
    :return: ``(A, B, D)``.
    """
    v = v.detach()
    if has_low_rank_jacobian(generator):
        with torch.no_grad():
            return _low_rank_solve(generator, _low_rank_factors(generator, z), v)
    # one inverse per noise point, then a batched product for its B vectors: 2-3x faster
    # on the CPU than torch's batched solve with B right-hand sides (D = 10-40, B = 100)
    return (_inverse_transposes(generator, z) @ v.mT).mT


def exact_kernel_repulsion(generator, z_score, z, dk):
    r"""The summed repulsion :math:`\sum_a J_f(z'_a)^{-\top} v_{ab}` of GPVI's eq. 9 with
    the exact solve, for the kernel gradients :math:`v_{ab} = \nabla_{z'_a} k(z'_a, z_b) =
    2 (z'_a - z_b)\, \partial_r k_{ab}` (:math:`r = \|z'_a - z_b\|^2`), without forming
    the ``(A, B, D)`` vectors:

    .. math:: \sum_a J_a^{-\top} v_{ab} = 2 \sum_a \partial_r k_{ab}\, J_a^{-\top} z'_a
        - 2 \Big(\sum_a \partial_r k_{ab}\, J_a^{-\top}\Big) z_b,

    the bracket one ``(B, A) x (A, D^2)`` product; for a skip generator with k < D
    (:func:`_low_rank_factors`) the bracket applied to :math:`z_b` is
    :math:`(\sum_a \partial_r k_{ab}\, z_b - E \sum_a \partial_r k_{ab}\, C_a U_a^\top
    z_b) / \lambda`, one ``(A, k, h) x (h, B)`` product after :math:`W^\top z_b`. The same
    vectors as ``exact_inverse_jvp(generator, z_score, v).sum(0)`` to rounding; GPVI's step on a
    40-coordinate hierarchical regression at 100 particles 13.5 -> 12.2 ms
    (``benchmarks/results/gpvi_repulsion.md``). Not differentiable.

    :param generator: ``(..., D) -> (..., D)``, row-wise.
    :param torch.Tensor z_score: ``(A, D)`` noise points :math:`z'`.
    :param torch.Tensor z: ``(B, D)`` noise points :math:`z`.
    :param torch.Tensor dk: ``(A, B)`` kernel derivatives :math:`\partial_r k_{ab}`.
    :return: ``(B, D)``.
    """
    a, d = z_score.shape
    dk, z_score, z = dk.detach(), z_score.detach(), z.detach()
    if has_low_rank_jacobian(generator):
        k, lam = generator.active_dim, generator.skip_scale
        factors = _low_rank_factors(generator, z_score)
        with torch.no_grad():
            own = _low_rank_solve(generator, factors, z_score.unsqueeze(1)).squeeze(1)
            # sum_a dk_ab J_a^{-T} z_b = (sum_a dk_ab z_b - E sum_a dk_ab C_a U_a^T z_b) / lam
            head = _low_rank_head(factors, z)  # (A, k, B)
            mixed = dk.sum(0).unsqueeze(-1) * z
            mixed[:, :k] -= torch.einsum("ab,akb->bk", dk, head)
            return 2.0 * (dk.mT @ own - mixed / lam)
    inv_t = _inverse_transposes(generator, z_score)  # (A, D, D)
    with torch.no_grad():
        own = (inv_t @ z_score.unsqueeze(-1)).squeeze(-1)  # J_a^{-T} z'_a, (A, D)
        mixed = (dk.mT @ inv_t.reshape(a, d * d)).reshape(-1, d, d)  # (B, D, D)
        return 2.0 * (dk.mT @ own - (mixed @ z.unsqueeze(-1)).squeeze(-1))
