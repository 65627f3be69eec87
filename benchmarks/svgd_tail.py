"""Why weight-space SVGD's eight-schools fit gets worse the longer it trains: its particles
in the right tail of ``log tau``.

``WeightSpaceSVGD(model, Adam(1e-2))`` with its defaults (100 particles, preconditioned,
median bandwidth) on the library's non-centred eight schools, against a NUTS run of the
same model: ``tau``'s mean error in NUTS sds and the quantiles of ``log tau`` after each
checkpoint, for the default and for variants (optimiser, learning rate, particle count,
bandwidth, kernel, rule) given on the command line; then, for the default at its last
checkpoint, where the particle with the largest ``tau`` sits: its ``theta_tilde`` against
the conditional mode given its ``mu`` and ``tau`` (the ridge of the funnel's neck), the
neck's width (the conditional sd of ``theta_tilde``) and the kernel's length scale.

    python benchmarks/svgd_tail.py --steps 1000,5000 --out benchmarks/results/svgd_tail.md
"""

import argparse
import time

import _provenance
import pyro
import torch
from pyro.infer import MCMC, NUTS

from pyro_implicit import WeightSpaceSVGD
from pyro_implicit.kernels import IMQKernel, RBFKernel, svgd_bandwidth_factor
from pyro_implicit.models import load_model

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)

#: name -> WeightSpaceSVGD keyword arguments and optimiser (name, learning rate); the
#: default is Adam(1e-2), 100 particles, the RBF kernel with the median distance as its
#: length scale (the preconditioned default; "bandwidth x2" doubles it, "Liu & Wang
#: bandwidth" is their h = med^2 / log N, a third of it at N = 100)
VARIANTS = {
    "default": ({}, ("Adam", 1e-2)),
    "Adam 3e-3": ({}, ("Adam", 3e-3)),
    "SGD 0.1": ({}, ("SGD", 0.1)),
    # Adam whose eps is near the Stein force's size at convergence: SGD at rate lr / eps
    # for small forces, Adam's normalised steps for large ones
    "Adam eps 0.01": ({}, ("Adam", 1e-2, {"eps": 0.01})),
    "Adam eps 0.03": ({}, ("Adam", 1e-2, {"eps": 0.03})),
    "Adam eps 0.1": ({}, ("Adam", 1e-2, {"eps": 0.1})),
    "SGD 0.03": ({}, ("SGD", 0.03)),
    "SGD 0.3": ({}, ("SGD", 0.3)),
    "N = 300 SGD 0.1": ({"num_particles": 300}, ("SGD", 0.1)),
    "Adagrad 0.1": ({}, ("Adagrad", 0.1)),
    "N = 300": ({"num_particles": 300}, ("Adam", 1e-2)),
    "bandwidth x0.5": ({"kernel": RBFKernel(bandwidth_factor=0.5)}, ("Adam", 1e-2)),
    "bandwidth x2": ({"kernel": RBFKernel(bandwidth_factor=2.0)}, ("Adam", 1e-2)),
    "Liu & Wang bandwidth": (
        {"kernel": RBFKernel(bandwidth_factor=svgd_bandwidth_factor(100))},
        ("Adam", 1e-2),
    ),
    "IMQ kernel": ({"kernel": IMQKernel()}, ("Adam", 1e-2)),
    "GFSF rule": ({"method": "gfsf"}, ("Adam", 1e-2)),
}


def nuts_reference(model, args, draws, seed):
    """One NUTS chain of ``draws`` draws after ``draws // 2`` warm-up (target acceptance
    0.9), seeded: the reference of this script and of ``stein_tail.py``."""
    pyro.set_rng_seed(seed)
    mcmc = MCMC(
        NUTS(model, target_accept_prob=0.9),
        num_samples=draws,
        warmup_steps=draws // 2,
        num_chains=1,
        disable_progbar=True,
    )
    mcmc.run(*args)
    return mcmc.get_samples()


def fit(model, args, options, optim, checkpoints, seed):
    """``[(step, tau draws, seconds)]`` and the fitted object."""
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    name, lr, *extra = optim
    svgd = WeightSpaceSVGD(
        model,
        getattr(pyro.optim, name)({"lr": lr, **(extra[0] if extra else {})}),
        max_plate_nesting=1,
        **options,
    )
    out, start = [], time.perf_counter()
    for step in range(1, max(checkpoints) + 1):
        svgd.step(*args)
        if step in checkpoints:
            tau = svgd.get_named_particles()["tau"].reshape(-1)
            out.append((step, tau, time.perf_counter() - start))
    return out, svgd


def tail_row(label, step, tau, ref_tau, seconds):
    q = torch.tensor(QUANTILES, dtype=tau.dtype)
    error = (tau.mean() - ref_tau.mean()).abs() / ref_tau.std()
    logq = " / ".join(f"{v:.2f}" for v in tau.log().quantile(q).tolist())
    return (
        f"| {label} | {step} | {error:.2f} | {tau.std() / ref_tau.std():.2f} | {logq} | "
        f"{seconds:.1f} |"
    )


def outlier_lines(svgd, args):
    """Where the particle with the largest ``tau`` sits against the neck of the funnel."""
    y, sigma = args
    p = svgd.get_named_particles()
    n = svgd.num_particles
    tau, mu = p["tau"].reshape(-1), p["mu"].reshape(-1)
    theta = p["theta_tilde"].reshape(n, -1)
    i = int(tau.argmax())
    t = tau[i]
    # theta_tilde_j | mu, tau, y_j is Gaussian: precision 1 + tau^2 / sigma_j^2
    mode = (y - mu[i]) * t / (sigma**2 + t**2)
    width = sigma / (sigma**2 + t**2).sqrt()
    z = svgd.particles.detach()
    dist = torch.cdist(z, z)
    nearest = torch.cat([dist[i, :i], dist[i, i + 1 :]]).min()
    info = svgd.step(*args)
    offset = ((theta[i] - mode).abs() / width).max()
    # the preconditioner's marginal sds of theta_tilde: the whitened unit there
    site = next(s for s in svgd.space.sites if s.name == "theta_tilde")
    sd = svgd.preconditioner.covariance().diagonal().sqrt()[site.start : site.stop]
    white = width / sd
    return [
        f"- largest `tau`: {t:.1f} (`log tau` {t.log():.2f});",
        f"- its `theta_tilde` is within {offset:.2f} neck widths of the conditional mode "
        "(of the conditional sd there);",
        f"- the neck's width (conditional sd of `theta_tilde`): {width.min():.3f}-"
        f"{width.max():.3f} in the model's units, {white.min():.3f}-{white.max():.3f} in "
        "units of the preconditioner's sds of `theta_tilde`;",
        f"- the kernel's length scale (whitened): {info['bandwidth']:.2f}; the particle's "
        f"nearest neighbour: {nearest:.2f} away (median pairwise distance "
        f"{dist.median():.2f}).",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,5000", help="checkpoints")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--nuts-draws", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    chosen = [v for v in args.variants.split(",") if v]
    model = load_model("eight_schools")
    ref = nuts_reference(model.model, model.args, args.nuts_draws, args.seed)
    ref_tau = ref["tau"]
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# Weight-space SVGD's tail on eight schools",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread. "
        f"Reference: NUTS, {args.nuts_draws} draws after {args.nuts_draws // 2} warm-up "
        "(target acceptance 0.9). Mean error of `tau` in NUTS sds, its sd ratio "
        "(approximation / NUTS), and the 1/10/50/90/99% quantiles of `log tau`.",
        "",
        "| fit | steps | tau mean err | tau sd ratio | log tau quantiles | s |",
        "|---|---:|---:|---:|---|---:|",
        tail_row("NUTS", "-", ref_tau, ref_tau, float("nan")).replace("| nan |", "| - |"),
    ]
    default = None
    for label in chosen:
        options, optim = VARIANTS[label]
        rows, svgd = fit(model.model, model.args, options, optim, checkpoints, args.seed)
        for step, tau, seconds in rows:
            lines.append(tail_row(label, step, tau, ref_tau, seconds))
            print(lines[-1], flush=True)
        if default is None:
            default = svgd
    lines += ["", f"The default fit after {checkpoints[-1]} steps:", ""]
    lines += outlier_lines(default, model.args)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
