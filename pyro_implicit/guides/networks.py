"""Generator networks: maps from standard-normal noise to packed latents.

Every generator is an ``nn.Module`` with attributes ``noise_dim`` and ``out_dim``, maps
``(..., noise_dim)`` to ``(..., out_dim)`` for any leading batch shape, and implements
:meth:`init_output` so a guide can centre its initial output at ``init_loc`` with a chosen
spread (Pyro's ``init_loc_fn`` / ``init_scale`` meaning).

* :class:`MLPGenerator`: a fully connected network (KIVI's UCI generators, Table 3).
* :class:`MatrixGenerator`: KIVI's matrix-multiplication network (MMNN, Algorithm 2) whose
  parameter count grows with ``M + N`` instead of ``M N`` for an ``M x N`` weight matrix.
* :class:`BlockGenerator`: independent generators for blocks of the latent vector, so q
  factorises across blocks (KIVI's layer-wise posterior, Sec. 3.1).
"""

import math

import torch
from torch import nn

from ..errors import check_count

__all__ = [
    "BlockGenerator",
    "MLPGenerator",
    "MatrixGenerator",
    "MatrixMultiplication",
    "ScaledLinear",
]

#: the negative slope of ``"leaky_relu"``: a unit switched off for every draw still passes
#: a gradient, which Adam's per-parameter scaling turns into full-size steps, so it can
#: come back (a plain ReLU unit cannot)
LEAKY_SLOPE = 0.01

_ACTIVATIONS = {
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(LEAKY_SLOPE),
    "tanh": nn.Tanh,
    "elu": nn.ELU,
    "softplus": nn.Softplus,
}

#: derivative of each activation from its input ``pre`` and output ``out`` (ELU with
#: alpha = 1 and Softplus with beta = 1, PyTorch's defaults, as :func:`_activation` builds)
_DERIVATIVES = {
    "relu": lambda pre, out: (pre > 0).to(pre.dtype),
    "leaky_relu": lambda pre, out: torch.where(pre > 0, 1.0, LEAKY_SLOPE).to(pre.dtype),
    "tanh": lambda pre, out: 1 - out.pow(2),
    "elu": lambda pre, out: torch.where(pre > 0, torch.ones_like(out), out + 1),
    "softplus": lambda pre, out: torch.sigmoid(pre),
}


def _activation(name):
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; choose from {sorted(_ACTIVATIONS)}"
        ) from None


class ScaledLinear(nn.Module):
    r"""A linear layer whose weight is a fixed multiple of the stored parameter,
    :math:`W = c\,V` (``weight`` is :math:`W`; the optimiser sees :math:`V`, ``raw_weight``).

    Adam moves every stored value by about its learning rate per step whatever the
    gradient's size, so a standard layer of fan-in :math:`n` (entries of order
    :math:`1/\sqrt n`) can move each output by up to :math:`n` learning rates in one step
    when the updates agree in sign. With :math:`V` of order one and :math:`c = 1/\sqrt n`
    (hidden layers: the NTK parametrisation) the bound is :math:`\sqrt n` learning rates,
    and with :math:`c = 1/n` (the output layer, as in the maximal-update parametrisation,
    Yang et al., *Tensor Programs V*, 2022) one. Initialised from a
    :class:`torch.nn.Linear`: the same function.
    """

    def __init__(self, linear, multiplier):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.multiplier = float(multiplier)
        self.raw_weight = nn.Parameter(linear.weight.detach() / self.multiplier)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    @property
    def weight(self):
        """The weight in use, c V."""
        return self.raw_weight * self.multiplier

    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, multiplier={self.multiplier:.3g}"


def _stored(layer):
    """The parameter an optimiser updates for ``layer``'s weight."""
    return layer.raw_weight if isinstance(layer, ScaledLinear) else layer.weight


@torch.no_grad()
def _rescale_to_spread(module, scale_param, bias_param, loc, scale, num_probe=None):
    """Multiply the output weight so the mean per-coordinate standard deviation of the
    output over a probe batch of noise is ``scale``, then shift the output bias so the
    probe mean is ``loc`` (hidden ReLU features have a non-zero mean)."""
    if num_probe is None:
        # enough draws for a stable spread; fewer for BNN-sized outputs, where each draw
        # is a whole weight matrix
        num_probe = int(min(512, max(16, 4e6 // module.out_dim)))
    noise = torch.randn(
        num_probe, module.noise_dim, dtype=scale_param.dtype, device=scale_param.device
    )
    spread = module(noise).std(0).mean()
    if spread > 0:
        scale_param.mul_(scale / spread)
    offset = module(noise).mean(0).reshape(bias_param.shape) - bias_param
    bias_param.copy_(loc.reshape(bias_param.shape) - offset)


@torch.no_grad()
def shrink_output_rows(module, rows, factor):
    """Multiply the spread of a generator's outputs ``rows`` by ``factor`` about their
    mean over a probe batch of noise (the bias moves so that the mean stays), e.g. to
    start some outputs nearly constant."""
    bias = module.output.bias
    noise = torch.randn(512, module.noise_dim, dtype=bias.dtype, device=bias.device)
    before = module(noise)[:, rows].mean(0)
    _stored(module.output)[rows].mul_(factor)
    bias[rows] += before - module(noise)[:, rows].mean(0)


#: the values of :class:`MLPGenerator`'s ``scaled``
SCALED_LAYERS = (False, True, "ntk")


class MLPGenerator(nn.Module):
    """Fully connected generator ``u = W_L a(... a(W_1 eps + b_1) ...) + b_L``.

    :param int noise_dim: input noise size.
    :param int out_dim: output size.
    :param tuple hidden_dims: hidden layer widths (may be empty: an affine map, whose
        pushforward of N(0, I) is the Gaussian N(b, W W^T)).
    :param str activation: ``"relu"`` (KIVI), ``"tanh"``, ``"elu"`` or ``"softplus"``.
    :param bool skip: add the identity skip ``s * eps[:k]`` (zero-padded,
        ``k = min(noise_dim, out_dim)``) to the output, so the network learns a residual
        on top of a Gaussian; :meth:`init_output` then starts the residual near zero on
        those k coordinates, so the pushforward starts at :math:`N(loc, scale^2 I)`
        (the preconditioned guides' start at their Gaussian fit).
    :param scaled: ``True``: every layer a :class:`ScaledLinear` (multipliers
        1/sqrt(fan-in) for the hidden layers, 1/fan-in for the output), so that one Adam
        step cannot move the output by a layer width's worth of learning rates; ``"ntk"``:
        1/sqrt(fan-in) at the output too (the NTK parametrisation, Jacot et al. 2018), so
        one step moves the output by up to sqrt(width) learning rates, between standard
        and scaled layers; ``False``: PyTorch's ``nn.Linear``. The same function at
        initialisation.
    """

    def __init__(
        self, noise_dim, out_dim, hidden_dims=(), activation="relu", skip=False, scaled=False
    ):
        super().__init__()
        self.noise_dim = check_count("noise_dim", noise_dim)
        self.out_dim = check_count("out_dim", out_dim)
        for width in hidden_dims:
            check_count("each of hidden_dims", width)
        self.activation = activation
        self.skip = bool(skip)
        self.skip_dim = min(self.noise_dim, self.out_dim) if self.skip else 0
        # the skip's scale s (set by init_output); a buffer: it is not learned
        self.register_buffer("skip_scale", torch.ones(()), persistent=self.skip)
        if scaled not in SCALED_LAYERS:
            raise ValueError(f"scaled must be one of {SCALED_LAYERS}, got {scaled!r}")
        self.scaled = scaled if scaled == "ntk" else bool(scaled)
        layers = []
        width = self.noise_dim
        for h in hidden_dims:
            linear = nn.Linear(width, h)
            if self.scaled:
                linear = ScaledLinear(linear, width**-0.5)
            layers += [linear, _activation(activation)]
            width = h
        self.hidden = nn.Sequential(*layers)
        self.output = nn.Linear(width, self.out_dim)
        if self.scaled:
            multiplier = width**-0.5 if self.scaled == "ntk" else 1.0 / width
            self.output = ScaledLinear(self.output, multiplier)

    def forward(self, noise):
        out = self.output(self.hidden(noise))
        if not self.skip:
            return out
        k = self.skip_dim
        head = out[..., :k] + self.skip_scale * noise[..., :k]
        return torch.cat([head, out[..., k:]], dim=-1)

    def hidden_jacobian(self, noise):
        r"""The last hidden layer's Jacobian in the noise, transposed, at every row of
        ``noise``: ``(..., noise_dim, width)``, or ``None`` for an affine generator (no
        hidden layer). :meth:`jacobian` is ``output.weight @ hidden_jacobian(noise).mT``
        (plus the skip's identity block); differentiable with respect to the parameters."""
        derivative = _DERIVATIVES[self.activation]
        # built transposed, (..., noise_dim, width): each layer's product is then one
        # matrix product over every row (rows x W^T), not a batch of small ones (a 40 x 40
        # Jacobian of 100 rows through 80-wide layers: 2.2 -> 1.5 ms)
        h, jac_t = noise, None  # None: the identity
        layers = list(self.hidden)
        for linear, act in zip(layers[::2], layers[1::2], strict=True):
            pre = linear(h)
            h = act(pre)
            weight_t = linear.weight.mT
            # the first layer's copy is contiguous so the products after it fold into one
            # matrix product (matmul batches a strided one instead)
            jac_t = weight_t.contiguous() if jac_t is None else jac_t @ weight_t
            jac_t = jac_t * derivative(pre, h).unsqueeze(-2)
        return jac_t

    def jacobian(self, noise):
        r"""The Jacobian :math:`\partial u / \partial \epsilon` at every row of ``noise``,
        ``(..., out_dim, noise_dim)``, built layer by layer
        (:math:`J = W_L\,\mathrm{diag}(a'_{L-1})\,W_{L-1} \cdots \mathrm{diag}(a'_1)\,W_1`)
        and differentiable with respect to the parameters.

        Used by :func:`pyro_implicit.elbo.livi.jacobian` in place of automatic
        differentiation in :math:`\epsilon`: the same matrix at a fraction of the cost of
        batched forward-mode products (which carry their own autograd graph).
        """
        jac_t = self.hidden_jacobian(noise)
        weight = self.output.weight
        if jac_t is None:  # an affine generator: the same J for every row
            jac = weight.expand(noise.shape[:-1] + weight.shape)
        else:
            jac = (jac_t @ weight.mT).mT
        if self.skip:
            k = self.skip_dim
            eye = torch.zeros(self.out_dim, self.noise_dim, dtype=jac.dtype, device=jac.device)
            eye[:k, :k] = torch.eye(k, dtype=jac.dtype, device=jac.device)
            jac = jac + self.skip_scale * eye
        return jac

    @torch.no_grad()
    def recycle_dead_units(self, num_draws=512):
        """Give every hidden ReLU unit that is off for all of ``num_draws`` fresh noise draws
        new incoming weights (PyTorch's ``nn.Linear`` initialisation, in the layer's own
        parametrisation) and zero outgoing ones: the generator computes the same function,
        and the unit can learn again (Sokar et al. 2023, "The dormant neuron phenomenon",
        ReDo). Returns the number of units recycled (0 for other activations).

        Under ``SteinScoreELBO`` on a near-Gaussian posterior every unit switches off, so a
        fitted guide keeps its width when the posterior later moves
        (``benchmarks/results/audit_probes_s59.md``)."""
        if self.activation != "relu" or not len(self.hidden):
            return 0
        linears = list(self.hidden)[::2]
        param = self.output.bias
        h = torch.randn(num_draws, self.noise_dim, dtype=param.dtype, device=param.device)
        recycled = 0
        for i, linear in enumerate(linears):
            pre = linear(h)
            dead = ~(pre > 0).any(0)
            if dead.any():
                fresh = nn.Linear(linear.in_features, linear.out_features)
                fresh = fresh.to(dtype=param.dtype, device=param.device)
                scale = linear.multiplier if isinstance(linear, ScaledLinear) else 1.0
                _stored(linear)[dead] = fresh.weight[dead] / scale
                linear.bias[dead] = fresh.bias[dead]
                after = linears[i + 1] if i + 1 < len(linears) else self.output
                _stored(after)[:, dead] = 0.0
                recycled += int(dead.sum())
                pre = linear(h)
            h = torch.relu(pre)
        return recycled

    def init_output(self, loc, scale):
        """Centre the output at ``loc`` with per-coordinate spread ``scale`` (with
        ``skip``: the skip carries that spread on its k coordinates and the residual
        starts at a hundredth of it there)."""
        stored = _stored(self.output)
        if not self.skip:
            _rescale_to_spread(self, stored, self.output.bias, loc, scale)
            return
        with torch.no_grad():
            self.skip_scale.fill_(float(scale))
            bias = self.output.bias
            noise = torch.randn(512, self.noise_dim, dtype=bias.dtype, device=bias.device)
            hidden = self.hidden(noise)
            spread = (hidden @ self.output.weight.T).std(0).clamp(min=1e-12)
            target = torch.full_like(spread, float(scale))
            target[: self.skip_dim] *= 0.01
            stored.mul_((target / spread)[:, None])
            bias.copy_(loc.reshape(bias.shape) - (hidden @ self.output.weight.T).mean(0))


class MatrixMultiplication(nn.Module):
    """One matrix-multiplication layer of KIVI's MMNN (Algorithm 2, lines 2-3):
    ``X <- A_l X + B_l`` then ``X <- X A_r + B_r``, mapping ``(M_in, N_in)`` matrices to
    ``(M_out, N_out)``. Parameters: ``M_out M_in + M_out N_in + N_in N_out + M_out N_out``.
    """

    def __init__(self, in_shape, out_shape):
        super().__init__()
        (m_in, n_in), (m_out, n_out) = in_shape, out_shape
        self.left = nn.Parameter(torch.randn(m_out, m_in) / math.sqrt(m_in))
        self.left_bias = nn.Parameter(torch.zeros(m_out, n_in))
        self.right = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.right_bias = nn.Parameter(torch.zeros(m_out, n_out))

    def forward(self, x):
        x = self.left @ x + self.left_bias
        return x @ self.right + self.right_bias


class MatrixGenerator(nn.Module):
    """KIVI's Matrix Multiplication Neural Network (MMNN, Algorithm 2) as a generator.

    Noise of shape ``noise_shape`` (flattened on input) passes through matrix-multiplication
    layers with ReLU between them; the last layer is linear and outputs an
    ``out_shape`` matrix, flattened row-major.

    :param tuple noise_shape: ``(M_0, N_0)`` (KIVI uses 30 x 30).
    :param tuple out_shape: ``(M, N)``, the weight matrix shape.
    :param list hidden_shapes: shapes of the hidden matrices (KIVI: two of ``N x N``).
    """

    def __init__(self, noise_shape, out_shape, hidden_shapes=()):
        super().__init__()
        self.noise_shape = tuple(int(s) for s in noise_shape)
        self.out_shape = tuple(int(s) for s in out_shape)
        if len(self.noise_shape) != 2 or len(self.out_shape) != 2:
            raise ValueError("MatrixGenerator needs 2-D noise_shape and out_shape")
        self.noise_dim = self.noise_shape[0] * self.noise_shape[1]
        self.out_dim = self.out_shape[0] * self.out_shape[1]
        shapes = [self.noise_shape, *[tuple(s) for s in hidden_shapes], self.out_shape]
        self.layers = nn.ModuleList(
            MatrixMultiplication(a, b) for a, b in zip(shapes[:-1], shapes[1:], strict=True)
        )

    def forward(self, noise):
        x = noise.reshape(noise.shape[:-1] + self.noise_shape)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x.reshape(x.shape[:-2] + (self.out_dim,))

    def init_output(self, loc, scale):
        """Centre the output at ``loc`` with per-coordinate spread ``scale``."""
        last = self.layers[-1]
        with torch.no_grad():
            last.left_bias.zero_()
        _rescale_to_spread(self, last.right, last.right_bias, loc, scale)


class BlockGenerator(nn.Module):
    """Independent generators for consecutive blocks of the latent vector.

    The noise vector is split into the blocks' noise and the outputs are concatenated, so
    the pushforward factorises across blocks: q(u) = prod_b q_b(u_b).

    :param list generators: generator modules, in latent order.
    :param list names: a name per block (e.g. the model site), for :attr:`groups`.
    """

    def __init__(self, generators, names=None):
        super().__init__()
        self.blocks = nn.ModuleList(generators)
        self.names = list(names) if names is not None else [str(i) for i in range(len(generators))]
        self.noise_sizes = [g.noise_dim for g in self.blocks]
        self.out_sizes = [g.out_dim for g in self.blocks]
        self.noise_dim = sum(self.noise_sizes)
        self.out_dim = sum(self.out_sizes)

    def forward(self, noise):
        parts = noise.split(self.noise_sizes, dim=-1)
        return torch.cat([g(e) for g, e in zip(self.blocks, parts, strict=True)], dim=-1)

    def init_output(self, loc, scale):
        for g, part in zip(self.blocks, loc.split(self.out_sizes, dim=-1), strict=True):
            g.init_output(part, scale)
