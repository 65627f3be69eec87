"""The seconds a model's traced graphs take to build, with one fake-tensor mode for the
whole trace (``_one_fake_mode`` in ``pyro_implicit/compiled.py``) against ``make_fx``'s
own mode per node.

A fit traces its model's graph once per input signature: the preconditioner search's
L-BFGS (one row), its Gaussian fit (16 draws) and check (256 draws), the loss's particles.
Each trace runs the model under ``make_fx``, which records a fake copy of every node's
value; without a fake mode in context it builds one per node. The two settings alternate
in one process (the first trace in a process also imports the tracing machinery: that
repeat is reported apart), and the graphs are checked to be the same code.

    python benchmarks/trace_time.py --out benchmarks/results/trace_time.md
"""

import argparse
import contextlib
from unittest import mock

import _provenance
import torch
from graph_simplify import model_entry

from pyro_implicit import compiled
from pyro_implicit.latent import LatentSpace

SETTINGS = ("a mode per node", "one mode")


def trace_all(name, rows, one_mode):
    """``(seconds spent tracing, the graphs' code)`` of one space scored at each row count."""
    model, args, kwargs, mpn = model_entry(name)
    mode = compiled._one_fake_mode if one_mode else contextlib.nullcontext
    with mock.patch.object(compiled, "_one_fake_mode", mode):
        space = LatentSpace.from_model(model, args, kwargs, mpn).compile("fx")
        for n in rows:
            u = space.init_loc + 0.1 * torch.randn(n, space.latent_dim, dtype=space.init_loc.dtype)
            space.score(u, args, kwargs, full_data=False)
    graphs = [g for g, _, _ in space.compiled._graphs.values()]
    return space.compiled.stats["trace_seconds"], [getattr(g, "code", None) for g in graphs]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="eight_schools,eight_schools_centered,stochastic_volatility,"
        "hierarchical_logistic,boston_bnn",
    )
    parser.add_argument("--rows", default="1,16,100,256", help="the signatures traced")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="results Markdown")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    rows = [int(r) for r in args.rows.split(",")]
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# Tracing a model's graphs: one fake-tensor mode against one per node",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), one torch thread, "
        f"float64; seconds to trace the graphs of {len(rows)} signatures ({args.rows} draws), "
        f"best of {args.repeats} alternating repeats.",
        "",
        "| model | a mode per node s | one mode s | ratio | same graphs |",
        "|---|---:|---:|---:|---|",
    ]
    names = list(filter(None, args.models.split(",")))
    # the first trace in a process also imports the tracing machinery: not either setting's
    warm_up, _ = trace_all(names[0], rows, one_mode=False)
    for name in names:
        seconds = {s: [] for s in SETTINGS}
        codes = {}
        for _ in range(args.repeats):
            for setting in SETTINGS:
                s, codes[setting] = trace_all(name, rows, setting == "one mode")
                seconds[setting].append(s)
        best = {k: min(v) for k, v in seconds.items()}
        lines.append(
            f"| {name} | {best[SETTINGS[0]]:.3f} | {best[SETTINGS[1]]:.3f} | "
            f"{best[SETTINGS[1]] / best[SETTINGS[0]]:.2f} | "
            f"{'yes' if codes[SETTINGS[0]] == codes[SETTINGS[1]] else 'NO'} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        f"The process's first traces ({names[0]}, a mode per node, not in the table) took "
        f"{warm_up:.2f} s: the one-time import of the tracing machinery, which a user's "
        "first fit in a session pays.",
    ]
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
