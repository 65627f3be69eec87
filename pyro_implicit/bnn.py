"""Bayesian neural networks written as Pyro models, vectorised over posterior samples.

The models follow the layout of KIVI (Shi, Sun & Zhu, 2018, Sec. 3.1 and App. E): one
latent site per layer, ``"layer{i}"``, holding the bias-augmented weight matrix of shape
``(in_features + 1, out_features)`` with the bias in the last row, a standard normal prior
(scaled by ``prior_scale``), and for regression a ``Gamma(6, 6)`` prior on the observation
noise precision.

Every forward pass is written with broadcasting matrix products, so one call evaluates the
network for any number of weight samples at once. That is what makes
``Predictive(..., parallel=True)`` and ``Trace_ELBO(vectorize_particles=True)`` work
without a Python loop over samples.

Shapes inside the model. The weights are global (sampled outside the data plate), so under
an outer plate, such as an ELBO's particle plate or ``Predictive``'s sample plate at dim -2,
a weight value has shape ``(S, 1, in + 1, out)``: the ``1`` is the slot of the data plate.
The model drops that slot before the forward pass, so the function values come out as
``(S, n)``, aligned with the plates (samples at dim -2, data at dim -1). Keeping the slot
would give ``(S, 1, n)``, which the data plate would broadcast against the ``S`` samples
into an ``(S, S, n)`` likelihood.
"""

import contextlib

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints

from .latent import NETWORK_WEIGHTS

__all__ = ["BNNClassification", "BNNRegression", "mlp_forward"]

_ACTIVATIONS = {
    "relu": torch.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "elu": F.elu,
    "softplus": F.softplus,
    "gelu": F.gelu,
}


def _activation(activation):
    if callable(activation):
        return activation
    try:
        return _ACTIVATIONS[activation]
    except KeyError:
        raise ValueError(
            f"Unknown activation {activation!r}; use one of {sorted(_ACTIVATIONS)} or a callable."
        ) from None


def mlp_forward(weights, x, activation=torch.relu):
    """Forward pass of an MLP with bias-augmented weight matrices, batched over weight samples.

    Layer ``i`` computes ``h @ W[..., :-1, :] + W[..., -1:, :]`` (the last row of each
    matrix is the bias), followed by ``activation`` on all layers but the last. Leading
    batch dimensions of the weights and of ``x`` broadcast as in :func:`torch.matmul`.

    :param weights: the weight matrices in layer order, each of shape
        ``batch + (in_features + 1, out_features)``.
    :type weights: list[torch.Tensor]
    :param torch.Tensor x: inputs of shape ``(..., n, in_features)``.
    :param callable activation: elementwise nonlinearity of the hidden layers.
    :returns: outputs of shape ``broadcast(batch, ...) + (n, out_features_of_last_layer)``.
    :rtype: torch.Tensor
    """
    h = x
    last = len(weights) - 1
    for i, w in enumerate(weights):
        if w.shape[-2] != h.shape[-1] + 1:
            raise ValueError(
                f"Layer {i}: weight matrix of shape {tuple(w.shape[-2:])} does not fit inputs "
                f"with {h.shape[-1]} features (expected {h.shape[-1] + 1} rows: the last row "
                "is the bias)."
            )
        # h @ W + b without concatenating a column of ones (saves a copy of h per layer)
        h = torch.matmul(h, w[..., :-1, :]) + w[..., -1:, :]
        if i < last:
            h = activation(h)
    return h


def _drop_data_slot(w, max_plate_nesting):
    """Remove the size-1 data-plate slots from the batch shape of a global weight value.

    A global site's value under outer plates has shape
    ``outer + (1,) * max_plate_nesting + event``; removing those size-1 dims puts the
    sample dimensions of the network output right where the plates expect them. Values
    without such slots (e.g. ``(S, in + 1, out)`` stacked MCMC draws handed to
    ``Predictive``) are left alone: their ``S`` already lands at dim -2 of the output.
    """
    batch_ndim = w.dim() - 2
    k = min(max_plate_nesting, batch_ndim)
    if k > 0 and all(s == 1 for s in w.shape[batch_ndim - k : batch_ndim]):
        w = w.reshape(w.shape[: batch_ndim - k] + w.shape[batch_ndim:])
    return w


class _BNNBase:
    """Shared code of :class:`BNNRegression` and :class:`BNNClassification`."""

    #: the data plate is the only plate of the model
    max_plate_nesting = 1

    def __init__(self, in_dim, out_dim, hidden_dims, activation, prior_scale):
        if int(in_dim) != in_dim or in_dim < 1:
            raise ValueError(f"in_dim must be a positive int, got {in_dim!r}.")
        hidden_dims = tuple(hidden_dims)
        if any(int(h) != h or h < 1 for h in hidden_dims):
            raise ValueError(f"hidden_dims must be positive ints, got {hidden_dims!r}.")
        self.in_dim = int(in_dim)
        self.hidden_dims = tuple(int(h) for h in hidden_dims)
        self.activation = activation
        self._act = _activation(activation)
        dims = (self.in_dim,) + self.hidden_dims + (int(out_dim),)
        #: ``(in_features + 1, out_features)`` of each layer, bias row included
        self.layer_shapes = [(dims[i] + 1, dims[i + 1]) for i in range(len(dims) - 1)]
        if isinstance(prior_scale, str):
            if prior_scale != "fan_out":
                raise ValueError(
                    f"prior_scale must be a positive number, a sequence of them or 'fan_out', "
                    f"got {prior_scale!r}."
                )
            scales = [out**-0.5 for _, out in self.layer_shapes]
        elif isinstance(prior_scale, (list, tuple)):
            if len(prior_scale) != len(self.layer_shapes):
                raise ValueError(
                    f"prior_scale has {len(prior_scale)} entries for {len(self.layer_shapes)} "
                    "layers."
                )
            scales = [float(s) for s in prior_scale]
        else:
            scales = [float(prior_scale)] * len(self.layer_shapes)
        if not all(s > 0 for s in scales):
            raise ValueError(f"prior_scale must be positive, got {prior_scale!r}.")
        #: the prior scale as given (a float for the KIVI default)
        self.prior_scale = (
            prior_scale
            if isinstance(prior_scale, str)
            else (scales[0] if not isinstance(prior_scale, (list, tuple)) else tuple(scales))
        )
        #: standard deviation of each layer's weight prior
        self.layer_prior_scales = scales
        #: names of the weight sites, in layer order
        self.layer_names = [f"layer{i}" for i in range(len(self.layer_shapes))]

    @property
    def num_weights(self):
        """Total number of network weights (biases included)."""
        return sum(a * b for a, b in self.layer_shapes)

    def _check_x(self, x):
        if not torch.is_tensor(x) or x.dim() != 2 or x.shape[1] != self.in_dim:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (n, {self.in_dim}), got {shape}.")

    @contextlib.contextmanager
    def _data_plate(self, x, y, subsample_size):
        """The data plate (dim -1; minibatch indices drawn on the data's device), yielding
        the rows of ``x`` and ``y`` it selects."""
        plate = pyro.plate(
            "data", x.shape[0], subsample_size=subsample_size, dim=-1, device=x.device
        )
        with plate as idx:
            yb = None if y is None else self._subsample(y, idx, subsample_size)
            yield self._subsample(x, idx, subsample_size), yb

    def _check_data(self, x, y):
        """Check the inputs and, unless ``None``, the targets (one per row of ``x``)."""
        self._check_x(x)
        n = x.shape[0]
        if y is not None and (not torch.is_tensor(y) or y.shape != (n,)):
            shape = tuple(y.shape) if torch.is_tensor(y) else type(y).__name__
            raise ValueError(f"y must be a tensor of shape ({n},) like x's rows, got {shape}.")

    def _weights_list(self, weights):
        try:
            return [weights[name] for name in self.layer_names]
        except KeyError as e:
            raise KeyError(
                f"weights lacks {e.args[0]!r}; expected the sites {self.layer_names}."
            ) from None

    def _sample_weights(self, x):
        """Sample the weight sites (outside any data plate) and align them with the plates."""
        loc = x.new_zeros(())
        weights = []
        for name, shape, s in zip(
            self.layer_names, self.layer_shapes, self.layer_prior_scales, strict=True
        ):
            scale = x.new_tensor(s)
            w = pyro.sample(
                name,
                dist.Normal(loc, scale).expand(shape).to_event(2),
                infer={NETWORK_WEIGHTS: True},  # a guide's default noise is a network's
            )
            weights.append(_drop_data_slot(w, self.max_plate_nesting))
        return weights

    @staticmethod
    def _subsample(t, idx, subsample_size):
        return t if subsample_size is None else t.index_select(0, idx)


class BNNRegression(_BNNBase):
    """A Bayesian MLP for regression with Gaussian noise, as a Pyro model.

    Model (KIVI, App. E)::

        layer{i} ~ Normal(0, prior_scale^2 I)          shape (in_features + 1, out_features)
        precision ~ Gamma(a, b)                          (rate parametrisation)
        f = MLP(x; layers)                               deterministic site "f"
        y_j ~ Normal(f_j, precision^-1/2)                j in plate "data" (dim -1)

    With ``precision_prior=None`` there is no ``precision`` site and the noise standard
    deviation is the fixed ``noise_scale``, unless ``noise_std_prior=(a, b)`` is given:
    then a site ``noise_std ~ InverseGamma(a, b)`` holds the noise standard deviation
    itself (f-POVI's UCI setting, App. A.2.1 and the authors' code: ``InverseGamma(1, 0.1)``
    on the std, with the per-layer weight prior ``prior_scale="fan_out"``, i.e.
    :math:`N(0, 1/n_{out})`).

    The object is a plain callable with no parameters. It is vectorised over samples of
    its latent sites: under an outer plate of size ``S`` at dim -2 (an ELBO's particle
    plate, ``Predictive(parallel=True)``) ``"f"`` has shape ``(S, n)``, see the module
    docstring.

    :param int in_dim: number of input features.
    :param hidden_dims: widths of the hidden layers.
    :type hidden_dims: tuple[int]
    :param activation: ``"relu"``, ``"tanh"``, ``"sigmoid"``, ``"elu"``, ``"softplus"``,
        ``"gelu"`` or a callable.
    :param prior_scale: standard deviation of the weight prior: one number for all layers,
        one per layer, or ``"fan_out"`` for :math:`1/\\sqrt{n_{out}}` per layer (f-POVI).
    :type prior_scale: float or tuple[float] or str
    :param precision_prior: ``(shape, rate)`` of the Gamma prior on the noise precision, or
        ``None`` for a fixed noise scale.
    :type precision_prior: tuple[float, float] or None
    :param float noise_scale: the fixed noise standard deviation, used only when
        ``precision_prior`` and ``noise_std_prior`` are ``None``.
    :param noise_std_prior: ``(a, b)`` of an inverse-Gamma prior on the noise standard
        deviation (site ``"noise_std"``); needs ``precision_prior=None``.
    :type noise_std_prior: tuple[float, float] or None
    :param bool learn_noise: make the noise standard deviation a Pyro parameter
        ``"noise_scale"`` (initialised at ``noise_scale``) that SVI fits by maximising the
        ELBO: type-II maximum likelihood, LIVI's regression setting (Uppal et al. 2023,
        Sec. 6.2-6.3). Needs ``precision_prior=None`` and ``noise_std_prior=None``.
    """

    def __init__(
        self,
        in_dim,
        hidden_dims=(50,),
        activation="relu",
        prior_scale=1.0,
        precision_prior=(6.0, 6.0),
        noise_scale=1.0,
        noise_std_prior=None,
        learn_noise=False,
    ):
        super().__init__(in_dim, 1, hidden_dims, activation, prior_scale)
        if learn_noise and (precision_prior is not None or noise_std_prior is not None):
            raise ValueError(
                "learn_noise=True fits the noise scale as a parameter; it needs "
                "precision_prior=None and noise_std_prior=None."
            )
        self.learn_noise = bool(learn_noise)
        if noise_std_prior is not None:
            if precision_prior is not None:
                raise ValueError("give precision_prior or noise_std_prior, not both.")
            a, b = noise_std_prior
            if not (a > 0 and b > 0):
                raise ValueError(f"noise_std_prior must be two positive numbers, got {a}, {b}.")
            noise_std_prior = (float(a), float(b))
        self.noise_std_prior = noise_std_prior
        if precision_prior is not None:
            a, b = precision_prior
            if not (a > 0 and b > 0):
                raise ValueError(f"precision_prior must be two positive numbers, got {a}, {b}.")
            precision_prior = (float(a), float(b))
        elif not noise_scale > 0:
            raise ValueError(f"noise_scale must be positive, got {noise_scale!r}.")
        self.precision_prior = precision_prior
        self.noise_scale = float(noise_scale)

    def forward(self, weights, x):
        """Function values of the network, outside Pyro.

        :param dict weights: ``{"layer{i}": tensor of shape batch + (in + 1, out)}``.
        :param torch.Tensor x: inputs of shape ``(n, in_dim)``.
        :returns: function values of shape ``batch + (n,)``.
        :rtype: torch.Tensor
        """
        return mlp_forward(self._weights_list(weights), x, self._act).squeeze(-1)

    def __call__(self, x, y=None, subsample_size=None):
        """Run the model.

        :param torch.Tensor x: inputs of shape ``(n, in_dim)``.
        :param torch.Tensor y: targets of shape ``(n,)``; ``None`` samples them (prediction).
        :param int subsample_size: minibatch size of the data plate; ``None`` uses all data
            (the likelihood of a minibatch is scaled by ``n / subsample_size``).
        :returns: the function values at the (sub)sampled inputs.
        :rtype: torch.Tensor
        """
        self._check_data(x, y)
        weights = self._sample_weights(x)
        if self.noise_std_prior is not None:
            a, b = self.noise_std_prior
            scale = pyro.sample("noise_std", dist.InverseGamma(x.new_tensor(a), x.new_tensor(b)))
        elif self.learn_noise:
            scale = pyro.param(
                "noise_scale",
                lambda: x.new_tensor(self.noise_scale),
                constraint=constraints.positive,
            )
        elif self.precision_prior is None:
            scale = x.new_tensor(self.noise_scale)
        else:
            a, b = self.precision_prior
            precision = pyro.sample("precision", dist.Gamma(x.new_tensor(a), x.new_tensor(b)))
            # a scalar site's value is already plate-aligned: () or (S, 1) under a plate at -2
            scale = precision.rsqrt()
        with self._data_plate(x, y, subsample_size) as (xb, yb):
            f = mlp_forward(weights, xb, self._act).squeeze(-1)
            pyro.deterministic("f", f, event_dim=0)
            pyro.sample("obs", dist.Normal(f, scale), obs=yb)
        return f


class BNNClassification(_BNNBase):
    """A Bayesian MLP for classification with a categorical likelihood, as a Pyro model.

    Model (KIVI, Sec. 3.1)::

        layer{i} ~ Normal(0, prior_scale^2 I)          shape (in_features + 1, out_features)
        logits = log_softmax(MLP(x; layers))             deterministic site "logits"
        y_j ~ Categorical(logits_j)                      j in plate "data" (dim -1)

    The recorded logits are normalised (log class probabilities): raw logits are defined
    only up to a shift per input that the likelihood cannot see, so a kernel on them (e.g.
    :class:`~pyro_implicit.particles.FunctionSpaceSVGD` with ``function_site="logits"``)
    would repel particles along that invisible direction (f-POVI, App. A.3).

    Vectorised over samples like :class:`BNNRegression`: under an outer plate of size
    ``S`` at dim -2, ``"logits"`` has shape ``(S, n, num_classes)``.

    :param int in_dim: number of input features.
    :param int num_classes: number of classes.
    :param hidden_dims: widths of the hidden layers.
    :type hidden_dims: tuple[int]
    :param activation: ``"relu"``, ``"tanh"``, ``"sigmoid"``, ``"elu"``, ``"softplus"``,
        ``"gelu"`` or a callable.
    :param float prior_scale: standard deviation of the weight prior.
    """

    def __init__(self, in_dim, num_classes, hidden_dims=(50,), activation="relu", prior_scale=1.0):
        if int(num_classes) != num_classes or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}.")
        super().__init__(in_dim, num_classes, hidden_dims, activation, prior_scale)
        self.num_classes = int(num_classes)

    def forward(self, weights, x):
        """Normalised logits (log class probabilities) of the network, outside Pyro: the
        values of the model's ``"logits"`` site.

        :param dict weights: ``{"layer{i}": tensor of shape batch + (in + 1, out)}``.
        :param torch.Tensor x: inputs of shape ``(n, in_dim)``.
        :returns: normalised logits of shape ``batch + (n, num_classes)``.
        :rtype: torch.Tensor
        """
        return mlp_forward(self._weights_list(weights), x, self._act).log_softmax(-1)

    def __call__(self, x, y=None, subsample_size=None):
        """Run the model.

        :param torch.Tensor x: inputs of shape ``(n, in_dim)``.
        :param torch.Tensor y: int64 labels in ``0..num_classes-1`` of shape ``(n,)``;
            ``None`` samples them (prediction).
        :param int subsample_size: minibatch size of the data plate; ``None`` uses all data.
        :returns: the normalised logits (log class probabilities) at the (sub)sampled
            inputs.
        :rtype: torch.Tensor
        """
        self._check_data(x, y)
        weights = self._sample_weights(x)
        with self._data_plate(x, y, subsample_size) as (xb, yb):
            logits = mlp_forward(weights, xb, self._act).log_softmax(-1)
            pyro.deterministic("logits", logits, event_dim=1)
            pyro.sample("obs", dist.Categorical(logits=logits), obs=yb)
        return logits
