"""The preconditioner's search on a model that subsamples its data, against the data's size.

The search scores a subsampled model on all of its data (``LatentSpace.log_density``: the
mean of its minibatch estimates over minibatches that cover every row), so its cost grows
with the data where a fit's steps do not. This times
:func:`~pyro_implicit.latent.find_preconditioner` on a logistic regression with ``--dim``
coefficients and N simulated rows (``--rows``), the likelihood in minibatches of
``--batch``: with the traced graph (``compile="fx"``, the default) and with Pyro's eager
runs (``compile=False``), and on the same model without subsampling (one run over every
row). Seconds of the whole search and of its phases, one run each, one thread.

Usage::

    python benchmarks/precondition_subsampled.py --rows 1000,10000,100000 \\
        --out benchmarks/results/precondition_subsampled.md
"""

import argparse

import _provenance
import pyro
import pyro.distributions as dist
import torch

from pyro_implicit.latent import LatentSpace, find_preconditioner


def logistic_regression(x, y, subsample_size=None):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as i:
        pyro.sample("y", dist.Bernoulli(logits=(x[i] * w).sum(-1)), obs=y[i])


def simulated(rows, dim, seed):
    """``(x, y)``: ``rows`` standard normal covariates and Bernoulli outcomes of
    coefficients evenly spaced in [-1, 1]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    truth = torch.linspace(-1.0, 1.0, dim)
    y = torch.bernoulli(torch.sigmoid((x * truth).sum(-1)), generator=gen)
    return x, y


def search(rows, dim, batch, subsample, compile, seed):
    """``{phase: seconds}`` and the source of the Gaussian found."""
    x, y = simulated(rows, dim, seed)
    kwargs = {"subsample_size": batch} if subsample else {}
    pyro.set_rng_seed(seed)
    space = LatentSpace.from_model(logistic_regression, (x, y), kwargs, 1)
    found = find_preconditioner(space, space.init_loc, (x, y), kwargs, compile=compile)
    d = found.diagnostics
    phases = {k: d.get(f"{k}_seconds", 0.0) for k in ("map", "laplace", "gaussian_vi")}
    return {"search": d["seconds"], **phases}, found.source


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1000,10000,100000")
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run = _provenance.provenance(__file__, argv, settings=vars(args))
    variants = [
        ("minibatches, compile='fx'", True, "fx"),
        ("minibatches, compile=False", True, False),
        ("no subsampling, compile='fx'", False, "fx"),
    ]
    for _, subsample, compile in variants:  # one-time costs (the tracer's first use)
        search(200, args.dim, args.batch, subsample, compile, args.seed)
    rows = []
    for n in [int(r) for r in args.rows.split(",")]:
        for label, subsample, compile in variants:
            seconds, source = search(n, args.dim, args.batch, subsample, compile, args.seed)
            row = (
                f"| {n} | {label} | {seconds['search']:.2f} | {seconds['map']:.2f} | "
                f"{seconds['laplace']:.2f} | {seconds['gaussian_vi']:.2f} | {source} |"
            )
            print(row, flush=True)
            rows.append(row)
    text = "\n".join(
        [
            "# The preconditioner's search on a subsampled model, against the data's size",
            "",
            f"`{run['command']}` (commit {run['commit']}, {run['utc']}), float32, one thread: "
            f"a logistic regression with {args.dim} coefficients, its likelihood in "
            f"minibatches of {args.batch} rows; seconds of `find_preconditioner` and of its "
            "phases (MAP, Laplace, Gaussian fit; one run each, after a search of 200 rows in each "
            "variant that takes the process's one-time costs).",
            "",
            "| rows | likelihood | search s | MAP s | Laplace s | Gaussian fit s | source |",
            "|---:|---|---:|---:|---:|---:|---|",
            *rows,
        ]
    )
    _provenance.write_result(text, args.out)


if __name__ == "__main__":
    main()
