r"""f-POVI's 1-D over-parameterisation experiment (Wang et al., ICLR 2019, Sec. 5.1, Fig. 1).

Data of Sun et al. (2017): 12 inputs ~ U(0, 0.6), 8 inputs ~ U(0.8, 1),
:math:`y = x + \epsilon + \sin(4(x + \epsilon)) + \sin(13(x + \epsilon))`,
:math:`\epsilon \sim N(0, 0.03^2)`. The same Bayesian MLP (2 hidden layers of 50 ReLU
units, weight prior :math:`N(0, 1/n_{out})` per layer, noise std fixed at 0.2) is fitted by

* :class:`~pyro_implicit.particles.FunctionSpaceSVGD` (f-SVGD, eq. 4): 50 particles, Adam
  1e-3, full batch, extra points = the training inputs plus small Gaussian noise (the
  code's KDE with ptb_scale 0.1), moment-matched Gaussian prior score from 400 prior draws
  on a prior batch of 4;
* :class:`~pyro_implicit.particles.WeightSpaceSVGD` (SVGD on the weights), same particles,
  optimiser and steps; the paper's raw-space settings pinned (``precondition=False``);
* NUTS (Pyro), the reference posterior (the paper uses HMC).

It plots the predictive mean with the 95% epistemic band (mean ± 1.96 sd of f over the
particles or draws) and the 95% predictive band (adds the noise) for each method, and
prints the average epistemic sd of f in the data, in the gap (0.6, 0.8) and outside the
data ([-0.5, 0] and [1, 1.5]), with each method's ratio to NUTS. Weight-space SVGD's
collapse shows as ratios far below 1.

Examples::

    python benchmarks/fpovi_1d.py --seed 0
    python benchmarks/fpovi_1d.py --smoke          # a few seconds, tiny settings
"""

import argparse
import json
import sys
import time
from pathlib import Path

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import numpy as np
import pyro
import torch
from pyro.infer import MCMC, NUTS

from pyro_implicit.bnn import BNNRegression
from pyro_implicit.particles import (
    FunctionSpaceSVGD,
    KDEInputs,
    WeightSpaceSVGD,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

FIG_DIR = REPO_ROOT / "benchmarks" / "results" / "figures"

#: regions of the input axis over which the epistemic sd is averaged
REGIONS = {
    "data": [(0.0, 0.6), (0.8, 1.0)],
    "gap": [(0.6, 0.8)],
    "outside": [(-0.5, 0.0), (1.0, 1.5)],
}


def make_data(seed, dtype=torch.float64):
    """The Sun et al. (2017) toy data (20 points), drawn with numpy's ``seed``."""
    rng = np.random.RandomState(seed)
    x = np.concatenate([rng.uniform(0.0, 0.6, 12), rng.uniform(0.8, 1.0, 8)])
    eps = rng.normal(0.0, 0.03, x.shape)
    xe = x + eps
    y = xe + np.sin(4 * xe) + np.sin(13 * xe)
    return torch.tensor(x, dtype=dtype).unsqueeze(-1), torch.tensor(y, dtype=dtype)


def region_sd(grid, sd):
    """Average of ``sd`` over the grid points in each region of :data:`REGIONS`."""
    out = {}
    for name, intervals in REGIONS.items():
        mask = np.zeros_like(grid, dtype=bool)
        for lo, hi in intervals:
            mask |= (grid >= lo) & (grid <= hi)
        out[name] = float(sd[mask].mean())
    return out


def run_particles(model, x, y, args, function_space):
    n = args.particles
    init = {
        name: torch.randn((n,) + tuple(shape), dtype=x.dtype) * s
        for name, shape, s in zip(
            model.layer_names, model.layer_shapes, model.layer_prior_scales, strict=True
        )
    }
    optim = pyro.optim.Adam({"lr": args.lr})
    if function_space:
        inference = FunctionSpaceSVGD(
            model,
            optim,
            n,
            max_plate_nesting=1,
            num_prior_samples=args.prior_draws,
            prior_batch_size=4,
            prior_eig_min=1e-3,
            nu=KDEInputs(num_points=x.shape[0], scale=args.ptb_scale),
            init_particles=init,
        )
    else:
        # the raw weight space with Liu & Wang's bandwidth, as the paper
        inference = WeightSpaceSVGD(
            model, optim, n, max_plate_nesting=1, init_particles=init, precondition=False
        )
    t0 = time.perf_counter()
    for step in range(args.steps):
        diag = inference.step(x, y)
        if (step + 1) % max(1, args.steps // 5) == 0:
            print(
                f"  {'f-SVGD' if function_space else 'SVGD'} step {step + 1}/{args.steps}  "
                f"attr {diag['attractive']:.3g}  rep {diag['repulsive']:.3g}  "
                f"bw {diag['bandwidth']:.3g}",
                flush=True,
            )
    return inference.get_named_particles(), time.perf_counter() - t0


def run_nuts(model, x, y, args):
    kernel = NUTS(model, max_tree_depth=args.nuts_tree_depth, target_accept_prob=0.8)
    mcmc = MCMC(
        kernel, num_samples=args.nuts_samples, warmup_steps=args.nuts_warmup, disable_progbar=True
    )
    t0 = time.perf_counter()
    mcmc.run(x, y)
    return mcmc.get_samples(), time.perf_counter() - t0


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=233, help="numpy seed of the data (code)")
    p.add_argument("--width", type=int, default=50)
    p.add_argument("--particles", type=int, default=50)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prior-draws", type=int, default=400)
    p.add_argument("--ptb-scale", type=float, default=0.1)
    p.add_argument("--noise", type=float, default=0.2)
    p.add_argument("--nuts-samples", type=int, default=300)
    p.add_argument("--nuts-warmup", type=int, default=300)
    p.add_argument("--nuts-tree-depth", type=int, default=8)
    p.add_argument("--smoke", action="store_true", help="tiny settings (seconds)")
    p.add_argument("--out", type=Path, default=None, help="figure path")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    return p


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.width, args.particles, args.steps, args.prior_draws = 8, 5, 20, 40
        args.nuts_samples, args.nuts_warmup, args.nuts_tree_depth = 10, 10, 4
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    x, y = make_data(args.data_seed)
    model = BNNRegression(
        1,
        hidden_dims=(args.width, args.width),
        prior_scale="fan_out",
        precision_prior=None,
        noise_scale=args.noise,
    )
    grid = torch.linspace(-1.0, 2.0, 601).unsqueeze(-1)
    results, draws = {}, {}
    for name, fn in [
        ("f-SVGD", lambda: run_particles(model, x, y, args, True)),
        ("SVGD", lambda: run_particles(model, x, y, args, False)),
        ("NUTS", lambda: run_nuts(model, x, y, args)),
    ]:
        pyro.set_rng_seed(args.seed)
        pyro.clear_param_store()
        print(f"{name} ...", flush=True)
        samples, secs = fn()
        with torch.no_grad():
            f = model.forward(samples, grid).reshape(-1, grid.shape[0]).numpy()
        draws[name] = f
        sd = f.std(0)
        results[name] = {"seconds": round(secs, 1), "sd": region_sd(grid[:, 0].numpy(), sd)}
    for name in results:
        results[name]["ratio_to_nuts"] = {
            k: v / results["NUTS"]["sd"][k] for k, v in results[name]["sd"].items()
        }
    summary = {
        "command": "python benchmarks/fpovi_1d.py " + " ".join(argv),
        "settings": vars(args) | {"out": None, "json": None},
        "results": results,
    }
    print(json.dumps(summary, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1, default=str))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    g = grid[:, 0].numpy()
    for ax, (name, f) in zip(axes, draws.items(), strict=True):
        m, sd = f.mean(0), f.std(0)
        pred = np.sqrt(sd**2 + args.noise**2)
        ax.fill_between(
            g, m - 1.96 * pred, m + 1.96 * pred, color="C0", alpha=0.2, label="95% predictive"
        )
        ax.fill_between(
            g, m - 1.96 * sd, m + 1.96 * sd, color="C0", alpha=0.45, label="95% epistemic"
        )
        ax.plot(g, m, color="C0", lw=1)
        ax.scatter(x[:, 0].numpy(), y.numpy(), s=10, color="k", zorder=3)
        r = results[name]["sd"]
        ax.set_title(f"{name}: sd gap {r['gap']:.2f}, outside {r['outside']:.2f}", fontsize=9)
        ax.set_xlim(-0.5, 1.5)
        ax.set_ylim(-2, 3)
    axes[0].legend(loc="upper left", fontsize=8)
    fig.suptitle(
        f"2 x {args.width} ReLU BNN, {args.particles} particles, {args.steps} steps; "
        f"NUTS {args.nuts_samples} draws",
        fontsize=9,
    )
    fig.tight_layout()
    out = args.out or FIG_DIR / ("fpovi_1d_smoke.png" if args.smoke else "fpovi_1d.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    summary["figure"] = str(out)
    return summary


if __name__ == "__main__":
    main()
