"""The results manifest: one table of every file in ``benchmarks/results/`` with the command,
the commit(s) and the date it records, read from the file itself (a JSON file's
``command`` / ``commit`` / ``git_commit`` / ``date`` / ``utc`` keys; a Markdown file's
backticked ``python benchmarks/...`` or ``torchrun ...`` commands and ``commit <hash>``
mentions). A file that records no command or no commit is listed as such, so a result
without provenance shows.

Usage::

    python -m benchmarks manifest --out benchmarks/results/MANIFEST.md
"""

import argparse
import json
import re
import subprocess
from pathlib import Path

from _provenance import REPO_ROOT, RESULTS_DIR

_COMMAND = re.compile(r"`((?:python|torchrun|PYRO_IMPLICIT|OMP_NUM)[^`]*benchmarks/[^`]+)`")
_COMMIT = re.compile(r"commit[s]?\s+`?([0-9a-f]{7,40})")


def _json_record(path):
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if isinstance(record, list):
        record = record[0] if record and isinstance(record[0], dict) else {}
    if not isinstance(record, dict):
        return None
    commands = [record["command"]] if isinstance(record.get("command"), str) else []
    commit = record.get("commit") or record.get("git_commit")
    date = record.get("date") or record.get("utc") or ""
    return commands, [str(commit)[:8]] if commit else [], str(date)[:19]


def _markdown_record(path):
    text = path.read_text()
    commands = list(dict.fromkeys(_COMMAND.findall(text)))
    commits = list(dict.fromkeys(_COMMIT.findall(text)))
    date = re.search(r"20\d\d-\d\d-\d\d", text)
    return commands, commits, date.group(0) if date else ""


def rows(results_dir=RESULTS_DIR):
    """``(name, commands, commits, date)`` for every result file, sorted by name."""
    out = []
    for path in sorted(results_dir.iterdir()):
        if path.is_dir() or path.name == "MANIFEST.md":
            continue
        if path.suffix == ".json":
            record = _json_record(path)
        elif path.suffix == ".md":
            record = _markdown_record(path)
        else:
            continue
        if record is not None:
            out.append((path.name, *record))
    return out


def last_committed(path):
    """The commit that last changed ``path`` in git (``""`` if never committed): where the
    file itself records no commit, the code it was made with is at most this recent."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def _cell(items, limit):
    if not items:
        return "**none recorded**"
    shown = ", ".join(f"`{item}`" for item in items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def text():
    """The manifest as Markdown."""
    lines = [
        "# Results manifest",
        "",
        "`python -m benchmarks manifest --out benchmarks/results/MANIFEST.md` (the runner "
        "rewrites it after every run that writes a result): every result "
        "file with the command(s), commit(s) and date it records (read from the file; a "
        "file naming several commits merges runs and says which in its header), and the "
        "commit that last changed the file in git. Files marked **none recorded** predate "
        "the rule that every result records its command and commit: the code that made "
        "them is at most as recent as their last commit.",
        "",
        "| file | command | commit (recorded) | last committed in | date |",
        "|---|---|---|---|---|",
    ]
    for name, commands, commits, date in rows():
        command = _cell([c if len(c) <= 160 else c[:157] + "..." for c in commands], 1)
        last = last_committed(RESULTS_DIR / name) or "not committed"
        lines.append(f"| {name} | {command} | {_cell(commits, 4)} | `{last}` | {date} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the manifest here (else print it)")
    args = parser.parse_args(argv)
    if args.out:
        Path(args.out).write_text(text())
    else:
        print(text(), end="")


if __name__ == "__main__":
    main()
