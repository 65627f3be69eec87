"""Data-parallel SVI on two CPU processes (gloo): the same parameters as one process
stepping over the same global minibatches."""

import os
import tempfile

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_implicit import SIVI_ELBO, SemiImplicitGuide
from pyro_implicit.distributed import (
    DistributedOptim,
    load_checkpoint,
    rank_shard,
    save_checkpoint,
)

N, GLOBAL_BATCH, STEPS = 40, 8, 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = (x * torch.tensor([1.0, -2.0], dtype=torch.float64)).sum(-1)
    return x, y + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)


def model(x, y, subsample):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", N, subsample=subsample) as i:
        pyro.sample("obs", dist.Normal((x[i] * w).sum(-1), 0.3), obs=y[i])


def _fit(method, shard):
    """Fit ``method``, each step on ``shard(global minibatch)``; the parameters at the end."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    # plain SGD for the point estimate: Adam would hide a wrong gradient scale
    optim = pyro.optim.SGD({"lr": 2e-3}) if method == "delta" else pyro.optim.Adam({"lr": 0.05})
    if tdist.is_initialized():
        optim = DistributedOptim(optim)
    if method == "delta":
        guide, loss = AutoDelta(model), Trace_ELBO()
    else:
        guide = SemiImplicitGuide(model, precondition=False)
        loss = SIVI_ELBO(num_particles=4, num_mixing=8, max_plate_nesting=1)
    svi = SVI(model, guide, optim, loss)
    batches = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        svi.step(x, y, shard(batch))
    return {k: v.detach().clone() for k, v in guide.named_parameters()}


def _rank(rank, world, store, out, method):
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                             world_size=world)
    try:
        params = _fit(method, rank_shard)
        if rank == 0:
            torch.save(params, out)
        tdist.barrier()  # neither rank leaves while the other still talks
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("method", ["delta", "sivi"])
def test_two_processes_match_one(method, tmp_path):
    """Two ranks, each on half of every global minibatch, end where one process on the
    whole minibatches ends (float tolerance): the gradient averaging and the N / B
    scaling are right, and the lazily built parameters agree."""
    out = tmp_path / "params.pt"
    for attempt in range(2):
        store = os.path.join(tempfile.mkdtemp(), "store")
        try:
            mp.spawn(_rank, args=(2, store, str(out), method), nprocs=2)
            break
        except mp.ProcessExitedException:
            # a gloo worker aborted at exit (3 of 13 runs before the barrier in _rank, none
            # of 13 since): one retry; a real error fails both attempts
            if attempt:
                raise
    distributed = torch.load(out)
    single = _fit(method, lambda batch: batch)
    assert distributed.keys() == single.keys() and single
    for name in single:
        assert torch.allclose(distributed[name], single[name], rtol=1e-9, atol=1e-10), name


def test_without_a_process_group_it_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        rank_shard(torch.arange(4))


def _fit_steps(start, stop, save=None, load=None):
    """AutoDelta + Adam over the global minibatches ``start:stop`` (each rank on its share
    when torch.distributed is up), from a checkpoint and to one if given."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    optim = pyro.optim.Adam({"lr": 0.05})
    shard = lambda batch: batch  # noqa: E731
    if tdist.is_initialized():
        optim, shard = DistributedOptim(optim), rank_shard
    if load is not None:
        load_checkpoint(load, optim)
    guide = AutoDelta(model)
    svi = SVI(model, guide, optim, Trace_ELBO())
    batches = torch.Generator().manual_seed(1)
    for step in range(stop):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        if step >= start:
            svi.step(x, y, shard(batch))
    if save is not None:
        save_checkpoint(save, optim)
    return {k: v.detach().clone() for k, v in guide.named_parameters()}


def _checkpoint_rank(rank, world, store, path):
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                             world_size=world)
    try:
        _fit_steps(0, 6, save=path)
    finally:
        tdist.destroy_process_group()


def test_a_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path):
    """Parameters and Adam's moments saved by rank 0 of a two-rank run, resumed by one
    process: the end is that of one uninterrupted process."""
    path = str(tmp_path / "checkpoint.pt")
    for attempt in range(2):
        store = os.path.join(tempfile.mkdtemp(), "store")
        try:
            mp.spawn(_checkpoint_rank, args=(2, store, path), nprocs=2)
            break
        except mp.ProcessExitedException:  # see test_two_processes_match_one
            if attempt:
                raise
    resumed = _fit_steps(6, 12, load=path)
    straight = _fit_steps(0, 12)
    for name in straight:
        assert torch.allclose(resumed[name], straight[name], rtol=1e-9, atol=1e-10), name
