"""Command line: ``python -m pyro_implicit`` (or the ``pyro-implicit`` script).

With no arguments it runs the default job: the eight-schools model fitted with
``ImplicitGuide`` + ``KernelRatioELBO``, ``AutoNormal`` and ``AutoMultivariateNormal``,
each compared with NUTS (2 chains), in about a minute on two CPU cores. The same job with
other settings::

    python -m pyro_implicit compare --model eight_schools --methods implicit,autonormal \\
        --steps 2000 --seed 0 --nuts-samples 500

``--smoke`` caps every count to a tiny run (for tests). The report goes to stdout,
progress to stderr.
"""

import argparse
import sys
import time

import torch

from . import __version__
from .diagnostics.compare import METHODS, compare
from .models import BUILTIN_MODELS, load_model

__all__ = ["main"]

#: defaults of the ``compare`` command (the default job); tuned to take about a minute
DEFAULTS = {
    "model": "eight_schools",
    "methods": "implicit,sivi,autonormal,automvn",
    "steps": 1000,
    "samples": 2000,
    "nuts_samples": 500,
    "nuts_warmup": 300,
    "nuts_chains": 2,
}

#: upper bounds applied by ``--smoke``
SMOKE_CAPS = {"steps": 10, "samples": 100, "nuts_samples": 20, "nuts_warmup": 20}


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser():
    """The argument parser (sub-command ``compare``).

    :rtype: argparse.ArgumentParser
    """
    parser = argparse.ArgumentParser(
        prog="python -m pyro_implicit",
        description="Fit variational posteriors to a built-in Pyro model and compare each "
        "with NUTS. Without arguments: the default job (eight schools, all methods).",
    )
    parser.add_argument("--version", action="version", version=f"pyro_implicit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{compare}")
    p = sub.add_parser("compare", help="compare methods with NUTS on one model (default)",
                       description="Compare variational methods with NUTS on one model.")
    p.add_argument("--model", default=DEFAULTS["model"], choices=list(BUILTIN_MODELS),
                   help="built-in model (default %(default)s)")
    p.add_argument("--methods", default=DEFAULTS["methods"],
                   help=f"comma-separated, from: {', '.join(METHODS)} (default all)")
    p.add_argument("--steps", type=_positive_int, default=DEFAULTS["steps"],
                   help="SVI steps per method (default %(default)s)")
    p.add_argument("--samples", type=_positive_int, default=DEFAULTS["samples"],
                   help="posterior draws per method (default %(default)s)")
    p.add_argument("--lr", type=float, default=None,
                   help="initial learning rate of every method (default: per method)")
    p.add_argument("--nuts-samples", type=_positive_int, default=DEFAULTS["nuts_samples"],
                   help="NUTS draws per chain (default %(default)s)")
    p.add_argument("--nuts-warmup", type=_positive_int, default=DEFAULTS["nuts_warmup"],
                   help="NUTS warmup steps per chain (default %(default)s)")
    p.add_argument("--nuts-chains", type=_positive_int, default=DEFAULTS["nuts_chains"],
                   help="NUTS chains, run one after another (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed (default %(default)s)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="torch threads (default %(default)s: small models run fastest on one)")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                   help="default torch dtype (default %(default)s)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run for tests: caps " + ", ".join(
                       f"--{k.replace('_', '-')} at {v}" for k, v in SMOKE_CAPS.items()))
    return parser


def _parse(argv):
    parser = build_parser()
    compare_parser = parser._subparsers._group_actions[0].choices["compare"]
    argv = list(sys.argv[1:] if argv is None else argv)
    # `compare` is the default command, so its options also work without it.
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["compare"] + argv
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        compare_parser.error(
            f"unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose "
            f"from: {', '.join(METHODS)}"
        )
    if len(set(methods)) != len(methods):
        compare_parser.error(f"--methods lists a method twice: {args.methods}")
    args.methods = methods
    if args.smoke:
        for key, cap in SMOKE_CAPS.items():
            setattr(args, key, min(getattr(args, key), cap))
    return args


def _header(args, spec):
    width = max(len(m) for m in args.methods)
    lines = [
        f"pyro_implicit {__version__}: variational posteriors compared with NUTS",
        f"model:    {spec.name}: {spec.description}",
        "methods:  " + f"\n{'':10}".join(
            f"{m.ljust(width)}  {METHODS[m].description}" for m in args.methods
        ),
        f"settings: {args.steps} SVI steps per method (ClippedAdam, lr decayed 10x over the "
        f"run), {args.samples} posterior draws per method;",
        f"{'':10}NUTS {args.nuts_chains} chain(s) x {args.nuts_samples} draws after "
        f"{args.nuts_warmup} warmup; seed {args.seed}; {args.dtype}; "
        f"{args.threads} thread(s)" + ("; SMOKE RUN" if args.smoke else ""),
    ]
    return "\n".join(lines)


def main(argv=None):
    """Run the command line.

    :param list argv: arguments without the program name (default ``sys.argv[1:]``);
        empty runs the default job.
    :return: exit code 0 (bad arguments exit with code 2 through ``argparse``).
    :rtype: int
    """
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        spec = load_model(args.model)  # data in the dtype just set
        print(_header(args, spec), flush=True)
        start = time.perf_counter()
        result = compare(
            spec.model,
            *spec.args,
            methods=args.methods,
            num_steps=args.steps,
            num_samples=args.samples,
            nuts_kwargs={
                "num_samples": args.nuts_samples,
                "warmup_steps": args.nuts_warmup,
                "num_chains": args.nuts_chains,
            },
            seed=args.seed,
            max_plate_nesting=spec.max_plate_nesting,
            progress=not args.quiet,
            lr=args.lr,
            **spec.kwargs,
        )
        total = time.perf_counter() - start
    finally:
        torch.set_default_dtype(old_dtype)
    print()
    print(result.to_markdown() if args.markdown else result.table())
    print(f"total {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
