"""Weight-space SVGD's accuracy on the stiff posteriors against its particle count.

``compare``'s ``wsvgd`` (``WeightSpaceSVGD``, preconditioned, ``Adam(1e-2)``, 2000 steps,
as ``benchmarks/stiff.py`` runs it) with N particles instead of the registry's, scored
against the same NUTS references. SVGD's particles lose spread as the dimension D grows
against N (the variance collapse of SVGD in moderate dimensions); this measures where that
costs accuracy on posteriors users bring.

    python benchmarks/svgd_particles.py --particles 100,300 \\
        --out benchmarks/results/svgd_particles.md
"""

import argparse

import _provenance
import stiff
import torch

import pyro_implicit.diagnostics.methods as methods
from pyro_implicit.latent import LatentSpace


def dimension(model_name):
    model, args, kwargs, mpn = stiff.MODELS[model_name]()
    return LatentSpace.from_model(model, args, kwargs, mpn).latent_dim


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", default="100,300")
    parser.add_argument("--models", default=",".join(stiff.MODELS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    prov = _provenance.provenance(__file__, argv, vars(args))
    counts = [int(n) for n in args.particles.split(",")]
    lines = [
        "# Weight-space SVGD against its particle count",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread, "
        f"seed {args.seed}, {args.steps} steps. Cells: max mean error in NUTS sds / sd ratio "
        "range / energy distance / fit seconds (`stiff.py`'s metrics and references).",
        "",
        "| model | D | " + " | ".join(f"N = {n}" for n in counts) + " |",
        "|---|---:|" + "---|" * len(counts),
    ]
    default = methods.WSVGD_PARTICLES
    for name in args.models.split(","):
        reference, _ = stiff.load_reference(name)
        cells = []
        for n in counts:
            # the registry's particle count, which its wsvgd builder reads
            methods.WSVGD_PARTICLES = n
            try:
                row = stiff.fit_one(
                    name, "wsvgd", True, args.steps, args.seed, 2000, 1e-2, reference
                )
            finally:
                methods.WSVGD_PARTICLES = default
            if row["status"] != "ok":
                cells.append(row["status"])
                continue
            cells.append(
                f"{row['mean_error_max']:.3f} / {row['sd_ratio_min']:.2f}-"
                f"{row['sd_ratio_max']:.2f} / {row['energy_distance']:.4f} / "
                f"{row['fit_seconds']:.1f}"
            )
        lines.append(f"| {name} | {dimension(name)} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
