"""What every result file of a benchmark records about the run that made it: the command
line, the commit of the code (``+`` when the checkout has uncommitted changes), the UTC
time, the settings and the library versions (:func:`provenance`).

Importing it also makes ``pyro_implicit`` importable from a checkout without an install
(the one place that does so). The benchmarks import it and each other by name: their folder
is first on ``sys.path`` when one runs as ``python benchmarks/<name>.py``, and the runner
(``python -m benchmarks <name>``) and the tests' loader put it there::

    import _provenance
"""

import datetime
import platform
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

try:
    import pyro_implicit  # noqa: F401
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, str(REPO_ROOT))

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "command_line",
    "git_commit",
    "provenance",
    "utc_now",
    "versions",
    "write_result",
]


def git_commit():
    """The checkout's short commit, with ``+`` if it has uncommitted changes to tracked
    files, or ``None`` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def utc_now():
    """The current UTC time, ISO 8601 to the second (``2026-01-31T12:00:00Z``)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(script, argv=None):
    """``python benchmarks/<script> <argv>``: the command that reruns this run.

    :param str script: the script's file (``__file__``) or name.
    :param list argv: its arguments (default ``sys.argv[1:]``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", f"benchmarks/{Path(script).name}", *argv])


def versions():
    """Python's, torch's, Pyro's and NumPy's versions."""
    import numpy as np
    import pyro
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyro": pyro.__version__,
        "numpy": np.__version__,
    }


def provenance(script, argv=None, settings=None):
    """``{"command", "argv", "commit", "utc", "settings", "versions"}`` of this run, to be
    stored in its result file.

    :param str script: the script's file (``__file__``).
    :param list argv: its arguments (default ``sys.argv[1:]``).
    :param dict settings: what the run was configured with (e.g. ``vars(args)``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    return {
        "command": command_line(script, argv),
        "argv": argv,
        "commit": git_commit(),
        "utc": utc_now(),
        "settings": {} if settings is None else dict(settings),
        "versions": versions(),
    }


def write_result(text, out=None):
    """Print a run's Markdown result and, with ``out``, write it to that file."""
    print(text)
    if out:
        Path(out).write_text(text)
