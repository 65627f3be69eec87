"""Step time of SIVI against the KIVI path and AutoNormal at the same sample count, and how
SIVI's cost grows with K, on the waveform Bayesian logistic regression (D = 22, n = 400).

Configurations (J = ``--particles`` draws of q per step for all of them):

* ``SIVI K=k``: ``SemiImplicitGuide`` (paper's BLR layers, full-covariance conditional)
  with ``SIVI_ELBO(num_particles=J, num_mixing=k)``;
* ``KIVI``: ``ImplicitGuide`` (its default MLP) with ``KernelRatioELBO(num_particles=J)``;
* ``AutoNormal``: ``AutoNormal`` with ``Trace_ELBO(num_particles=J, vectorize_particles=True)``.

Each is timed over ``--steps`` SVI steps after 10 warm-up steps, in ``--repeats``
alternating rounds (so machine load affects all alike); the best round is reported, with
the ratio to AutoNormal. The papers' raw-space settings are pinned
(``precondition=False``, KIVI's prior contrast ``adaptive_contrast=False``).

Usage::

    nice -n 10 python benchmarks/sivi_step_time.py --seed 0
    python benchmarks/sivi_step_time.py --smoke
"""

import argparse
import time

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.elbo.sivi import SIVI_ELBO
from pyro_implicit.guides.semi_implicit import SemiImplicitGuide
from pyro_implicit.models import waveform_logistic


def make_svi(name, model, particles):
    if name == "AutoNormal":
        guide = AutoNormal(model)
        loss = Trace_ELBO(num_particles=particles, vectorize_particles=True, max_plate_nesting=1)
    elif name == "KIVI":
        guide = ImplicitGuide(model, precondition=False)
        loss = KernelRatioELBO(
            num_particles=particles, max_plate_nesting=1, adaptive_contrast=False
        )
    else:
        k = int(name.split("=")[1])
        guide = SemiImplicitGuide(model, conditional="full", precondition=False)
        loss = SIVI_ELBO(num_particles=particles, num_mixing=k, max_plate_nesting=1)
    return SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    parser.add_argument("--particles", type=int, default=50)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 10, 100, 1000])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    warmup = 10
    if args.smoke:
        args.steps, args.repeats, args.ks, warmup, args.particles = 2, 1, [1, 4], 1, 4
    builtin = waveform_logistic()
    names = ["AutoNormal", "KIVI"] + [f"SIVI K={k}" for k in args.ks]
    times = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names:
            pyro.clear_param_store()
            pyro.set_rng_seed(args.seed)
            svi = make_svi(name, builtin.model, args.particles)
            for _ in range(warmup):  # lazy set-up and the vectorisation check
                svi.step(*builtin.args, **builtin.kwargs)
            start = time.perf_counter()
            for _ in range(args.steps):
                svi.step(*builtin.args, **builtin.kwargs)
            times[name].append(1000 * (time.perf_counter() - start) / args.steps)
            print(f"round {r + 1}/{args.repeats} {name}: {times[name][-1]:.2f} ms/step", flush=True)
    base = min(times["AutoNormal"])
    print()
    print(
        f"waveform BLR (D = 22, n = 400), J = {args.particles} draws per step, 1 thread, "
        f"best of {args.repeats} x {args.steps} steps, seed {args.seed}"
    )
    print("| method | ms / step (best) | all rounds | ratio to AutoNormal |")
    print("|---|---:|---|---:|")
    for name in names:
        best = min(times[name])
        rounds = ", ".join(f"{t:.1f}" for t in times[name])
        print(f"| {name} | {best:.2f} | {rounds} | {best / base:.2f} |")
    return times


if __name__ == "__main__":
    main()
