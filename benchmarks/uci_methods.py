"""The UCI benchmark's methods (``benchmarks/uci.py``): the BNN model, the papers' fits
(MAP, KIVI, f-SVGD, w-SVGD, LIVI) and :data:`METHODS`, the runner's names for them.

A method is a function ``fit_predict(split, config, seed, progress)`` returning
``(f_samples_norm, noise_scale_norm)``; the runner scores every method the same way.
"""

import dataclasses
import math

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import torch
from pyro import poutine
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoGuideList
from pyro.infer.autoguide.initialization import init_to_sample

from pyro_implicit import ImplicitGuide, KernelRatioELBO
from pyro_implicit.bnn import BNNRegression

__all__ = [
    "KIVI_GENERATORS",
    "KIVIFit",
    "METHODS",
    "build_kivi",
    "fit_fsvgd",
    "fit_kivi",
    "fit_livi",
    "fit_map",
    "fit_wsvgd",
    "make_model",
    "noise_std",
    "num_steps",
    "optimizer",
    "predict_kivi",
    "train_minibatches",
]


def make_model(split, config):
    """The BNN regression model of the benchmark for a split and a configuration.

    :param pyro_implicit.datasets.UCISplit split: the data split (for the input size).
    :param dict config: the run configuration (``hidden_dims``, ``activation``,
        ``prior_scale``, ``precision_prior``).
    :rtype: pyro_implicit.bnn.BNNRegression
    """
    prior = config.get("precision_prior")
    std_prior = config.get("noise_std_prior")
    scale = config.get("prior_scale", 1.0)
    return BNNRegression(
        split.in_dim,
        hidden_dims=tuple(config["hidden_dims"]),
        activation=config.get("activation", "relu"),
        prior_scale=tuple(scale) if isinstance(scale, list) else scale,
        precision_prior=None if prior is None else tuple(prior),
        noise_scale=config.get("noise_scale", 1.0),
        noise_std_prior=None if std_prior is None else tuple(std_prior),
        learn_noise=bool(config.get("learn_noise", False)),
    )


def num_steps(n_train, config):
    """Optimisation steps for ``config["epochs"]`` passes of minibatches of ``batch_size``.

    :param int n_train: number of training points.
    :param dict config: the run configuration.
    :rtype: int
    """
    batch = min(int(config["batch_size"]), n_train)
    return int(config["epochs"]) * math.ceil(n_train / batch)


def train_minibatches(step, x, y, config, progress, describe, report_every=None):
    """Run ``config["epochs"]`` passes over the data in minibatches of ``batch_size`` drawn
    by the model's data plate, printing a progress line every ``report_every`` steps (by
    default ten in all).

    :param callable step: ``step(x, y, subsample_size=...)``, e.g. ``SVI.step``; returns
        what ``describe`` reads.
    :param torch.Tensor x: training inputs.
    :param torch.Tensor y: training targets.
    :param dict config: the run configuration.
    :param callable progress: ``progress(message)`` prints a progress line.
    :param callable describe: ``describe(result, n)`` gives the progress text of a step's
        result (``n`` is the number of training points).
    :param int report_every: steps between progress lines.
    """
    n = x.shape[0]
    batch = min(int(config["batch_size"]), n)
    steps = num_steps(n, config)
    report_every = report_every or max(1, steps // 10)
    for i in range(steps):
        result = step(x, y, subsample_size=batch)
        if (i + 1) % report_every == 0 or i + 1 == steps:
            progress(f"step {i + 1}/{steps}  {describe(result, n)}")


def optimizer(config):
    """Adam with the run's ``lr``, the papers' optimiser; with a ``clip_norm`` setting,
    Pyro's ``ClippedAdam``, which clamps each gradient element to +-clip_norm (not in the
    papers; see ``benchmarks/results/kivi_spikes.md``)."""
    clip_norm = config.get("clip_norm")
    if clip_norm is None:
        return pyro.optim.Adam({"lr": config["lr"]})
    return pyro.optim.ClippedAdam({"lr": config["lr"], "clip_norm": float(clip_norm)})


def noise_std(model, draws, f):
    """Observation noise sd per draw in normalised units, however the model sets it: a
    ``noise_std`` site, a ``precision`` site, a fitted ``noise_scale`` parameter or the fixed
    ``noise_scale``.

    :param pyro_implicit.bnn.BNNRegression model: the benchmark model.
    :param dict draws: the draws behind ``f`` (site name -> tensor with a leading draw dim).
    :param torch.Tensor f: ``(S, n_test)`` function values of those draws.
    :rtype: torch.Tensor
    """
    num = f.shape[0]
    if "noise_std" in draws:
        return draws["noise_std"].reshape(num)
    if "precision" in draws:
        return draws["precision"].rsqrt().reshape(num)
    if model.learn_noise:
        return pyro.param("noise_scale").detach().to(f).expand(num)
    return f.new_full((num,), model.noise_scale)


def _init_scaled(site):
    """Initial value of a site: weights ~ N(0, 1 / fan_in), other sites from the prior.

    The prior median (zero) would start every hidden unit alike so they could never
    differ, and a unit-variance prior draw gives large outputs that Adam takes long to undo.
    """
    if site["name"].startswith("layer"):
        fan_in = site["fn"].event_shape[0]  # in_features + 1 (the bias row)
        return torch.randn_like(site["fn"].sample()) / math.sqrt(fan_in)
    return init_to_sample(site)


def fit_map(split, config, seed, progress):
    """MAP estimate of the benchmark BNN (weights and noise precision) with Adam.

    A point-mass guide (``AutoDelta``, weights initialised by a scaled prior draw, see
    :func:`_init_scaled`) trained with minibatches of ``batch_size`` for ``epochs`` passes
    over the data.

    :param pyro_implicit.datasets.UCISplit split: the normalised data split.
    :param dict config: the run configuration.
    :param int seed: seed of this fit (the runner has already called ``pyro.set_rng_seed``).
    :param callable progress: ``progress(message)`` prints a progress line.
    :returns: ``f_samples_norm`` of shape ``(1, n_test)`` and ``noise_scale_norm`` of shape
        ``(1,)``.
    """
    del seed  # the runner seeds Pyro's global generators
    pyro.clear_param_store()
    model = make_model(split, config)
    guide = AutoDelta(model, init_loc_fn=_init_scaled)
    svi = SVI(model, guide, optimizer(config), Trace_ELBO(max_plate_nesting=1))
    x, y = split.x_train, split.y_train
    train_minibatches(svi.step, x, y, config, progress, lambda loss, n: f"loss/n {loss / n:.4f}")
    with torch.no_grad():
        point = guide.median(x, y)
        f = model.forward(point, split.x_test).unsqueeze(0)
        noise = noise_std(model, point, f)
    return f, noise


#: KIVI's implicit posteriors for UCI (Table 3): (noise dim, hidden widths) per layer.
KIVI_GENERATORS = {
    "boston": [(20, (30,)), (20, (30,))],
    "concrete": [(30, (50,)), (30, (50,))],
    "energy": [(100, (500,)), (50, (100,))],
    "kin8nm": [(100, (500,)), (50, (100,))],
    "naval": [(100, (500,)), (50, (100,))],
    "power": [(100, (500,)), (100, (500,))],
    "protein": [(100, (500,)), (100, (500,))],
    "wine": [(20, (10,)), (5, (20,))],
    "yacht": [(100, (800, None)), (50, (200, 51))],  # None: KIVI's second layer of size N1
}


def _kivi_site_options(split, model):
    sizes = KIVI_GENERATORS[split.name]
    options = {}
    for name, (noise, hidden), shape in zip(
        model.layer_names, sizes, model.layer_shapes, strict=True
    ):
        numel = math.prod(shape)
        options[name] = {
            "noise_dim": noise,
            "hidden_dims": tuple(numel if h is None else h for h in hidden),
        }
    # The noise precision gets a small generator of its own, unless the run asks for
    # KIVI's explicit Gamma q (App. E, ``precision_q="gamma"``, see :func:`fit_kivi`).
    options["precision"] = {"noise_dim": 5, "hidden_dims": (20,)}
    return options


def _gamma_precision_guide(*args, **kwargs):
    """KIVI's explicit q(precision) = Gamma(shape, rate) (App. E), started at the prior
    Gamma(6, 6)."""
    del args, kwargs
    positive = torch.distributions.constraints.positive
    shape = pyro.param("q_precision_shape", torch.tensor(6.0), constraint=positive)
    rate = pyro.param("q_precision_rate", torch.tensor(6.0), constraint=positive)
    pyro.sample("precision", pyro.distributions.Gamma(shape, rate))


@dataclasses.dataclass
class KIVIFit:
    """KIVI's pieces for one split (see :func:`build_kivi`)."""

    model: BNNRegression
    weights: ImplicitGuide  # the implicit guide of the weights
    elbo: KernelRatioELBO
    svi: SVI
    explicit: bool  # the precision has KIVI's explicit Gamma q


def build_kivi(split, config):
    """KIVI (Shi et al., 2018): layer-wise implicit posterior (``ImplicitGuide`` with
    per-site MLP generators of the paper's Table 3 sizes) trained with
    ``KernelRatioELBO`` (n_p = n_q = 100, lambda = 1e-3, clip 1e-8) and Adam
    (:func:`optimizer`). The noise precision gets the paper's explicit Gamma q with an exact
    KL term (App. E; ``KernelRatioELBO(exact_sites=...)``; ``precision_q="gamma"``, the
    runner's default for KIVI) or, with ``precision_q="implicit"``, a small implicit
    generator of its own.

    :rtype: KIVIFit
    """
    pyro.clear_param_store()
    model = make_model(split, config)
    precision_q = config.get("precision_q", "implicit")
    if precision_q not in ("implicit", "gamma"):
        raise ValueError(f"precision_q must be 'implicit' or 'gamma', got {precision_q!r}")
    explicit = precision_q == "gamma" and model.precision_prior is not None
    options = _kivi_site_options(split, model)
    if explicit:
        del options["precision"]
        weights = ImplicitGuide(
            poutine.block(model, hide=["precision"]),
            per_site=True,
            site_options=options,
            init_loc_fn=_init_scaled,
            init_scale=config.get("init_scale", 0.1),
            precondition=False,  # the paper's raw-space generators
        )
        guide = AutoGuideList(model)
        guide.append(weights)
        guide.append(_gamma_precision_guide)
    else:
        weights = guide = ImplicitGuide(
            model,
            per_site=True,
            site_options=options,
            init_loc_fn=_init_scaled,
            init_scale=config.get("init_scale", 0.1),
            precondition=False,
        )
    elbo = KernelRatioELBO(
        num_particles=int(config.get("num_particles", 100)),
        regularizer=float(config.get("regularizer", 1e-3)),
        clip=float(config.get("clip", 1e-8)),
        adaptive_contrast=config.get("adaptive_contrast", False),
        stein_identity=None,  # the paper's estimate, so its tables stay reproducible
        exact_sites=("precision",) if explicit else (),
        max_plate_nesting=1,
    )
    svi = SVI(model, guide, optimizer(config), elbo)
    return KIVIFit(model, weights, elbo, svi, explicit)


def predict_kivi(fit, x, num_samples):
    """``(f, noise)``: ``num_samples`` draws of the function at ``x`` and of the noise sd.

    :param KIVIFit fit: a trained :func:`build_kivi`.
    """
    with torch.no_grad():
        draws = fit.weights.sample_posterior(num_samples)
        f = fit.model.forward(draws, x)
        if fit.explicit:
            q = pyro.distributions.Gamma(
                pyro.param("q_precision_shape"), pyro.param("q_precision_rate")
            )
            noise = q.sample((num_samples,)).rsqrt().to(f.dtype)
        else:
            noise = noise_std(fit.model, draws, f)
    return f, noise


def fit_kivi(split, config, seed, progress):
    """KIVI (:func:`build_kivi`) trained with minibatches of ``batch_size`` scaled by the
    data plate for ``epochs`` passes.

    See :func:`fit_map` for the signature; returns ``num_samples`` posterior draws.
    """
    del seed
    fit = build_kivi(split, config)

    def describe(loss, n):
        clipped = max(d["clipped_fraction"] for d in fit.elbo.diagnostics.values())
        return f"loss/n {loss / n:.4f}  clipped {clipped:.2f}"

    train_minibatches(fit.svi.step, split.x_train, split.y_train, config, progress, describe)
    return predict_kivi(fit, split.x_test, int(config["num_samples"]))


def _fpovi_inputs(split, config):
    """Training and test inputs as f-POVI's UCI code scales them: the runner's standardised
    features divided by ``sqrt(D)`` (``input_scale="sqrt_dim"``), so that each feature has
    standard deviation :math:`1/\\sqrt{D}` and :math:`\\|x\\| \\approx 1`."""
    if config.get("input_scale") == "sqrt_dim":
        c = 1.0 / math.sqrt(split.in_dim)
        return split.x_train * c, split.x_test * c
    return split.x_train, split.x_test


def _fpovi_init(model, config, n, dtype):
    """Initial particles: weights drawn from the prior, noise std ``noise_std_init`` (the
    code's softplus parameter starts at 0.5 in standardised units)."""
    init = {
        name: torch.randn((n,) + tuple(shape), dtype=dtype) * s
        for name, shape, s in zip(
            model.layer_names, model.layer_shapes, model.layer_prior_scales, strict=True
        )
    }
    if model.noise_std_prior is not None:
        init["noise_std"] = torch.full((n,), float(config.get("noise_std_init", 0.5)), dtype=dtype)
    elif model.precision_prior is not None:
        init["precision"] = torch.full((n,), 1.0, dtype=dtype)
    return init


def _fit_particles(split, config, progress, function_space):
    from pyro_implicit.particles import FunctionSpaceSVGD, KDEInputs, WeightSpaceSVGD

    pyro.clear_param_store()
    model = make_model(split, config)
    x, x_test = _fpovi_inputs(split, config)
    y = split.y_train
    n_particles = int(config["num_particles"])
    init = _fpovi_init(model, config, n_particles, x.dtype)
    optim = optimizer(config)
    if function_space:
        inference = FunctionSpaceSVGD(
            model,
            optim,
            n_particles,
            max_plate_nesting=1,
            num_prior_samples=int(config["num_prior_samples"]),
            prior_batch_size=int(config["prior_batch_size"]),
            prior_eig_min=float(config["prior_eig_min"]),
            nu=KDEInputs(int(config["num_extra"]), float(config["ptb_scale"])),
            init_particles=init,
        )
    else:
        # the raw weight space with Liu & Wang's bandwidth, as the papers
        inference = WeightSpaceSVGD(
            model, optim, n_particles, max_plate_nesting=1, init_particles=init, precondition=False
        )

    def describe(diag, n):
        ll = diag.get("log_likelihood", diag.get("log_joint"))
        return (
            f"loglik/n {ll / n:.4f}  attr {diag['attractive']:.3g}  "
            f"rep {diag['repulsive']:.3g}  bw {diag['bandwidth']:.3g}"
        )

    train_minibatches(inference.step, x, y, config, progress, describe)
    with torch.no_grad():
        particles = inference.get_named_particles()
        f = model.forward(particles, x_test)
        noise = noise_std(model, particles, f)
    return f, noise


def fit_fsvgd(split, config, seed, progress):
    """Function-space SVGD (f-POVI, Wang et al. 2019, Algorithm 1) with the paper's UCI
    settings (:func:`_fpovi_defaults`): the kernel acts on the particles' function values
    at the minibatch plus 100 KDE points (eq. 4), the prior score is the moment-matched
    Gaussian of 40 prior networks at 4 points, and each particle's noise std takes a MAP
    step under its InverseGamma(1, 0.1) prior. Predictions are the equal-weight mixture
    over the particles.

    See :func:`fit_map` for the signature; returns one draw per particle.
    """
    del seed
    return _fit_particles(split, config, progress, function_space=True)


def fit_wsvgd(split, config, seed, progress):
    """Weight-space SVGD (Liu & Wang, 2016) on the same model and settings as
    :func:`fit_fsvgd` (RBF kernel on all latents, median rule; the noise std is part of
    each particle and the weight prior enters the score).

    See :func:`fit_map` for the signature; returns one draw per particle.
    """
    del seed
    return _fit_particles(split, config, progress, function_space=False)


def fit_livi(split, config, seed, progress):
    """LIVI (Uppal et al. 2023): ``LinearizedGuide`` (an MLP generator from ``noise_dim``
    Gaussian noise to all weights, output noise ``sigma``) trained with ``LIVI_ELBO``:
    ``bound="det"`` is L' (eq. 15), ``"svd"`` is L'' (eq. 18); the noise scale is a
    parameter fitted by the same optimiser (type-II maximum likelihood).

    See :func:`fit_map` for the signature; returns ``num_samples`` posterior draws.
    """
    from pyro_implicit import LIVI_ELBO, LinearizedGuide

    del seed
    pyro.clear_param_store()
    model = make_model(split, config)
    guide = LinearizedGuide(
        model,
        noise_dim=int(config["noise_dim"]),
        hidden_dims=tuple(config["generator_hidden"]),
        sigma=float(config["sigma"]),
        init_loc_fn=_init_scaled,
        init_scale=config.get("init_scale", 0.1),
        precondition=False,  # the paper's raw-space generator
    )
    # tempering only when asked for: LIVI_ELBO's own defaults are the paper's ELBO
    weights = {k: float(config[k]) for k in ("entropy_weight", "prior_weight") if k in config}
    elbo = LIVI_ELBO(
        num_particles=int(config["num_particles"]),
        bound=config["bound"],
        max_plate_nesting=1,
        **weights,
    )
    svi = SVI(model, guide, optimizer(config), elbo)

    def describe(loss, n):
        return f"loss/n {loss / n:.4f}  noise {pyro.param('noise_scale').item():.4f}"

    train_minibatches(svi.step, split.x_train, split.y_train, config, progress, describe)
    with torch.no_grad():
        draws = guide.sample_posterior(int(config["num_samples"]))
        f = model.forward(draws, split.x_test)
        noise = noise_std(model, draws, f)
    return f, noise


#: name -> fit_predict(split, config, seed, progress) -> (f_samples_norm, noise_scale_norm)
METHODS = {
    "map": fit_map,
    "kivi": fit_kivi,
    "fsvgd": fit_fsvgd,
    "wsvgd": fit_wsvgd,
    "livi": fit_livi,
    "livi_svd": fit_livi,
}
