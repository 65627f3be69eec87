"""A BNN on UCI Boston fitted data-parallel under ``torchrun``, with a check against one
process.

Each rank takes its share of every global minibatch (:func:`pyro_implicit.distributed.
rank_shard`) and :class:`~pyro_implicit.distributed.DistributedOptim` averages the
gradients. With ``--check``, rank 0 then fits the same model in-process on the whole global
minibatches and prints, as its last line, ``max parameter difference vs one process: X``.

Usage::

    torchrun --standalone --nproc_per_node=2 benchmarks/distributed.py --steps 300 --check
    torchrun --standalone --nproc_per_node=1 benchmarks/distributed.py --steps 300

(``--backend nccl`` and ``--nnodes`` on GPU clusters, as any torchrun job.)
"""

import argparse
import sys
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
import torch.distributed as tdist
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyro_implicit.datasets import load_uci  # noqa: E402
from pyro_implicit.distributed import DistributedOptim, rank_shard  # noqa: E402

HIDDEN = 50


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
    svi = SVI(bnn, guide, optim, Trace_ELBO(num_particles=8, vectorize_particles=True,
                                             max_plate_nesting=1))
    batches = torch.Generator().manual_seed(seed + 1)
    n = x.shape[0]
    svi.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))  # set-up
    start = time.perf_counter()
    for _ in range(steps - 1):
        svi.step(x, y, shard(torch.randperm(n, generator=batches)[:batch_size]))
    seconds = time.perf_counter() - start
    params = {k: v.detach().clone() for k, v in guide.named_parameters()}
    return params, 1000 * seconds / max(steps - 1, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=100, help="global minibatch size")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    tdist.init_process_group(args.backend)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    split = load_uci("boston", 0, dtype=torch.float64)
    x, y = split.x_train, split.y_train
    params, ms = fit(x, y, args.steps, args.batch_size, rank_shard, True, args.seed)
    times = [torch.zeros(()) for _ in range(world)]
    tdist.all_gather(times, torch.tensor(ms))
    tdist.barrier()
    if rank == 0:
        print(f"{world} process(es), global batch {args.batch_size}, {args.steps} steps: "
              f"{max(float(t) for t in times):.2f} ms per step (slowest rank)", flush=True)
        if args.check:
            single, _ = fit(x, y, args.steps, args.batch_size, lambda b: b, False, args.seed)
            diff = max(float((params[k] - single[k]).abs().max()) for k in single)
            print(f"max parameter difference vs one process: {diff:.3g}", flush=True)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
