"""The benchmarks' shared runner (``python -m benchmarks``)."""

import os
import sys
import types

import pytest


@pytest.fixture
def runner(load_benchmark):
    return load_benchmark("__main__")


def test_lists_every_benchmark_and_refuses_an_unknown_one(runner):
    scripts = runner.scripts()
    assert {"stiff", "uci", "manifest", "compiled_score"} <= set(scripts)
    assert not {"__init__", "__main__", "_provenance"} & set(scripts)
    assert scripts["stiff"]  # its docstring's first line
    with pytest.raises(SystemExit, match="no benchmark 'nope'; the benchmarks are: "):
        runner.run("nope", [])


def test_runs_a_script_as_python_would_and_rewrites_the_manifest(runner, tmp_path, monkeypatch):
    bench = tmp_path / "bench"
    results = bench / "results"
    results.mkdir(parents=True)
    (bench / "toy.py").write_text(
        '"""A toy benchmark."""\n'
        "import sys\n"
        "from pathlib import Path\n\n"
        'if __name__ == "__main__":\n'
        '    out = Path(sys.argv[0]).parent / "results" / "toy.md"\n'
        '    out.write_text(" ".join(sys.argv[1:]))\n'
    )
    (bench / "quiet.py").write_text('"""Writes nothing."""\n')
    monkeypatch.setattr(runner, "BENCHMARKS", bench)
    monkeypatch.setattr(runner, "RESULTS", results)
    manifest = types.SimpleNamespace(text=lambda: "manifest\n")
    monkeypatch.setitem(sys.modules, "manifest", manifest)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert runner.scripts() == {"toy": "A toy benchmark.", "quiet": "Writes nothing."}

    runner.run("quiet", [])
    assert not (results / "MANIFEST.md").exists()  # nothing written, nothing rewritten
    runner.run("toy", ["--seed", "3"])
    assert (results / "toy.md").read_text() == "--seed 3"
    assert (results / "MANIFEST.md").read_text() == "manifest\n"
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_numpyro_row_is_skipped_with_its_reason(load_benchmark, tmp_path):
    """JAX and NumPyro are never the library's dependencies: without an interpreter that
    has them, compiled_score's NumPyro comparison says why it is missing."""
    import torch

    bench = load_benchmark("compiled_score")
    table = {"eight_schools": (None, (torch.zeros(8), torch.ones(8)), {}, 1)}
    assert bench.numpyro_steps(None, table, 4, 1, 1, 0) == (None, "no --numpyro-python given")
    missing = str(tmp_path / "no-python")
    measured, reason = bench.numpyro_steps(missing, table, 4, 1, 1, 0)
    assert measured is None and reason.startswith(f"{missing} did not run")
    fails = tmp_path / "python-without-numpyro"
    fails.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named jax' >&2\nexit 1\n")
    fails.chmod(0o755)
    measured, reason = bench.numpyro_steps(str(fails), table, 4, 1, 1, 0)
    assert measured is None and "No module named jax" in reason
