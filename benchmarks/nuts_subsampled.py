"""NUTS on a model that subsamples its data: the full-data potential traced against eager.

:func:`~pyro_implicit.diagnostics.nuts.run_nuts` samples a subsampled model's full-data
posterior with minus :meth:`~pyro_implicit.latent.LatentSpace.log_density` as NUTS's
potential, every gradient a pass over every minibatch. This times one chain on the
logistic regression of ``precondition_subsampled.py`` (``--dim`` coefficients, N simulated
rows in minibatches of ``--batch``) with the potential from the space's traced graph (the
default) and from Pyro's eager runs (``LatentSpace.compile`` made a no-op), and on the same
model without subsampling (Pyro's own NUTS on the model); seconds, the posterior means'
largest difference from the eager run in posterior sds, one thread.

Usage::

    python benchmarks/nuts_subsampled.py --rows 1000,10000 \\
        --out benchmarks/results/nuts_subsampled.md
"""

import argparse
import contextlib
from unittest import mock

import _provenance
import torch
from precondition_subsampled import logistic_regression, simulated

from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.latent import LatentSpace


def sample(x, y, batch, variant, args):
    kwargs = {} if variant == "no subsampling" else {"subsample_size": batch}
    eager = mock.patch.object(LatentSpace, "compile", lambda self, *a, **k: self)
    with eager if variant == "minibatches, eager" else contextlib.nullcontext():
        result = run_nuts(
            logistic_regression,
            x,
            y,
            num_samples=args.samples,
            warmup_steps=args.warmup,
            num_chains=1,
            seed=args.seed,
            max_plate_nesting=1,
            progress_bar=False,
            **kwargs,
        )
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1000,10000")
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run = _provenance.provenance(__file__, argv, settings=vars(args))
    variants = ["minibatches, traced", "minibatches, eager", "no subsampling"]
    x, y = simulated(200, args.dim, args.seed)
    for variant in variants:  # one-time costs (the tracer's first use)
        sample(x, y, args.batch, variant, argparse.Namespace(**{**vars(args), "warmup": 5}))
    rows = []
    for n in [int(r) for r in args.rows.split(",")]:
        x, y = simulated(n, args.dim, args.seed)
        results = {v: sample(x, y, args.batch, v, args) for v in variants}
        reference = results["minibatches, eager"].samples["w"]
        for variant, result in results.items():
            w = result.samples["w"]
            gap = ((w.mean(0) - reference.mean(0)) / reference.std(0)).abs().max()
            row = (
                f"| {n} | {variant} | {result.wall_time:.1f} | {gap:.3f} | "
                f"{result.num_divergences} |"
            )
            print(row, flush=True)
            rows.append(row)
    text = "\n".join(
        [
            "# NUTS on a subsampled model: the full-data potential traced against eager",
            "",
            f"`{run['command']}` (commit {run['commit']}, {run['utc']}), float32, one thread: "
            f"a logistic regression with {args.dim} coefficients, its likelihood in "
            f"minibatches of {args.batch} rows; one chain of {args.warmup} warmup steps and "
            f"{args.samples} draws, seed {args.seed}; seconds of `run_nuts`, the largest "
            "difference of the posterior means from the eager run's in its posterior sds "
            "(the same seed: the traced potential gives the same values to float rounding), "
            "divergences. After a short run of each variant that takes the process's "
            "one-time costs.",
            "",
            "| rows | potential | seconds | mean gap (sds) | divergences |",
            "|---:|---|---:|---:|---:|",
            *rows,
            "",
        ]
    )
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
