"""Merge UCI result files (from ``benchmarks/uci.py``) into one Markdown report, with the
paper's numbers beside ours.

Usage::

    python benchmarks/uci_report.py benchmarks/results/uci_kivi_part*.json \
        --title "KIVI (ImplicitGuide + KernelRatioELBO)" --paper kivi \
        --out benchmarks/results/uci.md

With ``--section NAME`` the report replaces only the part of ``--out`` between the lines
``<!-- uci_report NAME -->`` and ``<!-- /uci_report NAME -->`` (appended if absent, heading
one level down), so that prose written around the tables survives a regeneration;
``benchmarks/make_uci_reports.sh`` regenerates every UCI table this way. The splits of a
data set spread over several files (runs in parallel processes) are merged into one row.

Every row's splits keep the commit they were run at (files from before the runner recorded
commits show ``not recorded``). A report whose splits come from more than one commit is
refused unless ``--mixed-commits`` is given, and then its first paragraph names the commits
and which data sets they ran.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np

#: published numbers: (RMSE mean, RMSE sd, test LL mean, test LL sd) per data set
PAPERS = {
    # Shi, Sun & Zhu (2018), Table 1, KIVI column; "±" is a standard deviation over runs
    "kivi": {
        "boston": (2.798, 0.173, -2.527, 0.102),
        "concrete": (4.702, 0.116, -3.054, 0.043),
        "energy": (0.467, 0.015, -1.298, 0.005),
        "kin8nm": (0.075, 0.001, 1.162, 0.008),
        "naval": (0.001, 0.000, 5.501, 0.121),
        "power": (3.976, 0.037, -2.794, 0.009),
        "protein": (4.255, 0.019, -2.868, 0.005),
        "wine": (0.629, 0.008, -0.958, 0.015),
        "yacht": (0.737, 0.068, -2.123, 0.010),
    },
    # Wang, Ren, Zhu & Zhang (2019), Tables 4 (RMSE) and 5 (NLL), FS SVGD column; the paper
    # reports NLL, so LL = -NLL; "±" is a standard error over splits (authors' code); no
    # energy row in the paper
    "fsvgd": {
        "boston": (2.61, 0.12, -2.47, 0.08),
        "concrete": (4.73, 0.13, -2.96, 0.04),
        "kin8nm": (0.07, 0.00, 1.24, 0.00),
        "naval": (0.00, 0.00, 5.92, 0.03),
        "power": (3.80, 0.03, -2.76, 0.01),
        "protein": (3.96, 0.03, -2.79, 0.01),
        "wine": (0.61, 0.01, -0.92, 0.02),
        "yacht": (0.63, 0.06, -1.01, 0.06),
    },
    # the same tables, WS SVGD column (weight-space SVGD)
    "wsvgd": {
        "boston": (2.96, 0.10, -2.50, 0.03),
        "concrete": (5.32, 0.10, -3.08, 0.02),
        "kin8nm": (0.09, 0.00, 0.98, 0.01),
        "naval": (0.00, 0.00, 4.09, 0.01),
        "power": (3.94, 0.03, -2.79, 0.01),
        "protein": (4.61, 0.01, -2.95, 0.00),
        "wine": (0.61, 0.01, -0.93, 0.01),
        "yacht": (0.86, 0.05, -1.23, 0.04),
    },
    # Uppal et al. (2023), Table 1, LIVI (L') and LIVI (L'') rows, averaged over three seeds;
    # the paper does not say what its "±" is
    "livi": {
        "boston": (2.32, 0.07, -2.16, 0.05),
        "concrete": (4.24, 0.17, -2.79, 0.11),
        "energy": (0.41, 0.27, -1.17, 0.13),
        "kin8nm": (0.03, 0.00, 1.24, 0.04),
        "naval": (0.00, 0.00, 6.74, 0.04),
    },
    "livi_svd": {
        "boston": (2.40, 0.09, -2.40, 0.09),
        "concrete": (4.62, 0.13, -2.99, 0.13),
        "energy": (0.44, 0.11, -1.37, 0.11),
        "kin8nm": (0.08, 0.01, 1.15, 0.01),
        "naval": (0.00, 0.01, 5.84, 0.06),
    },
}

#: the runner's method behind each paper's rows (a report refuses any other)
PAPER_METHOD = {
    "kivi": "kivi",
    "fsvgd": "fsvgd",
    "wsvgd": "wsvgd",
    "livi": "livi",
    "livi_svd": "livi_svd",
}

#: run settings that must agree for splits to share a table row
RUN_KEYS = ("method", "seed", "dtype", "smoke")

#: what the paper's "±" is
PAPER_SPREAD = {"kivi": "sd", "fsvgd": "se", "wsvgd": "se", "livi": "?", "livi_svd": "?"}
_SPREAD_NOTE = {
    "sd": "The paper's ± is a standard deviation.",
    "se": "The paper's ± is a standard error.",
    "?": "The paper does not say what its ± is.",
}


def _stats(values):
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return None, None, None
    sd = arr.std(ddof=1) if arr.size > 1 else float("nan")
    return arr.mean(), sd / math.sqrt(arr.size) if arr.size > 1 else float("nan"), sd


def _finite(value):
    return value is not None and math.isfinite(value)


def _fmt(mean, spread, digits=3):
    if mean is None or not math.isfinite(mean):  # e.g. the sd of a single split
        return "n/a"
    if spread is None or not math.isfinite(spread):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def merge_datasets(runs, paths):
    """The splits of each data set, gathered from every result file, in first-seen order.

    Splits of one data set may be spread over several files (runs in parallel processes
    each write their own file); they must have the same configuration and run settings
    (:data:`RUN_KEYS`: method, seed, dtype, smoke) and no split may appear twice.

    :param list runs: the loaded result files.
    :param list paths: their paths, for the error messages.
    :returns: ``{name: (config, splits)}`` for the data sets with at least one split.
    :raises ValueError: on a configuration or run-setting mismatch or a repeated split.
    """
    merged = {}
    for run, path in zip(runs, paths, strict=True):
        settings = {key: run.get(key) for key in RUN_KEYS}
        for name, record in run["datasets"].items():
            if not record["splits"]:
                continue
            if name not in merged:
                merged[name] = (record["config"], [], path, settings)
            config, splits, first, first_settings = merged[name]
            if record["config"] != config:
                raise ValueError(
                    f"{name}: {path} and {first} were run with different configurations"
                )
            if settings != first_settings:
                raise ValueError(
                    f"{name}: {path} ({settings}) and {first} ({first_settings}) differ in "
                    "their run settings"
                )
            seen = {s["split"] for s in splits}
            repeated = sorted(seen & {s["split"] for s in record["splits"]})
            if repeated:
                raise ValueError(f"{name}: splits {repeated} appear in {first} and in {path}")
            splits.extend(record["splits"])
    return {name: (config, splits) for name, (config, splits, _, _) in merged.items()}


#: what a split without a recorded commit shows
UNRECORDED = "not recorded"


def split_commits(run):
    """``{data set: sorted commits of its splits}`` of one result file: each split's own
    ``commit``, or :data:`UNRECORDED` (not the file's: a resumed file holds the last
    invocation's)."""
    return {
        name: sorted({s.get("commit") or UNRECORDED for s in record["splits"]})
        for name, record in run["datasets"].items()
        if record["splits"]
    }


def commits_note(runs, paths, mixed_ok):
    """The sentence that says which commits a report merges: ``None`` when every split
    comes from one commit.

    :raises ValueError: when the splits come from several commits and ``mixed_ok`` is
        false.
    """
    by_commit = {}
    for run in runs:
        for name, commits in split_commits(run).items():
            for commit in commits:
                by_commit.setdefault(commit, set()).add(name)
    if len(by_commit) <= 1:
        return None
    parts = "; ".join(
        f"{commit}: {', '.join(sorted(names))}" for commit, names in sorted(by_commit.items())
    )
    if not mixed_ok:
        raise ValueError(
            f"{[str(p) for p in paths]} hold splits run at {len(by_commit)} commits ({parts}); "
            "rerun them at one commit, or pass --mixed-commits to merge them and say so"
        )
    return (
        f"**This table merges runs from {len(by_commit)} commits** (the code may differ "
        f"between them): {parts}."
    )


def report(paths, title, paper=None, mixed_commits=False):
    """Markdown text for the merged result files.

    :param list paths: JSON files written by ``benchmarks/uci.py``.
    :param str title: heading of the report.
    :param str paper: key of :data:`PAPERS` to print beside our numbers, or ``None``.
    :param bool mixed_commits: merge splits run at different commits (the report says so)
        instead of raising.
    :raises ValueError: on splits from several commits without ``mixed_commits``.
    """
    runs = [json.loads(Path(p).read_text()) for p in paths]
    mixed = commits_note(runs, paths, mixed_commits)
    if paper:
        wrong = [
            str(p)
            for p, r in zip(paths, runs, strict=True)
            if r.get("method") != PAPER_METHOD[paper]
        ]
        if wrong:
            raise ValueError(
                f"--paper {paper} compares with the paper's {PAPER_METHOD[paper]!r} rows, but "
                f"{wrong} hold another method's runs"
            )
    lines = [f"# UCI regression: {title}", ""]
    if mixed:
        lines += [mixed, ""]
    lines.append(
        "Protocol: standard splits (Hernandez-Lobato & Adams 2015), features and target "
        "normalised with the training split, test RMSE and per-point test log-likelihood "
        "in the original units. Ours: mean ± standard error over the splits run, and the "
        "standard deviation over splits; a failed split (non-finite metric) is left out of "
        "the means and shown as failed in the Splits column. "
        + _SPREAD_NOTE.get(PAPER_SPREAD.get(paper), "")
    )
    lines.append("")
    head = "| Data set | Splits | RMSE (± se) | RMSE sd | Test LL (± se) | LL sd | s / split |"
    sep = "|---|---:|---:|---:|---:|---:|---:|"
    if paper:
        spread = PAPER_SPREAD.get(paper, "sd")
        head += f" Paper RMSE (± {spread}) | Paper LL (± {spread}) |"
        sep += "---:|---:|"
    lines += [head, sep]
    configs = []
    for name, (config, splits) in merge_datasets(runs, paths).items():
        rmse, rmse_se, rmse_sd = _stats([s["rmse"] for s in splits])
        ll, ll_se, ll_sd = _stats([s["ll"] for s in splits])
        secs = np.mean([s["seconds"] for s in splits])
        failed = sum(1 for s in splits if not _finite(s["rmse"]) or not _finite(s["ll"]))
        count = f"{len(splits) - failed} ({failed} failed)" if failed else f"{len(splits)}"
        row = (
            f"| {name} | {count} | {_fmt(rmse, rmse_se)} | {_fmt(rmse_sd, None)} | "
            f"{_fmt(ll, ll_se)} | {_fmt(ll_sd, None)} | {secs:.0f} |"
        )
        if paper:
            ref = PAPERS[paper].get(name)
            if ref:
                row += f" {_fmt(ref[0], ref[1])} | {_fmt(ref[2], ref[3])} |"
            else:
                row += " | |"
        lines.append(row)
        configs.append((name, config, sorted(s["split"] for s in splits)))
    lines += ["", "Configurations and splits run:", ""]
    for name, config, splits in configs:
        lines.append(f"- `{name}`: splits {splits}; `{json.dumps(config, sort_keys=True)}`")
    lines += ["", "Runs:", ""]
    for path, run in zip(paths, runs, strict=True):
        lines.append(
            f"- `{path}`: `{run['command']}` (commit "
            f"{', '.join(sorted({c for cs in split_commits(run).values() for c in cs}))}, "
            f"started {run['started']}, resumed "
            f"{len(run.get('resumed', []))} times, torch {run['versions']['torch']}, "
            f"pyro {run['versions']['pyro']}, {run['threads']} thread(s), {run['dtype']})"
        )
    return "\n".join(lines) + "\n"


def replace_section(document, name, text):
    """``document`` with the part between the markers of section ``name`` set to ``text``.

    :param str document: the Markdown file's current text.
    :param str name: the section's name in its ``<!-- uci_report NAME -->`` markers.
    :param str text: the new content of the section.
    :rtype: str
    """
    begin, end = f"<!-- uci_report {name} -->", f"<!-- /uci_report {name} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in document:
        head, rest = document.split(begin, 1)
        if end not in rest:
            raise ValueError(f"section {name!r} has no end marker {end!r}")
        return head + block + rest.split(end, 1)[1]
    return document.rstrip() + "\n\n" + block + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="JSON files written by benchmarks/uci.py")
    parser.add_argument("--title", default="results")
    parser.add_argument("--paper", choices=sorted(PAPERS), default=None)
    parser.add_argument("--out", default=None, help="write the Markdown here (else print)")
    parser.add_argument(
        "--section",
        default=None,
        help="replace only this named section of --out (see the module doc)",
    )
    parser.add_argument(
        "--missing-ok",
        action="store_true",
        help="leave out result files that do not exist yet (a report of none says so)",
    )
    parser.add_argument(
        "--mixed-commits",
        action="store_true",
        help="merge splits run at different commits (the report names them) instead of refusing",
    )
    args = parser.parse_args(argv)
    if args.section and not args.out:
        parser.error("--section needs --out")
    paths = [p for p in args.paths if Path(p).exists()] if args.missing_ok else args.paths
    if paths:
        try:
            text = report(paths, args.title, args.paper, args.mixed_commits)
        except ValueError as e:
            parser.error(str(e))
    else:
        text = f"# UCI regression: {args.title}\n\nNo split has been run yet.\n"
    if args.section:
        out = Path(args.out)
        document = out.read_text() if out.exists() else ""
        out.write_text(replace_section(document, args.section, "#" + text))
    elif args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return text


if __name__ == "__main__":
    main()
