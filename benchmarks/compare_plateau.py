"""``compare`` on a built-in model at 1000 and 5000 steps, each guide trained with the
``plateau`` schedule (``_schedules.PlateauDecay``: Adam at the method's ``compare`` rate,
halved whenever the loss has stopped falling) instead of ``compare``'s fixed tenfold decay.
The issue's "longer training must not make a fit worse" with another schedule. With
``--baseline`` the same call also fits each method by name, i.e. with ``compare``'s own
schedule, scored against the same NUTS draws.

    python benchmarks/compare_plateau.py --methods stein_score,kivi,sivi,livi \\
        --out benchmarks/results/compare_plateau.md
"""

import argparse
import pathlib

import _provenance
import pyro
import torch
from _schedules import PlateauDecay
from pyro.infer import SVI

from pyro_implicit.diagnostics.compare import METHODS, compare
from pyro_implicit.models import load_model


def fit(model, name, steps, seed):
    """A guide of ``compare``'s method ``name``, trained under ``PlateauDecay``."""
    spec = METHODS[name]
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = PlateauDecay(pyro.optim.Adam({"lr": spec.lr}))
    guide, loss = spec.build(model.model, model.max_plate_nesting, precondition=True)
    svi = SVI(model.model, guide, optim, loss)
    for _ in range(steps):
        optim.record(svi.step(*model.args, **model.kwargs))
    first = next((h[0] for h in optim.history if h[2] < 1), None)
    return guide, first, optim.scale


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="stein_score,kivi,sivi,livi")
    parser.add_argument("--steps", default="1000,5000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="eight_schools", help="a built-in model")
    parser.add_argument(
        "--baseline", action="store_true", help="also each method with compare's schedule"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    record = _provenance.provenance(__file__, argv, vars(args))
    model = load_model(args.model)
    lines = [
        f"# `compare` on {args.model} with the plateau schedule",
        "",
        f"`{record['command']}` (commit {record['commit']}), float64, one thread, seed "
        f"{args.seed}. Each guide: `compare`'s builder and rate, Adam halved whenever the "
        "mean loss of 200 steps has not fallen by two standard errors from the 200 before "
        "(down to 1/20); scored by `compare` against its NUTS run (2 x 500 draws).",
    ]
    for steps in [int(s) for s in args.steps.split(",")]:
        fitted, notes = {}, []
        if args.baseline:
            fitted.update({name: name for name in args.methods.split(",")})
        for name in args.methods.split(","):
            guide, first, scale = fit(model, name, steps, args.seed)
            fitted[f"{name}-plateau"] = guide
            notes.append(f"{name}: first decay at step {first}, final rate x{scale:g}")
        table = compare(
            model.model,
            *model.args,
            methods=fitted,
            num_steps=steps,
            seed=args.seed,
            **model.kwargs,
        )
        lines += ["", f"## {steps} steps", "", "```", str(table).split("\nmean err:")[0], "```"]
        lines += ["", "; ".join(notes) + "."]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
