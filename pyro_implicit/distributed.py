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

References: Pyro's ``HorovodOptimizer`` (the same role, through Horovod).
"""

import pyro
import torch
import torch.distributed as dist
from pyro.optim import PyroOptim
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["DistributedOptim", "load_checkpoint", "rank_shard", "save_checkpoint"]


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
        super().__init__(pyro_optim.pt_optim_constructor, pyro_optim.pt_optim_args,
                         pyro_optim.pt_clip_args)
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


def save_checkpoint(path, optim, group=None):
    """Write Pyro's parameter store, ``optim``'s state and the random streams to ``path``:
    from rank 0 only when ``torch.distributed`` is initialised (every rank then waits for
    the file), else from this process.

    :param optim: the :class:`~pyro.optim.PyroOptim` of the fit (a
        :class:`DistributedOptim` or any other).
    """
    rank = dist.get_rank(group) if _is_distributed(group) else 0
    if rank == 0:
        torch.save({"params": pyro.get_param_store().get_state(),
                    "optim": optim.get_state(),
                    "rng": pyro.util.get_rng_state()}, path)
    if _is_distributed(group):
        dist.barrier(group)


def load_checkpoint(path, optim):
    """Resume from :func:`save_checkpoint` on this rank (the number of ranks may differ
    from the saving run's): the parameter store, ``optim``'s state (applied when its
    per-parameter optimisers are built) and the random streams.

    :param optim: a fresh optimiser of the same kind as the saving run's.
    """
    state = torch.load(path, weights_only=False)
    store = pyro.get_param_store()
    store.clear()
    store.set_state(state["params"])
    optim.set_state(state["optim"])
    pyro.util.set_rng_state(state["rng"])
