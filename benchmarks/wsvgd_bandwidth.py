"""A preconditioned ``WeightSpaceSVGD``'s kernel length scale on the stiff benchmark.

The default kernel of a preconditioned run is :class:`~pyro_implicit.kernels.RBFKernel`
with ``WHITENED_BANDWIDTH_FACTOR`` median distances as its length scale; this fits
``stiff.py``'s ``wsvgd`` (its defaults, 2000 steps of ``Adam(0.01)``) with that factor
replaced by each of ``--factors``, and scores the particles against the NUTS reference::

    python benchmarks/wsvgd_bandwidth.py --models stochastic_volatility \\
        --factors 0.5,0.7,1,1.4,2 --seeds 0,1,2 --out benchmarks/results/wsvgd_bandwidth.md

``--method gpvi`` or ``asvgd`` does the same for the functional-gradient losses, whose
default length scale is Liu & Wang's (``svgd_bandwidth_factor(num_particles)`` median
distances, 0.35 at their 64 particles; ``--factors default`` keeps it).

One torch thread, float64, as ``stiff.py``.
"""

import argparse
import statistics
from unittest import mock

import _provenance
import stiff
import torch

import pyro_implicit.elbo.functional_gradient as functional_gradient
import pyro_implicit.particles.svgd as svgd


def _patched(method, factor):
    """The default length scale of ``method``'s kernel set to ``factor`` median distances
    (``None``: left as it is)."""
    if factor is None:
        return mock.patch.object(svgd, "WHITENED_BANDWIDTH_FACTOR", svgd.WHITENED_BANDWIDTH_FACTOR)
    if method == "wsvgd":
        return mock.patch.object(svgd, "WHITENED_BANDWIDTH_FACTOR", factor)
    return mock.patch.object(functional_gradient, "svgd_bandwidth_factor", lambda n: factor)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="wsvgd", choices=("wsvgd", "gpvi", "asvgd"))
    parser.add_argument("--models", default="stochastic_volatility")
    parser.add_argument("--factors", default="0.5,0.7,1,1.4,2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    models = stiff._choices(args.models, stiff.MODELS, "models")  # names checked, or all
    factors = [None if f == "default" else float(f) for f in args.factors.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = [
        f"# `{args.method}`'s kernel length scale on the stiff benchmark",
        "",
        f"`{_provenance.command_line(__file__, argv)}` (commit {_provenance.git_commit()}, "
        f"{_provenance.utc_now()}, one thread, float64). `stiff.py`'s `{args.method}` "
        f"({args.steps} steps of `Adam(0.01)`, its default particle count) with the RBF "
        "kernel's length scale at each factor times the median distance between the whitened "
        f"points (`wsvgd`'s default: {svgd.WHITENED_BANDWIDTH_FACTOR}; `gpvi`'s and `asvgd`'s: "
        "Liu & Wang's, `default` below). Cells: max mean error in NUTS sds at each seed, its "
        "mean over the seeds, and the energy distance's mean; "
        "the narrowest and widest sd ratio over the seeds.",
        "",
        "| model | factor | err per seed | mean err | energy | sd ratio | fit s |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name in models:
        reference, _ = stiff.load_reference(name)
        for factor in factors:
            rows = []
            with _patched(args.method, factor):
                for seed in seeds:
                    rows.append(
                        stiff.fit_one(
                            name, args.method, True, args.steps, seed, 2000, 0.01, reference
                        )
                    )
            errors = [r["mean_error_max"] for r in rows]
            line = (
                f"| {name} | {'default' if factor is None else f'{factor:g}'} | "
                f"{' / '.join(f'{e:.3f}' for e in errors)} | "
                f"{statistics.mean(errors):.3f} | "
                f"{statistics.mean(r['energy_distance'] for r in rows):.4f} | "
                f"{min(r['sd_ratio_min'] for r in rows):.2f}-"
                f"{max(r['sd_ratio_max'] for r in rows):.2f} | "
                f"{statistics.mean(r['fit_seconds'] for r in rows):.0f} |"
            )
            print(line, flush=True)
            lines.append(line)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
