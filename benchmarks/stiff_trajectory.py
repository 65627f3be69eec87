"""One fit of the stiff benchmark scored every few hundred steps against the gold NUTS
draws: where a longer run's error comes from, and whether a check without NUTS sees it.

The model, the method and its optimiser are those of ``benchmarks/stiff.py`` (``compare``'s
builders, the preconditioner on, ``ClippedAdam`` with the rate decayed by ``--lr-decay``
over ``--steps``, or plain ``Adam`` without it). Every ``--every`` steps 2000 draws of the
fit are scored:

- against the gold draws: the max mean error in gold sds and the energy distance;
- without NUTS: the kernel Stein discrepancy of ``--ksd-draws`` of them in the model's own
  preconditioner coordinates (``stiff.diagnostics``; the V-statistic ``ksd`` and the
  unbiased U-statistic of KSD^2, the latter meaningful for independent draws only);
- the two halves of the Gaussian-entropy surrogate that ``SteinScoreELBO`` maximises:
  ``E_q log p``, the mean unconstrained log-joint of the draws, and ``H_gauss``, the
  entropy of the Gaussian of their moments; the gold draws' own values are printed beside.
  ``E_q log p + H[q]`` can never exceed ``log Z``, so a fit whose ``E_q log p`` climbs far
  above the posterior's while ``H_gauss`` stays flat has lost entropy that the Gaussian
  part cannot see.

    python benchmarks/stiff_trajectory.py --model stochastic_volatility --method stein_score \\
        --steps 5000 --every 500 --lr-decay 0.1 --seed 0 \\
        --out benchmarks/results/stiff_trajectory_sv_stein_seed0.json
    python benchmarks/stiff_trajectory.py --report benchmarks/results/stiff_trajectory_*.json \\
        --markdown benchmarks/results/stiff_trajectory_sv.md
"""

import argparse
import json
import math
import time

import _provenance
import pyro
import stiff
import torch
from compare_trajectory import add_loss_set_argument, apply_loss_settings
from pyro.infer import SVI

from pyro_implicit.diagnostics.metrics import compare_samples
from pyro_implicit.latent import LatentSpace

NUM_DRAWS = 2000


def packed(space, draws):
    """``(N, D)`` unconstrained packing of ``{site: (N, ...)}`` draws of ``space``'s sites."""
    return torch.cat(
        [s.transform.inv(draws[s.name]).reshape(draws[s.name].shape[0], -1) for s in space.sites],
        -1,
    )


def surrogate_parts(space, draws, args, kwargs):
    """``(E log p, H_gauss)`` of ``draws``: the mean unconstrained log-joint and the entropy of
    the Gaussian of their moments (unbiased covariance)."""
    u = packed(space, draws)
    with torch.no_grad():
        log_p = space.log_density(u, args, kwargs)
        cov = torch.cov(u.T).reshape(u.shape[1], u.shape[1])
        h_gauss = 0.5 * torch.logdet(2 * math.pi * math.e * cov)
    return float(log_p.mean()), float(h_gauss)


def run(args):
    model_fn = stiff.MODELS[args.model]
    model, margs, mkwargs, mpn = model_fn()
    reference, _ = stiff.load_reference(args.model)
    space = LatentSpace.from_model(model, margs, mkwargs, max_plate_nesting=mpn)
    gold = {s.name: reference[s.name] for s in space.sites}
    gold_log_p, gold_h = surrogate_parts(space, gold, margs, mkwargs)
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(next(iter(gold.values())).shape[0], generator=g)[: args.ksd_draws]
    gold_ksd = stiff.diagnostics(args.model, {k: v[idx] for k, v in reference.items()})
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    if args.lr_decay is None:
        optim = pyro.optim.Adam({"lr": args.lr})
    else:
        optim = pyro.optim.ClippedAdam(
            {"lr": args.lr, "lrd": args.lr_decay ** (1.0 / max(args.steps, 1))}
        )
    kind, obj, loss = stiff.build_method(args.method, model, mpn, optim, True)
    if loss is not None:
        apply_loss_settings(loss, args.loss_set)
    step = obj.step if kind == "particles" else SVI(model, obj, optim, loss).step
    shapes = stiff.latent_shapes(model, *margs, **mkwargs)
    rows, losses, start = [], [], time.perf_counter()
    for i in range(1, args.steps + 1):
        out = step(*margs, **mkwargs)
        if isinstance(out, dict):
            out = -out["log_joint"] if "log_joint" in out else sum(out.values())
        losses.append(float(out))
        if i % args.every:
            continue
        # scoring draws its own random numbers: the fit goes on with the stream it had
        rng = pyro.util.get_rng_state()
        with torch.no_grad():
            draws, _ = stiff.posterior_draws(obj, model, margs, mkwargs, NUM_DRAWS, mpn, shapes)
        metrics = compare_samples(draws, reference, sites=list(reference))["joint"]
        ksd = stiff.diagnostics(args.model, {k: v[: args.ksd_draws] for k, v in draws.items()})
        log_p, h_gauss = surrogate_parts(space, draws, margs, mkwargs)
        pyro.util.set_rng_state(rng)
        window = losses[-max(1, args.every // 5) :]
        row = {
            "step": i,
            "loss": sum(window) / len(window),
            "mean_error_max": metrics["mean_error_max"],
            "sd_ratio_min": metrics["sd_ratio_min"],
            "sd_ratio_max": metrics["sd_ratio_max"],
            "energy_distance": metrics["energy_distance"],
            "ksd": ksd["ksd"],
            "ksd_squared_unbiased": ksd["ksd_squared_unbiased"],
            "log_p_mean": log_p,
            "h_gauss": h_gauss,
            "seconds": time.perf_counter() - start,
        }
        rows.append(row)
        print(
            f"{i:6d} loss {row['loss']:8.2f} err {row['mean_error_max']:.3f} energy "
            f"{row['energy_distance']:.4f} ksd {row['ksd']:6.2f} "
            f"U {row['ksd_squared_unbiased']:9.3f} "
            f"E log p {log_p:8.2f} H_gauss {h_gauss:7.2f}",
            flush=True,
        )
    return {
        "gold": {
            "log_p_mean": gold_log_p,
            "h_gauss": gold_h,
            "ksd": gold_ksd["ksd"],
            "ksd_squared_unbiased": gold_ksd["ksd_squared_unbiased"],
            "ksd_draws": args.ksd_draws,
        },
        "rows": rows,
    }


def null_statistics(models, sizes, subsets, out=None, header=""):
    """The U-statistic of KSD^2 of random subsets of each model's gold draws (``subsets``
    of each size in ``sizes``, in the coordinates ``stiff.diagnostics`` uses): what exact
    draws read, to set a fit's readings against."""
    import statistics

    lines = [
        "# The KSD^2 U-statistic of exact draws: random subsets of the gold NUTS draws",
        "",
        header,
        "",
        "| model | draws | mean | sd | min | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in models:
        reference, _ = stiff.load_reference(name)
        total = next(iter(reference.values())).shape[0]
        g = torch.Generator().manual_seed(0)
        for size in sizes:
            values = []
            for _ in range(subsets):
                idx = torch.randperm(total, generator=g)[:size]
                sub = {k: v[idx] for k, v in reference.items()}
                values.append(stiff.diagnostics(name, sub)["ksd_squared_unbiased"])
            lines.append(
                f"| {name} | {size} | {statistics.mean(values):.4f} | "
                f"{statistics.stdev(values):.4f} | {min(values):.4f} | {max(values):.4f} |"
            )
            print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")


def report(paths, markdown):
    """One table per file (its command, commit and settings above it)."""
    lines = ["# Stiff fits scored along their training", ""]
    for path in paths:
        blob = json.load(open(path))
        s, gold = blob["settings"], blob["result"]["gold"]
        if s["lr_decay"] is None:
            schedule = "Adam, constant rate"
        elif s["lr_decay"] == 1.0:
            schedule = "ClippedAdam, constant rate"
        else:
            schedule = f"ClippedAdam, rate decayed to {s['lr_decay']} x"
        lines += [
            f"## {s['model']}, {s['method']}, seed {s['seed']}, {schedule}"
            + (f", {', '.join(s['loss_set'])}" if s["loss_set"] else ""),
            "",
            f"`{blob['command']}` (commit {blob['commit']}, {blob['utc']}); lr {s['lr']}"
            + (f" decayed to {s['lr_decay']} x" if s["lr_decay"] is not None else " constant")
            + f" over {s['steps']} steps; {NUM_DRAWS} draws per check, KSD from "
            f"{s['ksd_draws']}. Gold NUTS draws: E log p {gold['log_p_mean']:.2f}, H_gauss "
            f"{gold['h_gauss']:.2f}, KSD {gold['ksd']:.2f} (U {gold['ksd_squared_unbiased']:.3f}, "
            f"{gold['ksd_draws']} draws).",
            "",
            "| step | loss | mean err | sd ratio | energy | KSD | KSD^2 U | E log p | H_gauss "
            "| s |",
            "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in blob["result"]["rows"]:
            lines.append(
                f"| {r['step']} | {r['loss']:.2f} | {r['mean_error_max']:.3f} | "
                f"{r['sd_ratio_min']:.2f}-{r['sd_ratio_max']:.2f} | {r['energy_distance']:.4f} | "
                f"{r['ksd']:.2f} | {r['ksd_squared_unbiased']:.3f} | {r['log_p_mean']:.2f} | "
                f"{r['h_gauss']:.2f} | {r['seconds']:.0f} |"
            )
        lines.append("")
    text = "\n".join(lines)
    with open(markdown, "w") as f:
        f.write(text)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stochastic_volatility", choices=sorted(stiff.MODELS))
    parser.add_argument("--method", default="stein_score")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--lr-decay", type=float, default=None)
    parser.add_argument("--ksd-draws", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    add_loss_set_argument(parser)
    parser.add_argument("--out")
    parser.add_argument(
        "--null",
        help="instead of a fit: the KSD^2 U-statistic of random subsets of the gold draws "
        "of these models (comma-separated, or all)",
    )
    parser.add_argument("--null-draws", default="200,500", help="subset sizes for --null")
    parser.add_argument("--null-subsets", type=int, default=10)
    parser.add_argument("--report", nargs="+", help="result files to tabulate")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.markdown)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    if args.null:
        models = sorted(stiff.MODELS) if args.null == "all" else args.null.split(",")
        sizes = [int(n) for n in args.null_draws.split(",")]
        record = _provenance.provenance(__file__, argv, vars(args))
        header = (
            f"`{record['command']}` (commit {record['commit']}, {record['utc']}); "
            f"{args.null_subsets} subsets per size, in the coordinates of each model's "
            "automatic preconditioner (as `stiff.py --diagnostics`)."
        )
        return null_statistics(models, sizes, args.null_subsets, args.out, header)
    record = _provenance.provenance(__file__, argv, vars(args))
    record["result"] = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
