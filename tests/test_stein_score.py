"""``SteinScoreELBO`` and its score estimate against closed forms: affine generators (whose
pushforward is Gaussian, so the entropy gradient is :math:`A^{-\\top}`), a banana whose
score is known, and a conjugate posterior."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI

from pyro_implicit import ImplicitGuide, SteinScoreELBO
from pyro_implicit.elbo import sample_score, stein_residual_score, stein_score
from pyro_implicit.elbo.stein_score import DEFAULT_RIDGE


@pytest.fixture(autouse=True)
def _float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.enable_validation(True)
    yield
    torch.set_default_dtype(dtype)


def _entropy_gradient_error(dim, num=100, reps=5, **kwargs):
    """Largest relative error of mean_j -s(u_j) eps_j^T against A^{-T} over ``reps``
    affine generators u = A eps."""
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(reps):
        a = torch.randn(dim, dim, generator=g) / math.sqrt(dim) + torch.eye(dim)
        eps = torch.randn(num, dim, generator=g)
        s = sample_score(eps @ a.T + 3.0, **kwargs)
        grad = -(s.T @ eps) / num
        exact = torch.linalg.inv(a).T
        worst = max(worst, float((grad - exact).norm() / exact.norm()))
    return worst


@pytest.mark.parametrize("dim, tol", [(2, 0.1), (10, 0.25), (50, 0.4)])
def test_entropy_gradient_of_an_affine_generator(dim, tol):
    # at the defaults (100 draws): the Gaussian part is exact, the kernel residual adds noise;
    # the sample-only estimators without the Gaussian part miss by 0.3-1.0 at D >= 10
    # (benchmarks/results/score_estimators.md)
    assert _entropy_gradient_error(dim) < tol


@pytest.mark.parametrize("dim", [2, 10, 50])
def test_gaussian_part_alone_is_exact_for_an_affine_generator(dim):
    # in-sample maximum-likelihood moments: the noise of the covariance cancels exactly
    assert _entropy_gradient_error(dim, residual=False) < 1e-6


def _banana(num, g, b=1.0):
    e = torch.randn(num, 2, generator=g)
    x = torch.stack([e[:, 0], e[:, 1] + b * (e[:, 0] ** 2 - 1)], -1)
    r = x[:, 1] - b * (x[:, 0] ** 2 - 1)
    score = torch.stack([-x[:, 0] + 2 * b * r * x[:, 0], -r], -1)
    return x, score


def test_residual_recovers_a_non_gaussian_score():
    # a banana: the Gaussian of the draws misses its score by about 0.9 (relative); the
    # Stein residual must cut that (a sign error in it makes it worse than the Gaussian)
    errors = {True: [], False: []}
    for rep in range(3):
        x, exact = _banana(400, torch.Generator().manual_seed(rep))
        for residual in (True, False):
            s = sample_score(x, residual=residual)
            errors[residual].append(float((s - exact).norm() / exact.norm()))
    with_residual = sum(errors[True]) / 3
    gaussian = sum(errors[False]) / 3
    assert gaussian > 0.8
    assert with_residual < 0.6


def test_residual_vanishes_in_expectation_for_a_gaussian():
    # Stein's identity around N(0, I): the right-hand side is zero in expectation, so the
    # residual averaged over many independent sample sets shrinks towards 0
    g = torch.Generator().manual_seed(1)
    total = torch.zeros(3)
    for _ in range(200):
        y = torch.randn(100, 3, generator=g)
        h, _ = stein_residual_score(y)
        total += h.mean(0)
    assert (total / 200).abs().max() < 0.02


class _IndefiniteKernel:
    """k(a, b) = 1 - |a - b|^2 / s^2: not positive definite, so K + eta I is not either."""

    def bandwidth_from_squared_distances(self, d2):
        return d2.mean().sqrt()

    def from_squared_distances(self, d2, bandwidth):
        return 1.0 - d2 / bandwidth**2

    def derivative_wrt_squared_distance(self, d2, bandwidth):
        return -torch.ones_like(d2) / bandwidth**2


@pytest.mark.parametrize("kernel", ["rbf", "indefinite"])
def test_residual_solves_its_defining_system(kernel):
    # H = (K + eta I)^{-1} (K Y - [sum_j grad_{y_j} k(y_i, y_j)]_i), with the kernel's
    # gradient by autograd and a general (LU) solve; the indefinite kernel takes the path
    # that cannot use a Cholesky factor
    from pyro_implicit.kernels import RBFKernel, squared_distances

    y = torch.randn(30, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    k_fn = RBFKernel(bandwidth_factor=2.0**-0.5) if kernel == "rbf" else _IndefiniteKernel()
    bandwidth = k_fn.bandwidth_from_squared_distances(squared_distances(y))

    def rows(z):  # sum_j k(y_i, z_j) for each i
        d2 = (y[:, None, :] - z[None, :, :]).pow(2).sum(-1)
        return k_fn.from_squared_distances(d2, bandwidth).sum(1)

    grad_k = torch.func.jacrev(rows)(y).sum(1)
    gram = k_fn.from_squared_distances(squared_distances(y), bandwidth)
    if kernel == "indefinite":
        assert torch.linalg.eigvalsh(gram + 0.01 * torch.eye(30)).min() < 0
    expected = torch.linalg.solve(gram + 0.01 * torch.eye(30), gram @ y - grad_k)
    h, _ = stein_residual_score(y, ridge=0.01, kernel=k_fn)
    torch.testing.assert_close(h, expected, rtol=1e-8, atol=1e-10)


def test_the_loss_default_kernel_is_imq_with_the_median_rule():
    # the loss's residual kernel (benchmarks/results/stein_imq.md); the function's own
    # default stays the RBF estimator of Li & Turner
    from pyro_implicit.kernels import IMQKernel, RBFKernel

    kernel = SteinScoreELBO().kernel
    assert isinstance(kernel, IMQKernel) and kernel.beta == -0.5
    assert kernel.bandwidth_factor == pytest.approx(2.0**-0.5)
    y = torch.randn(50, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    default, _ = stein_residual_score(y)
    rbf, _ = stein_residual_score(y, kernel=RBFKernel(bandwidth_factor=2.0**-0.5))
    torch.testing.assert_close(default, rbf)


def test_the_loss_residual_is_the_estimate_at_its_ridge():
    # the loss's surrogate has gradient mean_j h(z_j) with h the kernel ridge estimate at
    # the loss's own ridge (DEFAULT_RIDGE unless given): benchmarks/results/stein_ridge.md
    z = torch.randn(40, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for ridge in (None, 0.01):
        loss = SteinScoreELBO(ridge=ridge)
        expected_ridge = DEFAULT_RIDGE if ridge is None else ridge
        assert loss.ridge == expected_ridge
        w = z.clone().requires_grad_()
        surrogate, _ = loss._whitened_kl(w)
        surrogate.backward()
        h, _ = stein_residual_score(z, expected_ridge, loss.kernel)
        torch.testing.assert_close(w.grad, h / z.shape[0])
    # the two ridges give different residuals, so the check above tells them apart
    other, _ = stein_residual_score(z, 0.01, loss.kernel)
    assert not torch.allclose(stein_residual_score(z, DEFAULT_RIDGE, loss.kernel)[0], other)


def test_bad_ridge_is_refused():
    with pytest.raises(ValueError, match="ridge"):
        SteinScoreELBO(ridge=0.0)


def test_bad_particle_count_is_refused():
    with pytest.raises(ValueError, match="'auto'"):
        SteinScoreELBO(num_particles="many")
    with pytest.raises(ValueError, match="num_particles >= 2"):
        SteinScoreELBO(num_particles=1)


def _normal_means(dim):
    def model(y):
        w = pyro.sample("w", dist.Normal(torch.zeros(dim), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(w, 1.0).to_event(1), obs=y)

    return model, (torch.zeros(dim),)


@pytest.mark.parametrize(
    "dim, num_particles, expected",
    [(3, "auto", 200), (100, "auto", 200), (101, "auto", 100), (3, 50, 50)],
)
def test_auto_particle_count_follows_the_latent_size(dim, num_particles, expected):
    model, args = _normal_means(dim)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    loss = SteinScoreELBO(num_particles=num_particles)
    svi = SVI(model, ImplicitGuide(model), pyro.optim.Adam({"lr": 1e-2}), loss)
    svi.step(*args)
    assert loss.num_particles == expected
    _, guide_trace = loss._last_traces  # the first step runs traced: its draws
    assert guide_trace.nodes["w"]["value"].shape[0] == expected


def test_latent_size_counts_unconstrained_coordinates_and_keeps_the_streams():
    from pyro_implicit.elbo.stein_score import _latent_size

    def model(y):
        pyro.sample("p", dist.Dirichlet(torch.ones(3)))  # a simplex: 2 free coordinates
        x = pyro.sample("x", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        with pyro.plate("data", 10, subsample_size=5):
            pyro.sample("y", dist.Normal(x.sum(), 1.0), obs=y)

    pyro.set_rng_seed(0)
    assert _latent_size(model, (torch.zeros(5),), {}) == 6
    after = torch.rand(3)
    pyro.set_rng_seed(0)
    assert torch.equal(after, torch.rand(3))


def _regression():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 3, generator=g)
    x[:, 2] = 0.8 * x[:, 0] + 0.6 * x[:, 2]  # correlated predictors
    beta = torch.tensor([1.0, -0.5, 0.3])
    y = (x * beta).sum(-1) + 0.5 * torch.randn(30, generator=g)
    prior_sd, noise_sd = 1.0, 0.5
    precision = torch.eye(3) / prior_sd**2 + x.T @ x / noise_sd**2
    cov = torch.linalg.inv(precision)
    mean = cov @ x.T @ y / noise_sd**2

    def model(x, y):
        b = pyro.sample("beta", dist.Normal(torch.zeros(3), prior_sd).to_event(1))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("y", dist.Normal((x * b).sum(-1), noise_sd), obs=y)

    return model, (x, y), mean, cov


@pytest.mark.parametrize("init_scale", [0.3, 3.0])
def test_fit_recovers_from_a_wrong_start(init_scale):
    # q starts at 0.3 or 3 times the preconditioner's (here exact) Gaussian: the entropy
    # estimate alone brings it back (KIVI's kernel ratio stays too wide from 3.0)
    model, args, mean, cov = _regression()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = ImplicitGuide(model, init_scale=init_scale)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(1000):
        svi.step(*args)
    draws = guide.sample_posterior(4000)["beta"]
    sd = cov.diagonal().sqrt()
    assert ((draws.mean(0) - mean).abs() / sd).max() < 0.25
    ratio = draws.std(0) / sd
    assert 0.85 < ratio.min() and ratio.max() < 1.15


@pytest.mark.parametrize("gaussian_part", [True, False])
def test_fit_recovers_a_conjugate_posterior(gaussian_part, monkeypatch):
    import pyro_implicit.elbo.kernel_ratio as kr

    if not gaussian_part:
        # the mutation: the draws' Gaussian log-density (the entropy's Gaussian part)
        # dropped; only the kernel residual is left
        monkeypatch.setattr(kr, "_contrast_log_density", lambda contrast, w: 0.0 * w.sum(-1))
    model, args, mean, cov = _regression()
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = ImplicitGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(500):
        svi.step(*args)
    draws = guide.sample_posterior(4000)["beta"]
    sd = cov.diagonal().sqrt()
    mean_error = ((draws.mean(0) - mean).abs() / sd).max().item()
    sd_ratio = draws.std(0) / sd
    ok = mean_error < 0.2 and 0.85 <= sd_ratio.min() and sd_ratio.max() <= 1.15
    assert ok == gaussian_part, (mean_error, sd_ratio)


def test_more_dimensions_than_draws_use_the_draws_diagonal():
    # a covariance of rank n - 1 < D has no inverse: the Gaussian part is the draws'
    # diagonal, whose in-sample score is still exact for a diagonal affine generator
    g = torch.Generator().manual_seed(0)
    dim, num = 150, 100
    a = torch.rand(dim, generator=g) + 0.5
    eps = torch.randn(num, dim, generator=g)
    s = sample_score(eps * a - 1.0, residual=False)
    grad = -(s * eps).mean(0)  # the diagonal of mean_j -s(u_j) eps_j^T
    assert torch.allclose(grad, 1.0 / a, rtol=1e-8)
    assert torch.isfinite(sample_score(eps * a)).all()


def test_float32_draws_on_fewer_dimensions_still_give_a_gaussian():
    # float32 draws that span 10 of 40 dimensions (a generator's draws on a GPU did): the
    # covariance's float32 Cholesky fails; the contrast Gaussian is factored in float64
    # and stays finite, in the draws' dtype
    from pyro_implicit.elbo.kernel_ratio import _fit_contrast

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(100, 10, generator=g) @ torch.randn(10, 40, generator=g)).float()
    for kind in ("moments", "full"):
        gauss = _fit_contrast(q, kind)
        assert gauss.loc.dtype == torch.float32
        assert torch.isfinite(gauss.log_prob(q)).all()
    constant = torch.ones(100, 40)  # no spread at all: no factor exists, the diagonal
    assert torch.isfinite(_fit_contrast(constant, "moments").log_prob(constant)).all()


def _normal_mean(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def test_a_leaky_generator_follows_new_data_after_converging(monkeypatch):
    """Fitted on 20 points and trained on 35, with the loss's recycling off (as where the
    posterior moves without the inputs changing): with ``activation="leaky_relu"`` the
    width follows the new posterior (ReLU units, all switched off after the first fit,
    kept the old width: sd ratio 1.32 after 500 steps, ``audit_probes_s58.md``
    section 4)."""
    monkeypatch.setattr(stein_score, "RECYCLE_AFTER_STEADY_STEPS", 10**9)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = 1.5 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    more = torch.cat([y, y + 0.5])[:35]
    guide = ImplicitGuide(_normal_mean, activation="leaky_relu")
    svi = SVI(_normal_mean, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(300):
        svi.step(y)
    for _ in range(500):
        svi.step(more)
    precision = 1 / 4 + 35
    draws = guide.sample_posterior(4000)["mu"]
    assert abs(draws.mean() - more.sum() / precision) < 0.2 * precision**-0.5
    assert 0.85 < draws.std() * precision**0.5 < 1.15


def _normal_mean_with_noise(y, noise):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, noise), obs=y)


def test_a_fitted_guide_follows_a_changed_input():
    """300 steps at noise 1 switch every unit of the default generator off; after the
    noise changes to 3 the loss recycles them, and q widens to the new posterior (without
    the recycling it stayed at the old width, sd ratio 0.334 after 1500 steps)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = 1.5 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    guide = ImplicitGuide(_normal_mean_with_noise)
    svi = SVI(_normal_mean_with_noise, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(300):
        svi.step(y, 1.0)
    for _ in range(600):
        svi.step(y, 3.0)
    precision = 1 / 100 + 20 / 9
    draws = guide.sample_posterior(4000)["mu"]
    assert abs(draws.mean() - y.sum() / 9 / precision) < 0.2 * precision**-0.5
    assert 0.85 < draws.std() * precision**0.5 < 1.15


def test_units_are_recycled_only_when_steady_inputs_change(monkeypatch):
    from pyro_implicit.guides.networks import MLPGenerator

    calls = []
    recycle = MLPGenerator.recycle_dead_units
    monkeypatch.setattr(
        MLPGenerator, "recycle_dead_units", lambda self: calls.append(1) or recycle(self)
    )
    pyro.clear_param_store()
    y = torch.randn(20)
    guide = ImplicitGuide(_normal_mean_with_noise)
    loss = SteinScoreELBO()
    svi = SVI(_normal_mean_with_noise, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    for _ in range(150):  # the same inputs: a fit on fixed data is untouched
        svi.step(y, 1.0)
    svi.evaluate_loss(y + 1.0, 1.0)  # no gradient step: not counted
    assert calls == []
    for _ in range(3):  # new tensors every step (the user's own minibatches)
        svi.step(y.clone(), 1.0)
    assert calls == [1]  # once: the first change after 150 steady steps
    for _ in range(150):
        svi.step(y, 1.0)
    y.add_(0.1)  # modified in place: a change too
    svi.step(y, 1.0)
    assert calls == [1, 1]
