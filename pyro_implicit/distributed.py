r"""Data-parallel SVI across processes with ``torch.distributed``: each rank fits on its
own shard of every global minibatch, and the gradients of all Pyro parameters are averaged
before each optimiser step.

The same wrapper serves every guide and loss that trains through a
:class:`~pyro.optim.PyroOptim` (the library's and Pyro's). Launch with ``torchrun``
(``torchrun --standalone --nproc_per_node=2 fit.py`` on CPU with the ``gloo`` backend, the
same script with ``nccl`` on GPUs)::

    import torch.distributed as dist
    from pyro_implicit.distributed import DistributedOptim, rank_shard

    dist.init_process_group("gloo")
    pyro.set_rng_seed(0)                      # the same seed on every rank (see below)
    optim = DistributedOptim(pyro.optim.Adam({"lr": 1e-2}))
    svi = SVI(model, guide, optim, loss)
    batches = torch.Generator().manual_seed(1)  # the same global batches on every rank
    for step in range(num_steps):
        batch = torch.randperm(n, generator=batches)[:global_batch_size]
        svi.step(x, y, subsample=rank_shard(batch))

with a model whose data plate takes the indices, ``pyro.plate("data", n, subsample=...)``.
Each rank then scales its likelihood by ``n / len(shard)``, so the average over ranks of
their gradients is the gradient of the global minibatch's estimate, which one process would
compute from the whole global batch.

Random streams. Parameters are created lazily, on a guide's first call, from the random
stream: seed every rank identically so that they agree (the first optimiser call also
broadcasts rank 0's values, so a rank that differs is overwritten, after one step computed
at its own values). The guide's noise is drawn per rank from that same stream, so every rank
draws the *same* particles: the averaged gradient is then the single-process gradient of
the global batch at those particles, reproducible and independent of the number of ranks.
A loss's own auxiliary optimiser (``GPVI_ELBO``'s helper network) is not synchronised.

Checkpoints. Parameters and optimiser states are the same on every rank, so
:func:`save_checkpoint` writes them once, from rank 0, with the random streams; every rank
(of a run with any number of ranks, or one process) resumes with :func:`load_checkpoint`.
A particle method is checkpointed the same way (``save_checkpoint(path, svgd)``): rank 0
writes all N particles, gathered from the ranks in the sharded layout, with their
optimiser state, and a run with another number of ranks (or one process) takes its own
rows of them.

Particle methods. :class:`~pyro_implicit.particles.WeightSpaceSVGD` runs across ranks
with ``layout="replicated"`` (all particles on every rank, the data sharded) or
``layout="sharded"`` (the particles sharded, the data on every rank);
:class:`~pyro_implicit.particles.FunctionSpaceSVGD` with either layout; see
:class:`ParticleLayout`. They take a plain optimiser: the layout combines the scores and
the model parameters' gradients itself.

References: Pyro's ``HorovodOptimizer`` (the same role, through Horovod).
"""

import copy
import pickle

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = [
    "LAYOUTS",
    "DistributedOptim",
    "ParticleLayout",
    "gather_named_particles",
    "load_checkpoint",
    "rank_shard",
    "save_checkpoint",
]

#: how a particle method spreads its particles over the ranks (:class:`ParticleLayout`)
LAYOUTS = ("replicated", "sharded")


def _world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group "
            "(e.g. under torchrun) before fitting with DistributedOptim"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def rank_shard(indices, group=None):
    """This rank's contiguous share of a global minibatch of indices (the shares of all
    ranks partition it; sizes differ by at most one).

    :param torch.Tensor indices: the global minibatch, the same on every rank.
    :rtype: torch.Tensor
    """
    rank, world = _world(group)
    indices = torch.as_tensor(indices)
    if indices.numel() < world:
        raise ValueError(
            f"a global minibatch of {indices.numel()} indices cannot be shared by {world} "
            "ranks: make it at least as large as the number of ranks"
        )
    return indices.tensor_split(world)[rank]


class DistributedOptim(PyroOptim):
    """A :class:`~pyro.optim.PyroOptim` that averages the gradients of the parameters it
    steps across the ranks of ``group`` (one ``all_reduce`` of all of them, in parameter
    name order) before the wrapped optimiser's step, and broadcasts each parameter from
    rank 0 when it first sees it.

    :param pyro_optim: the optimiser to wrap, e.g. ``pyro.optim.Adam({"lr": 1e-2})``.
    :param group: the process group (default: the whole world).
    """

    def __init__(self, pyro_optim, group=None):
        if not isinstance(pyro_optim, PyroOptim):
            raise TypeError(
                f"DistributedOptim wraps a pyro.optim.PyroOptim, got {type(pyro_optim).__name__}"
            )
        super().__init__(
            pyro_optim.pt_optim_constructor, pyro_optim.pt_optim_args, pyro_optim.pt_clip_args
        )
        self.group = group
        self._broadcast = set()

    def __call__(self, params, *args, **kwargs):
        # the same order on every rank, so that the flat buffers line up
        params = sorted(params, key=pyro.get_param_store().param_name)
        _, world = _world(self.group)
        fresh = [p for p in params if id(p) not in self._broadcast]
        if fresh:
            with torch.no_grad():
                flat = _flatten_dense_tensors([p.detach() for p in fresh])
                dist.broadcast(flat, src=0, group=self.group)
                for p, value in zip(fresh, _unflatten_dense_tensors(flat, fresh), strict=True):
                    p.copy_(value)
            self._broadcast.update(id(p) for p in fresh)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if grads:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
            flat /= world
            for p, g in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):
                p.grad = g
        super().__call__(params, *args, **kwargs)


def _is_distributed(group):
    return dist.is_available() and dist.is_initialized()


def _particle_method(obj):
    from .particles import ParticleInference

    return isinstance(obj, ParticleInference)


def save_checkpoint(path, optim, group=None):
    """Write Pyro's parameter store, ``optim``'s state and the random streams to ``path``:
    from rank 0 only when ``torch.distributed`` is initialised (every rank then waits for
    the file), else from this process.

    For a particle method (:class:`~pyro_implicit.particles.WeightSpaceSVGD`,
    :class:`~pyro_implicit.particles.FunctionSpaceSVGD`, with or without ``layout=``)
    pass the method itself: its :meth:`~pyro_implicit.particles.ParticleInference.
    state_dict`, i.e. all N particles (gathered from every rank in the sharded layout),
    the optimiser's state (the per-particle tensors gathered alike), the preconditioner,
    the parameter store and the random streams. Call it on every rank.

    :param optim: the :class:`~pyro.optim.PyroOptim` of the fit (a
        :class:`DistributedOptim` or any other), or the particle method.
    :param group: the process group (a particle method uses its layout's).
    """
    state = None
    if _particle_method(optim):
        layout = optim.distributed
        group = None if layout is None else layout.group
        state = optim.state_dict()  # a collective in the sharded layout
        distributed = layout is not None
    else:
        distributed = _is_distributed(group)
    rank = dist.get_rank(group) if distributed else 0
    if rank == 0:
        if state is None:
            state = {
                "params": pyro.get_param_store().get_state(),
                "optim": optim.get_state(),
                "rng": pyro.util.get_rng_state(),
            }
        torch.save(state, path)
    if distributed:
        dist.barrier(group)


def load_checkpoint(path, optim):
    """Resume from :func:`save_checkpoint` on this rank (the number of ranks may differ
    from the saving run's): the parameter store, ``optim``'s state (applied when its
    per-parameter optimisers are built) and the random streams.

    For a particle method pass a fresh one built with the same arguments (``layout=``
    and the number of ranks may differ, or one process): it takes this rank's rows of
    the N particles and of their optimiser state on its next ``step``
    (:meth:`~pyro_implicit.particles.ParticleInference.load_state_dict`).

    :param optim: a fresh optimiser of the same kind as the saving run's, or a fresh
        particle method.
    """
    state = torch.load(path, weights_only=False)
    if _particle_method(optim):
        optim.load_state_dict(state)
        return
    store = pyro.get_param_store()
    store.clear()
    store.set_state(state["params"])
    optim.set_state(state["optim"])
    pyro.util.set_rng_state(state["rng"])


def _portable(error):
    """``error`` if it survives pickling (to travel to the other ranks), else a
    ``RuntimeError`` with its type and message."""
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any exception that cannot travel is described
        return RuntimeError(f"{type(error).__name__}: {error}")


class ParticleLayout:
    r"""How a particle method (:class:`~pyro_implicit.particles.WeightSpaceSVGD`, built
    with ``layout=`` and ``group=``) spreads its N particles and its data over the R ranks
    of a ``torch.distributed`` process group, and the collectives of its steps.

    ``"replicated"``: **the data sharded, the particles replicated.** Every rank holds all
    N particles and scores them on its own shard of each step's data: pass the data
    plate its share of the global minibatch, ``pyro.plate("data", n,
    subsample=rank_shard(batch))``, so that its likelihood carries the scale
    ``n / len(shard)``. One ``all_reduce`` per step (N D scores, N log-joints and the
    model parameters' gradients) averages them over the ranks: the likelihood average is
    the global minibatch's estimate (scale ``n / B``, exactly when R divides the global
    batch size ``B``, as for :class:`DistributedOptim`), and the prior's part, the same on
    every rank, counts once. Every rank then applies the identical SVGD update to the
    identical particles. Compute per step: the model on ``B / R`` data points for N
    particles, plus the whole ``(N, N)`` kernel on every rank.

    ``"sharded"``: **the particles sharded, the data replicated.** Rank ``r`` holds
    particles ``r N / R .. (r + 1) N / R - 1`` and scores them on all of the step's data.
    One ``all_gather`` per step collects every particle and score (``N x (2D + 2)``
    values), a second the rank's ``(N / R, N)`` block of squared distances (for the median
    bandwidth; skipped for ``"svgd"`` with a fixed bandwidth); the rank then computes the
    direction of its own particles from their ``(N / R, N)`` kernel block against all N
    (:func:`~pyro_implicit.particles.stein_direction` with ``rows=``), never an
    ``(N, N, D)`` tensor, and updates only those (GFSF also gathers the ``(N, D)``
    repulsion; the model parameters' gradients are summed by an ``all_reduce``). Memory
    per rank: ``O(N^2 + N D)`` for the gathered particles and scores and the squared
    distances.

    The initial particles (N of them, drawn as one process would) and the preconditioner
    are broadcast from rank 0, so that the ranks start identical (``"replicated"``) or
    with rank 0's rows (``"sharded"``); so are the model's own ``pyro.param`` values. The
    automatic preconditioner (``precondition=True``) is fitted to the first step's data as
    rank 0 sees it: the whole minibatch in the sharded layout (as one process), rank 0's
    shard of it in the replicated layout (a different start from one process's; pass a
    :class:`~pyro_implicit.latent.Preconditioner` or ``precondition=False`` where the
    runs must agree).

    **Random streams.** Seed every rank identically (``pyro.set_rng_seed``) and give them
    the same global minibatch sequence. The streams stay shared because every rank makes
    the same draws: the update itself draws nothing, the particle plate has the same size
    on every rank, and a model's own random draws (a plate's ``subsample_size`` minibatch)
    are then the same on every rank. That is what the sharded layout needs (every rank's
    particles must see the same minibatch, or the ranks would follow different
    estimates); in the replicated layout the data comes from the explicit shards and the
    shared stream only keeps the setup identical. With these, R ranks end where one
    process with the same seed and the same global minibatches ends, to rounding.

    **Errors.** Set-up errors (a latent site in the sharded data plate, a model whose
    latent space differs between ranks) and errors while a rank scores its particles are
    raised on every rank: the rank's own exception where it occurred, the first failing
    rank's exception (with a note naming it) elsewhere; no rank is left waiting in a
    collective. A world size that does not divide N is refused on construction.

    :param str layout: ``"replicated"`` or ``"sharded"``.
    :param int num_particles: N, over all ranks.
    :param optim: the method's optimiser (a :class:`DistributedOptim` is refused: the
        layout combines the gradients itself).
    :param group: the process group (default: the whole world).
    """

    def __init__(self, layout, num_particles, optim=None, group=None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS} or None, got {layout!r}")
        if isinstance(optim, DistributedOptim):
            raise TypeError(
                f"layout={layout!r} combines the particles' scores and the model parameters' "
                "gradients across ranks itself: pass the plain optimiser, not a "
                "DistributedOptim (which would also average the sharded particles' updates)"
            )
        self.rank, self.world = _world(group)
        self.layout, self.group = layout, group
        #: N, over all ranks
        self.num_particles = int(num_particles)
        if layout == "sharded" and self.num_particles % self.world:
            raise ValueError(
                f"layout='sharded' splits the {self.num_particles} particles evenly over the "
                f"{self.world} ranks, and {self.world} does not divide {self.num_particles}: "
                f"choose num_particles a multiple of the world size (e.g. "
                f"{-(-self.num_particles // self.world) * self.world})"
            )
        sharded = layout == "sharded"
        #: the number of particles this rank holds
        self.num_local = self.num_particles // self.world if sharded else self.num_particles
        #: this rank's rows of the N particles
        self.rows = (
            slice(self.rank * self.num_local, (self.rank + 1) * self.num_local)
            if sharded
            else slice(0, self.num_particles)
        )
        #: the keyword arguments of :func:`~pyro_implicit.particles.stein_direction`
        self.block = {"rows": self.rows, "gather": self.gather} if sharded else {}

    def __repr__(self):
        return (
            f"ParticleLayout({self.layout!r}, num_particles={self.num_particles}, "
            f"rank {self.rank} of {self.world})"
        )

    def _src(self):
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    # ------------------------------------------------------------------ collectives
    def gather(self, block):
        """The row blocks ``(N / R, ...)`` of all ranks, in rank order: ``(N, ...)``."""
        block = block.contiguous()
        parts = [torch.empty_like(block) for _ in range(self.world)]
        dist.all_gather(parts, block, group=self.group)
        return torch.cat(parts, dim=0)

    def agree(self, fn):
        """Run ``fn()`` on every rank; raise on every rank if it raised on any
        (:meth:`raise_together`); else the list of every rank's result (picklable)."""
        try:
            out, error = fn(), None
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            out, error = None, e
        results = [None] * self.world
        dist.all_gather_object(
            results, (None if error is None else _portable(error), out), group=self.group
        )
        self._raise_first(error, [e for e, _ in results])
        return [o for _, o in results]

    def raise_together(self, error):
        """Every rank calls this once some rank has failed (known from a flag of a
        collective): the ranks share their errors and all raise."""
        errors = [None] * self.world
        dist.all_gather_object(
            errors, None if error is None else _portable(error), group=self.group
        )
        self._raise_first(error, errors)

    def _raise_first(self, error, errors):
        if error is not None:
            raise error
        for rank, other in enumerate(errors):
            if other is not None:
                other.add_note(
                    f"(raised on rank {rank} of {self.world}; every rank of the "
                    f"{self.layout} particle layout stops with it)"
                )
                raise other

    def broadcast_parameters(self, params):
        """Rank 0's values of the model's ``pyro.param`` tensors on every rank."""
        if params:
            with torch.no_grad():
                flat = _flatten_dense_tensors([p.detach() for p in params])
                dist.broadcast(flat, src=self._src(), group=self.group)
                for p, value in zip(params, _unflatten_dense_tensors(flat, params), strict=True):
                    p.copy_(value)

    # ------------------------------------------------------------------ the method's hooks
    def setup(self, inference, args, kwargs):
        """The method's set-up agreed across the ranks: its latent space (the same on
        every rank, else an error on every rank), rank 0's preconditioner, and rank 0's N
        initial particles; returns this rank's rows of them."""

        def space():
            inference._setup_space(args, kwargs)
            return [(s.name, tuple(s.shape), s.stop - s.start) for s in inference._sites]

        spaces = self.agree(space)
        if any(other != spaces[0] for other in spaces):
            differ = next(r for r, other in enumerate(spaces) if other != spaces[0])
            raise ValueError(
                f"the ranks' models have different latent spaces (rank 0: {spaces[0]}; rank "
                f"{differ}: {spaces[differ]}): a latent site depends on the rank's share of "
                "the data. Shard the data through a plate's subsample (rank_shard) and keep "
                "local latent sites out of that plate."
            )
        pre = [copy.deepcopy(inference.preconditioner).to("cpu") if self.rank == 0 else None]
        dist.broadcast_object_list(pre, src=self._src(), group=self.group)
        inference.preconditioner = pre[0].to(device=inference.space.device)
        local, drawn = inference.num_particles, []
        inference.num_particles = self.num_particles  # draw all N, as one process does
        try:
            self.agree(
                lambda: drawn.append(
                    inference._initial_particles(args, kwargs, inference.space.dtype)
                )
            )
        finally:
            inference.num_particles = local
        init = drawn[0].detach().contiguous()
        dist.broadcast(init, src=self._src(), group=self.group)
        return init[self.rows]

    def exchange(self, inference, score_fn, width=None):
        """Score this rank's particles and combine across the ranks.

        ``score_fn() -> (points, log_joint, score, param_grads)``: the kernel's ``(n, M)``
        inputs for this rank's ``n`` particles (the particles themselves, or their function
        values), their log-densities ``(n,)``, scores ``(n, M)`` and the sums over them of
        the model parameters' gradients. Returns the same for all N particles: the
        replicated layout averages the scores (and parameter gradients) over the ranks,
        the sharded one gathers the points and scores (and sums the gradients). An error
        raised by ``score_fn`` on any rank is raised on every rank.

        :param int width: ``M`` when it is known on every rank beforehand (the latent
            dimension); ``None``: the ranks first agree on it, and on any failure, with one
            more small ``all_reduce``.
        """
        particles = inference.particles.detach()
        params = inference.model_parameters()
        n = len(particles)
        try:
            points, log_joint, score, grads = score_fn()
            error = None
        except Exception as e:  # noqa: BLE001 - re-raised on every rank
            error, points, grads = e, None, []
        dtype, device = particles.dtype, particles.device
        if width is None:
            m = -1 if points is None else points.shape[-1]
            header = torch.tensor([float(error is not None), m, -m], dtype=dtype, device=device)
            dist.all_reduce(header, op=dist.ReduceOp.MAX, group=self.group)
            if header[0] > 0:
                self.raise_together(error)
            if header[1] != -header[2]:
                raise ValueError(
                    f"the ranks' particles have rows of different sizes ({int(-header[2])} to "
                    f"{int(header[1])} values): every rank must run the model on the same "
                    "inputs in the sharded layout"
                )
            width = int(header[1])
        if points is None:  # this rank failed: placeholders until every rank knows
            points = particles.new_zeros(n, width)
            log_joint, score = particles.new_zeros(n), particles.new_zeros(n, width)
        grads = list(grads) + [None] * (len(params) - len(grads))
        grads = [
            torch.zeros_like(p) if g is None else g.detach()
            for p, g in zip(params, grads, strict=True)
        ]
        flag = particles.new_tensor([0.0 if error is None else 1.0])
        points = points.detach().to(dtype)
        score, log_joint = score.detach().to(dtype), log_joint.detach().to(dtype)
        if self.layout == "replicated":
            parts = [score, log_joint] + [g.to(dtype) for g in grads] + [flag]
            flat = _flatten_dense_tensors(parts)
            dist.all_reduce(flat, group=self.group)
            if flat[-1] > 0:
                self.raise_together(error)
            flat /= self.world
            score, log_joint, *grads, _ = _unflatten_dense_tensors(flat, parts)
            grads = [g.to(p.dtype) for p, g in zip(params, grads, strict=True)]
            return points, log_joint, score, grads
        m = points.shape[-1]
        rows = torch.cat([points, score, log_joint.unsqueeze(-1), flag.expand(n, 1)], dim=-1)
        rows = self.gather(rows)
        if bool((rows[:, -1] > 0).any()):
            self.raise_together(error)
        if grads:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
            grads = list(_unflatten_dense_tensors(flat, grads))
        return rows[:, :m], rows[:, 2 * m], rows[:, m : 2 * m], grads


def gather_named_particles(inference):
    """``{site: (N, *site_shape)}``: all N particles of a particle method on every rank
    (its :meth:`get_named_particles`; gathered from the ranks with ``layout="sharded"``).
    """
    named = inference.get_named_particles()
    layout = getattr(inference, "distributed", None)
    if layout is None or layout.layout == "replicated":
        return named
    return {name: layout.gather(value) for name, value in named.items()}
