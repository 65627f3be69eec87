"""The preconditioner's own Gaussian on the stiff posteriors, scored against NUTS.

Every guide starts at the Gaussian :func:`pyro_implicit.latent.find_preconditioner`
returns, so its distance from the posterior is where each fit begins. This scores that
Gaussian (2000 draws) against the stiff benchmark's NUTS reference, built the way the
guides build it (the model's starting point from the same seeded stream), for each
``--vi-max-steps`` given: ``auto`` (the default rounds) and e.g. ``300`` (one decayed
300-step round per start, the search before the rounds)::

    python benchmarks/preconditioner_fit.py --models all --vi-max-steps auto,300 \\
        --markdown benchmarks/results/preconditioner_fit.md

and for each ``--vi-draws`` (draws per step of the Gaussian fit; ``auto``: the default)
and each ``--search-seeds`` (the search's own seed), with the Gaussian's ELBO on 20 000
common draws beside (higher is a better Gaussian by the KL the fit minimises)::

    python benchmarks/preconditioner_fit.py --models all --vi-draws 16,auto \\
        --search-seeds 0,1,2 --markdown benchmarks/results/preconditioner_draws.md

With ``--automvn-steps N,...`` each model also gets Pyro's ``AutoMultivariateNormal`` fitted
N steps as ``stiff.py`` fits it (``Trace_ELBO`` with 8 vectorised draws, ``Adam(0.01)``;
beyond 2000 steps ``ClippedAdam`` decaying to 1% of that rate), scored the same way: a long
run is the Gaussian optimum the search's fit aims at.

One torch thread, float64, as ``stiff.py``.
"""

import argparse
import itertools
import pathlib
import time

import _provenance
import pyro
import stiff
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal

from pyro_implicit import SemiImplicitGuide
from pyro_implicit.diagnostics.metrics import compare_samples
from pyro_implicit.latent import LatentSpace, Preconditioner, _elbo_draws, find_preconditioner


def _scored(space, reference, loc, scale_tril, args, kwargs, num_draws):
    """Joint metrics against NUTS of ``N(loc, scale_tril scale_tril^T)`` (``num_draws``
    draws) and its ELBO on 20 000 common draws."""
    gaussian = Preconditioner(loc, scale_tril=scale_tril)
    z = torch.randn(num_draws, space.latent_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        values = space.unpack(gaussian.unwhiten(z.to(loc)))
    draws = {k: values[k].reshape((num_draws,) + reference[k].shape[1:]) for k in reference}
    joint = compare_samples(draws, reference, sites=list(reference))["joint"]
    eps = torch.randn(20000, space.latent_dim, generator=torch.Generator().manual_seed(2))
    elbo = _elbo_draws(space, gaussian, eps.to(loc), args, kwargs).mean().item()
    return dict(joint, elbo=elbo)


def score_automvn(name, steps, seed=0, num_draws=2000):
    """:func:`score`'s dict for ``AutoMultivariateNormal`` after ``steps`` steps."""
    model, args, kwargs, mpn = stiff.MODELS[name]()
    reference, _ = stiff.load_reference(name)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = AutoMultivariateNormal(model)
    if steps <= 2000:
        optim = pyro.optim.Adam({"lr": 0.01})
    else:
        optim = pyro.optim.ClippedAdam({"lr": 0.01, "lrd": 0.01 ** (1.0 / steps)})
    loss = Trace_ELBO(num_particles=8, vectorize_particles=True, max_plate_nesting=mpn)
    svi = SVI(model, guide, optim, loss)
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*args, **kwargs)
    seconds = time.perf_counter() - start
    posterior = guide.get_posterior(*args, **kwargs)
    space = LatentSpace.from_model(model, args, kwargs, max_plate_nesting=mpn)
    loc, tril = posterior.loc.detach(), posterior.scale_tril.detach()
    row = _scored(space, reference, loc, tril, args, kwargs, num_draws)
    pyro.clear_param_store()
    return dict(row, source="automvn", vi_steps=steps, seconds=seconds)


def score(
    name, vi_max_steps, seed=0, num_draws=2000, vi_draws=None, search_seed=0, vi_estimator=None
):
    """``dict`` of the Gaussian's joint metrics against NUTS, its ELBO (20 000 draws), its
    source, the Gaussian fit's steps and the search's seconds."""
    model, args, kwargs, _ = stiff.MODELS[name]()
    reference, _ = stiff.load_reference(name)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = SemiImplicitGuide(model, precondition=False)
    guide(*args, **kwargs)  # builds the packed space and the starting point
    space = guide.latent_space(*args, **kwargs)
    start = time.perf_counter()
    found = find_preconditioner(
        space,
        guide._init_loc(),
        args,
        kwargs,
        vi_max_steps=vi_max_steps,
        seed=search_seed,
        **({"vi_draws": vi_draws} if vi_draws else {}),
        **({"vi_estimator": vi_estimator} if vi_estimator else {}),
    )
    seconds = time.perf_counter() - start
    tril = found.scale_tril if found.scale_tril is not None else torch.diag(found.scale)
    row = _scored(space, reference, found.loc, tril, args, kwargs, num_draws)
    return dict(
        row,
        source=found.source,
        vi_steps=found.diagnostics.get("gaussian_vi_steps", 0),
        seconds=seconds,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all")
    parser.add_argument("--vi-max-steps", default="auto,300")
    parser.add_argument("--vi-draws", default="auto")
    parser.add_argument("--search-seeds", default="0")
    parser.add_argument(
        "--vi-estimators", default="", help="comma-separated find_preconditioner vi_estimator"
    )
    parser.add_argument("--automvn-steps", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    models = stiff._choices(args.models, stiff.MODELS, "models")  # names checked, or all
    budgets = [None if b == "auto" else int(b) for b in args.vi_max_steps.split(",")]
    draws = [None if d == "auto" else int(d) for d in args.vi_draws.split(",")]
    search_seeds = [int(s) for s in args.search_seeds.split(",")]
    automvn_steps = [int(n) for n in args.automvn_steps.split(",") if n.strip()]
    estimators = [e for e in args.vi_estimators.split(",") if e] or [None]
    lines = [
        "# The preconditioner's Gaussian against NUTS",
        "",
        f"`{_provenance.command_line(__file__, argv)}` (commit {_provenance.git_commit()}, "
        f"{_provenance.utc_now()}, one thread, float64, seed {args.seed}). Max mean error "
        "in NUTS sds, sd ratio range and energy distance of 2000 draws of the Gaussian "
        "every guide starts at; `ELBO`: its ELBO on 20 000 draws (the same for every row "
        "of a model); `vi steps`: the Gaussian fit's steps from the start it "
        "kept (0: the Laplace passed its check); `s`: the search's seconds.",
        "",
        "| model | vi_max_steps | vi_draws | estimator | search seed | source | mean err | "
        "sd ratio | energy | ELBO | vi steps | s |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in models:
        for budget, vi_draws, estimator, search_seed in itertools.product(
            budgets, draws, estimators, search_seeds
        ):
            row = score(
                name,
                budget,
                seed=args.seed,
                vi_draws=vi_draws,
                search_seed=search_seed,
                vi_estimator=estimator,
            )
            label = "auto" if budget is None else str(budget)
            line = (
                f"| {name} | {label} | {vi_draws or 'auto'} | {estimator or 'default'} | "
                f"{search_seed} | {row['source']} | "
                f"{row['mean_error_max']:.3f} | "
                f"{row['sd_ratio_min']:.2f}-{row['sd_ratio_max']:.2f} | "
                f"{row['energy_distance']:.4f} | {row['elbo']:.3f} | {row['vi_steps']} | "
                f"{row['seconds']:.1f} |"
            )
            print(line, flush=True)
            lines.append(line)
        for steps in automvn_steps:
            row = score_automvn(name, steps, seed=args.seed)
            line = (
                f"| {name} | - | - | - | - | automvn, {steps} steps | "
                f"{row['mean_error_max']:.3f} | "
                f"{row['sd_ratio_min']:.2f}-{row['sd_ratio_max']:.2f} | "
                f"{row['energy_distance']:.4f} | {row['elbo']:.3f} | - | {row['seconds']:.1f} |"
            )
            print(line, flush=True)
            lines.append(line)
    pathlib.Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
