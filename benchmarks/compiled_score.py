"""Time per score of a model's latent space: eager Pyro against the traced graphs of
``LatentSpace.compile`` (``fx`` replay and ``inductor``), with the time to build them.

The score ``(log p(x, u), grad_u log p)`` of N particles is what particle methods, the
Stein discrepancy and the preconditioner's search evaluate over and over. Models:
eight schools (D = 10), the waveform logistic regression (D = 22) and the UCI Boston BNN
(13-50-1, D = 753, minibatches of 100 of its 455 rows). Each backend is timed in alternating
repeats in one process, so load on the machine affects all alike; the ratio is the
number to read.

Usage::

    python benchmarks/compiled_score.py --particles 100 --calls 200 --repeats 3 \\
        --out benchmarks/results/compiled_score.md
    python benchmarks/compiled_score.py --only-losses --loss-particles 100 --calls 200 \\
        --repeats 2 --out benchmarks/results/kernel_loss_steps.md
    python benchmarks/compiled_score.py --only-losses --loss-particles 100 --calls 200 \
        --repeats 2 --losses autonormal,stein-fx,asvgd-fx,kivi-fx \
        --numpyro-python /path/to/env-with-numpyro/bin/python \
        --out benchmarks/results/numpyro_steps.md
    python benchmarks/compiled_score.py --only-losses --device cuda --loss-particles 100 \
        --models hierarchical_logistic,boston_bnn --numpyro-python python3 \
        --out benchmarks/results/gpu_steps.md
"""

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import torch

from pyro_implicit.compiled import CompiledLogDensity
from pyro_implicit.datasets import data_available, load_uci
from pyro_implicit.latent import LatentSpace
from pyro_implicit.models import load_model

BACKENDS = ("eager", "fx", "inductor")


def _boston():
    from pyro_implicit.bnn import BNNRegression

    split = load_uci("boston", 0, dtype=torch.get_default_dtype())
    bnn = BNNRegression(split.x_train.shape[-1], hidden_dims=(50,))
    return bnn, (split.x_train, split.y_train), {"subsample_size": 100}, 1


HIER_GROUPS, HIER_FEATURES, HIER_ROWS = 8, 4, 400


def hierarchical_logistic_model(x, group, y=None):
    """Logistic regression with group-level coefficients: ``mu ~ N(0, 2^2)``, ``tau ~
    HalfNormal(1)`` per feature, ``beta_j ~ N(mu, tau^2)`` for each of the groups, and
    ``y_i ~ Bernoulli(sigmoid(x_i . beta_{group_i}))`` (written to broadcast over particle
    plates)."""
    features = x.shape[-1]
    mu = pyro.sample("mu", dist.Normal(x.new_zeros(()), 2.0).expand([features]).to_event(1))
    tau = pyro.sample("tau", dist.HalfNormal(x.new_ones(())).expand([features]).to_event(1))
    with pyro.plate("groups", HIER_GROUPS, dim=-1):
        beta = pyro.sample("beta", dist.Normal(mu, tau).to_event(1))
    with pyro.plate("data", x.shape[0], dim=-1):
        logits = (x * beta[..., group, :]).sum(-1)
        pyro.sample("obs", dist.Bernoulli(logits=logits), obs=y)


def hierarchical_logistic():
    """:func:`hierarchical_logistic_model` on simulated data (seed 0): 400 rows, 8 groups,
    an intercept and 3 covariates (D = 4 + 4 + 32 = 40)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(HIER_ROWS, HIER_FEATURES, generator=g)
    x[:, 0] = 1.0
    group = torch.arange(HIER_ROWS) % HIER_GROUPS
    mu = torch.tensor([-0.5, 1.0, -1.0, 0.5])
    beta = mu + 0.5 * torch.randn(HIER_GROUPS, HIER_FEATURES, generator=g)
    logits = (x * beta[group]).sum(-1)
    y = torch.bernoulli(torch.sigmoid(logits), generator=g)
    return hierarchical_logistic_model, (x, group, y), {}, 1


def models(device="cpu"):
    """``{name: (model, args, kwargs, max_plate_nesting)}`` with the data on ``device``."""
    out = {}
    for name in ("eight_schools", "waveform_logistic"):
        m = load_model(name)
        out[name] = (m.model, m.args, m.kwargs, m.max_plate_nesting)
    out["hierarchical_logistic"] = hierarchical_logistic()
    if data_available():
        out["boston_bnn"] = _boston()
    return {
        name: (model, tuple(_to(a, device) for a in margs), mkwargs, mpn)
        for name, (model, margs, mkwargs, mpn) in out.items()
    }


def _to(value, device):
    return value.to(device) if torch.is_tensor(value) else value


def _where(device):
    """The results file's words for the device the steps ran on."""
    if torch.device(device).type == "cuda":
        return f"on {torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"on the CPU (torch {torch.__version__})"


def _jax_where(device):
    return "on JAX's GPU platform" if torch.device(device).type == "cuda" else "one XLA thread"


def _synchronize(device):
    """Wait for queued GPU work, so a wall-clock interval holds all of it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_backend(space, backend, u, args, kwargs, calls):
    """``(ms per call, build seconds)``; the first call (which builds the graph) is not
    timed per call."""
    if backend != "eager":
        space.compile(backend)
    start = time.perf_counter()
    space.score(u, args, kwargs, full_data=False)
    build = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        space.score(u, args, kwargs, full_data=False)
    per_call = 1000 * (time.perf_counter() - start) / calls
    if backend != "eager" and not space.compiled.active:
        raise RuntimeError(f"{backend} fell back to eager: {space.compiled.fallback_reason}")
    return per_call, build


def time_svgd(model, args, kwargs, mpn, compile, particles, steps, seed):
    """``(ms per step, set-up seconds)`` of ``WeightSpaceSVGD(compile=...)``; set-up is the
    first step (preconditioner search, vectorisation check, trace or compile)."""
    from pyro_implicit import WeightSpaceSVGD

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    svgd = WeightSpaceSVGD(
        model,
        pyro.optim.Adam({"lr": 1e-2}),
        num_particles=particles,
        max_plate_nesting=mpn,
        compile=compile,
    )
    start = time.perf_counter()
    svgd.step(*args, **kwargs)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        svgd.step(*args, **kwargs)
    return 1000 * (time.perf_counter() - start) / steps, setup


def _loss_pair(model, mpn, name, particles):
    """``(guide, loss)`` of loss ``name`` (see :func:`time_loss`)."""
    from pyro.infer import Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    from pyro_implicit import (
        GPVI_ELBO,
        LIVI_ELBO,
        SIVI_ELBO,
        AmortizedSVGD_ELBO,
        ImplicitGuide,
        KernelRatioELBO,
        LinearizedGuide,
        SemiImplicitGuide,
        SteinScoreELBO,
    )
    from pyro_implicit.guides import gpvi_generator

    if name == "autonormal":
        guide = AutoNormal(model)
        loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=mpn)
    else:
        method, backend = name.split("-")
        compile = False if backend == "eager" else backend
        if method in ("livi", "livisvd"):
            guide = LinearizedGuide(model)
            bound = "svd" if method == "livisvd" else "det"
            loss = LIVI_ELBO(
                num_particles=particles, bound=bound, max_plate_nesting=mpn, compile=compile
            )
        elif method in ("sivi", "sividiag"):
            # `sivi` keeps the guide's default conditional; `sividiag` the paper's
            options = {"conditional": "diagonal"} if method == "sividiag" else {}
            guide = SemiImplicitGuide(model, **options)
            loss = SIVI_ELBO(
                num_particles=particles, num_mixing=100, max_plate_nesting=mpn, compile=compile
            )
        elif method in ("kivi", "stein"):
            cls = KernelRatioELBO if method == "kivi" else SteinScoreELBO
            guide = ImplicitGuide(model)
            loss = cls(num_particles=particles, max_plate_nesting=mpn, compile=compile)
        elif method == "gpvi":
            guide = ImplicitGuide(model, generator=gpvi_generator())
            loss = GPVI_ELBO(num_particles=particles, max_plate_nesting=mpn, compile=compile)
        else:
            guide = ImplicitGuide(model)
            loss = AmortizedSVGD_ELBO(
                num_particles=particles, max_plate_nesting=mpn, compile=compile
            )
    return guide, loss


def time_loss(model, args, kwargs, mpn, name, particles, steps, seed):
    """``(ms per SVI step after 5 warm-up steps, seconds of those 5 steps, seconds of them
    spent in torch.compile, seconds of them spent tracing the model's graph)`` of ``name``:
    ``"autonormal"`` (AutoNormal + Trace_ELBO, vectorised particles), or
    ``"METHOD-BACKEND"`` with METHOD one of kivi, stein, asvgd, gpvi, sivi, livi and
    BACKEND ``eager`` (``compile=False``), ``fx`` or ``inductor``. The warm-up holds the
    set-up: preconditioner search, vectorisation check, trace, compile."""
    from pyro.infer import SVI

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide, loss = _loss_pair(model, mpn, name, particles)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    start = time.perf_counter()
    with _recording_graphs() as graphs:
        for _ in range(5):  # set-up, preconditioner, vectorisation check, trace
            svi.step(*args, **kwargs)
    device = next((a.device for a in args if torch.is_tensor(a)), "cpu")
    _synchronize(device)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*args, **kwargs)
    _synchronize(device)
    compile_seconds = sum(g.stats["compile_seconds"] for g in graphs)
    trace_seconds = sum(g.stats["trace_seconds"] for g in graphs)
    return 1000 * (time.perf_counter() - start) / steps, setup, compile_seconds, trace_seconds


def _time_loss_of(entry, loss_name, args):
    """:func:`time_loss` of a :func:`models` entry at the command line's particles, steps
    (half of ``--calls``) and seed."""
    model, margs, mkwargs, mpn = entry
    return time_loss(
        model, margs, mkwargs, mpn, loss_name, args.loss_particles, args.calls // 2, args.seed
    )


@contextlib.contextmanager
def _recording_graphs():
    """The :class:`~pyro_implicit.compiled.CompiledLogDensity` objects built inside, as a
    list (their ``stats`` hold the seconds spent tracing and compiling)."""
    built = []
    original = CompiledLogDensity.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    CompiledLogDensity.__init__ = recording
    try:
        yield built
    finally:
        CompiledLogDensity.__init__ = original


LOSSES = ("autonormal", "gpvi-eager", "gpvi-fx", "asvgd-eager", "asvgd-fx")

#: ``--only-losses``: the implicit losses whose traced path skips the guide's trace too
METHODS = ("kivi", "stein", "asvgd", "gpvi", "sivi", "sividiag", "livi", "livisvd")
KERNEL_LOSSES = ("autonormal",) + tuple(
    f"{m}-{b}" for m in METHODS for b in ("eager", "fx", "inductor")
)
#: what ``--only-losses`` times unless ``--losses`` says otherwise
DEFAULT_LOSSES = tuple(n for n in KERNEL_LOSSES if not n.endswith("-inductor"))

#: steps of a default fit, against which a set-up's cost is weighed
DEFAULT_FIT_STEPS = 2000


def numpyro_steps(python, model_table, particles, steps, repeats, seed, device="cpu"):
    """NumPyro's jitted AutoNormal step on the same models and data
    (``benchmarks/numpyro_steps.py`` under the interpreter ``python``, which has JAX and
    NumPyro; on JAX's GPU platform when ``device`` is CUDA), as
    ``({model: {particles: {"ms_per_step", "compile_s"}}}, None)``, or ``(None, reason)``
    when it cannot run."""
    import json
    import tempfile

    import numpy as np

    if not python:
        return None, "no --numpyro-python given"
    arrays = {}
    y, sigma = model_table["eight_schools"][1]
    arrays.update(y=y.cpu().numpy(), sigma=sigma.cpu().numpy())
    if "boston_bnn" in model_table:
        _, (x, t), kwargs, _ = model_table["boston_bnn"]
        arrays.update(x=x.cpu().numpy(), t=t.cpu().numpy(), subsample_size=kwargs["subsample_size"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.npz"
        np.savez(path, **arrays)
        script = Path(__file__).with_name("numpyro_steps.py")
        cmd = [python, str(script), str(path), "--particles", str(particles)]
        cmd += ["--steps", str(steps), "--repeats", str(repeats), "--seed", str(seed)]
        platform = "cuda" if torch.device(device).type == "cuda" else "cpu"
        # JAX would otherwise take most of the GPU's memory beside torch's
        env = dict(os.environ, JAX_PLATFORMS=platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"{python} did not run: {e}"
    if done.returncode != 0:
        return None, f"{python} failed: {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1]), None


def main_losses(args, command, commit):
    """The SVI-step table alone, for the losses of ``--losses`` (any of
    :data:`KERNEL_LOSSES`), with each loss's set-up seconds, and with ``--numpyro-python``
    NumPyro's jitted step beside it."""
    chosen = [n.strip() for n in args.losses.split(",") if n.strip()]
    unknown = sorted(set(chosen) - set(KERNEL_LOSSES))
    if unknown:
        raise SystemExit(f"unknown --losses {unknown}; choose from {', '.join(KERNEL_LOSSES)}")
    if "autonormal" not in chosen:
        chosen.insert(0, "autonormal")
    rows, setups, failures = [], {}, {}
    model_table = all_models = models(args.device)
    if args.models:
        wanted = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(model_table))
        if unknown:
            raise SystemExit(f"unknown --models {unknown}; choose from {', '.join(model_table)}")
        model_table = {n: all_models[n] for n in wanted}
    for name, (model, margs, mkwargs, mpn) in model_table.items():
        losses = {n: float("inf") for n in chosen}
        setups[name] = {n: [] for n in chosen}
        for _ in range(args.repeats):
            for loss_name in chosen:
                if (name, loss_name) in failures:
                    continue
                try:
                    ms, setup, compiling, tracing = _time_loss_of(
                        (model, margs, mkwargs, mpn), loss_name, args
                    )
                except Exception as e:  # a cell that cannot run is reported, not hidden
                    traceback.print_exc()
                    failures[(name, loss_name)] = f"{type(e).__name__}: {e}".splitlines()[0]
                    continue
                losses[loss_name] = min(losses[loss_name], ms)
                setups[name][loss_name].append((setup, compiling, tracing))
        rows.append((name, losses))
        print(name, {n: f"{v:.2f} ms" for n, v in losses.items()}, flush=True)
    backends = [b for b in ("fx", "inductor") if any(n.endswith(f"-{b}") for n in chosen)]
    methods = [m for m in METHODS if any(n.startswith(f"{m}-") for n in chosen)]
    lines = [
        "# SVI steps of the implicit losses: Pyro traces against the traced graph",
        "",
        f"`{command}` (commit {commit}, {datetime.date.today()}), {_where(args.device)}, "
        f"float32, {args.threads} thread(s), {args.loss_particles} vectorised particles, "
        "ms per step "
        f"(best of {args.repeats} alternating repeats of {args.calls // 2} steps after 5), "
        "against AutoNormal + Trace_ELBO with as many particles. `kivi` = ImplicitGuide + "
        "KernelRatioELBO(), `stein` = ImplicitGuide + SteinScoreELBO(), `asvgd` = "
        "ImplicitGuide + AmortizedSVGD_ELBO(), `gpvi` = ImplicitGuide(generator="
        "gpvi_generator()) + GPVI_ELBO() (on the BNN, D = 752, the exact solve through the "
        "skip generator's 92 x 92 block), "
        "`sivi` = SemiImplicitGuide + SIVI_ELBO(num_mixing=100) (its default, mixed conditional "
        "since f4cc951; `sividiag`: `conditional='diagonal'`), `livi` = LinearizedGuide + "
        "LIVI_ELBO() (`bound='det'`, whole Jacobians), `livisvd` = the same with "
        "`bound='svd'` (LOBPCG, no whole Jacobian: the BNN setting); "
        "`-fx`: after the "
        "first step the guide is drawn directly and its draws scored by the traced graph "
        "(`compile='fx'`, the default); `-inductor`: that graph also compiled by "
        "`torch.compile` (`compile='inductor'`); `-eager`: every step traces the guide and "
        "the model through Pyro (`compile=False`, the code before this path). "
        "`hierarchical_logistic`: 400 simulated rows, 8 groups, 4 coefficients per group "
        "(D = 40; `hierarchical_logistic_model` in this script).",
        "",
        "| model | " + " | ".join(chosen) + " |",
        "|---|" + "---:|" * len(chosen),
    ]

    def cell(value, fmt):
        return "-" if value == float("inf") or value != value else format(value, fmt)

    def get(losses, key):
        return losses.get(key, float("inf"))

    for name, losses in rows:
        lines.append(f"| {name} | " + " | ".join(cell(losses[n], ".2f") for n in chosen) + " |")
    columns = [(m, b) for b in backends for m in methods]
    lines += [
        "",
        "Speed-up over Pyro traces (`-eager` / `-fx`, `-eager` / `-inductor`), and each step "
        "against AutoNormal's (the goal is at most 1.0):",
        "",
        "| model | "
        + " | ".join(f"{m}-{b} speed-up" for m, b in columns)
        + " | "
        + " | ".join(f"{m}-{b} / autonormal" for m, b in columns)
        + " |",
        "|---|" + "---:|" * (2 * len(columns)),
    ]
    for name, losses in rows:
        base = losses["autonormal"]
        lines.append(
            f"| {name} | "
            + " | ".join(
                cell(get(losses, f"{m}-eager") / get(losses, f"{m}-{b}"), ".2f") for m, b in columns
            )
            + " | "
            + " | ".join(cell(get(losses, f"{m}-{b}") / base, ".2f") for m, b in columns)
            + " |"
        )
    if "inductor" in backends:
        lines += [
            "",
            "Compile time of `-inductor`, apart from the steps: the seconds `torch.compile` "
            "took (first to last repeat; a repeat can reuse inductor's caches, as a user's "
            "next fit in the same process or on the same machine does), and that cost as a "
            f"share of a default fit ({DEFAULT_FIT_STEPS} steps at the `-inductor` step time "
            "plus the five set-up steps, which also hold the preconditioner search; the "
            "goal is below 10%). The first compile in a process also loads the compiler, "
            "and is in the first model's first repeat.",
            "",
            "| model | " + " | ".join(f"{m} compile s | {m} share" for m in methods) + " |",
            "|---|" + "---:|" * (2 * len(methods)),
        ]
        for name, losses in rows:
            cells = []
            for m in methods:
                runs = setups[name].get(f"{m}-inductor")
                if not runs:
                    cells += ["-", "-"]
                    continue
                seconds = [c for _, c, _ in runs]
                shares = [
                    100 * c / (s + DEFAULT_FIT_STEPS * get(losses, f"{m}-inductor") / 1000)
                    for s, c, _ in runs
                ]
                cells += [
                    f"{seconds[0]:.2f} -> {seconds[-1]:.2f}",
                    f"{shares[0]:.0f}% -> {shares[-1]:.0f}%",
                ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if "fx" in backends:
        lines += [
            "",
            "Set-up of `-fx` (the default), apart from the steps: the seconds of the five "
            "set-up steps (the preconditioner's search, the vectorisation check, and the "
            "trace of the model's graph), the seconds spent tracing graphs (the search's "
            "and the step's), and the set-up as a share "
            f"of a default fit ({DEFAULT_FIT_STEPS} steps at the `-fx` step time plus the "
            "set-up); best of the repeats.",
            "",
            "| model | "
            + " | ".join(f"{m} set-up s | {m} trace s | {m} share" for m in methods)
            + " |",
            "|---|" + "---:|" * (3 * len(methods)),
        ]
        for name, losses in rows:
            cells = []
            for m in methods:
                runs = setups[name].get(f"{m}-fx")
                if not runs:
                    cells += ["-", "-", "-"]
                    continue
                setup, _, tracing = min(runs)
                fit = setup + DEFAULT_FIT_STEPS * get(losses, f"{m}-fx") / 1000
                cells += [f"{setup:.2f}", f"{tracing:.2f}", f"{100 * setup / fit:.0f}%"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if failures:
        lines += ["", "Cells that failed (shown as `-` above):", ""]
        lines += [f"- {name}, {loss}: `{why}`" for (name, loss), why in failures.items()]
    lines += numpyro_lines(args, all_models, rows)  # NumPyro's script reads them all
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


def numpyro_lines(args, model_table, rows):
    """The NumPyro comparison of :func:`main_losses`'s results file, or the reason it is
    missing."""
    steps = args.calls // 2
    measured, reason = numpyro_steps(
        args.numpyro_python,
        model_table,
        args.loss_particles,
        steps,
        args.repeats,
        args.seed,
        args.device,
    )
    if measured is None:
        return ["", f"NumPyro row skipped: {reason}."]
    n = str(args.loss_particles)
    versions = ", ".join(f"{k} {v}" for k, v in measured["versions"].items())
    timed = {m for _, losses in rows for m, v in losses.items() if v < float("inf")}
    fx = [m for m in KERNEL_LOSSES if not m.endswith(("-eager", "autonormal")) and m in timed]
    lines = [
        "",
        f"NumPyro ({versions}) in the same run: `jax.jit(SVI.update)` of AutoNormal + "
        f"Trace_ELBO(num_particles={n}, vectorize_particles=True) on the same model and data "
        f"(`benchmarks/numpyro_steps.py`, {_jax_where(args.device)}, best of {args.repeats} "
        f"repeats of {steps} steps after the compiling step and 5 more); the goal is at "
        "most 3x on eight schools and below 1x on the BNN:",
        "",
        "| model | numpyro 1 particle ms | numpyro ms | compile s | autonormal / numpyro | "
        + " | ".join(f"{m} / numpyro" for m in fx)
        + " |",
        "|---|" + "---:|" * (4 + len(fx)),
    ]
    for name, losses in rows:
        if name not in measured:
            continue
        ref = measured[name][n]["ms_per_step"]
        one = measured[name]["1"]["ms_per_step"]

        def ratio(value, ref=ref):
            return "-" if value == float("inf") else f"{value / ref:.1f}"

        lines.append(
            f"| {name} | {one:.3f} | {ref:.3f} | {measured[name][n]['compile_s']:.1f} | "
            f"{ratio(losses['autonormal'])} | " + " | ".join(ratio(losses[m]) for m in fx) + " |"
        )
    return lines


def optimizer_floor(model, args, kwargs, mpn, name, particles, calls, seed):
    """``(ms per SVI step, ms per optimiser call, parameter tensors)`` of loss ``name`` (as
    :func:`time_loss`): the optimiser call is ``pyro.optim.Adam`` stepping the parameters
    an SVI step updates, with their last gradients, alone; Pyro keeps one torch optimiser
    per tensor."""
    from pyro.infer import SVI

    step_ms = time_loss(model, args, kwargs, mpn, name, particles, calls, seed)[0]
    # time_loss leaves its guide's parameters in the store; rebuild the step to reach them
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide, loss = _loss_pair(model, mpn, name, particles)
    optim = pyro.optim.Adam({"lr": 1e-3})
    svi = SVI(model, guide, optim, loss)
    for _ in range(5):
        svi.step(*args, **kwargs)
    with poutine.trace(param_only=True) as tr:
        loss.loss_and_grads(model, guide, *args, **kwargs)
    params = [site["value"].unconstrained() for site in tr.trace.nodes.values()]
    start = time.perf_counter()
    for _ in range(calls):
        optim(params)
    return step_ms, 1000 * (time.perf_counter() - start) / calls, len(params)


def main_optimizer_floor(args, command, commit):
    """``--optimizer-floor``: how much of each step Pyro's per-tensor optimiser takes."""
    lines = [
        "# Pyro's optimiser in a step",
        "",
        f"`{command}` (commit {commit}, {datetime.date.today()}), float32, {args.threads} "
        f"thread(s), {args.loss_particles} vectorised particles. Step: ms per SVI step "
        f"(as `--only-losses`, {args.calls // 2} steps after 5); optimiser: ms per call of "
        "`pyro.optim.Adam` on the parameter tensors the step updates, with their last "
        f"gradients ({args.calls} calls); Pyro keeps one torch optimiser per tensor.",
        "",
        "| model | loss | tensors | step ms | optimiser ms | optimiser share |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, (model, margs, mkwargs, mpn) in models().items():
        for loss_name in args.losses.split(","):
            step, opt, count = optimizer_floor(
                model, margs, mkwargs, mpn, loss_name, args.loss_particles, args.calls, args.seed
            )
            lines.append(
                f"| {name} | {loss_name} | {count} | {step:.2f} | {opt:.3f} | "
                f"{100 * opt / step:.0f}% |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--particles", type=int, default=100)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument(
        "--loss-particles",
        type=int,
        default=64,
        help="particles of the SVI losses (GPVI's and amortised SVGD's default)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="Markdown results file")
    p.add_argument(
        "--device",
        default="cpu",
        help="with --only-losses, where the models' data live (and so every step runs): "
        "cpu or cuda; NumPyro then runs on JAX's matching platform",
    )
    p.add_argument(
        "--only-losses",
        action="store_true",
        help="only the kernel losses' SVI steps (KernelRatioELBO, SteinScoreELBO)",
    )
    p.add_argument(
        "--losses",
        default=",".join(DEFAULT_LOSSES),
        help="with --only-losses, which of them to time (autonormal always): "
        + ", ".join(KERNEL_LOSSES),
    )
    p.add_argument(
        "--models",
        help="with --only-losses, which models to time (comma-separated; default: all)",
    )
    p.add_argument(
        "--optimizer-floor",
        action="store_true",
        help="time Pyro's optimiser call alone against the whole step, for --losses",
    )
    p.add_argument(
        "--numpyro-python",
        help="with --only-losses, an interpreter with JAX and NumPyro: time NumPyro's "
        "jitted AutoNormal step on the same models in the same run",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(args.seed)
    command = "python benchmarks/compiled_score.py " + " ".join(argv or sys.argv[1:])
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    if args.optimizer_floor:
        return main_optimizer_floor(args, command, commit)
    if args.only_losses:
        return main_losses(args, command, commit)
    rows = []
    for name, (model, margs, mkwargs, mpn) in models().items():
        best = {b: float("inf") for b in BACKENDS}
        builds = {b: [] for b in BACKENDS}
        for _ in range(args.repeats):
            for backend in BACKENDS:
                # a fresh space per repeat: the build (trace, compile) is measured each time
                space = LatentSpace.from_model(model, margs, mkwargs, mpn)
                u = 0.1 * torch.randn(args.particles, space.latent_dim)
                ms, build = time_backend(space, backend, u, margs, mkwargs, args.calls)
                best[backend] = min(best[backend], ms)
                builds[backend].append(build)
        steps = {b: float("inf") for b in BACKENDS}
        setups = {b: [] for b in BACKENDS}
        for _ in range(args.repeats):
            for backend in BACKENDS:
                ms, setup = time_svgd(
                    model,
                    margs,
                    mkwargs,
                    mpn,
                    False if backend == "eager" else backend,
                    args.particles,
                    args.calls,
                    args.seed,
                )
                steps[backend] = min(steps[backend], ms)
                setups[backend].append(setup)
        losses = {n: float("inf") for n in LOSSES}
        for _ in range(args.repeats):
            for loss_name in LOSSES:
                ms = _time_loss_of((model, margs, mkwargs, mpn), loss_name, args)[0]
                losses[loss_name] = min(losses[loss_name], ms)
        rows.append((name, space.latent_dim, best, builds, steps, setups, losses))
        print(
            name,
            {b: f"{v:.3f} ms" for b, v in best.items()},
            {b: f"{v:.3f} ms" for b, v in steps.items()},
            flush=True,
        )
    lines = [
        "# Score of N particles: eager Pyro against traced graphs",
        "",
        f"`{command}` (commit {commit}, {datetime.date.today()}), float32, "
        f"{args.threads} thread(s), N = {args.particles} particles, minibatch scores "
        f"(`full_data=False`), best of {args.repeats} alternating repeats of {args.calls} "
        "calls. Build: the first call, which traces (fx) or traces and compiles (inductor); "
        "for eager, its first call. The first inductor build in a process also loads the "
        "compiler.",
        "",
        "| model | D | eager ms | fx ms | inductor ms | fx speed-up | inductor speed-up | "
        "fx build s | inductor build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, dim, best, builds, _, _, _ in rows:
        lines.append(
            f"| {name} | {dim} | {best['eager']:.3f} | {best['fx']:.3f} | "
            f"{best['inductor']:.3f} | {best['eager'] / best['fx']:.1f}x | "
            f"{best['eager'] / best['inductor']:.1f}x | "
            f"{min(builds['fx']):.2f}-{max(builds['fx']):.2f} | "
            f"{min(builds['inductor']):.1f}-{max(builds['inductor']):.1f} |"
        )
    lines += [
        "",
        f"`WeightSpaceSVGD(model, Adam(1e-2), num_particles={args.particles}, compile=...)`, "
        f"ms per step (best of {args.repeats} alternating repeats of {args.calls} steps after "
        "the first) and the first step's seconds (preconditioner search, vectorisation "
        "check, trace or compile):",
        "",
        "| model | eager ms/step | fx ms/step | inductor ms/step | fx speed-up | "
        "inductor speed-up | first step s (eager / fx / inductor) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, _, _, _, steps, setups, _ in rows:
        lines.append(
            f"| {name} | {steps['eager']:.2f} | {steps['fx']:.2f} | {steps['inductor']:.2f} | "
            f"{steps['eager'] / steps['fx']:.1f}x | {steps['eager'] / steps['inductor']:.1f}x | "
            + " / ".join(f"{min(setups[b]):.1f}" for b in BACKENDS)
            + " |"
        )
    lines += [
        "",
        f"SVI steps with {args.loss_particles} vectorised particles, ms per step (best of "
        f"{args.repeats} alternating repeats of {args.calls // 2} steps after 5), against "
        "AutoNormal + Trace_ELBO with as many particles; `-fx`: the functional-gradient "
        "losses score the draws with the traced graph (`compile='fx'`, the default), "
        "`-eager`: with a Pyro trace of the model (`compile=False`):",
        "",
        "| model | "
        + " | ".join(LOSSES)
        + " | "
        + " | ".join(f"{n} / autonormal" for n in LOSSES[1:])
        + " |",
        "|---|" + "---:|" * (2 * len(LOSSES) - 1),
    ]
    for name, *_, losses in rows:
        base = losses["autonormal"]
        lines.append(
            f"| {name} | "
            + " | ".join("-" if losses[n] == float("inf") else f"{losses[n]:.2f}" for n in LOSSES)
            + " | "
            + " | ".join(
                "-" if losses[n] == float("inf") else f"{losses[n] / base:.2f}" for n in LOSSES[1:]
            )
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


if __name__ == "__main__":
    main()
