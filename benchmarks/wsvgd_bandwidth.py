"""A preconditioned ``WeightSpaceSVGD``'s kernel length scale on the stiff benchmark.

The default kernel of a preconditioned run is :class:`~pyro_implicit.kernels.RBFKernel`
with ``WHITENED_BANDWIDTH_FACTOR`` median distances as its length scale; this fits
``stiff.py``'s ``wsvgd`` (its defaults, 2000 steps of ``Adam(0.01)``) with that factor
replaced by each of ``--factors``, and scores the particles against the NUTS reference::

    python benchmarks/wsvgd_bandwidth.py --models stochastic_volatility \\
        --factors 0.5,0.7,1,1.4,2 --seeds 0,1,2 --out benchmarks/results/wsvgd_bandwidth.md

``--method gpvi`` or ``asvgd`` does the same for the functional-gradient losses (their
``default_kernel``: for ``gpvi`` Liu & Wang's length scale, ``svgd_bandwidth_factor(64)``
= 0.35 median distances; for ``asvgd`` since 1a929a3 an equal mixture of RBF kernels at
0.35 and 1 median distances; ``--factors default`` keeps it), where a factor written
``0.35+1`` is such a mixture.

One torch thread, float64, as ``stiff.py``.
"""

import argparse
import statistics
from unittest import mock

import _provenance
import stiff
import torch

import pyro_implicit.particles.svgd as svgd
from pyro_implicit import GPVI_ELBO, AmortizedSVGD_ELBO
from pyro_implicit.kernels import MultiScaleRBFKernel, RBFKernel


def _patched(method, factor):
    """The default length scale of ``method``'s kernel set to ``factor`` median distances
    (``None``: left as it is; a tuple, for ``gpvi`` and ``asvgd``: an equal mixture of RBF
    kernels at those many median distances)."""
    if factor is None:
        return mock.patch.object(svgd, "WHITENED_BANDWIDTH_FACTOR", svgd.WHITENED_BANDWIDTH_FACTOR)
    if method == "wsvgd":
        return mock.patch.object(svgd, "WHITENED_BANDWIDTH_FACTOR", factor)
    cls = GPVI_ELBO if method == "gpvi" else AmortizedSVGD_ELBO
    if isinstance(factor, tuple):
        kernel = staticmethod(lambda n: MultiScaleRBFKernel(factor))
    else:
        kernel = staticmethod(lambda n: RBFKernel(bandwidth_factor=factor))
    return mock.patch.object(cls, "default_kernel", kernel)


def _factor(text):
    """``default``, one factor (``0.35``) or a mixture's factors (``0.35+1``)."""
    if text == "default":
        return None
    if "+" in text:
        return tuple(float(f) for f in text.split("+"))
    return float(text)


def _label(factor):
    if factor is None:
        return "default"
    if isinstance(factor, tuple):
        return "+".join(f"{f:g}" for f in factor)
    return f"{factor:g}"


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
    factors = [_factor(f) for f in args.factors.split(",")]
    if args.method == "wsvgd" and any(isinstance(f, tuple) for f in factors):
        parser.error("a mixture of length scales (a+b) is for --method gpvi or asvgd only")
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
                f"| {name} | {_label(factor)} | "
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
