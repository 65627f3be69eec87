"""One loss's SVI step at two commits (or one commit under two environments), alternating in
one run: how much a change saved.

Each commit is checked out into a temporary ``git worktree``; every repeat runs one
subprocess per commit (in turn, so load drifts hit both alike), which times ``--steps``
steps of ``compiled_score.py``'s loss (``--method``, as its ``--losses`` names them) after
five set-up steps, on one thread, and prints ms per step. The table holds the best repeat
of each. ``--after-env NAME=VALUE`` (repeatable) sets a variable for the "after" processes
only, e.g. an allocator setting, with ``--before`` and ``--after`` the same commit.

Usage::

    python benchmarks/step_ab.py --before 1b173ad --after ea40aa5 --method livi-fx \\
        --models eight_schools,hierarchical_logistic --out benchmarks/results/livi_log_det.md
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _provenance

#: run inside each worktree: ``argv = [worktree, method, model, steps, particles]``; the timing is
#: that worktree's ``compiled_score.time_loss`` (five set-up steps, then the timed ones)
_TIMER = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import torch
import compiled_score
import pyro_implicit
assert pyro_implicit.__file__.startswith(sys.argv[1]), pyro_implicit.__file__
torch.set_num_threads(1)
model, args, kwargs, mpn = compiled_score.models()[sys.argv[3]]
ms, setup = compiled_score.time_loss(
    model, args, kwargs, mpn, sys.argv[2], int(sys.argv[5]), int(sys.argv[4]), 0
)[:2]
print(json.dumps([ms, setup]))
"""


def time_step(tree, method, model, steps, particles=100, extra_env=None):
    """``(ms per step, set-up seconds)`` of ``method`` on ``model`` with the library of
    ``tree`` (and the variables of ``extra_env`` set); the set-up is the five first steps
    of a fresh process (the preconditioner's search, the traces, and the one-time import
    of the tracing machinery that a user's first fit in a session pays)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    # the data beside this checkout (a worktree elsewhere has none beside it)
    env.setdefault("PYRO_IMPLICIT_DATA", str(_provenance.REPO_ROOT.parent / "shared" / "data"))
    out = subprocess.run(
        [sys.executable, "-c", _TIMER, str(tree), method, model, str(steps), str(particles)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,  # ``python -c`` puts the working directory first on sys.path
    )
    if out.returncode:
        raise RuntimeError(f"timing {method} on {model} in {tree} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="commit without the change")
    parser.add_argument("--after", default="HEAD", help="commit with it")
    parser.add_argument("--method", default="livi-fx", help="comma-separated")
    parser.add_argument("--models", default="eight_schools,hierarchical_logistic")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--particles", type=int, default=100, help="vectorised particles")
    parser.add_argument(
        "--after-env", action="append", default=[], help="NAME=VALUE for the after runs"
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    after_env = dict(item.split("=", 1) for item in args.after_env)
    envs = {"before": {}, "after": after_env}
    prov = _provenance.provenance(__file__, argv, vars(args))
    root = _provenance.REPO_ROOT
    commits = {"before": args.before, "after": args.after}
    lines = [
        "# One loss's step before and after a change",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}): `{args.method}` "
        f"(`compiled_score.py`'s loss, {args.particles} vectorised particles, float32, one "
        "thread), ms "
        f"per step and set-up seconds (the five first steps of a fresh process), best of "
        f"{args.repeats} alternating repeats of {args.steps} steps, each "
        f"commit in its own worktree and process. before = {args.before}, after = "
        f"{args.after}"
        + (" with " + ", ".join(f"`{k}={v}`" for k, v in after_env.items()) if after_env else "")
        + ".",
        "",
        "| model | method | before ms | after ms | speed-up | before set-up s | "
        "after set-up s | set-up ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for key, commit in commits.items():
            trees[key] = Path(tmp) / key
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(root),
                    "worktree",
                    "add",
                    "--detach",
                    "-q",
                    str(trees[key]),
                    commit,
                ],
                check=True,
            )
        try:
            for model in args.models.split(","):
                for method in args.method.split(","):
                    best = {key: float("inf") for key in trees}
                    setup = {key: float("inf") for key in trees}
                    for _ in range(args.repeats):
                        for key, tree in trees.items():
                            ms, seconds = time_step(
                                tree, method, model, args.steps, args.particles, envs[key]
                            )
                            best[key] = min(best[key], ms)
                            setup[key] = min(setup[key], seconds)
                    lines.append(
                        f"| {model} | {method} | {best['before']:.2f} | {best['after']:.2f} | "
                        f"{best['before'] / best['after']:.2f} | {setup['before']:.2f} | "
                        f"{setup['after']:.2f} | {setup['after'] / setup['before']:.2f} |"
                    )
                    print(lines[-1], flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(
                    ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                    check=False,
                )
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"# {time.perf_counter() - start:.0f} s", file=sys.stderr)
