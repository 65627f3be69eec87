"""What compare's ``livi`` pays for 32 draws per step instead of 8: the SVI step of
``LinearizedGuide`` + ``LIVI_ELBO(bound="det")`` at both counts on stiff-benchmark models,
alternating in one process (one thread, float64 as the stiff benchmark runs).

    python benchmarks/livi_particles_cost.py --out benchmarks/results/livi_particles_cost.md
"""

import argparse

import _provenance
import compiled_score
import torch
from stiff import MODELS


def step_ms(name, particles, steps, seed):
    """ms per SVI step after 5 set-up steps (``compiled_score.time_loss``'s ``livi-fx``:
    ``LinearizedGuide`` + ``LIVI_ELBO(num_particles=particles, bound="det")``)."""
    model, args, kwargs, mpn = MODELS[name]()
    return compiled_score.time_loss(model, args, kwargs, mpn, "livi-fx", particles, steps, seed)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all")
    parser.add_argument("--particles", default="8,32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    counts = [int(c) for c in args.particles.split(",")]
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# `livi`'s step at 8 and 32 draws",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), one thread, float64; "
        f"ms per step, best of {args.repeats} alternating repeats of {args.steps} steps after 5.",
        "",
        "| model | " + " | ".join(f"{c} draws ms" for c in counts) + " | ratio |",
        "|---|" + "---:|" * (len(counts) + 1),
    ]
    for name in names:
        best = {c: float("inf") for c in counts}
        for _ in range(args.repeats):
            for c in counts:
                best[c] = min(best[c], step_ms(name, c, args.steps, args.seed))
        lines.append(
            f"| {name} | "
            + " | ".join(f"{best[c]:.2f}" for c in counts)
            + f" | {best[counts[-1]] / best[counts[0]]:.2f} |"
        )
        print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
