"""Do the checks that need no NUTS rank fits as NUTS does? A report on the stiff benchmark.

Reads the JSON of ``benchmarks/stiff.py --diagnostics`` (every fit with its error against
the NUTS gold standard, its kernel Stein discrepancy and, for guides with a log-density,
its PSIS k-hat) and writes, per model, the rank correlation (Spearman) between each
diagnostic and the error against NUTS over the model's fits, then how well simple rules
("KSD within a factor of NUTS's own", "k-hat below 0.7") separate good fits from bad.

Usage::

    python benchmarks/stiff.py --models all --methods all --steps 2000 \\
        --precondition both --seed 0 --diagnostics \\
        --out benchmarks/results/stiff_diagnostics.json
    python benchmarks/stiff_diagnostics.py benchmarks/results/stiff_diagnostics.json \\
        --markdown benchmarks/results/stiff_diagnostics.md

A fit is *good* when its largest mean error is below ``--good`` NUTS posterior sds
(default 0.3) and its sd ratios lie in [0.7, 1.3].
"""

import argparse
import json
import math
import sys
from pathlib import Path

from scipy.stats import spearmanr

#: the diagnostics compared with the error, and how to read each from a row (within one
#: model, KSD / NUTS KSD ranks as KSD does)
DIAGNOSTICS = {
    "KSD": lambda row: row.get("ksd"),
    "KSD / noise level": lambda row: _ratio(row.get("ksd"), row.get("ksd_noise_level")),
    "KSD^2 U-statistic": lambda row: row.get("ksd_squared_unbiased"),
    "k-hat": lambda row: row.get("k_hat"),
}

#: the errors against NUTS they are ranked with
ERRORS = {"mean err": "mean_error_max", "energy": "energy_distance"}


def _ratio(a, b):
    if a is None or b is None or not b > 0:
        return None
    return a / b


def _finite(x):
    return x is not None and isinstance(x, (int, float)) and not math.isnan(x)


def is_good(row, good):
    return row["mean_error_max"] < good and row["sd_ratio_min"] > 0.7 and row["sd_ratio_max"] < 1.3


def _label(row):
    tag = {None: "", True: " +pre", False: " -pre"}[row["precondition"]]
    return row["method"] + tag


def correlations(record):
    """``{model: {(diagnostic, error): (rho, n)}}``: Spearman's rho between each diagnostic
    and each error over the model's fits (inf counts as the largest value)."""
    out = {}
    for model in record["references"]:
        rows = [r for r in record["results"] if r["model"] == model and r["status"] == "ok"]
        out[model] = {}
        for name, read in DIAGNOSTICS.items():
            for error, key in ERRORS.items():
                pairs = [(read(r), r[key]) for r in rows]
                pairs = [(d, e) for d, e in pairs if _finite(d) or d == math.inf]
                if len(pairs) < 4:
                    out[model][name, error] = (math.nan, len(pairs))
                    continue
                big = 1e300  # rank inf last
                rho = spearmanr(
                    [min(d, big) for d, _ in pairs], [min(e, big) for _, e in pairs]
                ).statistic
                out[model][name, error] = (float(rho), len(pairs))
    return out


def rule_table(record, good):
    """Confusion counts of the rules over every fit of every model."""
    rules = {
        "KSD <= 1.5 x NUTS KSD": lambda r, g: (
            _ratio(r.get("ksd"), g.get("ksd")) is not None
            and _ratio(r.get("ksd"), g.get("ksd")) <= 1.5
        ),
        "KSD <= 2 x NUTS KSD": lambda r, g: (
            _ratio(r.get("ksd"), g.get("ksd")) is not None
            and _ratio(r.get("ksd"), g.get("ksd")) <= 2.0
        ),
        "KSD / noise level <= 1.5": lambda r, g: (
            _ratio(r.get("ksd"), r.get("ksd_noise_level")) is not None
            and _ratio(r.get("ksd"), r.get("ksd_noise_level")) <= 1.5
        ),
        "k-hat <= 0.7 (guides with a density)": lambda r, g: (
            _finite(r.get("k_hat")) and r["k_hat"] <= 0.7
        ),
    }
    out = {}
    for name, rule in rules.items():
        counts = {"pass_good": 0, "pass_bad": 0, "fail_good": 0, "fail_bad": 0}
        for r in record["results"]:
            if r["status"] != "ok":
                continue
            if name.startswith("k-hat") and not _finite(r.get("k_hat")):
                continue
            gold = record["references"][r["model"]].get("diagnostics", {})
            passed = rule(r, gold)
            key = ("pass_" if passed else "fail_") + ("good" if is_good(r, good) else "bad")
            counts[key] += 1
        out[name] = counts
    return out


def _num(x, fmt=".3f"):
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, fmt)


def markdown(record, source, good):
    lines = [
        "# Checks without NUTS on the stiff benchmark: KSD and PSIS k-hat against the error",
        "",
        f"Fits: `{record['command']}` (commit {record['git_commit'][:10]}"
        f"{', dirty tree' if record['git_dirty'] else ''}, {record['date']}), read from "
        f"`{source}`. Report: `python benchmarks/stiff_diagnostics.py {source} "
        f"--good {good}`.",
        "",
        "KSD: kernel Stein discrepancy (IMQ, beta = -1/2, c = 1) of the fit's draws (2000 per "
        "guide, the 100 particles of wsvgd), in the coordinates of the model's automatic "
        "preconditioner, the same for every fit of a model; `NUTS` is the KSD of 2000 "
        "evenly thinned gold draws. Noise level: the KSD that as many exact draws would "
        "show, from the fit's own scores. k-hat: PSIS Pareto k of 1000 guide draws, for "
        "guides with a log-density (sivi: mixture estimate, K = 1000; livi: linearised "
        "density; Pyro's guides: exact). Mean err: largest mean error in NUTS sds.",
        "",
        "## Rank correlation with the mean error, per model (Spearman rho over its fits)",
        "",
        "| model | fits | "
        + " | ".join(f"{d} ~ {e}" for d in DIAGNOSTICS for e in ERRORS)
        + " | NUTS KSD (noise level) |",
        "|---|---:|" + "---:|" * (len(DIAGNOSTICS) * len(ERRORS)) + "---:|",
    ]
    corr = correlations(record)
    columns = [(d, e) for d in DIAGNOSTICS for e in ERRORS]
    for model, ref in record["references"].items():
        gold = ref.get("diagnostics", {})
        n = max(v[1] for v in corr[model].values())
        cells = [_num(corr[model][c][0], ".2f") for c in columns]
        lines.append(
            f"| {model} | {n} | " + " | ".join(cells) + f" | {_num(gold.get('ksd'))} "
            f"({_num(gold.get('ksd_noise_level'))}) |"
        )
    med = {}
    for c in columns:
        vals = sorted(corr[m][c][0] for m in corr if math.isfinite(corr[m][c][0]))
        med[c] = (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2 if vals else math.nan
    lines.append(
        "| median over models | | " + " | ".join(_num(med[c], ".2f") for c in columns) + " | |"
    )
    lines += [
        "",
        "k-hat is ranked over the 7 fits per model with a log-density (sivi, livi "
        "with and without the preconditioner, Pyro's three guides); the KSD columns over "
        "every fit that finished.",
    ]
    lines += [
        "",
        "## Picking a fit by KSD alone",
        "",
        "| model | lowest KSD | its mean err | its rank by mean err | best by mean err | "
        "its mean err |",
        "|---|---|---:|---:|---|---:|",
    ]
    for model in record["references"]:
        rows = [
            r
            for r in record["results"]
            if r["model"] == model and r["status"] == "ok" and _finite(r.get("ksd"))
        ]
        if not rows:
            continue
        by_error = sorted(rows, key=lambda r: r["mean_error_max"])
        chosen = min(rows, key=lambda r: r["ksd"])
        lines.append(
            f"| {model} | {_label(chosen)} | {_num(chosen['mean_error_max'])} | "
            f"{by_error.index(chosen) + 1} of {len(rows)} | {_label(by_error[0])} | "
            f"{_num(by_error[0]['mean_error_max'])} |"
        )
    lines += [
        "",
        f"## Rules of thumb over all fits (good: mean err < {good} sd, sd ratios in [0.7, 1.3])",
        "",
        "| rule | passes, good | passes, bad | fails, good | fails, bad |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, c in rule_table(record, good).items():
        lines.append(
            f"| {name} | {c['pass_good']} | {c['pass_bad']} | {c['fail_good']} | {c['fail_bad']} |"
        )
    lines += [
        "",
        "## Every fit",
        "",
        "| model | method | mean err | sd ratio | KSD | KSD / noise | KSD / NUTS | k-hat | good |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["results"]:
        gold = record["references"][r["model"]].get("diagnostics", {})
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {_label(r)} | {r['status']} | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {_label(r)} | {_num(r['mean_error_max'])} | "
            f"{_num(r['sd_ratio_min'], '.2f')}-{_num(r['sd_ratio_max'], '.2f')} | "
            f"{_num(r.get('ksd'), '.4g')} | "
            f"{_num(_ratio(r.get('ksd'), r.get('ksd_noise_level')), '.2f')} | "
            f"{_num(_ratio(r.get('ksd'), gold.get('ksd')), '.2f')} | "
            f"{_num(r.get('k_hat'), '.2f')} | {'yes' if is_good(r, good) else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", help="output of benchmarks/stiff.py --diagnostics")
    p.add_argument(
        "--good",
        type=float,
        default=0.3,
        help="largest mean error (NUTS sds) of a good fit (default 0.3)",
    )
    p.add_argument("--markdown", help="write the report here (default: stdout)")
    args = p.parse_args(argv)
    record = json.loads(Path(args.json).read_text())
    if not record["settings"].get("diagnostics"):
        sys.exit(f"{args.json} was not run with --diagnostics")
    text = markdown(record, args.json, args.good)
    if args.markdown:
        Path(args.markdown).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
