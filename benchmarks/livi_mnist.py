"""MNIST classification with a Bayesian MLP trained by LIVI's L'' (Uppal et al. 2023,
Sec. 6.4: MNIST with L'', scored by accuracy, NLL, ECE and out-of-distribution confidence),
against a mean-field Gaussian (``AutoNormal``) of the same network and budget.

Data: only MNIST's 10k test images are available here, so ``load_mnist(num_train=8000)``
splits them (permutation seed 0): 8,000 train / 2,000 test. Out-of-distribution inputs
are built from the 2,000 test images: each rotated by 90 degrees, and uniform noise images.

Model: :class:`pyro_implicit.bnn.BNNClassification`, 784 -> H -> 10 (ReLU), weight prior
N(0, 1/(n_in + 1)) per layer (a fan-in scaled prior; the paper's N(0, 1) on 784 inputs
gives logits of size ~30 a priori), minibatches of 256 with the data plate's N/B scaling.

LIVI: :class:`~pyro_implicit.guides.LinearizedGuide` with the correlated matrix-multiplication
generator (``generator="scalable"``, App. D; the paper's raw-space settings pinned:
``precondition=False``), sigma = 1e-3, and
:class:`~pyro_implicit.elbo.LIVI_ELBO` ``(bound="svd", num_particles=2)`` (the paper's 1-2
draws per minibatch, 5 LOBPCG iterations). Mean field: ``AutoNormal`` with
``Trace_ELBO(num_particles=2, vectorize_particles=True)``. Both: Adam, the same learning
rate and epochs, weights initialised by a prior draw. Predictions average the softmax over
``--draws`` posterior draws.

Usage::

    python benchmarks/livi_mnist.py --out benchmarks/results/livi_mnist.json
    python benchmarks/livi_mnist.py --smoke
"""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import pyro.poutine as poutine
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.poutine.messenger import Messenger

from pyro_implicit import LIVI_ELBO, LinearizedGuide
from pyro_implicit.bnn import BNNClassification
from pyro_implicit.datasets import load_mnist
from pyro_implicit.diagnostics.classification import auroc, classification_scores
from pyro_implicit.diagnostics.memory import PeakMemory


def make_model(hidden):
    sizes = [784, hidden, 10]
    scales = tuple(1.0 / math.sqrt(n_in + 1) for n_in in sizes[:-1])
    return BNNClassification(784, 10, hidden_dims=(hidden,), prior_scale=scales)


def make_method(name, model, args):
    if name == "livi":
        guide = LinearizedGuide(
            model,
            generator="scalable",
            sigma=1e-3,
            init_loc_fn=init_to_sample,
            init_scale=args.init_scale,
            precondition=False,
        )  # the paper's raw weight space
        return guide, LIVI_ELBO(
            num_particles=2,
            bound="svd",
            max_plate_nesting=1,
            entropy_weight=getattr(args, "entropy_weight", 1.0),
            prior_weight=getattr(args, "prior_weight", 1.0),
        )
    guide = AutoNormal(model, init_loc_fn=init_to_sample, init_scale=args.init_scale)
    options = {"num_particles": 2, "vectorize_particles": True, "max_plate_nesting": 1}
    entropy_weight = getattr(args, "entropy_weight", 1.0)
    prior_weight = getattr(args, "prior_weight", 1.0)
    if entropy_weight == prior_weight == 1.0:
        return guide, Trace_ELBO(**options)
    return guide, _TemperedELBO(model.layer_names, entropy_weight, prior_weight, **options)


class _ScaleSites(Messenger):
    """Multiply the log-density of the named sites by ``scale``."""

    def __init__(self, names, scale):
        super().__init__()
        self.names, self.scale = set(names), scale

    def _process_message(self, msg):
        if msg["name"] in self.names:
            msg["scale"] = msg["scale"] * self.scale


class _TemperedELBO(Trace_ELBO):
    """The same tempering for a Gaussian guide: weight ``prior_weight`` on the weights'
    prior log-density and ``entropy_weight`` on -log q (the guide's log-density), so that
    both guides optimise the same objective."""

    def __init__(self, names, entropy_weight, prior_weight, **kwargs):
        super().__init__(**kwargs)
        self.names, self.entropy_weight, self.prior_weight = names, entropy_weight, prior_weight

    def _wrap(self, model, guide):
        return (
            _ScaleSites(self.names, self.prior_weight)(model),
            poutine.scale(guide, scale=self.entropy_weight),
        )

    def loss_and_grads(self, model, guide, *args, **kwargs):
        return super().loss_and_grads(*self._wrap(model, guide), *args, **kwargs)

    def loss(self, model, guide, *args, **kwargs):
        return super().loss(*self._wrap(model, guide), *args, **kwargs)


def ood_inputs(x_test, seed):
    images = x_test.reshape(-1, 28, 28)
    rotated = torch.rot90(images, 1, dims=(1, 2)).reshape(-1, 784)
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(x_test.shape, generator=g, dtype=x_test.dtype)
    return {"rotated 90": rotated, "uniform noise": noise}


@torch.no_grad()
def predictive_probs(guide, model, x, draws, chunk=20):
    total = 0.0
    done = 0
    while done < draws:
        n = min(chunk, draws - done)
        if isinstance(guide, AutoNormal):
            with pyro.plate("draws", n, dim=-2):
                weights = guide()
            weights = {k: v.reshape((n,) + v.shape[-2:]) for k, v in weights.items()}
        else:
            weights = guide.sample_posterior(n)
        total = total + model.forward(weights, x).softmax(-1).sum(0)
        done += n
    return total / draws


def warm_up(data):
    """One step of each method on a tiny network, so that lazy imports (torch.func, ...)
    are not counted in the first method's peak memory."""
    tiny = BNNClassification(784, 10, hidden_dims=(2,))
    x, y = data.x_train[:8], data.y_train[:8]
    args = argparse.Namespace(init_scale=0.1)
    for name in ("livi", "meanfield"):
        guide, loss = make_method(name, tiny, args)
        SVI(tiny, guide, pyro.optim.Adam({"lr": 1e-3}), loss).step(x, y)
    pyro.clear_param_store()


def run_method(name, data, args, progress):
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    model = make_model(args.hidden)
    x, y = data.x_train, data.y_train
    n = x.shape[0]
    steps_per_epoch = math.ceil(n / args.batch_size)
    steps = args.epochs * steps_per_epoch
    with PeakMemory() as memory:
        guide, loss = make_method(name, model, args)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": args.lr}), loss)
        start = time.perf_counter()
        for step in range(steps):
            value = svi.step(x, y, subsample_size=args.batch_size)
            if (step + 1) % steps_per_epoch == 0 and progress:
                epoch = (step + 1) // steps_per_epoch
                if epoch % max(1, args.epochs // 10) == 0 or epoch == args.epochs:
                    print(
                        f"  {name}: epoch {epoch}/{args.epochs}  loss/n {value / n:.4f}  "
                        f"{time.perf_counter() - start:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
        seconds = time.perf_counter() - start
    probs = predictive_probs(guide, model, data.x_test, args.draws)
    scores = classification_scores(probs, data.y_test)
    in_conf = probs.max(-1).values
    ood = {}
    for label, inputs in ood_inputs(data.x_test, args.seed).items():
        p = predictive_probs(guide, model, inputs, args.draws)
        conf = p.max(-1).values
        ood[label] = {
            "confidence": float(conf.mean()),
            "auroc": auroc(in_conf, conf),
            "entropy": float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean()),
        }
    num_params = sum(v.numel() for v in pyro.get_param_store().values())
    return {
        "method": name,
        "latent_dim": model.num_weights,
        "variational_params": num_params,
        "steps": steps,
        "train_seconds": seconds,
        "seconds_per_step": seconds / steps,
        "peak_mb": memory.peak_mb,
        "test": scores,
        "ood": ood,
    }


def markdown(results):
    lines = [
        "| method | D | variational params | accuracy | NLL | ECE | conf. rotated | "
        "AUROC rotated | conf. noise | AUROC noise | s / step | peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        t, rot, noi = r["test"], r["ood"]["rotated 90"], r["ood"]["uniform noise"]
        lines.append(
            f"| {r['method']} | {r['latent_dim']:,} | {r['variational_params']:,} | "
            f"{t['accuracy']:.4f} | {t['nll']:.4f} | {t['ece']:.4f} | {rot['confidence']:.3f} | "
            f"{rot['auroc']:.3f} | {noi['confidence']:.3f} | {noi['auroc']:.3f} | "
            f"{r['seconds_per_step']:.3f} | {r['peak_mb']:.0f} |"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="livi,meanfield")
    p.add_argument("--hidden", type=int, default=200)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--init-scale",
        type=float,
        default=1e-2,
        help="initial spread of both guides around the initial weights",
    )
    p.add_argument(
        "--entropy-weight",
        type=float,
        default=1.0,
        help="tempering of the entropy, for both methods (1: the paper's ELBO; "
        "the authors' code uses N/B)",
    )
    p.add_argument(
        "--prior-weight",
        type=float,
        default=1.0,
        help="tempering of the weights' prior, for both methods (1: the "
        "paper's ELBO; the authors' code uses 8.5e-4 N/B)",
    )
    p.add_argument("--draws", type=int, default=100, help="posterior draws per prediction")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write every number to this JSON file")
    p.add_argument("--smoke", action="store_true", help="a run of seconds (tests)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.epochs, args.draws = 8, 1, 4
    torch.set_num_threads(args.threads)
    data = load_mnist(num_train=8000, seed=0)
    if args.smoke:
        data.x_train, data.y_train = data.x_train[:512], data.y_train[:512]
        data.x_test, data.y_test = data.x_test[:200], data.y_test[:200]
    warm_up(data)
    results = []
    started = time.time()
    for name in args.methods.split(","):
        if name not in ("livi", "meanfield"):
            raise SystemExit(f"unknown method {name!r}; choose livi, meanfield")
        results.append(run_method(name, data, args, progress=not args.quiet))
        if not args.quiet:
            print(markdown(results[-1:]).splitlines()[-1], flush=True)
    table = markdown(results)
    print(table)
    record = {
        "command": "python benchmarks/livi_mnist.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "data": data.split_description,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "quiet")},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "pyro": pyro.__version__,
        },
        "total_seconds": time.time() - started,
        "results": results,
        "table": table,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
