"""Every tutorial notebook runs top to bottom in smoke mode (Pyro's convention:
``smoke_test = "CI" in os.environ`` gives fewer steps on the same code path)."""

import os
import pathlib

import pytest

from pyro_implicit.datasets import data_available

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

TUTORIALS = pathlib.Path(__file__).resolve().parent.parent / "tutorials"
NOTEBOOKS = sorted(TUTORIALS.glob("*.ipynb"))
#: notebooks that read the shared data folder (skipped when it is missing)
NEEDS_DATA = {"semi_implicit_vi.ipynb"}


def test_tutorials_exist():
    assert len(NOTEBOOKS) >= 1, f"no notebooks in {TUTORIALS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_tutorial_runs_in_smoke_mode(path, monkeypatch):
    if path.name in NEEDS_DATA and not data_available():
        pytest.skip("data folder not available (set PYRO_IMPLICIT_DATA)")
    monkeypatch.setenv("CI", "1")
    # jupyter_core warns (DeprecationWarning) unless told to use platformdirs already
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(TUTORIALS)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, when one fails
    assert os.environ["CI"] == "1"
