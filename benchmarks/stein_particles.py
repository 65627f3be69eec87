"""``SteinScoreELBO``'s draws per step on the stiff benchmark: a table from ``stiff.py`` runs.

Each ``--runs LABEL=FILE,FILE,...`` is one particle count's ``stiff.py --methods
stein_score`` result files (``--method``: another method's rows, e.g. ``kivi``), one per
seed (in seed order; ``A+B`` for a seed whose rows are spread over files, later files'
rows replacing earlier ones, as ``stiff_report.py`` merges them); ``--automvn`` the files that hold
AutoMVN's rows for the same seeds. Per posterior: the max mean error in NUTS sds per seed
and over seeds, the energy distance over seeds, at how many seeds the fit is within 3x
NUTS's noise floor, and the fit's seconds over seeds.

    python benchmarks/stein_particles.py \\
        --runs 100=a_seed0.json,a_seed1.json --runs 200=b_seed0.json,b_seed1.json \\
        --automvn stiff_seed0.json,stiff_seed1.json --out benchmarks/results/stein_particles.md
"""

import argparse
import json
import statistics

import _provenance

FLOOR_FACTOR = 3.0


def _rows(path, method):
    with open(path) as f:
        record = json.load(f)
    # the preconditioned fits (or Pyro's, which have no switch), as stiff_automvn.py reads
    rows = {
        row["model"]: row
        for row in record["results"]
        if row["method"] == method
        and row.get("status", "ok") == "ok"
        and row.get("precondition") is not False
    }
    return rows, record


def _merged_rows(paths, method):
    """``(rows, records)`` of ``A+B+...``: later files' rows replace earlier ones."""
    merged, records = {}, []
    for path in paths.split("+"):
        rows, record = _rows(path, method)
        merged.update(rows)
        records.append((path, record))
    return merged, records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", action="append", required=True, help="LABEL=FILE,FILE,...")
    parser.add_argument("--automvn", required=True, help="FILE,FILE,... (one per seed)")
    parser.add_argument("--method", default="stein_score", help="whose rows to read")
    parser.add_argument("--title", help="the table's heading (default: the method's draws)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    prov = _provenance.provenance(__file__, argv, vars(args))
    runs, sources = {}, []
    for spec in args.runs:
        label, files = spec.split("=", 1)
        per_seed = []
        for paths in files.split(","):
            rows, records = _merged_rows(paths, args.method)
            per_seed.append(rows)
            for path, record in records:
                if not any(row["method"] == args.method for row in record["results"]):
                    continue
                sources.append(
                    f"- `{path}`: `{record['command']}` (commit {record['git_commit'][:7]}"
                    f"{'+' if record.get('git_dirty') else ''}, {record['date']})"
                )
        runs[label] = per_seed
    automvn = [_merged_rows(paths, "automvn")[0] for paths in args.automvn.split(",")]
    seeds = len(automvn)
    models = [
        m for m in next(iter(runs.values()))[0] if all(m in r for p in runs.values() for r in p)
    ]
    header = ["model"] + [
        f"{label}: err per seed, mean (energy); within {FLOOR_FACTOR:g}x floor; fit s"
        for label in runs
    ]
    lines = [
        args.title or f"# `{args.method}`'s draws per step on the stiff benchmark",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}). From these runs:",
        "",
        *sources,
        "",
        "Max mean error in NUTS sds at each seed, then its mean over the seeds; the energy "
        "distance's mean over the seeds; at how many seeds the error is within "
        f"{FLOOR_FACTOR:g}x NUTS's noise floor; the fit's seconds, mean over the seeds. "
        "AutoMVN: its seed means of the same two measures.",
        "",
        "| " + " | ".join(header + ["AutoMVN err (energy)"]) + " |",
        "|" + "---|" * (len(header) + 1),
    ]
    for model in models:
        cells = [model]
        for per_seed in runs.values():
            rows = [r[model] for r in per_seed]
            errors = [r["mean_error_max"] for r in rows]
            energy = statistics.mean(r["energy_distance"] for r in rows)
            within = sum(r["floor_ratio"] <= FLOOR_FACTOR for r in rows)
            seconds = statistics.mean(r["fit_seconds"] for r in rows)
            per = " / ".join(f"{e:.3f}" for e in errors)
            cells.append(
                f"{per}, **{statistics.mean(errors):.3f}** ({energy:.3f}); "
                f"{within}/{len(rows)}; {seconds:.0f}"
            )
        mvn_err = statistics.mean(r[model]["mean_error_max"] for r in automvn)
        mvn_energy = statistics.mean(r[model]["energy_distance"] for r in automvn)
        cells.append(f"{mvn_err:.3f} ({mvn_energy:.3f})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Seeds: {seeds} (AutoMVN's files: {args.automvn})."]
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
