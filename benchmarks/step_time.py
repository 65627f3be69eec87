"""Step time of KIVI against Pyro's AutoNormal on the same BNN, as a ratio in one run.

``SVI(model, ImplicitGuide(model), Adam, KernelRatioELBO(num_particles=S))`` against
``SVI(model, AutoNormal(model), Adam, Trace_ELBO(num_particles=S, vectorize_particles=True))``
on the UCI Boston BNN (one hidden layer of 50 units, minibatches of 100), measured in
alternating repeats so that load on the machine affects both alike. The paper's
raw-space settings are pinned (``precondition=False``).

Usage::

    python benchmarks/step_time.py --particles 100 --steps 200 --repeats 3
"""

import argparse
import math
import time

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch
import uci
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.datasets import load_uci


def _svi(name, model, split, particles):
    if name == "autonormal":
        guide = AutoNormal(model)
        loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    else:
        guide = ImplicitGuide(
            model,
            per_site=True,
            site_options=uci._kivi_site_options(split, model),
            init_loc_fn=uci._init_scaled,
            precondition=False,  # the paper's raw-space generators, as the UCI runner
        )
        contrast = "diag" if name == "kivi_adaptive_contrast" else False
        loss = KernelRatioELBO(
            num_particles=particles, max_plate_nesting=1, adaptive_contrast=contrast
        )
    return SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    split = load_uci("boston", 0, dtype=torch.float32)
    x, y = split.x_train, split.y_train
    config = dict(uci.DEFAULTS["boston"])
    names = ["autonormal", "kivi", "kivi_adaptive_contrast"]
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            pyro.clear_param_store()
            pyro.set_rng_seed(args.seed)
            svi = _svi(name, uci.make_model(split, config), split, args.particles)
            for _ in range(10):  # warm-up: lazy set-up and the vectorisation check
                svi.step(x, y, subsample_size=100)
            start = time.perf_counter()
            for _ in range(args.steps):
                svi.step(x, y, subsample_size=100)
            times[name].append(1000 * (time.perf_counter() - start) / args.steps)
    base = min(times["autonormal"])
    print(
        f"Boston BNN 13-50-1, batch 100, S = {args.particles} particles, "
        f"{args.threads} thread(s), best of {args.repeats} x {args.steps} steps"
    )
    print("| method | ms / step (best) | all repeats | ratio to AutoNormal |")
    print("|---|---:|---|---:|")
    for name in names:
        best = min(times[name])
        runs = ", ".join(f"{t:.1f}" for t in times[name])
        print(f"| {name} | {best:.1f} | {runs} | {best / base:.2f} |")
    assert all(math.isfinite(t) for v in times.values() for t in v)
    return times


if __name__ == "__main__":
    main()
