"""The preconditioning issue's longer-training clause on the stiff benchmark: does a method
end further from NUTS after more steps?

The issue checks it on ``compare``'s (non-centred) eight schools at 1000 and 5000 steps,
scored against ``compare``'s short NUTS run (``longer_training*.md``). This reads
``benchmarks/stiff.py`` result files instead, so any stiff posterior is scored against its
long gold NUTS run, whose noise floor is known, over several seeds:

    python benchmarks/stiff.py --models eight_schools_centered --methods all \\
        --steps 1000 --lr-decay 0.1 --seed S --out short_S.json   # and --steps 5000
    python benchmarks/stiff_longer.py --short short_0.json,short_1.json \\
        --long long_0.json,long_1.json --markdown out.md

``--short`` and ``--long`` list one file per seed, in the same seed order (several files of
one seed joined by ``+`` are merged as ``stiff_report.py`` merges them). A method is
read as **worse** where its seed mean of the max mean error after the longer run exceeds
the shorter run's by more than the reference's noise floor (NUTS's first half against its
second: fits that differ by less cannot be told apart by this reference), **energy up**
where only the seed mean of the energy distance rose, and **no worse** otherwise.
"""

import argparse
import pathlib
from statistics import fmean

import _provenance
from stiff_report import merge


def _load(groups):
    """One merged record per seed (``stiff_report.merge``: later files' rows replace
    earlier ones, old method names renamed)."""
    return [merge(files.split("+"))[0] for files in groups]


def _by_method(records):
    """``{(model, method, precondition): [row per seed]}`` of the fits that every record has."""
    out = {}
    for record in records:
        for row in record["results"]:
            out.setdefault((row["model"], row["method"], row["precondition"]), []).append(row)
    return {k: v for k, v in out.items() if len(v) == len(records)}


def _summary(rows):
    """Seed means of the max mean error and energy distance (inf if a fit failed), the
    per-seed errors, and the widest sd-ratio range over the seeds."""
    if any(r["status"] != "ok" for r in rows):
        return float("inf"), float("inf"), [], "-"
    errors = [r["mean_error_max"] for r in rows]
    low = min(r["sd_ratio_min"] for r in rows)
    high = max(r["sd_ratio_max"] for r in rows)
    return (
        fmean(errors),
        fmean([r["energy_distance"] for r in rows]),
        errors,
        f"{low:.2f}-{high:.2f}",
    )


def table(short, long):
    """Markdown lines comparing the two lengths, one row per (model, method)."""
    steps = [r["settings"]["steps"] for r in (short[0], long[0])]
    a, b = _by_method(short), _by_method(long)
    lines = [
        f"| model | method | err {steps[0]} | err {steps[1]} | per seed {steps[1]} | "
        f"energy {steps[0]} | energy {steps[1]} | sd ratio {steps[0]} | sd ratio {steps[1]} "
        "| floor | verdict |",
        "|---|---|---:|---:|---|---:|---:|---|---|---:|---|",
    ]
    verdicts = {}
    # the order the models and methods ran in
    models, methods = list(short[0]["references"]), short[0]["settings"]["methods"]

    def ran(key):
        return models.index(key[0]), methods.index(key[1]) if key[1] in methods else len(methods)

    for key in sorted(a, key=ran):
        if key not in b:
            continue
        model, method, pre = key
        floor = short[0]["references"][model]["noise_floor"]
        err_a, en_a, _, sd_a = _summary(a[key])
        err_b, en_b, per_b, sd_b = _summary(b[key])
        if err_b > err_a + floor["mean_error_max"]:
            verdict = "worse"
        elif en_b > en_a + max(floor["energy_distance"], 0.0):
            verdict = "energy up"
        else:
            verdict = "no worse"
        verdicts[method] = verdict
        name = method + (" +pre" if pre else "")
        seeds = ", ".join(f"{e:.3f}" for e in per_b)
        lines.append(
            f"| {model} | {name} | {err_a:.3f} | {err_b:.3f} | {seeds} | {en_a:.4f} | "
            f"{en_b:.4f} | {sd_a} | {sd_b} | {floor['mean_error_max']:.3f} | {verdict} |"
        )
    return lines, verdicts


def markdown(args, short, long):
    lines, verdicts = table(short, long)
    settings = short[0]["settings"]
    commits = sorted(
        {r["git_commit"][:7] + ("+dirty" if r["git_dirty"] else "") for r in short + long}
    )
    worse = [m for m, v in verdicts.items() if v == "worse"]
    energy = [m for m, v in verdicts.items() if v == "energy up"]
    out = [
        "# Longer training on the stiff benchmark",
        "",
        f"`python benchmarks/stiff_longer.py --short {','.join(args.short)} --long "
        f"{','.join(args.long)} --markdown ...` (commit {_provenance.git_commit()}); the fits "
        f"at {', '.join(commits)}, seeds {', '.join(str(r['settings']['seed']) for r in short)}, "
        f"lr {settings['lr']}, lr decay {settings['lr_decay']}, {settings['dtype']}. The runs:",
        "",
        *[f"    {r['command']}" for r in short + long],
        "",
        "Max mean error in gold-NUTS sds and energy distance, each the mean over the seeds; "
        "the widest sd-ratio range over the seeds; `floor`: the reference's own mean error "
        "(its halves). `worse`: the mean error's seed mean rose by more than the floor; "
        "`energy up`: only the energy distance's seed mean rose.",
        "",
        *lines,
        "",
        f"Worse with the longer run: {', '.join(worse) or 'none'}; energy distance up "
        f"only: {', '.join(energy) or 'none'}.",
        "",
    ]
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", required=True, help="stiff.py files, one per seed (a+b: merged)")
    parser.add_argument("--long", required=True, help="the same seeds' longer runs")
    parser.add_argument("--markdown", required=True)
    args = parser.parse_args(argv)
    args.short, args.long = args.short.split(","), args.long.split(",")
    if len(args.short) != len(args.long):
        parser.error("--short and --long need one file per seed each, in the same order")
    short, long = _load(args.short), _load(args.long)
    for s, lg in zip(short, long, strict=True):
        if s["settings"]["seed"] != lg["settings"]["seed"]:
            parser.error("--short and --long must list the same seeds in the same order")
    pathlib.Path(args.markdown).write_text(markdown(args, short, long))


if __name__ == "__main__":
    main()
