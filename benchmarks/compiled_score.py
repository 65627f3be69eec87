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
"""

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyro_implicit.datasets import data_available, load_uci  # noqa: E402
from pyro_implicit.latent import LatentSpace  # noqa: E402
from pyro_implicit.models import load_model  # noqa: E402

BACKENDS = ("eager", "fx", "inductor")


def _boston():
    from pyro_implicit.bnn import BNNRegression

    split = load_uci("boston", 0, dtype=torch.get_default_dtype())
    bnn = BNNRegression(split.x_train.shape[-1], hidden_dims=(50,))
    return bnn, (split.x_train, split.y_train), {"subsample_size": 100}, 1


def models():
    out = {}
    for name in ("eight_schools", "waveform_logistic"):
        m = load_model(name)
        out[name] = (m.model, m.args, m.kwargs, m.max_plate_nesting)
    if data_available():
        out["boston_bnn"] = _boston()
    return out


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


def time_loss(model, args, kwargs, mpn, name, particles, steps, seed):
    """ms per SVI step (after 5 warm-up steps) of ``name``: ``"autonormal"`` (AutoNormal +
    Trace_ELBO, vectorised particles), or ``"gpvi"`` / ``"asvgd"`` with ``compile`` False
    (``-eager``) or ``"fx"``."""
    from pyro.infer import SVI, Trace_ELBO
    from pyro.infer.autoguide import AutoNormal

    from pyro_implicit import (
        GPVI_ELBO,
        AmortizedSVGD_ELBO,
        ImplicitGuide,
        KernelRatioELBO,
        SteinScoreELBO,
    )
    from pyro_implicit.guides import gpvi_generator

    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    if name == "autonormal":
        guide = AutoNormal(model)
        loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=mpn)
    else:
        method, backend = name.split("-")
        compile = False if backend == "eager" else backend
        if method in ("kivi", "stein"):
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
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    for _ in range(5):  # set-up, preconditioner, vectorisation check, trace
        svi.step(*args, **kwargs)
    start = time.perf_counter()
    for _ in range(steps):
        svi.step(*args, **kwargs)
    return 1000 * (time.perf_counter() - start) / steps


LOSSES = ("autonormal", "gpvi-eager", "gpvi-fx", "asvgd-eager", "asvgd-fx")

#: ``--only-losses``: the implicit losses whose traced path skips the guide's trace too
KERNEL_LOSSES = (
    "autonormal",
    "kivi-eager",
    "kivi-fx",
    "stein-eager",
    "stein-fx",
    "asvgd-eager",
    "asvgd-fx",
    "gpvi-eager",
    "gpvi-fx",
)


def main_losses(args, command, commit):
    """The SVI-step table alone, for :data:`KERNEL_LOSSES` (``--only-losses``)."""
    rows = []
    for name, (model, margs, mkwargs, mpn) in models().items():
        losses = {n: float("inf") for n in KERNEL_LOSSES}
        for _ in range(args.repeats):
            for loss_name in KERNEL_LOSSES:
                if name == "boston_bnn" and loss_name.startswith("gpvi"):
                    continue  # D = 752: GPVI's helper network, not the score, sets its pace
                ms = time_loss(
                    model,
                    margs,
                    mkwargs,
                    mpn,
                    loss_name,
                    args.loss_particles,
                    args.calls // 2,
                    args.seed,
                )
                losses[loss_name] = min(losses[loss_name], ms)
        rows.append((name, losses))
        print(name, {n: f"{v:.2f} ms" for n, v in losses.items()}, flush=True)
    lines = [
        "# SVI steps of the implicit losses: Pyro traces against the traced graph",
        "",
        f"`{command}` (commit {commit}, {datetime.date.today()}), float32, "
        f"{args.threads} thread(s), {args.loss_particles} vectorised particles, ms per step "
        f"(best of {args.repeats} alternating repeats of {args.calls // 2} steps after 5), "
        "against AutoNormal + Trace_ELBO with as many particles. `kivi` = ImplicitGuide + "
        "KernelRatioELBO(), `stein` = ImplicitGuide + SteinScoreELBO(), `asvgd` = "
        "ImplicitGuide + AmortizedSVGD_ELBO(), `gpvi` = ImplicitGuide(generator="
        "gpvi_generator()) + GPVI_ELBO() (not on the BNN: its helper network sets the pace); "
        "`-fx`: after the "
        "first step the guide is drawn directly and its draws scored by the traced graph "
        "(`compile='fx'`, the default); `-eager`: every step traces the guide and the model "
        "through Pyro (`compile=False`, the code before this path).",
        "",
        "| model | " + " | ".join(KERNEL_LOSSES) + " |",
        "|---|" + "---:|" * len(KERNEL_LOSSES),
    ]
    methods = ("kivi", "stein", "asvgd", "gpvi")

    def cell(value, fmt):
        return "-" if value == float("inf") or value != value else format(value, fmt)

    for name, losses in rows:
        lines.append(
            f"| {name} | " + " | ".join(cell(losses[n], ".2f") for n in KERNEL_LOSSES) + " |"
        )
    lines += [
        "",
        "Speed-up of the traced path over Pyro traces (`-eager` / `-fx`), and each step "
        "against AutoNormal's (`-fx` / autonormal; the goal is at most 1.0):",
        "",
        "| model | "
        + " | ".join(f"{m} speed-up" for m in methods)
        + " | "
        + " | ".join(f"{m}-fx / autonormal" for m in methods)
        + " |",
        "|---|" + "---:|" * (2 * len(methods)),
    ]
    for name, losses in rows:
        base = losses["autonormal"]
        lines.append(
            f"| {name} | "
            + " | ".join(cell(losses[f"{m}-eager"] / losses[f"{m}-fx"], ".2f") for m in methods)
            + " | "
            + " | ".join(cell(losses[f"{m}-fx"] / base, ".2f") for m in methods)
            + " |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return rows


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
        "--only-losses",
        action="store_true",
        help="only the kernel losses' SVI steps (KernelRatioELBO, SteinScoreELBO)",
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
                if name == "boston_bnn" and loss_name.startswith("gpvi"):
                    continue  # D = 752: GPVI's helper network, not the score, sets its pace
                ms = time_loss(
                    model,
                    margs,
                    mkwargs,
                    mpn,
                    loss_name,
                    args.loss_particles,
                    args.calls // 2,
                    args.seed,
                )
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
