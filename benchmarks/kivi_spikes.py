"""KIVI's loss spikes on a UCI split, and what gradient clipping does to them.

The reverse-ratio gradient is :math:`\\nabla \\hat r / \\hat r`, so a draw whose ratio lands
just above the clip value gets a huge gradient (KIVI digest, pitfall 5), and Adam turns a
gradient far above its running scale into a step of about 30 learning rates. This script
trains the UCI runner's KIVI (``benchmarks/uci.py``, same settings and seed as the table)
on one split and evaluates the test and training RMSE every ``--every`` steps, once with
the paper's Adam and once per ``--clip-norms`` value with Pyro's ``ClippedAdam`` (despite
the option's name it clamps each gradient element to +-clip_norm; not in the paper). Every
evaluation also records the largest gradient element since the last one and the share of
steps (and of elements) above 10. The evaluation draws and the read-only gradient hooks leave the
training's random stream untouched, so the first run is the table's run.

    python benchmarks/kivi_spikes.py --dataset yacht --split 3 --every 450 --clip-norms 10
"""

import argparse
import json
from pathlib import Path

import pyro
import torch
import uci  # noqa: E402  (the runner: settings, KIVI's pieces, metrics)
from _provenance import provenance

from pyro_implicit.datasets import load_uci

CLAMP = 10.0  # the clip_norm whose reach is recorded


def _rmse(fit, x, y, y_std):
    """RMSE of the predictive mean at ``x`` in original units, from 100 draws drawn on a
    saved-and-restored random stream."""
    rng = pyro.util.get_rng_state()
    try:
        f, _ = uci.predict_kivi(fit, x, 100)
    finally:
        pyro.util.set_rng_state(rng)
    return (f.mean(0) - y).pow(2).mean().sqrt().item() * y_std


def trace_run(split, config, seed, every, progress=print):
    """Train KIVI on ``split`` and record the RMSE every ``every`` steps.

    :return: ``{"steps", "loss_per_point", "test_rmse", "train_rmse", "grad_max",
        "steps_clamped", "elements_clamped", "rmse", "ll"}``.
    """
    pyro.set_rng_seed(seed)
    fit = uci.build_kivi(split, config)
    record = {
        "steps": [],
        "loss_per_point": [],
        "test_rmse": [],
        "train_rmse": [],
        "grad_max": [],
        "steps_clamped": [],
        "elements_clamped": [],
    }
    taken = [0]
    # Gradient sizes as the optimiser receives them (read-only hooks): how often Pyro's
    # ClippedAdam, which clamps each gradient *element* to +-clip_norm, would act.
    window = {"max": 0.0, "steps": 0, "clamped_steps": 0, "clamped": 0.0}
    grads = {}

    def hook(i):
        def read(g):
            grads[i] = g.detach().abs()

        return read

    def step(*args, **kwargs):
        taken[0] += 1
        grads.clear()
        loss = fit.svi.step(*args, **kwargs)
        if taken[0] == 1:  # the parameters exist after the first step
            for i, p in enumerate(pyro.get_param_store().values()):
                p.register_hook(hook(i))
        elif grads:
            g = torch.cat([v.reshape(-1) for v in grads.values()])
            over = (g > CLAMP).double().mean().item()
            window["max"] = max(window["max"], g.max().item())
            window["steps"] += 1
            window["clamped_steps"] += over > 0
            window["clamped"] += over
        return loss

    def describe(loss, n):
        record["steps"].append(taken[0])
        record["loss_per_point"].append(loss / n)
        record["test_rmse"].append(_rmse(fit, split.x_test, split.y_test, split.y_std))
        record["train_rmse"].append(_rmse(fit, split.x_train, split.y_train, split.y_std))
        steps = max(window["steps"], 1)
        record["grad_max"].append(window["max"])
        record["steps_clamped"].append(window["clamped_steps"] / steps)
        record["elements_clamped"].append(window["clamped"] / steps)
        window.update(max=0.0, steps=0, clamped_steps=0, clamped=0.0)
        return (
            f"loss/n {loss / n:.3f}  test RMSE {record['test_rmse'][-1]:.3f}  "
            f"train RMSE {record['train_rmse'][-1]:.3f}  max|grad| "
            f"{record['grad_max'][-1]:.3g}  steps with |grad| > {CLAMP:g}: "
            f"{record['steps_clamped'][-1]:.0%}"
        )

    uci.train_minibatches(
        step, split.x_train, split.y_train, config, progress, describe, report_every=every
    )
    f, noise = uci.predict_kivi(fit, split.x_test, int(config["num_samples"]))
    record["rmse"], record["ll"] = uci.evaluate(f, noise, split)
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="yacht")
    parser.add_argument("--split", type=int, default=3)
    parser.add_argument("--every", type=int, default=450, help="steps between evaluations")
    parser.add_argument(
        "--clip-norms",
        default="10",
        help="comma-separated ClippedAdam clip_norm values (besides Adam)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the runner's --seed")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--epochs", type=int, default=None, help="override (smoke runs)")
    parser.add_argument("--out", default=None, help="write the traces as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    split = load_uci(args.dataset, args.split, dtype=getattr(torch, args.dtype))
    base = uci.run_config("kivi", args.dataset)
    if args.epochs is not None:
        base["epochs"] = args.epochs
    runs = {}
    for clip in [None] + [float(c) for c in args.clip_norms.split(",") if c]:
        name = "adam" if clip is None else f"clipped_adam_{clip:g}"
        config = dict(base) if clip is None else {**base, "clip_norm": clip}
        print(f"# {name}", flush=True)
        runs[name] = trace_run(split, config, args.seed + args.split, args.every)
        print(
            f"# {name}: final RMSE {runs[name]['rmse']:.3f}, test LL {runs[name]['ll']:.3f}",
            flush=True,
        )
    result = {
        **provenance(__file__, argv, vars(args)),
        "dataset": args.dataset,
        "split": args.split,
        "runs": runs,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
