"""GPVI benchmarks (Ratzlaff et al. 2021): Gaussians (Table 1), Bayesian linear regression
(Table 2) and the 2-D energy potentials (App. D.1, Figs. 4-7).

Usage::

    python benchmarks/gpvi.py gaussian --seed 0 [--smoke]
    python benchmarks/gpvi.py blr --seed 0 [--smoke]
    python benchmarks/gpvi.py energy --seed 0 [--smoke]

Each prints progress and a markdown table. Errors are the relative norms the digest
settles on (GPVI digest Sec. 5.7): ``|Sigma_hat - Sigma|_F / |Sigma|_F`` and
``|mu_hat - mu| / |mu|``; for the linear generators ``(mu_hat, Sigma_hat) = (b, W W^T)`` are
read off the weights, as in the paper; sample-based methods use sample moments. The
papers' raw-space settings are pinned (``precondition=False``, GPVI's helper network
``exact_jacobian=False``), whatever the library's defaults.
"""

import argparse
import statistics
import time
from pathlib import Path

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import GPVI_ELBO, AmortizedSVGD_ELBO, ImplicitGuide, WeightSpaceSVGD
from pyro_implicit.diagnostics.metrics import energy_distance
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.elbo.gpvi import gpvi_generator
from pyro_implicit.kernels import RBFKernel, svgd_bandwidth_factor
from pyro_implicit.targets.energy import ENERGY_POTENTIALS, energy_log_density, energy_model

FIGURES = Path(__file__).parent / "results" / "figures"


def _log(msg):
    print(msg, flush=True)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _linear_moments(guide):
    gen = guide.generator.output
    w, b = gen.weight.detach(), gen.bias.detach()
    return b, w @ w.T


def _fit(model, guide, loss, steps, lr, args=(), final_lr_ratio=0.01, label=""):
    """Adam with a geometric decay to ``final_lr_ratio * lr`` over ``steps``."""
    optim = pyro.optim.ClippedAdam(
        {"lr": lr, "lrd": final_lr_ratio ** (1 / steps), "clip_norm": 100}
    )
    svi = SVI(model, guide, optim, loss)
    start = time.perf_counter()
    for i in range(steps):
        value = svi.step(*args)
        if (i + 1) % max(1, steps // 4) == 0:
            _log(f"    {label} step {i + 1}/{steps} loss {value:.3f}")
    return time.perf_counter() - start


def _paper_asvgd(num_particles):
    """Amortised SVGD with the GPVI paper's kernel (Liu & Wang's length scale alone, not
    the library's two-scale default), so the paper's table stays reproducible."""
    kernel = RBFKernel(bandwidth_factor=svgd_bandwidth_factor(num_particles))
    return AmortizedSVGD_ELBO(num_particles, kernel=kernel)


def _losses(num_particles, helper_lr):
    return {
        "GPVI": lambda: GPVI_ELBO(num_particles, exact_jacobian=False, helper_lr=helper_lr),
        "GPVI exact Jac": lambda: GPVI_ELBO(num_particles, exact_jacobian=True),
        "amortised SVGD": lambda: _paper_asvgd(num_particles),
    }


def _summary(values):
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {sd:.3f}"


# ----------------------------------------------------------------------------- Table 1
PAPER_TABLE1 = {
    "GPVI": ("0.14 ± .08", "0.14 ± .04"),
    "GPVI exact Jac": ("0.15 ± .09", "0.49 ± .17"),
    "amortised SVGD": ("0.10 ± .09", "0.37 ± .32"),
}


def gaussian(seed=0, smoke=False, num_seeds=3, steps=1500, num_particles=32):
    """Zero-mean Gaussians with covariance A A^T, A ~ N(0, I) entries, in 2-D and 5-D; a
    linear square generator u = W z + b; covariance error of W W^T."""
    if smoke:
        num_seeds, steps, num_particles = 1, 20, 8
    rows = {}
    for dim in (2, 5):
        for method, make_loss in _losses(num_particles, helper_lr=1e-3).items():
            errors = []
            for s in range(seed, seed + num_seeds):
                pyro.set_rng_seed(1000 * dim + s)
                a = torch.randn(dim, dim)
                cov = a @ a.T
                target = dist.MultivariateNormal(torch.zeros(dim), cov)

                def model(target=target):
                    pyro.sample("x", target)

                pyro.clear_param_store()
                guide = ImplicitGuide(model, hidden_dims=(), init_scale=1.0, precondition=False)
                secs = _fit(model, guide, make_loss(), steps, 1e-2, label=f"{dim}-D {method}")
                _, cov_hat = _linear_moments(guide)
                errors.append(_rel(cov_hat, cov))
                _log(f"  {dim}-D {method} seed {s}: cov error {errors[-1]:.3f} ({secs:.0f} s)")
            rows.setdefault(method, {})[dim] = errors
    lines = [
        "| method | Σ error 2-D (ours) | Σ error 5-D (ours) | paper 2-D | paper 5-D |",
        "|---|---|---|---|---|",
    ]
    for method, by_dim in rows.items():
        p2, p5 = PAPER_TABLE1[method]
        lines.append(f"| {method} | {_summary(by_dim[2])} | {_summary(by_dim[5])} | {p2} | {p5} |")
    table = "\n".join(lines)
    print(table)
    return rows


# ----------------------------------------------------------------------------- Table 2
PAPER_TABLE2 = {
    "GPVI": "0.002 ± .0007 / 0.128 ± .04",
    "GPVI exact Jac": "0.002 ± .0004 / 0.106 ± .07",
    "amortised SVGD": "0.002 ± .0009 / 0.158 ± .04",
    "weight-space SVGD": "0.006 ± .0024 / 0.125 ± .03",
    "AutoNormal (MF-VI)": "0.004 ± .0035 / 0.303 ± .04",
    "NUTS (paper: HMC)": "0.009 ± .0003 / 0.181 ± .05",
}


def blr_model(x, y, batch_size=None, prior_scale=10.0):
    """y = x beta + eps, eps ~ N(0, 1), beta ~ N(0, prior_scale^2 I); written with
    broadcasting so a particle plate can stack draws of beta."""
    d = x.shape[-1]
    beta = pyro.sample("beta", dist.Normal(torch.zeros(d), prior_scale).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        mean = (x[idx] * beta).sum(-1)
        pyro.sample("y", dist.Normal(mean, 1.0), obs=y[idx])


def blr(
    seed=0,
    smoke=False,
    num_seeds=2,
    steps=2000,
    num_data=50,
    batch_size=10,
    num_particles=50,
    lr=5e-2,
):
    """Bayesian linear regression, d = 3 (paper Sec. 4.2): X ~ N(0, I), beta ~ U(0, 1) + 5,
    unit noise; exact conjugate posterior with the N(0, 10^2 I) prior. Every optimiser is
    Adam from ``lr`` decaying geometrically to ``lr / 100`` (the paper: 50k steps at 1e-3)."""
    if smoke:
        num_seeds, steps, num_particles = 1, 10, 8
    d = 3
    results = {}
    for s in range(seed, seed + num_seeds):
        pyro.set_rng_seed(s)
        x = torch.randn(num_data, d)
        beta_true = torch.rand(d) + 5
        y = x @ beta_true + torch.randn(num_data)
        cov = torch.linalg.inv(x.T @ x + torch.eye(d) / 100.0)
        mean = cov @ x.T @ y
        args = (x, y, batch_size)

        def record(method, m, c, secs, s=s, mean=mean, cov=cov):
            errs = (_rel(m, mean), _rel(c, cov))
            results.setdefault(method, []).append(errs)
            _log(f"  seed {s} {method}: mean {errs[0]:.4f} cov {errs[1]:.3f} ({secs:.0f} s)")

        for method, make_loss in _losses(num_particles, helper_lr=1e-2).items():
            pyro.clear_param_store()
            guide = ImplicitGuide(blr_model, hidden_dims=(), init_scale=1.0, precondition=False)
            secs = _fit(blr_model, guide, make_loss(), steps, lr, args, label=method)
            record(method, *_linear_moments(guide), secs)

        pyro.clear_param_store()
        svgd = WeightSpaceSVGD(
            blr_model,
            pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.01 ** (1 / steps)}),
            num_particles=100,
            max_plate_nesting=1,
            # N(0, I) like the generators' initial spread: prior draws (scale 10) lie further
            # out than Adam can move them in this budget
            init_particles=torch.randn(100, d),
            precondition=False,
        )
        start = time.perf_counter()
        for _ in range(steps):
            svgd.step(*args)
        p = svgd.get_named_particles()["beta"]
        record("weight-space SVGD", p.mean(0), torch.cov(p.T), time.perf_counter() - start)

        pyro.clear_param_store()
        guide = AutoNormal(blr_model, init_scale=0.1)
        secs = _fit(blr_model, guide, Trace_ELBO(), steps, lr, args, label="AutoNormal")
        loc, scale = guide.locs.beta, guide.scales.beta
        record("AutoNormal (MF-VI)", loc.detach(), torch.diag(scale.detach() ** 2), secs)

        nuts = run_nuts(
            blr_model,
            x,
            y,
            None,
            num_samples=20 if smoke else 2000,
            warmup_steps=10 if smoke else 500,
            num_chains=1 if smoke else 2,
            seed=s,
            progress_bar=False,
        )
        b = nuts.samples["beta"]
        record("NUTS (paper: HMC)", b.mean(0), torch.cov(b.T), nuts.wall_time)
    lines = [
        "| method | μ error (ours) | Σ error (ours) | paper μ / Σ error |",
        "|---|---|---|---|",
    ]
    for method, errs in results.items():
        lines.append(
            f"| {method} | {_summary([e[0] for e in errs])} | {_summary([e[1] for e in errs])}"
            f" | {PAPER_TABLE2[method]} |"
        )
    print("\n".join(lines))
    return results


# ----------------------------------------------------------------------------- energy
def energy(
    seed=0, smoke=False, steps=1500, num_particles=50, hidden=(64, 64), num_draws=20000, plot=True
):
    """The four potentials: GPVI and amortised SVGD with the same generator
    f(z) = g(z) + z (eq. 6 with k = D = 2), energy distance to NUTS draws, and a figure.

    The floor of the metric is the energy distance between NUTS's two chains."""
    num_nuts = 1000
    if smoke:
        steps, num_particles, hidden, num_draws, plot, num_nuts = 10, 8, (8,), 200, False, 10
    names = list(ENERGY_POTENTIALS)[:1] if smoke else list(ENERGY_POTENTIALS)
    draws, rows = {}, {}
    for name in names:
        model = energy_model(name)
        nuts = run_nuts(
            model,
            num_samples=num_nuts,
            warmup_steps=num_nuts // 3,
            num_chains=2,
            seed=seed,
            progress_bar=False,
            nuts_kwargs={"max_tree_depth": 3} if smoke else None,
        )
        reference = nuts.samples["z"]
        chains = nuts.samples_by_chain["z"]
        rows.setdefault("NUTS chain 1 vs chain 2 (floor)", {})[name] = energy_distance(
            chains[0], chains[1]
        )
        draws[(name, "NUTS")] = reference
        _log(f"  {name}: NUTS {nuts.wall_time:.0f} s")
        for method, make_loss in (
            ("GPVI", lambda: GPVI_ELBO(num_particles, exact_jacobian=False, helper_lr=1e-3)),
            ("amortised SVGD", lambda: _paper_asvgd(num_particles)),
        ):
            pyro.clear_param_store()
            pyro.set_rng_seed(seed)
            guide = ImplicitGuide(
                model,
                generator=gpvi_generator(hidden_dims=hidden),
                init_scale=1.0,
                precondition=False,
            )
            secs = _fit(
                model, guide, make_loss(), steps, 3e-3, final_lr_ratio=0.1, label=f"{name} {method}"
            )
            sample = guide.sample_posterior(num_draws)["z"]
            draws[(name, method)] = sample
            ed = energy_distance(sample, reference)
            rows.setdefault(method, {})[name] = ed
            _log(f"  {name} {method}: energy distance {ed:.4f} ({secs:.0f} s)")
    lines = ["| method | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for method, by_name in rows.items():
        lines.append(f"| {method} | " + " | ".join(f"{by_name[n]:.4f}" for n in names) + " |")
    print("\n".join(lines))
    if plot:
        _plot_energy(names, draws, FIGURES / "gpvi_energy.png")
    return rows


def _plot_energy(names, draws, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = ["NUTS", "GPVI", "amortised SVGD"]
    fig, axes = plt.subplots(len(names), len(methods), figsize=(9, 12))
    grid = torch.linspace(-4, 4, 200)
    zz = torch.stack(torch.meshgrid(grid, grid, indexing="xy"), -1)
    for i, name in enumerate(names):
        density = energy_log_density(name)(zz).exp()
        for j, method in enumerate(methods):
            ax = axes[i, j]
            ax.contourf(grid, grid, density, levels=20, cmap="Blues")
            pts = draws[(name, method)][:3000]
            ax.scatter(pts[:, 0], pts[:, 1], s=1, c="tab:red", alpha=0.3)
            ax.set_xlim(-4, 4)
            ax.set_ylim(-4, 4)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(method)
            if j == 0:
                ax.set_ylabel(name)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    _log(f"  wrote {path}")


COMMANDS = {"gaussian": gaussian, "blr": blr, "energy": energy}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(COMMANDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny version (seconds)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    start = time.perf_counter()
    result = COMMANDS[opts.command](seed=opts.seed, smoke=opts.smoke)
    _log(f"total {time.perf_counter() - start:.0f} s")
    return result


if __name__ == "__main__":
    main()
