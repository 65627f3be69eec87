"""The traced graphs as traced against the same graphs simplified (``_simplify`` in
``pyro_implicit/compiled.py``): the model's score per call, the preconditioner's search,
and every implicit loss's SVI step.

A trace of a Pyro model records operations that its replay does not need: ``x * 1``,
``x + 0``, views to a tensor's own shape, fresh copies of constant data, sums nobody
reads. On small tensors every replayed node costs a few microseconds whatever it computes,
so removing them shortens each call. The two settings run in alternating repeats in one
process (``CompiledLogDensity.simplify`` switched), so load on the machine affects both
alike; the values are checked to be the same to the bit (scores, and the Gaussian the
search finds). One torch thread, float64 for the scores and the search (as the stiff
benchmark), float32 for the SVI steps (as ``compiled_score.py --only-losses``).

    python benchmarks/graph_simplify.py --out benchmarks/results/graph_simplify.md
"""

import argparse
import contextlib
import time
from unittest import mock

import _provenance
import compiled_score
import pyro
import torch
from stiff import MODELS as STIFF_MODELS

from pyro_implicit import compiled
from pyro_implicit.latent import LatentSpace, find_preconditioner
from pyro_implicit.models import load_model

SETTINGS = {"as traced": False, "simplified": True}


def model_entry(name):
    """``(model, args, kwargs, max_plate_nesting)`` of a stiff-benchmark model, a built-in
    one, or one of ``compiled_score.py``'s (hierarchical regression, Boston BNN), in the
    current default dtype."""
    if name in STIFF_MODELS:
        return STIFF_MODELS[name]()
    if name in ("hierarchical_logistic", "boston_bnn"):
        return compiled_score.models()[name]
    m = load_model(name)
    return m.model, m.args, m.kwargs, m.max_plate_nesting


@contextlib.contextmanager
def simplify(on, counts=None):
    """Graphs traced inside are simplified (``on``) or kept as traced; ``counts`` (a list)
    receives ``(nodes before, nodes after)`` of each simplified graph."""

    original = compiled._simplify

    def counting(graph_module):
        before = len(graph_module.graph.nodes)
        removed = original(graph_module)
        counts.append((before, before - removed))
        return removed

    with mock.patch.object(compiled.CompiledLogDensity, "simplify", on):
        if counts is None:
            yield
        else:
            with mock.patch.object(compiled, "_simplify", counting):
                yield


def time_scores(name, rows, calls, repeats, seed):
    """``{setting: ms per call}``, ``(nodes as traced, nodes simplified)`` and whether the
    two graphs gave the same scores to the bit."""
    model, args, kwargs, mpn = model_entry(name)
    gen = torch.Generator().manual_seed(seed)
    spaces, counts = {}, []
    for label, on in SETTINGS.items():
        space = LatentSpace.from_model(model, args, kwargs, mpn).compile("fx")
        with simplify(on, counts if on else None):
            u = space.init_loc + 0.1 * torch.randn(
                rows, space.latent_dim, generator=gen, dtype=space.init_loc.dtype
            )
            space.score(u, args, kwargs, full_data=False)
        spaces[label] = space
    u = spaces["simplified"].init_loc + 0.1 * torch.randn(
        rows, spaces["simplified"].latent_dim, generator=gen, dtype=u.dtype
    )
    outs = {}
    for label, space in spaces.items():
        pyro.set_rng_seed(seed)  # a subsampled model draws its minibatch from this stream
        outs[label] = space.score(u, args, kwargs, full_data=False)
    same = all(
        torch.equal(a, b) for a, b in zip(outs["as traced"], outs["simplified"], strict=True)
    )
    ms = {label: [] for label in SETTINGS}
    for _ in range(repeats):
        for label, space in spaces.items():
            start = time.perf_counter()
            for _ in range(calls):
                space.score(u, args, kwargs, full_data=False)
            ms[label].append(1000 * (time.perf_counter() - start) / calls)
    before = sum(c[0] for c in counts)
    after = sum(c[1] for c in counts)
    return {k: min(v) for k, v in ms.items()}, (before, after), same


def _factor(preconditioner):
    return preconditioner.scale_tril if preconditioner.kind == "dense" else preconditioner.scale


def time_search(name, repeats, seed):
    """``{setting: seconds}`` of :func:`find_preconditioner` and whether the two found the
    same Gaussian to the bit."""
    model, args, kwargs, mpn = model_entry(name)
    seconds, found = {label: [] for label in SETTINGS}, {}
    for _ in range(repeats):
        for label, on in SETTINGS.items():
            space = LatentSpace.from_model(model, args, kwargs, mpn)
            with simplify(on):
                start = time.perf_counter()
                found[label] = find_preconditioner(space, space.init_loc, args, kwargs, seed=seed)
                seconds[label].append(time.perf_counter() - start)
    a, b = found["as traced"], found["simplified"]
    same = a.kind == b.kind and torch.equal(a.loc, b.loc) and torch.equal(_factor(a), _factor(b))
    return {k: min(v) for k, v in seconds.items()}, same, a.source


def time_steps(name, loss, particles, steps, repeats, seed):
    """``{setting: (ms per step, set-up seconds)}`` of ``compiled_score.time_loss``."""
    model, args, kwargs, mpn = model_entry(name)
    out = {label: [] for label in SETTINGS}
    for _ in range(repeats):
        for label, on in SETTINGS.items():
            with simplify(on):
                ms, setup, _, _ = compiled_score.time_loss(
                    model, args, kwargs, mpn, loss, particles, steps, seed
                )
            out[label].append((ms, setup))
    return {k: (min(v[0] for v in vs), min(v[1] for v in vs)) for k, vs in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--score-models",
        default="eight_schools,eight_schools_centered,neals_funnel,banana,"
        "raw_scale_regression,stochastic_volatility,gp_hyperparameters,"
        "two_component_mixture,hierarchical_logistic,waveform_logistic,boston_bnn",
    )
    parser.add_argument("--rows", default="16,100", help="draws per score call")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument(
        "--search-models", default="eight_schools,eight_schools_centered,hierarchical_logistic"
    )
    parser.add_argument("--step-models", default="eight_schools,hierarchical_logistic")
    parser.add_argument(
        "--losses", default="autonormal,kivi-fx,stein-fx,asvgd-fx,gpvi-fx,sivi-fx,livi-fx"
    )
    parser.add_argument("--particles", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="results Markdown")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # the first optimiser built in a process imports torch._dynamo (about 1.4 s): not a cost
    # of either setting
    torch.optim.LBFGS([torch.zeros(1, requires_grad=True)])
    prov = _provenance.provenance(__file__, argv, vars(args))
    lines = [
        "# Traced graphs as traced against simplified",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), one torch thread; "
        f"best of {args.repeats} alternating repeats of each setting in one process.",
        "",
        f"## The score per call (float64, {args.calls} calls of `LatentSpace.score`)",
        "",
        "| model | draws | nodes as traced | nodes simplified | as traced ms | "
        "simplified ms | ratio | same bits |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    torch.set_default_dtype(torch.float64)
    for name in filter(None, args.score_models.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            ms, (before, after), same = time_scores(name, rows, args.calls, args.repeats, args.seed)
            lines.append(
                f"| {name} | {rows} | {before} | {after} | {ms['as traced']:.3f} | "
                f"{ms['simplified']:.3f} | {ms['simplified'] / ms['as traced']:.2f} | "
                f"{'yes' if same else 'NO'} |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "## The preconditioner's search (float64, `find_preconditioner` with its defaults)",
        "",
        "| model | found | as traced s | simplified s | ratio | same Gaussian to the bit |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in filter(None, args.search_models.split(",")):
        seconds, same, source = time_search(name, args.repeats, args.seed)
        lines.append(
            f"| {name} | {source} | {seconds['as traced']:.2f} | {seconds['simplified']:.2f} | "
            f"{seconds['simplified'] / seconds['as traced']:.2f} | {'yes' if same else 'NO'} |"
        )
        print(lines[-1], flush=True)
    torch.set_default_dtype(torch.float32)
    pyro.enable_validation(False)  # as compiled_score.py times the steps
    lines += [
        "",
        f"## SVI steps (float32, {args.particles} vectorised particles, ms per step after "
        f"5 set-up steps, {args.steps} steps; set-up: the seconds of the 5, the "
        "preconditioner's search among them)",
        "",
        "| model | loss | as traced ms | simplified ms | ratio | as traced set-up s | "
        "simplified set-up s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in filter(None, args.step_models.split(",")):
        for loss in args.losses.split(","):
            out = time_steps(name, loss, args.particles, args.steps, args.repeats, args.seed)
            (ms0, s0), (ms1, s1) = out["as traced"], out["simplified"]
            lines.append(
                f"| {name} | {loss} | {ms0:.2f} | {ms1:.2f} | {ms1 / ms0:.2f} | {s0:.2f} | "
                f"{s1:.2f} |"
            )
            print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
