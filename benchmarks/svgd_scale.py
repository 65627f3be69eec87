"""Step time and peak memory of WeightSpaceSVGD and FunctionSpaceSVGD against
``pyro.infer.SVGD`` on the same BNN, as ratios in one run.

The model is :class:`pyro_implicit.bnn.BNNRegression` with two hidden layers of width H
(10 inputs, 100 training points, full batch, float32), so the latent size
D = 11 H + (H + 1) H + (H + 1) + 1 (the last coordinate is the noise precision); H is
chosen for D close to 1e3, 1e4 and 1e5. Methods, all with N particles and Adam(lr 1e-3):

* ``pyro``: ``pyro.infer.SVGD(model, RBFSteinKernel(), optim, N, 1, mode="multivariate")``;
* ``weight``: :class:`pyro_implicit.particles.WeightSpaceSVGD` (isotropic RBF, median rule;
  the papers' raw-space settings pinned: ``precondition=False``);
* ``function``: :class:`pyro_implicit.particles.FunctionSpaceSVGD` with the paper's defaults
  (100 extra KDE points, Gaussian prior score from 40 prior networks at 4 points).

Each (method, D) runs in a fresh subprocess. Peak memory is the growth of the process's
peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) over its resident set
after the data and model are built, so it covers particles, optimiser state and every
temporary of the steps. Time is the mean of ``--steps`` steps after ``--warmup`` steps.
A run longer than ``--timeout`` seconds is reported as skipped.

Usage::

    python benchmarks/svgd_scale.py --particles 50 --steps 5
"""

import argparse
import gc
import json
import math
import subprocess
import sys
import time

METHODS = ("pyro", "weight", "function")


def _width_for(dim):
    # D(H) = H^2 + 13 H + 2 for 10 inputs and two hidden layers of width H
    return max(1, round((-13 + math.sqrt(169 - 4 * (2 - dim))) / 2))


def _worker(method, width, particles, steps, warmup, seed):
    import pyro
    import torch

    torch.set_num_threads(1)
    import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
    from pyro.infer import SVGD, RBFSteinKernel

    from pyro_implicit.bnn import BNNRegression
    from pyro_implicit.diagnostics.memory import PeakMemory
    from pyro_implicit.particles import FunctionSpaceSVGD, WeightSpaceSVGD

    def build(model, num_particles):
        optim = pyro.optim.Adam({"lr": 1e-3})
        if method == "pyro":
            return SVGD(model, RBFSteinKernel(), optim, num_particles, 1, mode="multivariate")
        if method == "weight":
            return WeightSpaceSVGD(model, optim, num_particles, 1, precondition=False)
        return FunctionSpaceSVGD(model, optim, num_particles, 1)

    pyro.set_rng_seed(seed)
    x = torch.randn(100, 10)
    y = torch.sin(x.sum(-1)) + 0.1 * torch.randn(100)
    # a throw-away run on a tiny network first, so lazy imports and one-off buffers of the
    # libraries are not counted as the method's memory
    for _ in range(2):
        build(BNNRegression(10, (2, 2)), 2).step(x, y)
    pyro.clear_param_store()
    gc.collect()
    model = BNNRegression(10, (width, width))
    latent_dim = model.num_weights + 1
    with PeakMemory() as memory:
        inference = build(model, particles)
        for _ in range(warmup):
            inference.step(x, y)
        start = time.perf_counter()
        for _ in range(steps):
            inference.step(x, y)
        seconds = (time.perf_counter() - start) / steps
    return {"ms": 1000 * seconds, "peak_mb": memory.peak_mb, "latent_dim": latent_dim}


def _run(method, dim, args):
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--width",
        str(_width_for(dim)),
        "--particles",
        str(args.particles),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--seed",
        str(args.seed),
    ]
    try:
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.timeout, check=True
        ).stdout
    except subprocess.TimeoutExpired:
        return None
    except subprocess.CalledProcessError as e:
        print(e.stderr, file=sys.stderr)
        return None
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=50)
    parser.add_argument("--dims", type=float, nargs="+", default=[1e3, 1e4, 1e5])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = _worker(
            args.worker, args.width, args.particles, args.steps, args.warmup, args.seed
        )
        print(json.dumps(result))
        return
    print(
        f"BNN 10-H-H-1, 100 points full batch, float32, N = {args.particles} particles, "
        f"1 thread, mean of {args.steps} steps after {args.warmup} warm-up steps"
    )
    print(
        "| D | H | method | ms / step | peak MB | time ratio pyro/this | memory ratio pyro/this |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|")
    for dim in args.dims:
        results = {m: _run(m, dim, args) for m in args.methods}
        ref = results.get("pyro")
        for method in args.methods:
            r = results[method]
            if r is None:
                print(
                    f"| {int(dim)} | {_width_for(dim)} | {method} | skipped (> "
                    f"{args.timeout:.0f} s or failed) | | | |"
                )
                continue
            ratios = ("", "")
            if ref is not None:
                ratios = (f"{ref['ms'] / r['ms']:.1f}", f"{ref['peak_mb'] / r['peak_mb']:.1f}")
            print(
                f"| {r['latent_dim']} | {_width_for(dim)} | {method} | {r['ms']:.1f} | "
                f"{r['peak_mb']:.1f} | {ratios[0]} | {ratios[1]} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
