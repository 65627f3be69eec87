"""The command line, run in-process through ``main`` (one run as ``python -m``)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pyro_implicit.__main__ import DEFAULTS, SMOKE_CAPS, _parse, main
from pyro_implicit.diagnostics.compare import METHODS

DEFAULT_METHODS = DEFAULTS["methods"].split(",")

# az.compare in --report on arviz 0.23 with pandas 3, and Pareto-k on tiny runs
pytestmark = [
    pytest.mark.filterwarnings("ignore:Estimated shape parameter of Pareto:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*inplace keyword:DeprecationWarning"),
]

USER_MODEL = """
import dataclasses

import pyro
import pyro.distributions as dist
import torch


@dataclasses.dataclass
class Prior:  # a dataclass in the file needs the module in sys.modules
    scale: float = 10.0


def model(y):
    \"\"\"normal mean with a known scale\"\"\"
    mu = pyro.sample("mu", dist.Normal(0.0, Prior().scale))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)


def broken(y):
    raise RuntimeError("boom")


def two_observations(y):
    "   "
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(mu, 1.0), obs=y)
        pyro.sample("obs2", dist.Normal(mu, 2.0), obs=y)


def discrete(y):
    k = pyro.sample("k", dist.Bernoulli(0.5))
    with pyro.plate("data", y.shape[-1]):
        pyro.sample("obs", dist.Normal(k, 1.0), obs=y)


args = (torch.tensor([1.2, 0.4, 2.2, 1.0]),)
max_plate_nesting = 1
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_model.py"
    path.write_text(textwrap.dedent(USER_MODEL))
    return str(path)


def test_default_job_smoke_prints_table(capsys):
    dtype = torch.get_default_dtype()
    assert main(["compare", "--smoke", "--quiet", "--nuts-chains", "1"]) == 0
    out = capsys.readouterr().out
    assert "eight_schools" in out and "SMOKE RUN" in out
    table = out[out.index("method  ") :]
    for name in DEFAULT_METHODS + ["nuts"]:
        assert any(line.startswith(name + " ") for line in table.splitlines()), name
    assert "NUTS: 1 chain(s) x 20 draws" in out
    # ten steps leave Pyro's guides rough: said once, under the table, not as a warning
    assert "note: PSIS k-hat > 0.7 for" in out
    assert torch.get_default_dtype() == dtype  # main restores it


def test_no_nuts_reports_ksd_and_k_hat(user_file, tmp_path, capsys):
    """--no-nuts: no reference run; the table has the KSD and k-hat columns only, the
    report its JSON without NUTS and no pair plots (they overlay NUTS)."""
    report = tmp_path / "report"
    argv = [
        "compare",
        "--model",
        user_file + ":model",
        "--methods",
        "autonormal,kivi",
        "--smoke",
        "--quiet",
        "--no-nuts",
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no NUTS reference" in out and "No NUTS reference" in out
    header = out[out.index("method  ") :].splitlines()[0].split()
    assert header[:3] == ["method", "KSD", "k-hat"]
    data = json.loads((report / "comparison.json").read_text())
    assert data["nuts"] is None and [r["method"] for r in data["rows"]] == ["autonormal", "kivi"]
    assert data["methods"]["kivi"]["ksd"]["num_draws"] == SMOKE_CAPS["samples"]
    assert not any(name.startswith("pairs_") for name in os.listdir(report))


def test_markdown_and_options_without_subcommand(capsys):
    argv = [
        "--smoke",
        "--quiet",
        "--model",
        "banana",
        "--methods",
        "autonormal",
        "--nuts-chains",
        "1",
        "--markdown",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| method | mean err |" in out
    assert "| autonormal |" in out and "| kivi |" not in out
    assert "banana" in out


def test_user_file_and_report(user_file, tmp_path, capsys):
    report = tmp_path / "report"
    argv = [
        "compare",
        "--model",
        user_file + ":model",
        "--methods",
        "autonormal,wsvgd",
        "--smoke",
        "--nuts-chains",
        "2",
        "--report",
        str(report),
        "--seed",
        "3",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "my_model.py:model: normal mean with a known scale" in captured.out
    assert "autonormal" in captured.err  # progress on stderr
    files = set(os.listdir(report))
    assert {
        "comparison.json",
        "table.md",
        "loo.csv",
        "losses.png",
        "pairs_autonormal.png",
        "pairs_wsvgd.png",
    } <= files
    data = json.loads((report / "comparison.json").read_text())
    assert data["settings"]["seed"] == 3 and data["settings"]["max_plate_nesting"] == 1
    assert [r["method"] for r in data["rows"]] == ["autonormal", "wsvgd", "nuts"]
    assert len(data["methods"]["autonormal"]["losses"]) == SMOKE_CAPS["steps"]
    assert set(data["loo"]) == {"nuts", "autonormal", "wsvgd"}
    # LOO ranks predictive fit, not fidelity: said beside it
    assert "not fidelity to NUTS" in data["loo_note"]
    assert "not fidelity to NUTS" in (report / "table.md").read_text()
    assert data["nuts"]["num_chains"] == 2 and "mu" in data["nuts"]["sites"]
    # the printed table and the JSON hold the same numbers
    row = data["rows"][0]
    assert f"{row['energy_distance']:.3f}" in captured.out


def test_parse_defaults_and_smoke_caps():
    args = _parse(["compare", "--smoke", "--steps", "5000", "--nuts-samples", "7"])
    assert args.steps == SMOKE_CAPS["steps"]
    assert args.nuts_samples == 7
    assert args.samples == SMOKE_CAPS["samples"]
    assert args.methods == DEFAULT_METHODS
    assert _parse(["--methods", "all"]).methods == list(METHODS)


def test_an_old_method_name_runs_its_method_with_a_warning():
    with pytest.warns(FutureWarning, match="'implicit' is deprecated.*use 'kivi'"):
        assert _parse(["--methods", "implicit,sivi"]).methods == ["kivi", "sivi"]


def test_no_arguments_is_the_default_job():
    args = _parse([])
    assert args.model == "eight_schools" and args.methods == DEFAULT_METHODS
    assert args.steps == 1000 and args.nuts_chains == 2
    assert args.threads == 1 and not args.smoke and args.report is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["compare", "--methods", "kivi,nope"],
            "unknown method(s) 'nope'; choose from: " + ", ".join(METHODS),
        ),
        (["compare", "--model", "nope"], "unknown model 'nope'; choose a built-in model"),
        (["compare", "--steps", "0"], "expected an integer >= 1"),
        (["compare", "--samples", "1"], "expected an integer >= 2"),
        (["compare", "--nuts-samples", "2"], "expected an integer >= 4"),
        (["compare", "--nuts-warmup", "-1"], "expected an integer >= 0"),
        (["compare", "--seed", "-1"], "expected an integer in [0, 4294967295]"),
        (["compare", "--lr", "-1"], "expected a positive number"),
        (["compare", "--lr", "nan"], "expected a positive number"),
    ],
)
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if "--model" in argv:
        assert "eight_schools" in err and "banana" in err


@pytest.mark.parametrize(
    "suffix, message",
    [
        (":no_such_model", "defines no 'no_such_model'"),
        (":args", "is a tuple, not a model"),
        (":discrete", "NUTS cannot sample discrete site 'k'"),
        (":broken", "running the model my_model.py:broken failed: RuntimeError: boom"),
    ],
)
def test_bad_user_file_exits_2(user_file, suffix, message, capsys):
    assert main(["compare", "--smoke", "--quiet", "--model", user_file + suffix]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""  # nothing fitted, no table


def test_missing_file_exits_2(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "absent.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_python_dash_m_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "pyro_implicit", "--methods", "bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown method(s) 'bogus'" in proc.stderr and proc.stdout == ""


def test_unknown_plot_sites_exit_2_before_any_fit(user_file, capsys):
    argv = [
        "compare",
        "--smoke",
        "--quiet",
        "--model",
        user_file + ":model",
        "--report",
        "unused",
        "--plot-sites",
        "mu,nosuch",
    ]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "--plot-sites: no site or coordinate 'nosuch'" in captured.err
    assert captured.out == ""  # nothing fitted


def test_report_with_two_observed_sites_has_a_loo_table_per_site(user_file, tmp_path, capsys):
    # a blank docstring names the model "user model"
    report = tmp_path / "report"
    argv = [
        "compare",
        "--model",
        user_file + ":two_observations",
        "--methods",
        "autonormal",
        "--smoke",
        "--quiet",
        "--nuts-chains",
        "1",
        "--report",
        str(report),
    ]
    assert main(argv) == 0
    assert "two_observations: user model" in capsys.readouterr().out
    assert {"loo_obs.csv", "loo_obs2.csv"} <= set(os.listdir(report))
    data = json.loads((report / "comparison.json").read_text())
    assert set(data["loo"]) == {"obs", "obs2"}
    assert set(data["loo"]["obs"]) == {"nuts", "autonormal"}
