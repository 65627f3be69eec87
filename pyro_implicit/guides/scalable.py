r"""LIVI's scalable generator: a shared matrix-multiplication trunk feeding many disconnected
matrix-multiplication sub-networks (Uppal et al., NeurIPS 2023, App. D, Fig. D.1).

A dense generator from d noise values to D outputs needs at least :math:`dD` weights,
which is out of reach for :math:`D = 10^6`-:math:`10^7`. The paper's *correlated*
matrix-multiplication network (CMMNN) instead

1. reshapes the noise into a small matrix and scales it up with shared
   matrix-multiplication layers (KIVI's MMNN layer, :math:`X \mapsto (A_l X + B_l) A_r +
   B_r`), which is where correlations *across* blocks of the output come from;
2. splits the trunk's output into K equal chunks, each the input of its own small MMNN
   (dense connections deeper in the network are pruned), which models correlations
   *within* a block;
3. concatenates the K output matrices (flattened row-major) and keeps the first D values.

The parameter count is about :math:`2D` (dominated by the last layer's per-output bias
:math:`B_r`), like the paper's "roughly twice as many parameters as the BNN", and one
forward pass costs :math:`O(D\,h)` for hidden matrices of side h. The K sub-networks run
as one batched matrix product (parameters stacked along a block axis), not a Python loop,
so K can be in the thousands.

The paper and the authors' code let blocks differ in size; here every block has the same
shape, which the authors' README allows ("they can all generate the same sized matrix")
and which keeps the sub-networks batched.
"""

import math

import torch
from torch import nn

from .networks import MatrixMultiplication

__all__ = ["BlockMatrixMultiplication", "CorrelatedMatrixGenerator", "matrix_shape"]


def matrix_shape(size):
    """A near-square ``(rows, cols)`` with ``rows * cols == size``: ``rows`` is the largest
    divisor of ``size`` not above its square root."""
    size = int(size)
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    rows = next(r for r in range(math.isqrt(size), 0, -1) if size % r == 0)
    return rows, size // rows


class BlockMatrixMultiplication(nn.Module):
    """K independent matrix-multiplication layers applied in one batched product:
    ``(..., K, M_in, N_in)`` to ``(..., K, M_out, N_out)``, block k computing
    ``(A_l[k] X_k + B_l[k]) A_r[k] + B_r[k]``."""

    def __init__(self, num_blocks, in_shape, out_shape):
        super().__init__()
        (m_in, n_in), (m_out, n_out) = in_shape, out_shape
        k = int(num_blocks)
        self.left = nn.Parameter(torch.randn(k, m_out, m_in) / math.sqrt(m_in))
        self.left_bias = nn.Parameter(torch.zeros(k, m_out, n_in))
        self.right = nn.Parameter(torch.randn(k, n_in, n_out) / math.sqrt(n_in))
        self.right_bias = nn.Parameter(torch.zeros(k, m_out, n_out))

    def forward(self, x):
        x = self.left @ x + self.left_bias
        return x @ self.right + self.right_bias


def _default_block_shape(out_dim):
    # one block for small D; 100 x 100 blocks (K = D / 10^4 sub-networks) beyond
    if out_dim <= 10_000:
        rows = math.isqrt(out_dim - 1) + 1
        return rows, -(-out_dim // rows)
    return 100, 100


class CorrelatedMatrixGenerator(nn.Module):
    r"""LIVI's correlated matrix-multiplication generator (CMMNN, App. D).

    ``noise (..., d) -> trunk -> K chunks -> K sub-networks -> (..., D)``, with ELU between
    layers and a linear last layer. It maps every leading index independently (row-wise),
    which the Jacobian-vector products of :class:`~pyro_implicit.elbo.LIVI_ELBO` rely on.

    :param int noise_dim: d; reshaped to ``noise_shape``.
    :param int out_dim: D.
    :param tuple noise_shape: the noise matrix (default: near-square factorisation of d).
    :param tuple trunk_shape: the shared hidden matrix (default ``(32, 32)``; the authors'
        code uses 250 x 500 for CIFAR).
    :param tuple block_in_shape: the chunk of the trunk's output each sub-network reads
        (default ``(16, 16)``).
    :param list block_hidden_shapes: hidden matrices of every sub-network (default one
        ``(32, 32)`` layer).
    :param tuple block_shape: the output matrix of every sub-network (default one block
        of about ``sqrt(D) x sqrt(D)`` up to D = 10^4, otherwise ``(100, 100)``); the
        number of sub-networks is ``K = ceil(D / prod(block_shape))``.
    """

    def __init__(
        self,
        noise_dim,
        out_dim,
        *,
        noise_shape=None,
        trunk_shape=(32, 32),
        block_in_shape=(16, 16),
        block_hidden_shapes=((32, 32),),
        block_shape=None,
    ):
        super().__init__()
        self.noise_dim = int(noise_dim)
        self.out_dim = int(out_dim)
        self.noise_shape = tuple(noise_shape or matrix_shape(self.noise_dim))
        if math.prod(self.noise_shape) != self.noise_dim:
            raise ValueError(f"noise_shape {self.noise_shape} does not hold d={self.noise_dim}")
        self.block_shape = tuple(block_shape or _default_block_shape(self.out_dim))
        self.block_in_shape = tuple(block_in_shape)
        self.num_blocks = -(-self.out_dim // math.prod(self.block_shape))
        k, (a, b) = self.num_blocks, self.block_in_shape
        self.trunk = nn.ModuleList(
            [
                MatrixMultiplication(self.noise_shape, tuple(trunk_shape)),
                # the split layer: K chunks of a x b stacked along the rows
                MatrixMultiplication(tuple(trunk_shape), (k * a, b)),
            ]
        )
        shapes = [self.block_in_shape, *[tuple(s) for s in block_hidden_shapes]]
        shapes.append(self.block_shape)
        self.blocks = nn.ModuleList(
            BlockMatrixMultiplication(k, s, t) for s, t in zip(shapes[:-1], shapes[1:], strict=True)
        )

    def forward(self, noise):
        batch = noise.shape[:-1]
        x = noise.reshape(batch + self.noise_shape)
        for layer in self.trunk:
            x = nn.functional.elu(layer(x))
        x = x.reshape(batch + (self.num_blocks,) + self.block_in_shape)
        for i, layer in enumerate(self.blocks):
            x = layer(x)
            if i < len(self.blocks) - 1:
                x = nn.functional.elu(x)
        return x.reshape(batch + (-1,))[..., : self.out_dim]

    @torch.no_grad()
    def init_output(self, loc, scale, num_probe=16):
        """Centre the output at ``loc`` with per-coordinate spread ``scale``: rescale the
        last layer's right factor, then shift its per-output bias. The probe batch is run
        in chunks so that memory stays O(D) at D = 10^7."""
        last = self.blocks[-1]
        last.left_bias.zero_()
        ref = last.right
        chunk = max(1, min(num_probe, 10_000_000 // max(self.out_dim, 1)))
        total = torch.zeros(self.out_dim, dtype=ref.dtype, device=ref.device)
        total_sq = torch.zeros_like(total)
        done = 0
        while done < num_probe:
            n = min(chunk, num_probe - done)
            out = self(torch.randn(n, self.noise_dim, dtype=ref.dtype, device=ref.device))
            total += out.sum(0)
            total_sq += out.pow(2).sum(0)
            done += n
        mean = total / num_probe
        var = (total_sq - num_probe * mean.pow(2)).clamp(min=0) / (num_probe - 1)
        spread = var.mean().sqrt()
        if spread > 0:
            last.right.mul_(scale / spread)
            mean = mean - last.right_bias.reshape(-1)[: self.out_dim]
            mean = mean * (scale / spread)
        else:
            mean = mean - last.right_bias.reshape(-1)[: self.out_dim]
        # the output is right @ (...) + right_bias, so scaling `right` scales the
        # bias-free part of the mean by the same factor
        bias = torch.zeros_like(last.right_bias).reshape(-1)
        bias[: self.out_dim] = loc.reshape(-1) - mean
        last.right_bias.copy_(bias.reshape(last.right_bias.shape))
