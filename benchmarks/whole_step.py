"""What a compiled *whole* SVI step would buy: a probe, not a library path.

The library's ``compile="fx"`` / ``"inductor"`` trace the model's log-density only; the
guide's draw, the entropy estimator, the backward pass and the optimiser still run as
eager PyTorch, op by op. NumPyro jits all of it into one XLA program. This probe traces the
whole step instead (``make_fx`` of the loss, its gradient in the guide's parameters and an
Adam update, replayed as one graph, optionally compiled by ``torch.compile``) and times it
against the library's step, to measure how far that design could go before anyone
builds it.

To be traceable the step runs with the library's per-step checks off: the finiteness and
divergence checks, and every ``.item()`` and ``float()`` of a tensor (diagnostics) gives NaN
while tracing. The graph is therefore not a usable fit (it would not stop a diverging one);
only its time is read.
Each timing is the best of ``--repeats`` alternating repeats of ``--steps`` steps, after
five warm-up steps, in one process.

On a GPU (``--device cuda``) a step of either kind is hundreds of small kernel launches;
``--modes default,reduce-overhead`` also times the compiled graph replayed as one CUDA
graph (``torch.compile(mode="reduce-overhead")``), which removes the launches, and
``--numpyro-python`` puts NumPyro's jitted AutoNormal step of the same run beside it.
The graph's state (the step count and Adam's moments) and the parameters stay in the same
tensors from step to step, written in place, as a CUDA graph needs.

Usage::

    python benchmarks/whole_step.py --models eight_schools,boston_bnn \\
        --losses autonormal,sivi,stein,asvgd --out benchmarks/results/whole_step.md
    python benchmarks/whole_step.py --device cuda --modes default,reduce-overhead \\
        --numpyro-python python3 --out $OUT/whole_step_gpu.md
"""

import argparse
import contextlib
import time

import _provenance
import compiled_score
import pyro
import pyro.infer.trace_elbo
import torch
from pyro.infer import SVI
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_implicit.elbo.base import ImplicitELBO

ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}

#: losses left out on the Boston BNN (D = 752), and why
SKIPPED_ON_THE_BNN = {
    "livi": "100 whole Jacobians per step: tracing them ran out of 24 GB",
    "gpvi": "its helper network, not the step's overhead, sets its pace (compiled_score.py)",
}


@contextlib.contextmanager
def checks_off():
    """The step without the Python reads a graph cannot follow (see the module docstring)."""
    saved = (ImplicitELBO._compiled_score, ImplicitELBO._check_divergence, torch.Tensor.item)
    nan_check = pyro.infer.trace_elbo.warn_if_nan
    to_float = torch.Tensor.__float__

    def score(self, space, u, args, kwargs):
        return space.score(u.detach(), args, kwargs, full_data=False)

    ImplicitELBO._compiled_score = score
    ImplicitELBO._check_divergence = lambda self, loss: None
    torch.Tensor.item = torch.Tensor.__float__ = lambda self: float("nan")
    pyro.infer.trace_elbo.warn_if_nan = lambda value, *args, **kwargs: value
    try:
        with pyro.validation_enabled(False):
            yield
    finally:
        ImplicitELBO._compiled_score, ImplicitELBO._check_divergence, torch.Tensor.item = saved
        pyro.infer.trace_elbo.warn_if_nan = nan_check
        torch.Tensor.__float__ = to_float


def whole_step_graph(model, guide, loss, args, kwargs, device="cpu"):
    """``(graph, state, params)``: the traced step ``(t, *m, *v) -> (loss, t, params, m,
    v)`` over the param store's tensors, its Adam state, and the tensors it updates."""
    store = pyro.get_param_store()
    params = [store._params[name] for name in sorted(store.keys())]
    lr, (b1, b2), eps = ADAM["lr"], ADAM["betas"], ADAM["eps"]

    def step(t, *moments):
        m, v = moments[: len(params)], moments[len(params) :]
        value = loss.differentiable_loss(model, guide, *args, **kwargs)
        grads = torch.autograd.grad(value, params, allow_unused=True)
        t = t + 1
        new = ([], [], [])
        for p, g, mi, vi in zip(params, grads, m, v, strict=True):
            g = torch.zeros_like(p) if g is None else g
            mi = b1 * mi + (1 - b1) * g
            vi = b2 * vi + (1 - b2) * g * g
            update = lr * (mi / (1 - b1**t)) / ((vi / (1 - b2**t)).sqrt() + eps)
            for out, x in zip(new, (p.detach() - update, mi, vi), strict=True):
                out.append(x)
        return value.detach(), t, *new

    state = [torch.zeros((), device=device)] + [torch.zeros_like(p) for p in params]
    state += [torch.zeros_like(p) for p in params]  # m, then v
    with checks_off():
        graph = make_fx(step)(*state)
    return graph, state, params


def replay(graph, state, params, steps):
    """Run ``steps`` steps of the graph, writing the new state and parameters back into
    the same tensors (a CUDA graph reads its inputs from fixed addresses)."""
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        _, t, new_params, m, v = graph(*state)
        with torch.no_grad():
            for old, new in zip(state, [t, *m, *v], strict=True):
                old.copy_(new)
            for p, q in zip(params, new_params, strict=True):
                p.copy_(q)


def time_loss(name, model, args, kwargs, mpn, particles, steps, repeats, modes, device):
    """ms per step of the library's SVI step, the whole-step graph replayed, and the
    whole-step graph compiled by inductor in each of ``modes``, with the trace and compile
    seconds."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    method = name if name == "autonormal" else f"{name}-fx"
    guide, loss = compiled_score._loss_pair(model, mpn, method, particles)
    svi = SVI(model, guide, pyro.optim.Adam(dict(ADAM)), loss)
    for _ in range(5):  # set-up: preconditioner, checks, the log-density's trace
        svi.step(*args, **kwargs)
    start = time.perf_counter()
    graph, state, params = whole_step_graph(model, guide, loss, args, kwargs, device)
    trace_s = time.perf_counter() - start
    runs = {
        "svi": lambda k: [svi.step(*args, **kwargs) for _ in range(k)],
        "graph": lambda k: replay(graph, state, params, k),
    }
    compile_s = {}
    for mode in modes:
        torch._dynamo.reset()
        start = time.perf_counter()
        compiled = torch.compile(graph, dynamic=False, mode=None if mode == "default" else mode)
        replay(compiled, state, params, 3)  # cudagraph trees record on the third call
        compiled_score._synchronize(device)
        compile_s[mode] = time.perf_counter() - start
        runs[mode] = lambda k, compiled=compiled: replay(compiled, state, params, k)
    best = {key: float("inf") for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            run(5)
            compiled_score._synchronize(device)
            start = time.perf_counter()
            run(steps)
            compiled_score._synchronize(device)
            best[key] = min(best[key], 1000 * (time.perf_counter() - start) / steps)
    nodes = sum(1 for _ in graph.graph.nodes)
    return {"ms": best, "trace_s": trace_s, "compile_s": compile_s, "nodes": nodes}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="eight_schools,boston_bnn")
    parser.add_argument("--losses", default="autonormal,sivi,stein,asvgd")
    parser.add_argument("--particles", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--modes",
        default="default",
        help="comma-separated torch.compile modes of the whole-step graph (reduce-overhead: "
        "replayed as a CUDA graph, on a GPU only)",
    )
    parser.add_argument(
        "--numpyro-python",
        help="an interpreter with JAX and NumPyro: their jitted AutoNormal step beside ours",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    modes = [m for m in args.modes.split(",") if m]
    if "reduce-overhead" in modes and torch.device(args.device).type != "cuda":
        raise SystemExit("--modes reduce-overhead replays CUDA graphs: use it with --device cuda")
    prov = _provenance.provenance(__file__, argv, vars(args))
    table = compiled_score.models(args.device)
    mode_cols = [f"{m} ms" for m in modes]
    lines = [
        "# A compiled whole SVI step: how far it could go (a probe)",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), "
        f"{compiled_score._where(args.device)}, float32, one thread, "
        f"{args.particles} particles, Adam(lr 1e-3); ms per step, best of {args.repeats} "
        f"alternating repeats of {args.steps} steps. `svi`: the library's step "
        "(`compile='fx'`, Pyro's `SVI`); `graph`: the whole step (draw, loss, gradient, Adam) "
        "traced by `make_fx` and replayed; then that graph compiled by `torch.compile` in "
        "each mode (`default`: inductor's kernels; `reduce-overhead`: those kernels replayed "
        "as one CUDA graph). The traced step runs with the per-step checks off (module "
        "docstring): a timing, not a usable fit. Models and losses as in "
        "`compiled_score.py --only-losses` (`autonormal`: AutoNormal + Trace_ELBO).",
        "",
        "| model | loss | svi ms | graph ms | "
        + " | ".join(mode_cols)
        + " | svi / best compiled | graph nodes | trace s | "
        + " | ".join(f"{m} compile s" for m in modes)
        + " |",
        "|---|---|---:|---:|" + "---:|" * (2 * len(modes) + 3),
    ]
    for model_name in args.models.split(","):
        model, margs, mkwargs, mpn = table[model_name]
        for name in args.losses.split(","):
            if model_name == "boston_bnn" and name in SKIPPED_ON_THE_BNN:
                lines.append(f"| {model_name} | {name} | skipped: {SKIPPED_ON_THE_BNN[name]} |")
                continue
            try:
                r = time_loss(
                    name,
                    model,
                    margs,
                    mkwargs,
                    mpn,
                    args.particles,
                    args.steps,
                    args.repeats,
                    modes,
                    args.device,
                )
            except Exception as e:  # noqa: BLE001 - a probe reports what does not trace
                first = str(e).strip().splitlines()[0][:120]
                lines.append(f"| {model_name} | {name} | fails: {type(e).__name__}: {first} |")
                print(lines[-1], flush=True)
                continue
            ms = r["ms"]
            best = min((ms[m] for m in modes), default=float("nan"))
            lines.append(
                f"| {model_name} | {name} | {ms['svi']:.3f} | {ms['graph']:.3f} | "
                + " | ".join(f"{ms[m]:.3f}" for m in modes)
                + f" | {ms['svi'] / best:.2f} | {r['nodes']} | {r['trace_s']:.1f} | "
                + " | ".join(f"{r['compile_s'][m]:.1f}" for m in modes)
                + " |"
            )
            print(lines[-1], flush=True)
    if args.numpyro_python:
        lines += ["", *numpyro_lines(args, table)]
    _provenance.write_result("\n".join(lines) + "\n", args.out)


def numpyro_lines(args, table):
    """NumPyro's jitted AutoNormal step on the same models, in the same run."""
    found, reason = compiled_score.numpyro_steps(
        args.numpyro_python, table, args.particles, args.steps, args.repeats, 0, args.device
    )
    if found is None:
        return [f"NumPyro row skipped: {reason}."]
    lines = [
        f"NumPyro's jitted `SVI.update` of AutoNormal + Trace_ELBO(num_particles="
        f"{args.particles}, vectorize_particles=True) in the same run "
        f"(`benchmarks/numpyro_steps.py`, {compiled_score._jax_where(args.device)}):",
        "",
        "| model | numpyro ms | compile s |",
        "|---|---:|---:|",
    ]
    for model_name, by_particles in found.items():
        row = by_particles.get(str(args.particles)) or by_particles.get(args.particles)
        if row:
            lines.append(f"| {model_name} | {row['ms_per_step']:.3f} | {row['compile_s']:.1f} |")
    return lines


if __name__ == "__main__":
    main()
