"""Weight-space SVGD's step time against its particle count, on the library's models.

A step evaluates the model once for all N particles, and kernel sums over N x N pairs; a
model that broadcasts its data against the particles (``(x * beta).sum(-1)``, the
vectorised form) builds an (N, n, D) product, so the step's memory traffic, and on this
machine its time, can grow faster than N. This times ``WeightSpaceSVGD(model,
Adam(5e-2), num_particles=N)`` (``compare``'s learning rate), float64, one thread, after
five warm-up steps (the preconditioner's search among them), best of the repeats.

    python benchmarks/svgd_step_cost.py --models waveform_logistic,eight_schools \\
        --particles 100,300,600 --out benchmarks/results/svgd_step_cost.md
"""

import argparse
import time

import _provenance
import pyro
import torch

from pyro_implicit import WeightSpaceSVGD
from pyro_implicit.models import load_model


def step_ms(name, num_particles, steps, seed=0):
    """Milliseconds per step of ``num_particles`` particles on library model ``name``."""
    problem = load_model(name)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svgd = WeightSpaceSVGD(
        problem.model, pyro.optim.Adam({"lr": 5e-2}), num_particles=num_particles
    )
    for _ in range(5):
        svgd.step(*problem.args)
    start = time.perf_counter()
    for _ in range(steps):
        svgd.step(*problem.args)
    return 1000 * (time.perf_counter() - start) / steps, svgd.latent_dim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="waveform_logistic,eight_schools")
    parser.add_argument("--particles", default="100,300,600")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    counts = [int(n) for n in args.particles.split(",")]
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# Weight-space SVGD's step time against its particle count",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread, "
        f"ms per step over {args.steps} steps after 5, best of {args.repeats} repeats "
        "(each particle count in turn within a repeat).",
        "",
        "| model | D | " + " | ".join(f"N = {n}" for n in counts) + " |",
        "|---|---:|" + "---:|" * len(counts),
    ]
    for name in args.models.split(","):
        best = {n: float("inf") for n in counts}
        for _ in range(args.repeats):
            for n in counts:
                ms, dim = step_ms(name, n, args.steps)
                best[n] = min(best[n], ms)
        lines.append(f"| {name} | {dim} | " + " | ".join(f"{best[n]:.1f}" for n in counts) + " |")
        print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
