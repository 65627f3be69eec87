"""Refreshing the preconditioner during training, tried on ``WeightSpaceSVGD``: does a
second whitening, from the particles' own moments, bring the fits of the stiff benchmark
nearer NUTS?

Issue #20 asks for the preconditioner to be "optionally refreshed during training from the
running covariance of the draws". For particles that is exact and cheap
(:meth:`~pyro_implicit.particles.WeightSpaceSVGD.refresh_preconditioner`, since 9471b91;
this script's own copy of it before): at the steps ``--refresh-at`` the particles' mean
``m`` and covariance ``C`` (in the unconstrained space) become the new preconditioner
``(m, chol(C))``, the particles are re-expressed in its coordinates (the same points in
``u``) and the optimiser's moments of the particles are reset (they were moments of the old
coordinates). Everything else is ``benchmarks/stiff.py``'s fit of
``wsvgd`` (``compare``'s builder, plain ``Adam``, the preconditioner on); each model is fit
with and without the refresh from the same seed and scored against the gold NUTS draws.

    python benchmarks/preconditioner_refresh.py --models all --refresh-at 500 --seed 0 \\
        --out benchmarks/results/preconditioner_refresh_wsvgd.md
"""

import argparse
import time

import _provenance
import pyro
import stiff
import torch

from pyro_implicit.diagnostics.metrics import compare_samples
from pyro_implicit.latent import Preconditioner


def trimmed_refresh(svgd, keep=0.975, rounds=3):
    """The refresh with trimmed moments (a prototype for ``--kind trimmed``): the mean and
    covariance of the particles within the ``keep`` quantile of chi-square in their own
    Mahalanobis distance, iterated ``rounds`` times, the covariance rescaled to be
    consistent at a Gaussian; then installed as ``refresh_preconditioner``
    installs its own."""
    from scipy.stats import chi2

    with torch.no_grad():
        u = svgd.unconstrained_particles().detach()
        dim = u.shape[1]
        cutoff = chi2.ppf(keep, dim)
        consistency = keep / chi2.cdf(cutoff, dim + 2)
        inside = torch.ones(len(u), dtype=torch.bool)
        for _ in range(rounds):
            kept = u[inside]
            loc = kept.mean(0)
            cov = torch.cov(kept.T).reshape(dim, dim) * (1.0 if _ == 0 else consistency)
            chol = torch.linalg.cholesky(cov)
            white = torch.linalg.solve_triangular(chol, (u - loc).T, upper=False)
            inside = white.pow(2).sum(0) <= cutoff
    svgd._rewhiten(Preconditioner(loc=loc, scale_tril=chol, source="particles"))


def blended_refresh(svgd, weight=0.5):
    """The refresh with the covariance ``weight * C_particles + (1 - weight) * C_old`` (a
    prototype for ``--kind blend``): the old preconditioner's Gaussian pulled halfway
    towards the particles' moments; then installed as ``refresh_preconditioner``
    installs its own."""
    with torch.no_grad():
        u = svgd.unconstrained_particles().detach()
        dim = u.shape[1]
        old = svgd.preconditioner.covariance().reshape(dim, dim)
        cov = weight * torch.cov(u.T).reshape(dim, dim) + (1 - weight) * old
        loc = weight * u.mean(0) + (1 - weight) * svgd.preconditioner.loc
        chol = torch.linalg.cholesky(cov)
    svgd._rewhiten(Preconditioner(loc=loc, scale_tril=chol, source="particles"))


def fit(model_name, steps, seed, refresh_at, lr, kind="dense"):
    model, args, kwargs, mpn = stiff.MODELS[model_name]()
    reference, _ = stiff.load_reference(model_name)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro.optim.Adam({"lr": lr})
    _, svgd, _ = stiff.build_method("wsvgd", model, mpn, optim, True)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        svgd.step(*args, **kwargs)
        if i in refresh_at:
            if kind == "trimmed":
                trimmed_refresh(svgd)
            elif kind == "blend":
                blended_refresh(svgd)
            else:
                svgd.refresh_preconditioner(kind)
    seconds = time.perf_counter() - start
    shapes = stiff.latent_shapes(model, *args, **kwargs)
    draws, _ = stiff.posterior_draws(svgd, model, args, kwargs, 2000, mpn, shapes)
    joint = compare_samples(draws, reference, sites=list(reference))["joint"]
    return {**{k: joint[k] for k in stiff._summary({"joint": joint})}, "seconds": seconds}


def particle_spread(model_name, steps, seed, lr):
    """What a refresh would see at step ``steps`` (a probe for a trigger): the range of the
    particles' sds in the current whitened coordinates (1 where the preconditioner still
    fits them) and their largest kurtosis over coordinates (3 for a Gaussian), from the fit
    of :func:`fit` without a refresh."""
    model, args, kwargs, mpn = stiff.MODELS[model_name]()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    _, svgd, _ = stiff.build_method("wsvgd", model, mpn, pyro.optim.Adam({"lr": lr}), True)
    for _ in range(steps):
        svgd.step(*args, **kwargs)
    z = svgd.particles.detach()
    sd = z.std(0)
    kurtosis = ((z - z.mean(0)) / sd).pow(4).mean(0)
    return {
        "dim": z.shape[1],
        "sd_min": sd.min().item(),
        "sd_median": sd.median().item(),
        "sd_max": sd.max().item(),
        "kurtosis_max": kurtosis.max().item(),
    }


def main_spread(args, record, models, at):
    lines = [
        "# What a refresh of WeightSpaceSVGD's preconditioner would see",
        "",
        f"`{record['command']}` (commit {record['commit']}, {record['utc']}); "
        f"{at} steps of Adam({args.lr}), seed {args.seed}, float64, one thread, no refresh: "
        "the particles' sds in the whitened coordinates (min / median / max) and their "
        "largest kurtosis over coordinates (3 for a Gaussian).",
        "",
        "| model | D | sd min | sd median | sd max | kurtosis max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in models:
        s = particle_spread(name, at, args.seed, args.lr)
        lines.append(
            f"| {name} | {s['dim']} | {s['sd_min']:.2f} | {s['sd_median']:.2f} | "
            f"{s['sd_max']:.2f} | {s['kurtosis_max']:.1f} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all")
    parser.add_argument("--refresh-at", default="500", help="comma-separated steps")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kind",
        choices=["dense", "diagonal", "trimmed", "blend"],
        default="dense",
        help="refresh_preconditioner's kind, or trimmed moments (trimmed_refresh), or the "
        "old and the particles' covariances averaged (blended_refresh)",
    )
    parser.add_argument(
        "--spread-only",
        action="store_true",
        help="no fits to score: the particles' whitened sds and kurtosis at the first "
        "--refresh-at step (particle_spread), what a trigger for the refresh would read",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    record = _provenance.provenance(__file__, argv, vars(args))
    models = sorted(stiff.MODELS) if args.models == "all" else args.models.split(",")
    refresh_at = {int(s) for s in args.refresh_at.split(",")}
    if args.spread_only:
        text = main_spread(args, record, models, min(refresh_at))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return
    lines = [
        "# WeightSpaceSVGD with its preconditioner refreshed from the particles",
        "",
        f"`{record['command']}` (commit {record['commit']}, {record['utc']}); "
        f"{args.steps} steps of Adam({args.lr}), seed {args.seed}, float64, one thread; "
        f"refreshed at step(s) {sorted(refresh_at)} ({args.kind}). Max mean error in gold "
        "NUTS sds, the sd-ratio range and the energy distance of 2000 draws (the particles) "
        "against the gold draws.",
        "",
        "| model | err | err refreshed | sd ratio | sd ratio refreshed | energy | "
        "energy refreshed |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for name in models:
        base = fit(name, args.steps, args.seed, set(), args.lr)
        new = fit(name, args.steps, args.seed, refresh_at, args.lr, args.kind)
        lines.append(
            f"| {name} | {base['mean_error_max']:.3f} | {new['mean_error_max']:.3f} | "
            f"{base['sd_ratio_min']:.2f}-{base['sd_ratio_max']:.2f} | "
            f"{new['sd_ratio_min']:.2f}-{new['sd_ratio_max']:.2f} | "
            f"{base['energy_distance']:.4f} | {new['energy_distance']:.4f} |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
