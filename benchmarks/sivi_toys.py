"""SIVI on the paper's 1-D and 2-D toy targets (Yin & Zhou 2018, Sec. 5.1, Table 1) against
NUTS, Pyro's AutoMultivariateNormal and AutoIAFNormal.

Each target is a Pyro model (``pyro_implicit.targets.sivi.toy_model``). Methods, all with
the same number of optimisation steps, particles per step and learning-rate schedule:

* SIVI: ``SemiImplicitGuide`` with the paper's toy set-up (10-dim mixing noise, mixing MLP
  [30, 60, 30], a *fixed* conditional variance sigma0^2 = 0.1; the Gamma target is fitted
  in log z, so the conditional is the paper's log-normal) trained with ``SIVI_ELBO``
  (J particles, K extra mixing draws); the paper's raw-space settings are pinned
  (``precondition=False``);
* AutoMultivariateNormal and AutoIAFNormal (Pyro defaults) with vectorised ``Trace_ELBO``.

Each fitted q gives 2,000 draws, compared by energy distance
(``pyro_implicit.diagnostics.metrics.energy_distance``, coordinates standardised by the
reference) with (a) NUTS (2 chains x 2,000 draws after 1,000 warm-up steps) and (b) 4,000
exact draws of the target; the NUTS row is NUTS against the exact draws (the noise floor of
(b) and the reference quality of (a)). A figure overlays SIVI's draws on the target density.

Usage::

    nice -n 10 python benchmarks/sivi_toys.py --seed 0
    python benchmarks/sivi_toys.py --smoke
"""

import argparse
import time
from pathlib import Path

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoIAFNormal, AutoMultivariateNormal

from pyro_implicit.diagnostics.metrics import energy_distance
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.elbo.sivi import SIVI_ELBO
from pyro_implicit.guides.semi_implicit import SemiImplicitGuide
from pyro_implicit.targets.sivi import SIVI_TOY_TARGETS, toy_distribution, toy_model

FIGURE = Path(__file__).resolve().parent / "results" / "figures" / "sivi_toys.png"
METHODS = ("SIVI", "AutoMultivariateNormal", "AutoIAFNormal")


def make_guide_and_loss(method, model, args):
    if method == "SIVI":
        guide = SemiImplicitGuide(
            model,
            mixing_noise_dim=10,
            hidden_dims=(30, 60, 30),
            conditional="fixed",
            conditional_scale=0.1**0.5,
            init_scale=1.0,
            precondition=False,  # the paper's raw-space set-up
        )
        loss = SIVI_ELBO(num_particles=args.particles, num_mixing=args.num_mixing)
    else:
        cls = AutoMultivariateNormal if method == "AutoMultivariateNormal" else AutoIAFNormal
        guide = cls(model)
        loss = Trace_ELBO(num_particles=args.particles, vectorize_particles=True)
    return guide, loss


def fit(method, model, args):
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    guide, loss = make_guide_and_loss(method, model, args)
    optim = pyro.optim.ClippedAdam({"lr": args.lr, "lrd": 0.1 ** (1 / args.steps)})
    svi = SVI(model, guide, optim, loss)
    start = time.perf_counter()
    for _ in range(args.steps):
        svi.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        draws = Predictive(model, guide=guide, num_samples=args.draws, return_sites=["z"])()["z"]
    return draws.reshape(args.draws, -1), seconds


def plot(all_draws, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(all_draws)
    fig, axes = plt.subplots(2, 3, figsize=(12, 7.5))
    for ax, name in zip(axes.ravel()[: len(names)], names, strict=True):
        target = toy_distribution(name)
        draws = all_draws[name]["SIVI"]
        if SIVI_TOY_TARGETS[name] == 1:
            lo, hi = (0.01, 10.0) if name == "gamma" else (-10.0, 10.0)
            grid = torch.linspace(lo, hi, 500).unsqueeze(-1)
            ax.hist(
                draws[:, 0].numpy(),
                bins=80,
                range=(lo, hi),
                density=True,
                alpha=0.5,
                label="SIVI q draws",
            )
            ax.plot(grid[:, 0].numpy(), target.log_prob(grid).exp().numpy(), "k", label="target")
            ax.legend(fontsize=8)
        else:
            lims = {"banana": ((-3, 9), (-7, 7))}.get(name, ((-6, 6), (-5, 5)))
            xs = torch.linspace(*lims[0], 200)
            ys = torch.linspace(*lims[1], 200)
            gx, gy = torch.meshgrid(xs, ys, indexing="xy")
            dens = target.log_prob(torch.stack([gx, gy], -1)).exp()
            ax.contour(gx.numpy(), gy.numpy(), dens.numpy(), levels=8, colors="k", linewidths=0.8)
            ax.scatter(draws[:1000, 0].numpy(), draws[:1000, 1].numpy(), s=2, alpha=0.4)
            ax.set_xlim(*lims[0])
            ax.set_ylim(*lims[1])
        ax.set_title(name)
    fig.suptitle("SIVI (fixed conditional variance 0.1) draws over the target density")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--particles", type=int, default=50, help="J (all methods)")
    parser.add_argument("--num-mixing", type=int, default=100, help="SIVI's K")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--nuts-samples", type=int, default=2000)
    parser.add_argument("--targets", nargs="+", default=list(SIVI_TOY_TARGETS))
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    warmup = 1000
    if args.smoke:
        args.steps, args.particles, args.num_mixing, args.draws = 5, 4, 3, 50
        args.nuts_samples, warmup = 20, 20
    rows, all_draws = [], {}
    for name in args.targets:
        model = toy_model(name)
        torch.manual_seed(args.seed)
        exact = toy_distribution(name).sample((2 * args.draws,)).reshape(2 * args.draws, -1)
        nuts = run_nuts(
            model,
            num_samples=args.nuts_samples,
            warmup_steps=warmup,
            num_chains=2,
            seed=args.seed,
            progress_bar=False,
        )
        reference = nuts.samples["z"].reshape(-1, SIVI_TOY_TARGETS[name])
        ed_nuts_exact = energy_distance(reference, exact, seed=args.seed)
        print(
            f"[{name}] NUTS {nuts.wall_time:.0f}s, R-hat {nuts.max_r_hat:.3f}, "
            f"ED(NUTS, exact) {ed_nuts_exact:.4f}",
            flush=True,
        )
        rows.append((name, "NUTS (reference)", float("nan"), ed_nuts_exact, nuts.wall_time))
        all_draws[name] = {}
        for method in METHODS:
            try:
                draws, seconds = fit(method, model, args)
            except Exception as e:  # e.g. AutoIAFNormal cannot build a 1-D flow
                print(f"[{name}] {method} failed: {type(e).__name__}: {e}", flush=True)
                rows.append((name, method, float("nan"), float("nan"), float("nan")))
                continue
            all_draws[name][method] = draws
            ed_nuts = energy_distance(draws, reference, seed=args.seed)
            ed_exact = energy_distance(draws, exact, seed=args.seed)
            rows.append((name, method, ed_nuts, ed_exact, seconds))
            print(
                f"[{name}] {method}: ED to NUTS {ed_nuts:.4f}, to exact {ed_exact:.4f} "
                f"({seconds:.0f}s)",
                flush=True,
            )
    print()
    print(
        f"{args.steps} steps, J = {args.particles} particles per step (all methods), "
        f"SIVI K = {args.num_mixing}, {args.draws} draws per q, seed {args.seed}"
    )
    print("| target | method | energy distance to NUTS | energy distance to exact | fit time (s) |")
    print("|---|---|---:|---:|---:|")
    for name, method, ed_nuts, ed_exact, seconds in rows:
        print(f"| {name} | {method} | {ed_nuts:.4f} | {ed_exact:.4f} | {seconds:.0f} |")
    if all(all_draws[n].get("SIVI") is not None for n in all_draws):
        plot(all_draws, args.figure)
        print(f"figure: {args.figure}")
    return rows


if __name__ == "__main__":
    main()
