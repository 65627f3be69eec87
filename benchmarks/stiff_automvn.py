"""The preconditioning issue's AutoMVN clause over several seeds of the stiff benchmark:
which of our methods are farther from NUTS than ``AutoMultivariateNormal``, and where is
that a property of the method rather than of one seed's draws?

One seed's comparison is noisy: the two fits differ by their own Monte Carlo noise, and
on the near-Gaussian posteriors both sit near the floor, so a difference of 0.0002 in
energy distance decides "worse". Over seeds each fit's error is a mean, and a method is
read as

* **no worse on average**: its mean over seeds of the max mean error and of the energy
  distance are both at most AutoMVN's (the clause, on seed means);
* **worse at every seed**: at each seed its max mean error or energy distance exceeds
  AutoMVN's (the clause failing every time: not a matter of one draw).

    python benchmarks/stiff_automvn.py \\
        --seed benchmarks/results/stiff.json,benchmarks/results/stiff_kivi_scaled.json \\
        --seed benchmarks/results/stiff_seed1.json,... --markdown out.md

Each ``--seed`` is the comma-separated list of result files that
``benchmarks/stiff_report.py`` merges into one seed's table (later rows replace earlier
ones), in the same order. ``--before-seed`` groups, given as many times, put an earlier
state's seed means beside each row (``before err``, ``before energy``), e.g. the files
without a change's reruns.
"""

import argparse
import pathlib

import _provenance
from stiff_report import OURS, merge


def _rows(record):
    """``{(model, method): row}`` of the preconditioned fits of ours and of AutoMVN."""
    out = {}
    for row in record["results"]:
        if row["method"] == "automvn" or (row["method"] in OURS and row["precondition"] is True):
            out[(row["model"], row["method"])] = row
    return out


def _worse(row, mvn):
    """The clause failing at one seed (a failed fit is worse)."""
    if row["status"] != "ok":
        return True
    return row["mean_error_max"] > mvn["mean_error_max"] or row["energy_distance"] > max(
        mvn["energy_distance"], 0.0
    )


def _mean(values):
    return sum(values) / len(values)


def compare_over_seeds(records):
    """Rows ``(model, method, ours err, mvn err, ours energy, mvn energy, worse seeds,
    verdict)``, errors and energies averaged over the seeds' records."""
    per_seed = [_rows(r) for r in records]
    models = list(records[0]["references"])
    lines = []
    for model in models:
        mvns = [rows.get((model, "automvn")) for rows in per_seed]
        if any(m is None or m["status"] != "ok" for m in mvns):
            continue
        for method in OURS:
            ours = [rows.get((model, method)) for rows in per_seed]
            if any(r is None for r in ours):
                continue
            worse = sum(_worse(r, m) for r, m in zip(ours, mvns, strict=True))
            ok = [r for r in ours if r["status"] == "ok"]
            if len(ok) < len(ours):
                err = energy = float("inf")
            else:
                err = _mean([r["mean_error_max"] for r in ok])
                energy = _mean([r["energy_distance"] for r in ok])
            mvn_err = _mean([m["mean_error_max"] for m in mvns])
            mvn_energy = _mean([m["energy_distance"] for m in mvns])
            on_average = err <= mvn_err and energy <= max(mvn_energy, 0.0)
            if on_average:
                verdict = "no worse on average"
            elif worse == len(ours):
                verdict = "worse at every seed"
            else:
                verdict = "worse on average"
            lines.append((model, method, err, mvn_err, energy, mvn_energy, worse, verdict))
    return lines


def markdown(groups, records, before_groups=(), before_records=()):
    rows = compare_over_seeds(records)
    before = {(r[0], r[1]): r for r in compare_over_seeds(before_records)} if before_records else {}
    n = len(records)
    out = [
        "# The AutoMVN clause over seeds of the stiff benchmark",
        "",
        "`python benchmarks/stiff_automvn.py "
        + " ".join(f"--seed {','.join(g)}" for g in groups)
        + "".join(f" --before-seed {','.join(g)}" for g in before_groups)
        + f" --markdown ...` (commit {_provenance.git_commit()}). Each seed's table is the merge "
        "`stiff_report.py` makes of its files (their commits are in each seed's markdown "
        "table). Our methods with the "
        f"preconditioner against `AutoMultivariateNormal`, over {n} seeds: the max mean "
        "error in NUTS sds and the energy distance, each averaged over the seeds; `worse "
        "seeds`: at how many seeds the clause (mean error and energy distance no larger "
        "than AutoMVN's) failed.",
        "",
        "| model | method | mean err | AutoMVN's | energy | AutoMVN's | worse seeds | verdict |"
        + (" before err | before energy | before verdict |" if before else ""),
        "|---|---|---:|---:|---:|---:|---:|---|" + ("---:|---:|---|" if before else ""),
    ]
    for model, method, err, mvn_err, energy, mvn_energy, worse, verdict in rows:
        line = (
            f"| {model} | {method} | {err:.3f} | {mvn_err:.3f} | {energy:.4f} | "
            f"{mvn_energy:.4f} | {worse} of {n} | {verdict} |"
        )
        if before:
            b = before.get((model, method))
            line += f" {b[2]:.3f} | {b[4]:.4f} | {b[7]} |" if b else " - | - | - |"
        out.append(line)
    out += ["", "Per method, posteriors where it is no worse than AutoMVN on the seed means:", ""]
    out += [
        "| method | no worse on average | worse at every seed | of |"
        + (" before: no worse | before: worse at every seed |" if before else ""),
        "|---|---:|---:|---:|" + ("---:|---:|" if before else ""),
    ]
    for method in OURS:
        mine = [r for r in rows if r[1] == method]
        if mine:
            good = sum(r[7] == "no worse on average" for r in mine)
            always = sum(r[7] == "worse at every seed" for r in mine)
            line = f"| {method} | {good} | {always} | {len(mine)} |"
            if before:
                was = [before[r[0], r[1]] for r in mine if (r[0], r[1]) in before]
                line += (
                    f" {sum(b[7] == 'no worse on average' for b in was)} |"
                    f" {sum(b[7] == 'worse at every seed' for b in was)} |"
                )
            out.append(line)
    models = sorted({r[0] for r in rows}, key=[r[0] for r in rows].index)
    every = [m for m in models if all(r[7] == "no worse on average" for r in rows if r[0] == m)]
    out += [
        "",
        f"Posteriors where every method of ours is no worse than AutoMVN on the seed means: "
        f"{len(every)} of {len(models)}" + (f" ({', '.join(every)})." if every else "."),
        "",
    ]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seed", action="append", required=True, help="one seed's files, comma-separated"
    )
    parser.add_argument(
        "--before-seed", action="append", default=[], help="an earlier state's seed files"
    )
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args(argv)
    groups = [s.split(",") for s in args.seed]
    records = [merge(files)[0] for files in groups]
    before_groups = [s.split(",") for s in args.before_seed]
    before_records = [merge(files)[0] for files in before_groups]
    text = markdown(groups, records, before_groups, before_records)
    pathlib.Path(args.markdown).write_text(text)


if __name__ == "__main__":
    main()
