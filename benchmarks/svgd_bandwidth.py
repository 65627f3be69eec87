"""SVGD's particle spread on a standard Gaussian against the bandwidth rule.

The measurement behind the default kernel of a preconditioned ``WeightSpaceSVGD``
(:mod:`pyro_implicit.particles.svgd`, "Bandwidth rule"): N particles start at exact draws
of N(0, I_D) (where a preconditioned run starts when the posterior is Gaussian), take
``--steps`` Adam steps along the SVGD direction with the exact score, and the script prints
the smallest and largest per-coordinate sd at the end (1 is exact).

    python benchmarks/svgd_bandwidth.py --steps 2000 --particles 100
"""

import argparse
import math

import torch

from pyro_implicit.kernels import RBFKernel, svgd_bandwidth_factor
from pyro_implicit.particles.svgd import stein_direction


def final_spread(dim, num_particles, factor, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(num_particles, dim, generator=gen, dtype=torch.float64).requires_grad_()
    kernel = RBFKernel(bandwidth_factor=factor)
    opt = torch.optim.Adam([z], lr=1e-2)
    for _ in range(steps):
        z.grad = -stein_direction(z, -z.detach(), kernel).direction
        opt.step()
    sd = z.detach().std(0)
    return sd.min().item(), sd.max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--particles", type=int, default=100)
    parser.add_argument("--dims", default="1,2,5,10,20,50")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rules = {
        "Liu & Wang, h = med^2 / log N": svgd_bandwidth_factor(args.particles),
        "median length scale, h = 2 med^2": 1.0,
    }
    print(f"| D | {' | '.join(rules)} |")
    print("|---:|" + "---|" * len(rules))
    for dim in (int(d) for d in args.dims.split(",")):
        cells = []
        for factor in rules.values():
            lo, hi = final_spread(dim, args.particles, factor, args.steps, args.seed)
            cells.append(
                f"{lo:.2f}-{hi:.2f}" if not math.isclose(lo, hi, abs_tol=5e-3) else f"{lo:.2f}"
            )
        print(f"| {dim} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
