"""Standard against scaled generator layers, per loss: the stiff posteriors, the exact
posteriors and the size of one Adam step.

An implicit guide's default MLP stores its weights as PyTorch's ``nn.Linear`` does, or
(``parametrization="scaled"``) as fixed multiples of order-one parameters
(:class:`~pyro_implicit.guides.networks.ScaledLinear`). Adam moves every stored value by
about its learning rate per step, so the first can move q by many of its sds in one step
and the second cannot. With ``parametrization="auto"`` (the guides' default) the loss that
builds the guide chooses (its ``guide_parametrization``); this script sets that choice to
each arm in turn, the rest of the code path being the library's:

* **one step**: the largest shift of the mean of q's whitened draws after one Adam step
  (lr 1e-2) from the preconditioner's Gaussian, on the stochastic-volatility posterior;
* **stiff**: ``benchmarks/stiff.py``'s fit (compare's settings, 2000 steps of Adam(1e-2),
  float64) on its eight posteriors, largest mean error and sd-ratio range against NUTS;
* **exact** (every loss but ``stein_score``): ``benchmarks/exact_defaults.py``'s five
  exact posteriors with the constructors' defaults (float32), how many pass the bar.

Usage::

    python benchmarks/kivi_parametrization.py --methods kivi --seeds 0,1,2,3 \\
        --out benchmarks/results/kivi_parametrization.md
"""

import argparse
import contextlib

import _provenance
import exact_defaults
import pyro
import stiff
import torch
from pyro.infer import SVI

from pyro_implicit import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    KernelRatioELBO,
    SteinScoreELBO,
)

LOSSES = {
    "kivi": KernelRatioELBO,
    "stein_score": SteinScoreELBO,
    "gpvi": GPVI_ELBO,
    "asvgd": AmortizedSVGD_ELBO,
    "sivi": SIVI_ELBO,
    "livi": LIVI_ELBO,
}
#: the layers compared (``--arms``); ``"ntk"``: scaled, with 1/sqrt(width) at the output
ARMS = ("standard", "scaled", "ntk")


@contextlib.contextmanager
def asking_for(method, arm):
    """The loss of ``method`` asks the guides it builds for ``arm``'s layers."""
    cls = LOSSES[method]
    saved = cls.__dict__.get("guide_parametrization")
    cls.guide_parametrization = arm
    try:
        yield
    finally:
        cls.guide_parametrization = saved


def one_step_shift(method, model_name="stochastic_volatility", seed=0):
    """Largest |mean z| of 4000 whitened draws after one Adam step (lr 1e-2), and before."""
    torch.set_default_dtype(torch.float64)
    model, args, kwargs, mpn = stiff.MODELS[model_name]()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro.optim.Adam({"lr": 1e-2})
    _, guide, loss = stiff.build_method(method, model, mpn, optim, True)
    svi = SVI(model, guide, optim, loss)
    shifts = []
    for steps in (0, 1):
        if steps:
            svi.step(*args, **kwargs)
        else:
            loss.loss(model, guide, *args, **kwargs)  # builds the guide under the loss
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(seed + 1)
            shifts.append(guide.sample_whitened(4000).mean(0).abs().max().item())
    pyro.clear_param_store()
    return shifts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="kivi")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--models", default=",".join(stiff.MODELS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--arms", default="standard,scaled")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    prov = _provenance.provenance(__file__, argv, vars(args))
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"--arms: unknown {sorted(unknown)}; choose from {ARMS}")
    models = args.models.split(",")
    lines = [
        "# Standard against scaled generator layers",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), one thread. Each arm "
        "is the library's code path with the loss asking for that arm's layers "
        "(module docstring). Stiff cells: largest mean error in NUTS sds / sd-ratio range "
        "(**bold**: above 1 sd; `error`: the fit stopped).",
    ]
    for method in args.methods.split(","):
        lines += ["", f"## {method}", ""]
        shifts = {}
        for arm in arms:
            with asking_for(method, arm):
                shifts[arm] = one_step_shift(method)
        lines.append(
            "One Adam step from the preconditioner's Gaussian (stochastic volatility, seed 0), "
            "largest |mean| of q's whitened draws before -> after: "
            + "; ".join(f"{arm} {a:.3f} -> {b:.3f}" for arm, (a, b) in shifts.items())
            + "."
        )
        lines += [
            "",
            "| model | seed | " + " | ".join(arms) + " |",
            "|---|---:|" + "---|" * len(arms),
        ]
        over = {arm: 0 for arm in arms}
        total = 0
        for name in models:
            reference, _ = stiff.load_reference(name)
            for seed in seeds:
                cells = []
                total += 1
                for arm in arms:
                    torch.set_default_dtype(torch.float64)
                    with asking_for(method, arm):
                        row = stiff.fit_one(
                            name, method, True, args.steps, seed, 2000, 1e-2, reference
                        )
                    if row["status"] != "ok":
                        cells.append("`error`")
                        over[arm] += 1
                        continue
                    err = row["mean_error_max"]
                    over[arm] += err > 1
                    text = f"{err:.3f}" if err <= 1 else f"**{err:.3g}**"
                    cells.append(f"{text} / {row['sd_ratio_min']:.2f}-{row['sd_ratio_max']:.2f}")
                lines.append(f"| {name} | {seed} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
        lines += [
            "",
            "Fits more than 1 sd off or stopped: "
            + ", ".join(f"{arm} {over[arm]} of {total}" for arm in arms)
            + ".",
        ]
        if method in ("kivi", "gpvi", "asvgd", "sivi", "livi"):
            lines += [
                "",
                "Exact posteriors (float32, constructors' defaults), passing the bar:",
                "",
            ]
            for arm in arms:
                passed, worst, worst_corr = 0, 0.0, 0.0
                n = 0
                with asking_for(method, arm):
                    for seed in seeds:
                        rows = exact_defaults.run(
                            [method],
                            exact_defaults.EXACT_PROBLEMS,
                            args.steps,
                            True,
                            "defaults",
                            seed,
                            torch.float32,
                            log=lambda *a: None,
                        )
                        passed += sum(r["passes"] for r in rows)
                        n += len(rows)
                        worst = max([worst] + [r["mean_error"] for r in rows])
                        worst_corr = max([worst_corr] + [r["correlation_error"] for r in rows])
                lines.append(
                    f"- {arm}: {passed} of {n} (worst mean error {worst:.2f} sd, worst "
                    f"correlation error {worst_corr:.3f})"
                )
                print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
