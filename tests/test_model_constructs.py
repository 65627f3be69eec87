"""Models as Pyro users write them: ``obs_mask`` fitted to the exact posterior, and the
constructs no method here supports (discrete latents, sequential plates), data it cannot
use (NaN), and guides used out of order refused with errors that name the site and the
fix."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive
from torch.distributions import constraints

from pyro_implicit import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    DataError,
    ImplicitGuide,
    KernelRatioELBO,
    LinearizedGuide,
    ModelError,
    SemiImplicitGuide,
    SteinScoreELBO,
    UnsupportedModelError,
    VectorizationError,
    WeightSpaceSVGD,
)
from pyro_implicit.diagnostics import compare, run_nuts
from pyro_implicit.elbo.gpvi import gpvi_generator
from pyro_implicit.latent import LatentSpace, completed_model, drawable_flat_prior

Y = torch.tensor([0.3, 1.9, 0.8, 2.4, 1.1, -0.2, 1.6, 0.0, 0.0, 0.0])
OBSERVED = torch.arange(10) < 7  # the last three are missing
PRIOR_SD = 10.0


def masked_model(y, obs_mask):
    mu = pyro.sample("mu", dist.Normal(0.0, PRIOR_SD))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y, obs_mask=obs_mask)


def _exact():
    """Posterior mean and sd of ``mu`` (conjugate Normal), and the sd of a missing ``y``
    (its posterior predictive)."""
    precision = PRIOR_SD**-2 + OBSERVED.sum().item()
    mean = Y[OBSERVED].sum().item() / precision
    return mean, precision**-0.5, (1.0 + 1.0 / precision) ** 0.5


def test_obs_mask_unused_entries_get_the_models_density_and_nothing_else_changes():
    space = LatentSpace.from_model(masked_model, (Y, OBSERVED), max_plate_nesting=1)
    assert [s.name for s in space.sites] == ["mu", "y_unobserved"]
    u = torch.randn(4, space.latent_dim, dtype=torch.float64)
    mu, unobserved = u[:, 0], u[:, 1:]
    expected = (
        dist.Normal(0.0, PRIOR_SD).log_prob(mu)
        + dist.Normal(mu[:, None], 1.0).log_prob(Y[OBSERVED]).sum(-1)
        + dist.Normal(mu[:, None], 1.0).log_prob(unobserved).sum(-1)  # all ten entries
    )
    assert torch.allclose(space.log_density(u, (Y, OBSERVED)), expected, rtol=1e-12)

    def plain(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    at = {"mu": torch.tensor(0.5)}
    trace = poutine.trace(poutine.condition(completed_model(plain), at)).get_trace(Y)
    alone = poutine.trace(poutine.condition(plain, at)).get_trace(Y)
    assert trace.log_prob_sum() == alone.log_prob_sum()
    assert completed_model(completed_model(plain)).model is plain


def _fitted_draws(method, model, *args):
    """After 800 steps of ``Adam(1e-2)``: ``WeightSpaceSVGD``'s particles (``"wsvgd"``), or
    4000 draws of an ``ImplicitGuide`` trained by ``KernelRatioELBO`` (``"kivi"``) or
    ``SteinScoreELBO`` (``"stein"``)."""
    if method == "wsvgd":
        svgd = WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}), max_plate_nesting=1)
        for _ in range(800):
            svgd.step(*args)
        return svgd.get_named_particles()
    guide = ImplicitGuide(model)
    loss = KernelRatioELBO() if method == "kivi" else SteinScoreELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    for _ in range(800):
        svi.step(*args)
    return guide.sample_posterior(4000)


@pytest.mark.parametrize("method", ["kivi", "wsvgd"])
def test_an_obs_mask_model_is_fitted_to_its_exact_posterior(method):
    mean, sd, missing_sd = _exact()
    draws = _fitted_draws(method, masked_model, Y, OBSERVED)
    mu = draws["mu"].flatten()
    missing = draws["y_unobserved"].reshape(len(mu), -1)[:, ~OBSERVED]
    assert abs(mu.mean().item() - mean) < 0.2 * sd
    assert 0.85 < mu.std().item() / sd < 1.15
    assert abs(missing.mean().item() - mean) < 0.2 * missing_sd
    assert 0.85 < missing.std(0).mean().item() / missing_sd < 1.15


def test_a_loss_traces_the_completed_model():
    """The losses' own traces (every step with ``compile=False``, the first one with the
    default) see the completed mask, not only the latent space's graph."""
    loss = KernelRatioELBO(num_particles=4, compile=False)
    svi = SVI(masked_model, ImplicitGuide(masked_model), pyro.optim.Adam({"lr": 1e-2}), loss)
    svi.step(Y, OBSERVED)
    model_trace, _ = loss._last_traces
    assert bool(model_trace.nodes["y_unobserved"]["mask"].all())


def _discrete(y):
    k = pyro.sample("k", dist.Bernoulli(0.5))
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu + k, 1.0), obs=y)


def _first_step(what, model, *args):
    if what == "wsvgd":
        WeightSpaceSVGD(model, pyro.optim.Adam({"lr": 1e-2}), num_particles=4).step(*args)
    elif what == "stein":
        guide = ImplicitGuide(model)
        SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO()).step(*args)
    else:
        {"implicit": ImplicitGuide, "semi": SemiImplicitGuide, "linearized": LinearizedGuide}[what](
            model
        )(*args)


@pytest.mark.parametrize("what", ["implicit", "semi", "linearized", "wsvgd", "stein"])
def test_a_discrete_latent_is_refused_with_the_fix(what):
    with pytest.raises(ModelError, match="cannot sample discrete site 'k'.*TraceEnum_ELBO"):
        _first_step(what, _discrete, Y)


def _moving_support(y):
    theta = pyro.sample("theta", dist.Exponential(1.0))
    x = pyro.sample("x", dist.Uniform(0.0, theta))
    pyro.sample("obs", dist.Normal(x, 0.1), obs=y)


def _fixed_support(y):
    """``_moving_support`` drawn on a fixed support, as the error says: the same joint."""
    theta = pyro.sample("theta", dist.Exponential(1.0))
    x_unit = pyro.sample("x_unit", dist.Uniform(0.0, 1.0))
    x = pyro.deterministic("x", theta * x_unit)
    pyro.sample("obs", dist.Normal(x, 0.1), obs=y)


@pytest.mark.parametrize("what", ["implicit", "semi", "linearized", "wsvgd", "stein", "nuts"])
def test_a_support_that_moves_with_a_latent_is_refused_with_the_fix(what):
    """``x ~ Uniform(0, theta)``: one fixed transform per site would put draws outside the
    support; the search met it as a failed Laplace and the vectorisation check blamed the
    particle plate."""
    message = "site 'x' has support .* moves with the latent site.*'theta'.*x_unit"
    with pytest.raises(UnsupportedModelError, match=message):
        if what == "nuts":
            run_nuts(_moving_support, torch.tensor(0.8), num_samples=5, warmup_steps=5)
        else:
            _first_step(what, _moving_support, torch.tensor(0.8))


def test_a_support_that_moves_with_a_param_or_not_at_all_is_not_refused():
    def model(y):
        upper = pyro.param("upper", torch.tensor(2.0), constraint=constraints.positive)
        a = pyro.sample("a", dist.Uniform(0.0, upper))
        b = pyro.sample("b", dist.Uniform(torch.tensor(-1.0), torch.tensor(3.0)))
        pyro.sample("obs", dist.Normal(a + b, 1.0), obs=y)

    ImplicitGuide(model, precondition=False)(torch.tensor(0.5))


def test_the_rewrite_on_a_fixed_support_fits_the_exact_posterior():
    y = torch.tensor(0.8)
    # the exact posterior of (theta, x) on a grid: e^-theta / theta on 0 < x < theta
    theta, x = torch.meshgrid(
        torch.linspace(1e-3, 12.0, 1500), torch.linspace(1e-4, 3.0, 1500), indexing="ij"
    )
    log_p = -theta - theta.log() + dist.Normal(x, 0.1).log_prob(y)
    weights = torch.where(x < theta, log_p, -math.inf).flatten().softmax(0).reshape(x.shape)
    guide = ImplicitGuide(_fixed_support)
    svi = SVI(_fixed_support, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(800):
        svi.step(y)
    draws = guide.sample_posterior(4000)
    draws["x"] = draws["theta"] * draws["x_unit"]
    for name, grid in (("theta", theta), ("x", x)):
        mean = (weights * grid).sum()
        sd = (weights * (grid - mean) ** 2).sum().sqrt()
        assert abs(draws[name].mean() - mean) < 0.2 * sd
        assert 0.85 < draws[name].std() / sd < 1.15


def _point_mass(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.sample("twice", dist.Delta(2 * mu))  # a recorded value, as pyro.deterministic does
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("what", ["implicit", "semi", "linearized", "wsvgd", "stein", "nuts"])
def test_a_point_mass_latent_is_refused_with_the_fix(what):
    """A ``Delta`` latent has no density: the fits met its -inf log-density as a
    divergence and advised a lower learning rate."""
    with pytest.raises(ModelError, match="'twice' is a point mass.*pyro.deterministic"):
        if what == "nuts":
            run_nuts(_point_mass, Y, num_samples=5, warmup_steps=5)
        else:
            _first_step(what, _point_mass, Y)


def _flat(y, counts):
    # Pyro's flat priors: mu on the reals, the rate on the positives. Exact posteriors:
    # N(mean y, 1 / n) and Gamma(sum counts + 1, len(counts))
    mu = pyro.sample("mu", dist.ImproperUniform(constraints.real, (), ()))
    rate = pyro.sample("rate", dist.ImproperUniform(constraints.positive, (), ()))
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
    with pyro.plate("counts", len(counts)):
        pyro.sample("k", dist.Poisson(rate), obs=counts)


COUNTS = torch.tensor([3.0, 5.0, 4.0, 6.0, 2.0])


@pytest.mark.parametrize("what", ["stein", "wsvgd", "nuts"])
def test_a_flat_prior_is_fitted_to_its_exact_posterior(what):
    """``ImproperUniform`` cannot be drawn from, and every method draws from the prior
    (starting points, the vectorisation check): each draws a stand-in instead, whose
    log-density is the flat prior's 0 (torch's "does not support sampling" before, then
    a refusal)."""
    if what == "nuts":
        draws = run_nuts(_flat, Y, COUNTS, num_samples=500, warmup_steps=200, num_chains=1).samples
    else:
        draws = _fitted_draws(what, _flat, Y, COUNTS)
    rate = dist.Gamma(COUNTS.sum() + 1, float(len(COUNTS)))
    exact = {"mu": (Y.mean(), len(Y) ** -0.5), "rate": (rate.mean, rate.stddev)}
    for name, (mean, sd) in exact.items():
        drawn = draws[name].flatten()
        assert abs(drawn.mean() - mean) < 0.2 * sd, name
        assert 0.85 < drawn.std() / sd < 1.15, name


@pytest.mark.parametrize("what", ["implicit", "semi", "linearized", "compare"])
# two steps of a fit leave a guide that PSIS rightly calls unreliable
@pytest.mark.filterwarnings("ignore::pyro_implicit.diagnostics.importance.UnreliableFitWarning")
def test_every_method_starts_on_a_flat_prior(what):
    if what == "compare":
        compare(
            _flat,
            Y,
            COUNTS,
            methods=["kivi", "autonormal"],
            num_steps=2,
            num_samples=5,
            nuts_kwargs={"num_samples": 5, "warmup_steps": 5, "num_chains": 1},
        )
    else:
        _first_step(what, _flat, Y, COUNTS)


def test_draws_of_a_flat_prior_model_go_through_the_guides_model():
    """Pyro's ``Predictive`` runs the model from its prior first, which a flat prior
    cannot; the guide's ``model`` (the one the fits run) can, and so does the export."""
    guide = ImplicitGuide(_flat)
    SVI(_flat, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO()).step(Y, COUNTS)
    predicted = Predictive(guide.model, guide=guide, num_samples=5)(Y, COUNTS)
    assert predicted["obs"].shape == (5, len(Y)) and predicted["k"].shape == (5, len(COUNTS))
    pytest.importorskip("arviz")
    from pyro_implicit.diagnostics.arviz import to_inference_data

    data = to_inference_data(_flat, (Y, COUNTS), source=guide, num_samples=20)
    assert data.posterior["rate"].shape[-1] == 20 and (data.posterior["rate"] > 0).all()


@pytest.mark.parametrize(
    "support, batch, event",
    [
        (constraints.real, (2,), ()),
        (constraints.positive, (), (3,)),
        (constraints.interval(-1.0, 2.0), (2,), (3,)),
        (constraints.simplex, (2,), (3,)),
    ],
)
def test_a_drawable_flat_prior_keeps_the_shape_support_and_zero_density(support, batch, event):
    flat = dist.ImproperUniform(support, batch, event)
    for fn in (flat, flat.to_event(len(batch))):
        stand_in = drawable_flat_prior(fn)
        assert stand_in.batch_shape == fn.batch_shape
        assert stand_in.event_shape == fn.event_shape
        draws = stand_in.sample((5,))
        assert draws.shape == (5,) + fn.batch_shape + fn.event_shape
        assert support.check(draws).all()
        assert torch.equal(stand_in.log_prob(draws), torch.zeros((5,) + fn.batch_shape))


def _flat_counts(y):
    n = pyro.sample("n", dist.ImproperUniform(constraints.nonnegative_integer, (), ()))
    pyro.sample("obs", dist.Normal(n, 1.0), obs=y)


def _masked_flat(y):
    mu = pyro.sample("mu", dist.ImproperUniform(constraints.real, (), ()).mask(False))
    pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize(
    "model, message",
    [
        (_flat_counts, "'n' has a flat prior.*no map from real space"),
        (_masked_flat, "'mu'.*wrapped"),
    ],
)
def test_a_flat_prior_that_cannot_be_drawn_is_named(model, message):
    with pytest.raises(ModelError, match=message):
        _first_step("implicit", model, torch.tensor(0.5))


def _branching(y):
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    w = pyro.sample("w", dist.Normal(z, 1.0)) if z > 0 else z
    pyro.sample("obs", dist.Normal(w, 1.0), obs=y)


@pytest.mark.parametrize("what", ["implicit", "semi", "linearized", "wsvgd", "stein"])
def test_python_control_flow_on_a_latent_is_a_vectorization_error(what):
    """An ``if`` on a latent fails at a batch of draws: named as such before the search
    runs (its batches met it as failed fits and warned with Pyro's trace dump first)."""
    with pytest.raises(VectorizationError, match="Boolean value of Tensor"):
        _first_step(what, _branching, torch.tensor(0.5))


def test_a_sequential_plate_is_an_unsupported_model():
    def sequential(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        for i in pyro.plate("data", len(y)):
            pyro.sample(f"z_{i}", dist.Normal(mu, 1.0))

    with pytest.raises(UnsupportedModelError, match="with pyro.plate") as info:
        ImplicitGuide(sequential)(Y)
    assert isinstance(info.value, NotImplementedError)


def _model(y=None):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", 10):
        return pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def test_a_guide_first_called_without_the_data_is_refused():
    guide = ImplicitGuide(_model)
    Predictive(_model, guide=guide, num_samples=2)()  # 'obs' was latent in that call
    svi = SVI(_model, guide, pyro.optim.Adam({"lr": 1e-2}), KernelRatioELBO())
    with pytest.raises(ModelError, match=r"samples \['obs'\], which the model observes"):
        svi.step(Y)


def test_nan_data_are_a_data_error_through_svi():
    y = Y.clone()
    y[3] = float("nan")
    svi = SVI(_model, SemiImplicitGuide(_model), pyro.optim.Adam({"lr": 1e-2}), KernelRatioELBO())
    with pytest.raises(DataError, match="observed site 'obs' hold 1 non-finite"):
        svi.step(y)


@pytest.mark.parametrize("cls", [ImplicitGuide, SemiImplicitGuide, LinearizedGuide])
def test_sampling_before_the_first_call_names_the_fix(cls):
    guide = cls(_model)
    with pytest.raises(RuntimeError, match=r"call guide\(\*args\)"):
        guide.sample_posterior(3)
    with pytest.raises(RuntimeError, match=r"call guide\(\*args\)"):
        guide.median()
    median = guide.median(Y)  # with the data: the set-up a first call does
    assert set(median) == {"mu"} and torch.isfinite(median["mu"])


def test_a_models_own_error_at_the_first_call_propagates():
    def broken(y):
        pyro.sample("mu", dist.Normal(0.0, 1.0))
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        ImplicitGuide(broken)(Y)


def test_column_shaped_data_get_pyros_shape_error_naming_the_site():
    column = Y[:, None]  # (10, 1) in a plate of 10: the likelihood would broadcast to 10 x 10
    with pytest.raises(ValueError, match='at site "obs", invalid log_prob shape'):
        SemiImplicitGuide(_model)(column)


def _one_latent():
    pyro.sample("x", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: ImplicitGuide(_one_latent, noise_dim=2.5), ValueError, "noise_dim must be an"),
        (lambda: ImplicitGuide(_one_latent, per_site="yes"), TypeError, "per_site must be"),
        (lambda: ImplicitGuide(_one_latent, hidden_dims=(-4, 8))(), ValueError, "hidden_dims"),
        (lambda: ImplicitGuide(_one_latent, hidden_dims=(0,))(), ValueError, "hidden_dims"),
        (lambda: LinearizedGuide(_one_latent, num_quantile_samples=0), ValueError, "num_quan"),
        (lambda: SemiImplicitGuide(_one_latent, mixing_noise_dim=1.5), ValueError, "mixing_noi"),
        (lambda: SteinScoreELBO(num_particles=2.5), ValueError, "num_particles must be an int"),
        (
            lambda: WeightSpaceSVGD(_one_latent, pyro.optim.Adam({"lr": 0.1}), kernel="rbf"),
            TypeError,
            "kernel must be a kernel object",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(build, error, message):
    # they were accepted (a float count truncated, "yes" read as True, a zero width) or
    # failed inside torch naming no setting
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize("count", [-1, 2.5])
def test_a_bad_number_of_draws_is_refused_by_name(count):
    guide = ImplicitGuide(_one_latent)
    guide()
    with pytest.raises(ValueError, match="num_samples must be an integer >= 0"):
        guide.sample_posterior(count)


def _no_latents(y):
    with pyro.plate("data", len(y)):
        pyro.sample("obs", dist.Normal(0.0, 1.0), obs=y)


@pytest.mark.parametrize("who", ["compare", "ImplicitGuide", "WeightSpaceSVGD"])
def test_a_model_without_latent_sites_is_refused_by_name(who):
    # compare fitted every method first and failed in its diagnostics with Pyro's
    # "AutoContinuous found no latent variables"; the particles named a private class
    from pyro_implicit.diagnostics import compare

    y = torch.zeros(3)
    optim = pyro.optim.Adam({"lr": 1e-2})
    run = {
        "compare": lambda: compare(_no_latents, y, methods="autonormal", nuts=False),
        "ImplicitGuide": lambda: SVI(
            _no_latents, ImplicitGuide(_no_latents), optim, SteinScoreELBO()
        ).step(y),
        "WeightSpaceSVGD": lambda: WeightSpaceSVGD(_no_latents, optim).step(y),
    }[who]
    with pytest.raises(ModelError, match=f"{who}: the model has no latent sites"):
        run()


def test_a_pyromodule_linear_on_sampled_weights_is_named_at_the_search():
    # nn.Linear on sampled weights cannot take a batch of draws; the preconditioner's
    # search met it first and raised torch's "t() expects a tensor with <= 2 dimensions"
    from pyro.nn import PyroModule, PyroSample
    from torch import nn

    from pyro_implicit import VectorizationError

    class Linear(PyroModule):
        def __init__(self):
            super().__init__()
            self.fc = PyroModule[nn.Linear](2, 1)
            self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
            self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y):
            mean = self.fc(x).squeeze(-1)  # the weights drawn outside the data plate
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, 1.0), obs=y)

    model = Linear()
    x = torch.randn(5, 2)
    with pytest.raises(VectorizationError, match="fails when 3 draws.*preconditioner search"):
        ImplicitGuide(model)(x, x.sum(-1))


def normal_mean(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


TEMPERED = {
    "kivi": (ImplicitGuide, KernelRatioELBO),
    "stein": (ImplicitGuide, SteinScoreELBO),
    "sivi": (SemiImplicitGuide, SIVI_ELBO),
    "livi": (LinearizedGuide, LIVI_ELBO),
    "gpvi": (lambda m: ImplicitGuide(m, generator=gpvi_generator()), GPVI_ELBO),
    "asvgd": (ImplicitGuide, AmortizedSVGD_ELBO),
}


@pytest.mark.parametrize("method", sorted(TEMPERED))
def test_a_loss_scores_the_model_it_is_given_not_the_guides(method):
    """``SVI(poutine.scale(model, s), guide)`` fits the tempered posterior, as Pyro's ELBOs
    do, on the steps that skip Pyro's traces too: their log-density is the model's the loss
    is given (it was the guide's own, so the fit found the untempered posterior, sd ratio
    0.47-0.52)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = 1.5 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    make_guide, make_loss = TEMPERED[method]
    guide = make_guide(normal_mean)
    svi = SVI(
        poutine.scale(normal_mean, scale=0.25), guide, pyro.optim.Adam({"lr": 1e-2}), make_loss()
    )
    for _ in range(600):
        svi.step(y)
    draws = guide.sample_posterior(4000)["mu"]
    precision = 0.25 * (1 / 4 + 20)  # the tempered posterior: every density to the power 1/4
    mean, sd = y.sum() / (1 / 4 + 20), precision**-0.5
    assert abs(draws.mean() - mean) < 0.2 * sd
    assert 0.85 < draws.std() / sd < 1.15


ELEMENT_SCALE = torch.tensor([1.0, 0.25])


def _element_scaled(y):
    # two coordinates, the second's prior tempered by poutine.scale; one point each
    with pyro.plate("p", 2):
        with poutine.scale(scale=ELEMENT_SCALE):
            z = pyro.sample("z", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal(z, 1.0), obs=y)


@pytest.mark.parametrize("method", ["kivi", "stein"])
def test_a_prior_scaled_element_by_element_is_fitted(method):
    """A tensor ``poutine.scale`` on a latent's prior weights each element, as in
    ``Trace_ELBO``; these two losses read one number and raised ("a Tensor with 2
    elements cannot be converted to Scalar")."""
    y = torch.tensor([1.0, 2.0])
    draws = _fitted_draws(method, _element_scaled, y)["z"].reshape(-1, 2)
    precision = ELEMENT_SCALE + 1.0
    mean, sd = y / precision, precision**-0.5
    assert ((draws.mean(0) - mean).abs() < 0.2 * sd).all()
    assert ((draws.std(0) / sd - 1.0).abs() < 0.15).all()


def test_a_guide_restored_by_torch_load_trains_on(tmp_path):
    """A pickled guide drops its model (Pyro's autoguides do); the loss scores the model it
    is given, so the restored guide trains on (it raised a TypeError from the space)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = 1.5 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    guide = ImplicitGuide(normal_mean)
    svi = SVI(normal_mean, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(3):
        svi.step(y)
    torch.save(guide, tmp_path / "guide.pt")
    restored = torch.load(tmp_path / "guide.pt", weights_only=False)
    svi = SVI(normal_mean, restored, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    for _ in range(3):
        assert math.isfinite(svi.step(y))


@pytest.mark.parametrize("cls", [ImplicitGuide, SemiImplicitGuide, LinearizedGuide])
def test_a_guide_draws_and_is_built_under_inference_mode(cls):
    """``torch.inference_mode`` around drawing (``sample_posterior``, ``Predictive``,
    ``median``) works, as under ``torch.no_grad`` (the dense preconditioner's draw cache
    read the version counter inference tensors lack), and a guide first called there is
    built with ordinary parameters that a loss then trains (its search needs autograd)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    y = 1.5 + torch.randn(20, generator=torch.Generator().manual_seed(0))
    guide = cls(normal_mean)
    with torch.inference_mode():
        Predictive(normal_mean, guide=guide, num_samples=5)(y)  # builds the guide
    svi = SVI(normal_mean, guide, pyro.optim.Adam({"lr": 1e-2}), SteinScoreELBO())
    if cls is SemiImplicitGuide:
        svi = SVI(normal_mean, guide, pyro.optim.Adam({"lr": 1e-2}), SIVI_ELBO())
    elif cls is LinearizedGuide:
        svi = SVI(normal_mean, guide, pyro.optim.Adam({"lr": 1e-2}), LIVI_ELBO())
    before = [p.detach().clone() for p in guide.parameters()]
    for _ in range(3):
        svi.step(y)
    assert any(not torch.equal(a, p) for a, p in zip(before, guide.parameters(), strict=True))
    with torch.inference_mode():
        draws = guide.sample_posterior(10)["mu"]
        predictive = Predictive(normal_mean, guide=guide, num_samples=5)(y)
        guide.median(y)
    assert draws.shape == (10,) and predictive["mu"].shape[0] == 5
