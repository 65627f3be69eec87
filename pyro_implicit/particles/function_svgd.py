r"""Function-space particle optimisation (f-POVI; Wang, Ren, Zhu & Zhang, ICLR 2019).

Weight-space POVI methods such as SVGD degenerate on over-parameterised models: many
distant weight settings encode the same function, and as a BNN grows wider the particles
collapse onto essentially one function (Sec. 2). f-POVI keeps the particles as weights
:math:`\theta^i` but runs the particle flow on their **function values** at a random batch
of inputs :math:`\mathbf x` and pulls the function-space direction back to the weights by
the network Jacobian (eq. 4):

.. math::
    \theta^i \leftarrow \theta^i + \epsilon \left(\frac{\partial f(\mathbf x; \theta^i)}
    {\partial \theta^i}\right)^{\!\top} \phi\big[f^i(\mathbf x)\big],

with :math:`\phi` any rule of Table 1 applied to the rows :math:`f^i(\mathbf x)` and the
function-space scores

.. math::
    G_i = \nabla_{f^i(\mathbf x)} \Big[ \tfrac{N}{B'} \log p(\mathbf y_b \mid f^i(\mathbf x_b))
          + \log p\big(f^i(\mathbf x_p)\big) \Big].

The weight prior :math:`p(\theta)` never enters the update (App. D, eq. 12); it only
generates the prior functions behind the function-space prior score
(:mod:`~pyro_implicit.particles.prior_score`).

In Pyro terms: the particles are the model's packed unconstrained latents (as for
:class:`~pyro_implicit.particles.WeightSpaceSVGD`), the function is the value of a site the
model records with ``pyro.deterministic`` (``"f"`` by default), the likelihood is every
observed site of the model (scaled by its plates, so ``pyro.plate(..., subsample_size=B')``
gives the :math:`N / B'` factor), and the pull-back is one vector-Jacobian product of the
vectorised model run.
"""

import contextlib
import math

import pyro.poutine as poutine
import torch
import torch.distributed as dist
from pyro.poutine.util import site_is_subsample
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .prior_score import GaussianPriorScore
from .svgd import ParticleInference, stein_direction

__all__ = ["FunctionSpaceSVGD", "KDEInputs"]


class KDEInputs:
    r"""The paper's default measure :math:`\nu` for the extra input points: a kernel density
    estimate of the training inputs (f-POVI Sec. 3.1.2 and the authors' UCI code).

    Each call picks ``num_points`` random rows of the inputs ``x`` and adds Gaussian noise
    with per-feature standard deviation ``scale * std(x[:, d]) / sqrt(n)``, ``n`` the number
    of rows of ``x``. On inputs standardised as in the paper's UCI code (feature std
    :math:`1/\sqrt{D}`) and ``scale=1`` this is the code's noise :math:`1/\sqrt{N D}` when
    ``x`` holds all ``N`` training inputs; the points are then near-copies of training
    inputs, so the repulsion acts near the data.

    :param int num_points: number of extra points per step (the paper: 100).
    :param float scale: noise multiplier (the code's ``ptb_scale``; 1 for UCI, 0.1 default).
    """

    def __init__(self, num_points=100, scale=1.0):
        if int(num_points) != num_points or num_points < 1:
            raise ValueError(f"num_points must be a positive int, got {num_points!r}")
        if scale < 0:
            raise ValueError(f"scale must be non-negative, got {scale!r}")
        self.num_points = int(num_points)
        self.scale = float(scale)

    def __call__(self, x):
        if not torch.is_tensor(x) or not x.is_floating_point() or x.dim() < 1:
            raise TypeError(
                "KDEInputs needs the model's inputs as a floating-point tensor with one row "
                "per data point; pass nu=<callable or tensor> for other inputs"
            )
        n = x.shape[0]
        if n >= self.num_points:
            idx = torch.randperm(n, device=x.device)[: self.num_points]
        else:
            idx = torch.randint(n, (self.num_points,), device=x.device)
        rows = x.detach().index_select(0, idx)
        if n < 2 or self.scale == 0:
            return rows
        std = x.detach().std(0) * (self.scale / math.sqrt(n))
        return rows + torch.randn_like(rows) * std

    def __repr__(self):
        return f"KDEInputs(num_points={self.num_points}, scale={self.scale})"


def _default_call_at(x):
    return (x,), {}


class FunctionSpaceSVGD(ParticleInference):
    r"""Function-space SVGD (f-SVGD) and its w-SGLD / pi-SGLD / GFSF variants for any Pyro
    model that records its function values at a site (f-POVI, Algorithm 1).

    Used like ``pyro.infer.SVGD``::

        model = BNNRegression(in_dim)       # records pyro.deterministic("f", ...)
        fsvgd = FunctionSpaceSVGD(model, pyro.optim.Adam({"lr": 4e-3}), num_particles=20,
                                  max_plate_nesting=1)
        for _ in range(num_steps):
            fsvgd.step(x_train, y_train, subsample_size=100)
        particles = fsvgd.get_named_particles()
        pred = Predictive(model, posterior_samples=particles)(x_test)   # mixture over particles

    Each step (the paper's Algorithm 1, with the details of its UCI code):

    1. run the model on the step's arguments under a particle plate, conditioned on the
       particles: function values :math:`f^i(\mathbf x_b)` at the labelled inputs and the
       per-particle log-likelihood of every observed site (with its plate scale);
    2. draw extra inputs :math:`\tilde{\mathbf x} \sim \nu` (``nu``; default
       :class:`KDEInputs`, 100 points) and run the model there (``call_at``) for
       :math:`f^i(\tilde{\mathbf x})`; these rows get no likelihood term;
    3. add the function-space prior score at a small prior batch :math:`\mathbf x_p`
       (``prior_batch_size`` rows, half labelled and half extra, as in the code);
    4. apply the update rule (``method``) with the kernel on the flattened rows
       :math:`f^i(\mathbf x_b \cup \tilde{\mathbf x})`, and pull the direction back to the
       latents by one vector-Jacobian product;
    5. latent sites that do not feed the function (a noise scale, say; found from the
       autograd graph, or given as ``aux_sites``) are not function-space particles: each
       particle takes its own MAP step on them, the gradient of its log-likelihood plus
       the site's log prior (as the authors' code does for the noise std), through the same
       optimiser;
    6. the model's own parameters (``pyro.param`` in the model, e.g. a noise scale) take a
       step along the gradient of the particles' mean log-likelihood (plus the log prior
       of the per-particle sites), through the same optimiser.

    :param callable model: a Pyro model, vectorised over a particle plate, that records the
        network output with ``pyro.deterministic(function_site, f)``, one row of ``f`` per
        input row (shape ``(n, *out)`` per particle), and whose likelihood depends on the
        function latents only through ``f``.
    :param optim: a :class:`pyro.optim.PyroOptim` or a callable
        ``params -> torch.optim.Optimizer`` (the paper: Adam, lr 4e-3 on UCI).
    :param int num_particles: ``N`` (the paper: 20 on UCI).
    :param int max_plate_nesting: the model's plate nesting.
    :param str function_site: name of the deterministic site holding the function values.
    :param kernel: kernel on the function values (see
        :func:`~pyro_implicit.particles.stein_direction`); default RBF with the median rule
        :math:`h = \mathrm{med}^2 / \log N` (the paper's code uses :math:`\log(N + 1)`).
    :param str method: ``"svgd"`` (default), ``"wsgld"``, ``"pisgld"`` or ``"gfsf"``.
    :param prior_score: ``"gaussian"`` (the paper's moment-matched Gaussian,
        :class:`~pyro_implicit.particles.GaussianPriorScore`), ``"none"`` (no prior term;
        the authors' fallback with early stopping), or an estimator such as
        :class:`~pyro_implicit.particles.GPPriorScore`.
    :param int num_prior_samples: prior networks per step for ``"gaussian"`` (paper: 40).
    :param prior_batch_size: number of prior points per step (paper: 4, two labelled and
        two extra); ``None`` uses every row of the batch.
    :param float prior_eig_min: eigenvalue clip of ``"gaussian"`` (paper: 1e-3 on UCI).
    :param nu: the measure of the extra inputs: ``"kde"`` (default, :class:`KDEInputs`
        with 100 points), a callable ``x -> x_extra``, a fixed tensor of extra inputs, or
        ``None`` for none.
    :param input_arg: position (int) or keyword (str) of the model argument holding the
        inputs ``x`` (rows = data points); needed by ``nu``, the prior batch and
        :class:`GPPriorScore`. If the data plate of the function site is subsampled, the
        labelled inputs are ``x[idx]`` with ``idx`` the plate's subsample.
    :param callable call_at: ``x -> (args, kwargs)``: how to run the model at inputs ``x``
        without observations, for the extra points and the prior draws; default
        ``model(x)``.
    :param aux_sites: names of latent sites updated per particle instead of through the
        function space; ``None`` finds the sites that do not feed the function.
    :param init_particles: see :class:`~pyro_implicit.particles.ParticleInference`.
    :param bool check_vectorization: check on the first step that the model is safe under
        the particle plate (see :class:`~pyro_implicit.particles.ParticleInference`).
    :param str layout: ``"sharded"``: across the ranks of ``group`` (``torch.distributed``
        initialised first), each rank holding N / world size particles and running the
        model on the whole step's arguments; the function values and their scores are
        all-gathered and each rank computes its particles' function-space directions from
        their kernel block against all N, then pulls them back to its own particles (see
        :class:`~pyro_implicit.distributed.ParticleLayout`; the same random streams on
        every rank, so that every rank draws the same minibatch, extra points and prior
        functions as one process). A ``prior_score`` callable then sees this rank's
        particles only (the built-in ones score each particle on its own), and the
        ``"attractive"``, ``"repulsive"`` and ``"prior_score"`` diagnostics are means over
        this rank's particles. ``"replicated"``: every rank holds all N particles and
        runs the model on its share of the data (pass the data plate
        ``subsample=rank_shard(batch)``); the kernel's ``(N, N)`` squared distances are
        summed over the ranks' labelled rows (one ``all_reduce``, the extra points
        counted once, on rank 0), each rank computes the function-space direction at its
        own rows and pulls it back, and the pulled-back directions, the per-particle
        sites' gradients and the model parameters' gradients are summed (a second
        ``all_reduce``; the likelihood weighted by the rank's share of the global
        minibatch, the priors counted once). The prior batch's labelled rows are chosen
        from the whole global minibatch as one process would (their inputs and function
        values shared by a small ``all_reduce``), so R ranks end where one process on
        the whole minibatches ends. Every rank still runs the model at the extra points
        (to keep the random streams shared).
    :param group: the process group of ``layout``.

    The model's observed sites are conditioned at the extra points (``call_at`` runs
    without observations): nothing is drawn for them, so the random streams do not depend
    on the number of particles.
    """

    def __init__(
        self,
        model,
        optim,
        num_particles,
        max_plate_nesting,
        function_site="f",
        *,
        kernel=None,
        method="svgd",
        prior_score="gaussian",
        num_prior_samples=40,
        prior_batch_size=4,
        prior_eig_min=1e-3,
        nu="kde",
        input_arg=0,
        call_at=None,
        aux_sites=None,
        init_particles=None,
        check_vectorization=True,
        layout=None,
        group=None,
    ):
        super().__init__(
            model,
            optim,
            num_particles,
            max_plate_nesting,
            kernel,
            method,
            init_particles,
            check_vectorization=check_vectorization,
            layout=layout,
            group=group,
        )
        if not isinstance(function_site, str):
            raise TypeError(f"function_site must be a site name, got {function_site!r}")
        self.function_site = function_site
        if prior_score == "gaussian":
            prior_score = GaussianPriorScore(num_prior_samples, prior_eig_min)
        elif prior_score == "none" or prior_score is None:
            prior_score = None
        elif isinstance(prior_score, str) or not callable(prior_score):
            raise ValueError(
                "prior_score must be 'gaussian', 'none' or a callable "
                f"score(f, x, sample_prior), got {prior_score!r}"
            )
        self.prior_score = prior_score
        if prior_batch_size is not None and (
            int(prior_batch_size) != prior_batch_size or prior_batch_size < 1
        ):
            raise ValueError(
                f"prior_batch_size must be a positive int or None, got {prior_batch_size!r}"
            )
        self.prior_batch_size = None if prior_batch_size is None else int(prior_batch_size)
        if isinstance(nu, str):
            if nu != "kde":
                raise ValueError(f"nu must be 'kde', a callable, a tensor or None, got {nu!r}")
            nu = KDEInputs()
        elif not (nu is None or callable(nu) or torch.is_tensor(nu)):
            raise TypeError(f"nu must be 'kde', a callable, a tensor or None, got {nu!r}")
        self.nu = nu
        self.input_arg = input_arg
        self.call_at = _default_call_at if call_at is None else call_at
        self.aux_sites = None if aux_sites is None else tuple(aux_sites)
        self._aux = None  # list of _Site updated per particle
        self._f_ndim = None  # dims of the function site in an un-vectorised run

    # ------------------------------------------------------------------ helpers
    def _inputs(self, args, kwargs):
        key = self.input_arg
        if isinstance(key, int):
            return args[key] if len(args) > key else None
        return kwargs.get(key)

    def _require_inputs(self, x, why):
        if not torch.is_tensor(x):
            raise ValueError(
                f"{why} needs the model's inputs: input_arg={self.input_arg!r} must name the "
                "model argument holding a tensor with one row per data point"
            )

    def _function_site(self, trace):
        site = trace.nodes.get(self.function_site)
        if site is None or site["type"] != "sample":
            found = sorted(
                name
                for name, s in trace.nodes.items()
                if s["type"] == "sample" and (s.get("infer") or {}).get("_deterministic")
            )
            raise ValueError(
                f"the model records no site '{self.function_site}': record the network output "
                f"with pyro.deterministic('{self.function_site}', f) (deterministic sites "
                f"found: {found}), or pass function_site="
            )
        return site

    def _rows(self, value, num, num_rows):
        """``(num, rows, F)`` view of a function site's value, particle axis first.

        The particle axis is found from the number of dims the function has in an
        un-vectorised run of the model (recorded on the first step), not from the site's
        ``event_dim``: ``pyro.deterministic`` defaults to ``event_dim = value.ndim``, which
        under a particle plate would count the particle dim as an event dim."""
        axis = value.dim() - self._f_ndim - 1
        if axis < 0:  # the function does not depend on the particles here
            value = value.reshape((1,) * -axis + value.shape)
            axis = 0
        value = value.movedim(axis, 0)
        if value.shape[0] != num:
            value = value.expand((num,) + value.shape[1:])
        per = math.prod(value.shape[1:])
        if num_rows is None:
            num_rows = 1
        if per % num_rows:
            raise ValueError(
                f"site '{self.function_site}' holds {per} values per particle, not a multiple "
                f"of the {num_rows} input rows: record one row of f per input row"
            )
        return value.reshape(num, num_rows, per // num_rows)

    def _setup_function(self, args, kwargs):
        """Number of dims of the function site in an un-vectorised model run."""
        with torch.no_grad():
            trace = poutine.block(poutine.trace(self.model).get_trace)(*args, **kwargs)
        self._f_ndim = self._function_site(trace)["value"].dim()

    def _labelled_inputs(self, x, site, trace):
        """Inputs behind the labelled rows of ``f``: ``x``, or ``x[idx]`` if the function
        site's plate is subsampled."""
        if not torch.is_tensor(x):
            return None
        frames = [
            f for f in site["cond_indep_stack"] if f.full_size is not None and f.size != f.full_size
        ]
        if not frames:
            return x
        if len(frames) > 1:
            raise NotImplementedError(
                f"site '{self.function_site}' is in several subsampled plates "
                f"{[f.name for f in frames]}; subsample one data plate"
            )
        sub = trace.nodes.get(frames[0].name)
        if sub is None or not site_is_subsample(sub):
            raise RuntimeError(f"no subsample indices recorded for plate '{frames[0].name}'")
        return x.index_select(0, sub["value"].to(x.device))

    def _prior_rows(self, n_lab, n_ext):
        total = n_lab + n_ext
        b = self.prior_batch_size
        if b is None or b >= total:
            return torch.arange(total)
        n_e = min(b - b // 2, n_ext)
        n_l = min(b - n_e, n_lab)
        lab = torch.randperm(n_lab)[:n_l]
        # the extra points are i.i.d. draws of nu, so their first rows are a random choice
        return torch.cat([lab, n_lab + torch.arange(n_e)])

    @contextlib.contextmanager
    def _calls_named(self):
        """Around a run of the model at other inputs: the default ``call_at`` runs
        ``model(x)``, and a model that needs more arguments fails with Python's message,
        which names neither ``call_at`` nor the fix."""
        try:
            yield
        except TypeError as e:
            if self.call_at is not _default_call_at or "argument" not in str(e):
                raise
            raise TypeError(
                f"{type(self).__name__} runs the model at other inputs (the extra points "
                "and the prior draws) as call_at(x), by default model(x), and this model "
                f"needs other arguments ({e}): pass call_at=lambda x: ((x, None), {{}}) or "
                "whatever runs the model at inputs x without observations"
            ) from e

    def _sample_prior(self, x_p, k):
        """Function values of ``k`` prior draws at ``x_p``: ``(k, b, F)``, no gradient."""
        args, kwargs = self.call_at(x_p)
        with torch.no_grad(), poutine.block(), self._calls_named():
            trace = self._trace({}, args, kwargs, size=k, name="_prior_draws")
        return self._rows(self._function_site(trace)["value"], k, x_p.shape[0])

    def _find_aux(self, values, f_value):
        names = [s.name for s in self._sites]
        if self.aux_sites is not None:
            unknown = set(self.aux_sites) - set(names)
            if unknown:
                raise ValueError(f"aux_sites {sorted(unknown)} are not latent sites of the model")
            aux = set(self.aux_sites)
        else:
            grads = torch.autograd.grad(
                f_value.sum(), [values[n] for n in names], retain_graph=True, allow_unused=True
            )
            aux = {n for n, g in zip(names, grads, strict=True) if g is None}
            if len(aux) == len(names):
                raise ValueError(
                    f"site '{self.function_site}' depends on no latent site of the model"
                )
        self._aux = [s for s in self._sites if s.name in aux]

    # ------------------------------------------------------------------ step
    def step(self, *args, **kwargs):
        """One f-POVI update of all particles (Algorithm 1, lines 4-6); with
        ``layout="sharded"``, of this rank's particles from their interaction with all N.

        :return: ``{"attractive", "repulsive"}`` (mean per-particle norms of the score part
            and the kernel-gradient part of the function-space direction), ``"bandwidth"``
            (the kernel's length scale :math:`\\sigma`, :math:`k = \\exp(-d^2 / 2\\sigma^2)`),
            ``"log_likelihood"`` (mean over particles, with plate scaling) and
            ``"prior_score"`` (mean norm of the function-space prior score; 0 without one).
        """
        first = self._setup(args, kwargs)
        if self.distributed is not None and self.distributed.layout == "replicated":
            return self._step_replicated(args, kwargs, first)
        n = self.num_particles
        with torch.enable_grad():
            local = {}

            def scores():
                self._check_finite()
                if first:
                    self._setup_function(args, kwargs)
                local.update(self._local_scores(args, kwargs, first))
                return (
                    local["f_all"].detach().reshape(n, -1),
                    local["log_lik"].detach(),
                    local["g_all"].reshape(n, -1),
                    local["param_grads"],
                )

            if self.distributed is None:
                z, log_lik, g, param_grads = scores()
                block = {}
            else:
                # every rank's function values and scores, or every rank raises
                z, log_lik, g, param_grads = self.distributed.exchange(self, scores)
                block = self.distributed.block
            d = stein_direction(z, g, self.kernel, self.method, **block)
            f_all = local["f_all"]
            (pulled,) = torch.autograd.grad(
                f_all,
                self.particles,
                grad_outputs=d.direction.reshape(f_all.shape),
                allow_unused=True,
            )
        direction = torch.zeros_like(self.particles) if pulled is None else pulled
        for s, g_aux in zip(self._aux, local["aux_grads"], strict=True):
            direction[:, s.start : s.stop] = 0.0 if g_aux is None else g_aux.reshape(n, -1)
        # the model's own pyro.params (e.g. a noise scale) descend minus the particles'
        # mean log-likelihood, over all N particles
        total = z.shape[0]
        self._apply(direction, [None if g_p is None else -g_p / total for g_p in param_grads])
        return {
            "attractive": self._norm(d.drive),
            "repulsive": self._norm(d.repulsion),
            "bandwidth": d.bandwidth.item(),
            "log_likelihood": log_lik.detach().mean().item(),
            "prior_score": local["prior_norm"],
        }

    def _prime(self, args, kwargs):
        with torch.enable_grad():
            self._setup_function(args, kwargs)
            self._local_scores(args, kwargs, True)

    def _step_replicated(self, args, kwargs, first):
        """The step of ``layout="replicated"``: the data sharded, all N particles on every
        rank (see the class's ``layout``)."""
        layout = self.distributed
        n, particles = self.num_particles, self.particles
        local, error = {}, None
        with torch.enable_grad():
            try:
                self._check_finite()
                if first:
                    self._setup_function(args, kwargs)
                local.update(self._local_scores(args, kwargs, first, replicated=True))
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
            # every rank's share of the global minibatch, or every rank raises
            head = particles.new_zeros(layout.world + 1)
            head[-1] = float(error is not None)
            if error is None:
                head[layout.rank] = local["n_lab"]
            dist.all_reduce(head, group=layout.group)
            if head[-1] > 0:
                layout.raise_together(error)
            sizes = [int(v) for v in head[:-1].tolist()]
            total, offset = sum(sizes), sum(sizes[: layout.rank])
            f_all, n_lab = local["f_all"], local["n_lab"]
            n_ext = f_all.shape[1] - n_lab
            owner = layout.rank == 0  # the extra points' rows are counted on rank 0
            weight = n_lab / total  # the rank's likelihood scale n / n_lab -> n / total
            g_all = torch.cat(
                [weight * local["g_lab"], f_all.new_zeros((n, n_ext) + f_all.shape[2:])], dim=1
            ).detach()
            prior_norm = 0.0
            if self.prior_score is not None:
                # the prior batch drawn from the global rows, as one process draws it
                x_parts = local["x_parts"]
                self._require_inputs(x_parts[0], "the function-space prior")
                rows = self._prior_rows(total, n_ext).tolist()
                x_p = x_parts[0].new_zeros((len(rows),) + x_parts[0].shape[1:])
                f_p = f_all.new_zeros((n, len(rows)) + f_all.shape[2:])
                cols = []  # (position in the prior batch, this rank's column)
                for i, row in enumerate(rows):
                    if offset <= row < offset + n_lab:
                        cols.append((i, row - offset))
                        x_p[i] = x_parts[0][row - offset]
                    elif row >= total and owner:
                        cols.append((i, n_lab + row - total))
                        x_p[i] = x_parts[1][row - total]
                for i, col in cols:
                    f_p[:, i] = f_all.detach()[:, col]
                parts = [x_p.to(f_p.dtype), f_p]
                flat = _flatten_dense_tensors(parts)
                dist.all_reduce(flat, group=layout.group)
                x_p, f_p = _unflatten_dense_tensors(flat, parts)
                x_p = x_p.to(x_parts[0].dtype)
                score = self.prior_score(f_p, x_p, lambda k: self._sample_prior(x_p, k))
                score = score.to(g_all)
                for i, col in cols:
                    g_all[:, col] += score[:, i]
                prior_norm = score.reshape(n, -1).norm(dim=-1).mean().item()
            # this rank's columns: its labelled rows, and the extra points on rank 0
            width = f_all.shape[1] if owner else n_lab
            z = f_all.detach()[:, :width].reshape(n, -1)
            g = g_all[:, :width].reshape(n, -1)
            reduced = {}

            def reduce(d2):
                parts = [d2, weight * local["log_lik"].detach()]
                flat = _flatten_dense_tensors(parts)
                dist.all_reduce(flat, group=layout.group)
                d2, reduced["log_lik"] = _unflatten_dense_tensors(flat, parts)
                return d2

            d = stein_direction(z, g, self.kernel, self.method, reduce=reduce)
            grad_out = torch.zeros_like(f_all)
            grad_out[:, :width] = d.direction.reshape((n, width) + f_all.shape[2:])
            (pulled,) = torch.autograd.grad(
                f_all, self.particles, grad_outputs=grad_out, allow_unused=True
            )
        direction = torch.zeros_like(particles) if pulled is None else pulled.detach()

        def combine(lik, prior):
            out = 0.0 if lik is None else weight * lik.detach()
            if owner and prior is not None:
                out = out + prior.detach()
            return out

        for s, lik, prior in zip(
            self._aux, local["aux_grads"], local["aux_prior_grads"], strict=True
        ):
            value = combine(lik, prior)
            direction[:, s.start : s.stop] = value.reshape(n, -1) if torch.is_tensor(value) else 0.0
        params = self.model_parameters()
        param_grads = [
            torch.zeros_like(p) + combine(lik, prior)
            for p, lik, prior in zip(
                params, local["param_grads"], local["param_prior_grads"], strict=True
            )
        ]
        norms = torch.stack([d.drive.pow(2).sum(-1), d.repulsion.pow(2).sum(-1)])
        parts = [direction, norms] + [g_p.to(direction.dtype) for g_p in param_grads]
        flat = _flatten_dense_tensors(parts)
        dist.all_reduce(flat, group=layout.group)
        direction, norms, *summed = _unflatten_dense_tensors(flat, parts)
        param_grads = [g_p.to(p.dtype) for p, g_p in zip(params, summed, strict=True)]
        self._apply(direction, [-g_p / n for g_p in param_grads])
        drive, repulsion = norms.sqrt().mean(-1).tolist()
        return {
            "attractive": drive,
            "repulsive": repulsion,
            "bandwidth": d.bandwidth.item(),
            "log_likelihood": reduced["log_lik"].mean().item(),
            "prior_score": prior_norm,
        }

    def _local_scores(self, args, kwargs, first, replicated=False):
        """This process's particles: their function values ``f_all`` ``(n, rows, F)`` (with
        the graph to the particles) and scores ``g_all``, the per-particle
        log-likelihoods, the aux sites' gradients, the sums over particles of the model
        parameters' gradients and the prior score's mean norm."""
        n = self.num_particles
        x = self._inputs(args, kwargs)
        values, views, _ = self._unpack(self.particles)
        trace = self._trace(values, args, kwargs)
        site = self._function_site(trace)
        if first:
            self._check_shapes(trace)
            self._find_aux(values, site["value"])
        x_lab = self._labelled_inputs(x, site, trace)
        f_lab = self._rows(site["value"], n, None if x_lab is None else x_lab.shape[0])

        # scores: log-likelihood (observed sites) w.r.t. f, and the aux sites' MAP objective
        observed = self._observed_names(trace)
        aux_names = [s.name for s in self._aux]
        scored = set(observed) | set(aux_names)
        trace.compute_log_prob(site_filter=lambda name, s: name in scored)
        log_lik = self._particle_sum(trace, observed)
        aux_prior = self._particle_sum(trace, aux_names).sum()
        # the replicated layout weights the likelihood by the rank's share and counts the
        # per-particle sites' prior once: their gradients apart
        objective = log_lik.sum() + (0.0 if replicated else aux_prior)
        inputs = [site["value"]] + [views[name] for name in aux_names]
        params = self.model_parameters()
        prior_grads = [None] * (len(inputs) - 1 + len(params))
        if replicated and torch.is_tensor(aux_prior) and aux_prior.requires_grad:
            prior_grads = torch.autograd.grad(
                aux_prior, inputs[1:] + params, retain_graph=True, allow_unused=True
            )
        if torch.is_tensor(objective) and objective.requires_grad:
            grads = torch.autograd.grad(
                objective, inputs + params, retain_graph=True, allow_unused=True
            )
        else:
            grads = [None] * (len(inputs) + len(params))
        param_grads = list(grads[len(inputs) :])
        grads = grads[: len(inputs)]
        g_site = grads[0]
        if g_site is None and observed:
            raise ValueError(
                f"the likelihood ({observed}) does not use the value recorded at "
                f"'{self.function_site}', so FunctionSpaceSVGD would see no likelihood "
                "gradient: pass the very tensor given to pyro.deterministic to the "
                "observation's distribution (not a recomputed copy)"
            )
        if g_site is None:
            g_lab = torch.zeros_like(f_lab)
        else:
            g_lab = self._rows(g_site, n, f_lab.shape[1])

        # extra points x ~ nu: no likelihood, prior and repulsion only
        parts, x_parts, g_parts = [f_lab], [x_lab], [g_lab.detach()]
        if self.nu is not None:
            if torch.is_tensor(self.nu):
                x_nu = self.nu
            else:
                self._require_inputs(x, "nu")
                x_nu = self.nu(x)
            ext_args, ext_kwargs = self.call_at(x_nu)
            # the observations are not needed there: conditioned, nothing is drawn for them
            zero = self.particles.new_zeros(())
            ext_values = dict(values, **{name: zero for name in observed})
            with self._calls_named():
                ext_trace = self._trace(ext_values, ext_args, ext_kwargs)
            f_ext = self._rows(self._function_site(ext_trace)["value"], n, x_nu.shape[0])
            parts.append(f_ext)
            x_parts.append(x_nu)
            g_parts.append(torch.zeros_like(f_ext).detach())
        f_all = torch.cat(parts, dim=1) if len(parts) > 1 else f_lab
        if replicated:  # the prior score needs the other ranks' rows: in _step_replicated
            return {
                "f_all": f_all,
                "g_lab": g_lab.detach(),
                "n_lab": f_lab.shape[1],
                "x_parts": x_parts,
                "log_lik": log_lik,
                "aux_grads": list(grads[1:]),
                "aux_prior_grads": list(prior_grads[: len(aux_names)]),
                "param_grads": param_grads,
                "param_prior_grads": list(prior_grads[len(aux_names) :]),
            }
        g_all = torch.cat(g_parts, dim=1)

        prior_norm = 0.0
        if self.prior_score is not None:
            self._require_inputs(x_lab, "the function-space prior")
            rows = self._prior_rows(f_lab.shape[1], f_all.shape[1] - f_lab.shape[1])
            rows = rows.to(f_all.device)  # drawn on the CPU generator, as everywhere
            x_p = torch.cat(x_parts, dim=0).index_select(0, rows)
            f_p = f_all.detach().index_select(1, rows)
            score = self.prior_score(f_p, x_p, lambda k: self._sample_prior(x_p, k))
            g_all = g_all.index_add(1, rows, score.to(g_all))
            prior_norm = score.reshape(n, -1).norm(dim=-1).mean().item()
        return {
            "f_all": f_all,
            "g_all": g_all,
            "log_lik": log_lik,
            "aux_grads": list(grads[1:]),
            "param_grads": param_grads,
            "prior_norm": prior_norm,
        }
