"""ArviZ export: groups, dims and shapes, closed-form log-likelihoods, and az.summary /
az.loo / az.compare on NUTS and two variational fits of one small model."""

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS

from pyro_implicit.diagnostics.arviz import (
    comparison_to_inference_data,
    predictive_samples,
    to_inference_data,
)
from pyro_implicit.diagnostics.compare import compare
from pyro_implicit.diagnostics.nuts import run_nuts

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # arviz 0.23's daily "refactor" notice
    import arviz as az

# Named third-party warnings of az.loo / az.compare on short runs and on arviz 0.23 with
# pandas 3: Pareto-k, and a pandas deprecation inside az.compare.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Estimated shape parameter of Pareto:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*inplace keyword:DeprecationWarning"),
]

N_OBS = 6


def vector_model(y):
    """A 2-D mean with a scale, ``y`` ``(n, 2)``: an event dim, a plate and a constraint."""
    loc = pyro.sample("loc", dist.Normal(torch.zeros(2), 3.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 0.5))
    with pyro.plate("obs_plate", y.shape[0], dim=-1):
        pyro.sample("y", dist.Normal(loc, scale.unsqueeze(-1)).to_event(1), obs=y)


@pytest.fixture(scope="module")
def data():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(N_OBS, 2, generator=g, dtype=torch.float64) + torch.tensor([1.0, -1.0]),)


@pytest.fixture(scope="module")
def comparison(data):
    torch.set_default_dtype(torch.float64)
    nuts = run_nuts(
        vector_model,
        *data,
        num_samples=100,
        warmup_steps=60,
        num_chains=2,
        seed=0,
        max_plate_nesting=1,
        progress_bar=False,
    )
    return compare(
        vector_model,
        *data,
        methods=["autonormal", "wsvgd"],
        num_steps=200,
        num_samples=400,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
    )


@pytest.fixture(scope="module")
def exports(comparison, data):
    return comparison_to_inference_data(comparison, vector_model, data, max_plate_nesting=1)


def test_groups_dims_and_shapes(exports):
    assert list(exports) == ["nuts", "autonormal", "wsvgd"]
    expected = {"nuts": (2, 100), "autonormal": (1, 400), "wsvgd": (1, 100)}
    for name, idata in exports.items():
        for group in ("posterior", "posterior_predictive", "log_likelihood", "observed_data"):
            assert group in idata.groups(), (name, group)
        chains, draws = expected[name]
        post = idata.posterior
        assert post["loc"].dims == ("chain", "draw", "loc_dim_0")
        assert post["loc"].shape == (chains, draws, 2)
        assert post["scale"].dims == ("chain", "draw")
        assert float(post["scale"].min()) > 0  # constrained space
        assert idata.log_likelihood["y"].dims == ("chain", "draw", "obs_plate")
        assert idata.log_likelihood["y"].shape == (chains, draws, N_OBS)
        assert idata.posterior_predictive["y"].dims == ("chain", "draw", "obs_plate", "y_dim_1")
        assert idata.posterior_predictive["y"].shape == (chains, draws, N_OBS, 2)
        assert idata.observed_data["y"].dims == ("obs_plate", "y_dim_1")
        assert post.attrs["method"] == name
    # no fake chains for VI: one chain, and the attrs say what the draws are
    assert exports["autonormal"].posterior.attrs["draws_kind"] == "iid"
    assert "not convergence diagnostics" in exports["autonormal"].posterior.attrs["draws"]
    assert exports["wsvgd"].posterior.attrs["draws_kind"] == "particles"
    assert exports["nuts"].posterior.attrs["draws_kind"] == "mcmc"
    # the loss trace is on its own dim, not (chain, draw)
    stats = exports["autonormal"].sample_stats
    assert stats["loss"].dims == ("loss_step",) and stats["loss"].shape == (200,)
    assert stats.attrs["loss"] == "loss (-ELBO estimate)"


def test_log_likelihood_is_the_closed_form(exports, data):
    (y,) = data
    idata = exports["autonormal"]
    loc = torch.as_tensor(idata.posterior["loc"].values[0])
    scale = torch.as_tensor(idata.posterior["scale"].values[0])
    # sum over the 2-D event of log N(y_ij | loc_j, scale)
    z = (y - loc[:, None, :]) / scale[:, None, None]
    expected = (-0.5 * z**2 - torch.log(scale)[:, None, None] - 0.5 * math.log(2 * math.pi)).sum(-1)
    actual = torch.as_tensor(idata.log_likelihood["y"].values[0])
    assert torch.allclose(actual, expected, atol=1e-10)
    observed = torch.as_tensor(idata.observed_data["y"].values)
    assert torch.equal(observed, y)


def test_posterior_predictive_matches_its_draws(exports):
    idata = exports["autonormal"]
    loc = idata.posterior["loc"].values[0]  # (S, 2)
    scale = idata.posterior["scale"].values[0]  # (S,)
    pp = idata.posterior_predictive["y"].values[0]  # (S, n, 2)
    # standardised residuals of the re-drawn data are N(0, 1)
    z = (pp - loc[:, None, :]) / scale[:, None, None]
    assert abs(z.mean()) < 0.1 and abs(z.std() - 1.0) < 0.1


def test_summary_loo_and_compare(exports):
    summary = az.summary(exports["nuts"])
    assert list(summary.index) == ["loc[0]", "loc[1]", "scale"]
    assert summary["r_hat"].notna().all()
    vi = az.summary(exports["autonormal"], kind="stats")
    assert list(vi.columns) == ["mean", "sd", "hdi_3%", "hdi_97%"]
    loo = az.loo(exports["autonormal"])
    assert loo.n_data_points == N_OBS and math.isfinite(loo.elpd_loo)
    table = az.compare(exports)
    assert set(table.index) == {"nuts", "autonormal", "wsvgd"}
    assert table["elpd_loo"].notna().all()
    # the same model and data: the two good fits agree on elpd within a few units
    assert abs(table.loc["nuts", "elpd_loo"] - table.loc["autonormal", "elpd_loo"]) < 3


def test_nuts_result_exports_divergences_per_draw(comparison, exports):
    nuts = comparison.nuts
    diverging = exports["nuts"].sample_stats["diverging"]
    assert diverging.dims == ("chain", "draw") and diverging.shape == (2, 100)
    assert int(diverging.sum()) == nuts.num_divergences
    assert [int(d) for d in diverging.sum("draw")] == nuts.divergences_by_chain


def test_mcmc_object_and_guide_sources(data):
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        NUTS(vector_model, max_plate_nesting=1),
        num_samples=30,
        warmup_steps=30,
        disable_progbar=True,
    )
    mcmc.run(*data)
    idata = to_inference_data(vector_model, data, source=mcmc, max_plate_nesting=1)
    assert idata.posterior["loc"].shape == (1, 30, 2)
    assert idata.sample_stats["diverging"].dims == ("chain", "draw")
    # a guide straight from SVI, drawn from here
    guide = pyro.infer.autoguide.AutoNormal(vector_model)
    svi = pyro.infer.SVI(
        vector_model, guide, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO()
    )
    trace = [svi.step(*data) for _ in range(20)]
    idata = to_inference_data(
        vector_model,
        data,
        source=guide,
        num_samples=50,
        seed=3,
        loss_trace=trace,
        max_plate_nesting=1,
    )
    assert idata.posterior["loc"].shape == (1, 50, 2)
    assert idata.sample_stats["loss"].shape == (20,)
    again = to_inference_data(
        vector_model, data, source=guide, num_samples=50, seed=3, max_plate_nesting=1
    )
    assert (again.posterior["loc"].values == idata.posterior["loc"].values).all()


def test_exports_carry_the_checks_that_need_no_nuts(comparison, exports, data):
    for name in ("autonormal", "wsvgd", "nuts"):
        attrs = exports[name].posterior.attrs
        expected = comparison.nuts_ksd if name == "nuts" else comparison.methods[name].ksd
        assert attrs["ksd"] == expected.ksd and attrs["ksd_noise_level"] > 0
    assert exports["autonormal"].posterior.attrs["pareto_k"] == (
        comparison.methods["autonormal"].k_hat
    )
    assert "pareto_k" not in exports["wsvgd"].posterior.attrs  # particles: no density
    guide = comparison.methods["autonormal"].approximation
    idata = to_inference_data(
        vector_model,
        data,
        source=guide,
        num_samples=200,
        seed=0,
        max_plate_nesting=1,
        diagnostics=True,
    )
    attrs = idata.posterior.attrs
    assert math.isfinite(attrs["ksd"]) and math.isfinite(attrs["pareto_k"])


def test_predictive_samples_at_new_inputs():
    def regression(x, y=None):
        w = pyro.sample("w", dist.Normal(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            f = pyro.deterministic("f", w * x)
            pyro.sample("obs", dist.Normal(f, 1e-6), obs=y)

    w = torch.tensor([1.0, -2.0, 0.5])
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    out = predictive_samples(regression, (x,), draws={"w": w}, max_plate_nesting=1, seed=0)
    assert set(out) == {"f", "obs"}
    assert torch.allclose(out["f"], w[:, None] * x)
    assert torch.allclose(out["obs"], out["f"], atol=1e-4)
    with pytest.raises(ValueError, match=r"no latent sites \['v'\]"):
        predictive_samples(regression, (x,), draws={"v": w}, max_plate_nesting=1)


def test_a_misplaced_argument_is_named(comparison, data):
    guide = comparison.methods["autonormal"].approximation
    with pytest.raises(TypeError, match="kwargs must be a dict.*source="):
        to_inference_data(vector_model, data, guide)
    with pytest.raises(TypeError, match="args must be a tuple"):
        to_inference_data(vector_model, data[0], source=guide)


def test_a_factor_is_no_observed_site():
    """``pyro.factor`` adds a term, not data: exported as an observed site it made a
    second pointwise log-likelihood (one value per draw), and ``az.loo`` refused the
    group ("Found several log likelihood arrays")."""

    def ridge(y):
        loc = pyro.sample("loc", dist.Normal(0.0, 3.0))
        pyro.factor("ridge", -0.5 * loc**2)
        with pyro.plate("data", y.shape[0]):
            pyro.sample("y", dist.Normal(loc, 1.0), obs=y)

    y = torch.tensor([0.5, 1.5, 1.0])
    idata = to_inference_data(ridge, (y,), source={"loc": torch.randn(40)}, seed=0)
    for group in ("observed_data", "log_likelihood", "posterior_predictive"):
        assert list(idata[group].data_vars) == ["y"], group
    az.loo(idata)
