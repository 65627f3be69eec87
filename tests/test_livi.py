"""LinearizedGuide and LIVI_ELBO (Uppal et al. 2023) against closed forms."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.datasets import data_available
from pyro_implicit.elbo.livi import (
    LIVI_ELBO,
    jacobian,
    linearized_entropy,
    smallest_singular_value,
)
from pyro_implicit.guides import MLPGenerator
from pyro_implicit.guides.linearized import LinearizedGuide
from pyro_implicit.guides.scalable import CorrelatedMatrixGenerator


def gaussian_entropy(cov):
    return 0.5 * torch.logdet(2 * math.pi * math.e * cov)


def linear_generator(d, out_dim, weight=None):
    gen = MLPGenerator(d, out_dim, ())
    if weight is not None:
        with torch.no_grad():
            gen.output.weight.copy_(weight)
    return gen


def weights_of_jacobian(gen):
    """The parameters J depends on (all but the output bias)."""
    return [p for name, p in gen.named_parameters() if name != "output.bias"]


def normal_normal(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def shapes_model():
    pyro.sample("a", dist.Normal(0.0, 1.0))
    with pyro.plate("p", 3):
        pyro.sample("c", dist.LogNormal(0.0, 1.0))
    pyro.sample("e", dist.Dirichlet(torch.ones(4)))


# --------------------------------------------------------------------------- entropy
@pytest.mark.parametrize("sigma", [1e-3, 0.1, 1.0, 3.0])
@pytest.mark.parametrize("d, out_dim", [(3, 7), (6, 4)])
def test_linear_generator_eq14_is_the_exact_gaussian_entropy(sigma, d, out_dim):
    # u = W z + b + sigma xi is N(b, W W^T + sigma^2 I) and eq. 14 is exact for any sigma
    # (digest Sec. 2.3); (3, 7) uses Sylvester's d x d form, (6, 4) the D x D form
    gen = linear_generator(d, out_dim)
    weight = gen.output.weight.detach()
    exact = gaussian_entropy(weight @ weight.T + sigma**2 * torch.eye(out_dim))
    entropy = linearized_entropy(gen, torch.randn(5, d), sigma, bound="det")
    assert torch.allclose(entropy, exact.expand(5), rtol=1e-10, atol=1e-10)
    # eq. 17 is a lower bound, tight when all singular values are equal
    lower = linearized_entropy(gen, torch.randn(5, d), sigma, bound="svd", num_iterations=20)
    assert (lower <= entropy + 1e-8).all() and (lower < entropy - 1e-3).all()


def test_svd_bound_is_tight_for_equal_singular_values():
    d, out_dim, sigma = 3, 9, 0.1
    q = torch.linalg.qr(torch.randn(out_dim, d)).Q
    gen = linear_generator(d, out_dim, 2.0 * q)
    z = torch.randn(4, d)
    det = linearized_entropy(gen, z, sigma, bound="det")
    svd = linearized_entropy(gen, z, sigma, bound="svd")
    assert torch.allclose(svd, det, rtol=1e-10)
    assert torch.allclose(det, gaussian_entropy(4 * q @ q.T + sigma**2 * torch.eye(out_dim)))


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit_jacobian", "matrix_free"])
@pytest.mark.parametrize("d, out_dim", [(5, 30), (8, 5)])
def test_smallest_singular_value(d, out_dim, explicit):
    mlp = MLPGenerator(d, out_dim, (16,), "elu")
    # a plain callable has no ``jacobian``: products by torch.func.jvp / vjp
    gen = mlp if explicit else (lambda e: mlp(e))
    z = torch.randn(3, d)
    jac = jacobian(gen, z)
    reference = torch.stack([torch.func.jacrev(mlp)(zi) for zi in z])
    assert torch.allclose(jac, reference)
    exact = torch.linalg.svdvals(reference)[..., -1]
    s1, info = smallest_singular_value(gen, z, num_iterations=30, return_info=True)
    assert torch.allclose(s1, exact, rtol=1e-8)
    assert info["residual"].max() < 1e-8
    # few iterations over-estimate s1 (Ritz values are upper bounds)
    assert (smallest_singular_value(gen, z, num_iterations=1) >= exact - 1e-10).all()
    # the gradient of s1 with respect to the parameters is the exact one
    params = weights_of_jacobian(mlp)
    got = torch.autograd.grad(s1.sum(), params)
    want = torch.autograd.grad(exact.sum(), params)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "tanh", "elu", "softplus"])
@pytest.mark.parametrize("hidden", [(), (7,), (9, 5)])
def test_explicit_mlp_jacobian_matches_autograd(activation, hidden):
    d, out_dim = 4, 6
    gen = MLPGenerator(d, out_dim, hidden, activation)
    z = torch.randn(3, d)
    reference = torch.stack([torch.func.jacrev(gen)(zi) for zi in z])
    explicit = gen.jacobian(z)
    assert explicit.shape == (3, out_dim, d)
    assert torch.allclose(explicit, reference, rtol=1e-10, atol=1e-12)
    # the same derivatives with respect to the parameters (the loss differentiates J)
    params = list(gen.parameters())
    probe = torch.randn(3, out_dim, d)
    got = torch.autograd.grad((explicit * probe).sum(), params, allow_unused=True)
    want = torch.autograd.grad((reference * probe).sum(), params, allow_unused=True)
    for g, w, p in zip(got, want, params, strict=True):
        # None: J does not depend on p (the output bias; the hidden biases under ReLU)
        g = torch.zeros_like(p) if g is None else g
        w = torch.zeros_like(p) if w is None else w
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("d, out_dim", [(4, 20), (6, 3)])
def test_svd_bound_gradient_matches_autograd_through_svdvals(d, out_dim):
    sigma, k = 0.05, min(d, out_dim)
    gen = MLPGenerator(d, out_dim, (12,), "elu")
    params = weights_of_jacobian(gen)
    z = torch.randn(3, d)
    value = linearized_entropy(gen, z, sigma, bound="svd", num_iterations=40).sum()
    grads = torch.autograd.grad(value, params)

    def exact_entropy(zi):
        s = torch.linalg.svdvals(torch.func.jacrev(gen)(zi))
        log_det = k * torch.log(s[k - 1] ** 2 + sigma**2) + (out_dim - k) * math.log(sigma**2)
        return 0.5 * log_det + 0.5 * out_dim * (1 + math.log(2 * math.pi))

    expected = sum(exact_entropy(zi) for zi in z)
    assert value.item() == pytest.approx(expected.item(), rel=1e-10)
    for got, want in zip(grads, torch.autograd.grad(expected, params), strict=True):
        assert torch.allclose(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("d, out_dim", [(4, 20), (6, 3)])
def test_det_bound_gradient_matches_the_full_size_log_det(d, out_dim):
    sigma = 0.05
    gen = MLPGenerator(d, out_dim, (12,), "elu")
    params = weights_of_jacobian(gen)
    z = torch.randn(3, d)
    value = linearized_entropy(gen, z, sigma, bound="det").sum()

    def full_size(zi):  # eq. 14 with the D x D matrix of the paper
        jac = torch.func.jacrev(gen)(zi)
        cov = jac @ jac.T + sigma**2 * torch.eye(out_dim)
        return 0.5 * torch.logdet(cov) + 0.5 * out_dim * (1 + math.log(2 * math.pi))

    expected = sum(full_size(zi) for zi in z)
    assert value.item() == pytest.approx(expected.item(), rel=1e-10)
    for got, want in zip(
        torch.autograd.grad(value, params), torch.autograd.grad(expected, params), strict=True
    ):
        assert torch.allclose(got, want, rtol=1e-8, atol=1e-10)


def test_det_bound_refuses_a_sigma_that_asks_for_a_gradient():
    gen = MLPGenerator(3, 5, (8,), "elu")
    sigma = torch.tensor(0.1, requires_grad=True)
    with pytest.raises(ValueError, match="fixed number"):
        linearized_entropy(gen, torch.randn(4, 3), sigma, bound="det")


# --------------------------------------------------------------------------- the ELBO
def test_conjugate_linear_regression_elbo_and_posterior():
    data = torch.Generator().manual_seed(0)
    d, n, noise_precision = 4, 30, 4.0
    x = torch.randn(n, d, generator=data)
    y = x @ torch.randn(d, generator=data) + torch.randn(n, generator=data) / noise_precision**0.5

    def model(x, y):  # broadcasting: particles may carry extra leading dims
        beta = pyro.sample("beta", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        with pyro.plate("data", n):
            pyro.sample("obs", dist.Normal((x * beta).sum(-1), noise_precision**-0.5), obs=y)

    cov = torch.linalg.inv(torch.eye(d) + noise_precision * x.T @ x)
    mean = noise_precision * cov @ x.T @ y
    evidence_cov = x @ x.T + torch.eye(n) / noise_precision
    log_evidence = dist.MultivariateNormal(torch.zeros(n), evidence_cov).log_prob(y).item()

    # a linear generator makes q Gaussian, with eq. 14 exact: L' is the true ELBO
    guide = LinearizedGuide(model, precondition=False, hidden_dims=(), noise_dim=d)
    steps, lr, final_lr = 1000, 0.02, 1e-3
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": (final_lr / lr) ** (1 / steps)})
    svi = SVI(model, guide, optim, LIVI_ELBO(num_particles=8, max_plate_nesting=1))
    for _ in range(steps):
        svi.step(x, y)

    weight = guide.generator.output.weight.detach()
    q_mean = guide.generator.output.bias.detach()
    q_cov = weight @ weight.T + guide.sigma**2 * torch.eye(d)
    kl = torch.distributions.kl_divergence(
        dist.MultivariateNormal(q_mean, q_cov), dist.MultivariateNormal(mean, cov)
    ).item()
    # the entropy term is exact, but log p(x, beta) varies over q: standard error ~0.005
    elbo = -LIVI_ELBO(num_particles=100_000, max_plate_nesting=1).loss(model, guide, x, y)
    assert elbo == pytest.approx(log_evidence - kl, abs=0.02)  # ELBO = log p(x) - KL
    assert -0.015 < log_evidence - elbo < 0.06  # below and close (seeds 0-4: 0.017-0.037)
    assert kl < 0.05
    sd = cov.diagonal().sqrt()
    assert ((q_mean - mean) / sd).abs().max() < 0.25
    assert (q_cov - cov).norm() / cov.norm() < 0.25
    draws = guide.sample_posterior(20000)["beta"]
    assert ((draws.mean(0) - mean) / sd).abs().max() < 0.25


def test_constraint_jacobian_sign_and_exact_guides():
    # A Gamma-Poisson model (rate > 0: u = log rate). LIVI's value for a linear
    # LinearizedGuide must equal Trace_ELBO's for the AutoNormal with the same q(u):
    # log p(x, theta) - log|du/dtheta| + H[q(u)]; a wrong Jacobian sign is off by 2 E[u].
    counts = torch.tensor([3.0, 5.0, 2.0, 6.0])

    def model(counts):
        rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
        with pyro.plate("data", len(counts)):
            pyro.sample("obs", dist.Poisson(rate), obs=counts)

    loc, scale, sigma = 1.3, 0.3, 0.1
    guide = LinearizedGuide(model, precondition=False, hidden_dims=(), noise_dim=1, sigma=sigma)
    guide(counts)
    with torch.no_grad():
        guide.generator.output.weight.fill_(math.sqrt(scale**2 - sigma**2))
        guide.generator.output.bias.fill_(loc)
    normal = AutoNormal(model, init_scale=scale)
    normal(counts)
    with torch.no_grad():
        normal.locs.rate.fill_(loc)
    num = 20000
    exact = Trace_ELBO(num_particles=num, vectorize_particles=True, max_plate_nesting=1)
    expected = exact.loss(model, normal, counts)
    livi = LIVI_ELBO(num_particles=num, max_plate_nesting=1)
    assert livi.loss(model, guide, counts) == pytest.approx(expected, abs=0.05)
    # a guide without an implicit site is scored by its exact density
    assert livi.loss(model, normal, counts) == pytest.approx(expected, abs=0.05)


def test_one_draw_per_step_is_an_unbiased_estimate():
    # each draw's linearised entropy stands alone, so S = 1 (the paper's image setting) is
    # allowed: the mean of many one-draw losses is the many-draw loss
    y = torch.randn(5)
    guide = LinearizedGuide(normal_normal, hidden_dims=(), sigma=0.3)
    guide(y)
    many = LIVI_ELBO(num_particles=20000).loss(normal_normal, guide, y)
    one = LIVI_ELBO(num_particles=1)
    ones = torch.tensor([one.loss(normal_normal, guide, y) for _ in range(2000)])
    assert ones.mean().item() == pytest.approx(many, abs=4 * ones.std().item() / 2000**0.5)


@pytest.mark.parametrize("bound", ["det", "svd"])
def test_default_guide_learns_normal_normal(bound):
    y = torch.randn(10) + 1.0
    post_var = 1.0 / (1.0 + len(y))
    guide = LinearizedGuide(normal_normal)  # MLP, d = 2 > D = 1
    elbo = LIVI_ELBO(num_particles=8, bound=bound, max_plate_nesting=1)
    optim = pyro.optim.ClippedAdam({"lr": 0.02, "lrd": 0.1 ** (1 / 600)})  # to lr 2e-3
    svi = SVI(normal_normal, guide, optim, elbo)
    for _ in range(600):
        svi.step(y)
    mu = guide.sample_posterior(10000)["mu"]
    # eq. 14 is an approximation for a non-linear g (seeds 0-4: mean within 0.17 sd, spread
    # within 12%)
    assert mu.mean().item() == pytest.approx(post_var * y.sum().item(), abs=0.3 * post_var**0.5)
    assert mu.std().item() == pytest.approx(post_var**0.5, rel=0.15)
    loss = svi.evaluate_loss(y)  # under no_grad: the Jacobian is still computed
    assert math.isfinite(loss)
    assert "entropy" in elbo.diagnostics


def test_tempering_is_off_by_default_and_warns():
    with pytest.warns(UserWarning, match="not the paper's ELBO"):
        LIVI_ELBO(entropy_weight=0.5)
    with pytest.raises(ValueError, match="bound"):
        LIVI_ELBO(bound="lobpcg")


# --------------------------------------------------------------------------- guide contract
def test_trace_layout_and_conditional_density():
    y = torch.randn(5)
    guide = LinearizedGuide(normal_normal, precondition=False, sigma=0.3)
    trace = poutine.trace(guide).get_trace(y)
    name = guide._pyro_name
    info = trace.nodes[f"_{name}_latent"]["infer"]["pyro_implicit"]
    assert info["guide"] is guide and "jacobian" in info["capabilities"]
    z = trace.nodes[info["base_site"]]["value"]
    assert torch.equal(z, trace.nodes[f"_{name}_noise"]["value"])
    u = trace.nodes[f"_{name}_latent"]["value"]
    expected = dist.Normal(guide.generator(z), 0.3).to_event(1).log_prob(u)
    assert torch.allclose(guide.conditional_log_prob(u, z), expected)
    pairwise = guide.pairwise_conditional_log_prob(u.expand(2, -1), torch.stack([z, -z]))
    assert torch.allclose(pairwise[0, 0], expected)
    with poutine.mask(mask=False):  # Predictive's setting: no base site
        assert info["base_site"] not in poutine.trace(guide).get_trace(y).nodes


@pytest.mark.parametrize("parallel", [False, True])
def test_predictive_shapes(parallel):
    y = torch.randn(4)
    guide = LinearizedGuide(normal_normal)
    guide(y)
    pred = Predictive(normal_normal, guide=guide, num_samples=7, parallel=parallel)(y)
    assert pred["obs"].shape == (7, 4)
    assert pred["mu"].reshape(-1).shape == (7,)


@pytest.mark.parametrize("generator", ["mlp", "scalable"])
def test_median_quantiles_and_constraints(generator):
    guide = LinearizedGuide(shapes_model, generator=generator, init_scale=0.5)
    loss = SVI(shapes_model, guide, pyro.optim.Adam({"lr": 0.01}), LIVI_ELBO(bound="svd")).step()
    assert math.isfinite(loss)
    median = guide.median()
    quantiles = guide.quantiles([0.1, 0.5, 0.9])
    for name, q in quantiles.items():
        assert q.shape == (3,) + median[name].shape
        torch.testing.assert_close(q[1], median[name])  # to float rounding: another lerp
        if name != "e":  # elementwise monotone transforms: per-coordinate quantiles
            assert (q[0] <= q[1]).all() and (q[1] <= q[2]).all()
    # the simplex: per-coordinate quantiles of u mapped into the support (as Pyro's)
    assert torch.allclose(quantiles["e"].sum(-1), torch.ones(3))
    assert (quantiles["e"] > 0).all()
    draws = guide.sample_posterior(6)
    assert draws["c"].shape == (6, 3) and (draws["c"] > 0).all()
    assert torch.allclose(draws["e"].sum(-1), torch.ones(6))


def test_state_dict_round_trip_and_serialization(assert_round_trip):
    y = torch.randn(5)
    guide = LinearizedGuide(normal_normal)
    svi = SVI(normal_normal, guide, pyro.optim.Adam({"lr": 0.01}), LIVI_ELBO())
    for _ in range(3):
        svi.step(y)
    assert_round_trip(guide, LinearizedGuide(normal_normal), (y,), "mu")


def test_pairings():
    y = torch.randn(5)
    optim = pyro.optim.Adam({"lr": 0.01})
    with pytest.raises(TypeError, match="jacobian.*KernelRatioELBO"):
        SVI(normal_normal, ImplicitGuide(normal_normal), optim, LIVI_ELBO()).step(y)
    with pytest.raises(NotImplementedError, match="LIVI_ELBO"):
        SVI(normal_normal, LinearizedGuide(normal_normal), optim, Trace_ELBO()).step(y)
    # losses that need less than a Jacobian also train it
    guide = LinearizedGuide(normal_normal, sigma=0.2)
    assert math.isfinite(SVI(normal_normal, guide, optim, KernelRatioELBO(10)).step(y))
    from pyro_implicit.elbo.sivi import SIVI_ELBO

    assert math.isfinite(SVI(normal_normal, guide, optim, SIVI_ELBO(10, 5)).step(y))


# --------------------------------------------------------------------------- scale
def test_svd_bound_step_at_large_latent_size():
    # D = 2e5: a D x D matrix (or a D x d Jacobian with d = 10^4) would not fit in memory;
    # one L'' step must only need O(D + d) per particle
    size = 200_000

    def model():
        w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([size]).to_event(1))
        pyro.sample("obs", dist.Normal(w[..., :10].sum(-1), 1.0), obs=torch.tensor(0.5))

    guide = LinearizedGuide(model, generator="scalable", noise_dim=64)
    guide()
    gen = guide.generator
    assert isinstance(gen, CorrelatedMatrixGenerator) and gen.num_blocks == 20
    assert sum(p.numel() for p in gen.parameters()) < 4 * size
    elbo = LIVI_ELBO(bound="svd", num_iterations=3, max_plate_nesting=0)
    loss = elbo.loss_and_grads(model, guide)
    assert math.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gen.parameters())
    assert elbo.diagnostics["smallest_singular_value"] > 0


def test_scale_benchmark_smoke(tmp_path, load_benchmark):
    record = load_benchmark("livi_scale").main(
        ["--smoke", "--out", str(tmp_path / "s.json"), "--figure", str(tmp_path / "s.png")]
    )
    assert (tmp_path / "s.png").exists() and (tmp_path / "s.json").exists()
    rows = record["results"]
    assert [r["sweep"] for r in rows] == ["D", "d", "d"]
    for r in rows:
        assert "skipped" not in r, r
        assert r["loss_finite"] and r["seconds_per_step"] > 0
    h = rows[0]["width"]
    assert rows[0]["latent_dim"] == h * h + 13 * h + 1 and abs(rows[0]["latent_dim"] - 300) < 30


def test_toy_benchmark_smoke(tmp_path, load_benchmark):
    default = torch.get_default_dtype()
    try:
        record = load_benchmark("livi_toy").main(["--smoke", "--figure", str(tmp_path / "t.png")])
    finally:
        torch.set_default_dtype(default)
    assert (tmp_path / "t.png").exists()
    assert record["results"]["NUTS"]["mean_rmse_vs_nuts"] == 0.0
    for r in record["results"].values():
        assert all(r[k] >= 0 for k in ("sd_gap", "sd_data", "sd_outside"))


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_mnist_benchmark_smoke(load_benchmark):
    record = load_benchmark("livi_mnist").main(["--smoke", "--quiet"])
    for r in record["results"]:
        assert 0 <= r["test"]["accuracy"] <= 1 and r["test"]["nll"] > 0
        assert set(r["ood"]) == {"rotated 90", "uniform noise"}


@pytest.mark.parametrize("shift, warns", [(30.0, True), (10.0, False)])
def test_a_fit_far_from_its_preconditioner_warns_that_it_runs_away(shift, warns):
    # LIVI at Adam(1.0) on a small BNN went 179 preconditioner sds away, its loss from 157
    # to 2180, with every number finite and no word; fits that work stay within 9.5
    import warnings

    from pyro_implicit import RunawayWarning
    from pyro_implicit.elbo.base import RUNAWAY_CHECK_EVERY

    def model():
        pyro.sample("x", dist.Normal(torch.zeros(2), 1.0).to_event(1))

    guide = LinearizedGuide(model)
    loss = LIVI_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    svi.step()
    with torch.no_grad():
        guide.generator.output.bias += shift  # q's mean `shift` preconditioner sds away
    loss._num_evaluations = RUNAWAY_CHECK_EVERY - 1  # the next step checks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        svi.step()
    runaway = [w for w in caught if issubclass(w.category, RunawayWarning)]
    assert bool(runaway) is warns
    if warns:
        assert "LinearizedGuide's draws has moved 3" in str(runaway[0].message)
