"""The benchmarks: scripts that measure the library against closed forms, NUTS, the
papers' tables and peers, each writing a result file under ``benchmarks/results/`` that
records its command, commit and settings (``_provenance.py``).

Run one through the shared runner from the repository root (``python -m benchmarks`` lists
them), or as a script (``python benchmarks/<name>.py``): both run the same code the same
way. See ``benchmarks/__main__.py``.
"""
