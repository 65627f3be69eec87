"""Command line: ``python -m pyro_implicit`` (or the ``pyro-implicit`` script).

With no arguments it runs the default job: the eight-schools model fitted with
``ImplicitGuide`` + ``KernelRatioELBO``, ``ImplicitGuide`` + ``SteinScoreELBO``,
``SemiImplicitGuide`` + ``SIVI_ELBO``, ``AutoNormal`` and ``AutoMultivariateNormal``, each
compared with NUTS (2 chains), in about a minute on two CPU cores. The same job with
other settings::

    python -m pyro_implicit compare --model eight_schools --methods kivi,autonormal \\
        --steps 2000 --seed 0 --nuts-samples 500 --report out/

``--model`` takes a built-in model (:data:`pyro_implicit.models.BUILTIN_MODELS`) or a
Python file of your own, ``path/to/file.py:NAME`` (``:NAME`` defaults to ``:model``).
The file is run as a module and ``NAME`` must be either

* a :class:`~pyro_implicit.models.BuiltinModel` (the model with its data), or
* a Pyro model (a callable), with its data in the module-level names ``args`` (a tuple
  of positional arguments, default ``()``), ``kwargs`` (a dict of keyword arguments,
  default ``{}``) and optionally ``max_plate_nesting`` (an int; guessed from one model
  run if absent).

For example ``my_model.py``::

    import pyro, pyro.distributions as dist, torch

    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        with pyro.plate("data", len(y)):
            pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)

    args = (torch.tensor([1.2, 0.4, 2.2]),)

and ``python -m pyro_implicit compare --model my_model.py:model``. The file is run after
``--dtype`` is set, so tensors it builds get that dtype. The model must have continuous
latent sites only (NUTS is the reference) and broadcast over an outer sample plate.

``--methods all`` runs every method of :data:`~pyro_implicit.diagnostics.compare.METHODS`
(an old name such as ``implicit``, now ``kivi``, still works for a release, with a warning).
Every row carries the checks that need no NUTS: the kernel Stein discrepancy of its
draws (NUTS's row too, as the yardstick) and, for guides with a log-density, PSIS k-hat;
``--no-nuts`` skips NUTS (for models where it is too slow) and reports those alone, and
``--no-diagnostics`` leaves them out.
``--smoke`` caps every count to a tiny run (for tests). The table goes to stdout,
progress to stderr. ``--report DIR`` also writes ``comparison.json`` (every number, loss
traces included), ``table.md``, ``loo.csv`` (``az.compare`` of the ArviZ exports),
``losses.png``, ``pairs_<method>.png`` and, for a BNN regression model,
``predictive.png``. Bad input (an unknown method or model, a file without the model, a
model with discrete latent sites) ends with a message on stderr and exit code 2.
"""

import argparse
import importlib.util
import math
import os
import sys
import time
import warnings

import torch
from pyro import poutine

from . import __version__
from .diagnostics.compare import METHODS, compare, guess_max_plate_nesting
from .diagnostics.importance import K_HAT_THRESHOLD, UnreliableFitWarning
from .diagnostics.methods import resolve_name
from .diagnostics.nuts import check_continuous_latents
from .models import BUILTIN_MODELS, BuiltinModel, load_model
from .report import write_report

__all__ = ["build_parser", "load_user_model", "main"]

#: defaults of the ``compare`` command (the default job); tuned to take about a minute
DEFAULTS = {
    "model": "eight_schools",
    "methods": "kivi,stein_score,sivi,autonormal,automvn",
    "steps": 1000,
    "samples": 2000,
    "nuts_samples": 500,
    "nuts_warmup": 300,
    "nuts_chains": 2,
}

#: upper bounds applied by ``--smoke``
SMOKE_CAPS = {"steps": 10, "samples": 100, "nuts_samples": 20, "nuts_warmup": 20}

#: what a user file must expose (also the message when it does not)
USER_FILE_CONVENTION = (
    "NAME in path/to/file.py:NAME (default 'model') must be a pyro_implicit.models."
    "BuiltinModel, or a Pyro model (a callable) with its data in the module-level names "
    "'args' (tuple), 'kwargs' (dict) and optionally 'max_plate_nesting' (int)"
)


class InputError(Exception):
    """Bad input on the command line: reported on stderr with exit code 2."""


def _int_at_least(low, high=None):
    """An argparse type: an integer in ``[low, high]``."""
    what = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser():
    """The argument parser (sub-command ``compare``).

    :rtype: argparse.ArgumentParser
    """
    parser = argparse.ArgumentParser(
        prog="pyro-implicit",
        description="Fit posterior approximations to a Pyro model and compare each with "
        "NUTS. Without arguments: the default job (eight schools, five methods).",
    )
    parser.add_argument("--version", action="version", version=f"pyro_implicit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{compare}")
    p = sub.add_parser(
        "compare",
        help="compare methods with NUTS on one model (default)",
        description="Compare posterior approximations with NUTS on one model.",
        epilog="User files: " + USER_FILE_CONVENTION + ".",
    )
    p.add_argument(
        "--model",
        default=DEFAULTS["model"],
        help=f"a built-in model ({', '.join(BUILTIN_MODELS)}) or a file "
        "path/to/file.py[:NAME] (default %(default)s)",
    )
    p.add_argument(
        "--methods",
        default=DEFAULTS["methods"],
        help=f"comma-separated, from: {', '.join(METHODS)}; or 'all' (default %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=DEFAULTS["steps"],
        help="optimisation steps per method (default %(default)s)",
    )
    p.add_argument(
        "--samples",
        type=_int_at_least(2),
        default=DEFAULTS["samples"],
        help="posterior draws per guide, at least 2 (default %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="initial learning rate of every method (default: per method)",
    )
    p.add_argument(
        "--no-precondition",
        dest="precondition",
        action="store_false",
        help="fit the library's methods in the raw unconstrained space (the "
        "papers' setting) instead of their automatic preconditioner's "
        "whitened coordinates",
    )
    p.add_argument(
        "--no-nuts",
        dest="nuts",
        action="store_false",
        help="run no NUTS reference (for models where it is too slow): the table "
        "then shows the Stein discrepancy (KSD) and PSIS k-hat only",
    )
    p.add_argument(
        "--no-diagnostics",
        dest="diagnostics",
        action="store_false",
        help="leave out the KSD and k-hat columns (they cost a model run per "
        "row, and k-hat 1000 guide draws)",
    )
    p.add_argument(
        "--nuts-samples",
        type=_int_at_least(4),
        default=DEFAULTS["nuts_samples"],
        help="NUTS draws per chain, at least 4 (default %(default)s)",
    )
    p.add_argument(
        "--nuts-warmup",
        type=_int_at_least(0),
        default=DEFAULTS["nuts_warmup"],
        help="NUTS warmup steps per chain (default %(default)s)",
    )
    p.add_argument(
        "--nuts-chains",
        type=_positive_int,
        default=DEFAULTS["nuts_chains"],
        help="NUTS chains, run one after another (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=_int_at_least(0, 2**32 - 1), default=0, help="seed (default %(default)s)"
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="torch threads (default %(default)s: small models run fastest on one)",
    )
    p.add_argument(
        "--dtype",
        choices=["float64", "float32"],
        default="float64",
        help="default torch dtype (default %(default)s)",
    )
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument(
        "--report",
        metavar="DIR",
        default=None,
        help="write plots, table.md, loo.csv and comparison.json (every number) to DIR",
    )
    p.add_argument(
        "--plot-sites",
        default=None,
        help="comma-separated sites or coordinates (e.g. mu,tau,theta[0]) for the "
        "pair plots of --report (default: the first six coordinates)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny run for tests: caps "
        + ", ".join(f"--{k.replace('_', '-')} at {v}" for k, v in SMOKE_CAPS.items()),
    )
    return parser


def _parse(argv):
    parser = build_parser()
    compare_parser = parser._subparsers._group_actions[0].choices["compare"]
    argv = list(sys.argv[1:] if argv is None else argv)
    # `compare` is the default command, so its options also work without it.
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["compare"] + argv
    args = parser.parse_args(argv)
    if args.methods.strip() == "all":
        methods = list(METHODS)
    else:
        # an old name (e.g. implicit for kivi) runs its method, with a FutureWarning
        methods = [resolve_name(m.strip()) for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        compare_parser.error(
            f"unknown method(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose "
            f"from: {', '.join(METHODS)} (or 'all')"
        )
    if len(set(methods)) != len(methods):
        compare_parser.error(f"--methods lists a method twice: {args.methods}")
    args.methods = methods
    if args.model not in BUILTIN_MODELS and ".py" not in args.model:
        compare_parser.error(
            f"unknown model {args.model!r}; choose a built-in model ("
            f"{', '.join(BUILTIN_MODELS)}) or a file path/to/file.py:NAME"
        )
    if args.smoke:
        for key, cap in SMOKE_CAPS.items():
            setattr(args, key, min(getattr(args, key), cap))
    return args


def load_user_model(spec):
    """The model of a user file ``path/to/file.py[:NAME]`` (see the module docstring for
    the convention).

    :param str spec: the file, optionally followed by ``:NAME`` (default ``model``).
    :rtype: ~pyro_implicit.models.BuiltinModel
    :raises InputError: if the file is missing, fails to run, or does not expose a
        model as the convention says.
    """
    path, name = spec, "model"
    if not spec.endswith(".py"):
        path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise InputError(f"model file {spec!r} is not of the form path/to/file.py:NAME")
    if not os.path.isfile(path):
        raise InputError(f"model file {path!r} does not exist")
    module_name = "_pyro_implicit_user_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    # the file may import modules next to it, and dataclasses in it need sys.modules
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise InputError(f"running {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    if not hasattr(module, name):
        raise InputError(f"{path} defines no {name!r}: {USER_FILE_CONVENTION}")
    obj = getattr(module, name)
    if isinstance(obj, BuiltinModel):
        return obj
    if not callable(obj):
        raise InputError(
            f"{path}:{name} is a {type(obj).__name__}, not a model: {USER_FILE_CONVENTION}"
        )
    model_args = getattr(module, "args", ())
    model_kwargs = getattr(module, "kwargs", {})
    if not isinstance(model_args, (tuple, list)) or not isinstance(model_kwargs, dict):
        raise InputError(
            f"{path}: 'args' must be a tuple and 'kwargs' a dict: {USER_FILE_CONVENTION}"
        )
    mpn = getattr(module, "max_plate_nesting", None)
    return BuiltinModel(
        name=f"{os.path.basename(path)}:{name}",
        model=obj,
        args=tuple(model_args),
        kwargs=dict(model_kwargs),
        max_plate_nesting=mpn,
        description=next(iter((obj.__doc__ or "").strip().splitlines()), "user model"),
    )


def _load(args):
    """The model to compare, checked: continuous latents, runs once."""
    if args.model in BUILTIN_MODELS:
        try:
            spec = load_model(args.model)
        except FileNotFoundError as e:
            raise InputError(f"model {args.model!r} needs its data: {e}") from e
    else:
        spec = load_user_model(args.model)
    try:
        check_continuous_latents(spec.model, *spec.args, **spec.kwargs)
        mpn = spec.max_plate_nesting
        if mpn is None:
            mpn = guess_max_plate_nesting(spec.model, *spec.args, **spec.kwargs)
    except ValueError as e:
        raise InputError(str(e)) from e
    except Exception as e:
        raise InputError(f"running the model {spec.name} failed: {type(e).__name__}: {e}") from e
    if getattr(args, "plot_sites", None):
        _check_plot_sites(spec, args.plot_sites.split(","))
    return spec, mpn


def _check_plot_sites(spec, coords):
    """Refuse unknown ``--plot-sites`` before any fit (a prior draw gives the names)."""
    from .diagnostics.plots import select_coordinates

    trace = poutine.trace(spec.model).get_trace(*spec.args, **spec.kwargs)
    draw = {
        name: site["value"].detach().unsqueeze(0) for name, site in trace.iter_stochastic_nodes()
    }
    try:
        select_coordinates(draw, coords)
    except ValueError as e:
        raise InputError(f"--plot-sites: {e}") from e


def _header(args, spec):
    width = max(len(m) for m in args.methods)
    reference = (
        f"NUTS {args.nuts_chains} chain(s) x {args.nuts_samples} draws after "
        f"{args.nuts_warmup} warmup"
        if args.nuts
        else "no NUTS reference"
    )
    lines = [
        f"pyro_implicit {__version__}: posterior approximations compared with NUTS",
        f"model:    {spec.name}: {spec.description}",
        "methods:  "
        + f"\n{'':10}".join(f"{m.ljust(width)}  {METHODS[m].description}" for m in args.methods),
        f"settings: {args.steps} steps per method (ClippedAdam, lr decayed 10x over the "
        f"run), {args.samples} posterior draws per guide;",
        f"{'':10}{reference}; seed {args.seed}; {args.dtype}; "
        f"{args.threads} thread(s)" + ("; SMOKE RUN" if args.smoke else ""),
    ]
    return "\n".join(lines)


def _fail(message):
    print(f"pyro-implicit compare: error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv=None):
    """Run the command line.

    :param list argv: arguments without the program name (default ``sys.argv[1:]``);
        empty runs the default job.
    :return: exit code: 0, or 2 for bad input (``argparse`` errors exit with 2 too).
    :rtype: int
    """
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        try:
            spec, mpn = _load(args)  # data in the dtype just set
        except InputError as e:
            return _fail(str(e))
        header = _header(args, spec)
        print(header, flush=True)
        start = time.perf_counter()
        with warnings.catch_warnings():
            # said once below the table, in the table's words
            warnings.simplefilter("ignore", UnreliableFitWarning)
            result = _compare(args, spec, mpn)
        total = time.perf_counter() - start
        print()
        print(result.to_markdown() if args.markdown else result.table())
        unreliable = [
            f"{r['method']} ({r['k_hat']:.2f})"
            for r in result.rows()
            if r["k_hat"] > K_HAT_THRESHOLD
        ]
        if unreliable:
            print(
                f"note: PSIS k-hat > {K_HAT_THRESHOLD} for {', '.join(unreliable)}: "
                "importance weights cannot correct these guides; read their rows with care"
            )
        print(f"total {total:.1f} s", flush=True)
        if args.report:
            written = write_report(args.report, result, spec, mpn, args, header, total)
            if not args.quiet:
                print(f"report: {len(written)} files in {args.report}", file=sys.stderr)
    finally:
        torch.set_default_dtype(old_dtype)
    return 0


def _compare(args, spec, mpn):
    """:func:`compare` with the command line's settings."""
    return compare(
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
        max_plate_nesting=mpn,
        progress=not args.quiet,
        lr=args.lr,
        precondition=args.precondition,
        nuts=None if args.nuts else False,
        diagnostics=args.diagnostics,
        model_kwargs=spec.kwargs,
    )


if __name__ == "__main__":
    sys.exit(main())
