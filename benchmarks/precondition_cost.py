"""What the automatic preconditioner costs before a fit, against the fit itself.

On a UCI BNN (``BNNRegression``, one hidden layer of 50 units, the KIVI/LIVI UCI
architecture, full-batch likelihood as the UCI runs use on boston), the script times:

* the preconditioner's set-up on the guide's first call (MAP by L-BFGS, Hessian, the
  importance-weight check, a Gaussian variational fit where the check fails), read from
  ``guide.preconditioner.diagnostics["seconds"]``;
* the median step of the default fit, ``SVI(model, ImplicitGuide(model), Adam,
  KernelRatioELBO())`` (100 particles; ``--guide stein_score``: ``SteinScoreELBO()``,
  ``livi``: ``LinearizedGuide`` + ``LIVI_ELBO()``), over ``--probe-steps`` steps,

and reports the set-up as a share of a default fit of ``--steps`` steps (the issue's goal:
under 10%).

    python benchmarks/precondition_cost.py --dataset boston --hidden 50 --steps 2000
"""

import argparse
import statistics
import time

import pyro
import torch
from _provenance import command_line, git_commit, utc_now
from pyro.infer import SVI

from pyro_implicit import (
    LIVI_ELBO,
    ImplicitGuide,
    KernelRatioELBO,
    LinearizedGuide,
    SteinScoreELBO,
)
from pyro_implicit.bnn import BNNRegression
from pyro_implicit.datasets import load_uci
from pyro_implicit.diagnostics.methods import resolve_name


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="boston")
    parser.add_argument("--hidden", type=int, default=50)
    parser.add_argument(
        "--steps",
        type=int,
        default=2000,
        help="length of the default fit the set-up is compared with",
    )
    parser.add_argument("--probe-steps", type=int, default=20)
    parser.add_argument(
        "--guide", type=resolve_name, choices=["kivi", "stein_score", "livi"], default="kivi"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.set_rng_seed(args.seed)
    data = load_uci(args.dataset, 0, dtype=torch.float32)
    model = BNNRegression(data.in_dim, hidden_dims=(args.hidden,))
    if args.guide == "kivi":
        guide, loss = ImplicitGuide(model), KernelRatioELBO(max_plate_nesting=1)
    elif args.guide == "stein_score":
        guide, loss = ImplicitGuide(model), SteinScoreELBO(max_plate_nesting=1)
    else:
        guide, loss = LinearizedGuide(model), LIVI_ELBO(max_plate_nesting=1)
    x, y = data.x_train, data.y_train
    start = time.perf_counter()
    guide(x, y)
    setup = time.perf_counter() - start
    diag = guide.preconditioner.diagnostics
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)  # the UCI BNN rate
    svi.step(x, y)  # the first step checks vectorisation: not a typical step
    times = []
    for _ in range(args.probe_steps):
        t = time.perf_counter()
        svi.step(x, y)
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    print(
        f"command: {command_line(__file__, argv)}; commit {git_commit()}; {utc_now()}; one "
        "torch thread, float32"
    )
    print(
        f"model: BNN {data.in_dim}-{args.hidden}-1 on {args.dataset} split 0 "
        f"(n = {x.shape[0]}, D = {guide.latent_dim})"
    )
    print(
        f"preconditioner: {guide.preconditioner.kind}, source {guide.preconditioner.source}, "
        f"{diag['seconds']:.2f} s in the search ({setup:.2f} s for the guide's first call); "
        f"log-weight sd of the Laplace {diag.get('laplace_log_weight_sd', float('nan')):.3g}, "
        f"clamped curvatures {diag.get('clamped_curvatures', 0)}"
    )
    if "gaussian_vi_seconds" in diag:
        print(
            f"gaussian fit: {diag['gaussian_vi_seconds']:.2f} s, "
            f"{diag.get('gaussian_vi_steps', '?')} steps from the "
            f"{diag.get('gaussian_vi_start', '?')}, "
            f"ELBO from each start after its first round "
            + ", ".join(
                f"{k.rsplit('_', 1)[-1]} {v:.1f}"
                for k, v in diag.items()
                if k.startswith("gaussian_vi_elbo_from_")
            )
        )
    print(
        f"default step ({args.guide}): median {1e3 * step:.1f} ms over {args.probe_steps}; "
        f"a {args.steps}-step fit {args.steps * step:.1f} s"
    )
    print(f"set-up / fit: {setup / (args.steps * step):.1%}")


if __name__ == "__main__":
    main()
