"""Weight-space SVGD's particle count on the library's built-in models, as ``compare``
fits them, over several seeds.

``compare``'s ``wsvgd`` schedule (``ClippedAdam``, learning rate 0.05 decayed tenfold over
the run, the preconditioner on) with N particles, against a NUTS run of the same model
(two chains). ``benchmarks/svgd_particles.py`` asks the same of the stiff posteriors at one
seed; ``svgd_tail.md`` found that on the non-centred eight schools a few of 100 particles
sit far out in ``tau``'s right tail. Rows: each seed's max mean error in NUTS sds, sd ratio
range, energy distance and fit seconds, then the mean over seeds.

    python benchmarks/svgd_particle_count.py --models eight_schools,waveform_logistic \\
        --particles 100,200,300 --seeds 0,1,2,3 --out benchmarks/results/svgd_particle_count.md
"""

import argparse
import time

import _provenance
import pyro
import torch

from pyro_implicit import WeightSpaceSVGD
from pyro_implicit.diagnostics.metrics import compare_samples
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.latent import LatentSpace
from pyro_implicit.models import load_model


def fit(model, num_particles, steps, seed):
    """``(named particles, seconds)`` of ``compare``'s ``wsvgd`` with ``num_particles``."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro.optim.ClippedAdam({"lr": 0.05, "lrd": 0.1 ** (1.0 / steps)})
    svgd = WeightSpaceSVGD(
        model.model, optim, num_particles=num_particles, max_plate_nesting=model.max_plate_nesting
    )
    start = time.perf_counter()
    for _ in range(steps):
        svgd.step(*model.args, **model.kwargs)
    return svgd.get_named_particles(), time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="eight_schools")
    parser.add_argument("--particles", default="100,200,300")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--nuts-draws", type=int, default=2000, help="per chain (2 chains)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    prov = _provenance.provenance(__file__, argv, vars(args))
    counts = [int(n) for n in args.particles.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [
        "# Weight-space SVGD's particle count, as `compare` fits it",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread, "
        f"{args.steps} steps of `ClippedAdam` (lr 0.05, decayed tenfold), preconditioned. "
        f"Reference: NUTS, 2 chains x {args.nuts_draws} draws after {args.nuts_draws // 2} "
        "warm-up. Cells: max mean error in NUTS sds / sd ratio range / energy distance / "
        "fit seconds; `mean`: each column's mean over the seeds.",
        "",
    ]
    for name in args.models.split(","):
        model = load_model(name)
        dim = LatentSpace.from_model(
            model.model, model.args, model.kwargs, model.max_plate_nesting
        ).latent_dim
        reference = run_nuts(
            model.model,
            *model.args,
            num_samples=args.nuts_draws,
            warmup_steps=args.nuts_draws // 2,
            num_chains=2,
            seed=0,
            max_plate_nesting=model.max_plate_nesting,
            progress_bar=False,
            **model.kwargs,
        ).samples
        lines += [
            f"## {name} (D = {dim})",
            "",
            "| N | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
            "|---:|" + "---|" * (len(seeds) + 1),
        ]
        for n in counts:
            cells, sums = [], [0.0, 0.0, 0.0, 0.0, 0.0]
            for seed in seeds:
                draws, seconds = fit(model, n, args.steps, seed)
                draws = {k: v for k, v in draws.items() if k in reference}
                joint = compare_samples(draws, reference)["joint"]
                values = [
                    joint["mean_error_max"],
                    joint["sd_ratio_min"],
                    joint["sd_ratio_max"],
                    joint["energy_distance"],
                    seconds,
                ]
                sums = [a + b / len(seeds) for a, b in zip(sums, values, strict=True)]
                cells.append("{:.3f} / {:.2f}-{:.2f} / {:.4f} / {:.1f}".format(*values))
            cells.append("{:.3f} / {:.2f}-{:.2f} / {:.4f} / {:.1f}".format(*sums))
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        lines.append("")
    _provenance.write_result("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
