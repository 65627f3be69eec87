"""Sample-based score estimators of a Gaussian q (spectral Stein, Shi, Sun & Zhu 2018; Stein
gradient estimator, Li & Turner 2018) against the exact score, and the entropy gradient of a
linear generator u = A z they imply against the exact A^{-T}: can a score estimate of q
replace the kernel ratio (issue #26, item 3)?

For each dimension d, 100 draws of q = N(0, A A^T) with A = I + N(0, 1/d): the relative
error of the estimated score at the draws, and of E[s(u) z^T] against -A^{-T}, averaged over
5 draws of A, for a grid of settings (RBF bandwidth: the median-heuristic scale times
``scale``; SSGE's number of eigenfunctions J; the Stein estimator's ridge eta).

A second table (``--kl``) asks the question the fits ask: the gradient of
KL(q || N(0, I)) with respect to A, for q = N(0, A A^T) near its contrast (A = I + 0.3 G /
sqrt(d)), from KIVI's kernel ratio (``kernel_kl``, the library's defaults) and from
``SteinScoreELBO``'s score estimate (the draws' Gaussian plus the Stein residual), against
the exact A - A^{-T}: the median relative error of one draw of 100 and the relative error
of the mean over 100 draws (the bias that SGD does not average away). Its second part varies
the kernel ratio alone: the number of draws n (of q and of the contrast alike), the
regulariser lambda, and a sample split (the ratio fitted on half of q's draws and evaluated
at the other half, both ways: the in-sample fit divides its gradient by a value shrunk by
the draw's own kernel centre). The split is tried here only; the library does not have it.

A third table (``--kl-cv``) tries issue #26's "bandwidth chosen per step by the ratio fit's
own held-out loss": for each estimate, the RBF bandwidth factor (times the median length
scale) and lambda minimising the two-fold held-out least-squares loss of the ratio fit,
0.5 E_q[r^2] - E_p[r] (the LSIF objective of r = p / q), then KIVI's estimate with all
draws at that choice.

Usage::

    python benchmarks/score_estimators.py > benchmarks/results/score_estimators.md
    python benchmarks/score_estimators.py --kl > benchmarks/results/kl_gradients.md
    python benchmarks/score_estimators.py --kl-cv > benchmarks/results/kl_bandwidth_cv.md
"""

import math

import torch


def _kernel(x, scale):
    m = x.shape[0]
    d2 = torch.cdist(x, x).pow(2)
    w2 = scale * d2[~torch.eye(m, dtype=torch.bool)].median()
    return torch.exp(-d2 / (2 * w2)), w2


def ssge(x, num_eigen, scale=1.0):
    """Spectral Stein gradient estimator at the draws themselves (Nystrom, in-sample)."""
    m = x.shape[0]
    k, w2 = _kernel(x, scale)
    lam, u = torch.linalg.eigh(k + 1e-8 * torch.eye(m))
    lam, u = lam.flip(0)[:num_eigen], u.flip(1)[:, :num_eigen]
    c = k.sum(1)
    beta = (u * (lam[None] - c[:, None])).T @ x / lam[:, None]
    return u @ beta / w2


def stein(x, eta, scale=1.0):
    """Stein gradient estimator: -(K + eta I)^{-1} <grad, K>."""
    m = x.shape[0]
    k, w2 = _kernel(x, scale)
    grad_k = (x * k.sum(1)[:, None] - k @ x) / w2
    return -torch.linalg.solve(k + eta * torch.eye(m), grad_k)


def errors(estimator, dim, num=100, reps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    score_err, grad_err = [], []
    for _ in range(reps):
        a = torch.randn(dim, dim, generator=g) / math.sqrt(dim) + torch.eye(dim)
        z = torch.randn(num, dim, generator=g)
        x = z @ a.T
        s = estimator(x)
        exact = -torch.linalg.solve(a @ a.T, x.T).T
        score_err.append(float((s - exact).norm() / exact.norm()))
        grad = -(s.T @ z) / num
        target = torch.linalg.inv(a).T
        grad_err.append(float((grad - target).norm() / target.norm()))
    return sum(score_err) / reps, sum(grad_err) / reps


def main():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    print("# Score estimators of a Gaussian q from 100 draws\n")
    print(
        "`python benchmarks/score_estimators.py`. Cells: relative error of the score / "
        "of the entropy gradient, mean of 5 draws of A.\n"
    )
    print("| estimator | setting | d = 2 | d = 10 | d = 50 |")
    print("|---|---|---|---|---|")
    for scale in (0.5, 1.0, 2.0):
        for j in (6, 12, 25, 50):
            cells = [errors(lambda x, j=j, s=scale: ssge(x, j, s), d) for d in (2, 10, 50)]
            print(
                f"| SSGE | scale {scale}, J = {j} | "
                + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells)
                + " |"
            )
        for eta in (1e-3, 1e-2, 1e-1, 1.0):
            cells = [errors(lambda x, e=eta, s=scale: stein(x, e, s), d) for d in (2, 10, 50)]
            print(
                f"| Stein | scale {scale}, eta = {eta:g} | "
                + " | ".join(f"{a:.2f} / {b:.2f}" for a, b in cells)
                + " |"
            )


def kl_gradients(dims=(2, 10, 50), num=100, reps=100, seed=0):
    """Rows ``(dim, estimator, median error, bias)`` of the KL gradient (module docstring)."""
    import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)

    from pyro_implicit.elbo import kernel_kl, sample_score

    rows = []
    for dim in dims:
        g = torch.Generator().manual_seed(seed)
        a0 = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g) / math.sqrt(dim)
        exact = a0 - torch.linalg.inv(a0).T
        sums = {"kernel ratio (KIVI)": 0.0, "Stein score + Gaussian": 0.0}
        errs = {k: [] for k in sums}
        for _ in range(reps):
            eps = torch.randn(num, dim, generator=g)
            p = torch.randn(num, dim, generator=g)
            a = a0.clone().requires_grad_(True)
            kl, _ = kernel_kl(eps @ a.T, p)
            (kivi,) = torch.autograd.grad(kl, a)
            u = eps @ a0.T
            # cross-entropy part E[u eps^T] plus minus the entropy's part E[s(u) eps^T]
            stein = (u.T @ eps + sample_score(u).T @ eps) / num
            for key, grad in (("kernel ratio (KIVI)", kivi), ("Stein score + Gaussian", stein)):
                sums[key] = sums[key] + grad / reps
                errs[key].append(float((grad - exact).norm() / exact.norm()))
        for key in sums:
            bias = float((sums[key] - exact).norm() / exact.norm())
            rows.append((dim, key, sorted(errs[key])[reps // 2], bias))
    return rows


def split_kernel_kl(q, p, regularizer):
    """KIVI's KL estimate with a two-way sample split: for each half of q's draws, the ratio
    fitted on the other half (and every contrast draw) by eq. (6), evaluated at this half
    through its function form (gradient through the evaluation points only, eq. 7)."""
    from pyro_implicit.kernels import RBFKernel, squared_distances

    kernel = RBFKernel()
    n_q, n_p = q.shape[0], p.shape[0]
    with torch.no_grad():
        bandwidth = kernel.bandwidth_from_squared_distances(
            squared_distances(torch.cat([q.detach(), p]))
        )
    halves = (torch.arange(0, n_q, 2), torch.arange(1, n_q, 2))
    log_r = []
    for held, fit in (halves, halves[::-1]):
        m = fit.shape[0]
        centres = torch.cat([q.detach()[fit], p])
        with torch.no_grad():
            k = kernel.from_squared_distances(squared_distances(centres), bandwidth)
            system = k[:m, :m] / m + regularizer * torch.eye(m, dtype=q.dtype)
            r_fit = torch.linalg.solve(system, k[:m, m:].sum(-1) / n_p)
            coef = torch.cat(
                [-r_fit / (regularizer * m), torch.full((n_p,), 1.0 / (regularizer * n_p))]
            )
        r = kernel.from_squared_distances(squared_distances(q[held], centres), bandwidth) @ coef
        log_r.append(torch.log(r.clamp(min=1e-8)))
    return -torch.cat(log_r).mean()


def kl_gradient_variants(dims=(2, 10, 50), reps=100, seed=0):
    """Rows ``(dim, n, lambda, split, median error, bias)`` of the kernel ratio's KL gradient
    (module docstring), each cell from ``reps`` independent draws of q and the contrast."""
    import _provenance  # noqa: F401

    from pyro_implicit.elbo import kernel_kl

    settings = [(n, lam, False) for n in (100, 400, 1000) for lam in (1e-3, 1e-2, 1e-1)]
    settings += [(100, lam, True) for lam in (1e-3, 1e-2)]
    rows = []
    for dim in dims:
        for num, lam, split in settings:
            g = torch.Generator().manual_seed(seed)
            a0 = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g) / math.sqrt(dim)
            exact = a0 - torch.linalg.inv(a0).T
            mean, errs = 0.0, []
            for _ in range(reps):
                eps = torch.randn(num, dim, generator=g)
                p = torch.randn(num, dim, generator=g)
                a = a0.clone().requires_grad_(True)
                q = eps @ a.T
                kl = split_kernel_kl(q, p, lam) if split else kernel_kl(q, p, lam)[0]
                (grad,) = torch.autograd.grad(kl, a)
                mean = mean + grad / reps
                errs.append(float((grad - exact).norm() / exact.norm()))
            bias = float((mean - exact).norm() / exact.norm())
            rows.append((dim, num, lam, split, sorted(errs)[reps // 2], bias))
    return rows


CV_FACTORS = (1.0, 2.0, 3.0, 5.0, 8.0, 13.0)
CV_REGULARIZERS = (1e-3, 1e-2, 1e-1)


def _ratio_coefficients(q, p, bandwidth, regularizer):
    """KIVI's eq. (6) for r = p / q: its centres (q's then p's draws) and coefficients."""
    from pyro_implicit.kernels import squared_distances

    n_q, n_p = q.shape[0], p.shape[0]
    centres = torch.cat([q, p])
    k = torch.exp(-squared_distances(centres) / (2 * bandwidth**2))
    system = k[:n_q, :n_q] / n_q + regularizer * torch.eye(n_q, dtype=q.dtype)
    r_fit = torch.linalg.solve(system, k[:n_q, n_q:].sum(-1) / n_p)
    coef = torch.cat([-r_fit / (regularizer * n_q), torch.full((n_p,), 1.0 / (regularizer * n_p))])
    return centres, coef


def heldout_ratio_loss(q, p, bandwidth, regularizer):
    """Two-fold held-out LSIF loss 0.5 E_q[r^2] - E_p[r] of the ratio fit (lower: better)."""
    from pyro_implicit.kernels import squared_distances

    folds = (torch.arange(0, q.shape[0], 2), torch.arange(1, q.shape[0], 2))
    total = 0.0
    for fit, held in (folds, folds[::-1]):
        centres, coef = _ratio_coefficients(q[fit], p[fit], bandwidth, regularizer)
        r_q = torch.exp(-squared_distances(q[held], centres) / (2 * bandwidth**2)) @ coef
        r_p = torch.exp(-squared_distances(p[held], centres) / (2 * bandwidth**2)) @ coef
        total += float(0.5 * r_q.pow(2).mean() - r_p.mean())
    return total / 2


def kl_gradient_cv(dims=(2, 10, 50), num=100, reps=100, seed=0):
    """Rows ``(dim, rule, median error, bias, picks)``: the kernel ratio's KL gradient with
    the median rule (the library's default) and with (factor, lambda) chosen per estimate
    by :func:`heldout_ratio_loss` (``picks``: the three most frequent choices)."""
    import itertools
    from collections import Counter

    import _provenance  # noqa: F401

    from pyro_implicit.elbo import kernel_kl
    from pyro_implicit.kernels import RBFKernel, squared_distances

    grid = list(itertools.product(CV_FACTORS, CV_REGULARIZERS))
    rows = []
    for dim in dims:
        g = torch.Generator().manual_seed(seed)
        a0 = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g) / math.sqrt(dim)
        exact = a0 - torch.linalg.inv(a0).T
        cells = {"median rule": (0.0, [], Counter()), "held-out loss": (0.0, [], Counter())}
        for _ in range(reps):
            eps = torch.randn(num, dim, generator=g)
            p = torch.randn(num, dim, generator=g)
            for rule, (mean, errs, picks) in cells.items():
                a = a0.clone().requires_grad_(True)
                q = eps @ a.T
                if rule == "median rule":
                    kl, _ = kernel_kl(q, p)
                else:
                    with torch.no_grad():
                        scale = RBFKernel().bandwidth_from_squared_distances(
                            squared_distances(torch.cat([q, p]))
                        )
                        factor, lam = min(
                            grid,
                            key=lambda fl: heldout_ratio_loss(q, p, fl[0] * scale, fl[1]),
                        )
                    picks[(factor, lam)] += 1
                    kernel = RBFKernel(bandwidth_factor=factor)
                    kl, _ = kernel_kl(q, p, regularizer=lam, kernel=kernel)
                (grad,) = torch.autograd.grad(kl, a)
                errs.append(float((grad - exact).norm() / exact.norm()))
                cells[rule] = (mean + grad / reps, errs, picks)
        for rule, (mean, errs, picks) in cells.items():
            bias = float((mean - exact).norm() / exact.norm())
            top = ", ".join(f"({f:g}, {lam:g}) x{c}" for (f, lam), c in picks.most_common(3))
            rows.append((dim, rule, sorted(errs)[reps // 2], bias, top or "-"))
    return rows


def main_kl_cv():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    import subprocess

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print("# The kernel ratio's KL gradient with its bandwidth chosen by held-out loss\n")
    print(
        f"`python benchmarks/score_estimators.py --kl-cv` (commit {commit}; float64, one "
        "thread, seed 0). The set-up of `kl_gradients.md`: q = N(0, A A^T), A = I + 0.3 G / "
        "sqrt(d), contrast N(0, I), 100 draws of each per estimate, 100 estimates; exact "
        "gradient A - A^{-T}; a zero gradient scores 1.00 in both columns. `held-out loss`: "
        "per estimate, the bandwidth factor (times the median length scale) in "
        f"{list(CV_FACTORS)} and lambda in {list(CV_REGULARIZERS)} minimising the two-fold "
        "held-out LSIF loss 0.5 E_q[r^2] - E_p[r] of the ratio fit, then KIVI's estimate "
        "from all draws at that choice. `picks`: the most frequent (factor, lambda).\n"
    )
    print("| d | bandwidth | median error | bias | picks |")
    print("|---:|---|---:|---:|---|")
    for dim, rule, med, bias, picks in kl_gradient_cv():
        print(f"| {dim} | {rule} | {med:.2f} | {bias:.2f} | {picks} |")


def main_kl():
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    print("# The gradient of KL(q || N(0, I)) for q near its contrast, from 100 draws\n")
    import subprocess

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(
        f"`python benchmarks/score_estimators.py --kl` (commit {commit}; float64, one "
        "thread, seed 0). q = "
        "N(0, A A^T), A = I + 0.3 G / sqrt(d); exact gradient A - A^{-T}. Cells: median "
        "relative error of one estimate, and relative error of the mean of 100 estimates "
        "(the bias). A zero gradient scores 1.00 in both columns.\n"
    )
    print("| d | estimator | median error | bias |")
    print("|---:|---|---:|---:|")
    for dim, key, med, bias in kl_gradients():
        print(f"| {dim} | {key} | {med:.2f} | {bias:.2f} |")
    print(
        "\n## The kernel ratio alone: draws, regulariser, sample split\n\n"
        "The same q and exact gradient; n draws of q and n of the contrast per estimate, 100 "
        "estimates per cell. `split`: the ratio fitted on one half of q's draws and evaluated "
        "at the other, both ways (`split_kernel_kl` in this script; not in the library). "
        "The library's default is n = 100, lambda = 1e-3, no split.\n"
    )
    print("| d | n | lambda | split | median error | bias |")
    print("|---:|---:|---:|---|---:|---:|")
    for dim, num, lam, split, med, bias in kl_gradient_variants():
        print(f"| {dim} | {num} | {lam:g} | {'yes' if split else 'no'} | {med:.2f} | {bias:.2f} |")


if __name__ == "__main__":
    import sys

    if "--kl-cv" in sys.argv:
        main_kl_cv()
    elif "--kl" in sys.argv:
        main_kl()
    else:
        main()
