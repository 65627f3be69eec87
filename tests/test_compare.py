"""``compare`` on a conjugate Normal-Normal model, with tiny settings."""

import math

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_implicit.diagnostics.compare import ComparisonResult, compare, latent_shapes
from pyro_implicit.diagnostics.nuts import run_nuts
from pyro_implicit.models import BUILTIN_MODELS, load_model


def normal_normal(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


@pytest.fixture(scope="module")
def y():
    return torch.linspace(-0.5, 2.5, 10, dtype=torch.float64)


@pytest.fixture
def nuts(y):
    return run_nuts(normal_normal, y, num_samples=100, warmup_steps=50, num_chains=2, seed=0,
                    max_plate_nesting=1, progress_bar=False)


def test_compare_structure(y, nuts, capsys):
    result = compare(normal_normal, y, num_steps=30, num_samples=300, nuts=nuts,
                     max_plate_nesting=1, progress=True, lr={"implicit": 0.02})
    assert isinstance(result, ComparisonResult)
    assert result.nuts is nuts
    assert list(result.methods) == ["implicit", "autonormal", "automvn"]
    rows = result.rows()
    assert [r["method"] for r in rows] == ["implicit", "autonormal", "automvn", "nuts"]
    for row in rows:
        for key, value in row.items():
            if key != "method":
                assert math.isfinite(value), (row["method"], key)
    for r in result.methods.values():
        assert r.samples["mu"].shape == (300,)  # Predictive's (S, 1) padding removed
        assert len(r.losses) == 30 and r.wall_time > 0
    assert result.methods["implicit"].lr == 0.02 and result.methods["automvn"].lr == 0.05
    text = result.table()
    assert text.splitlines()[0].split()[:2] == ["method", "mean"]
    assert "NUTS: 2 chain(s) x 100 draws" in text
    assert result.to_markdown().startswith("| method |")
    assert "implicit: step 30/30" in capsys.readouterr().err


def test_compare_is_reproducible_per_method(y, nuts):
    kw = dict(num_steps=5, num_samples=50, nuts=nuts, max_plate_nesting=1, progress=False)
    both = compare(normal_normal, y, methods=("autonormal", "implicit"), **kw)
    alone = compare(normal_normal, y, methods=("implicit",), **kw)
    # Each fit starts from the same seed, whatever ran before it.
    assert torch.equal(both.methods["implicit"].samples["mu"],
                       alone.methods["implicit"].samples["mu"])


def test_compare_rejects_unknown_method(y, nuts):
    with pytest.raises(ValueError, match="unknown method.*'svgd'.*implicit, sivi, autonormal"):
        compare(normal_normal, y, methods=("svgd",), nuts=nuts)


@pytest.mark.parametrize("name", list(BUILTIN_MODELS))
def test_builtin_models_shapes(name):
    m = load_model(name)
    assert m.name == name
    shapes = latent_shapes(m.model, *m.args, **m.kwargs)
    if name == "eight_schools":
        assert shapes == {"mu": (), "tau": (), "theta_tilde": (8,)}
    else:
        assert shapes == {"x1": (), "x2": ()}
    with pytest.raises(KeyError, match="eight_schools, banana"):
        load_model("nope")
