"""The benchmarks' shared runner.

Usage, from the repository root::

    python -m benchmarks                  # every benchmark, what it measures, its results
    python -m benchmarks NAME [ARGS ...]  # run benchmarks/NAME.py with ARGS

A run goes exactly as ``python benchmarks/NAME.py ARGS`` would (the script's folder first on
``sys.path``, ``__name__ == "__main__"``), with what every benchmark needs done in one place:

- torch and OpenMP held to one thread unless ``OMP_NUM_THREADS`` is set: small models run
  many times faster so on a shared machine (a script's own ``--threads`` still wins);
- a warning when the checkout has uncommitted changes to tracked files (the result then
  records the commit with a ``+``, and cannot be reproduced from the commit alone);
- the elapsed time printed at the end;
- ``results/MANIFEST.md`` rewritten when the run wrote into ``results/``.
"""

import ast
import os
import runpy
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
#: helpers and the runner itself, not benchmarks
NOT_BENCHMARKS = {"__init__", "__main__"}


def scripts():
    """``{name: first line of its docstring}`` of every benchmark script."""
    out = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.stem in NOT_BENCHMARKS or path.stem.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out[path.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def _results_state():
    return {
        p.relative_to(RESULTS): p.stat().st_mtime_ns
        for p in RESULTS.rglob("*")
        if p.is_file() and p.name != "MANIFEST.md"
    }


def listing():
    """The benchmarks and the result files whose recorded command runs each."""
    import manifest

    wrote = {}
    for name, commands, _, _ in manifest.rows():
        for command in commands:
            for script in scripts():
                if f"benchmarks/{script}.py" in command:
                    wrote.setdefault(script, set()).add(name)
    lines = ["python -m benchmarks NAME [ARGS ...]; NAME --help for its arguments", ""]
    for script, summary in scripts().items():
        lines.append(f"{script:20s} {summary}")
        if script in wrote:
            lines.append(f"{'':20s}   -> {', '.join(sorted(wrote[script]))}")
    return "\n".join(lines)


def run(name, argv):
    """Run ``benchmarks/<name>.py`` with ``argv`` as a script; rewrite the manifest if it
    wrote a result."""
    path = BENCHMARKS / f"{name}.py"
    if name in NOT_BENCHMARKS or not path.exists():
        known = ", ".join(scripts())
        raise SystemExit(f"no benchmark {name!r}; the benchmarks are: {known}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import _provenance  # pyro_implicit importable from a bare checkout, and the commit

    commit = _provenance.git_commit()
    if commit and commit.endswith("+"):
        print(
            f"# warning: the checkout has uncommitted changes; results will record commit "
            f"{commit} (commit first to make them reproducible)",
            file=sys.stderr,
        )
    before = _results_state()
    start = time.perf_counter()
    sys.argv = [str(path), *argv]
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        print(f"# {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
        if name != "manifest" and _results_state() != before:
            import manifest

            (RESULTS / "MANIFEST.md").write_text(manifest.text())
            print("# results/MANIFEST.md rewritten", file=sys.stderr)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # the scripts import their siblings (_provenance, stiff, uci, ...) by name
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return
    run(argv[0], argv[1:])


if __name__ == "__main__":
    main()
