"""Tests of pyro_implicit.datasets (read the shared data folder; each test takes < 1 s)."""

import math

import numpy as np
import pytest
import torch

from pyro_implicit import datasets
from pyro_implicit.datasets import (
    UCI_DATASETS,
    data_available,
    data_dir,
    gaussian_test_ll,
    load_mnist,
    load_uci,
    load_waveform,
    num_splits,
    rmse_original,
)

torch.set_num_threads(1)


needs_data = pytest.mark.skipif(not data_available(), reason="data folder not available")


@needs_data
def test_boston_split0():
    split = load_uci("boston", 0)
    assert split.x_train.shape == (455, 13)
    assert split.y_train.shape == (455,)
    assert split.x_test.shape == (51, 13)
    assert split.y_test.shape == (51,)
    assert split.x_train.dtype == torch.float64
    assert split.name == "boston" and split.split == 0
    assert float(split.y_train.mean()) == pytest.approx(0.0, abs=1e-12)
    assert float(split.y_train.std(unbiased=False)) == pytest.approx(1.0, abs=1e-12)
    assert torch.allclose(split.x_train.mean(0), torch.zeros(13, dtype=torch.float64), atol=1e-12)
    # the original targets come back with y * y_std + y_mean (house prices, 5..50)
    y = split.y_train * split.y_std + split.y_mean
    assert 5.0 <= float(y.min()) and float(y.max()) <= 50.0
    # the folder name works too, and the dtype is honoured
    assert load_uci("bostonHousing", 0, dtype=torch.float32).x_train.dtype == torch.float32


@needs_data
def test_num_splits_and_split_range():
    assert num_splits("protein") == 5
    assert num_splits("boston") == 20
    with pytest.raises(ValueError, match="splits 0..4"):
        load_uci("protein", 5)
    with pytest.raises(ValueError, match="Unknown UCI data set"):
        load_uci("iris", 0)


@needs_data
def test_constant_features_get_unit_std():
    # naval has two constant feature columns
    split = load_uci("naval", 0)
    assert int((split.x_std == 1.0).sum()) >= 2
    assert torch.isfinite(split.x_train).all() and torch.isfinite(split.x_test).all()


def test_rmse_original():
    pred = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    y = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    assert rmse_original(pred, y, 2.0) == pytest.approx(2.0 * math.sqrt(5.0 / 3.0))
    with pytest.raises(ValueError, match="shape"):
        rmse_original(pred, y[:2], 1.0)


def _log_normal(y, mu, sigma):
    return -0.5 * np.log(2 * np.pi) - np.log(sigma) - 0.5 * ((y - mu) / sigma) ** 2


def test_gaussian_test_ll_single_sample():
    f = np.array([[0.1, -0.4, 1.2]])
    y = np.array([0.0, 0.5, 1.0])
    sigma, y_std = 0.7, 3.0
    expected = np.mean(_log_normal(y, f[0], sigma)) - np.log(y_std)
    t = torch.tensor(sigma, dtype=torch.float64)
    for noise in (sigma, t, t.reshape(1), t.reshape(1, 1)):
        got = gaussian_test_ll(torch.tensor(f), noise, torch.tensor(y), y_std)
        assert got == pytest.approx(expected, rel=1e-12)
    # a 1-D f is one sample
    got = gaussian_test_ll(torch.tensor(f[0]), sigma, torch.tensor(y), y_std)
    assert got == pytest.approx(expected, rel=1e-12)


def test_gaussian_test_ll_mixture():
    from scipy.special import logsumexp

    f = np.array([[0.1, -0.4, 1.2], [0.3, 0.2, -2.0]])
    sigma = np.array([0.5, 1.5])
    y = np.array([0.0, 0.5, 1.0])
    y_std = 0.25
    dens = _log_normal(y[None, :], f, sigma[:, None])  # (S, n)
    expected = np.mean(logsumexp(dens, axis=0) - np.log(2)) - np.log(y_std)
    got = gaussian_test_ll(torch.tensor(f), torch.tensor(sigma), torch.tensor(y), y_std)
    assert got == pytest.approx(expected, rel=1e-12)
    got = gaussian_test_ll(
        torch.tensor(f, dtype=torch.float32),
        torch.tensor(sigma).unsqueeze(-1),
        torch.tensor(y),
        y_std,
    )
    assert got == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="noise_scale_norm"):
        gaussian_test_ll(torch.tensor(f), torch.ones(3), torch.tensor(y), y_std)
    with pytest.raises(ValueError, match="positive"):
        gaussian_test_ll(torch.tensor(f), torch.zeros(2), torch.tensor(y), y_std)


def test_missing_folder_names_env_var(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("PYRO_IMPLICIT_DATA", str(missing))
    with pytest.raises(FileNotFoundError, match="PYRO_IMPLICIT_DATA") as info:
        data_dir()
    assert str(missing) in str(info.value)
    # an existing folder without the needed subfolder fails the same way
    monkeypatch.setenv("PYRO_IMPLICIT_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="PYRO_IMPLICIT_DATA"):
        load_uci("boston", 0)
    with pytest.raises(FileNotFoundError, match="PYRO_IMPLICIT_DATA"):
        load_mnist()
    # a data set's folder without its files names the missing file (it said "splits 0..-1")
    (tmp_path / "uci" / UCI_DATASETS["yacht"]).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="Data file of UCI data set 'yacht' not found"):
        load_uci("yacht", 0)


def _fake_uci(root, rows):
    folder = root / "uci" / UCI_DATASETS["yacht"]
    folder.mkdir(parents=True)
    (folder / "data.txt").write_text("\n".join(rows) + "\n")
    (folder / "index_features.txt").write_text("0\n1\n")
    (folder / "index_target.txt").write_text("2\n")
    (folder / "n_splits.txt").write_text("1\n")
    (folder / "index_train_0.txt").write_text("0\n1\n2\n")
    (folder / "index_test_0.txt").write_text("3\n")
    return folder


def test_fake_dataset_and_nan(monkeypatch, tmp_path):
    good = tmp_path / "good"
    _fake_uci(good, ["1 5 1", "2 5 2", "3 5 3", "4 5 10"])
    monkeypatch.setenv("PYRO_IMPLICIT_DATA", str(good))
    split = load_uci("yacht", 0)
    # column 1 is constant: std 1, so it maps to 0 instead of NaN
    assert split.x_std.tolist() == [pytest.approx(math.sqrt(2 / 3)), 1.0]
    assert split.x_train[:, 1].tolist() == [0.0, 0.0, 0.0]
    assert split.y_mean == pytest.approx(2.0)
    assert split.y_test.tolist() == [pytest.approx((10 - 2) / math.sqrt(2 / 3))]

    bad = tmp_path / "bad"
    _fake_uci(bad, ["1 5 1", "2 nan 2", "3 5 3", "4 5 10"])
    monkeypatch.setenv("PYRO_IMPLICIT_DATA", str(bad))
    with pytest.raises(ValueError, match="'yacht'.*NaN"):
        load_uci("yacht", 0)


@needs_data
def test_mnist():
    mnist = load_mnist()
    assert mnist.x_train.shape == (8000, 784) and mnist.x_test.shape == (2000, 784)
    assert mnist.y_train.dtype == torch.int64
    assert mnist.x_train.dtype == torch.float32
    labels = torch.cat([mnist.y_train, mnist.y_test])
    assert labels.shape == (10000,)
    assert int(labels.min()) == 0 and int(labels.max()) == 9
    assert set(torch.bincount(labels).tolist()) != {0}
    assert float(mnist.x_train.min()) >= 0.0 and float(mnist.x_train.max()) == 1.0
    assert "8000 train / 2000 test" in mnist.split_description
    assert "seed 0" in mnist.split_description
    # the permutation is fixed by the seed
    again = load_mnist(num_train=100, seed=0)
    assert torch.equal(again.y_train, mnist.y_train[:100])
    other = load_mnist(num_train=100, seed=1)
    assert not torch.equal(other.y_train, again.y_train)
    with pytest.raises(ValueError, match="num_train"):
        load_mnist(num_train=10000)


@needs_data
def test_waveform():
    pytest.importorskip("scipy")
    data = load_waveform()
    assert data.x_train.shape == (400, 22) and data.y_train.shape == (400,)
    assert data.x_test.shape == (4600, 22) and data.y_test.shape == (4600,)
    assert data.beta_mcmc.shape == (250, 22)
    assert data.x_train.dtype == torch.float64
    assert set(data.y_train.unique().tolist()) == {0.0, 1.0}
    assert torch.all(data.x_train[:, 0] == 1.0)  # intercept column
    # labels are coded so that a positive logit means 1: the MCMC mean classifies well
    acc = ((data.x_test @ data.beta_mcmc.mean(0) > 0).double() == data.y_test).double().mean()
    assert float(acc) > 0.8


@needs_data
def test_spam_from_its_text_files():
    # the data folder ships it, load_sivi refused it
    from pyro_implicit.datasets import load_sivi

    data = load_sivi("spam")
    assert data.x_train.shape == (2000, 3) and data.y_train.shape == (2000,)
    assert data.x_test.shape == (1000, 3) and data.y_test.shape == (1000,)
    assert data.beta_mcmc is None and data.x_train.dtype == torch.float64
    assert set(data.y_train.unique().tolist()) == {0.0, 1.0}
    assert torch.all(data.x_train[:, 0] == 1.0)  # intercept column


def test_public_names_documented():
    for name in datasets.__all__:
        obj = getattr(datasets, name)
        if callable(obj):
            assert obj.__doc__, name
