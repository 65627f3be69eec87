"""Why KIVI's paper-setting BNN overfits on UCI: the trajectory of one training run.

Trains the UCI benchmark's KIVI fit (``benchmarks/uci.py --method kivi``: same model,
generators, optimiser and schedule) on one split and, every ``--every`` steps, prints from
200 posterior draws: the median noise precision and the sd of its log, the train and test
RMSE of the predictive mean (normalised units), the mean posterior sd of the output layer's
weights, and per KL group the kernel KL estimate and the fraction of clipped ratios.
The paper's raw-space settings are pinned (``precondition=False``, the prior contrast
unless ``--adaptive-contrast``).

    python benchmarks/kivi_collapse.py --dataset boston --split 0
    python benchmarks/kivi_collapse.py --dataset boston --split 0 --adaptive-contrast diag
"""

import argparse
import time

import pyro
import torch
from pyro.infer import SVI

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.datasets import load_uci


def _runner():
    import uci

    return uci


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="boston")
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--adaptive-contrast", choices=["diag", "full"], default=None)
    parser.add_argument("--regularizer", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=None, help="default: the runner's")
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=None, help="default: the split index")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    uci = _runner()
    split = load_uci(args.dataset, args.split)
    config = dict(uci.DEFAULTS[args.dataset])
    pyro.set_rng_seed(args.split if args.seed is None else args.seed)
    pyro.clear_param_store()
    model = uci.make_model(split, config)
    guide = ImplicitGuide(
        model,
        per_site=True,
        site_options=uci._kivi_site_options(split, model),
        init_loc_fn=uci._init_scaled,
        init_scale=0.1,
        precondition=False,  # the paper's raw-space generators, as the runner
    )
    elbo = KernelRatioELBO(
        num_particles=100,
        regularizer=args.regularizer,
        clip=1e-8,
        adaptive_contrast=args.adaptive_contrast or False,
        max_plate_nesting=1,
    )
    svi = SVI(model, guide, pyro.optim.Adam({"lr": config["lr"]}), elbo)
    x, y = split.x_train, split.y_train
    steps = args.steps or uci.num_steps(split.n_train, config)
    print(f"# {args}\n# {steps} steps of batch {config['batch_size']}", flush=True)
    t0 = time.time()
    for step in range(steps):
        svi.step(x, y, subsample_size=min(config["batch_size"], split.n_train))
        if (step + 1) % args.every and step + 1 != steps:
            continue
        with torch.no_grad():
            draws = guide.sample_posterior(200)
            precision = draws["precision"].reshape(-1)
            train = (model.forward(draws, x).mean(0) - y).pow(2).mean().sqrt().item()
            test = model.forward(draws, split.x_test).mean(0) - split.y_test
            test = test.pow(2).mean().sqrt().item()
            out_sd = draws[model.layer_names[-1]].reshape(200, -1).std(0).mean().item()
        groups = {
            group.split("+")[0]: (round(info["kl"], 1), round(info["clipped_fraction"], 2))
            for group, info in elbo.diagnostics.items()
        }
        print(
            f"{step + 1:6d} {time.time() - t0:6.0f}s  precision median {precision.median():7.2f}"
            f"  log sd {precision.log().std():.3f}  rmse train {train:.3f} test {test:.3f}"
            f"  out-layer sd {out_sd:.4f}  kl/clipped {groups}",
            flush=True,
        )


if __name__ == "__main__":
    main()
