"""Every method runs where the data lives.

The library creates its tensors on the device of the model's data, so a model whose data
sits on CUDA trains there unchanged. On a machine with a GPU the tests below run on it too
(``cuda`` is added when available); on a CPU-only machine they still exercise every method
end to end on a minibatched BNN, with the returned draws checked for device and finiteness.
"""

import math

import pyro
import pytest
import torch
from pyro.infer import SVI, Predictive

from pyro_implicit import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    FunctionSpaceSVGD,
    ImplicitGuide,
    KernelRatioELBO,
    LinearizedGuide,
    SemiImplicitGuide,
    WeightSpaceSVGD,
)
from pyro_implicit.bnn import BNNRegression
from pyro_implicit.elbo.gpvi import gpvi_generator

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

GUIDE_METHODS = {
    "kivi": lambda m: (ImplicitGuide(m), KernelRatioELBO(num_particles=8, max_plate_nesting=1)),
    "kivi_adaptive": lambda m: (
        ImplicitGuide(m),
        KernelRatioELBO(num_particles=8, adaptive_contrast="full", max_plate_nesting=1),
    ),
    "sivi": lambda m: (
        SemiImplicitGuide(m),
        SIVI_ELBO(num_particles=4, num_mixing=4, max_plate_nesting=1),
    ),
    "livi_det": lambda m: (LinearizedGuide(m), LIVI_ELBO(2, bound="det", max_plate_nesting=1)),
    "livi_svd": lambda m: (LinearizedGuide(m), LIVI_ELBO(2, bound="svd", max_plate_nesting=1)),
    "gpvi": lambda m: (
        ImplicitGuide(m, generator=gpvi_generator()),
        GPVI_ELBO(4, max_plate_nesting=1),
    ),
    "asvgd": lambda m: (ImplicitGuide(m), AmortizedSVGD_ELBO(4, max_plate_nesting=1)),
}


def _problem(device):
    x = torch.randn(24, 3, device=device)
    y = x.sum(-1) + 0.1 * torch.randn(24, device=device)
    # D = 3 * 4 + 4 + 4 + 1 + 1 = 22 latents: small enough for GPVI's square generator
    return BNNRegression(3, hidden_dims=(4,)), x, y


def _check_draws(draws, device):
    for name, value in draws.items():
        assert value.device.type == device, name
        assert torch.isfinite(value).all(), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", sorted(GUIDE_METHODS))
def test_guides_train_and_predict_on_the_data_device(device, method):
    model, x, y = _problem(device)
    guide, loss = GUIDE_METHODS[method](model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    for _ in range(2):
        value = svi.step(x, y, subsample_size=12)
    assert math.isfinite(value)
    _check_draws(guide.sample_posterior(5), device)
    predictive = Predictive(model, guide=guide, num_samples=3, return_sites=["f", "obs"])
    _check_draws(predictive(x), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("function_space", [False, True], ids=["weight", "function"])
def test_particles_step_on_the_data_device(device, function_space):
    model, x, y = _problem(device)
    optim = pyro.optim.Adam({"lr": 1e-3})
    if function_space:
        inference = FunctionSpaceSVGD(model, optim, 4, 1, function_site="f")
    else:
        inference = WeightSpaceSVGD(model, optim, 4, max_plate_nesting=1)
    for _ in range(2):
        diagnostics = inference.step(x, y, subsample_size=12)
    assert math.isfinite(diagnostics["bandwidth"])
    particles = inference.get_named_particles()
    _check_draws(particles, device)
    _check_draws(Predictive(model, posterior_samples=particles, return_sites=["f"])(x), device)


@pytest.mark.parametrize("vi_estimator", ["entropy", "stl"])
@pytest.mark.parametrize("device", DEVICES)
def test_preconditioner_search_fits_on_the_data_device(device, vi_estimator):
    # the Laplace of log p(u) = -u^2/2 - u^4 fails its importance check, so the Gaussian
    # fit must run where the data are: its parameters once stayed on the CPU beside a
    # CUDA start, every fit raised, and the failed Laplace was kept
    from pyro_implicit.latent import LatentSpace, find_preconditioner

    x = torch.zeros(3, device=device)

    def quartic(x):
        u = pyro.sample("u", pyro.distributions.Normal(x.new_zeros(()), 1.0))
        pyro.factor("quartic", -(u**4) + x.sum())

    space = LatentSpace.from_model(quartic, (x,))
    pre = find_preconditioner(space, space.init_loc, (x,), vi_estimator=vi_estimator)
    assert pre.source == "gaussian_vi"
    assert pre.loc.device.type == device
    assert pre.scale_tril.item() == pytest.approx(0.5, rel=0.1)  # the best Gaussian's sd


@pytest.mark.parametrize("device", DEVICES)
def test_diagnostics_on_the_data_device(device):
    # PSIS's smoothed tail and the AUROC's ranks are written into tensors on the
    # weights' (the scores') device
    from pyro_implicit.diagnostics.classification import auroc
    from pyro_implicit.diagnostics.importance import pareto_smooth

    g = torch.Generator().manual_seed(0)
    log_weights = (2.0 * torch.randn(400, generator=g, dtype=torch.float64)).to(device)
    smoothed, k_hat = pareto_smooth(log_weights)
    assert smoothed.device.type == device and math.isfinite(k_hat)
    assert torch.logsumexp(smoothed, 0).item() == pytest.approx(0.0, abs=1e-9)
    scores = torch.randn(50, generator=g).to(device)
    assert auroc(scores + 10.0, scores) == pytest.approx(1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_plots_of_draws_on_the_data_device(device):
    # matplotlib reads numpy, which cannot see GPU memory: the plots move draws to the CPU
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from pyro_implicit.diagnostics.plots import pair_plot, regression_predictive_plot

    g = torch.Generator().manual_seed(0)
    draws = {"mu": torch.randn(50, generator=g).to(device)}
    reference = {"mu": torch.randn(60, generator=g).to(device)}
    assert len(pair_plot(draws, reference).axes) == 1
    model = BNNRegression(1, hidden_dims=(4,))
    x = torch.linspace(-2, 2, 7, device=device).unsqueeze(-1)

    def weights(n):
        return {
            "layer0": torch.randn(n, 2, 4, generator=g).to(device),
            "layer1": torch.randn(n, 5, 1, generator=g).to(device),
            "precision": torch.full((n,), 100.0, device=device),
        }

    fig = regression_predictive_plot(
        model, x, {"m": weights(20)}, weights(30), y=x[:, 0], max_plate_nesting=1
    )
    assert [a.get_title() for a in fig.axes if a.axison] == ["m"]


@pytest.mark.parametrize("device", DEVICES)
def test_arviz_export_of_a_guide_on_the_data_device(device):
    # the export's log-likelihood, posterior predictive, KSD and PSIS read draws made
    # where the data live, and hand numpy arrays to ArviZ
    pytest.importorskip("arviz")
    from pyro_implicit.diagnostics import to_inference_data

    model, x, y = _problem(device)
    guide = SemiImplicitGuide(model, precondition=False)  # the search is tested above
    loss = SIVI_ELBO(num_particles=4, num_mixing=4, max_plate_nesting=1)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-3}), loss)
    for _ in range(2):
        svi.step(x, y)
    idata = to_inference_data(
        model, (x, y), source=guide, num_samples=20, max_plate_nesting=1, seed=0, diagnostics=True
    )
    assert idata["posterior"]["precision"].shape == (1, 20)
    assert idata["log_likelihood"]["obs"].shape == (1, 20, 24)
    assert math.isfinite(idata["posterior"].attrs["pareto_k"])
