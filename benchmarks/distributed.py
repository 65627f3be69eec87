"""A BNN on UCI Boston fitted data-parallel under ``torchrun``, with a check against one
process.

``--method svi`` (default): each rank takes its share of every global minibatch
(:func:`pyro_implicit.distributed.rank_shard`) and
:class:`~pyro_implicit.distributed.DistributedOptim` averages the gradients.

``--method wsvgd``: an SVGD ensemble (:class:`~pyro_implicit.particles.WeightSpaceSVGD`,
``--particles`` of them) with ``--layout replicated`` (every rank holds all particles
and scores them on its share of each global minibatch) or ``--layout sharded`` (every rank
holds particles / ranks of them and scores them on the whole minibatch); see
:class:`~pyro_implicit.distributed.ParticleLayout`.

With ``--check``, rank 0 then fits the same model in-process on the whole global
minibatches and prints, as its last line, ``max parameter difference vs one process: X``
(for wsvgd: over all particles' constrained values).

Usage::

    torchrun --standalone --nproc_per_node=2 benchmarks/distributed.py --steps 300 --check
    torchrun --standalone --nproc_per_node=1 benchmarks/distributed.py --steps 300
    torchrun --standalone --nproc_per_node=2 benchmarks/distributed.py --method wsvgd \\
        --layout sharded --particles 64 --steps 100 --check

(``--backend nccl`` on GPUs: one GPU per process, ``cuda:LOCAL_RANK``, the data moved to it;
``--nnodes`` across machines, as any torchrun job. The nccl path has not been run yet.)
"""

import argparse
import os
import time

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit.datasets import load_uci
from pyro_implicit.distributed import (
    DistributedOptim,
    gather_named_particles,
    rank_shard,
)
from pyro_implicit.particles import WeightSpaceSVGD

HIDDEN = 50


def _drop_data_slot(value, event_dim):
    """A global latent's value without the size-1 slot of the data plate (dim -1 of its
    batch shape), so that particle draws (batch ``(P, 1)`` under a plate at dim -2) give
    function values of shape ``(P, B)``, as the plates expect."""
    if value.dim() > event_dim and value.shape[-event_dim - 1] == 1:
        return value.squeeze(-event_dim - 1)
    return value


def bnn(x, y, subsample):
    """One hidden layer of 50 tanh units, N(0, 1) weights, a Gamma noise precision; the
    data plate takes its minibatch indices (``subsample``)."""
    n, d = x.shape
    zero = x.new_zeros(())
    w1 = pyro.sample("w1", dist.Normal(zero, 1.0).expand([d, HIDDEN]).to_event(2))
    b1 = pyro.sample("b1", dist.Normal(zero, 1.0).expand([HIDDEN]).to_event(1))
    w2 = pyro.sample("w2", dist.Normal(zero, 1.0).expand([HIDDEN]).to_event(1))
    b2 = pyro.sample("b2", dist.Normal(zero, 1.0))
    precision = pyro.sample("precision", dist.Gamma(x.new_tensor(6.0), 6.0))
    w1, b1, w2 = _drop_data_slot(w1, 2), _drop_data_slot(b1, 1), _drop_data_slot(w2, 1)
    b2, precision = _drop_data_slot(b2, 0), _drop_data_slot(precision, 0)
    with pyro.plate("data", n, subsample=subsample) as i:
        # batched over any leading particle dims (einsum's ...), never mixing particles
        h = torch.tanh(torch.einsum("nd,...dh->...nh", x[i], w1) + b1.unsqueeze(-2))
        f = (h * w2.unsqueeze(-2)).sum(-1) + b2.unsqueeze(-1)
        pyro.sample("obs", dist.Normal(f, precision.rsqrt().unsqueeze(-1)), obs=y[i])


def fit(x, y, steps, batch_size, shard, distributed, seed):
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro.optim.Adam({"lr": 1e-2})
    if distributed:
        optim = DistributedOptim(optim)
    guide = AutoNormal(bnn)
    svi = SVI(
        bnn,
        guide,
        optim,
        Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=1),
    )
    batches = torch.Generator().manual_seed(seed + 1)
    n = x.shape[0]
    svi.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))  # set-up
    start = time.perf_counter()
    for _ in range(steps - 1):
        svi.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))
    seconds = time.perf_counter() - start
    params = {k: v.detach().clone() for k, v in guide.named_parameters()}
    return params, 1000 * seconds / max(steps - 1, 1)


def fit_svgd(x, y, steps, batch_size, layout, num_particles, seed):
    """``steps`` SVGD steps (``layout=None``: one process on the whole minibatches); all
    particles at the end and the ms per step after the first (the set-up)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    # eager scores: the minibatch indices change every step, so traced graphs would be
    # retraced, then dropped, within the first steps
    svgd = WeightSpaceSVGD(
        bnn,
        pyro.optim.Adam({"lr": 1e-2}),
        num_particles,
        max_plate_nesting=1,
        precondition=False,
        compile=False,
        layout=layout,
    )
    shard = rank_shard if layout == "replicated" else (lambda b: b)
    batches = torch.Generator().manual_seed(seed + 1)
    n = x.shape[0]
    svgd.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))  # set-up
    start = time.perf_counter()
    for _ in range(steps - 1):
        svgd.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))
    seconds = time.perf_counter() - start
    return gather_named_particles(svgd), 1000 * seconds / max(steps - 1, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=100, help="global minibatch size")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true")
    p.add_argument("--method", choices=["svi", "wsvgd"], default="svi")
    p.add_argument(
        "--layout",
        choices=["replicated", "sharded"],
        default="replicated",
        help="wsvgd: the data or the particles sharded across ranks",
    )
    p.add_argument("--particles", type=int, default=64, help="wsvgd: number of particles")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    tdist.init_process_group(args.backend)
    device = torch.device("cpu")
    if args.backend == "nccl":  # one GPU per process; nccl moves GPU tensors only
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    split = load_uci("boston", 0, dtype=torch.float64)
    x, y = split.x_train.to(device), split.y_train.to(device)
    if args.method == "svi":
        params, ms = fit(x, y, args.steps, args.batch_size, rank_shard, True, args.seed)
        what = "svi"
    else:
        params, ms = fit_svgd(
            x, y, args.steps, args.batch_size, args.layout, args.particles, args.seed
        )
        what = f"wsvgd, {args.layout} layout, {args.particles} particles"
    times = [torch.zeros((), device=device) for _ in range(world)]
    tdist.all_gather(times, torch.tensor(ms, device=device))
    tdist.barrier()
    if rank == 0:
        print(
            f"{what}: {world} process(es), global batch {args.batch_size}, {args.steps} "
            f"steps: {max(float(t) for t in times):.2f} ms per step (slowest rank)",
            flush=True,
        )
        if args.check and args.method == "svi":
            single, _ = fit(x, y, args.steps, args.batch_size, lambda b: b, False, args.seed)
        elif args.check:
            single, _ = fit_svgd(x, y, args.steps, args.batch_size, None, args.particles, args.seed)
        if args.check:
            diff = max(float((params[k] - single[k]).abs().max()) for k in single)
            print(f"max parameter difference vs one process: {diff:.3g}", flush=True)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
