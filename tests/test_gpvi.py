"""GPVI_ELBO and AmortizedSVGD_ELBO (Ratzlaff et al. 2021) against closed forms.

Reference numbers and test designs are the GPVI digest's Sec. 8.5 (notes/seeds/gpvi.md).
"""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.infer.autoguide import AutoNormal

from pyro_implicit import GPVI_ELBO, AmortizedSVGD_ELBO, ImplicitGuide
from pyro_implicit.elbo.gpvi import (
    SkipGenerator,
    exact_inverse_jvp,
    exact_kernel_repulsion,
    gpvi_generator,
)
from pyro_implicit.guides.semi_implicit import SemiImplicitGuide
from pyro_implicit.kernels import RBFKernel, kernel_and_derivative, squared_distances
from pyro_implicit.targets.energy import ENERGY_POTENTIALS, energy_log_density, energy_model

# a correlated 2-D target with a non-symmetric Cholesky root (catches J^{-1} vs J^{-T})
SIGMA = torch.tensor([[1.0, 0.8], [0.8, 2.0]], dtype=torch.float64)
MU = torch.tensor([1.0, -1.0], dtype=torch.float64)


def gaussian_model():
    pyro.sample("x", dist.MultivariateNormal(MU, SIGMA))


def linear_guide(model=gaussian_model):
    """u = W z + b: q = N(b, W W^T), square and (generically) invertible (in the raw
    space: the tests read q's moments off W and b)."""
    guide = ImplicitGuide(model, hidden_dims=(), init_scale=1.0, precondition=False)
    guide()
    return guide


def fit(guide, loss, steps, lr, model=gaussian_model):
    optim = pyro.optim.ClippedAdam({"lr": lr, "lrd": 0.01 ** (1.0 / steps)})
    svi = SVI(model, guide, optim, loss)
    for _ in range(steps):
        svi.step()
    return svi


def moment_errors(guide):
    w, b = guide.generator.output.weight.detach(), guide.generator.output.bias.detach()
    cov_err = ((w @ w.T - SIGMA).norm() / SIGMA.norm()).item()
    mean_err = ((b - MU).norm() / MU.norm()).item()
    return cov_err, mean_err


# ------------------------------------------------------------------------ convergence
def test_gpvi_exact_jacobian_recovers_gaussian():
    guide = linear_guide()
    fit(guide, GPVI_ELBO(32, exact_jacobian=True), steps=600, lr=2e-2)
    cov_err, mean_err = moment_errors(guide)
    assert cov_err < 0.08 and mean_err < 0.08, (cov_err, mean_err)


def test_gpvi_helper_recovers_gaussian():
    guide = linear_guide()
    loss = GPVI_ELBO(32, exact_jacobian=False, helper_lr=3e-3)
    fit(guide, loss, steps=1000, lr=1e-2)
    cov_err, mean_err = moment_errors(guide)
    assert cov_err < 0.15 and mean_err < 0.15, (cov_err, mean_err)
    assert loss.diagnostics["helper_loss"] < 1e-3


def test_amortized_svgd_recovers_gaussian():
    guide = linear_guide()
    fit(guide, AmortizedSVGD_ELBO(32), steps=600, lr=2e-2)
    cov_err, mean_err = moment_errors(guide)
    assert cov_err < 0.1 and mean_err < 0.1, (cov_err, mean_err)


def test_default_guide_works_out_of_the_box():
    guide = ImplicitGuide(gaussian_model)
    loss = GPVI_ELBO()
    svi = SVI(gaussian_model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    values = [svi.step() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(values)))
    # the reported loss is the mean negative log target at the step's draws
    assert values[-1] == pytest.approx(-loss.diagnostics["log_target"])
    # D = 2: the default solves with the exact Jacobian, no helper
    assert set(loss.diagnostics) >= {"bandwidth", "attraction", "repulsion"}
    assert loss.helper is None
    assert guide.sample_posterior(5)["x"].shape == (5, 2)


# --------------------------------------------------------------- the gradient itself
def _hand_written_direction(guide, loss, exact):
    """Eq. (9) from scratch: G_b = -(1/N) sum_a [s(u'_a) k(z'_a, z_b) + J^{-T} grad k]."""
    z_score, z = loss.last_noise
    w = guide.generator.output.weight.detach()
    b = guide.generator.output.bias.detach()
    u_score = z_score @ w.T + b
    score = -(u_score - MU) @ torch.linalg.inv(SIGMA)  # grad log N(MU, SIGMA)
    sigma = loss.diagnostics["bandwidth"]
    diff = z_score.unsqueeze(1) - z.unsqueeze(0)  # (N', N, D)
    k = torch.exp(-diff.pow(2).sum(-1) / (2 * sigma**2))
    grad_k = -diff / sigma**2 * k.unsqueeze(-1)  # grad wrt z'_a
    if exact:
        y = torch.linalg.solve(w.T, grad_k.reshape(-1, 2).T).T.reshape(grad_k.shape)
    else:
        pairs = z_score.unsqueeze(1).expand_as(grad_k)
        with torch.no_grad():
            y = loss.helper(pairs.reshape(-1, 2), grad_k.reshape(-1, 2)).reshape(grad_k.shape)
    n = z_score.shape[0]
    return -(k.T @ score + y.sum(0)) / n, z


@pytest.mark.parametrize("exact", [True, False])
def test_surrogate_gradient_is_pulled_back_functional_gradient(exact):
    guide = linear_guide()
    loss = GPVI_ELBO(16, exact_jacobian=exact)
    gen = guide.generator.output
    gen.weight.grad = gen.bias.grad = None
    loss.loss_and_grads(gaussian_model, guide)
    direction, z = _hand_written_direction(guide, loss, exact)
    # eq. (4) for u = W z + b: dJ/dW = mean_b G_b z_b^T, dJ/db = mean_b G_b
    assert torch.allclose(gen.weight.grad, direction.T @ z / z.shape[0], atol=1e-10)
    assert torch.allclose(gen.bias.grad, direction.mean(0), atol=1e-10)


def test_target_is_a_fixed_point_with_the_transpose():
    """At W = chol(SIGMA) (not symmetric), b = MU the pulled-back gradient vanishes up to
    Monte Carlo error; with J^{-1} instead of J^{-T} it is ~1.4e-2 (digest Sec. 8.5)."""
    guide = linear_guide()
    gen = guide.generator.output
    with torch.no_grad():
        gen.weight.copy_(torch.linalg.cholesky(SIGMA))
        gen.bias.copy_(MU)
    loss = GPVI_ELBO(1500, exact_jacobian=True)
    grads = []
    for _ in range(2):
        gen.weight.grad = None
        loss.loss_and_grads(gaussian_model, guide)
        grads.append(gen.weight.grad.clone())
    # measured 3.6e-3 here; 2.7e-2 with J^{-1}
    assert torch.stack(grads).mean(0).abs().max() < 1e-2


def test_helper_matches_linear_solve():
    """Train the helper alone on a frozen non-symmetric generator with k < D; compare its
    products with J^{-T} v from torch.linalg.solve on held-out points."""
    torch.manual_seed(0)
    gen = SkipGenerator(3, active_dim=2, hidden_dims=(8,), activation="tanh")
    for p in gen.parameters():
        p.requires_grad_(False)
    loss = GPVI_ELBO(8, helper_hidden=32, helper_lr=3e-3)
    loss._build_helper(2, 3)
    for _ in range(1500):
        z = torch.randn(16, 3)
        v = torch.randn(16, 4, 3)
        loss._helper_update(gen, z, v)
    z, v = torch.randn(64, 3), torch.randn(64, 4, 3)
    exact = exact_inverse_jvp(gen, z, v)
    # check the oracle itself: J^T y = v
    jac = torch.func.vmap(torch.func.jacrev(gen))(z)
    assert torch.allclose(jac.mT @ exact.mT, v.mT, atol=1e-10)
    approx = loss.inverse_jvp(gen, z, v)
    rel = (approx - exact).norm() / exact.norm()
    assert rel < 0.1, rel


# ---------------------------------------------------------------------- the helper state
def test_helper_state_dict_round_trip_and_loss_does_not_train():
    guide = linear_guide()
    loss = GPVI_ELBO(8, exact_jacobian=False)
    fit(guide, loss, steps=3, lr=1e-3)
    before = [p.clone() for p in loss.helper.parameters()]
    value = loss.loss(gaussian_model, guide)
    assert isinstance(value, float)
    assert all(torch.equal(a, b) for a, b in zip(before, loss.helper.parameters(), strict=True))
    # the helper is not a Pyro param: SVI's optimiser never sees it
    assert not any("helper" in name for name in pyro.get_param_store().keys())

    restored = GPVI_ELBO(8, exact_jacobian=False)
    restored.load_state_dict(loss.state_dict())
    z, v = torch.randn(4, 2), torch.randn(4, 3, 2)
    assert torch.equal(
        restored.inverse_jvp(guide.generator, z, v), loss.inverse_jvp(guide.generator, z, v)
    )
    assert restored.helper_optimizer.state_dict()["state"].keys() == (
        loss.helper_optimizer.state_dict()["state"].keys()
    )


def test_skip_generator_jacobian_is_eq_7():
    gen = SkipGenerator(4, active_dim=2, hidden_dims=(5,), skip_scale=0.5)
    z = torch.randn(4)
    jac = torch.func.jacrev(gen)(z)
    jac_g = torch.func.jacrev(lambda head: gen.net(head))(z[:2])
    expected = torch.cat([jac_g, torch.zeros(4, 2)], dim=1) + 0.5 * torch.eye(4)
    assert torch.allclose(jac, expected)


@pytest.mark.parametrize("hidden_dims", [(5, 3), ()])
@pytest.mark.parametrize("active_dim", [2, 4])
def test_skip_generator_explicit_jacobian_matches_autograd(hidden_dims, active_dim):
    gen = SkipGenerator(
        4, active_dim=active_dim, hidden_dims=hidden_dims, activation="tanh"
    ).double()
    z = torch.randn(3, 4, dtype=torch.float64)
    expected = torch.stack([torch.func.jacrev(gen)(row) for row in z])
    assert torch.allclose(gen.jacobian(z), expected, atol=1e-12)
    # and the exact solve built on it is J^{-T} v
    v = torch.randn(3, 2, 4, dtype=torch.float64)
    solved = exact_inverse_jvp(gen, z, v)
    assert torch.allclose(expected.mT.unsqueeze(1) @ solved.unsqueeze(-1), v.unsqueeze(-1))


@pytest.mark.parametrize("active_dim", [4, 2], ids=["k=D", "k<D"])
@pytest.mark.parametrize("independent", [False, True])
def test_exact_kernel_repulsion_is_the_sum_of_solves(independent, active_dim):
    """sum_a J(z'_a)^{-T} grad_{z'_a} k(z'_a, z_b) for each b, against torch.linalg.solve
    with autograd's Jacobian and the kernel's gradient by autograd (a generator whose
    Jacobian is not symmetric, so J^{-1} in place of J^{-T} fails); k < D takes the
    k x k (Woodbury) solve."""
    torch.manual_seed(0)
    gen = SkipGenerator(
        4, active_dim=active_dim, hidden_dims=(6,), activation="tanh", skip_scale=0.7
    ).double()
    z_score = torch.randn(5, 4, dtype=torch.float64)
    z = torch.randn(3, 4, dtype=torch.float64) if independent else z_score
    kernel = RBFKernel()
    sigma = 1.3
    _, dk = kernel_and_derivative(kernel, squared_distances(z_score, z), sigma)
    expected = torch.zeros(z.shape[0], 4, dtype=torch.float64)
    for a in range(z_score.shape[0]):
        jac = torch.func.jacrev(gen)(z_score[a])
        for b in range(z.shape[0]):
            # the kernel's gradient in its first argument, by autograd
            za = z_score[a].clone().requires_grad_()
            value, _ = kernel_and_derivative(kernel, (za - z[b]).pow(2).sum()[None, None], sigma)
            (grad,) = torch.autograd.grad(value.sum(), za)
            expected[b] += torch.linalg.solve(jac.mT, grad)
    got = exact_kernel_repulsion(gen, z_score, z, dk)
    assert torch.allclose(got, expected, atol=1e-10)


def test_low_rank_solve_matches_the_dense_inverse_at_bnn_like_shapes():
    """k < D through the k x k block against the float64 solve with the formed D x D
    Jacobian, in float32 (the dtype of a fit), a skip scale other than 1 and a Jacobian
    block far from the identity."""
    torch.manual_seed(1)
    gen = SkipGenerator(40, active_dim=9, hidden_dims=(16, 16), skip_scale=0.6).float()
    with torch.no_grad():
        gen.net.output.weight.mul_(3.0)
    z, v = torch.randn(6, 40, dtype=torch.float32), torch.randn(6, 5, 40, dtype=torch.float32)
    jac = gen.jacobian(z).detach().double()
    expected = torch.linalg.solve(jac.mT.unsqueeze(1), v.double().unsqueeze(-1)).squeeze(-1)
    got = exact_inverse_jvp(gen, z, v)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


def test_auto_solves_exactly_above_64_with_the_skip_generator():
    """Above D = 64 ``exact_jacobian="auto"`` takes the k x k solve for the skip generator
    (no helper network is built); ``exact_jacobian=False`` still trains the paper's
    helper."""
    dim = 70

    def model():
        pyro.sample("x", dist.Normal(torch.zeros(dim), 1.0).to_event(1))

    for exact, built in (("auto", False), (False, True)):
        pyro.clear_param_store()
        guide = ImplicitGuide(model, generator=gpvi_generator())
        loss = GPVI_ELBO(8, exact_jacobian=exact)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
        assert torch.isfinite(torch.tensor(svi.step()))
        assert guide.generator.active_dim < dim
        assert (loss.helper is not None) is built


def test_default_above_64_keeps_an_exact_gaussian_posterior():
    """The default GPVI fit of a 70-coefficient Bayesian linear regression (k = 65 < D:
    the k x k solve) against its exact posterior: it starts at the preconditioner's
    Gaussian, the exact answer here, and 300 steps of ``Adam(1e-2)`` must keep it there
    (with the repulsion's cross term of the wrong sign it fails). g starts near zero and
    stays small on a Gaussian target, so the k x k correction itself is small here: the
    solve tests above check it."""
    from pyro_implicit.targets.conjugate import linear_regression, score_draws

    problem = linear_regression((1.0,) * 70)
    guide = ImplicitGuide(problem.model, generator=gpvi_generator())
    loss = GPVI_ELBO()
    svi = SVI(problem.model, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    for _ in range(300):
        svi.step(*problem.args)
    assert guide.generator.active_dim < 70 and loss.helper is None
    with torch.no_grad():
        score = score_draws(guide.sample_posterior(4000)[problem.site], problem.posterior)
    assert score["mean_error"] < 0.2, score
    assert 0.85 <= score["sd_ratio_min"] and score["sd_ratio_max"] <= 1.15, score
    assert score["correlation_error"] < 0.1, score


def test_singular_low_rank_block_is_rejected():
    """J = lambda I + [U | 0] is singular exactly when lambda I_k + U[:k]^T is: the k x k
    solve raises the error naming the invertible generator."""
    gen = SkipGenerator(5, active_dim=2, hidden_dims=(), skip_scale=1.0)
    with torch.no_grad():
        gen.net.output.weight.zero_()
        gen.net.output.weight[:2].copy_(-torch.eye(2))  # U[:k] = -I: the block is 0
    with pytest.raises(ValueError, match="gpvi_generator"):
        exact_inverse_jvp(gen, torch.randn(3, 5), torch.randn(3, 2, 5))


def test_gpvi_generator_option_trains():
    guide = ImplicitGuide(gaussian_model, generator=gpvi_generator(hidden_dims=(8,)))
    loss = GPVI_ELBO(8, exact_jacobian=True)
    svi = SVI(gaussian_model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    assert torch.isfinite(torch.tensor(svi.step()))
    assert isinstance(guide.generator, SkipGenerator)


# ---------------------------------------------------------------------------- errors
def one_dim_model():
    pyro.sample("s", dist.LogNormal(0.0, 1.0))


def test_non_square_default_names_the_option():
    guide = ImplicitGuide(one_dim_model)  # D = 1, default noise size 2
    svi = SVI(one_dim_model, guide, pyro.optim.Adam({"lr": 1e-3}), GPVI_ELBO(4))
    with pytest.raises(ValueError, match="generator=gpvi_generator"):
        svi.step()
    # the named option fixes it
    pyro.clear_param_store()
    guide = ImplicitGuide(one_dim_model, generator=gpvi_generator())
    svi = SVI(one_dim_model, guide, pyro.optim.Adam({"lr": 1e-3}), GPVI_ELBO(4))
    assert torch.isfinite(torch.tensor(svi.step()))


def test_singular_generator_is_rejected():
    guide = linear_guide()
    with torch.no_grad():
        guide.generator.output.weight.copy_(torch.tensor([[1.0, 2.0], [2.0, 4.0]]))
    with pytest.raises(ValueError, match="singular"):
        GPVI_ELBO(4, exact_jacobian=False).loss_and_grads(gaussian_model, guide)


@pytest.mark.parametrize(
    "make_guide", [AutoNormal, SemiImplicitGuide], ids=["AutoNormal", "SemiImplicitGuide"]
)
def test_wrong_guide_type_is_rejected(make_guide):
    guide = make_guide(gaussian_model)
    with pytest.raises(TypeError, match="gpvi_generator"):
        GPVI_ELBO(4).loss_and_grads(gaussian_model, guide)


def test_bad_arguments():
    with pytest.raises(ValueError, match="skip_scale"):
        SkipGenerator(4, active_dim=2, skip_scale=0.0)
    with pytest.raises(ValueError, match="active_dim"):
        SkipGenerator(4, active_dim=5)
    with pytest.raises(ValueError, match="helper_lr"):
        GPVI_ELBO(helper_lr=0.0)
    with pytest.raises(ValueError, match="num_particles"):
        GPVI_ELBO(1)


def test_amortized_svgd_default_kernel_is_two_rbf_terms(monkeypatch):
    """The default kernel, from the distances the step computes: the mean of the RBF
    kernels at Liu & Wang's length scale (median / sqrt(2 log N)) and at the median
    distance itself; GPVI keeps Liu & Wang's alone."""
    import pyro_implicit.elbo.amortized_svgd as amortized_svgd

    seen = []

    def recording(kernel, d2, bandwidth):
        out = kernel_and_derivative(kernel, d2, bandwidth)
        seen.append((d2, out[0]))
        return out

    monkeypatch.setattr(amortized_svgd, "kernel_and_derivative", recording)
    n = 16
    guide = ImplicitGuide(gaussian_model, noise_dim=3)
    loss = AmortizedSVGD_ELBO(n, independent_batches=False)
    SVI(gaussian_model, guide, pyro.optim.Adam({"lr": 1e-3}), loss).step()
    d2, k = seen[-1]
    rows, cols = torch.triu_indices(n, n, 1)
    median = float(np.median(d2[rows, cols].sqrt().numpy()))  # each pair once
    liu_wang = median / math.sqrt(2 * math.log(n))
    expected = 0.5 * (torch.exp(-d2 / (2 * liu_wang**2)) + torch.exp(-d2 / (2 * median**2)))
    assert torch.allclose(k, expected, rtol=1e-10, atol=1e-12)
    gpvi_kernel = GPVI_ELBO(n).kernel
    assert type(gpvi_kernel) is RBFKernel
    assert gpvi_kernel.bandwidth_factor == pytest.approx(1 / math.sqrt(2 * math.log(n)))


def test_amortized_svgd_accepts_non_square_guides():
    guide = ImplicitGuide(gaussian_model, noise_dim=3)
    svi = SVI(gaussian_model, guide, pyro.optim.Adam({"lr": 1e-3}), AmortizedSVGD_ELBO(8))
    assert torch.isfinite(torch.tensor(svi.step()))


# --------------------------------------------------------------------- energy targets
def test_energy_potentials():
    z = torch.tensor([[2.0, 0.0], [0.0, 0.0], [4.5, 0.0]])
    # U1 at (2, 0): on the ring, at a mode: -ln(1 + exp(-0.5 (4/0.6)^2))
    expected = torch.log1p(torch.exp(torch.tensor(-0.5 * (4 / 0.6) ** 2)))
    assert energy_log_density("twin_moons", wall=False)(z)[0] == pytest.approx(expected.item())
    for name in ENERGY_POTENTIALS:
        values = energy_log_density(name)(z)
        assert values.shape == (3,) and torch.isfinite(values).all()
        # the soft wall only acts outside the box
        free = energy_log_density(name, wall=False)(z)
        assert torch.equal(values[:2], free[:2]) and values[2] < free[2]
    model = energy_model("sinusoid")
    trace = pyro.poutine.trace(model).get_trace()
    assert trace.nodes["z"]["value"].shape == (2,)
    with pytest.raises(ValueError, match="unknown energy potential"):
        energy_log_density("banana")


# ------------------------------------------------------------------------ benchmarks
@pytest.mark.parametrize("command", ["gaussian", "blr", "energy"])
def test_benchmark_smoke(command, capsys, load_benchmark):
    rows = load_benchmark("gpvi").main([command, "--smoke", "--seed", "1"])
    assert rows
    assert "| method |" in capsys.readouterr().out


def _subsampled_regression(x, y, subsample_size=None):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as i:
        pyro.sample("obs", dist.Normal((x[i] * w).sum(-1), 0.5), obs=y[i])


@pytest.mark.parametrize("loss_cls", [GPVI_ELBO, AmortizedSVGD_ELBO])
def test_traced_score_path_gives_the_eager_numbers(loss_cls):
    """After the first step the functional-gradient losses draw the guide directly and
    score the draws with the traced graph of the log-density instead of Pyro traces of the
    guide and the model: the same losses and the same fit, step for step (a subsampled
    model: the same minibatches too)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, generator=g)
    y = (x * torch.tensor([1.0, -0.5])).sum(-1) + 0.5 * torch.randn(40, generator=g)
    runs = []
    for compile in (False, "fx"):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = ImplicitGuide(_subsampled_regression, generator=gpvi_generator())
        elbo = loss_cls(num_particles=16, max_plate_nesting=1, compile=compile)
        svi = SVI(_subsampled_regression, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)
        losses = [svi.step(x, y, subsample_size=10) for _ in range(6)]
        pyro.set_rng_seed(1)
        runs.append((losses, guide.sample_posterior(20)["w"], elbo))
    (eager, draws_eager, _), (traced, draws_traced, elbo) = runs
    assert len(elbo._spaces) == 1 and next(iter(elbo._spaces.values())).compiled.active
    # the guide is drawn directly too (no Pyro trace of it) and still gives these numbers
    assert list(elbo._direct.values()) == [True]
    assert eager == pytest.approx(traced, rel=1e-10, abs=1e-10)
    assert torch.allclose(draws_eager, draws_traced, atol=1e-10)
