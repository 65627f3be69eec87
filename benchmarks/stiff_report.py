"""Merge ``benchmarks/stiff.py`` result files into one table and check the
preconditioning issue's goals against it.

    python benchmarks/stiff_report.py benchmarks/results/stiff.json \\
        benchmarks/results/stiff_raw_rest.json benchmarks/results/stiff_pre.json \\
        --markdown benchmarks/results/stiff.md

Later files replace earlier rows of the same (model, method, precondition). Each row
keeps the commit of the file it came from, and the header lists every file's command and
commit, so a table that mixes runs says so. The goal checks (the issue's):

* the best of our preconditioned methods within 3x NUTS's noise floor (the halves floor,
  and the iid floor of the same number of draws) on every posterior;
* each of our preconditioned methods at least as close to NUTS (max mean error, energy
  distance) as ``AutoMultivariateNormal``;
* the time to that quality at most 1/5 of NUTS's wall time: read for the best fit, and for
  the quickest of our fits that is within 3x a floor (the goal's "that quality"). A row
  from a run with ``--time-nuts`` is divided by the NUTS time measured in its own run;
  other rows by the wall time stored with the reference.
"""

import argparse
import json
import pathlib

#: our methods, then stiff.py's benchmark-only ``VARIANTS`` of them
OURS = (
    "kivi",
    "stein_score",
    "sivi",
    "livi",
    "gpvi",
    "asvgd",
    "wsvgd",
    "sivi_diagonal",
    "sivi_mixed",
)

#: names that earlier result files used (the registry's aliases)
RENAMED = {"implicit": "kivi"}


def _stiff():
    import stiff

    return stiff


def merge(paths):
    runs, rows, references, notes = [], {}, {}, {}
    for path in paths:
        record = json.loads(pathlib.Path(path).read_text())
        commit = record["git_commit"][:7] + ("+dirty" if record["git_dirty"] else "")
        runs.append((path, record["command"], commit, record["date"]))
        for row in record["results"]:
            row = dict(row, commit=commit)
            row["method"] = RENAMED.get(row["method"], row["method"])
            rows[(row["model"], row["method"], row["precondition"])] = row
        for name, ref in record["references"].items():
            references.setdefault(name, ref)
            references[name].update(ref)
        notes.update(record.get("notes", {}))
    first = json.loads(pathlib.Path(paths[0]).read_text())
    order = list(references)
    merged = dict(
        first,
        references={n: references[n] for n in order},
        notes=notes,
        results=sorted(rows.values(), key=lambda r: (order.index(r["model"]), r["method"])),
    )
    return merged, runs


def _nuts_seconds(row, ref):
    """NUTS's wall time for ``row``'s ratio: timed in the row's own run where it was
    (``stiff.py --time-nuts``), else the one stored with the reference."""
    return row.get("nuts_wall_time_this_run") or ref["wall_time"]


def _within(row):
    """Within 3x NUTS's noise floor: the halves floor, or the iid floor of as many draws."""
    return row["floor_ratio"] <= 3 or row["iid_floor_ratio"] <= 3


def goals(record):
    lines = [
        "## The issue's goals",
        "",
        "| model | best of ours (+pre) | its mean err | x floor | x iid | "
        "fit s / NUTS s | fastest of ours within 3x a floor | its fit s / NUTS s | "
        "ours (+pre) no worse than AutoMVN |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    met_floor = met_mvn = met_time = met_fastest = 0
    # per method of ours: posteriors where it is no worse than AutoMVN, and where compared
    per_method = {m: [0, 0] for m in OURS}
    for name, ref in record["references"].items():
        every = [r for r in record["results"] if r["model"] == name]
        rows = [r for r in every if r["status"] == "ok"]
        ours = [r for r in rows if r["method"] in OURS and r["precondition"] is True]
        # a fit that failed is no closer to NUTS than AutoMVN
        failed = [
            r["method"]
            for r in every
            if r["status"] != "ok" and r["method"] in OURS and r["precondition"] is True
        ]
        mvn = [r for r in rows if r["method"] == "automvn"]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["mean_error_max"])
        met_floor += _within(best)
        time_ratio = best["fit_seconds"] / _nuts_seconds(best, ref)
        met_time += time_ratio <= 0.2
        # "time to that quality": the quickest of our fits that reaches it
        reached = [r for r in ours if _within(r)]
        fastest = min(reached, key=lambda r: r["fit_seconds"]) if reached else None
        fastest_ratio = (
            fastest["fit_seconds"] / _nuts_seconds(fastest, ref) if fastest else float("nan")
        )
        met_fastest += fastest is not None and fastest_ratio <= 0.2
        worse = []
        if mvn:
            m = mvn[0]
            worse = [
                r["method"]
                for r in ours
                if r["mean_error_max"] > m["mean_error_max"]
                or r["energy_distance"] > max(m["energy_distance"], 0.0)
            ] + [f"{f} (failed)" for f in failed]
        met_mvn += not worse
        if mvn:
            for method in [r["method"] for r in ours] + failed:
                per_method[method][0] += method not in worse and method not in failed
                per_method[method][1] += 1
        lines.append(
            f"| {name} | {best['method']} | {best['mean_error_max']:.3f} | "
            f"{best['floor_ratio']:.1f} | {best['iid_floor_ratio']:.1f} | {time_ratio:.2f} | "
            f"{fastest['method'] if fastest else 'none'} | {fastest_ratio:.2f} | "
            f"{'yes' if not worse else 'no: ' + ', '.join(worse)} |"
        )
    total = len(record["references"])
    lines += [
        "",
        f"Best of ours within 3x a noise floor: {met_floor} of {total}; every method of "
        f"ours no worse than AutoMVN (mean error and energy distance): {met_mvn} of "
        f"{total}; the best fit in at most 1/5 of NUTS's time: {met_time} of {total}; "
        f"the quality (within 3x a floor) reached in at most 1/5 of NUTS's time by one of "
        f"our fits: {met_fastest} of {total}.",
        "",
        "Each method of ours (+pre) no worse than AutoMVN (mean error and energy distance), "
        "posteriors of those compared: "
        + ", ".join(f"{m} {n} of {of}" for m, (n, of) in per_method.items() if of)
        + ".",
        "",
    ]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--markdown", required=True)
    parser.add_argument("--note", default="", help="a paragraph placed under the run list")
    args = parser.parse_args(argv)
    record, runs = merge(args.files)
    table = _stiff().markdown(record).split("\n")
    header = [
        "# Stiff posteriors: methods with and without the affine preconditioner",
        "",
        "Merged from these runs (later rows replace earlier ones; the `commit` of each "
        "row is its run's):",
        "",
    ]
    header += [
        f"- `{cmd}` (commit {commit}, {date}) -> `{path}`" for path, cmd, commit, date in runs
    ]
    header += [
        f"- merged by `python benchmarks/stiff_report.py {' '.join(args.files)} "
        f"--markdown {args.markdown}`",
        "",
    ]
    if args.note:
        header += [args.note, ""]
    body = table[2:]  # drop the single-run title and command line
    body = [line for line in body if not line.startswith("`python")]
    out = header + goals(record) + body
    pathlib.Path(args.markdown).write_text("\n".join(out))


if __name__ == "__main__":
    main()
