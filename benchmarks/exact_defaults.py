"""Every method with its defaults against exact posteriors (the preconditioning issue's
acceptance grid).

For each problem of :mod:`pyro_implicit.targets.conjugate` (conjugate Normal,
Gamma-Poisson, Beta-Bernoulli, a correlated 5-coefficient regression and the same on raw
predictors spanning five orders of magnitude) and each method, one fit exactly as a new
user writes it, ``SVI(model, Guide(model), pyro.optim.Adam({"lr": 1e-2}), Loss())`` (or
``WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}))``), for ``--steps`` steps; then
4000 draws (the particles for SVGD) scored against the exact posterior in its sd units:
the largest mean error, the sd-ratio range, the largest correlation error. ``--settings
compare`` fits with the settings of ``pyro_implicit.diagnostics.compare`` instead
(``ClippedAdam`` with a decaying rate, each method's particle counts and rate).
``--no-precondition`` fits in the raw space (the papers' setting) for comparison.

    python benchmarks/exact_defaults.py --steps 2000 --out benchmarks/results/exact_defaults.json

The bar (the issue's): mean error < 0.2, sd ratios in [0.85, 1.15], correlation error
< 0.1.
"""

import argparse
import contextlib
import json
import sys
import time

import pyro
import torch
from _averaging import Averaged
from _provenance import provenance
from pyro.infer import SVI

from pyro_implicit import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    ImplicitGuide,
    KernelRatioELBO,
    LinearizedGuide,
    SemiImplicitGuide,
    SteinScoreELBO,
    WeightSpaceSVGD,
)
from pyro_implicit.diagnostics.compare import METHODS as COMPARE_METHODS
from pyro_implicit.diagnostics.compare import _fit as compare_fit
from pyro_implicit.diagnostics.compare import posterior_draws
from pyro_implicit.diagnostics.methods import resolve_name
from pyro_implicit.elbo.gpvi import gpvi_generator
from pyro_implicit.targets.conjugate import EXACT_PROBLEMS, exact_problem, score_draws

#: method (the registry's names) -> how a new user builds it with the defaults: (guide,
#: loss) or particles
DEFAULT_METHODS = {
    "kivi": lambda m, p, **options: (
        ImplicitGuide(m, precondition=p),
        KernelRatioELBO(**options),
    ),
    "sivi": lambda m, p: (SemiImplicitGuide(m, precondition=p), SIVI_ELBO()),
    "livi": lambda m, p: (LinearizedGuide(m, precondition=p), LIVI_ELBO()),
    "gpvi": lambda m, p: (
        ImplicitGuide(m, generator=gpvi_generator(), precondition=p),
        GPVI_ELBO(),
    ),
    "asvgd": lambda m, p: (ImplicitGuide(m, precondition=p), AmortizedSVGD_ELBO()),
    "stein_score": lambda m, p: (ImplicitGuide(m, precondition=p), SteinScoreELBO()),
    "wsvgd": None,  # WeightSpaceSVGD(model, optim)
}

#: benchmark-only variants (``--methods`` only): a default's guide with one option
VARIANTS = {
    "sivi_mixed": lambda m, p: (
        SemiImplicitGuide(m, precondition=p, conditional="mixed"),
        SIVI_ELBO(),
    ),
    "sivi_diagonal": lambda m, p: (
        SemiImplicitGuide(m, precondition=p, conditional="diagonal"),
        SIVI_ELBO(),
    ),
    # for wide_blr (D = 150): a noise as large as the latent, and more draws than D
    "livi_noise150": lambda m, p: (
        LinearizedGuide(m, precondition=p, noise_dim=150),
        LIVI_ELBO(),
    ),
    "livi_noise150_32": lambda m, p: (
        LinearizedGuide(m, precondition=p, noise_dim=150),
        LIVI_ELBO(num_particles=32),
    ),
    "stein_score_400": lambda m, p: (
        ImplicitGuide(m, precondition=p),
        SteinScoreELBO(num_particles=400),
    ),
}

#: the bar every (problem, method) must pass
BAR = {"mean_error": 0.2, "sd_ratio": (0.85, 1.15), "correlation_error": 0.1}

NUM_DRAWS = 4000


def passes(score):
    lo, hi = BAR["sd_ratio"]
    return (
        score["mean_error"] < BAR["mean_error"]
        and lo <= score["sd_ratio_min"]
        and score["sd_ratio_max"] <= hi
        and score["correlation_error"] < BAR["correlation_error"]
    )


def fit_default(
    method,
    problem,
    steps,
    precondition,
    lr=1e-2,
    average=False,
    kivi_options=None,
    call_guide_first=False,
):
    """One fit with the constructors' defaults and plain Adam (with ``average``, a guide's
    draws from its parameters averaged by ``_averaging.Averaged``; the
    particle method is never averaged; ``kivi_options``: keyword arguments of
    ``KernelRatioELBO`` for ``kivi``; ``call_guide_first``: the guide is called once on
    the model's arguments before the first step, as a user looking at it first does);
    returns draws ``(S, ...)``."""
    model, args = problem.model, problem.args
    optim = pyro.optim.Adam({"lr": lr})
    if method == "wsvgd":
        svgd = WeightSpaceSVGD(model, optim, precondition=precondition)
        for _ in range(steps):
            svgd.step(*args)
        return svgd.get_named_particles()[problem.site]
    if average:
        optim = Averaged(optim)
    options = kivi_options if method == "kivi" and kivi_options else {}
    build = DEFAULT_METHODS[method] if method in DEFAULT_METHODS else VARIANTS[method]
    guide, loss = build(model, precondition, **options)
    svi = SVI(model, guide, optim, loss)
    if call_guide_first:
        guide(*args)
    for _ in range(steps):
        svi.step(*args)
    with optim.averaged() if average else contextlib.nullcontext():
        return guide.sample_posterior(NUM_DRAWS)[problem.site]


def fit_compare(method, problem, steps, precondition):
    """One fit with ``compare``'s settings for the method (the registry's, same name)."""
    name = resolve_name(method)
    lr = COMPARE_METHODS[name].lr
    fitted, _ = compare_fit(
        name,
        problem.model,
        problem.args,
        {},
        steps,
        lr,
        problem.max_plate_nesting,
        False,
        precondition,
    )
    draws, _ = posterior_draws(
        fitted, problem.model, problem.args, {}, NUM_DRAWS, problem.max_plate_nesting
    )
    return draws[problem.site]


def run(
    methods,
    problems,
    steps,
    precondition,
    settings,
    seed,
    dtype,
    log=print,
    average=False,
    kivi_options=None,
    call_guide_first=False,
):
    rows = []
    for name in problems:
        for method in methods:
            torch.set_default_dtype(dtype)
            problem = exact_problem(name)
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            start = time.perf_counter()
            if settings == "defaults":
                draws = fit_default(
                    method,
                    problem,
                    steps,
                    precondition,
                    average=average,
                    kivi_options=kivi_options,
                    call_guide_first=call_guide_first,
                )
            else:
                draws = fit_compare(method, problem, steps, precondition)
            seconds = time.perf_counter() - start
            score = score_draws(draws, problem.posterior)
            row = {
                "problem": name,
                "method": method,
                "seconds": seconds,
                **score,
                "passes": passes(score),
            }
            rows.append(row)
            log(
                f"{name:15s} {method:6s} mean {score['mean_error']:.3f} sd "
                f"[{score['sd_ratio_min']:.3f}, {score['sd_ratio_max']:.3f}] corr "
                f"{score['correlation_error']:.3f} {'ok' if row['passes'] else 'FAIL'} "
                f"({seconds:.1f} s)"
            )
            sys.stdout.flush()
    return rows


def markdown(rows):
    lines = [
        "| problem | method | mean error | sd ratio | correlation error | passes | s |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['problem']} | {r['method']} | {r['mean_error']:.3f} | "
            f"{r['sd_ratio_min']:.3f}-{r['sd_ratio_max']:.3f} | {r['correlation_error']:.3f} | "
            f"{'yes' if r['passes'] else '**no**'} | {r['seconds']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    parser.add_argument("--problems", default=",".join(EXACT_PROBLEMS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--settings", choices=["defaults", "compare"], default="defaults")
    parser.add_argument("--no-precondition", dest="precondition", action="store_false")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument(
        "--average",
        action="store_true",
        help="defaults only: train with _averaging.Averaged(Adam) and draw from "
        "the guides' averaged parameters (wsvgd as without)",
    )
    parser.add_argument(
        "--kivi-stein-identity",
        choices=["affine", "mean", "none"],
        default=None,
        help="defaults only: KernelRatioELBO(stein_identity=...) for kivi (none: the paper's "
        "estimate; default: the loss's own default)",
    )
    parser.add_argument(
        "--call-guide-first",
        action="store_true",
        help="defaults only: call the guide on the model's arguments before the first step "
        "(it is then built outside the loss)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pyro.enable_validation(True)
    dtype = getattr(torch, args.dtype)
    # the commit of the code that runs, read before it runs
    record = provenance(__file__, argv, {k: v for k, v in vars(args).items() if k != "out"})
    # an old name (implicit) runs its method under its new name, with a FutureWarning
    methods = [resolve_name(m) for m in args.methods.split(",")]
    rows = run(
        methods,
        args.problems.split(","),
        args.steps,
        args.precondition,
        args.settings,
        args.seed,
        dtype,
        average=args.average,
        kivi_options=(
            None
            if args.kivi_stein_identity is None
            else {
                "stein_identity": {"none": None}.get(
                    args.kivi_stein_identity, args.kivi_stein_identity
                )
            }
        ),
        call_guide_first=args.call_guide_first,
    )
    print(markdown(rows))
    if args.out:
        record.update(date=time.strftime("%Y-%m-%d"), bar=BAR, rows=rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
