"""``SteinScoreELBO``'s ``tau`` on eight schools against training length and the optimiser's
schedule.

``ImplicitGuide`` + ``SteinScoreELBO()`` (defaults) on the library's non-centred eight
schools, trained for N steps with plain ``Adam(1e-2)`` or with ``compare``'s schedule
(``ClippedAdam``, rate 1e-2 decayed to a tenth over the N steps), against NUTS (4000 draws):
``tau``'s mean error in NUTS sds, its sd ratio and the 1/50/99% quantiles of ``log tau``
from 4000 draws of the guide. ``--particles`` compares draw counts per step (``auto``: the
loss's default), ``--seeds`` repeats each fit (each seed with its own NUTS reference).

    python benchmarks/stein_tail.py --steps 1000,5000 --out benchmarks/results/stein_tail.md
    python benchmarks/stein_tail.py --steps 1000,5000 --optimisers compare \
        --particles 100,auto --seeds 0,1,2 --out benchmarks/results/stein_particles_tail.md
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


OPTIMISERS = {"adam": "Adam(1e-2)", "compare": "compare's ClippedAdam, decayed"}


def row(label, steps, tau, ref, particles="-", seed="-"):
    q = torch.tensor(QUANTILES, dtype=tau.dtype)
    logq = " / ".join(f"{v:.2f}" for v in tau.log().quantile(q).tolist())
    error = (tau.mean() - ref.mean()) / ref.std()
    return (
        f"| {label} | {particles} | {seed} | {steps} | {error:.2f} | "
        f"{tau.std() / ref.std():.2f} | {logq} |"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,5000")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--particles", default="auto", help="comma-separated counts or auto")
    parser.add_argument("--optimisers", default="adam,compare", help=f"from {list(OPTIMISERS)}")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    prov = _provenance.provenance(__file__, argv, vars(args))
    model = load_model("eight_schools")
    seeds = [int(x) for x in args.seeds.split(",")]
    refs = {seed: nuts_reference(model.model, model.args, 4000, seed)["tau"] for seed in seeds}
    lines = [
        "# SteinScoreELBO's tau on eight schools: training length and schedule",
        "",
        f"`{prov['command']}` (commit {prov['commit']}, {prov['utc']}), float64, one thread, "
        f"seeds {args.seeds}. `tau`'s mean error in NUTS sds, sd ratio (guide / NUTS) and the "
        "1/50/99% quantiles of `log tau` (4000 guide draws; NUTS: 4000 draws, one chain per "
        "seed, that seed's fits scored against it); `particles`: `SteinScoreELBO`'s "
        "`num_particles`.",
        "",
        "| optimiser | particles | seed | steps | tau mean err | tau sd ratio | "
        "log tau quantiles |",
        "|---|---|---:|---:|---:|---:|---|",
        *(row("NUTS", "-", refs[seed], refs[seed], seed=seed) for seed in seeds),
    ]
    for name in args.optimisers.split(","):
        for particles in args.particles.split(","):
            count = particles if particles == "auto" else int(particles)
            for seed in seeds:
                for steps in (int(s) for s in args.steps.split(",")):
                    pyro.clear_param_store()
                    pyro.set_rng_seed(seed)
                    guide = ImplicitGuide(model.model)
                    loss = SteinScoreELBO(num_particles=count)
                    svi = SVI(model.model, guide, optimiser(name, steps), loss)
                    for _ in range(steps):
                        svi.step(*model.args)
                    tau = guide.sample_posterior(4000)["tau"].reshape(-1)
                    label = OPTIMISERS[name]
                    shown = f"auto ({loss.num_particles})" if count == "auto" else count
                    lines.append(row(label, steps, tau, refs[seed], shown, seed))
                    print(lines[-1], flush=True)
    _provenance.write_result("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
