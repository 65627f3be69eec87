"""UCI regression benchmark (the Hernandez-Lobato & Adams 2015 protocol).

For every requested data set and split: load the split normalised with its training part,
fit a method, predict the test set, and report the test RMSE and the per-point test
log-likelihood in the ORIGINAL target units; then aggregate mean ± standard error over the
splits. One line per split is printed (and flushed) as it finishes, and the JSON file is
rewritten after every split, so a long run that stops early keeps what it did.

Examples::

    python benchmarks/uci.py --datasets boston,concrete --splits 0-4 --method map
    python benchmarks/uci.py --datasets boston --method map --smoke
    python benchmarks/uci.py --datasets all --method map --markdown

A method is a function ``fit_predict(split, config, seed, progress)`` registered in
:data:`METHODS`. It returns ``(f_samples_norm, noise_scale_norm)``: posterior samples of
the function values at the test inputs, shape ``(S, n_test)``, and the observation noise
standard deviation per sample, shape ``(S,)``, both in normalised units. The runner
computes the metrics, so every method is scored the same way.

Every method runs its paper's raw-space settings, pinned against the library's defaults:
``precondition=False`` for the guides and weight-space SVGD, KIVI's prior contrast
(``adaptive_contrast=False`` unless ``--set`` asks otherwise).

This file is the runner (command line, scoring, result files); the configuration is in
``uci_config.py`` and the methods in ``uci_methods.py``, both re-exported here. Method
names are the method registry's (``pyro_implicit.diagnostics.methods.resolve_name``), and
each result file records its command, commit, UTC time and versions (``_provenance.py``)
beside every split's own commit.
"""

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pyro
import torch
from _provenance import (  # noqa: F401
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    git_commit,
    utc_now,
    versions,
)

# the configuration and the methods live beside the runner; every name is re-exported here
from uci_config import (  # noqa: F401
    _FPOVI_OPTIONAL,
    _FPOVI_SMALL,
    _LIVI_OPTIONAL,
    _SMALL,
    COMMON,
    DEFAULTS,
    METHOD_DEFAULTS,
    METHOD_OPTIONAL_SETTINGS,
    OPTIONAL_SETTINGS,
    SMOKE,
    _fpovi_defaults,
    _livi_defaults,
    run_config,
)
from uci_methods import (  # noqa: F401
    KIVI_GENERATORS,
    METHODS,
    KIVIFit,
    _fit_particles,
    _fpovi_init,
    _fpovi_inputs,
    _gamma_precision_guide,
    _init_scaled,
    _kivi_site_options,
    build_kivi,
    fit_fsvgd,
    fit_kivi,
    fit_livi,
    fit_map,
    fit_wsvgd,
    make_model,
    noise_std,
    num_steps,
    optimizer,
    predict_kivi,
    train_minibatches,
)

from pyro_implicit.datasets import (
    UCI_DATASETS,
    gaussian_test_ll,
    load_uci,
    num_splits,
    rmse_original,
)
from pyro_implicit.diagnostics.methods import resolve_name

#: the checkout's commit, ``+`` if it has uncommitted changes (kept for old callers)
_git_commit = git_commit

# ----------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------


def parse_splits(text):
    """Parse a split selection: ``"all"``, ``"3"``, ``"0-19"``, ``"0,2,5-7"``.

    :param str text: the selection.
    :returns: sorted split indices, or ``None`` for all splits.
    :rtype: list[int] or None
    """
    if text.strip().lower() == "all":
        return None
    splits = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(p) for p in part.split("-"))
                if lo > hi:
                    raise ValueError
                splits.update(range(lo, hi + 1))
            else:
                splits.add(int(part))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid split selection {text!r}; use 'all', '3', '0-19' or '0,2,5-7'"
        ) from None
    if min(splits) < 0:
        raise argparse.ArgumentTypeError("split indices must be >= 0")
    return sorted(splits)


def _parse_datasets(text):
    if text.strip().lower() == "all":
        return list(UCI_DATASETS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in UCI_DATASETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown data set(s) {unknown}; choose from {', '.join(UCI_DATASETS)} or 'all'"
        )
    return names


def _parse_setting(text):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string such as activation=tanh


def build_parser():
    """The command-line parser of the runner.

    :rtype: argparse.ArgumentParser
    """
    p = argparse.ArgumentParser(
        description="UCI regression benchmark: test RMSE and log-likelihood, original units.",
    )
    p.add_argument(
        "--datasets",
        type=_parse_datasets,
        default=list(UCI_DATASETS),
        help="comma-separated names or 'all' (default): " + ",".join(UCI_DATASETS),
    )
    p.add_argument(
        "--splits",
        type=parse_splits,
        default=None,
        help="'all' (default), '0-19', '0,3,5-7'; splits a data set lacks are skipped",
    )
    # the registry's names (an old one, e.g. implicit for kivi, with a FutureWarning)
    p.add_argument("--method", type=resolve_name, choices=sorted(METHODS), default="map")
    p.add_argument("--epochs", type=int, default=None, help="override the per-data-set epochs")
    p.add_argument(
        "--set",
        dest="settings",
        type=_parse_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config entry (value parsed as JSON); a key the method does not read "
        "is refused (OPTIONAL_SETTINGS lists the ones outside the defaults)",
    )
    p.add_argument("--seed", type=int, default=0, help="base seed; split k uses seed + k")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny run for tests: split 0 only, 2 epochs, few samples",
    )
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON output (default benchmarks/results/uci_<method>[_smoke].json)",
    )
    p.add_argument("--markdown", action="store_true", help="print a Markdown table at the end")
    p.add_argument("--quiet", action="store_true", help="no progress lines from inside a fit")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the splits already in --out (same configuration) and run only the others",
    )
    return p


def _mean_se(values):
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return None, None
    se = float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else None
    return float(arr.mean()), se


def _finite_or_none(v):
    return v if v is not None and math.isfinite(v) else None


def _check_prediction(f, noise, split, method):
    if not torch.is_tensor(f) or f.dim() != 2 or f.shape[1] != split.n_test:
        shape = tuple(f.shape) if torch.is_tensor(f) else type(f).__name__
        raise ValueError(
            f"method {method!r} returned f_samples_norm of shape {shape}; expected "
            f"(S, {split.n_test})."
        )
    noise = torch.as_tensor(noise)
    if noise.numel() not in (1, f.shape[0]):
        raise ValueError(
            f"method {method!r} returned noise_scale_norm of shape {tuple(noise.shape)}; "
            f"expected ({f.shape[0]},)."
        )
    return f.detach(), noise.detach().reshape(-1)


def evaluate(f, noise, split):
    """Test RMSE and per-point log-likelihood, both in the original target units.

    :param torch.Tensor f: ``(S, n_test)`` function-value samples (normalised units).
    :param torch.Tensor noise: ``(S,)`` noise standard deviations (normalised units).
    :param pyro_implicit.datasets.UCISplit split: the data split.
    :returns: ``(rmse, ll)``; the RMSE uses the predictive mean ``f.mean(0)``.
    """
    rmse = rmse_original(f.mean(0), split.y_test, split.y_std)
    ll = gaussian_test_ll(f, noise.expand(f.shape[0]), split.y_test, split.y_std)
    return rmse, ll


def _fmt(mean, se, digits):
    """``mean ± se`` with ``digits`` decimals; ``n/a`` for a missing mean, no ``±`` part for
    a missing standard error (a single split)."""
    if mean is None:
        return "n/a"
    return f"{mean:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")


def markdown_table(results):
    """A Markdown table of a run: mean ± standard error over splits per data set.

    :param dict results: the dictionary returned by :func:`main`.
    :rtype: str
    """

    lines = [
        f"Method `{results['method']}`; `{results['command']}`",
        "",
        "| Data set | N train | Splits | Test RMSE | Test LL | s / split |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["datasets"].items():
        if not r["splits"]:
            continue
        secs = np.mean([s["seconds"] for s in r["splits"]])
        n_train = r["splits"][0]["n_train"]
        lines.append(
            f"| {name} | {n_train} | {len(r['splits'])} | {_fmt(r['rmse_mean'], r['rmse_se'], 3)}"
            f" | {_fmt(r['ll_mean'], r['ll_se'], 3)} | {secs:.1f} |"
        )
    return "\n".join(lines)


def _write_json(results, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)  # never leave a half-written file behind


def main(argv=None):
    """Run the benchmark.

    :param argv: command-line arguments (without the program name); ``None`` reads
        ``sys.argv``.
    :type argv: list[str] or None
    :returns: the results: config, command line, versions and, per data set, the per-split
        numbers and their mean and standard error (``None`` where undefined).
    :rtype: dict
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fit_predict = METHODS[args.method]
    out = args.out
    if out is None:
        suffix = "_smoke" if args.smoke else ""
        out = RESULTS_DIR / f"uci_{args.method}{suffix}.json"

    overrides = dict(args.settings)
    if args.smoke:
        overrides = {**SMOKE, **overrides}
    if args.epochs is not None:
        overrides["epochs"] = args.epochs
    # built before anything runs or is written, so a bad --set stops the run at once
    configs = {name: run_config(args.method, name, overrides) for name in args.datasets}

    results = {
        "method": args.method,
        "command": command_line(__file__, argv),
        "argv": argv,
        "seed": args.seed,
        "smoke": args.smoke,
        "dtype": args.dtype,
        "threads": args.threads,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "started_utc": utc_now(),
        "commit": git_commit(),  # of this invocation; each split records its own too
        "versions": versions(),
        "protocol": "standard splits; normalised with the training split; RMSE and per-point "
        "test log-likelihood in original units; mean and standard error over splits",
        "datasets": {},
    }
    previous = {}
    if args.resume and out.exists():
        previous = json.loads(out.read_text())
        for key in ("method", "seed", "dtype", "smoke"):
            if key in previous and previous[key] != results[key]:
                raise SystemExit(
                    f"--resume: {out} holds runs with {key}={previous[key]!r}, this run has "
                    f"{key}={results[key]!r}; use another --out"
                )
        results["datasets"] = previous.get("datasets", {})
        results["command"] = previous.get("command", results["command"])
        results["resumed"] = previous.get("resumed", []) + [results["started"]]
        results["started"] = previous.get("started", results["started"])
    t_start = time.perf_counter() - previous.get("total_seconds", 0.0)
    commit = results["commit"]
    for name in args.datasets:
        config = configs[name]
        available = num_splits(name)
        if args.splits is None:
            splits = [0] if args.smoke else list(range(available))
        else:
            splits = [k for k in args.splits if k < available]
            skipped = [k for k in args.splits if k >= available]
            if skipped:
                print(f"# {name}: has splits 0..{available - 1}; skipping {skipped}", flush=True)
        record = results["datasets"].get(name)
        if record is not None and record.get("config") != config:
            raise SystemExit(
                f"--resume: {out} holds {name} results made with another configuration "
                f"({record.get('config')}); use another --out"
            )
        if record is None:
            record = {"config": config, "splits": []}
        results["datasets"][name] = record
        done = {s["split"] for s in record["splits"]}
        for k in splits:
            if k in done:
                continue
            split = load_uci(name, k, dtype=dtype)
            seed = args.seed + k
            pyro.set_rng_seed(seed)

            def progress(message, _name=name, _k=k):
                if not args.quiet:
                    print(f"    {_name} split {_k}: {message}", flush=True)

            t0 = time.perf_counter()
            f, noise = fit_predict(split, dict(config), seed, progress)
            seconds = time.perf_counter() - t0
            f, noise = _check_prediction(f, noise, split, args.method)
            rmse, ll = evaluate(f, noise, split)
            record["splits"].append(
                {
                    "split": k,
                    "seed": seed,
                    "commit": commit,
                    "n_train": split.n_train,
                    "n_test": split.n_test,
                    "num_samples": f.shape[0],
                    "rmse": _finite_or_none(rmse),
                    "ll": _finite_or_none(ll),
                    "seconds": round(seconds, 3),
                }
            )
            print(
                f"{name:>8s}  split {k:2d}  rmse {rmse:9.4f}  ll {ll:9.4f}  {seconds:8.1f}s",
                flush=True,
            )
            if not (math.isfinite(rmse) and math.isfinite(ll)):
                print(
                    f"# {name} split {k} FAILED (non-finite metric): recorded, left out of "
                    "the means",
                    file=sys.stderr,
                    flush=True,
                )
            for metric in ("rmse", "ll"):
                mean, se = _mean_se([s[metric] for s in record["splits"]])
                record[f"{metric}_mean"], record[f"{metric}_se"] = mean, se
            record["splits"].sort(key=lambda s: s["split"])
            record["num_splits"] = len(record["splits"])
            results["total_seconds"] = round(time.perf_counter() - t_start, 1)
            _write_json(results, out)
        if record["splits"]:
            rmse_text = _fmt(record["rmse_mean"], record["rmse_se"], 4)
            ll_text = _fmt(record["ll_mean"], record["ll_se"], 4)
            print(
                f"{name:>8s}  mean over {len(record['splits'])} splits  rmse {rmse_text}  "
                f"ll {ll_text}",
                flush=True,
            )
    results["total_seconds"] = round(time.perf_counter() - t_start, 1)
    _write_json(results, out)
    results["out"] = str(out)
    if args.markdown:
        print(markdown_table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
