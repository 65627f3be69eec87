"""Why ``WeightSpaceSVGD``'s eight-schools fit widens with longer training, and whether a
per-particle curvature metric stops it.

``--trajectory``: ``compare``'s ``wsvgd`` (its builder's defaults, ``ClippedAdam`` at its
rate, decaying tenfold over ``--steps``) on the non-centred eight schools, scored every
``--every`` steps against one NUTS chain: ``tau``'s sd ratio and mean error in NUTS sds and
the largest ``log tau`` of the particles. At the end, the forces on the particle with the
largest ``tau``, in ``log tau``'s unconstrained coordinate: its own score's share of the
kernel-weighted drive (weight ``1/N``), the other particles' share, and the repulsion.
With ``--variant metric`` the same run with :class:`CurvatureMetricSVGD`.

``--stiff``: :class:`CurvatureMetricSVGD` in place of ``WeightSpaceSVGD`` under
``benchmarks/stiff.py`` (the arguments after ``--stiff`` go to it).

:class:`CurvatureMetricSVGD` is a prototype for this experiment, not part of the library:
particle i's update measures distances in its own diagonal curvature metric
``q_i = max(-diag H_z(z_i), q_min)`` (the whitened log-density's Hessian diagonal,
refreshed every ``--metric-every`` steps): ``k_i(z_j) = exp(-|z_j - z_i|^2_{q_i} / 2h^2)``,
``phi_i = [q_i^{-1} sum_j k_i(z_j) g_j + sum_j k_i(z_j) (z_i - z_j) / h^2] / N`` (the
pointwise version of Wang et al. 2019's Hessian-preconditioned matrix-valued kernel;
asymmetric, so not a positive-definite kernel). A particle on the ridge of the funnel's
neck, where the curvature across the neck is large, stops feeling the others' repulsion.

    python benchmarks/svgd_curvature_metric.py --trajectory --seed 1
    python benchmarks/svgd_curvature_metric.py --trajectory --seed 1 --variant metric
    python benchmarks/svgd_curvature_metric.py --stiff --models all --methods wsvgd \\
        --steps 2000 --precondition on --seed 0 --out /tmp/stiff_metric.json
"""

import argparse
import functools
import os
import sys

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch

import pyro_implicit.diagnostics.methods as methods
from pyro_implicit import WeightSpaceSVGD
from pyro_implicit.diagnostics.compare import METHODS
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.kernels import median_from_squared_distances, squared_distances
from pyro_implicit.models import load_model
from pyro_implicit.particles.svgd import WHITENED_BANDWIDTH_FACTOR, stein_direction


class CurvatureMetricSVGD(WeightSpaceSVGD):
    """``WeightSpaceSVGD`` whose particles each measure distances in their own diagonal
    curvature metric (see the module docstring)."""

    #: floor of the metric's diagonal (whitened units)
    q_min = float(os.environ.get("SVGD_METRIC_QMIN", "0.25"))
    #: steps between refreshes of the metric
    every = int(os.environ.get("SVGD_METRIC_EVERY", "10"))

    def _hessian_diagonal(self, u, args, kwargs):
        """``(N, D)`` diagonal of each particle's whitened Hessian, ``L^T H_u L``: one
        batched second derivative along the columns of ``L``."""
        n, dim = u.shape
        columns = self.preconditioner.scale_tril.T.repeat(n, 1)
        with torch.enable_grad():
            batch = u.detach().repeat_interleave(dim, 0).requires_grad_(True)
            log_density = self.space.log_density(batch, args, kwargs, full_data=False)
            (grad,) = torch.autograd.grad(log_density.sum(), batch, create_graph=True)
            (hv,) = torch.autograd.grad((grad * columns).sum(), batch)
        return (hv * columns).sum(-1).reshape(n, dim)

    def step(self, *args, **kwargs):
        first = self._setup(args, kwargs)
        self._check_finite()
        log_joint, g, _ = self._scores(args, kwargs, first)
        z = self.particles.detach()
        self._steps = getattr(self, "_steps", 0) + 1
        if (self._steps - 1) % self.every == 0:
            u = self.unconstrained_particles().detach()
            self._q = (-self._hessian_diagonal(u, args, kwargs)).clamp(min=self.q_min)
        q, n = self._q, z.shape[0]
        h = median_from_squared_distances(squared_distances(z)) * WHITENED_BANDWIDTH_FACTOR
        x2 = z * z
        d2 = q @ x2.T - 2 * (q * z) @ z.T + (q * x2).sum(-1, keepdim=True)  # in metric q_i
        k = torch.exp(-d2.clamp(min=0) / (2 * h**2))
        drive = (k @ g) / q / n
        repulsion = (k.sum(-1, keepdim=True) * z - k @ z) / h**2 / n
        self._apply(drive + repulsion)
        return {"bandwidth": h.item(), "log_joint": log_joint.mean().item()}


def tail_forces(svgd, model):
    """The forces on the particle with the largest ``tau``, in ``log tau``'s coordinate."""
    with torch.no_grad():
        u = svgd.unconstrained_particles().detach()
        z = svgd.particles.detach()
        _, score_u = svgd.space.score(u, model.args, model.kwargs, full_data=False)
        g = svgd.preconditioner.whiten_score(score_u)
        d = stein_direction(z, g, svgd.kernel, svgd.method)
        pre = svgd.preconditioner
        scale = pre.scale_tril if pre.kind == "dense" else torch.diag(pre.scale)
        col = {s.name: s.start for s in svgd._sites}["tau"]
        i = u[:, col].argmax().item()
        n = z.shape[0]
        k = svgd.kernel.from_squared_distances(squared_distances(z - z[:1]), d.bandwidth)

        def in_u(v):
            return (scale @ v)[col].item()

        others = torch.arange(n) != i
        return {
            "log tau": u[i, col].item(),
            "particles' median log tau": u[:, col].median().item(),
            "total force": in_u(d.direction[i]),
            "its own score / N": in_u(g[i] / n),
            "the others' drive": in_u((k[i] @ g - g[i]) / n),
            "repulsion": in_u(d.repulsion[i]),
            "median |force| of all particles": (d.direction @ scale.T)[:, col]
            .abs()
            .median()
            .item(),
            "kernel to the others (min / median / max)": " / ".join(
                f"{v:.2f}" for v in (k[i, others].min(), k[i, others].median(), k[i, others].max())
            ),
        }


def trajectory(args):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    record = _provenance.provenance(__file__, sys.argv[1:], vars(args))
    model = load_model("eight_schools")
    reference = (
        run_nuts(
            model.model,
            *model.args,
            num_samples=args.nuts_samples,
            warmup_steps=args.nuts_samples // 2,
            num_chains=1,
            seed=args.seed,
            progress_bar=False,
            **model.kwargs,
        )
        .samples["tau"]
        .flatten()
    )
    spec = METHODS["wsvgd"]
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    optim = pyro.optim.ClippedAdam({"lr": spec.lr, "lrd": 0.1 ** (1.0 / args.steps)})
    if args.variant == "metric":
        methods.WeightSpaceSVGD = CurvatureMetricSVGD
        CurvatureMetricSVGD.every = args.metric_every
        CurvatureMetricSVGD.q_min = args.q_min
    if args.num_particles:
        methods.WSVGD_PARTICLES = args.num_particles
    if args.update != "svgd":
        methods.WeightSpaceSVGD = functools.partial(methods.WeightSpaceSVGD, method=args.update)
    svgd = spec.build(model.model, model.max_plate_nesting, optim, precondition=True)
    rows = []
    for step in range(1, args.steps + 1):
        svgd.step(*model.args, **model.kwargs)
        if step == args.refresh_at:
            svgd.refresh_preconditioner()
        if step % args.every == 0:
            tau = svgd.get_named_particles()["tau"].flatten()
            rows.append(
                (
                    step,
                    (tau.std() / reference.std()).item(),
                    ((tau.mean() - reference.mean()) / reference.std()).item(),
                    tau.log().max().item(),
                )
            )
            print(rows[-1], flush=True)
    variant = (
        f"`CurvatureMetricSVGD` (q_min {args.q_min}, metric every {args.metric_every} steps)"
        if args.variant == "metric"
        else "`WeightSpaceSVGD`"
    )
    if args.update != "svgd":
        variant += f", `method={args.update!r}`"
    if args.refresh_at:
        variant += f", `refresh_preconditioner()` after step {args.refresh_at}"
    lines = [
        f"## eight schools, {variant}, seed {args.seed}",
        "",
        f"`{record['command']}` (commit {record['commit']}, {record['utc']}), float64, one "
        f"thread: `compare`'s `wsvgd` builder ({svgd.num_particles} particles), ClippedAdam "
        f"at {spec.lr} decaying tenfold over {args.steps} steps; one NUTS chain of "
        f"{args.nuts_samples} draws as the reference.",
        "",
        "| step | tau sd ratio | tau mean err (NUTS sds) | largest log tau |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {s} | {r:.2f} | {e:+.2f} | {m:.2f} |" for s, r, e, m in rows]
    if args.variant == "default":
        lines += ["", "Forces on the particle with the largest `tau` at the end (`log tau`):", ""]
        lines += [f"- {name}: {value}" for name, value in tail_forces(svgd, model).items()]
    _provenance.write_result("\n".join(lines) + "\n", args.out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--stiff":
        import stiff

        methods.WeightSpaceSVGD = CurvatureMetricSVGD
        return stiff.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectory", action="store_true", required=True)
    parser.add_argument("--variant", choices=["default", "metric"], default="default")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nuts-samples", type=int, default=2000)
    parser.add_argument("--q-min", type=float, default=CurvatureMetricSVGD.q_min)
    parser.add_argument("--metric-every", type=int, default=CurvatureMetricSVGD.every)
    parser.add_argument(
        "--num-particles", type=int, help="particles (default: compare's, WeightSpaceSVGD's auto)"
    )
    parser.add_argument(
        "--refresh-at", type=int, help="call refresh_preconditioner() after this step"
    )
    parser.add_argument(
        "--update",
        choices=["svgd", "wsgld", "pisgld", "gfsf"],
        default="svgd",
        help="WeightSpaceSVGD's update rule (method=)",
    )
    parser.add_argument("--out")
    return trajectory(parser.parse_args(argv))


if __name__ == "__main__":
    main()
