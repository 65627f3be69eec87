"""Where a particle method's predictive width comes from, on one UCI split.

Fits the runner's methods (``benchmarks/uci.py``, same settings and seed) on one split and
splits the predictive mixture's width into the spread of the particles' functions (sd over
particles at each test point) and their noise std, beside the error of the mixture mean,
all in normalised units. Used to read f-SVGD against weight-space SVGD on naval
(``benchmarks/results/uci_fsvgd.md``)::

    python benchmarks/uci_spread.py --dataset naval --split 0 --methods wsvgd,fsvgd
"""

import argparse
import json
import time

import pyro
import torch
import uci  # noqa: E402  (the runner, for its settings, fits and metrics)

from pyro_implicit.datasets import load_uci


def spread(dataset, split_index, methods, dtype="float32", seed=0, overrides=None):
    """Fit each method on one split and measure its predictive width.

    ``overrides`` changes the runner's configuration (e.g. ``{"epochs": 1}`` for a smoke run).

    :return: ``{method: {"rmse", "ll", "noise_std_mean", "noise_std_min", "noise_std_max",
        "f_spread_mean", "abs_error_mean", "seconds"}}`` (metrics in original units as in
        the runner; the rest in normalised units).
    """
    split = load_uci(dataset, split_index, dtype=getattr(torch, dtype))
    out = {}
    for method in methods:
        config = uci.run_config(method, dataset, overrides)
        pyro.set_rng_seed(seed + split_index)  # the runner's seed for this split
        start = time.perf_counter()
        f, noise = uci.METHODS[method](split, dict(config), seed + split_index, lambda m: None)
        seconds = time.perf_counter() - start
        rmse, ll = uci.evaluate(f, noise, split)
        out[method] = {
            "rmse": rmse,
            "ll": ll,
            "noise_std_mean": noise.mean().item(),
            "noise_std_min": noise.min().item(),
            "noise_std_max": noise.max().item(),
            "f_spread_mean": f.std(0).mean().item(),
            "abs_error_mean": (f.mean(0) - split.y_test).abs().mean().item(),
            "seconds": round(seconds, 1),
        }
        print(method, json.dumps(out[method]), flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="naval")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--methods", default="wsvgd,fsvgd")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=None, help="override (smoke runs)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    overrides = None if args.epochs is None else {"epochs": args.epochs}
    return spread(
        args.dataset, args.split, args.methods.split(","), args.dtype, args.seed, overrides
    )


if __name__ == "__main__":
    main()
