"""One of ``compare``'s methods trained for many steps, scored every few hundred: which
coordinate moves when a longer run ends worse ("longer training must not make a fit worse").

The method is built and trained exactly as ``compare`` trains it (its builder and rate,
``ClippedAdam`` decaying tenfold over ``--steps``); every ``--every`` steps 2000 draws are
scored against one NUTS run (``run_nuts``: ``--nuts-samples`` draws after
``--nuts-warmup``, one chain, seed ``--seed``) site by site: the sd ratio and the mean
error in NUTS sds of each latent coordinate.

    python benchmarks/compare_trajectory.py --method kivi --model eight_schools \\
        --out benchmarks/results/kivi_trajectory_eight_schools.md
"""

import argparse

import _provenance
import pyro
import torch
from pyro.infer import SVI

from pyro_implicit.diagnostics.compare import METHODS
from pyro_implicit.diagnostics.metrics import flatten_samples, sd_ratio
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.models import load_model


def _setting(value):
    """A ``--loss-set`` value: ``none``, a number, or a string."""
    if value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        return value


def add_loss_set_argument(parser):
    """The ``--loss-set NAME=VALUE`` option (repeatable) of the trajectory scripts."""
    parser.add_argument(
        "--loss-set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set an attribute of the built loss or of one of its parts (a number, none or a "
        "string), e.g. stein_identity=mean or kernel.bandwidth_factor=0.5",
    )


def apply_loss_settings(loss, settings):
    """Apply ``--loss-set`` items to ``loss``: a dotted name reaches into its parts
    (``kernel.bandwidth_factor``: the loss's kernel's), and a count stays an int."""
    for setting in settings:
        name, value = setting.split("=", 1)
        *path, attribute = name.split(".")
        owner = loss
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, attribute):
            raise SystemExit(f"--loss-set: {type(owner).__name__} has no attribute {attribute!r}")
        value = _setting(value)
        if isinstance(getattr(owner, attribute), int) and isinstance(value, float):
            value = int(value)
        setattr(owner, attribute, value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="kivi")
    parser.add_argument("--model", default="eight_schools", help="a built-in model")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--nuts-samples", type=int, default=1000)
    parser.add_argument("--nuts-warmup", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    add_loss_set_argument(parser)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    record = _provenance.provenance(__file__, argv, vars(args))
    model = load_model(args.model)
    call = (model.model, model.args, model.kwargs)

    reference = run_nuts(
        call[0],
        *call[1],
        num_samples=args.nuts_samples,
        warmup_steps=args.nuts_warmup,
        num_chains=1,
        seed=args.seed,
        progress_bar=False,
        **call[2],
    ).samples
    names = sorted(reference)
    ref, labels = flatten_samples({name: reference[name] for name in names})

    spec = METHODS[args.method]
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    optim = pyro.optim.ClippedAdam({"lr": spec.lr, "lrd": 0.1 ** (1.0 / args.steps)})
    guide, loss = spec.build(call[0], model.max_plate_nesting, precondition=True)
    apply_loss_settings(loss, args.loss_set)
    svi = SVI(call[0], guide, optim, loss)
    rows = []
    for step in range(1, args.steps + 1):
        svi.step(*call[1], **call[2])
        if step % args.every == 0:
            with torch.no_grad():
                sampled = guide.sample_posterior(2000)
            draws, _ = flatten_samples({name: sampled[name] for name in names})
            ratio = sd_ratio(draws, ref)
            error = (draws.mean(0) - ref.mean(0)) / ref.std(0)  # signed: which way it moved
            rows.append((step, ratio, error))
            print(f"step {step}: sd ratios {[round(r, 2) for r in ratio.tolist()]}", flush=True)

    lines = [
        f"# `{args.method}` on {args.model}, scored every {args.every} steps",
        "",
        f"`{record['command']}` (commit {record['commit']}, {record['utc']}), float64, one "
        f"thread, seed {args.seed}: `compare`'s builder and rate for `{args.method}`"
        + "".join(f", `loss.{setting}`" for setting in args.loss_set)
        + ", "
        f"ClippedAdam decaying tenfold over {args.steps} steps; 2000 draws against one NUTS "
        f"chain of {args.nuts_samples} draws after {args.nuts_warmup}. Cells: sd ratio "
        "(mean error in NUTS sds) per coordinate.",
        "",
        "| step | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for step, ratio, error in rows:
        cells = [f"{r:.2f} ({e:+.2f})" for r, e in zip(ratio.tolist(), error.tolist(), strict=True)]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
