"""Smoke test of the UCI benchmark runner (benchmarks/uci.py), run in-process."""

import json
import math

import pytest
import torch

from pyro_implicit.datasets import data_available

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runner(load_benchmark):
    return load_benchmark("uci")


def test_parse_splits(runner):
    assert runner.parse_splits("all") is None
    assert runner.parse_splits("0-3,7") == [0, 1, 2, 3, 7]
    with pytest.raises(Exception, match="invalid split selection"):
        runner.parse_splits("3-1")


def test_defaults_follow_kivi(runner):
    assert runner.DEFAULTS["boston"]["epochs"] == 3000
    assert runner.DEFAULTS["kin8nm"]["epochs"] == 500
    assert runner.DEFAULTS["protein"]["hidden_dims"] == [100]
    assert runner.DEFAULTS["wine"]["batch_size"] == 100
    assert "map" in runner.METHODS
    # the paper's explicit Gamma q for the noise precision (App. E)
    assert runner.METHOD_DEFAULTS["kivi"]("boston") == {"precision_q": "gamma"}


def test_method_names_are_the_registrys(runner):
    # the runner resolves names through the method registry: an old name is its new one
    with pytest.warns(FutureWarning, match="'implicit' is deprecated.*use 'kivi'"):
        assert runner.build_parser().parse_args(["--method", "implicit"]).method == "kivi"


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_smoke_run_boston_map(runner, tmp_path, capsys):
    out = tmp_path / "uci_map.json"
    results = runner.main(
        ["--datasets", "boston", "--method", "map", "--smoke", "--out", str(out), "--markdown"]
    )
    record = results["datasets"]["boston"]
    assert len(record["splits"]) == 1
    split = record["splits"][0]
    assert split["split"] == 0 and split["n_test"] == 51
    assert math.isfinite(split["rmse"]) and split["rmse"] > 0
    assert math.isfinite(split["ll"])
    assert record["config"]["epochs"] == 2

    saved = json.loads(out.read_text())
    assert saved["method"] == "map" and saved["smoke"] is True
    assert "--smoke" in saved["command"]
    assert saved["datasets"]["boston"]["splits"][0]["rmse"] == pytest.approx(split["rmse"])

    printed = capsys.readouterr().out
    assert "boston  split  0" in printed
    assert "| boston | 455 | 1 |" in printed


def test_fpovi_defaults_follow_the_paper_and_leave_kivi_alone(runner):
    boston = runner.METHOD_DEFAULTS["fsvgd"]("boston")
    power = runner.METHOD_DEFAULTS["fsvgd"]("power")
    assert (boston["batch_size"], boston["epochs"]) == (100, 500)
    assert (power["batch_size"], power["epochs"]) == (1000, 1000)
    assert boston["num_particles"] == 20 and boston["lr"] == 4e-3
    assert boston["noise_std_prior"] == [1.0, 0.1] and boston["precision_prior"] is None
    # KIVI keeps DEFAULTS' training settings; it only adds its precision's q
    assert set(runner.METHOD_DEFAULTS["kivi"]("boston")) == {"precision_q"}
    assert "map" not in runner.METHOD_DEFAULTS


@pytest.mark.skipif(not data_available(), reason="data folder not available")
@pytest.mark.parametrize("method", ["fsvgd", "wsvgd"])
def test_smoke_run_boston_particles(runner, tmp_path, method):
    out = tmp_path / f"uci_{method}.json"
    results = runner.main(
        ["--datasets", "boston", "--method", method, "--smoke", "--quiet", "--out", str(out)]
    )
    record = results["datasets"]["boston"]
    split = record["splits"][0]
    assert math.isfinite(split["rmse"]) and math.isfinite(split["ll"])
    assert record["config"]["num_particles"] == 20 and record["config"]["epochs"] == 2
    # --resume keeps the split and runs nothing new
    again = runner.main(
        [
            "--datasets",
            "boston",
            "--method",
            method,
            "--smoke",
            "--quiet",
            "--resume",
            "--out",
            str(out),
        ]
    )
    assert again["datasets"]["boston"]["splits"][0]["rmse"] == pytest.approx(split["rmse"])
    assert split["seed"] == 0 and "commit" in split  # per-split provenance
    # a resumed file refuses another method (f-SVGD and w-SVGD share a configuration),
    # seed or dtype
    other = "wsvgd" if method == "fsvgd" else "fsvgd"
    for change in (
        ["--method", other],
        ["--method", method, "--seed", "1"],
        ["--method", method, "--dtype", "float64"],
    ):
        with pytest.raises(SystemExit, match="--resume: .* holds runs with"):
            runner.main(
                ["--datasets", "boston", "--smoke", "--quiet", "--resume", "--out", str(out)]
                + change
            )


def test_livi_defaults(runner):
    det = runner.METHOD_DEFAULTS["livi"]("boston")
    svd = runner.METHOD_DEFAULTS["livi_svd"]("naval")
    assert det["bound"] == "det" and svd["bound"] == "svd"
    assert det["learn_noise"] and det["precision_prior"] is None and det["hidden_dims"] == [50]
    # the paper follows KIVI's UCI set-up: KIVI's epochs
    assert det["epochs"] == 3000 and svd["epochs"] == 500


@pytest.mark.skipif(not data_available(), reason="data folder not available")
@pytest.mark.parametrize("method", ["livi", "livi_svd"])
def test_smoke_run_boston_livi(runner, tmp_path, method):
    out = tmp_path / f"uci_{method}.json"
    results = runner.main(
        ["--datasets", "boston", "--method", method, "--smoke", "--quiet", "--out", str(out)]
    )
    split = results["datasets"]["boston"]["splits"][0]
    assert math.isfinite(split["rmse"]) and math.isfinite(split["ll"])
    assert split["num_samples"] == 4


def test_set_refuses_a_setting_the_method_does_not_read(runner, tmp_path):
    argv = ["--datasets", "boston", "--smoke", "--quiet", "--out", str(tmp_path / "x.json")]
    # a misspelt key would otherwise run with the default
    with pytest.raises(SystemExit, match="no setting epoch;"):
        runner.main(argv + ["--method", "livi", "--set", "epoch=10"])
    # LIVI's tempering weights belong to LIVI only
    with pytest.raises(SystemExit, match="'kivi' has no setting entropy_weight"):
        runner.main(argv + ["--method", "kivi", "--set", "entropy_weight=0.5"])
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_livi_tempering_settings_reach_the_elbo(runner, tmp_path, monkeypatch):
    from pyro_implicit import LIVI_ELBO

    seen = []
    init = LIVI_ELBO.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append((self.entropy_weight, self.prior_weight))

    monkeypatch.setattr(LIVI_ELBO, "__init__", spy)
    argv = ["--datasets", "boston", "--method", "livi", "--smoke", "--quiet"]
    runner.main(argv + ["--out", str(tmp_path / "a.json")])
    with pytest.warns(UserWarning, match="not the paper's ELBO"):
        runner.main(
            argv
            + [
                "--set",
                "prior_weight=0.1",
                "--set",
                "entropy_weight=2",
                "--out",
                str(tmp_path / "b.json"),
            ]
        )
    assert seen == [(1.0, 1.0), (2.0, 0.1)]


@pytest.fixture(scope="module")
def reporter(load_benchmark):
    return load_benchmark("uci_report")


def _fake_run(rmses, first=0, config=None, method="kivi", seed=0):
    splits = [
        {"split": first + i, "rmse": r, "ll": None if r is None else -r, "seconds": 1.0}
        for i, r in enumerate(rmses)
    ]
    config = {"epochs": 1} if config is None else config
    return {
        "command": "python benchmarks/uci.py ...",
        "started": "now",
        "resumed": [],
        "versions": {"torch": "t", "pyro": "p"},
        "threads": 1,
        "dtype": "float32",
        "method": method,
        "seed": seed,
        "smoke": False,
        "datasets": {"boston": {"splits": splits, "config": config}},
    }


def test_report_statistics_and_section_update(reporter, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_fake_run([1.0, 2.0, 3.0])))
    text = reporter.report([str(run)], "t", paper="kivi")
    # mean 2, sd 1, se 1/sqrt(3), and the paper's boston row beside it
    assert "| boston | 3 | 2.000 ± 0.577 | 1.000 | -2.000 ± 0.577 | 1.000 | 1 |" in text
    assert "2.798 ± 0.173" in text

    out = tmp_path / "report.md"
    out.write_text("# Title\n\nProse that must survive.\n")
    reporter.main([str(run), "--out", str(out), "--section", "a"])
    run.write_text(json.dumps(_fake_run([4.0, 6.0])))
    reporter.main([str(run), "--out", str(out), "--section", "a"])
    document = out.read_text()
    assert document.startswith("# Title\n\nProse that must survive.\n")
    assert document.count("<!-- uci_report a -->") == 1
    assert "| boston | 2 | 5.000 ± 1.000 |" in document and "| boston | 3 |" not in document
    assert "\n## UCI regression: results" in document
    # a result file not written yet: the section says so instead of keeping stale numbers
    missing = str(tmp_path / "not_yet.json")
    reporter.main([missing, "--missing-ok", "--out", str(out), "--section", "a"])
    assert "No split has been run yet." in out.read_text() and "| boston |" not in out.read_text()
    with pytest.raises(ValueError, match="no end marker"):
        reporter.replace_section("<!-- uci_report a -->", "a", "x")


def test_report_merges_a_data_set_split_over_files(reporter, tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_fake_run([1.0, 2.0])))
    second.write_text(json.dumps(_fake_run([3.0], first=2)))
    text = reporter.report([str(first), str(second)], "t")
    # one row over the three splits: mean 2, sd 1
    assert "| boston | 3 | 2.000 ± 0.577 | 1.000 |" in text and text.count("| boston |") == 1
    assert "splits [0, 1, 2]" in text
    second.write_text(json.dumps(_fake_run([3.0], first=1)))
    with pytest.raises(ValueError, match=r"splits \[1\] appear in"):
        reporter.report([str(first), str(second)], "t")
    second.write_text(json.dumps(_fake_run([3.0], first=2, config={"epochs": 2})))
    with pytest.raises(ValueError, match="different configurations"):
        reporter.report([str(first), str(second)], "t")
    # the same configuration from another method (f-SVGD and w-SVGD share theirs) or seed
    for other in ({"method": "wsvgd"}, {"seed": 1}):
        second.write_text(json.dumps(_fake_run([3.0], first=2, **other)))
        with pytest.raises(ValueError, match="differ in their run settings"):
            reporter.report([str(first), str(second)], "t")


def test_report_refuses_to_mix_commits_unless_told_and_then_says_so(reporter, tmp_path):
    def run_at(commit, first):
        run = _fake_run([1.0], first=first)
        run["datasets"]["boston"]["splits"][0]["commit"] = commit
        return json.dumps(run)

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(run_at("aaaaaaa", 0))
    second.write_text(run_at("aaaaaaa", 1))
    text = reporter.report([str(first), str(second)], "t")
    assert "merges runs" not in text and "(commit aaaaaaa," in text
    second.write_text(run_at("bbbbbbb", 1))
    with pytest.raises(ValueError, match="2 commits .*--mixed-commits"):
        reporter.report([str(first), str(second)], "t")
    text = reporter.report([str(first), str(second)], "t", mixed_commits=True)
    assert "**This table merges runs from 2 commits**" in text
    assert "aaaaaaa: boston; bbbbbbb: boston" in text
    # a split from before commits were recorded counts as another commit
    second.write_text(json.dumps(_fake_run([3.0], first=1)))
    with pytest.raises(ValueError, match="not recorded: boston"):
        reporter.report([str(first), str(second)], "t")
    with pytest.raises(SystemExit):
        reporter.main([str(first), str(second)])


def test_report_refuses_another_methods_paper_and_counts_failed_splits(reporter, tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_fake_run([1.0, 2.0], method="map")))
    with pytest.raises(ValueError, match="--paper kivi compares with the paper's 'kivi' rows"):
        reporter.report([str(run)], "t", paper="kivi")
    run.write_text(json.dumps(_fake_run([1.0, None, 3.0])))
    text = reporter.report([str(run)], "t")
    assert "| boston | 2 (1 failed) | 2.000 ± 1.000 |" in text


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_kivi_collapse_smoke(capsys, load_benchmark):
    module = load_benchmark("kivi_collapse")
    module.main(["--dataset", "yacht", "--steps", "2", "--every", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and "precision median" in lines[-1] and "'layer0'" in lines[-1]


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_smoke_run_kivi_with_the_papers_gamma_precision(runner, tmp_path):
    out = tmp_path / "uci_kivi_gamma.json"
    argv = ["--datasets", "boston", "--method", "kivi", "--smoke", "--quiet", "--out", str(out)]
    results = runner.main(argv + ["--set", 'precision_q="gamma"'])
    record = results["datasets"]["boston"]
    assert record["config"]["precision_q"] == "gamma"
    split = record["splits"][0]
    assert math.isfinite(split["rmse"]) and math.isfinite(split["ll"])
    with pytest.raises(ValueError, match="precision_q must be"):
        runner.main(argv + ["--set", 'precision_q="beta"', "--out", str(tmp_path / "x.json")])


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_spread_benchmark_smoke(load_benchmark):
    module = load_benchmark("uci_spread")
    out = module.main(["--dataset", "yacht", "--methods", "wsvgd", "--epochs", "1"])
    row = out["wsvgd"]
    assert row["f_spread_mean"] > 0 and row["noise_std_min"] <= row["noise_std_max"]


@pytest.mark.skipif(not data_available(), reason="data folder not available")
def test_kivi_spikes_benchmark_smoke(tmp_path, load_benchmark):
    module = load_benchmark("kivi_spikes")
    out = tmp_path / "spikes.json"
    result = module.main(
        [
            "--dataset",
            "yacht",
            "--split",
            "0",
            "--every",
            "2",
            "--epochs",
            "1",
            "--clip-norms",
            "10",
            "--out",
            str(out),
        ]
    )
    assert set(result["runs"]) == {"adam", "clipped_adam_10"}
    run = result["runs"]["adam"]
    assert run["steps"] == [2, 3]  # every 2 steps and the last of 3 (277 points, batch 100)
    assert len(run["test_rmse"]) == 2 and math.isfinite(run["rmse"])
    # gradient sizes from the read-only hooks: one per evaluation, a share in [0, 1]
    assert len(run["grad_max"]) == 2 and run["grad_max"][0] > 0
    assert all(0 <= s <= 1 for s in run["steps_clamped"] + run["elements_clamped"])
    assert json.loads(out.read_text())["split"] == 0
