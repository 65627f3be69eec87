"""Loaders for the data sets used by the tests, benchmarks and tutorials.

Nothing is downloaded: every loader reads the folder returned by :func:`data_dir` (env
``PYRO_IMPLICIT_DATA``, default ``../shared/data`` beside the project checkout). The layout
of that folder is described in its ``README.md``.

* UCI regression with the standard splits of Hernandez-Lobato & Adams (2015):
  :func:`load_uci`, :func:`num_splits`, and the two metrics of that protocol,
  :func:`rmse_original` and :func:`gaussian_test_ll`, both in the ORIGINAL target units.
* The MNIST test set (10,000 images) with a fixed, seeded train/test split:
  :func:`load_mnist`.
* The Bayesian logistic regression sets of the SIVI paper with their reference posterior
  draws: :func:`load_sivi`, :func:`load_waveform`.

A data file that is malformed (NaN values, bad indices, missing fields) raises
:class:`~pyro_implicit.errors.DataError` (a ``ValueError``).
"""

import functools
import gzip
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import DataError

__all__ = [
    "DATA_ENV_VAR",
    "UCI_DATASETS",
    "MNISTSplit",
    "SIVIData",
    "UCISplit",
    "data_dir",
    "gaussian_test_ll",
    "load_mnist",
    "load_sivi",
    "load_uci",
    "load_waveform",
    "num_splits",
    "rmse_original",
]

#: environment variable naming the data folder
DATA_ENV_VAR = "PYRO_IMPLICIT_DATA"

#: short name -> folder under ``uci/``
UCI_DATASETS = {
    "boston": "bostonHousing",
    "concrete": "concrete",
    "energy": "energy",
    "kin8nm": "kin8nm",
    "naval": "naval-propulsion-plant",
    "power": "power-plant",
    "protein": "protein-tertiary-structure",
    "wine": "wine-quality-red",
    "yacht": "yacht",
}


# ----------------------------------------------------------------------------------------
# data folder
# ----------------------------------------------------------------------------------------


def _missing(path, what):
    return FileNotFoundError(
        f"{what} not found at {path}. Set the environment variable {DATA_ENV_VAR} to the data "
        f"folder (the one holding uci/, mnist/ and sivi/; see its README.md)."
    )


def data_available():
    """Whether the data folder (see :func:`data_dir`) exists; for skipping what needs it.

    :rtype: bool
    """
    try:
        data_dir()
    except FileNotFoundError:
        return False
    return True


def data_dir():
    """The data folder.

    ``$PYRO_IMPLICIT_DATA`` if that variable is set and non-empty, else ``../shared/data``
    beside the repository root (the parent of the ``pyro_implicit`` package folder).

    :returns: the folder, as an absolute path.
    :rtype: pathlib.Path
    :raises FileNotFoundError: if the folder does not exist; the message names
        ``PYRO_IMPLICIT_DATA`` and the path tried.
    """
    env = os.environ.get(DATA_ENV_VAR)
    if env:
        path = Path(env).expanduser()
    else:
        repo_root = Path(__file__).resolve().parent.parent
        path = repo_root.parent / "shared" / "data"
    path = path.resolve()
    if not path.is_dir():
        raise _missing(path, "Data folder")
    return path


def _data_path(*parts, what=None):
    """A file or folder inside :func:`data_dir`, raising a helpful error if it is missing."""
    path = data_dir().joinpath(*parts)
    if not path.exists():
        raise _missing(path, what or "/".join(parts))
    return path


# ----------------------------------------------------------------------------------------
# UCI regression
# ----------------------------------------------------------------------------------------


@dataclass
class UCISplit:
    """One train/test split of a UCI regression data set, normalised with the training split.

    Features and target are standardised with the training split's mean and standard
    deviation (``ddof=0``); a feature that is constant on the training split gets standard
    deviation 1, so it maps to 0 instead of NaN. Predictions made in these normalised units
    are brought back to the original units by ``y * y_std + y_mean``.

    :ivar x_train: ``(n_train, d)`` normalised features.
    :ivar y_train: ``(n_train,)`` normalised targets.
    :ivar x_test: ``(n_test, d)`` features, normalised with the training statistics.
    :ivar y_test: ``(n_test,)`` targets, normalised with the training statistics.
    :ivar y_mean: training mean of the target (original units).
    :ivar y_std: training standard deviation of the target (original units).
    :ivar x_mean: ``(d,)`` training means of the features.
    :ivar x_std: ``(d,)`` training standard deviations of the features (1 where constant).
    :ivar name: short data set name (a key of :data:`UCI_DATASETS`).
    :ivar split: split index.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    y_mean: float
    y_std: float
    x_mean: torch.Tensor
    x_std: torch.Tensor
    name: str
    split: int

    @property
    def n_train(self):
        """Number of training points."""
        return self.x_train.shape[0]

    @property
    def n_test(self):
        """Number of test points."""
        return self.x_test.shape[0]

    @property
    def in_dim(self):
        """Number of features."""
        return self.x_train.shape[1]


def _uci_name(name):
    """Short name of a UCI data set given its short name or its folder name."""
    if name in UCI_DATASETS:
        return name
    for short, folder in UCI_DATASETS.items():
        if name == folder:
            return short
    raise ValueError(f"Unknown UCI data set {name!r}; expected one of {sorted(UCI_DATASETS)}.")


def _uci_folder(name):
    short = _uci_name(name)
    return _data_path("uci", UCI_DATASETS[short], what=f"UCI data set {short!r}")


def num_splits(name):
    """Number of standard train/test splits of a UCI data set (20; 5 for protein).

    :param str name: short name (a key of :data:`UCI_DATASETS`) or folder name.
    :rtype: int
    """
    folder = _uci_folder(name)
    n_file = folder / "n_splits.txt"
    if n_file.exists():
        return int(n_file.read_text().split()[0])
    # older copies of the split files come without n_splits.txt: count the index files
    return len(list(folder.glob("index_train_*.txt")))


@functools.lru_cache(maxsize=4)
def _read_table(path, mtime_ns, size):
    # mtime and size are part of the cache key so an edited file is read again
    del mtime_ns, size
    array = np.loadtxt(path, dtype=np.float64, ndmin=2)
    array.flags.writeable = False
    return array


def _read_cached(path):
    stat = path.stat()
    return _read_table(str(path), stat.st_mtime_ns, stat.st_size)


def _read_indices(path, name):
    if not path.exists():
        raise _missing(path, f"Index file of UCI data set {name!r}")
    idx = np.loadtxt(path, dtype=np.float64, ndmin=1)
    if not np.all(idx == np.round(idx)):
        raise DataError(f"UCI data set {name!r}: {path.name} holds non-integer indices.")
    return idx.astype(np.int64)


def _standardise(train, test):
    mean = train.mean(axis=0)
    std = train.std(axis=0)
    # a constant column (naval has two) would divide by zero; compare with the scale of the
    # mean too, because float rounding can leave a tiny nonzero std on a constant column
    constant = std <= 1e-12 * np.maximum(1.0, np.abs(mean))
    std = np.where(constant, 1.0, std)
    return (train - mean) / std, (test - mean) / std, mean, std


def load_uci(name, split, dtype=torch.float64):
    """Load one standard split of a UCI regression data set, normalised with its training part.

    Reads ``data.txt``, ``index_features.txt``, ``index_target.txt``,
    ``index_train_<split>.txt`` and ``index_test_<split>.txt`` (0-based indices) from
    ``<data_dir>/uci/<folder>``.

    :param str name: short name (a key of :data:`UCI_DATASETS`) or folder name.
    :param int split: split index, ``0 <= split < num_splits(name)``.
    :param torch.dtype dtype: dtype of the returned tensors.
    :rtype: UCISplit
    :raises ValueError: for an unknown name, a split out of range, NaN/inf in the data or
        indices out of range.
    :raises FileNotFoundError: if the data folder or a file is missing.
    """
    short = _uci_name(name)
    folder = _uci_folder(short)
    if not isinstance(split, (int, np.integer)) or isinstance(split, bool):
        raise TypeError(f"split must be an int, got {type(split).__name__}.")
    # the files first: an empty folder has no splits, and "splits 0..-1" named no file
    data_file = folder / "data.txt"
    if not data_file.exists():
        raise _missing(data_file, f"Data file of UCI data set {short!r}")
    n_splits = num_splits(short)
    if n_splits == 0:
        raise _missing(folder / "index_train_0.txt", f"Split files of UCI data set {short!r}")
    if not 0 <= split < n_splits:
        raise ValueError(
            f"UCI data set {short!r} has splits 0..{n_splits - 1}; split {split} requested."
        )
    data = _read_cached(data_file)
    if not np.isfinite(data).all():
        bad = np.argwhere(~np.isfinite(data))[0]
        raise DataError(
            f"UCI data set {short!r}: {data_file} holds NaN or inf values "
            f"(first at row {bad[0]}, column {bad[1]})."
        )
    features = _read_indices(folder / "index_features.txt", short)
    target = _read_indices(folder / "index_target.txt", short)
    if target.size != 1:
        raise DataError(f"UCI data set {short!r}: expected one target column, got {target}.")
    train = _read_indices(folder / f"index_train_{split}.txt", short)
    test = _read_indices(folder / f"index_test_{split}.txt", short)
    n_rows, n_cols = data.shape
    for what, idx, bound in [
        ("feature", features, n_cols),
        ("target", target, n_cols),
        ("train", train, n_rows),
        ("test", test, n_rows),
    ]:
        if idx.size and (idx.min() < 0 or idx.max() >= bound):
            raise DataError(
                f"UCI data set {short!r}: {what} indices out of range [0, {bound}) in split "
                f"{split}."
            )
    if train.size == 0 or test.size == 0:
        raise DataError(f"UCI data set {short!r}: split {split} has an empty train or test set.")

    x = data[:, features]
    y = data[:, target[0]]
    x_train, x_test, x_mean, x_std = _standardise(x[train], x[test])
    y_train, y_test, y_mean, y_std = _standardise(y[train], y[test])

    def t(a):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return UCISplit(
        x_train=t(x_train),
        y_train=t(y_train),
        x_test=t(x_test),
        y_test=t(y_test),
        y_mean=float(y_mean),
        y_std=float(y_std),
        x_mean=t(x_mean),
        x_std=t(x_std),
        name=short,
        split=int(split),
    )


def rmse_original(pred_mean_norm, y_norm, y_std):
    """Root mean squared error in the original target units.

    :param torch.Tensor pred_mean_norm: ``(n,)`` predictive means in normalised units.
    :param torch.Tensor y_norm: ``(n,)`` targets in normalised units.
    :param float y_std: the training standard deviation of the target.
    :returns: ``y_std * sqrt(mean((pred - y)^2))``.
    :rtype: float
    """
    pred = torch.as_tensor(pred_mean_norm, dtype=torch.float64)
    y = torch.as_tensor(y_norm, dtype=torch.float64)
    if pred.shape != y.shape or y.dim() != 1:
        raise ValueError(
            f"pred_mean_norm and y_norm must both have shape (n,); got {tuple(pred.shape)} "
            f"and {tuple(y.shape)}."
        )
    return float((pred - y).pow(2).mean().sqrt()) * float(y_std)


def gaussian_test_ll(f_samples_norm, noise_scale_norm, y_norm, y_std):
    """Mean per-point predictive log-likelihood in the original target units.

    For each test point, ``log (1/S) sum_s N(y | f_s, sigma_s^2)`` is computed in normalised
    units with ``logsumexp``; ``log(y_std)`` is then subtracted (the Jacobian of
    ``y -> (y - y_mean) / y_std``), and the result is averaged over the test points. This
    is the test log-likelihood of the Hernandez-Lobato & Adams (2015) protocol. Computed in
    float64 whatever the input dtype.

    :param torch.Tensor f_samples_norm: ``(S, n)`` function values (normalised units), one row
        per posterior sample; a ``(n,)`` tensor counts as ``S = 1``.
    :param noise_scale_norm: observation noise standard deviation (normalised units) per
        sample: shape ``(S,)``, ``(S, 1)``, a scalar tensor or a float.
    :param torch.Tensor y_norm: ``(n,)`` test targets (normalised units).
    :param float y_std: the training standard deviation of the target.
    :rtype: float
    """
    f = torch.as_tensor(f_samples_norm, dtype=torch.float64)
    y = torch.as_tensor(y_norm, dtype=torch.float64)
    if y.dim() != 1:
        raise ValueError(f"y_norm must have shape (n,), got {tuple(y.shape)}.")
    if f.dim() == 1:
        f = f.unsqueeze(0)
    if f.dim() != 2 or f.shape[1] != y.shape[0]:
        raise ValueError(
            f"f_samples_norm must have shape (S, n) with n = {y.shape[0]}, got "
            f"{tuple(torch.as_tensor(f_samples_norm).shape)}."
        )
    num_samples = f.shape[0]
    sigma = torch.as_tensor(noise_scale_norm, dtype=torch.float64)
    if sigma.dim() == 2 and sigma.shape[1] == 1:
        sigma = sigma.squeeze(1)
    if sigma.dim() == 0:
        sigma = sigma.expand(num_samples)
    if sigma.shape != (num_samples,):
        raise ValueError(
            f"noise_scale_norm must be a scalar or have shape (S,) or (S, 1) with S = "
            f"{num_samples}, got {tuple(torch.as_tensor(noise_scale_norm).shape)}."
        )
    if not bool((sigma > 0).all()):
        raise ValueError("noise_scale_norm must be positive.")
    sigma = sigma.unsqueeze(1)
    log_density = (
        -0.5 * math.log(2 * math.pi) - sigma.log() - 0.5 * ((y - f) / sigma).pow(2)
    )  # (S, n)
    per_point = torch.logsumexp(log_density, dim=0) - math.log(num_samples) - math.log(y_std)
    return float(per_point.mean())


# ----------------------------------------------------------------------------------------
# MNIST
# ----------------------------------------------------------------------------------------


@dataclass
class MNISTSplit:
    """A fixed train/test split of the 10,000 MNIST test images.

    :ivar x_train: ``(num_train, 784)`` pixels in ``[0, 1]``.
    :ivar y_train: ``(num_train,)`` int64 labels in ``0..9``.
    :ivar x_test: ``(10000 - num_train, 784)`` pixels in ``[0, 1]``.
    :ivar y_test: ``(10000 - num_train,)`` int64 labels.
    :ivar split_description: how the split was made; print it next to every number.
    :ivar seed: seed of the permutation.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    split_description: str
    seed: int


def _read_idx(path, magic, ndim):
    """Parse a gzipped idx file (big-endian header: magic number, then one int32 per dim)."""
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    header = np.frombuffer(raw, dtype=">i4", count=1 + ndim)
    if header[0] != magic:
        raise DataError(f"{path} is not an idx file of the expected kind (magic {header[0]}).")
    dims = tuple(int(d) for d in header[1:])
    values = np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + ndim))
    if values.size != int(np.prod(dims)):
        raise DataError(f"{path}: {values.size} values for a header of shape {dims}.")
    return values.reshape(dims)


@functools.lru_cache(maxsize=1)
def _mnist_arrays(folder):
    folder = Path(folder)
    images = _read_idx(folder / "t10k-images-idx3-ubyte.gz", magic=2051, ndim=3)
    labels = _read_idx(folder / "t10k-labels-idx1-ubyte.gz", magic=2049, ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise DataError(f"MNIST: {images.shape[0]} images but {labels.shape[0]} labels.")
    return images, labels


def load_mnist(num_train=8000, seed=0, dtype=torch.float32):
    """The MNIST test set (10,000 images) split into a training and a test part.

    Only the 10k test images are available locally (see the data README), so a fixed
    permutation from ``numpy.random.default_rng(seed)`` makes the split: the first
    ``num_train`` permuted images train, the rest test. State ``split_description`` next to
    any number computed on it.

    :param int num_train: number of training images, ``0 < num_train < 10000``.
    :param int seed: seed of the permutation.
    :param torch.dtype dtype: dtype of the pixel tensors (labels are int64).
    :rtype: MNISTSplit
    """
    folder = _data_path("mnist", what="MNIST folder")
    for fname in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        if not (folder / fname).exists():
            raise _missing(folder / fname, "MNIST file")
    images, labels = _mnist_arrays(str(folder))
    n = images.shape[0]
    if not 0 < num_train < n:
        raise ValueError(f"num_train must be in 1..{n - 1}, got {num_train}.")
    perm = np.random.default_rng(seed).permutation(n)
    x = torch.as_tensor(images.reshape(n, -1)[perm], dtype=dtype) / 255.0
    y = torch.as_tensor(labels[perm].astype(np.int64))
    description = f"MNIST t10k, {num_train} train / {n - num_train} test, permutation seed {seed}"
    return MNISTSplit(
        x_train=x[:num_train],
        y_train=y[:num_train],
        x_test=x[num_train:],
        y_test=y[num_train:],
        split_description=description,
        seed=seed,
    )


# ----------------------------------------------------------------------------------------
# SIVI logistic regression sets
# ----------------------------------------------------------------------------------------


@dataclass
class SIVIData:
    """A Bayesian logistic regression data set of the SIVI paper with reference posteriors.

    The first column of ``x`` is the intercept. Labels are 0/1 floats (1 where the logit
    ``x @ beta`` is positive).

    :ivar x_train: ``(n_train, d)`` features.
    :ivar y_train: ``(n_train,)`` labels in ``{0., 1.}``.
    :ivar x_test: ``(n_test, d)`` features.
    :ivar y_test: ``(n_test,)`` labels in ``{0., 1.}``.
    :ivar beta_mcmc: ``(250, d)`` Polya-Gamma Gibbs draws of the coefficients (the
        reference; ``None`` for spam, which ships without one).
    :ivar beta_vb: ``(250, d)`` draws of the paper's mean-field VB posterior (or ``None``).
    :ivar mu_beta: ``(d,)`` mean of that VB posterior (or ``None``).
    :ivar sig_beta: ``(d, d)`` covariance of that VB posterior (or ``None``).
    :ivar name: data set name.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    beta_mcmc: torch.Tensor
    beta_vb: torch.Tensor
    mu_beta: torch.Tensor
    sig_beta: torch.Tensor
    name: str


_SIVI_SETS = ("waveform", "nodal", "spam")


def load_sivi(name, dtype=torch.float64):
    """Load a Bayesian logistic regression set of the SIVI paper from ``sivi/<name>.mat``.

    Needs scipy (a dev dependency) to read the MATLAB file.

    :param str name: ``"waveform"`` (400 train / 4600 test, 22 coefficients), ``"nodal"``
        (25 / 28, 6 coefficients), or ``"spam"`` (2000 / 1000, 3 coefficients; from the
        text files ``sivi/spam_{xtr,ytr,xte,yte}.txt`` of the paper's code, without
        reference posteriors).
    :param torch.dtype dtype: dtype of all returned tensors.
    :rtype: SIVIData
    """
    if name not in _SIVI_SETS:
        raise ValueError(f"Unknown SIVI data set {name!r}; expected one of {_SIVI_SETS}.")
    if name == "spam":
        return _load_spam(dtype)
    try:
        from scipy.io import loadmat
    except ImportError as e:  # pragma: no cover - scipy is installed with the dev extra
        raise ImportError(
            f"Reading sivi/{name}.mat needs scipy; install it with "
            "`pip install scipy` or `pip install pyro-implicit[dev]`."
        ) from e
    path = _data_path("sivi", f"{name}.mat", what=f"SIVI data set {name!r}")
    mat = loadmat(str(path))
    required = ("X_train", "y_train", "X_test", "y_test", "BetaMCMC", "Beta_VB_sample")
    missing = [k for k in required + ("mu_Beta", "Sig_Beta") if k not in mat]
    if missing:
        raise DataError(f"{path} lacks the fields {missing}.")

    def t(a):
        return torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=dtype)

    x_train, x_test = t(mat["X_train"]), t(mat["X_test"])
    # labels and the mean are stored as MATLAB row/column vectors; draws as (d, num_draws)
    data = SIVIData(
        x_train=x_train,
        y_train=t(mat["y_train"]).reshape(-1),
        x_test=x_test,
        y_test=t(mat["y_test"]).reshape(-1),
        beta_mcmc=t(mat["BetaMCMC"]).T.contiguous(),
        beta_vb=t(mat["Beta_VB_sample"]).T.contiguous(),
        mu_beta=t(mat["mu_Beta"]).reshape(-1),
        sig_beta=t(mat["Sig_Beta"]),
        name=name,
    )
    d = x_train.shape[1]
    if data.y_train.shape[0] != x_train.shape[0] or data.y_test.shape[0] != x_test.shape[0]:
        raise DataError(f"{path}: the numbers of labels and feature rows differ.")
    if data.beta_mcmc.shape[1] != d or data.mu_beta.shape[0] != d:
        raise DataError(f"{path}: coefficient draws do not have {d} coefficients.")
    for field in (data.x_train, data.x_test, data.beta_mcmc):
        if not bool(torch.isfinite(field).all()):
            raise ValueError(f"SIVI data set {name!r} holds NaN or inf values.")
    return data


def _load_spam(dtype):
    """The spam set as text files (no reference posteriors)."""
    parts = {}
    for key in ("xtr", "ytr", "xte", "yte"):
        path = _data_path("sivi", f"spam_{key}.txt", what="SIVI data set 'spam'")
        parts[key] = torch.as_tensor(_read_cached(path).copy(), dtype=dtype)
    x_train, x_test = parts["xtr"].reshape(parts["xtr"].shape[0], -1), parts["xte"]
    x_test = x_test.reshape(x_test.shape[0], -1)
    data = SIVIData(
        x_train=x_train,
        y_train=parts["ytr"].reshape(-1),
        x_test=x_test,
        y_test=parts["yte"].reshape(-1),
        beta_mcmc=None,
        beta_vb=None,
        mu_beta=None,
        sig_beta=None,
        name="spam",
    )
    if data.y_train.shape[0] != x_train.shape[0] or data.y_test.shape[0] != x_test.shape[0]:
        raise DataError("SIVI data set 'spam': the numbers of labels and feature rows differ.")
    for field in (x_train, x_test, data.y_train, data.y_test):
        if not bool(torch.isfinite(field).all()):
            raise DataError("SIVI data set 'spam' holds NaN or inf values.")
    return data


def load_waveform(dtype=torch.float64):
    """The waveform set of the SIVI paper: ``load_sivi("waveform")``.

    Shapes: ``x_train`` (400, 22), ``y_train`` (400,), ``x_test`` (4600, 22), ``y_test``
    (4600,), ``beta_mcmc`` (250, 22).

    :param torch.dtype dtype: dtype of all returned tensors.
    :rtype: SIVIData
    """
    return load_sivi("waveform", dtype=dtype)
