"""The preconditioner's search on traced graphs against Pyro's eager runs, per stiff model.

:func:`~pyro_implicit.latent.find_preconditioner` evaluates the model thousands of times
(L-BFGS, then Gaussian variational fits in rounds). With ``compile="fx"`` (the default)
the MAP search and the Gaussian fits score the model with traced graphs; ``False`` runs
Pyro's handlers every time. The two are timed in alternating repeats in one process, so
load on the machine affects both alike, and the Gaussians they find are compared (the same
fit to float rounding is the claim). One torch thread, float64, the stiff benchmark's
models (``benchmarks/stiff.py``), seed 0.

    python benchmarks/preconditioner_search_time.py --models all --repeats 2 \\
        --out benchmarks/results/preconditioner_search_time.md
"""

import argparse
import time

import _provenance
import torch
from stiff import MODELS

from pyro_implicit.latent import LatentSpace, find_preconditioner

BACKENDS = {"eager": False, "fx": "fx"}


def search(name, compile):
    """``(seconds, preconditioner)`` of one search on stiff model ``name``."""
    model, args, kwargs, mpn = MODELS[name]()
    space = LatentSpace.from_model(model, args, kwargs, mpn)
    start = time.perf_counter()
    pre = find_preconditioner(space, space.init_loc, args, kwargs, compile=compile)
    return time.perf_counter() - start, pre


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all", help=f"comma-separated from {list(MODELS)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="results Markdown")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    # the first optimiser built in a process imports torch._dynamo (about 1.4 s here): not
    # the search's cost
    torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# The preconditioner's search: traced graphs against Pyro's eager runs",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), one thread, float64, "
        f"seed 0; seconds of `find_preconditioner` with `compile=False` (eager) and "
        f'`compile="fx"` (the default), best of {args.repeats} alternating repeats; '
        "`max loc diff` and `max L diff`: the largest difference between the two Gaussians "
        "found (location, Cholesky factor), against the largest entry of L.",
        "",
        "| model | D | source | vi steps | eager s | fx s | speed-up | max loc diff / max L |"
        " max L diff / max L |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        seconds = {k: [] for k in BACKENDS}
        found = {}
        for _ in range(args.repeats):
            for label, compile in BACKENDS.items():
                s, found[label] = search(name, compile)
                seconds[label].append(s)
        eager, fx = found["eager"], found["fx"]
        tril_e, tril_f = (
            p.scale_tril if p.kind == "dense" else torch.diag(p.scale) for p in (eager, fx)
        )
        scale = tril_e.abs().max().item()
        loc_diff = (eager.loc - fx.loc).abs().max().item() / scale
        tril_diff = (tril_e - tril_f).abs().max().item() / scale
        best = {k: min(v) for k, v in seconds.items()}
        line = (
            f"| {name} | {eager.loc.numel()} | {eager.source} | "
            f"{eager.diagnostics.get('gaussian_vi_steps', 0)} | {best['eager']:.2f} | "
            f"{best['fx']:.2f} | {best['eager'] / best['fx']:.2f}x | {loc_diff:.1e} | "
            f"{tril_diff:.1e} |"
        )
        lines.append(line)
        print(line, flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
