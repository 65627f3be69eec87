"""SIVI Bayesian logistic regression on waveform (Yin & Zhou 2018, Sec. 5.4, App. B) against
the shipped Polya-Gamma Gibbs draws, Pyro NUTS and mean-field VI.

Model: ``pyro_implicit.models.waveform_logistic()`` (400 training points, 22 coefficients
including the intercept, prior N(0, 100) per coefficient as the paper). Methods:

* SIVI: ``SemiImplicitGuide`` with the paper's BLR layers (50-dim mixing noise, mixing MLP
  [100, 200, 100], full-covariance Gaussian conditional, "SIVI-full") and ``SIVI_ELBO``
  (J = 50, K = 100, App. B.4). Unlike the paper, mixing and conditional parameters are
  updated jointly by one Adam, not alternately. The paper's raw-space settings are
  pinned (``precondition=False``).
* AutoNormal (mean-field Gaussian) with vectorised ``Trace_ELBO``, same J, steps, schedule.
* NUTS (``run_nuts``) and the 250 Gibbs draws stored in ``waveform.mat`` (``BetaMCMC``);
  the paper's stored full-covariance MFVI draws (``Beta_VB_sample``) for context.

Reported: per-coefficient posterior sds and their median ratio to Gibbs and to NUTS; RMS
difference of the 231 pairwise correlations; on the 4,600 test points, the accuracy of the
posterior-mean predictive probability, the mean test log-likelihood
log mean_j p(y | x, beta_j) and the mean predictive-probability sd (the paper's Fig. 5).

Usage::

    nice -n 10 python benchmarks/sivi_waveform.py --seed 0
    python benchmarks/sivi_waveform.py --smoke
"""

import argparse
import math
import time

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit.datasets import load_waveform
from pyro_implicit.diagnostics.metrics import correlation_rmse, sd_ratio
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.elbo.sivi import SIVI_ELBO
from pyro_implicit.guides.semi_implicit import SemiImplicitGuide
from pyro_implicit.models import waveform_logistic


def fit(method, builtin, args):
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    model = builtin.model
    if method == "SIVI":
        guide = SemiImplicitGuide(model, conditional="full", precondition=False)
        loss = SIVI_ELBO(
            num_particles=args.particles, num_mixing=args.num_mixing, max_plate_nesting=1
        )
    else:
        guide = AutoNormal(model)
        loss = Trace_ELBO(
            num_particles=args.particles, vectorize_particles=True, max_plate_nesting=1
        )
    optim = pyro.optim.ClippedAdam({"lr": args.lr, "lrd": 0.1 ** (1 / args.steps)})
    svi = SVI(model, guide, optim, loss)
    start = time.perf_counter()
    for step in range(args.steps):
        value = svi.step(*builtin.args, **builtin.kwargs)
        if (step + 1) % max(args.steps // 5, 1) == 0:
            print(f"[{method}] step {step + 1}/{args.steps} loss {value:.2f}", flush=True)
    seconds = time.perf_counter() - start
    predictive = Predictive(model, guide=guide, num_samples=args.draws, return_sites=["beta"])
    with torch.no_grad():
        beta = predictive(*builtin.args, **builtin.kwargs)["beta"].reshape(args.draws, -1)
    return beta, seconds


def predictive_metrics(beta, x_test, y_test):
    probs = torch.sigmoid(x_test @ beta.T)  # (n_test, S)
    mean_prob = probs.mean(1)
    accuracy = ((mean_prob > 0.5).double() == y_test).double().mean().item()
    log_lik = torch.where(y_test.bool().unsqueeze(-1), probs, 1 - probs).clamp_min(1e-300).log()
    test_ll = (torch.logsumexp(log_lik, 1) - math.log(beta.shape[0])).mean().item()
    return accuracy, test_ll, probs.std(1).mean().item()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--particles", type=int, default=50, help="J (both VI methods)")
    parser.add_argument("--num-mixing", type=int, default=100, help="SIVI's K")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--nuts-samples", type=int, default=1000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    warmup = 500
    if args.smoke:
        args.steps, args.particles, args.num_mixing, args.draws = 3, 4, 3, 20
        args.nuts_samples, warmup = 10, 10
    data = load_waveform()
    builtin = waveform_logistic()
    draws = {"Gibbs (BetaMCMC, 250 stored)": data.beta_mcmc}
    nuts = run_nuts(
        builtin.model,
        *builtin.args,
        num_samples=args.nuts_samples,
        warmup_steps=warmup,
        num_chains=2,
        seed=args.seed,
        max_plate_nesting=1,
        progress_bar=False,
        **builtin.kwargs,
    )
    print(
        f"[NUTS] {nuts.wall_time:.0f}s, max R-hat {nuts.max_r_hat:.3f}, "
        f"min ESS {nuts.min_ess:.0f}, divergences {nuts.num_divergences}",
        flush=True,
    )
    draws["NUTS"] = nuts.samples["beta"].reshape(-1, data.x_train.shape[1])
    times = {"NUTS": nuts.wall_time}
    for method in ("SIVI", "AutoNormal"):
        draws[method], times[method] = fit(method, builtin, args)
    draws["MFVI-full (paper, 250 stored)"] = data.beta_vb
    gibbs, ref_nuts = draws["Gibbs (BetaMCMC, 250 stored)"], draws["NUTS"]
    print()
    print(
        f"waveform BLR, prior N(0, 100); VI: {args.steps} steps, J = {args.particles}, "
        f"SIVI K = {args.num_mixing}, {args.draws} draws; NUTS 2 x {args.nuts_samples} "
        f"after {warmup} warm-up; seed {args.seed}"
    )
    print(
        "| method | median sd ratio to Gibbs | median sd ratio to NUTS | "
        "corr RMSE to Gibbs | corr RMSE to NUTS | test acc | test log-lik | "
        "mean pred. sd | time (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, beta in draws.items():
        acc, ll, psd = predictive_metrics(beta, data.x_test, data.y_test)
        print(
            f"| {name} | {sd_ratio(beta, gibbs).median():.3f} | "
            f"{sd_ratio(beta, ref_nuts).median():.3f} | {correlation_rmse(beta, gibbs):.3f} | "
            f"{correlation_rmse(beta, ref_nuts):.3f} | {acc:.4f} | {ll:.4f} | {psd:.4f} | "
            f"{times.get(name, float('nan')):.0f} |"
        )
    print()
    print("posterior sd per coefficient (beta_0 = intercept):")
    print("| coef | " + " | ".join(draws) + " |")
    print("|---|" + "---:|" * len(draws))
    sds = {name: beta.std(0) for name, beta in draws.items()}
    for d in range(gibbs.shape[1]):
        print(f"| {d} | " + " | ".join(f"{sds[n][d]:.3f}" for n in draws) + " |")
    return draws


if __name__ == "__main__":
    main()
