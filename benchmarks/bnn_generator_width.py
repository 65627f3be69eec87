"""The generator's width on a BNN: step time against test accuracy.

An ``ImplicitGuide``'s default generator has two hidden layers of
``min(512, 2 * max(noise_dim, min(D, 256)))`` units, so every BNN gets 512-wide layers, and
on the Boston BNN (D = 752) they cost more than the model does (the fast-steps issue,
``implicit_loss_steps*.md``). This fits the Boston BNN (13-50-1, UCI split ``--split``,
minibatches of 100 rows, ``Adam(lr)``) with each loss's defaults at each generator width,
and reports ms per step (set-up steps excluded) and the test RMSE and log-likelihood (500
predictive draws) after ``--steps`` steps; ``autonormal`` (AutoNormal + Trace_ELBO with as
many vectorised particles) is the mean-field reference; ``gpvi`` is
``ImplicitGuide(generator=gpvi_generator())`` with ``GPVI_ELBO`` (its exact solve through
the skip generator's k x k block).

Usage::

    python benchmarks/bnn_generator_width.py --methods autonormal,kivi,stein_score \\
        --widths default,256,128 --seeds 0,1 --out benchmarks/results/bnn_generator_width.md
"""

import argparse
import math
import time

import _provenance
import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import GPVI_ELBO, ImplicitGuide, KernelRatioELBO, SteinScoreELBO
from pyro_implicit.bnn import BNNRegression
from pyro_implicit.datasets import load_uci
from pyro_implicit.elbo.gpvi import gpvi_generator

#: ``gpvi``: ``ImplicitGuide(generator=gpvi_generator())`` (the width is g's)
LOSSES = {"kivi": KernelRatioELBO, "stein_score": SteinScoreELBO, "gpvi": GPVI_ELBO}
SETUP_STEPS = 5


def fit(method, width, seed, steps, lr, particles, split_index):
    """``(ms per step after the set-up steps, test RMSE, test log-likelihood)``."""
    split = load_uci("boston", split_index, dtype=torch.float32)
    bnn = BNNRegression(split.x_train.shape[-1], hidden_dims=(50,))
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if method == "autonormal":
        guide = AutoNormal(bnn)
        loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    else:
        widths = {} if width == "default" else {"hidden_dims": (int(width), int(width))}
        if method == "gpvi":
            guide = ImplicitGuide(bnn, generator=gpvi_generator(**widths))
        else:
            guide = ImplicitGuide(bnn, **widths)
        loss = LOSSES[method](num_particles=particles, max_plate_nesting=1)
    svi = SVI(bnn, guide, pyro.optim.Adam({"lr": lr}), loss)
    for _ in range(SETUP_STEPS):  # preconditioner, vectorisation check, trace
        svi.step(split.x_train, split.y_train, subsample_size=100)
    start = time.perf_counter()
    for _ in range(steps - SETUP_STEPS):
        svi.step(split.x_train, split.y_train, subsample_size=100)
    ms = 1000 * (time.perf_counter() - start) / (steps - SETUP_STEPS)
    with torch.no_grad():
        predictive = Predictive(
            bnn, guide=guide, num_samples=500, return_sites=["_RETURN", "precision"]
        )
        draws = predictive(split.x_test)
    f, precision = draws["_RETURN"], draws["precision"].reshape(-1, 1)
    rmse = float(((f.mean(0) - split.y_test) ** 2).mean().sqrt() * split.y_std)
    # the predictive density: a mixture of the draws' Normals, in the data's units
    log_density = torch.distributions.Normal(f, precision.rsqrt()).log_prob(split.y_test)
    ll = float((log_density.logsumexp(0) - math.log(f.shape[0])).mean() - math.log(split.y_std))
    return ms, rmse, ll


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="autonormal,kivi,stein_score")
    parser.add_argument("--widths", default="default,256,128")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--particles", type=int, default=100)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run = _provenance.provenance(__file__, argv, settings=vars(args))
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for method in args.methods.split(","):
            widths = ["-"] if method == "autonormal" else args.widths.split(",")
            for width in widths:
                ms, rmse, ll = fit(
                    method, width, seed, args.steps, args.lr, args.particles, args.split
                )
                row = f"| {method} | {width} | {seed} | {ms:.1f} | {rmse:.3f} | {ll:.3f} |"
                print(row, flush=True)
                rows.append(row)
    text = "\n".join(
        [
            "# The generator's width on the Boston BNN: step time and test accuracy",
            "",
            f"`{run['command']}` (commit {run['commit']}, {run['utc']}), float32, one thread, "
            f"Boston split {args.split}: {args.steps} steps of `Adam({args.lr})`, "
            f"{args.particles} particles, minibatches of 100 rows; `default` is the guide's own "
            "width (512 here); ms per "
            f"step after {SETUP_STEPS} set-up steps; test RMSE and log-likelihood from 500 "
            "predictive draws.",
            "",
            "| method | width | seed | ms / step | test RMSE | test LL |",
            "|---|---|---:|---:|---:|---:|",
            *rows,
        ]
    )
    _provenance.write_result(text, args.out)


if __name__ == "__main__":
    main()
