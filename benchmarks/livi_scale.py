"""Cost of LIVI as the posterior grows: time per step and peak memory of L'' (eq. 18) for
D = 10^4 ... 10^7 latent dimensions, and of L' (eq. 15) against L'' as the noise size d
grows (Uppal et al. 2023, Sec. 4 and App. C-D).

The model is a BNN regression (:class:`pyro_implicit.bnn.BNNRegression`, 10 inputs, two
ReLU hidden layers of width H, fixed noise) with H chosen so that it has about D weights;
the data are 100 random points, one full batch per step. The guide is
:class:`~pyro_implicit.guides.LinearizedGuide` with the paper's correlated
matrix-multiplication generator (``generator="scalable"``; the paper's raw-space
settings pinned: ``precondition=False``), trained by
:class:`~pyro_implicit.elbo.LIVI_ELBO` with S = 2 draws per step (the paper's 1-2) and
Adam, in float32.

Each configuration runs in a fresh subprocess. Peak memory is
:class:`~pyro_implicit.diagnostics.PeakMemory` around building the guide and all steps
(so it covers the generator, Adam's state and every temporary), on top of the model and
data. Time per step is the mean over ``--steps`` steps after one warm-up step.

Usage::

    python benchmarks/livi_scale.py --out benchmarks/results/livi_scale.json \\
        --figure benchmarks/results/figures/livi_scale.png
    python benchmarks/livi_scale.py --smoke          # seconds; what the tests run
"""

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

#: latent sizes of the D sweep (L'') and of the d sweep (L' against L'')
DIMS = [10**4, 10**5, 10**6, 10**7]
NOISE_DIMS = [16, 64, 256, 1024]
D_FOR_NOISE_SWEEP = 10**4
IN_DIM = 10


def width_for(dim):
    """Hidden width H of a 10 -> H -> H -> 1 MLP with about ``dim`` weights (biases
    included): (10 + 1) H + (H + 1) H + H + 1 = H^2 + 13 H + 1."""
    return max(1, round((-13 + math.sqrt(169 - 4 * (1 - dim))) / 2))


def worker(dim, noise_dim, bound, steps, seed):
    """One configuration, in this process; returns a dict of measurements."""
    import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
    import pyro
    import torch
    from pyro.infer import SVI

    from pyro_implicit import LIVI_ELBO, LinearizedGuide
    from pyro_implicit.bnn import BNNRegression
    from pyro_implicit.diagnostics.memory import PeakMemory

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    pyro.set_rng_seed(seed)
    x = torch.randn(100, IN_DIM)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(100)
    model = BNNRegression(
        IN_DIM, hidden_dims=(width_for(dim),) * 2, precision_prior=None, noise_scale=0.1
    )
    latent_dim = model.num_weights
    # a throw-away step on a tiny network first, so lazy imports (torch.func, ...) and
    # one-off buffers are not counted as this configuration's memory
    tiny = BNNRegression(IN_DIM, hidden_dims=(2, 2), precision_prior=None, noise_scale=0.1)
    SVI(
        tiny,
        LinearizedGuide(tiny, generator="scalable", noise_dim=4, precondition=False),
        pyro.optim.Adam({}),
        LIVI_ELBO(bound=bound, max_plate_nesting=1),
    ).step(x, y)
    pyro.clear_param_store()
    with PeakMemory() as memory:
        start = time.perf_counter()
        guide = LinearizedGuide(
            model, generator="scalable", noise_dim=noise_dim, precondition=False
        )  # the paper's raw weight space
        loss = LIVI_ELBO(
            num_particles=2, bound=bound, max_plate_nesting=1, check_vectorization=False
        )
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-4}), loss)
        svi.step(x, y)  # builds the generator and Adam's state
        setup = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            value = svi.step(x, y)
        seconds = (time.perf_counter() - start) / steps
    num_params = sum(p.numel() for p in guide.parameters())
    return {
        "bound": bound,
        "latent_dim": latent_dim,
        "noise_dim": guide.noise_dim,
        "width": width_for(dim),
        "generator_params": num_params,
        "seconds_per_step": seconds,
        "setup_seconds": setup,
        "peak_mb": memory.peak_mb,
        "loss_finite": math.isfinite(value),
    }


def run(dim, noise_dim, bound, steps, seed, timeout):
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        str(dim),
        str(noise_dim),
        bound,
        "--steps",
        str(steps),
        "--seed",
        str(seed),
    ]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True)
    except subprocess.TimeoutExpired:
        return {
            "bound": bound,
            "latent_dim": dim,
            "noise_dim": noise_dim,
            "skipped": f"longer than {timeout} s",
        }
    except subprocess.CalledProcessError as e:
        tail = e.stderr.strip().splitlines()[-1:] or ["no output"]
        return {
            "bound": bound,
            "latent_dim": dim,
            "noise_dim": noise_dim,
            "skipped": f"failed: {tail[0]}",
        }
    return json.loads(out.stdout.strip().splitlines()[-1])


def _row(r):
    if "skipped" in r:
        return (
            f"| {r['bound']} | {r['latent_dim']:,} | {r['noise_dim']} | skipped: "
            f"{r['skipped']} | | | |"
        )
    return (
        f"| {r['bound']} | {r['latent_dim']:,} | {r['noise_dim']} | "
        f"{r['generator_params']:,} | {r['seconds_per_step']:.3f} | "
        f"{r['setup_seconds']:.1f} | {r['peak_mb']:.0f} |"
    )


def markdown(results):
    head = (
        "| bound | D | d | generator parameters | s / step | setup s | peak MB |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    return "\n".join([head] + [_row(r) for r in results])


def figure(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "skipped" not in r]
    sweep = [r for r in ok if r["sweep"] == "D"]
    noise = [r for r in ok if r["sweep"] == "d"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    dims = [r["latent_dim"] for r in sweep]
    axes[0].loglog(dims, [r["seconds_per_step"] for r in sweep], "o-")
    axes[0].set(xlabel="latent size D", ylabel="seconds per step", title="L'': time per step")
    axes[1].loglog(dims, [r["peak_mb"] for r in sweep], "o-", label="peak memory")
    axes[1].axhline(16 * 1024, color="r", ls="--", label="16 GB")
    axes[1].set(xlabel="latent size D", ylabel="MB", title="L'': peak memory")
    axes[1].legend()
    for bound, label in [("det", "L' (whole Jacobian)"), ("svd", "L'' (LOBPCG)")]:
        rows = [r for r in noise if r["bound"] == bound]
        axes[2].loglog(
            [r["noise_dim"] for r in rows], [r["seconds_per_step"] for r in rows], "o-", label=label
        )
    axes[2].set(
        xlabel="noise size d",
        ylabel="seconds per step",
        title=f"L' vs L'' at D = {D_FOR_NOISE_SWEEP:,}",
    )
    axes[2].legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=3, metavar=("D", "d", "BOUND"), help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    p.add_argument("--dims", default=",".join(map(str, DIMS)), help="D sweep (comma-separated)")
    p.add_argument(
        "--noise-dims",
        default=",".join(map(str, NOISE_DIMS)),
        help="d sweep at D = 10^4 (comma-separated)",
    )
    p.add_argument("--out", help="write every number to this JSON file")
    p.add_argument("--figure", help="save the three-panel figure here")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one step: seconds")
    args = p.parse_args(argv)
    if args.worker:
        dim, noise_dim, bound = int(args.worker[0]), int(args.worker[1]), args.worker[2]
        print(json.dumps(worker(dim, noise_dim, bound, args.steps, args.seed)))
        return None
    dims = [int(v) for v in args.dims.split(",")]
    noise_dims = [int(v) for v in args.noise_dims.split(",")]
    d_fixed, d_sweep_dim, steps = 64, D_FOR_NOISE_SWEEP, args.steps
    if args.smoke:
        dims, noise_dims, d_fixed, d_sweep_dim, steps = [300], [4], 4, 300, 1
    plan = [("D", dim, d_fixed, "svd") for dim in dims]
    plan += [("d", d_sweep_dim, d, bound) for d in noise_dims for bound in ("det", "svd")]
    results = []
    started = time.time()
    for sweep, dim, noise_dim, bound in plan:
        r = run(dim, noise_dim, bound, steps, args.seed, args.timeout)
        r["sweep"] = sweep
        results.append(r)
        print(_row(r), flush=True)
    print(markdown(results))
    record = {
        "command": "python benchmarks/livi_scale.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "steps": steps,
        "seed": args.seed,
        "threads": 1,
        "dtype": "float32",
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "total_seconds": time.time() - started,
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.figure:
        figure(results, args.figure)
    return record


if __name__ == "__main__":
    main()
