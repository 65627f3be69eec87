"""``compare`` on a conjugate Normal-Normal model, with tiny settings."""

import math
import re
import sys

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

from pyro_implicit.datasets import data_available
from pyro_implicit.diagnostics.compare import (
    METHODS,
    NUM_PARTICLES,
    ComparisonResult,
    compare,
    latent_shapes,
)
from pyro_implicit.diagnostics.importance import UnreliableFitWarning
from pyro_implicit.diagnostics.methods import ALIASES, grid_method, resolve_name
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.latent import Preconditioner, preconditioner_of
from pyro_implicit.models import BUILTIN_MODELS, load_model

# fits of a few dozen steps are rough: their k-hat warning is expected (and tested below)
pytestmark = pytest.mark.filterwarnings(
    "ignore::pyro_implicit.diagnostics.importance.UnreliableFitWarning"
)


def normal_normal(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


@pytest.fixture(scope="module")
def y():
    return torch.linspace(-0.5, 2.5, 10, dtype=torch.float64)


@pytest.fixture
def nuts(y):
    return run_nuts(
        normal_normal,
        y,
        num_samples=100,
        warmup_steps=50,
        num_chains=2,
        seed=0,
        max_plate_nesting=1,
        progress_bar=False,
    )


def test_compare_structure(y, nuts, capsys):
    names = ["kivi", "autonormal", "automvn", "wsvgd"]
    result = compare(
        normal_normal,
        y,
        methods=names,
        num_steps=30,
        num_samples=300,
        nuts=nuts,
        max_plate_nesting=1,
        progress=True,
        lr={"kivi": 0.02},
    )
    assert isinstance(result, ComparisonResult)
    assert result.nuts is nuts
    assert list(result.methods) == names
    rows = result.rows()
    assert [r["method"] for r in rows] == names + ["nuts"]
    with_density = {"autonormal", "automvn"}  # k-hat only for guides with a log-density
    for row in rows:
        for key, value in row.items():
            if key == "method" or (row["method"], key) == ("nuts", "peak_mb"):
                continue
            if key == "k_hat" and row["method"] not in with_density:
                assert math.isnan(value), row["method"]
            else:
                assert math.isfinite(value), (row["method"], key)
    assert math.isnan(result.nuts_peak_mb)  # a reused NUTS run is not measured
    for r in result.methods.values():
        # plate padding removed; a particle method gives its particles
        expected = NUM_PARTICLES if r.kind == "particles" else 300
        assert r.samples["mu"].shape == (expected,)
        assert len(r.losses) == 30 and r.wall_time > 0
    assert result.methods["wsvgd"].kind == "particles"
    assert result.methods["autonormal"].kind == "iid"
    assert result.methods["kivi"].lr == 0.02 and result.methods["automvn"].lr == 0.05
    text = result.table()
    assert text.splitlines()[0].split()[:2] == ["method", "mean"]
    assert "NUTS: 2 chain(s) x 100 draws" in text
    assert result.to_markdown().startswith("| method |")
    site_lines = result.to_markdown(per_site=True).splitlines()
    assert site_lines[0].startswith("| method | site | coords |")
    assert site_lines[2].startswith("| kivi | mu | 1 |")
    table_rows = [line for line in site_lines if line.startswith("| ")]
    assert len(table_rows) == 1 + len(names) + 1  # header, methods, nuts
    err = capsys.readouterr().err
    assert "kivi: 30 steps, lr 0.02" in err and "wsvgd: 30 steps" in err
    sites = result.to_dataframe(per_site=True)
    assert list(sites.index.get_level_values("site").unique()) == ["mu"]
    assert set(result.nuts_diagnostics()) == {"mu"}
    assert math.isfinite(sites.loc[("kivi", "mu"), "nuts_r_hat_max"])


def test_compare_is_reproducible_per_method(y, nuts):
    kw = dict(num_steps=5, num_samples=50, nuts=nuts, max_plate_nesting=1, progress=False)
    both = compare(normal_normal, y, methods=("autonormal", "kivi"), **kw)
    # the old name fits the same method (same draws) and keeps its label, with a warning
    with pytest.warns(FutureWarning, match="'implicit' is deprecated.*use 'kivi'"):
        alone = compare(normal_normal, y, methods=("implicit",), **kw)
    assert alone.settings["methods"] == {"implicit": "kivi"}
    # Each fit starts from the same seed, whatever ran before it.
    assert torch.equal(both.methods["kivi"].samples["mu"], alone.methods["implicit"].samples["mu"])


def test_each_method_gets_the_preconditioner_its_loss_asks_for(quartic_model):
    """Where the search fits a Gaussian, compare searches once per estimator the methods
    ask for and gives each method its own: kivi the STL fit, stein_score and wsvgd the
    exact-entropy one, as each would find alone."""
    from pyro_implicit.latent import LatentSpace, find_preconditioner

    space = LatentSpace.from_model(quartic_model, (), {}, 0)
    found = {
        e: find_preconditioner(space, space.init_loc, (), vi_estimator=e)
        for e in ("entropy", "stl")
    }
    kw = dict(num_steps=2, num_samples=20, nuts=False, max_plate_nesting=0, progress=False)
    result = compare(quartic_model, methods=["kivi", "stein_score", "wsvgd"], **kw)
    assert sorted(result.settings["preconditioner"]) == ["entropy", "stl"]
    for name, estimator in [("kivi", "stl"), ("stein_score", "entropy"), ("wsvgd", "entropy")]:
        pre = preconditioner_of(result.methods[name].approximation)
        assert torch.equal(pre.scale_tril, found[estimator].scale_tril), name
    assert not torch.equal(found["entropy"].scale_tril, found["stl"].scale_tril)
    # a row's KSD does not depend on the other rows (its coordinates did: the stl fit's
    # where no method asked for the exact-entropy one)
    alone = compare(quartic_model, methods=["kivi"], **kw)
    assert alone.methods["kivi"].ksd.ksd == result.methods["kivi"].ksd.ksd


@pytest.mark.parametrize(
    "network, dim, noise", [(True, 300, "network"), (False, 300, 300), (True, 200, 200)]
)
def test_compares_livi_takes_a_networks_noise_for_a_wide_network(network, dim, noise):
    """``livi`` in ``compare`` around a dense Gaussian fit beyond 256 latents takes a
    network's noise where they are a network's weights (marked ``NETWORK_WEIGHTS``, as
    :mod:`pyro_implicit.bnn` marks them): D would make each step form whole D x D
    Jacobians. Any other model, or one of at most 256 latents, keeps noise of D."""
    from pyro_implicit.diagnostics.methods import METHODS
    from pyro_implicit.guides.base import network_noise_dim
    from pyro_implicit.latent import NETWORK_WEIGHTS

    def wide(x, y):
        prior = dist.Normal(0.0, 1.0).expand([dim]).to_event(1)
        beta = pyro.sample("beta", prior, infer={NETWORK_WEIGHTS: network})
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Normal((x * beta).sum(-1), 1.0), obs=y)

    x, y = torch.randn(2 * dim, dim), torch.randn(2 * dim)
    pre = Preconditioner(torch.zeros(dim), scale_tril=torch.eye(dim), source="gaussian_vi")
    pyro.clear_param_store()
    guide, _ = METHODS["livi"].build(wide, 1, precondition=pre)
    guide(x, y)
    assert guide.noise_dim == (network_noise_dim(dim) if noise == "network" else noise)


def test_one_preconditioner_search_serves_every_method(y, nuts, monkeypatch):
    """The model's preconditioner is searched once, not once per method (and again for
    the KSD's coordinates), and every method of the library gets it: here the exact
    Gaussian posterior of the conjugate model, mean sum(y) / 11 and sd 1 / sqrt(11)."""
    import pyro_implicit.latent as latent

    searches = []

    def counted(*args, **kwargs):
        searches.append(1)
        return find(*args, **kwargs)

    find = latent.find_preconditioner
    monkeypatch.setattr(latent, "find_preconditioner", counted)
    names = ["kivi", "sivi", "wsvgd", "autonormal"]
    kw = dict(num_steps=3, num_samples=50, nuts=nuts, max_plate_nesting=1, progress=False)
    result = compare(normal_normal, y, methods=names, **kw)
    # kivi and sivi ask for the STL Gaussian fit, wsvgd for the exact-entropy one, but the
    # Laplace passes its check, so no fit runs and one search serves both
    assert len(searches) == 1
    search = result.settings["preconditioner"]
    assert search["stl"] is search["entropy"]
    assert search["entropy"]["source"] == "laplace" and search["entropy"]["seconds"] > 0
    for name in ["kivi", "sivi", "wsvgd"]:
        pre = preconditioner_of(result.methods[name].approximation)
        assert torch.allclose(pre.loc, y.sum() / 11 * torch.ones(1), atol=1e-6), name
        assert torch.allclose(pre.scale_tril, torch.full((1, 1), 11**-0.5), atol=1e-6), name
    # one's own preconditioner goes to every method, and no search runs
    own = Preconditioner(torch.tensor([0.5]), scale_tril=torch.tensor([[0.2]]))
    result = compare(normal_normal, y, methods=names, precondition=own, **kw)
    assert len(searches) == 1 and result.settings["preconditioner"] is None
    for name in ["kivi", "sivi", "wsvgd"]:
        pre = preconditioner_of(result.methods[name].approximation)
        assert torch.equal(pre.scale_tril, own.scale_tril.to(pre.scale_tril)), name

    # a wrong one is refused before NUTS runs, not by the first fit after it
    def no_nuts(*args, **kwargs):
        raise AssertionError("NUTS ran before the preconditioner was checked")

    # the module, not the function of the same name that the package exports
    monkeypatch.setattr(sys.modules[compare.__module__], "run_nuts", no_nuts)
    wrong = Preconditioner(torch.zeros(2), scale=torch.ones(2))
    with pytest.raises(ValueError, match="D=2 but the model's packed latent has D=1"):
        compare(normal_normal, y, methods=names, precondition=wrong, **dict(kw, nuts=None))
    with pytest.raises(TypeError, match="precondition must be True"):
        compare(normal_normal, y, methods=names, precondition="yes", **dict(kw, nuts=None))
    # only Pyro's methods: nothing to share (the KSD's coordinates need the one search)
    compare(normal_normal, y, methods=["autonormal"], diagnostics=False, **kw)
    assert len(searches) == 1


def test_old_method_names_resolve_to_the_registrys_one_name():
    assert list(METHODS)[0] == "kivi" and "implicit" not in list(METHODS)
    for old, new in ALIASES.items():
        assert new in METHODS
        with pytest.warns(FutureWarning, match=f"'{re.escape(old)}' is deprecated.*use '{new}'"):
            assert resolve_name(old) == new
        with pytest.warns(FutureWarning, match=f"use '{new}'"):
            assert METHODS[old] is METHODS[new]
    assert resolve_name("kivi") == "kivi" and resolve_name("map") == "map"  # no warning
    with pytest.warns(FutureWarning):
        guide, loss = METHODS["implicit"].build(normal_normal, 1, precondition=False)
    assert (type(guide).__name__, type(loss).__name__) == ("ImplicitGuide", "KernelRatioELBO")
    # one name in each place: the grid's pairs are the registry's methods
    assert (METHODS["kivi"].guide, METHODS["kivi"].loss) == ("ImplicitGuide", "KernelRatioELBO")
    assert grid_method("SemiImplicitGuide", "SIVI_ELBO") == "sivi"
    with pytest.raises(ValueError, match="distinct.*old and new names"):
        with pytest.warns(FutureWarning):
            compare(normal_normal, torch.zeros(3), methods=("kivi", "implicit"))


def test_compare_takes_an_mcmc_object_and_fitted_methods(y):
    pyro.set_rng_seed(0)
    mcmc = MCMC(
        NUTS(normal_normal, max_plate_nesting=1),
        num_samples=60,
        warmup_steps=40,
        disable_progbar=True,
    )
    mcmc.run(y)
    guide = AutoNormal(normal_normal)
    svi = SVI(normal_normal, guide, pyro.optim.Adam({"lr": 0.05}), Trace_ELBO())
    for _ in range(200):
        svi.step(y)
    # conjugate posterior N(sum(y) / (n + 1), 1 / (n + 1)) as a dict of draws
    n = y.shape[0]
    exact = {"mu": y.sum() / (n + 1) + torch.randn(2000) / math.sqrt(n + 1)}
    result = compare(
        normal_normal,
        y,
        methods={"fitted": guide, "exact": exact},
        nuts=mcmc,
        num_samples=500,
        max_plate_nesting=1,
        progress=False,
    )
    assert result.nuts.samples["mu"].shape == (60,)
    assert result.nuts.samples_by_chain["mu"].shape == (1, 60)
    assert math.isnan(result.nuts.wall_time)
    assert result.methods["fitted"].kind == "iid" and not result.methods["fitted"].fitted_here
    assert result.methods["exact"].kind == "samples"
    assert result.methods["fitted"].samples["mu"].shape == (500,)
    assert "passed in already fitted" in " ".join(result.table().split())
    # the exact posterior is within NUTS's Monte Carlo error of it
    assert result.methods["exact"].metrics["joint"]["mean_error_max"] < 0.5


def test_compare_rejects_unknown_method(y):
    with pytest.raises(ValueError, match="unknown method.*'nope'; choose from: kivi, "):
        compare(normal_normal, y, methods=("nope",))


def test_a_model_keyword_named_like_an_option_is_refused_before_any_fit(y):
    """``compare(model, y, lr=2.0)`` for a model taking ``lr`` set compare's learning rate
    and ran the model at its default, silently."""
    seen = []

    def scaled(y, lr=1.0):
        seen.append(lr)
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Normal(mu, lr), obs=y)

    with pytest.raises(ValueError, match=r"model takes \['lr'\].*model_kwargs=\{'lr': ...\}"):
        compare(scaled, y, lr=2.0, methods=["autonormal"], nuts=False)
    assert not seen
    compare(
        scaled,
        y,
        methods=["autonormal"],
        lr=0.01,
        nuts=False,
        diagnostics=False,
        num_steps=1,
        num_samples=2,
        progress=False,
        model_kwargs={"lr": 2.0},
    )
    assert seen and set(seen) == {2.0}


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lr": {"kivii": 0.1}}, r"lr names \['kivii'\], which no fitted row is"),
        ({"lr": -0.1}, "must be a positive number"),
        ({"lr": {"autonormal": float("inf")}}, "must be finite"),
        ({"num_steps": 2.5}, "need an integer num_steps >= 1, got 2.5"),
    ],
)
def test_bad_learning_rates_and_counts_are_refused(y, options, message):
    with pytest.raises(ValueError, match=message):
        compare(normal_normal, y, methods=["autonormal"], nuts=False, **options)


def test_a_learning_rate_by_method_name_reaches_its_labelled_row(y):
    result = compare(
        normal_normal,
        y,
        methods={"mine": "autonormal"},
        lr={"autonormal": 0.02},
        nuts=False,
        diagnostics=False,
        num_steps=1,
        num_samples=2,
        progress=False,
    )
    assert result.settings["lr"] == {"mine": 0.02}


_EXPECTED_SHAPES = {
    "eight_schools": {"mu": (), "tau": (), "theta_tilde": (8,)},
    "banana": {"x1": (), "x2": ()},
    "waveform_logistic": {"beta": (22,)},
    # 6 inputs + bias -> 10 hidden, 10 + bias -> 1 output, the noise precision
    "yacht_bnn": {"layer0": (7, 10), "layer1": (11, 1), "precision": ()},
}


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_builtin_models_shapes(name):
    if name in ("waveform_logistic", "yacht_bnn") and not data_available():
        pytest.skip("data folder not available")
    m = load_model(name)
    assert m.name == name
    shapes = latent_shapes(m.model, *m.args, **m.kwargs)
    assert shapes == _EXPECTED_SHAPES[name]
    with pytest.raises(KeyError, match="eight_schools, banana"):
        load_model("nope")


def test_every_method_runs(y, nuts):
    result = compare(
        normal_normal,
        y,
        methods=list(METHODS),
        num_steps=5,
        num_samples=50,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
    )
    assert list(result.methods) == list(METHODS)
    for name, r in result.methods.items():
        assert len(r.losses) == 5 and all(math.isfinite(v) for v in r.losses), name
        assert torch.isfinite(r.samples["mu"]).all(), name
        assert r.description == METHODS[name].description


def test_compare_without_nuts_reports_ksd_and_k_hat(y):
    """nuts=False: no reference run, and the rows carry the checks that need none; draws
    shifted by two posterior sds score far above exact ones."""
    exact_sd = 1 / math.sqrt(11)
    exact = y.sum() / 11 + exact_sd * torch.randn(1000)
    result = compare(
        normal_normal,
        y,
        methods={
            "exact": {"mu": exact},
            "shifted": {"mu": exact + 2 * exact_sd},
            "autonormal": "autonormal",
        },
        num_steps=20,
        num_samples=200,
        nuts=False,
        max_plate_nesting=1,
        progress=False,
    )
    assert result.nuts is None and not result.has_reference
    assert [r["method"] for r in result.rows()] == ["exact", "shifted", "autonormal"]
    ksd = {name: r.ksd for name, r in result.methods.items()}
    assert ksd["exact"].ratio_to_noise < 1.5 < 5 < ksd["shifted"].ratio_to_noise
    assert math.isnan(result.methods["exact"].k_hat)
    assert math.isfinite(result.methods["autonormal"].k_hat)
    header = result.table().splitlines()[0].split()
    assert header[:3] == ["method", "KSD", "k-hat"] and "mean" not in header
    assert "No NUTS reference" in result.table()
    assert result.site_rows() == [] and result.to_dict()["nuts"] is None
    assert result.to_dict()["methods"]["shifted"]["ksd"]["ksd"] == ksd["shifted"].ksd


def test_compare_warns_once_for_unreliable_guides(y, nuts):
    with pytest.warns(UnreliableFitWarning, match="autonormal") as record:
        result = compare(
            normal_normal,
            y,
            methods=["autonormal"],
            num_steps=3,
            num_samples=100,
            nuts=nuts,
            max_plate_nesting=1,
            progress=False,
            lr=1e-3,
        )
    assert result.methods["autonormal"].k_hat > 0.7
    assert len([w for w in record if w.category is UnreliableFitWarning]) == 1
    # NUTS's own draws are the yardstick of the KSD column
    assert result.nuts_ksd.ksd < result.methods["autonormal"].ksd.ksd


def test_compare_diagnostics_can_be_switched_off(y, nuts):
    result = compare(
        normal_normal,
        y,
        methods=["autonormal"],
        num_steps=3,
        num_samples=100,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
        diagnostics=False,
    )
    assert result.methods["autonormal"].ksd is None and result.nuts_ksd is None
    assert math.isnan(result.rows()[0]["ksd"])


def test_bad_models_are_refused_before_nuts(y):
    """NaN data and a model that mixes particles get their own error before NUTS runs."""
    bad = y.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="observed site 'obs'.*non-finite"):
        compare(normal_normal, bad, methods=["autonormal"], num_steps=2, progress=False)

    def mixes(y):
        mu = pyro.sample("mu", dist.Normal(torch.zeros(2), 1.0).to_event(1))
        with pyro.plate("data", y.shape[-1]):
            pyro.sample("obs", dist.Normal(mu.sum(), 1.0), obs=y)  # sums over particles

    from pyro_implicit.elbo import VectorizationError

    with pytest.raises(VectorizationError):
        compare(mixes, y, methods=["svgd"], num_steps=2, progress=False)


def with_scale_parameter(y):
    scale = pyro.param("scale", torch.tensor(0.5), constraint=dist.constraints.positive)
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(mu, scale), obs=y)


def test_model_parameters_are_held_at_one_value_in_every_row(y):
    """NUTS cannot learn a model's pyro.param: every row uses the same value (said in the
    settings), so the fits' sds match NUTS's instead of looking about 2x too narrow."""
    nuts = run_nuts(
        with_scale_parameter,
        y,
        num_samples=200,
        warmup_steps=100,
        num_chains=2,
        seed=0,
        max_plate_nesting=1,
        progress_bar=False,
    )
    result = compare(
        with_scale_parameter,
        y,
        methods=["automvn", "wsvgd"],
        num_steps=300,
        num_samples=1000,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
    )
    assert result.settings["held_model_parameters"] == {"scale": 0.5}
    exact_sd = 1 / math.sqrt(1 + y.numel() / 0.25)
    for name in ("automvn", "wsvgd"):
        sd = float(result.methods[name].samples["mu"].std())
        assert sd == pytest.approx(exact_sd, rel=0.2), name
    assert float(result.nuts.samples["mu"].std()) == pytest.approx(exact_sd, rel=0.2)


def test_a_weak_reference_is_said_under_the_table(y, nuts):
    result = compare(
        normal_normal,
        y,
        methods=["autonormal"],
        num_steps=3,
        num_samples=100,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
        diagnostics=False,
    )
    assert nuts.min_ess < 400
    weak = [line for line in result.table().splitlines() if line.startswith("WEAK REFERENCE")]
    assert len(weak) == 1 and "min ESS" in weak[0]


def test_nuts_starts_in_every_mode_and_weighs_its_draws_as_the_modes(two_modes):
    """Two modes (masses 0.30 / 0.70), a valley NUTS's chains rarely cross: compare's NUTS
    starts two chains in each mode the search found and resamples their draws to the
    modes' weights, so the reference has the posterior's exact mean and sd. R-hat
    is taken within each mode, where the chains mix."""
    from pyro_implicit import MultimodalPosteriorWarning

    model, exact = two_modes(0.3)
    with pytest.warns(MultimodalPosteriorWarning):
        result = compare(
            model,
            methods=["wsvgd"],
            num_steps=300,
            nuts_kwargs={"num_samples": 300, "warmup_steps": 200},
            progress=False,
            diagnostics=False,
        )
    nuts = result.nuts
    minor = exact["minor_mass"]
    assert nuts.mode_weights == pytest.approx([1 - minor, minor], abs=0.01)
    assert next(iter(nuts.samples_by_chain.values())).shape[0] == 4
    a = nuts.samples["a"]
    assert abs(a.mean().item() - exact["mean"]) < 0.05 * exact["sd"]
    assert a.std().item() == pytest.approx(exact["sd"], rel=0.05)
    assert nuts.max_r_hat < 1.05
    assert "chains started in 2 modes" in result.table()
    assert result.methods["wsvgd"].metrics["joint"]["mean_error_max"] < 0.1


def test_nuts_starts_in_the_labelling_the_methods_fit(unordered_mixture):
    """An unordered two-component mixture (label switching): the search keeps one
    labelling, and compare's NUTS starts every chain in it, so the reference and the
    methods agree on the labels (chains from NUTS's own start fell in both: R-hat of
    several and component means averaged to about zero)."""
    from pyro_implicit import LabelSwitchingWarning

    mixture, y = unordered_mixture

    with pytest.warns(LabelSwitchingWarning):
        result = compare(
            mixture,
            y,
            methods=["wsvgd"],
            num_steps=200,
            nuts_kwargs={"num_samples": 150, "warmup_steps": 100, "num_chains": 4},
            progress=False,
            diagnostics=False,
        )
    mu = result.nuts.samples["mu"]
    kept = (result.methods["wsvgd"].samples["mu"][:, 0] < 0).double().mean().item()
    assert kept in (0.0, 1.0)  # the particles hold one labelling
    assert ((mu[:, 0] < 0).double().mean().item() == kept) and result.nuts.max_r_hat < 1.05
    assert result.methods["wsvgd"].metrics["joint"]["mean_error_max"] < 0.3


def test_a_diverged_method_is_a_row_not_the_end(y, nuts):
    """A method whose fit diverges (here: a learning rate of 1e4) is reported in its row
    and under the table; the other rows are computed as usual."""
    result = compare(
        normal_normal,
        y,
        methods=["sivi", "autonormal"],
        num_steps=50,
        num_samples=100,
        nuts=nuts,
        max_plate_nesting=1,
        progress=False,
        lr={"sivi": 1e4},
    )
    failed = result.methods["sivi"]
    assert failed.failure.startswith("diverged at step") and failed.num_draws == 0
    rows = {r["method"]: r for r in result.rows()}
    assert math.isnan(rows["sivi"]["mean_error_max"]) and math.isnan(rows["sivi"]["ksd"])
    assert math.isfinite(rows["autonormal"]["mean_error_max"])
    assert "sivi: diverged at step" in result.table()
    assert [r["method"] for r in result.site_rows()].count("sivi") == 0
