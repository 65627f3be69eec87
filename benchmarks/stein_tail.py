"""``SteinScoreELBO``'s ``tau`` on eight schools against training length and the optimiser's
schedule.

``ImplicitGuide`` + ``SteinScoreELBO()`` (defaults) on the library's non-centred eight
schools, trained for N steps with plain ``Adam(1e-2)`` or with ``compare``'s schedule
(``ClippedAdam``, rate 1e-2 decayed to a tenth over the N steps), against NUTS (4000 draws):
``tau``'s mean error in NUTS sds, its sd ratio and the 1/50/99% quantiles of ``log tau``
from 4000 draws of the guide.

    python benchmarks/stein_tail.py --steps 1000,5000 --out benchmarks/results/stein_tail.md
"""

import argparse

import _provenance
import pyro
import torch
from pyro.infer import SVI
from svgd_tail import nuts_reference

from pyro_implicit import ImplicitGuide, SteinScoreELBO
from pyro_implicit.models import load_model

QUANTILES = (0.01, 0.5, 0.99)


def optimiser(name, steps):
    if name == "adam":
        return pyro.optim.Adam({"lr": 1e-2})
    return pyro.optim.ClippedAdam({"lr": 1e-2, "lrd": 0.1 ** (1.0 / steps)})


def row(label, steps, tau, ref):
    q = torch.tensor(QUANTILES, dtype=tau.dtype)
    logq = " / ".join(f"{v:.2f}" for v in tau.log().quantile(q).tolist())
    error = (tau.mean() - ref.mean()) / ref.std()
    return f"| {label} | {steps} | {error:.2f} | {tau.std() / ref.std():.2f} | {logq} |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,5000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    prov = _provenance.provenance(__file__, argv, vars(args))
    model = load_model("eight_schools")
    ref = nuts_reference(model.model, model.args, 4000, args.seed)["tau"]
    lines = [
        "# SteinScoreELBO's tau on eight schools: training length and schedule",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread, "
        f"seed {args.seed}. `tau`'s mean error in NUTS sds, sd ratio (guide / NUTS) and the "
        "1/50/99% quantiles of `log tau` (4000 guide draws; NUTS: 4000 draws).",
        "",
        "| optimiser | steps | tau mean err | tau sd ratio | log tau quantiles |",
        "|---|---:|---:|---:|---|",
        row("NUTS", "-", ref, ref),
    ]
    for name, label in (("adam", "Adam(1e-2)"), ("compare", "compare's ClippedAdam, decayed")):
        for steps in (int(s) for s in args.steps.split(",")):
            pyro.clear_param_store()
            pyro.set_rng_seed(args.seed)
            guide = ImplicitGuide(model.model)
            svi = SVI(model.model, guide, optimiser(name, steps), SteinScoreELBO())
            for _ in range(steps):
                svi.step(*model.args)
            tau = guide.sample_posterior(4000)["tau"].reshape(-1)
            lines.append(row(label, steps, tau, ref))
            print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
