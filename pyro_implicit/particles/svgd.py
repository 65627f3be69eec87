r"""Particle updates on a Pyro model's packed unconstrained latents, and weight-space SVGD.

This module holds what every particle method of the library shares:

* :func:`stein_direction`: the particle update directions of the f-POVI paper's Table 1
  (Wang, Ren, Zhu & Zhang, ICLR 2019) for any particle matrix :math:`Z \in \mathbb R^{N
  \times D}` and scores :math:`G_i = \nabla \log p(z_i)`: SVGD (Liu & Wang, 2016),
  w-SGLD and pi-SGLD (Chen et al., 2018) and GFSF (Liu et al., 2018). Kernel sums are
  matrix products with an ``(N, N)`` kernel matrix, so memory is :math:`O(N^2 + N D)`,
  never the :math:`O(N^2 D)` of ``pyro.infer.SVGD``'s kernels;
* :class:`ParticleInference`: particles stored **particle-major** as one ``(N, D)``
  tensor attribute (row ``i`` is particle ``i``'s full packed latent, every site), packed
  with Pyro's :class:`~pyro.infer.autoguide.AutoContinuous` prototype, unpacked through
  ``biject_to`` and scored by **one** run of the model under an outer particle plate;
* :class:`WeightSpaceSVGD`: SVGD on those latents, a faster and leaner replacement for
  ``pyro.infer.SVGD(..., mode="multivariate")``.

Layout matters. ``pyro.infer.SVGD`` (pyro-ppl 1.9) packs its particle parameter site by
site but reshapes it as if it were particle-major, so on models with several latent sites
its kernel mixes coordinates of different particles; here each row is one particle.

**Bandwidth rule.** The default kernel is :class:`~pyro_implicit.kernels.RBFKernel` with
``bandwidth_factor = svgd_bandwidth_factor(N)``, i.e. Liu & Wang's
:math:`k(a, b) = \exp(-\|a - b\|^2 / h)`, :math:`h = \mathrm{med}^2 / \log N`, with
:math:`\mathrm{med}` the median off-diagonal pairwise distance. (``pyro.infer.SVGD`` uses a
per-dimension bandwidth with :math:`\log(N + 1)`; the f-POVI code uses the median of all
:math:`N^2` squared distances, zeros included, over :math:`\log(N + 1)`.)

With a preconditioner (the default of :class:`WeightSpaceSVGD`) the default kernel is
:class:`~pyro_implicit.kernels.RBFKernel` with :data:`WHITENED_BANDWIDTH_FACTOR` (1.4)
times the median distance as the length scale, :math:`k = \exp(-\|a - b\|^2 / (2 \cdot
1.4^2\,\mathrm{med}^2))`, a bandwidth about :math:`\log N` times wider than Liu & Wang's.
Their rule shrinks the particle cloud of a standard Gaussian as D grows: 100 particles, 2000
Adam steps from exact draws, final sd 0.99 at D = 1, 0.83-0.84 at D = 5, 0.65-0.66 at D =
10, 0.30 at D = 50; with the median length scale 1.00, 1.00, 0.98, 0.95-0.97
(``benchmarks/results/svgd_bandwidth.md``), with 1.4 of it 1.00, 0.99, 0.99, 0.97-0.98, and
at D = 100 0.89-0.94 against 0.84-0.88 (``svgd_bandwidth_factors.md``). On the stiff
benchmark 1.4 took stochastic volatility from 0.37 to 0.21 NUTS sds off, where 300
particles had spread into ``phi_raw``'s tail (``wsvgd_bandwidth.md``). Beyond
:data:`WIDE_BANDWIDTH_DIM` (100) latent coordinates that are not a network's weights it is
:data:`WIDE_BANDWIDTH_FACTOR` (3) median distances: there 300 particles with 1.4 lost
spread in many groups' effects and let the groups' shared scale drift (0.37-1.43 NUTS sds
off at about 150 latents in three hierarchical models, 0.25-0.37 with 3;
``benchmarks/results/audit_probes_s64.md``, section 4).
"""

import collections
import copy
import inspect
import math
import warnings

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import init_to_median, init_to_sample
from pyro.infer.svgd import SteinKernel
from pyro.optim import PyroOptim
from pyro.poutine.util import site_is_subsample

from ..compiled import BACKENDS
from ..elbo.base import (
    DIVERGENCE_ADVICE,
    RUNAWAY_CHECK_EVERY,
    RUNAWAY_DRIFT,
    DivergenceError,
    particle_sum,
)
from ..elbo.checks import check_space_vectorized
from ..elbo.kernel_ratio import _dense_gaussian
from ..errors import FewParticlesWarning, RunawayWarning
from ..kernels import RBFKernel, kernel_and_derivative, squared_distances, svgd_bandwidth_factor
from ..latent import (
    LatentSpace,
    Preconditioner,
    check_fixed_supports,
    check_no_point_mass_latents,
    check_no_subsampled_local_latents,
    check_trace_shapes,
    completed_model,
    plate_nesting,
    prototype_errors_named,
    resolve_precondition,
    spread_over_modes,
)
from ..progress import refresh_intervals
from ..random_streams import random_streams_kept

__all__ = [
    "AUTO_PARTICLES",
    "FEW_PARTICLES_DIM",
    "MIN_PARTICLES_PER_DIM",
    "WIDE_BANDWIDTH_DIM",
    "WIDE_BANDWIDTH_FACTOR",
    "METHODS",
    "PARTICLES_PER_DIM",
    "ParticleInference",
    "SteinDirection",
    "WHITENED_BANDWIDTH_FACTOR",
    "WeightSpaceSVGD",
    "auto_num_particles",
    "stein_direction",
]

#: update rules of f-POVI's Table 1
METHODS = ("svgd", "wsgld", "pisgld", "gfsf")

#: diagonal jitter of the GFSF kernel-matrix solve, per dtype (the f-POVI code uses a plain
#: inverse; 1e-6 is below float32 rounding of a Gram matrix with unit diagonal, so float32
#: takes the 1e-4 of the GPVI authors' ALF code)
GFSF_JITTER = {torch.float64: 1e-6, torch.float32: 1e-4}

SteinDirection = collections.namedtuple(
    "SteinDirection", ["direction", "drive", "repulsion", "bandwidth"]
)
SteinDirection.__doc__ = """An ascent direction ``direction = drive + repulsion`` (each
``(N, D)``): ``drive`` is the part built from the scores, ``repulsion`` the part built from
kernel gradients; ``bandwidth`` is the kernel bandwidth used (a 0-dim tensor)."""


def _pairwise_weighted(z, w, z_all=None):
    """:math:`\\sum_j w_{ij} (z_i - z_j)` for the rows ``i`` of ``z`` as two matrix
    products, ``j`` over the rows of ``z_all`` (default ``z``)."""
    return z * w.sum(-1, keepdim=True) - w @ (z if z_all is None else z_all)


def _pyro_kernel_terms(kernel, z):
    # pyro's SteinKernel returns (N, N, D) tensors: only for comparisons with pyro.infer.SVGD
    log_kernel, grad_term = kernel.log_kernel_and_grad(z)
    k = log_kernel.sum(-1).exp()
    # pyro's grad_term[n, m] is -d log k_nm / d x_m (its code, not its docstring), so the
    # repulsion sum_m grad_{x_m} k(x_m, x_n) is minus its K-weighted sum
    repulsion = -torch.einsum("nm,nm...->n...", k, grad_term)
    return k, repulsion, z.new_tensor(float("nan"))


def stein_direction(particles, score, kernel, method="svgd", rows=None, gather=None, reduce=None):
    r"""Particle update direction of a POVI method (f-POVI, Table 1), as an ascent direction
    :math:`\phi_i = -v(z_i)`; the particles move by :math:`z_i \leftarrow z_i + \epsilon
    \phi_i`.

    With :math:`K_{ij} = k(z_i, z_j)`, :math:`R_i = \sum_j \nabla_{z_j} k(z_j, z_i)` (the
    repulsive force) and :math:`S_i = \sum_j K_{ij}`:

    * ``"svgd"`` (Liu & Wang, 2016): :math:`\phi = (K G + R) / N`;
    * ``"wsgld"`` (Chen et al., 2018): :math:`\phi_i = G_i - \sum_j \nabla_{z_i} K_{ij} / S_j
      + R_i / S_i`;
    * ``"pisgld"``: the average of the two, as in the authors' code (Table 1 says "sum";
      the factor 2 only rescales the step, and the average keeps :math:`N = 1` exact);
    * ``"gfsf"`` (Liu et al., 2018): :math:`\phi = G + (K + \epsilon I)^{-1} R`.

    For :math:`N = 1` every rule reduces to gradient ascent, :math:`\phi = G`.

    The kernel is evaluated on the particles shifted by the first particle (the update is
    translation invariant): identical particles then give exactly zero repulsion instead of
    rounding error divided by a vanishing bandwidth.

    **A block of rows** (particles sharded across processes,
    :class:`~pyro_implicit.distributed.ParticleLayout`): with ``rows`` (a slice of
    ``0..N-1``) only the directions of those particles are computed, from their
    ``(len(rows), N)`` kernel block against all ``N`` particles; ``gather`` turns such a
    row block of squared distances (or of GFSF's repulsion) into the full ``(N, ...)``
    tensor, the blocks of all ranks in row order (an all-gather). The full ``(N, N)``
    squared distances are needed for the median bandwidth (not for a fixed one with
    ``"svgd"``), the row sums :math:`S` of w-SGLD and pi-SGLD and GFSF's solve; no
    ``(N, N, D)`` tensor is ever formed. Without ``gather`` the full distances are computed
    here.

    :param torch.Tensor particles: ``(N, D)`` particles (no gradient is taken).
    :param torch.Tensor score: ``(N, D)`` :math:`\nabla \log p` at the particles.
    :param kernel: a :class:`~pyro_implicit.kernels.RBFKernel` or
        :class:`~pyro_implicit.kernels.IMQKernel` (any object with their
        ``stein_terms``/``bandwidth_from_squared_distances``/``from_squared_distances``/
        ``derivative_wrt_squared_distance`` methods; ``value_and_derivative`` where it has
        one), or a ``pyro.infer.SteinKernel``
        (``"svgd"`` only, multivariate, :math:`O(N^2 D)` memory; for comparisons).
    :param str method: one of :data:`METHODS`.
    **A block of columns** (the coordinates split across processes, e.g. function values
    at each rank's share of the data): with ``reduce``, ``particles`` and ``score`` hold
    this rank's columns of all N particles and ``reduce`` sums the ``(N, N)`` squared
    distances of the ranks' column blocks (an all-reduce); the directions returned are
    this rank's columns (every rule of Table 1 acts column by column once the kernel
    matrix is known).

    :param slice rows: the particles whose directions are wanted (default: all).
    :param callable gather: ``(len(rows), ...) -> (N, ...)``, see above.
    :param callable reduce: ``(N, N) -> (N, N)``, see above (not with ``rows``).
    :rtype: SteinDirection (of ``len(rows)`` rows)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    z = particles.detach()
    g = score.detach()
    if z.dim() != 2 or g.shape != z.shape:
        raise ValueError(
            f"expected particles and score of the same shape (N, D), got {tuple(z.shape)} "
            f"and {tuple(g.shape)}"
        )
    n = z.shape[0]
    z = z - z[:1]
    if isinstance(kernel, SteinKernel):
        if method != "svgd" or rows is not None:
            raise ValueError(
                f"a pyro SteinKernel supports method='svgd' on all rows only, got {method!r}"
            )
        k, repulsion, bandwidth = _pyro_kernel_terms(kernel, z)
        return SteinDirection((k @ g + repulsion) / n, k @ g / n, repulsion / n, bandwidth)
    if reduce is not None and rows is not None:
        raise ValueError("stein_direction takes rows= or reduce=, not both")
    if method == "svgd" and rows is None and reduce is None:
        k, repulsion, bandwidth = kernel.stein_terms(z)
        drive, rep = k @ g / n, repulsion / n
        return SteinDirection(drive + rep, drive, rep, bandwidth)
    # the rows' block of the kernel; one process: the block is the whole matrix
    z_rows, g_rows = (z, g) if rows is None else (z[rows], g[rows])
    d2_rows = squared_distances(z_rows, None if rows is None else z)
    if reduce is not None:
        d2_rows = reduce(d2_rows)
    if rows is None:
        d2 = d2_rows
    elif method == "svgd" and getattr(kernel, "fixed_bandwidth", None) is not None:
        d2 = d2_rows  # a fixed bandwidth ignores the distances: nothing to gather
    else:
        d2 = squared_distances(z) if gather is None else gather(d2_rows)
    bandwidth = kernel.bandwidth_from_squared_distances(d2)
    k_rows, dk_rows = kernel_and_derivative(kernel, d2_rows, bandwidth)
    k = k_rows if rows is None else None  # the full matrix, built only where needed
    # grad_{z_i} k(z_i, z_j) = -a_ij (z_i - z_j) with a_ij >= 0 for a stationary kernel
    a = -2.0 * dk_rows
    repulsion = _pairwise_weighted(z_rows, a, z)
    if method == "svgd":
        drive, rep = k_rows @ g / n, repulsion / n
        return SteinDirection(drive + rep, drive, rep, bandwidth)
    if k is None:
        k = kernel.from_squared_distances(d2, bandwidth)
    if method == "gfsf":
        eye = torch.eye(n, dtype=k.dtype, device=k.device)
        chol = torch.linalg.cholesky(k + GFSF_JITTER.get(k.dtype, 1e-3) * eye)
        if rows is None:
            rep = torch.cholesky_solve(repulsion, chol)
        else:
            # the rows of the symmetric inverse, times every particle's repulsion
            inverse_rows = torch.cholesky_solve(eye[:, rows], chol).T
            if gather is None:
                a_full = -2.0 * kernel.derivative_wrt_squared_distance(d2, bandwidth)
                full = _pairwise_weighted(z, a_full)
            else:
                full = gather(repulsion)
            rep = inverse_rows @ full
        return SteinDirection(g_rows + rep, g_rows, rep, bandwidth)
    s = k.sum(-1)  # a constant of the update (stop-gradient in the authors' code)
    s_rows = s if rows is None else s[rows]
    rep = _pairwise_weighted(z_rows, a / s, z) + repulsion / s_rows.unsqueeze(-1)
    drive = g_rows
    if method == "pisgld":
        drive = 0.5 * (drive + k_rows @ g / n)
        rep = 0.5 * (rep + repulsion / n)
    return SteinDirection(drive + rep, drive, rep, bandwidth)


def default_kernel(whitened, num_particles):
    """The default kernel (the module's "Bandwidth rule"): 1.4 median distances for
    whitened particles, Liu & Wang's rule, which counts the particles, in the raw space."""
    if whitened:
        return RBFKernel(bandwidth_factor=WHITENED_BANDWIDTH_FACTOR)
    return RBFKernel(bandwidth_factor=svgd_bandwidth_factor(num_particles))


def _guess_max_plate_nesting(model, args, kwargs):
    with torch.no_grad():
        return plate_nesting(poutine.block(poutine.trace(model).get_trace)(*args, **kwargs))


def _param_names(model, args, kwargs):
    """Names of the model's own ``pyro.param`` sites (an autoguide's prototype trace hides
    them), read from one run that leaves the random streams as they were."""
    with random_streams_kept(), torch.no_grad():
        trace = poutine.block(poutine.trace(model).get_trace)(*args, **kwargs)
    return tuple(name for name, site in trace.nodes.items() if site["type"] == "param")


def _runs_without_arguments(model):
    """Whether ``model()`` is a valid call (every parameter has a default)."""
    try:
        parameters = inspect.signature(model).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters
    )


class _Prototype(AutoContinuous):
    """Pyro's AutoContinuous, used only for its prototype trace and unconstrained shapes."""

    def __init__(self, model, init_loc_fn=init_to_sample):
        super().__init__(model, init_loc_fn=init_loc_fn)


_Site = collections.namedtuple(
    "_Site", ["name", "transform", "shape", "event_dim", "vec_shape", "start", "stop"]
)


def _is_deterministic(site):
    return bool((site.get("infer") or {}).get("_deterministic", False))


class ParticleInference:
    """Base class: ``N`` particles of a Pyro model's packed unconstrained latent vector.

    The latent vector is the one of Pyro's :class:`~pyro.infer.autoguide.AutoContinuous`
    (every continuous latent site mapped to real space by ``biject_to`` and flattened, in
    model order, size ``D``). The particles are an ``(N, D)`` leaf tensor
    :attr:`particles`, particle-major, created on the first :meth:`step` (the model's
    arguments are needed to trace it). One model run under an outer plate of size ``N`` at
    ``dim = -max_plate_nesting - 1`` scores all particles, as in ``pyro.infer.SVGD``, so the
    model must be vectorised over that plate.

    Subclasses implement :meth:`step`; :meth:`_apply` hands the ascent direction to the
    optimiser by overwriting the particles' gradient with its negative.

    :param callable model: a Pyro model with continuous latent sites.
    :param optim: a :class:`pyro.optim.PyroOptim` (e.g. ``pyro.optim.Adam({"lr": 1e-2})``),
        or a callable ``params -> torch.optim.Optimizer``.
    :param int num_particles: ``N`` (:class:`WeightSpaceSVGD` also takes ``"auto"``, its
        default: :func:`auto_num_particles` of the latent size, chosen on the first step).
    :param int max_plate_nesting: the model's plate nesting (the particle plate goes
        outside it); ``None``: read from one run of the model on the first step.
    :param kernel: the kernel of the update (see :func:`stein_direction`); default
        :class:`~pyro_implicit.kernels.RBFKernel` with Liu & Wang's median rule in the raw
        space, and with :data:`WHITENED_BANDWIDTH_FACTOR` median distances as its length
        scale with a preconditioner (see the module's "Bandwidth rule").
    :param str method: update rule, one of :data:`METHODS`.
    :param init_particles: ``None`` (default) draws each particle from the prior (Pyro's
        ``init_to_sample``, as ``pyro.infer.SVGD``), or from the preconditioner's Gaussian
        when there is one; or an ``(N, D)`` unconstrained tensor; or ``{site: (N,
        *site_shape) constrained tensor}`` for every latent site.
    :param precondition: ``False`` (default here): the particles are the packed
        unconstrained latents ``u``; ``True``: find an affine preconditioner
        :math:`u = m + Lz` before the first step
        (:func:`~pyro_implicit.latent.find_preconditioner`) and move whitened particles
        :math:`z` (the kernel, its bandwidth and the optimiser then act where the
        posterior has unit scale: SVGD with the constant matrix-valued kernel
        :math:`L k(z, z') L^\top`, Wang et al. 2019); or a
        :class:`~pyro_implicit.latent.Preconditioner`.
    :param bool check_vectorization: on the first step, check that the model gives each
        particle the same log-density under the particle plate as alone
        (:func:`~pyro_implicit.elbo.base.check_vectorized_log_joint`, as the losses do),
        so that a model that mixes particles raises instead of giving a wrong posterior.
    :param str layout: run across the processes of ``group`` (``torch.distributed`` must be
        initialised first, e.g. under ``torchrun``): ``"replicated"`` (every rank holds
        all N particles and scores them on its shard of the data) or ``"sharded"`` (every
        rank holds N / world size of the particles and scores them on all of the step's
        data); see :class:`~pyro_implicit.distributed.ParticleLayout`. ``None``
        (default): one process. With ``"sharded"``, :attr:`num_particles` and
        :attr:`particles` are this rank's (``N / world size`` rows);
        :func:`~pyro_implicit.distributed.gather_named_particles` collects all N.
    :param group: the ``torch.distributed`` process group of ``layout`` (default: all
        ranks).

    Parameters of the model itself (``pyro.param`` calls in the model) are trained along
    with the particles by the same optimiser, on the gradient of the particles' mean
    log-joint :math:`\\frac1N \\sum_i \\nabla_\\theta \\log p_\\theta(x, z_i)` (the
    gradient of the ELBO of the particle approximation with respect to :math:`\\theta`;
    ``pyro.infer.SVGD`` trains them on the sum, N times that).
    """

    #: name of the particle plate
    plate_name = "_svgd_particles"

    def __init__(
        self,
        model,
        optim,
        num_particles,
        max_plate_nesting,
        kernel=None,
        method="svgd",
        init_particles=None,
        precondition=False,
        check_vectorization=True,
        layout=None,
        group=None,
    ):
        if not callable(model):
            raise TypeError("model must be a callable Pyro model")
        if not (isinstance(optim, PyroOptim) or callable(optim)):
            raise TypeError(
                "optim must be a pyro.optim.PyroOptim (e.g. pyro.optim.Adam({'lr': 1e-2})) or "
                "a callable params -> torch.optim.Optimizer"
            )
        if int(num_particles) != num_particles or num_particles < 1:
            raise ValueError(f"num_particles must be a positive int, got {num_particles!r}")
        if max_plate_nesting is not None and (
            int(max_plate_nesting) != max_plate_nesting or max_plate_nesting < 0
        ):
            raise ValueError(
                f"max_plate_nesting must be a non-negative int, got {max_plate_nesting!r}"
            )
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.model = completed_model(model)
        self.optim = optim
        self.num_particles = int(num_particles)
        self.max_plate_nesting = None if max_plate_nesting is None else int(max_plate_nesting)
        if kernel is None:
            whitened = not (precondition is False or precondition is None)
            kernel = default_kernel(whitened, self.num_particles)
        if not (isinstance(kernel, SteinKernel) or callable(getattr(kernel, "stein_terms", None))):
            raise TypeError(
                "kernel must be a kernel object of pyro_implicit.kernels (e.g. RBFKernel(), "
                f"IMQKernel()), a pyro SteinKernel, or None for the default, got {kernel!r}"
            )
        self.kernel = kernel
        self.method = method
        #: the :class:`~pyro_implicit.distributed.ParticleLayout` across processes, or
        #: ``None`` (one process)
        self.distributed = None
        if layout is not None:
            from ..distributed import ParticleLayout

            # after the kernel: its bandwidth rule counts all N particles
            self.distributed = ParticleLayout(layout, self.num_particles, optim, group)
            self.num_particles = self.distributed.num_local
        elif group is not None:
            raise ValueError("group= needs layout='replicated' or layout='sharded'")
        self._init_particles = init_particles
        self._precondition = precondition
        self.check_vectorization = bool(check_vectorization)
        #: names of the model's own ``pyro.param`` sites (read on the first step)
        self.param_names = ()
        #: the ``(N, D)`` particles (a leaf tensor), after the first step: the packed
        #: unconstrained latents, or their whitened coordinates ``z`` with a preconditioner
        #: (:meth:`unconstrained_particles` gives ``u = m + L z``)
        self.particles = None
        #: the :class:`~pyro_implicit.latent.Preconditioner` (identity without one)
        self.preconditioner = Preconditioner.identity()
        #: the model's :class:`~pyro_implicit.latent.LatentSpace`, after the first step
        self.space = None
        self._sites = None
        self._torch_optim = None
        self.latent_dim = None
        self._resume = None  # a state_dict waiting for the first step (load_state_dict)

    # ------------------------------------------------------------------ set-up
    def _setup(self, args, kwargs):
        """The set-up of the first step; ``True`` when the first step's own checks are still
        to be made (a fresh start), ``False`` once set up or resumed from a checkpoint."""
        if self._sites is not None:
            return False
        resume = self._resume
        if resume is None:
            self._setup_fresh(args, kwargs)
            return True
        # resuming (load_state_dict): the same set-up and first-step checks as a fresh start,
        # then the checkpoint's particles and optimiser state; the random draws they make
        # are undone, so the streams stay those of the checkpoint
        rng = pyro.util.get_rng_state()
        try:
            pre = resume["preconditioner"]
            self._precondition = False if pre.is_identity else pre  # no new search
            self._setup_fresh(args, kwargs)
            if self.distributed is None:
                self._prime(args, kwargs)
            else:
                self.distributed.agree(lambda: self._prime(args, kwargs))
            self._install(resume)
        finally:
            self._resume = None
            pyro.util.set_rng_state(rng)
        return False

    def _prime(self, args, kwargs):
        """The first step's one-off checks and set-up (shapes, compiled scores, ...),
        without an update: run when resuming from a checkpoint."""
        raise NotImplementedError

    def _setup_fresh(self, args, kwargs):
        if self.distributed is None:
            self._setup_space(args, kwargs)
            init = self._initial_particles(args, kwargs, self.space.dtype)
        else:
            # the same steps, agreed across the ranks (see ParticleLayout.setup)
            init = self.distributed.setup(self, args, kwargs)
        self.particles = init.detach().clone().requires_grad_(True)
        self.param_names = _param_names(self.model, args, kwargs)
        if self.distributed is not None:
            self.distributed.broadcast_parameters(self.model_parameters())
        if not isinstance(self.optim, PyroOptim):
            self._torch_optim = self.optim([self.particles] + self.model_parameters())

    def _setup_space(self, args, kwargs):
        """The latent space, the vectorisation check and the preconditioner."""
        who = type(self).__name__
        searching = self._precondition is True
        # a MAP search starts better from prior medians than from one prior draw
        proto = _Prototype(self.model, init_to_median if searching else init_to_sample)
        if self.max_plate_nesting is None:
            self.max_plate_nesting = _guess_max_plate_nesting(self.model, args, kwargs)
        with torch.no_grad(), prototype_errors_named(proto, who):
            proto._setup_prototype(*args, **kwargs)
        check_no_subsampled_local_latents(proto.prototype_trace, type(self).__name__)
        check_no_point_mass_latents(proto.prototype_trace, type(self).__name__)
        check_fixed_supports(self.model, proto.prototype_trace, args, kwargs, type(self).__name__)
        self.space = LatentSpace.from_guide(
            proto, args, kwargs, max_plate_nesting=self.max_plate_nesting
        )
        if self.space.max_plate_nesting != self.max_plate_nesting:
            raise ValueError(
                f"the model uses {self.space.max_plate_nesting} plate dims but "
                f"max_plate_nesting={self.max_plate_nesting}: pass the model's true plate "
                "nesting (or None to have it read from the model)"
            )
        self._sites = self.space.sites
        self.latent_dim = self.space.latent_dim
        init_loc = proto._init_loc().detach()
        # before the preconditioner's search, which would run on a model that mixes
        # particles too
        self._check_vectorized(args, kwargs, init_loc)
        if self._precondition is not False and self._precondition is not None:
            with poutine.block():
                self.preconditioner = resolve_precondition(
                    self._precondition, self.space, init_loc, args, kwargs
                )

    def _initial_particles(self, args, kwargs, dtype):
        """The optimised tensor's start: whitened when there is a preconditioner."""
        pre = self.preconditioner
        if self._init_particles is None and not pre.is_identity:
            # the preconditioner's Gaussian, z ~ N(0, I), and each other mode the search
            # found its share, drawn from its Laplace: SVGD keeps the shares it starts with
            z = torch.randn(
                self.num_particles, self.latent_dim, dtype=pre.loc.dtype, device=pre.loc.device
            )
            return spread_over_modes(pre, z)
        return pre.whiten(self._initial_unconstrained(args, kwargs, dtype))

    def _initial_unconstrained(self, args, kwargs, dtype):
        n = self.num_particles
        init = self._init_particles
        if init is None:
            with torch.no_grad(), poutine.block():
                trace = self._trace({}, args, kwargs)
            return self._pack({s.name: trace.nodes[s.name]["value"] for s in self._sites})
        if isinstance(init, dict):
            missing = [s.name for s in self._sites if s.name not in init]
            if missing:
                raise ValueError(f"init_particles lacks the latent sites {missing}")
            return self._pack(init)
        init = torch.as_tensor(init, dtype=dtype)
        if init.shape != (n, self.latent_dim):
            raise ValueError(
                f"init_particles must have shape (num_particles, latent_dim) = "
                f"({n}, {self.latent_dim}), got {tuple(init.shape)}"
            )
        return init

    def _pack(self, values):
        """``(N, D)`` unconstrained rows from ``{site: constrained value}``; a value may have
        shape ``(N, *site_shape)`` or the plate-aligned ``vec_shape``."""
        rows = []
        for s in self._sites:
            v = torch.as_tensor(values[s.name])
            u = s.transform.inv(v)
            u = u.reshape(self.num_particles, -1) if u.numel() > 0 else u
            if u.shape != (self.num_particles, s.stop - s.start):
                raise ValueError(
                    f"value of site '{s.name}' has shape {tuple(v.shape)}; expected "
                    f"({self.num_particles}, *{s.shape})"
                )
            rows.append(u)
        return torch.cat(rows, dim=-1)

    # ------------------------------------------------------------------ checkpoints
    def _local_rows(self):
        return slice(None) if self.distributed is None else self.distributed.rows

    def _total_particles(self):
        """All N particles, over every rank (:attr:`num_particles` is this rank's)."""
        return self.num_particles if self.distributed is None else self.distributed.num_particles

    def state_dict(self):
        """Everything a fit needs to resume: all N particles (gathered from the ranks with
        ``layout="sharded"``, so a collective: call it on every rank), the optimiser's
        state (the per-particle tensors, e.g. Adam's moments, gathered the same way), the
        preconditioner, Pyro's parameter store (the model's ``pyro.param`` values) and the
        random streams. :func:`~pyro_implicit.distributed.save_checkpoint` writes it from
        rank 0 and :func:`~pyro_implicit.distributed.load_checkpoint` reads it back; with
        ``torch.save`` read it with ``torch.load(path, weights_only=False)`` (it holds the
        preconditioner and the random streams' states, which torch's default
        ``weights_only=True`` refuses). :meth:`load_state_dict` resumes from it with any
        number of ranks.

        :rtype: dict
        """
        if self._sites is None:
            raise RuntimeError(
                f"{type(self).__name__} has no particles to checkpoint yet: call step(*args) first"
            )
        sharded = self.distributed is not None and self.distributed.layout == "sharded"

        def gather(t):
            return self.distributed.gather(t) if sharded else t

        particles = gather(self.particles.detach()).clone()
        return {
            "type": type(self).__name__,
            "method": self.method,
            "layout": None if self.distributed is None else self.distributed.layout,
            "num_particles": len(particles),
            "latent_dim": self.latent_dim,
            "particles": particles,
            "optim": self._optim_state(gather),
            "preconditioner": copy.deepcopy(self.preconditioner),
            "params": copy.deepcopy(pyro.get_param_store().get_state()),
            "rng": pyro.util.get_rng_state(),
        }

    def _optim_state(self, gather):
        """The optimiser's state: the particles' (their tensors shaped like the particles,
        e.g. Adam's moments, gathered over all N rows; the others, e.g. Adam's step
        count, the same on every rank) and the model parameters' (the same on every
        rank)."""
        p = self.particles
        if self._torch_optim is not None:
            out = {"torch": copy.deepcopy(self._torch_optim.state_dict())}
            particle_state = out["torch"]["state"].get(0, {})
        else:
            opt = self.optim.optim_objs.get(p)
            if not isinstance(opt, torch.optim.Optimizer):
                raise NotImplementedError(
                    "checkpoints of particle methods hold plain torch optimisers' states (a "
                    f"pyro.optim.PyroOptim of one), not a {type(opt).__name__}"
                )
            from pyro.optim.optim import _get_state_dict

            store = pyro.get_param_store()
            params = set(map(id, self.model_parameters()))
            out = {
                "particles": copy.deepcopy(opt.state_dict()),
                "params": {
                    store.param_name(q): copy.deepcopy(_get_state_dict(o))
                    for q, o in self.optim.optim_objs.items()
                    if id(q) in params
                },
            }
            particle_state = out["particles"]["state"].get(0, {})
        out["per_particle"] = sorted(
            k for k, v in particle_state.items() if torch.is_tensor(v) and v.shape == p.shape
        )
        for k in out["per_particle"]:  # the same keys, in the same order, on every rank
            particle_state[k] = gather(particle_state[k])
        return out

    def load_state_dict(self, state):
        """Resume from :meth:`state_dict` (of a run with any number of ranks, or of one
        process), into a particle method built with the same arguments that has not
        stepped yet. Pyro's parameter store and the random streams are restored now; the
        particles, the optimiser's state and the preconditioner on the next :meth:`step`
        (which needs the model's arguments to set the method up): this rank's rows of the N
        particles (``layout="sharded"``) or all of them, and the same rows of the
        per-particle optimiser state. The set-up's own random draws are undone, so the
        step continues the checkpoint's random streams.
        """
        if self._sites is not None:
            raise ValueError(
                "load_state_dict resumes a particle method that has not stepped yet: build a "
                "fresh one with the same arguments and load into it"
            )
        total = self._total_particles()
        if state.get("type") != type(self).__name__ or state["num_particles"] != total:
            raise ValueError(
                f"the checkpoint holds {state['num_particles']} particles of a "
                f"{state.get('type')}, not {total} of a {type(self).__name__}"
            )
        kind = "particles" if isinstance(self.optim, PyroOptim) else "torch"
        if kind not in state["optim"]:
            raise ValueError(
                "the checkpoint's optimiser state is of the other kind (a pyro.optim.PyroOptim "
                "against a callable params -> torch.optim.Optimizer): build the method with "
                "the same kind of optimiser as the saving run"
            )
        store = pyro.get_param_store()
        store.clear()
        store.set_state(copy.deepcopy(state["params"]))
        pyro.util.set_rng_state(state["rng"])
        self._resume = state

    def _install(self, state):
        """The checkpoint's particles and optimiser state, this rank's rows of them."""
        rows = self._local_rows()
        if tuple(state["particles"].shape[1:]) != (self.latent_dim,):
            raise ValueError(
                f"the checkpoint's particles have {state['particles'].shape[1]} coordinates, "
                f"the model's packed latent {self.latent_dim}"
            )
        with torch.no_grad():
            self.particles.copy_(state["particles"][rows])
        optim = state["optim"]

        def local(sd):
            sd = copy.deepcopy(sd)
            for k in optim["per_particle"]:
                if sd["state"][0][k].shape != state["particles"].shape:
                    raise ValueError(
                        f"the checkpoint's optimiser state {k!r} has shape "
                        f"{tuple(sd['state'][0][k].shape)}, not that of its particles "
                        f"{tuple(state['particles'].shape)}"
                    )
                sd["state"][0][k] = sd["state"][0][k][rows].clone()
            return sd

        if self._torch_optim is not None:
            self._torch_optim.load_state_dict(local(optim["torch"]))
            return
        p = self.particles
        self.optim.optim_objs[p] = self.optim._get_optim(p)
        self.optim.grad_clip[p] = self.optim._get_grad_clip(p)
        self.optim.optim_objs[p].load_state_dict(local(optim["particles"]))
        # the model's parameters: consumed when the optimiser first sees them
        self.optim.set_state(copy.deepcopy(optim["params"]))

    # ------------------------------------------------------------------ model runs
    def _unpack(self, particles, log_jacobian=False):
        """Constrained, plate-aligned site values of the unconstrained rows ``particles``
        (keeping the graph), the unconstrained views, and optionally the per-particle
        log |det dT/du|."""
        values, views, ladj = self.space.unpack_views(particles, log_jacobian=log_jacobian)
        return values, views, (ladj if log_jacobian else 0.0)

    def unconstrained_particles(self):
        """The ``(N, D)`` packed unconstrained latents of the particles, ``u = m + L z``
        (with the autograd graph to :attr:`particles`)."""
        return self.preconditioner.unwhiten(self.particles)

    def _trace(self, values, args, kwargs, size=None, name=None):
        """Trace the model under the particle plate, conditioned on ``values``."""
        model = poutine.condition(self.model, data=values) if values else self.model
        plate = pyro.plate(
            name or self.plate_name, size or self.num_particles, dim=-self.max_plate_nesting - 1
        )
        with plate:
            trace = poutine.trace(model).get_trace(*args, **kwargs)
        return trace

    def _check_shapes(self, trace):
        check_trace_shapes(trace, self.max_plate_nesting + 1)

    def _particle_sum(self, trace, names):
        """Per-particle sum of the (scaled, masked) log-densities of the named sites."""
        total = 0.0
        for name in names:
            total = total + particle_sum(
                trace.nodes[name]["log_prob"], self.num_particles, self.max_plate_nesting + 1
            )
        if not torch.is_tensor(total):
            total = self.particles.new_zeros(self.num_particles)
        return total

    def _observed_names(self, trace):
        latent = {s.name for s in self._sites}
        return [
            name
            for name, site in trace.nodes.items()
            if site["type"] == "sample"
            and site["is_observed"]
            and name not in latent
            and not site_is_subsample(site)
            and not _is_deterministic(site)
        ]

    # ------------------------------------------------------------------ updates
    def model_parameters(self):
        """The unconstrained tensors of the model's own ``pyro.param`` sites (from Pyro's
        parameter store), which the particle method trains with the particles."""
        store = pyro.get_param_store()
        return [store.get_param(name).unconstrained() for name in self.param_names]

    def _apply(self, direction, param_grads=None):
        """One optimiser step along the ascent ``direction`` (grads = -direction), and of
        the model's parameters along ``param_grads`` (gradients of the loss, i.e. minus
        the mean log-joint, in :meth:`model_parameters` order)."""
        if not torch.isfinite(direction).all():
            bad = sorted(
                {
                    s.name
                    for s in self._sites
                    if not torch.isfinite(direction[:, s.start : s.stop]).all()
                }
            )
            raise DivergenceError(
                f"{type(self).__name__}: the update direction of site(s) {bad} is not finite "
                "(the model's log-density or its gradient is not finite at some particles). "
                f"The particles have diverged. {DIVERGENCE_ADVICE}"
            )
        self.particles.grad = -direction.detach().to(self.particles.dtype)
        params = []
        for p, g in zip(self.model_parameters(), param_grads or (), strict=False):
            if g is not None:
                p.grad = g.detach().to(p.dtype)
                params.append(p)
        if self._torch_optim is not None:
            self._torch_optim.step()
        else:
            self.optim([self.particles] + params)
        self.particles.grad = None
        for p in params:
            p.grad = None

    #: largest magnitude of an unconstrained particle coordinate before the particles count
    #: as diverged (as :attr:`pyro_implicit.elbo.base.ImplicitELBO.max_abs_draw`; ``None``
    #: disables the check)
    max_abs_particle = 1e12

    def _check_finite(self):
        """Stop with a :class:`~pyro_implicit.elbo.base.DivergenceError` naming the sites
        whose particles are no longer finite or have exploded (instead of a validation
        error deep in the model, or draws of 1e45 without a word)."""
        u = self.unconstrained_particles().detach()
        limit = math.inf if self.max_abs_particle is None else self.max_abs_particle
        ok = torch.isfinite(u) & (u.abs() <= limit)
        if bool(ok.all()):
            return
        bad = [s.name for s in self._sites if not bool(ok[:, s.start : s.stop].all())]
        rows = (~ok).any(-1).nonzero().flatten().tolist()
        raise DivergenceError(
            f"{type(self).__name__}: particle(s) {rows[:10]} hold non-finite values of "
            f"site(s) {bad}, or values beyond max_abs_particle={self.max_abs_particle:g} in "
            f"unconstrained space. The particles have diverged. {DIVERGENCE_ADVICE}"
        )

    def _check_vectorized(self, args, kwargs, init_loc):
        """The losses' vectorisation check (:func:`~pyro_implicit.elbo.checks.
        check_space_vectorized`) on a few draws around the initial location, before any
        search or step."""
        if self.check_vectorization:
            check_space_vectorized(self.space, args, kwargs, init_loc)

    @staticmethod
    def _norm(t):
        return t.norm(dim=-1).mean().item()

    def step(self, *args, **kwargs):
        """One update of all particles; returns a dict of diagnostics."""
        raise NotImplementedError

    def run(self, num_steps, *args, progress_bar=False, **kwargs):
        """Call :meth:`step` ``num_steps`` times with the model's arguments.

        :param bool progress_bar: show a ``tqdm`` bar with the last diagnostics.
        :return: ``{diagnostic: list of values, one per step}``.
        """
        history = collections.defaultdict(list)
        steps = range(num_steps)
        if progress_bar:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc=type(self).__name__, **refresh_intervals())
        for _ in steps:
            diag = self.step(*args, **kwargs)
            for key, value in diag.items():
                history[key].append(value)
            if progress_bar:
                steps.set_postfix({k: f"{v:.3g}" for k, v in diag.items()}, refresh=False)
        return dict(history)

    # ------------------------------------------------------------------ results
    @torch.no_grad()
    def get_named_particles(self, *args, **kwargs):
        """``{site: (N, *site_shape)}`` constrained particle values, detached copies, without the
        plate-padding dims: ready for ``Predictive(model, posterior_samples=...)``, which then
        predicts with the equal-weight mixture over particles.

        After :meth:`load_state_dict`, before any step, pass the model's arguments: they
        set the method up and restore the checkpoint's particles, without a step (which
        would move them)."""
        if self._sites is None and self._resume is not None:
            if args or kwargs or _runs_without_arguments(self.model):
                self._setup(args, kwargs)
        if self._sites is None:
            after_load = self._resume is not None
            raise RuntimeError(
                "no particles yet: call step(*args) first"
                + (
                    "; after load_state_dict, get_named_particles(*args) restores the "
                    "checkpoint's particles without a step"
                    if after_load
                    else ""
                )
            )
        # clone: for real-valued sites the values are views of the live particle tensor
        values, _, _ = self._unpack(self.unconstrained_particles().detach().clone())
        return {
            s.name: values[s.name].reshape((self.num_particles,) + s.shape) for s in self._sites
        }


#: the length scale of a preconditioned :class:`WeightSpaceSVGD`'s default kernel, in
#: median distances between the whitened particles (see the module's "Bandwidth rule")
WHITENED_BANDWIDTH_FACTOR = 1.4

#: ``num_particles="auto"`` of :class:`WeightSpaceSVGD`: N = PARTICLES_PER_DIM * D,
#: within AUTO_PARTICLES. SVGD's particles lose spread when D grows against N; on the
#: stochastic-volatility posterior (D = 33) 100 particles ended 1.57 NUTS sds off (sd
#: ratios down to 0.11) and 300 ended 0.20 off (0.64) from the preconditioner's one-round
#: Gaussian (``svgd_particles.md``); from the Gaussian fitted in rounds, 300 ended 0.31-0.42
#: off at seeds 0-2, their spread in ``phi_raw``'s tail growing the longer they ran, 600
#: ended 0.14-0.17 off for about twice the seconds and the rule's own 990 0.05-0.11 for
#: 3.2-3.9 times (``svgd_particles_sv_seed*.md``). The cap stays at 300 because a step's
#: cost can grow faster than N: on the 22-coefficient waveform regression (400 rows, the
#: model broadcasting an (N, 400, 22) product) a step took 12 ms with 300 particles and 61
#: with 600 (``svgd_step_cost.md``), where 100 already fit as well. Pass ``num_particles``
#: for more. On the
#: non-centred eight schools (D = 10, ``compare``'s schedule, seeds 0-3) a few of 100
#: particles sit far out in ``tau``'s heavy right tail: 0.46 sds off on average (``tau``'s
#: sd up to 5.5 times NUTS's), 200 particles 0.20, 300 particles 0.11, for 1.3 times the
#: seconds (``benchmarks/results/svgd_particle_count.md``).
PARTICLES_PER_DIM = 30
AUTO_PARTICLES = (100, 300)

#: :class:`WeightSpaceSVGD` warns (:class:`~pyro_implicit.errors.FewParticlesWarning`) on a
#: latent of more than :data:`FEW_PARTICLES_DIM` coordinates that are not a network's
#: weights with fewer than :data:`MIN_PARTICLES_PER_DIM` particles per coordinate. On
#: non-centred hierarchical logistic regressions (about 7 rows per group; 2000 steps of
#: ``Adam(1e-2)`` against NUTS, ``benchmarks/results/audit_probes_s64.md`` section 4) the
#: particles drift in the group scale: 300 of them ended 0.05 NUTS sds off at D = 60, 0.36
#: at 100, 1.15 at 150 and 4.65 at 300 (10.5 after 5000 steps); five per coordinate 0.20
#: at D = 100 and 0.41 at 150, ten 0.16 and 0.21 (eight times the seconds of 300 at 150),
#: all with the kernel at 1.4 median distances (beyond 100 latents it is now wider,
#: :data:`WIDE_BANDWIDTH_DIM`: 300 particles 0.28-0.30 at 150 and 1.54 at 300).
#: A network's weights do not warn: a few particles for thousands of weights is f-POVI's
#: setting, whose collapse :class:`~pyro_implicit.particles.FunctionSpaceSVGD` answers.
FEW_PARTICLES_DIM = 60
MIN_PARTICLES_PER_DIM = 10

#: beyond :data:`WIDE_BANDWIDTH_DIM` latent coordinates that are not a network's weights the
#: default kernel of whitened particles is :data:`WIDE_BANDWIDTH_FACTOR` median distances
#: wide instead of :data:`WHITENED_BANDWIDTH_FACTOR`. With 300 particles (2000 steps of
#: ``Adam(1e-2)`` against NUTS, ``benchmarks/results/audit_probes_s64.md`` section 4) the
#: group scale of three non-centred hierarchical models of about 150 latents ended 0.25-0.37
#: NUTS sds off instead of 0.37-1.43 (a logistic regression at seeds 0-2: 1.15-1.31 ->
#: 0.28-0.30; many schools 0.37 -> 0.25; a Poisson regression 1.35-1.43 -> 0.37), and of
#: the logistic one at 300 latents 1.54 instead of 4.65; a Gaussian posterior of 150 latents
#: stayed exact (``wide_blr``). At 100 latents it traded the error (0.15-0.36 -> 0.12-0.21)
#: for a too-narrow group scale (sd 0.94-1.32 -> 0.51-0.72 of NUTS's), so the rule starts
#: beyond. A network's weights keep the narrower kernel.
WIDE_BANDWIDTH_DIM = 100
WIDE_BANDWIDTH_FACTOR = 3.0


def _count_of(init_particles):
    """The particle count an ``init_particles`` start fixes (``None``: none given)."""
    if init_particles is None:
        return None
    if isinstance(init_particles, dict):
        return int(torch.as_tensor(next(iter(init_particles.values()))).shape[0])
    return int(torch.as_tensor(init_particles).shape[0])


def auto_num_particles(latent_dim):
    """The particle count of ``num_particles="auto"`` for a packed latent of size D:
    :data:`PARTICLES_PER_DIM` per dimension, within :data:`AUTO_PARTICLES`."""
    low, high = AUTO_PARTICLES
    return int(min(high, max(low, PARTICLES_PER_DIM * int(latent_dim))))


class WeightSpaceSVGD(ParticleInference):
    r"""Stein variational gradient descent on a Pyro model's packed unconstrained latents
    (Liu & Wang, 2016), plus the w-SGLD, pi-SGLD and GFSF rules of f-POVI's Table 1.

    Used like ``pyro.infer.SVGD(..., mode="multivariate")``::

        svgd = WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}), num_particles=50,
                               max_plate_nesting=1)
        for _ in range(1000):
            svgd.step(x, y)
        samples = Predictive(model, posterior_samples=svgd.get_named_particles())(x_test)

    The score of particle :math:`u_i` is :math:`\nabla_u [\log p(x, T(u)) + \log |\det
    \partial T / \partial u|]` (the unconstrained-space posterior, as Pyro's SVGD), taken by
    one backward pass through one vectorised model run. The kernel acts on the whole
    particle rows (all sites jointly, particle-major) with an isotropic bandwidth; kernel
    sums are ``(N, N)`` matrix products, so a step needs :math:`O(N^2 + N D)` memory for the
    update instead of the several :math:`(N, N, D)` tensors of ``pyro.infer.SVGD``.

    In over-parameterised models (BNNs) weight-space SVGD collapses towards one function as
    the width grows (f-POVI, Sec. 2 and Fig. 5);
    :class:`~pyro_implicit.particles.FunctionSpaceSVGD` fixes that.

    Defaults: ``num_particles="auto"``, thirty per latent dimension within 100-300
    (:func:`auto_num_particles`; on a D = 33 stochastic-volatility posterior 300 particles
    ended 0.31-0.42 NUTS sds off at seeds 0-2 and 600 ended 0.14-0.17 off: pass
    ``num_particles`` above the cap where D exceeds 10 and the posterior has a heavy tail
    or a funnel; on the non-centred eight schools, D = 10, 100 particles ended 0.46 sds off
    on average over four seeds and 300 ended 0.11), the model's plate nesting read on the
    first step.

    ``compile="fx"`` (default) scores the particles with a traced graph of the model's
    log-density (:meth:`~pyro_implicit.latent.LatentSpace.compile`: the model's Python
    and Pyro's handlers run once, not on every step; the same numbers; about 1.2-2x faster
    per score on small models, ``benchmarks/results/compiled_score.md``); ``"inductor"``
    also compiles it (seconds to build, an order of magnitude faster per step on small
    models); ``False`` stays eager. A model with its own ``pyro.param`` stays eager
    (the graph would freeze the parameter); so does one that cannot be traced, with the
    reason logged.

    With the default ``precondition=True`` the particles start at draws of the
    preconditioner's Gaussian (:mod:`pyro_implicit.latent`) and move in its whitened
    coordinates, where one isotropic bandwidth and one learning rate suit every direction
    (``precondition=False``: the raw packed space, as ``pyro.infer.SVGD``).

    Across processes (``torchrun``), ``layout="replicated"`` shards the data and keeps
    every particle on every rank, ``layout="sharded"`` shards the particles and keeps the
    data; R ranks then end where one process ends, to rounding
    (:class:`~pyro_implicit.distributed.ParticleLayout`)::

        dist.init_process_group("gloo")             # "nccl" on GPUs
        pyro.set_rng_seed(0)                        # the same seed on every rank
        svgd = WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}), num_particles=64,
                               layout="sharded")    # 64 / world size particles per rank
        for batch in global_batches:                # the same on every rank
            svgd.step(x, y, batch)                  # "replicated": rank_shard(batch)
        particles = gather_named_particles(svgd)    # all 64, on every rank

    See :class:`ParticleInference` for the arguments.
    """

    def __init__(
        self,
        model,
        optim,
        num_particles="auto",
        max_plate_nesting=None,
        kernel=None,
        method="svgd",
        init_particles=None,
        precondition=True,
        check_vectorization=True,
        compile="fx",
        layout=None,
        group=None,
    ):
        #: the count is still to be chosen from the latent size (on the first step)
        self._auto_particles = False
        if isinstance(num_particles, str):
            if num_particles != "auto":
                raise ValueError(
                    f"num_particles must be a positive int or 'auto', got {num_particles!r}"
                )
            if layout is not None:
                raise ValueError(
                    "a layout across processes needs the particle count up front: pass "
                    "num_particles=N (e.g. auto_num_particles(D)) with layout="
                )
            start = _count_of(init_particles)  # a start fixes the count
            self._auto_particles = start is None
            num_particles = start or AUTO_PARTICLES[0]  # a placeholder until then
        super().__init__(
            model,
            optim,
            num_particles,
            max_plate_nesting,
            kernel,
            method,
            init_particles,
            precondition,
            check_vectorization,
            layout,
            group,
        )
        if compile not in (None, False) and compile not in BACKENDS:
            raise ValueError(f"compile must be False or one of {BACKENDS}, got {compile!r}")
        self.compile = compile or None
        # the default kernel of the raw space counts the particles (Liu & Wang's rule)
        self._count_kernel = kernel is None and (precondition is False or precondition is None)
        self._default_kernel = kernel is None
        self._warned_drift = False  # the runaway warning is given once
        self._num_steps = 0

    def _choose_count(self, num_particles):
        """Fix the ``"auto"`` particle count (and the default kernel that counts them)."""
        self.num_particles = int(num_particles)
        self._auto_particles = False
        if self._count_kernel:
            self.kernel = default_kernel(False, self.num_particles)

    def _setup_space(self, args, kwargs):
        super()._setup_space(args, kwargs)
        if self._auto_particles:
            self._choose_count(auto_num_particles(self.latent_dim))
        if self._default_kernel and not self._count_kernel:
            self.kernel = self._whitened_kernel()
        self._check_particle_count()

    def _check_particle_count(self):
        """Warn where the particles are too few for the latent (:data:`FEW_PARTICLES_DIM`)."""
        dim = self.latent_dim
        total = self._total_particles()
        if self.space.network or dim <= FEW_PARTICLES_DIM or total >= MIN_PARTICLES_PER_DIM * dim:
            return
        warnings.warn(
            f"{type(self).__name__}: {total} particles for {dim} latent coordinates. SVGD's "
            "particles lose spread as the dimension grows against their number, and a "
            "scale that many latents share drifts to make up for it, with no sign in the "
            "Stein discrepancy: on hierarchical regressions 300 particles left the group "
            "scale 0.15-0.36 NUTS sds off at 100 latents, 0.25-0.37 at 150 and 1.54 at 300. "
            "Pass "
            f"num_particles={MIN_PARTICLES_PER_DIM * dim} ({MIN_PARTICLES_PER_DIM} per "
            "coordinate: 0.16 sds off at 100 latents) and check the fit against NUTS "
            "(pyro_implicit.compare), or fit ImplicitGuide with SteinScoreELBO() (0.12 sds "
            "off at 300). A network's weights (sites marked infer={'network_weights': True}) "
            "do not warn.",
            FewParticlesWarning,
            stacklevel=6,  # the caller of step()
        )

    def load_state_dict(self, state):
        if self._auto_particles and state.get("type") == type(self).__name__:
            self._choose_count(state["num_particles"])  # the checkpoint says how many
        super().load_state_dict(state)
        pre = state.get("preconditioner")
        if pre is not None and not pre.is_identity:  # e.g. refreshed from a raw-space start
            self._whitened_default_kernel()

    load_state_dict.__doc__ = ParticleInference.load_state_dict.__doc__

    def refresh_preconditioner(self, kind="diagonal"):
        r"""Re-whiten the particles by their own moments: the preconditioner becomes
        :math:`(m, L)` with :math:`m` the particles' mean and :math:`L` their sds
        (``kind="diagonal"``) or the Cholesky factor of their covariance (``"dense"``) in
        the unconstrained space, and the particles are re-expressed in its coordinates (the
        same points :math:`u`, so :meth:`get_named_particles` does not move). The
        optimiser's state of the particles is reset: its moments were in the old
        coordinates. The kernel's bandwidth and the learning rate then act in the new ones
        (from the raw space, the default kernel becomes that of whitened particles, 1.4
        median distances).

        Off unless called (issue #20's "optionally refreshed during training from the
        running covariance of the draws"). Once at step 500 of 2000 on the stiff benchmark
        (``Adam(1e-2)``, ``benchmarks/results/preconditioner_refresh_wsvgd_diagonal.md``),
        the diagonal refresh took stochastic volatility from 0.174-0.248 to 0.095-0.111
        NUTS sds off and the banana from 0.123-0.211 to 0.046-0.084 (seeds 0-2), but Neal's
        funnel from 0.136-0.147 to 0.181-0.212, the centred eight schools from 0.020 to
        0.033 and the mixture from 0.011 to 0.022 (seed 0; the other three within 0.002),
        and on the non-centred eight schools trained 5000 steps with ``compare``'s rate it
        widened ``tau``'s tail far more (sd ratio 9-34 against 1.8-6.3 without).
        The dense one moved stochastic volatility to 0.48 instead
        (``preconditioner_refresh_wsvgd.md``).

        :param str kind: ``"diagonal"`` (default) or ``"dense"`` (needs more particles
            than latent dimensions).
        :return: the new :class:`~pyro_implicit.latent.Preconditioner`.
        """
        if kind not in ("dense", "diagonal"):
            raise ValueError(f"kind must be 'diagonal' or 'dense', got {kind!r}")
        if self.particles is None:
            raise RuntimeError(
                f"{type(self).__name__} has no particles to refresh from yet: call step(*args) "
                "first"
            )
        sharded = self.distributed is not None and self.distributed.layout == "sharded"
        with torch.no_grad():
            u_local = self.unconstrained_particles().detach()
            # every rank computes the same moments from all N particles
            u = self.distributed.gather(u_local) if sharded else u_local
            n, dim = u.shape
            if kind == "dense" and n <= dim:
                raise ValueError(
                    f"a dense refresh needs more particles than latent dimensions ({n} "
                    f"particles, {dim} dimensions): pass kind='diagonal' or more particles"
                )
            loc = u.mean(0)
            if kind == "dense":
                # the draws' covariance factored in float64, 1e-10 of its mean variance
                # added (KernelRatioELBO's full contrast); its diagonal where that fails
                gauss = _dense_gaussian(loc, u - loc, n - 1, 1e-10, u.std(0))
                if not isinstance(gauss, torch.distributions.MultivariateNormal):
                    raise ValueError(
                        "the particles' covariance is not positive definite (have they "
                        "collapsed?): pass kind='diagonal'"
                    )
                new = Preconditioner(loc=loc, scale_tril=gauss.scale_tril, source="particles")
            else:
                sd = u.std(0)
                if not (sd > 0).all():
                    raise ValueError(
                        "some coordinate has the same value at every particle: the particles "
                        "have collapsed there and cannot set its scale"
                    )
                new = Preconditioner(loc=loc, scale=sd, source="particles")
        self._rewhiten(new)
        return new

    def _rewhiten(self, preconditioner):
        """Install ``preconditioner``: the particles re-expressed in its coordinates (the
        same points u), the optimiser's state of the particles reset, the whitened default
        kernel in place of the raw space's."""
        with torch.no_grad():
            u = self.unconstrained_particles()
            self.particles.copy_(preconditioner.whiten(u).to(self.particles.dtype))
        self.preconditioner = preconditioner
        self._reset_particle_optimizer_state()
        self._whitened_default_kernel()

    def _whitened_default_kernel(self):
        """The default kernel of whitened particles (:meth:`_whitened_kernel`) in place of the
        raw space's default (Liu & Wang's, which counts the particles), once the particles
        are whitened; a kernel of the caller's stays."""
        if self._count_kernel:
            self._count_kernel = False
            self.kernel = self._whitened_kernel()

    def _whitened_kernel(self):
        """The default kernel of whitened particles: :data:`WHITENED_BANDWIDTH_FACTOR`
        median distances, :data:`WIDE_BANDWIDTH_FACTOR` beyond :data:`WIDE_BANDWIDTH_DIM`
        latent coordinates that are not a network's weights."""
        if (
            self.space is not None
            and self.latent_dim > WIDE_BANDWIDTH_DIM
            and not self.space.network
        ):
            return RBFKernel(bandwidth_factor=WIDE_BANDWIDTH_FACTOR)
        return default_kernel(True, self.num_particles)

    def _reset_particle_optimizer_state(self):
        """Forget the optimiser's state of the particles (not of the model's parameters)."""
        p = self.particles
        if self._torch_optim is not None:
            self._torch_optim.state.pop(p, None)
        elif isinstance(self.optim, PyroOptim) and p in self.optim.optim_objs:
            self.optim.optim_objs[p].state.pop(p, None)

    def step(self, *args, **kwargs):
        """One SVGD update of all particles (with ``layout="sharded"``: of this rank's
        particles, from their interaction with all N).

        :return: ``{"attractive", "repulsive"}`` (mean per-particle norms of the score part
            and the kernel-gradient part of the direction), ``"bandwidth"`` (the kernel's
            length scale :math:`\\sigma`, :math:`k = \\exp(-d^2 / 2\\sigma^2)`) and
            ``"log_joint"`` (mean over particles, unconstrained space).
        """
        first = self._setup(args, kwargs)
        if self.distributed is None:
            self._check_finite()
            log_joint, score, param_grads = self._scores(args, kwargs, first)
            particles, block = self.particles, {}
        else:
            # every rank scores its particles on its data; the ranks then agree on the
            # (averaged or gathered) scores, or all raise the first rank's error
            def scores():
                self._check_finite()
                return (self.particles.detach(), *self._scores(args, kwargs, first))

            particles, log_joint, score, param_grads = self.distributed.exchange(
                self, scores, width=self.latent_dim
            )
            block = self.distributed.block
        if not math.isfinite(log_joint.detach().sum().item()):
            bad = torch.nonzero(~torch.isfinite(log_joint.detach())).flatten().tolist()
            raise DivergenceError(
                f"{type(self).__name__}: the log-joint of particle(s) {bad[:10]} is not "
                f"finite. {DIVERGENCE_ADVICE}"
            )
        d = stein_direction(particles, score, self.kernel, self.method, **block)
        # the model's parameters descend minus the particles' mean log-joint (all N of them)
        n = particles.shape[0]
        self._apply(d.direction, [None if g is None else -g / n for g in param_grads])
        self._check_drift()
        return {
            "attractive": self._norm(d.drive),
            "repulsive": self._norm(d.repulsion),
            "bandwidth": d.bandwidth.item(),
            "log_joint": log_joint.detach().mean().item(),
        }

    def _check_drift(self):
        """Warn once (:class:`~pyro_implicit.errors.RunawayWarning`) when the particles' mean
        has moved :data:`~pyro_implicit.elbo.base.RUNAWAY_DRIFT` of the preconditioner's sds
        from its mean (largest over coordinates; every
        :data:`~pyro_implicit.elbo.base.RUNAWAY_CHECK_EVERY` steps). Fits that held stayed
        within 3.3 (the eight stiff posteriors at seeds 0-1 over 2000 steps, the three whose
        drift grew over 5000 at seed 0) and 4.7 (UCI BNNs of 402 and 752 weights); past 12
        went runs whose particles had lost their spread (a
        300-latent hierarchical regression, 10.5 NUTS sds off after 5000 steps) and the
        w-SGLD and pi-SGLD rules at 150 latents (8.6 off;
        ``benchmarks/results/audit_probes_s64.md`` section 4)."""
        self._num_steps += 1
        if (
            self._warned_drift
            or self.preconditioner.is_identity
            or self._num_steps % RUNAWAY_CHECK_EVERY
        ):
            return
        drift = self.particles.detach().mean(0).abs().max().item()
        if not drift > RUNAWAY_DRIFT:
            return
        self._warned_drift = True
        warnings.warn(
            f"{type(self).__name__}: the particles' mean has moved {drift:.1f} of the "
            "preconditioner's sds from the preconditioner's mean, where fits that held "
            "stayed within 5 (the stiff posteriors, up to 5000 steps; UCI BNNs). Runs past "
            f"{RUNAWAY_DRIFT:.0f} had drifted off: particles too few for the dimension (a "
            "300-latent hierarchical regression ended 10.5 NUTS sds off) or the w-SGLD and "
            "pi-SGLD rules at 150 latents (8.6 off). Check this fit against NUTS "
            "(pyro_implicit.compare) before trusting it; more particles (num_particles) and "
            "SVGD's own rule (method='svgd') are the first things to try.",
            RunawayWarning,
            stacklevel=3,
        )

    def _prime(self, args, kwargs):
        self._scores(args, kwargs, True)

    def _scores(self, args, kwargs, first):
        """``(log_joint, score, param_grads)`` of this process's particles: ``(N,)``,
        ``(N, D)`` (in the particles' coordinates) and the sums over particles of the
        gradients of the model's parameters (``[]`` without any)."""
        with torch.enable_grad():
            # with a preconditioner the particles are z and the score below is
            # L^T grad_u by the chain rule: the update acts in whitened coordinates
            u = self.unconstrained_particles()
            if first:
                values, _, _ = self._unpack(u.detach())
                self._check_shapes(self._trace(values, args, kwargs))
            params = self.model_parameters()
            if first and self.compile and not params:
                self.space.compile(self.compile)
            if self.space.compiled is not None and not params:
                # the traced score (the model's Python runs once per input signature);
                # by the chain rule the whitened particles' score is L^T grad_u
                log_joint, score_u = self.space.score(u.detach(), args, kwargs, full_data=False)
                return log_joint, self.preconditioner.whiten_score(score_u), []
            # one minibatch estimate when the model subsamples: SVGD is stochastic
            log_joint = self.space.log_density(u, args, kwargs, full_data=False)
            score, *param_grads = torch.autograd.grad(
                log_joint.sum(), [self.particles] + params, allow_unused=True
            )
        return log_joint, score, param_grads
