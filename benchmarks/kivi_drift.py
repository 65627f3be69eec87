"""How far a fit's draws move from its preconditioner's Gaussian: the signal behind
``KernelRatioELBO``'s runaway warning.

Every preconditioned ``ImplicitGuide`` / ``SemiImplicitGuide`` / ``LinearizedGuide`` starts
at its preconditioner's Gaussian :math:`N(m, LL^\\top)`. This script fits the stiff
posteriors of ``benchmarks/stiff.py`` with ``compare``'s settings and the preconditioner on
(2000 steps of ``Adam(1e-2)``, as ``stiff.py``), and every 50 steps records the *drift*:
the largest over coordinates of :math:`|\\bar z|`, the mean of 200 draws whitened by the
preconditioner, :math:`z = L^{-1}(u - m)` (and, for ``KernelRatioELBO``, the largest
per-step drift of its own draws, ``diagnostics[group]["drift"]``, which its runaway warning
watches). At the end it scores the fit against the NUTS reference (max mean error in NUTS
sds). Fits that do not run away show how far a
posterior's mean lies from its preconditioner's; the kernel ratio's runaways show how
far they go.

    python benchmarks/kivi_drift.py --methods kivi --seeds 0,1 \\
        --out benchmarks/results/kivi_drift_kivi.json
    python benchmarks/kivi_drift.py --methods stein_score,sivi,livi,gpvi,asvgd --seeds 0 \\
        --out benchmarks/results/kivi_drift_others.json
    python benchmarks/kivi_drift.py --narrow-start 0,1,2,3,4,5,6,7 \\
        --out benchmarks/results/kivi_drift_narrow.json
    python benchmarks/kivi_drift.py --report benchmarks/results/kivi_drift_kivi.json \\
        benchmarks/results/kivi_drift_others.json benchmarks/results/kivi_drift_narrow.json \\
        --markdown benchmarks/results/kivi_drift.md
"""

import argparse
import json
import math
from pathlib import Path

import _provenance
import pyro
import pyro.distributions as dist
import stiff
import torch
from pyro.infer import SVI

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.diagnostics.metrics import compare_samples
from pyro_implicit.elbo.kernel_ratio import RUNAWAY_DRIFT

EVERY = 50


def drift(guide, num=200):
    """Largest coordinate of the mean of ``num`` whitened draws of ``guide``; the random
    streams are restored after, so the fit draws what it would unmeasured."""
    rng = pyro.util.get_rng_state()
    with torch.no_grad():
        z = guide.preconditioner.whiten(guide.sample_unconstrained(num))
    pyro.util.set_rng_state(rng)
    return z.mean(0).abs().max().item()


def _track_loss_drift(row, loss):
    """The largest per-step drift a ``KernelRatioELBO`` has seen (``diagnostics[group]
    ["drift"]``, each step's draws: the quantity its warning watches)."""
    for info in getattr(loss, "diagnostics", {}).values():
        if isinstance(info, dict) and info.get("drift") is not None:
            row["loss_drift_max"] = max(row.get("loss_drift_max", 0.0), info["drift"])


def fit(model_name, method, seed, steps):
    model, args, kwargs, mpn = stiff.MODELS[model_name]()
    reference, _ = stiff.load_reference(model_name)
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    optim = pyro.optim.Adam({"lr": 1e-2})
    _, guide, loss = stiff.build_method(method, model, mpn, optim, True)
    svi = SVI(model, guide, optim, loss)
    row = {"model": model_name, "method": method, "seed": seed, "drift": []}
    try:
        for step in range(1, steps + 1):
            svi.step(*args, **kwargs)
            _track_loss_drift(row, loss)
            if step % EVERY == 0:
                row["drift"].append(drift(guide))
        shapes = stiff.latent_shapes(model, *args, **kwargs)
        draws, _ = stiff.posterior_draws(guide, model, args, kwargs, 2000, mpn, shapes)
        metrics = compare_samples(draws, reference, sites=list(reference))
        row.update(status="ok", mean_error=metrics["joint"]["mean_error_max"])
    except (ValueError, RuntimeError) as e:
        row.update(status=type(e).__name__, mean_error=math.nan)
    finally:
        pyro.clear_param_store()
    return row


def narrow_regression():
    """The exact-posterior problem of ``tests/test_kernel_ratio.py``'s too-narrow start: a
    3-coefficient Bayesian linear regression with correlated predictors, its posterior
    mean and covariance."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g)
    x[:, 2] = 0.8 * x[:, 0] + 0.6 * x[:, 2]
    y = (x * torch.tensor([1.0, -0.5, 0.3])).sum(-1) + 0.5 * torch.randn(30, generator=g)
    cov = torch.linalg.inv(torch.eye(3) + x.T @ x / 0.25)
    mean = cov @ x.T @ y / 0.25

    def model(x, y):
        b = pyro.sample("beta", dist.Normal(torch.zeros(3), 1.0).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal((x * b).sum(-1), 0.5), obs=y)

    return model, (x, y), mean, cov


def fit_narrow_start(seed, steps):
    """``ImplicitGuide(init_scale=0.3)`` + ``KernelRatioELBO()`` on :func:`narrow_regression`
    (its preconditioner is the exact posterior): the drift every 50 steps and the error."""
    model, args, mean, cov = narrow_regression()
    pyro.clear_param_store()
    pyro.set_rng_seed(seed)
    guide = ImplicitGuide(model, init_scale=0.3)
    loss = KernelRatioELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    row = {"model": "narrow_start_regression", "method": "kivi", "seed": seed, "drift": []}
    for step in range(1, steps + 1):
        svi.step(*args)
        _track_loss_drift(row, loss)
        if step % EVERY == 0:
            row["drift"].append(drift(guide))
    draws = guide.sample_posterior(4000)["beta"]
    error = ((draws.mean(0) - mean).abs() / cov.diagonal().sqrt()).max().item()
    row.update(status="ok", mean_error=error)
    return row


def _warned(row):
    return "yes" if row.get("loss_drift_max", 0.0) > RUNAWAY_DRIFT else "no"


def report(paths, markdown):
    rows, runs = [], []
    for path in paths:
        record = json.loads(Path(path).read_text())
        runs.append(f"- `{record['command']}` (commit {record['commit']}, {record['utc']})")
        rows += record["rows"]
    lines = [
        "# Drift of a fit's draws from its preconditioner's Gaussian",
        "",
        "Runs (2000 steps of Adam(1e-2), preconditioner on, `compare`'s settings; drift: "
        "the largest coordinate of the mean of 200 draws whitened by the preconditioner, "
        f"every {EVERY} steps; error: max mean error in NUTS sds at the end):",
        "",
        *runs,
        "",
        "| model | method | seed | status | mean err | drift max | drift at the end | "
        f"first step past {RUNAWAY_DRIFT:g} | the loss's per-step drift max | warned |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        past = next((EVERY * (i + 1) for i, d in enumerate(r["drift"]) if d > RUNAWAY_DRIFT), None)
        top = max(r["drift"], default=math.nan)
        last = r["drift"][-1] if r["drift"] else math.nan
        lines.append(
            f"| {r['model']} | {r['method']} | {r['seed']} | {r['status']} | "
            f"{r['mean_error']:.3g} | {top:.3g} | {last:.3g} | {past or '-'} | "
            + (
                f"{r['loss_drift_max']:.3g} | {_warned(r)} |"
                if "loss_drift_max" in r
                else "- | - |"
            )
        )
    ours = [r for r in rows if r["method"] != "kivi"]
    kivi = [r for r in rows if r["method"] == "kivi"]
    quiet = max((max(r["drift"], default=0) for r in ours), default=math.nan)
    flagged = [r for r in kivi if _warned(r) == "yes"]
    lines += [
        "",
        f"Largest drift of a fit by the other methods: {quiet:.3g}. `kivi` fits whose loss "
        f"saw a step past {RUNAWAY_DRIFT:g} (`RUNAWAY_DRIFT`: the fit warned): "
        f"{len(flagged)} of {len(kivi)}; their errors: "
        + ", ".join(
            "diverged" if r["status"] != "ok" else f"{r['mean_error']:.2g}" for r in flagged
        )
        + "; the errors of the others: "
        + ", ".join(
            "diverged" if r["status"] != "ok" else f"{r['mean_error']:.2g}"
            for r in kivi
            if r not in flagged
        )
        + ".",
    ]
    _provenance.write_result("\n".join(lines) + "\n", markdown)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="kivi")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--models", default=",".join(stiff.MODELS))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument(
        "--narrow-start",
        help="seeds of the too-narrow start on an exact posterior instead (1000 steps)",
    )
    parser.add_argument("--out")
    parser.add_argument("--report", nargs="+", help="result files to merge into --markdown")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    if args.report:
        return report(args.report, args.markdown)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    record = dict(_provenance.provenance(__file__, argv, vars(args)), rows=[])
    if args.narrow_start:
        for seed in (int(s) for s in args.narrow_start.split(",")):
            record["rows"].append(fit_narrow_start(seed, 1000))
            print(json.dumps({k: v for k, v in record["rows"][-1].items() if k != "drift"}))
            if args.out:
                Path(args.out).write_text(json.dumps(record, indent=1))
        return
    for model_name in args.models.split(","):
        for method in args.methods.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                row = fit(model_name, method, seed, args.steps)
                record["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "drift"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
