r"""The packed latent space of a Pyro model, built once, and its affine preconditioner.

Every method of the library works on the same vector :math:`u \in \mathbb R^D`: each
continuous latent site of the model mapped to real space by ``biject_to(support)`` and
flattened, in model order, exactly as Pyro's
:class:`~pyro.infer.autoguide.AutoContinuous` packs it. :class:`LatentSpace` is that space
as one object, built from a prototype trace (a guide's own, so the model is not traced
again): pack / unpack, the vectorised unconstrained log-density

.. math:: \log \tilde p(u) = \log p(x, T(u)) + \log |\det \partial T / \partial u|

of a batch of ``u`` (one model run under an outer particle plate, with Pyro's plate and
``subsample_size`` scaling), its score and its Hessian.

:class:`Preconditioner` is an affine change of variables :math:`u = m + L z`. With
:math:`(m, L)` the mean and a Cholesky factor of a Gaussian fit to the posterior, the
posterior of :math:`z` is roughly isotropic with unit scale, which is what isotropic
kernels with one median bandwidth, generators initialised at a fixed spread and Adam's
fixed learning rate all assume (raw-unit covariates give coordinates whose posterior sds
differ by 10^4). It is the dense mass matrix of NUTS, done once before training.
:func:`find_preconditioner` finds it automatically: a MAP by L-BFGS, the Laplace
approximation at the MAP (dense Hessian for moderate D, its diagonal beyond), checked by
importance weights and replaced by a short Gaussian variational fit started at the Laplace
where the posterior is not Gaussian at its mode (funnels, skewed scales) or where the
Hessian is not positive definite.

References

[1] `Pathfinder: Parallel quasi-Newton variational inference`, Lu Zhang, Bob Carpenter,
    Andrew Gelman, Aki Vehtari, JMLR 2022 (an L-BFGS path to a Gaussian fit, checked by
    importance weights; here one Gaussian at the end of the path).
[2] `NeuTra-lizing Bad Geometry in Hamiltonian Monte Carlo Using Neural Transport`,
    Matthew Hoffman et al., 2019 (sampling in the coordinates of a fitted transport map;
    Pyro's ``NeuTraReparam``).
"""

import collections
import contextlib
import functools
import itertools
import math
import warnings
import weakref

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.autoguide import AutoContinuous
from pyro.infer.autoguide.initialization import InitMessenger, init_to_median
from pyro.infer.util import is_validation_enabled
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _DIM_ALLOCATOR
from pyro.poutine.util import site_is_subsample
from pyro.util import check_site_shape
from torch import nn
from torch.distributions import biject_to

from .errors import ModelError, UnsupportedModelError
from .progress import refresh_intervals
from .random_streams import random_streams_kept

__all__ = [
    "DrawableFlatPrior",
    "LatentSpace",
    "NETWORK_WEIGHTS",
    "completed_model",
    "is_network",
    "plate_nesting",
    "preconditioner_of",
    "Preconditioner",
    "PreconditionerWarning",
    "check_precondition",
    "find_preconditioner",
    "mode_counts",
    "mode_of",
    "resolve_precondition",
    "significant_modes",
]

#: largest D for which the preconditioner is dense (a D x D Hessian, D model runs batched)
DENSE_LIMIT = 2000

#: the ``infer`` key that marks a model's sample site as a network's weights,
#: ``pyro.sample(name, fn, infer={NETWORK_WEIGHTS: True})`` (:mod:`pyro_implicit.bnn`
#: marks its layers): where such sites hold most of the latent coordinates
#: (:attr:`LatentSpace.network`), a guide's default noise is a network's
#: (:func:`~pyro_implicit.guides.base.default_noise_dim`) and, beyond
#: :data:`_VI_DENSE_LIMIT` coordinates, the search's Gaussian fit runs one round
#: (:func:`find_preconditioner`)
NETWORK_WEIGHTS = "network_weights"

#: model runs per batch when the Hessian is built row block by row block
_HESSIAN_CHUNK = 256

#: largest D for which the Gaussian variational fit learns a dense factor of its own
_VI_DENSE_LIMIT = 256

#: nats of expected log-likelihood by which a Gaussian fit's check draws must explain the
#: data better than those of the fit with the higher ELBO to go on instead (see
#: :func:`_leading_fit`): Kass & Raftery's (1995) "very strong" evidence, 2 log B > 10,
#: read as a log-likelihood ratio. The races measured sit far from it: disagreements of
#: at most 0.9 nats on the stiff benchmark, 28-182 on networks of 82-162 weights
_DECISIVE_LOG_LIKELIHOOD = 5.0

#: the Gaussian variational fit starts at this fraction of its starting scale
_VI_START_SCALE = 0.1

#: steps between two reads of the Gaussian variational fit's ELBO on the check draws
_VI_CHECK_EVERY = 100

#: most steps of the Gaussian variational fit that goes on in rounds (up to
#: :data:`_VI_DENSE_LIMIT` coordinates)
_VI_MAX_STEPS = 3000

#: most Newton steps that polish the MAP where the Hessian is dense
_NEWTON_STEPS = 3

#: L-BFGS starts beyond the model's own from which the search looks for other modes, each
#: unconstrained coordinate uniform on (-2, 2) (as Stan and Pyro's NUTS initialise): on a
#: posterior with two modes (0.78 and 0.22 of the mass) the search had started in the
#: lighter one, whichever the guide's random starting point chose, and every method stayed
#: there, 1.9 posterior sds off (``benchmarks/results/audit_probes_s65.md``)
MODE_STARTS = 4

#: most coordinates for which the search looks for other modes (one dense Hessian per
#: mode found; a network's weights, whose symmetries make every start a mode of its own,
#: are never searched)
MODE_SEARCH_LIMIT = _VI_DENSE_LIMIT

#: the weight of a second mode above which the search warns
#: (:class:`~pyro_implicit.errors.MultimodalPosteriorWarning`)
MINOR_MODE_WEIGHT = 0.05

#: a local maximum counts as a mode where the Newton step left there is shorter than this
#: (in the Laplace's sds): L-BFGS stops short of an unbounded density (a funnel's neck, a
#: mixture component collapsing onto one point) with steps that stay long
_MODE_TOLERANCE = 1e-2

#: two modes are one where each lies within this many of the other's Laplace sds
_SAME_MODE_DISTANCE = 1.0

#: two modes are relabellings of one another (label switching: a mixture's components in
#: another order) where their log-densities differ by less than this many nats, their
#: Laplace log-volumes by less than ten times it, and every site holds the same values in
#: another order, to a relative :data:`_RELABEL_RTOL` of the site's largest value
_RELABEL_LOG_DENSITY = 1e-3
_RELABEL_RTOL = 1e-3

#: draws per mode by which importance sampling corrects the modes' Laplace weights (half
#: from each mode's Laplace, half from a wider Student-t, :func:`_importance_mode_weights`).
#: The Laplace volume misses a mode's tails: a Student-t(1.5) mode beside a Normal one of
#: equal mass in five dimensions was given 0.16 of the mass; corrected, 0.49-0.50, against
#: an exact 0.49 (``benchmarks/results/audit_probes_s66.md``)
MODE_WEIGHT_DRAWS = 1024

#: degrees of freedom of the heavy-tailed half of each mode's proposal, and its scale in
#: the Laplace's sds: where a mode's tails are heavier than its Laplace's, a Gaussian
#: proposal's weights grow without bound there (defensive importance sampling, Hesterberg
#: 1995). At the Laplace's own scale the weights of modes with Student-t(3) tails rose
#: toward a bound in the far tails, which the Pareto fit misread as heavy (k-hat 0.84-0.96)
_MODE_PROPOSAL_DF = 3
_MODE_PROPOSAL_WIDTH = 2.0

#: the correction is refused where a mode's weights both look heavy-tailed (Pareto k-hat
#: above 0.7) and peak above this many times their mean. k-hat alone misreads weights
#: that crowd below a bound, as a proposal close to the mode makes them: on modes whose
#: largest weight was 1.5-8.5 times the mean it read 0.72-1.67 where the corrected weights
#: were within 0.009 of exact (``benchmarks/results/audit_probes_s66.md``)
_MODE_WEIGHT_PEAK = 10.0

#: draws whose log-density the weights' correction evaluates at once
_MODE_WEIGHT_BLOCK = 256

#: seconds after which the search shows a progress bar (model calls, the phase, elapsed
#: time); shorter searches print nothing. A model that subsamples its data is scored on
#: all of it, one minibatch after another, so its search grows with the data (a logistic
#: regression of 100 000 rows in minibatches of 100: 8 s, against 1.5 s without
#: subsampling; ``benchmarks/results/precondition_subsampled.md``). At 10 s a 502-weight
#: BNN's first step (its search) stayed silent for 9.3 s, a pause a user cannot read.
SEARCH_PROGRESS_DELAY = 3.0


class PreconditionerWarning(UserWarning):
    """The automatic preconditioner fell back to a weaker fit (or to none)."""


Site = collections.namedtuple(
    "Site", ["name", "transform", "shape", "event_dim", "vec_shape", "start", "stop"]
)
Site.__doc__ = """One latent site's place in the packed vector: ``u[start:stop]`` is its
unconstrained value flattened; ``shape`` the constrained value's shape in the prototype
trace; ``vec_shape`` its unconstrained shape under a particle plate (with a ``-1`` for the
particle count), aligned to the model's plates."""


def _is_discrete(fn):
    """Whether a distribution is discrete: enumerable support, or a discrete support
    constraint."""
    try:
        discrete_support = bool(fn.support.is_discrete)
    except (AttributeError, NotImplementedError):
        discrete_support = False
    return bool(getattr(fn, "has_enumerate_support", False)) or discrete_support


def _discrete_site_error(name, fn, who):
    return ModelError(
        f"{who} cannot sample discrete site '{name}' ({type(fn).__name__}): pyro_implicit's "
        "guides, losses and particle methods, like NUTS, need continuous latent sites and do "
        "not enumerate. Marginalise it out of the model (e.g. dist.MixtureSameFamily, or "
        "pyro.factor with a logsumexp over its values) or observe it; Pyro's TraceEnum_ELBO "
        "can fit it with an autoguide of the other sites, e.g. "
        f"AutoNormal(poutine.block(model, hide=['{name}']))."
    )


def check_trace_continuous(trace, who="NUTS"):
    """Raise if a trace has a discrete latent sample site (not observed, not a plate's
    subsample site).

    :param str who: the method named in the message.
    :raises ModelError: naming the first discrete latent site and the fix.
    """
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
            continue
        if _is_discrete(site["fn"]):
            raise _discrete_site_error(name, site["fn"], who)


def check_no_subsampled_local_latents(trace, who):
    """Raise where a latent sample site lies inside a subsampled plate: a packed latent
    vector cannot size it (it would reuse the ``subsample_size`` slots for different data
    points).

    :param str who: the method named in the message.
    :raises UnsupportedModelError: naming the site, its plate and the rewrite.
    """
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
            continue
        frame = subsampled_plate_of(site)
        if frame is not None:
            raise UnsupportedModelError(
                f"Latent site '{name}' is a local latent inside the subsampled plate "
                f"'{frame.name}' (size {frame.full_size}, subsample_size {frame.size}). "
                f"{who} packs all latents into one vector and cannot size it (it would "
                "silently reuse the subsample_size slots for different data points). "
                "Subsample only the likelihood: sample local latents outside the "
                "subsampled plate or give that plate no subsample_size."
            )


def subsampled_plate_of(site):
    """The frame of the first subsampled plate a trace site lies in (``None`` if none)."""
    for frame in site["cond_indep_stack"]:
        if frame.full_size is not None and frame.full_size != frame.size:
            return frame
    return None


def wraps_distribution(fn, kind):
    """Whether ``fn`` is a distribution of type ``kind`` (a type or a tuple of types, as
    ``isinstance`` takes) or wraps one (``Independent``, ``MaskedDistribution``,
    ``ExpandedDistribution``, a transformed one: ``base_dist`` down the chain)."""
    while not isinstance(fn, kind) and hasattr(fn, "base_dist"):
        fn = fn.base_dist
    return isinstance(fn, kind)


def check_no_point_mass_latents(trace, who="pyro_implicit"):
    """Raise where a latent sample site is a point mass (``dist.Delta``, wrapped or not):
    it has no density that a guide or a sampler can approximate, and its log-density is
    -inf at every draw but one, which the fits met as a divergence.

    :raises ModelError: naming the site and ``pyro.deterministic``, the way to record a
        computed value.
    """
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"] or site_is_subsample(site):
            continue
        if wraps_distribution(site["fn"], pyro.distributions.Delta):
            raise ModelError(
                f"{who}: latent site {name!r} is a point mass (Delta): it has no density to "
                "approximate, so every draw but one has log-density -inf. Record a value "
                f"computed from other latents with `pyro.deterministic({name!r}, value)`, "
                "or observe it (obs=)."
            )


def _constraint_tensors(constraint):
    """The tensors a constraint holds (an interval's bounds, those of the constraints it
    wraps or stacks)."""
    found, stack = [], [constraint]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, torch.distributions.constraints.Constraint):
            stack.extend(vars(item).values())
    return found


def check_fixed_supports(model, trace, args=(), kwargs=None, who="pyro_implicit"):
    """Raise where a latent site's support moves with another latent's value
    (``x ~ Uniform(0, theta)``).

    A packed space maps each site to real space through one ``biject_to`` read from one
    run of the model, as Pyro's ``AutoContinuous`` guides and NUTS do, so draws of such a
    site would leave its support whenever the other latent moves: Pyro then fails with a
    support error at the site, or a vectorised check blames the particle plate. The model
    is run once more with the latents of ``trace`` as inputs that require grad, and each
    support's bounds are differentiated with respect to them (a bound that moves with a
    ``pyro.param`` alone is not refused).

    :raises UnsupportedModelError: naming the site, its support, the latents it moves
        with, and the rewrite on a fixed support.
    """
    latents = {
        name: site["value"]
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and not site["is_observed"]
        and not site_is_subsample(site)
        and torch.is_tensor(site["value"])
        and site["value"].is_floating_point()
    }
    if len(latents) < 2:
        return
    inputs = {name: value.detach().requires_grad_() for name, value in latents.items()}
    rng = pyro.util.get_rng_state()
    try:
        with torch.enable_grad(), poutine.block():
            rerun = poutine.trace(poutine.condition(model, data=inputs)).get_trace(
                *args, **(kwargs or {})
            )
    except Exception:  # noqa: BLE001 (the model's own errors surface in the fit's runs)
        return
    finally:
        pyro.util.set_rng_state(rng)
    for name in latents:
        site = rerun.nodes.get(name)
        if site is None or site["type"] != "sample":
            continue
        moving = set()
        for bound in _constraint_tensors(site["fn"].support):
            if not bound.requires_grad:
                continue
            others = [other for other in inputs if other != name]
            grads = torch.autograd.grad(
                bound.sum(), [inputs[o] for o in others], allow_unused=True, retain_graph=True
            )
            moving.update(o for o, g in zip(others, grads, strict=True) if g is not None)
        if moving:
            parents = ", ".join(repr(o) for o in sorted(moving))
            raise UnsupportedModelError(
                f"{who}: latent site {name!r} has support {site['fn'].support}, which moves "
                f"with the latent site(s) {parents}. Every site is mapped to real space "
                "through one fixed transform (as in Pyro's autoguides and NUTS), so its "
                "draws would leave that support. Draw it on a fixed support and transform "
                f"it in the model: for Uniform(low, high), `{name}_unit = pyro.sample("
                f"'{name}_unit', dist.Uniform(0., 1.))` and `{name} = pyro.deterministic("
                f"'{name}', low + (high - low) * {name}_unit)`."
            )


@contextlib.contextmanager
def prototype_errors_named(autoguide, who):
    """Around an ``AutoContinuous`` prototype's set-up: Pyro's error for a discrete
    latent site, which suggests enumerating it (nothing here enumerates), becomes
    :func:`check_trace_continuous`'s, with the fix, and its error for a model without
    latent sites :func:`no_latent_sites_error`. Other errors pass as they are."""
    try:
        yield
    except ValueError:
        if getattr(autoguide, "prototype_trace", None) is not None:  # the model ran
            check_trace_continuous(autoguide.prototype_trace, who)
        raise
    except RuntimeError as e:
        if "found no latent variables" in str(e):
            raise no_latent_sites_error(who) from e
        raise


def no_latent_sites_error(who):
    """The :class:`~pyro_implicit.errors.ModelError` for a model whose every sample site
    is observed: there is no posterior to approximate."""
    return ModelError(
        f"{who}: the model has no latent sites (every sample site is observed or a "
        "pyro.param), so there is no posterior to fit; check that the latent sites are "
        "not given obs=, and fit pyro.params with Pyro's SVI and an empty guide"
    )


def support_transform(site, who="pyro_implicit"):
    """``biject_to`` of a latent site's support, the map from real space into it.

    :param str who: the method named in the message.
    :raises ModelError: for a discrete site, or a support with no such map, naming the
        site and the fix.
    """
    fn = site["fn"]
    if _is_discrete(fn):
        raise _discrete_site_error(site["name"], fn, who)
    try:
        return biject_to(fn.support)
    except NotImplementedError:
        raise ModelError(
            f"Latent site '{site['name']}' has support {fn.support}, which has no bijection "
            f"to real space: {who} needs latent sites whose support torch's biject_to maps "
            "(real, positive, interval, simplex, Cholesky factors, ...)."
        ) from None


class _CompleteObsMask(Messenger):
    """See :func:`completed_model`."""

    def __enter__(self):
        self._observed_masks = {}
        return super().__enter__()

    def _process_message(self, msg):
        mask = msg["mask"]
        if msg["type"] != "sample" or not torch.is_tensor(mask) or mask.dtype != torch.bool:
            return
        name = msg["name"]
        if name.endswith("_observed") and msg["is_observed"]:
            self._observed_masks[name[: -len("_observed")]] = mask
        elif name.endswith("_unobserved"):
            observed = self._observed_masks.pop(name[: -len("_unobserved")], None)
            if observed is not None:
                msg["mask"] = mask | observed


def completed_model(model):
    """``model`` as every method here runs it: each ``obs_mask`` made proper and each flat
    prior made drawable, its density unchanged.

    **obs_mask.** Pyro splits ``pyro.sample(name, fn, obs=y, obs_mask=m)`` in two:
    ``{name}_observed`` (the data where ``m`` holds) and the latent ``{name}_unobserved``,
    of the whole shape but masked by ``~m``, whose entries where ``m`` holds are replaced
    by the data and so never used. Those entries have no density at all: a flat, improper
    direction of the posterior, along which a preconditioner's Laplace or Gaussian fit
    widens without end and a kernel's length scale is lost. Here they get ``fn``'s own
    density instead (the mask becomes ``~m | m``, times any outer mask), which integrates
    to one over each of them: the posterior of every other site, and of the missing
    entries, is unchanged, and those entries become draws of ``fn`` given the rest.

    **Flat priors.** A latent ``ImproperUniform`` (Pyro's flat prior, log-density 0)
    cannot be drawn from, and every method here draws from the prior: its starting
    points, the vectorisation check, KIVI's prior contrast (as Pyro's ``init_to_median``
    does). Here it becomes a :class:`DrawableFlatPrior`: draws of ``biject_to(support)``
    of standard normal noise, the log-density still 0, so the posterior is the model's.

    A model with neither runs as it is.
    """
    if isinstance(model, _CompletedModel):
        return model
    return _CompletedModel(model)


class _CompletedModel:
    """A model run under :class:`_CompleteObsMask` and :class:`_DrawableFlatPriors`
    (fresh ones per call)."""

    def __init__(self, model):
        self.model = model
        functools.update_wrapper(self, model, updated=())

    def __call__(self, *args, **kwargs):
        with _CompleteObsMask(), _DrawableFlatPriors(_first_float_tensor(args, kwargs)):
            return self.model(*args, **kwargs)


def _first_float_tensor(args, kwargs):
    """The first floating-point tensor among a model's inputs (``None`` if none): the
    device of the data."""
    for value in itertools.chain(args, kwargs.values()):
        if torch.is_tensor(value) and value.is_floating_point():
            return value
    return None


class _DrawableFlatPriors(Messenger):
    """See :func:`completed_model`: each latent ``ImproperUniform`` becomes
    :func:`drawable_flat_prior`, on the device of ``like``."""

    def __init__(self, like=None):
        super().__init__()
        self.like = like

    def _process_message(self, msg):
        if msg["type"] != "sample" or msg["is_observed"]:
            return
        if wraps_distribution(msg["fn"], pyro.distributions.ImproperUniform):
            msg["fn"] = drawable_flat_prior(msg["fn"], msg["name"], self.like)


class DrawableFlatPrior(pyro.distributions.ImproperUniform):
    """A flat prior that can be drawn from: ``ImproperUniform``'s support, shapes and
    log-density 0 (so the posterior is the model's), with draws ``biject_to(support)`` of
    standard normal noise, which serve as starting points only."""

    #: a tensor whose device the draws take (``None``: torch's default)
    like = None

    def expand(self, batch_shape, _instance=None):
        new = super().expand(batch_shape, _instance)
        new.like = self.like
        return new

    def noise_distribution(self):
        """The distribution the draws come from (its log-density is KIVI's prior
        contrast's, :class:`~pyro_implicit.elbo.KernelRatioELBO`)."""
        transform = biject_to(self.support)
        shape = transform.inverse_shape(self.batch_shape + self.event_shape)
        # torch's default dtype, as a prior written with Python numbers draws in
        device = None if self.like is None else self.like.device
        zeros = torch.zeros(shape, dtype=torch.get_default_dtype(), device=device)
        noise = pyro.distributions.Normal(zeros, 1.0).to_event(transform.domain.event_dim)
        drawn = pyro.distributions.TransformedDistribution(noise, transform)
        return drawn.to_event(len(self.event_shape) - len(drawn.event_shape))

    def sample(self, sample_shape=()):
        with torch.no_grad():
            return self.noise_distribution().sample(torch.Size(sample_shape))


def drawable_flat_prior(fn, name="?", like=None):
    """``fn``, an ``ImproperUniform`` (possibly under ``.to_event``), as a
    :class:`DrawableFlatPrior` whose draws take the device of the tensor ``like``.

    :raises ModelError: where ``fn`` wraps the ``ImproperUniform`` otherwise, or no map
        from real space reaches its support, naming the site ``name``.
    """
    flat = fn.base_dist if isinstance(fn, torch.distributions.Independent) else fn
    if isinstance(flat, DrawableFlatPrior):
        return fn
    if type(flat) is not pyro.distributions.ImproperUniform:
        raise ModelError(
            f"latent site {name!r}: its flat prior (ImproperUniform) is wrapped in "
            f"{type(fn).__name__}, which this library cannot draw from; write "
            "ImproperUniform(support, batch_shape, event_shape) at the site, or give it "
            "a proper prior that is flat at the data's scale, e.g. dist.Normal(0., 100.)"
        )
    drawable = DrawableFlatPrior(flat.support, flat.batch_shape, flat.event_shape)
    drawable.like = like
    try:
        drawable.noise_distribution()
    except NotImplementedError:
        raise ModelError(
            f"latent site {name!r} has a flat prior (ImproperUniform) on {fn.support}, "
            "which has no map from real space to draw from; give it a proper prior"
        ) from None
    if flat is fn:
        return drawable
    return drawable.to_event(fn.reinterpreted_batch_ndims)


def is_network(trace, sizes):
    """Whether the latent sites of ``trace`` marked :data:`NETWORK_WEIGHTS` hold more than
    half of the packed coordinates; ``sizes``: ``{site: number of packed coordinates}``."""
    marked = sum(
        size
        for name, size in sizes.items()
        if trace.nodes[name]["infer"].get(NETWORK_WEIGHTS, False)
    )
    return 2 * marked > sum(sizes.values())


def check_trace_shapes(trace, max_plate_nesting):
    """Under Pyro's validation, Pyro's own check of every sample site's log-density shape
    (``check_site_shape``; plate subsample sites aside), whose message names the site and
    the fix."""
    if not is_validation_enabled():
        return
    trace.compute_log_prob()
    for site in trace.nodes.values():
        if site["type"] == "sample" and not site_is_subsample(site):
            check_site_shape(site, max_plate_nesting)


def _is_subsampled(trace):
    return any(
        frame.full_size is not None and frame.size != frame.full_size
        for site in trace.nodes.values()
        if site["type"] == "sample"
        for frame in site["cond_indep_stack"]
    )


def plate_nesting(trace):
    """The number of vectorised plate dims the sample sites of ``trace`` use (the
    ``max_plate_nesting`` Pyro asks for)."""
    dims = [
        -frame.dim
        for site in trace.nodes.values()
        if site["type"] == "sample"
        for frame in site["cond_indep_stack"]
        if frame.vectorized and frame.dim is not None
    ]
    return max(dims, default=0)


def _subsample_plates(trace):
    return {
        name: (int(site["fn"].size), int(site["fn"].subsample_size))
        for name, site in trace.nodes.items()
        if site["type"] == "sample"
        and site_is_subsample(site)
        and site["fn"].subsample_size is not None
        and site["fn"].subsample_size < site["fn"].size
    }


class _PlateWeights(Messenger):
    """Scales the sample sites of each named plate by a factor and masks the rows a
    ``(subsample_size,)`` bool mask leaves out (``{plate: (factor, mask or None)}``), at
    the plate's dim; the subsample sites themselves are left alone."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def _process_message(self, msg):
        if msg["type"] != "sample" or site_is_subsample(msg):
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name not in self.weights:
                continue
            factor, mask = self.weights[frame.name]
            msg["scale"] = factor * msg["scale"]
            if mask is not None:
                mask = mask.reshape((-1,) + (1,) * (-frame.dim - 1))
                msg["mask"] = mask if msg["mask"] is None else msg["mask"] & mask


def _crossed(trace, plates):
    return any(
        sum(frame.name in plates for frame in site["cond_indep_stack"]) > 1
        for site in trace.nodes.values()
        if site["type"] == "sample"
    )


def _is_deterministic(site):
    return bool((site.get("infer") or {}).get("_deterministic", False))


def _without_init(model):
    """The model inside Pyro's ``InitMessenger`` wrappers (an ``AutoContinuous`` guide's
    ``model`` is wrapped in one): conditioned on every latent, the log-density needs no
    initial values, and computing them (``init_to_median`` draws prior samples at every
    site) would cost a prior run per call and move the random streams."""
    while True:
        parts = getattr(model, "args", None)
        if (
            isinstance(parts, tuple)
            and len(parts) == 2
            and isinstance(parts[0], InitMessenger)
            and callable(parts[1])
        ):
            model = parts[1]
        else:
            return model


class LatentSpace:
    """The packed unconstrained latent space of a Pyro model.

    :param callable model: the Pyro model.
    :param prototype_trace: a trace of the model (e.g. an ``AutoContinuous`` guide's
        ``prototype_trace``), whose latent sites define the space.
    :param dict unconstrained_shapes: ``{site: unconstrained shape}`` as
        ``AutoContinuous._unconstrained_shapes`` (computed from the trace if omitted).
    :param int max_plate_nesting: the model's plate nesting; the particle plate goes at
        ``dim = -max_plate_nesting - 1``.
    """

    #: name of the particle plate of :meth:`trace`
    plate_name = "_latent_particles"

    def __init__(self, model, prototype_trace, max_plate_nesting, unconstrained_shapes=None):
        self.model = completed_model(_without_init(model))
        # every plate of the model counts, those of observed sites too (a guide's own
        # max_plate_nesting counts only its latents' plates)
        self.max_plate_nesting = max(int(max_plate_nesting), plate_nesting(prototype_trace))
        sites, pos = [], 0
        #: whether the model subsamples a plate (its log-density is then a minibatch
        #: estimate, a random function of the particles)
        self.subsampled = _is_subsampled(prototype_trace)
        #: ``{plate: (size, subsample_size)}`` of the subsampled plates (read from a full
        #: model run; see :meth:`from_guide`)
        self.subsample_plates = _subsample_plates(prototype_trace)
        #: whether a site lies in two subsampled plates (rows x columns of a matrix)
        self.crossed_subsample_plates = _crossed(prototype_trace, self.subsample_plates)
        for name, site in prototype_trace.iter_stochastic_nodes():
            fn, value = site["fn"], site["value"]
            transform = support_transform(site)
            if unconstrained_shapes is not None:
                shape = tuple(unconstrained_shapes[name])
            else:
                shape = tuple(transform.inv(value).shape)
            batch_ndim = value.dim() - fn.event_dim
            if batch_ndim > self.max_plate_nesting:
                raise ValueError(
                    f"Latent site '{name}' has batch shape {tuple(value.shape[:batch_ndim])}, "
                    f"more dims than max_plate_nesting={self.max_plate_nesting}: pass the "
                    "model's true plate nesting, and use .to_event() for dims that are not "
                    "plates."
                )
            size = math.prod(shape)
            vec_shape = (-1,) + (1,) * (self.max_plate_nesting - batch_ndim) + shape
            event_dim = fn.event_dim + len(shape) - value.dim()
            sites.append(
                Site(name, transform, tuple(value.shape), event_dim, vec_shape, pos, pos + size)
            )
            pos += size
        if not sites:
            raise ValueError("the model has no latent sample sites")
        self.sites = sites
        self.latent_dim = pos
        #: whether the latent is mostly a network's weights (:func:`is_network`)
        self.network = is_network(prototype_trace, {s.name: s.stop - s.start for s in sites})
        first = prototype_trace.nodes[sites[0].name]["value"]
        self.dtype, self.device = first.dtype, first.device

    @classmethod
    def from_guide(cls, guide, args=(), kwargs=None, max_plate_nesting=0, model=None):
        """The space of an ``AutoContinuous`` guide that has been set up, with the model's
        plate nesting and subsampled plates read from one more model run (the guide's
        prototype trace hides the observed sites, their plates and the subsample sites).

        :param int max_plate_nesting: a lower bound for the nesting (e.g. the user's).
        :param model: the model whose log-density the space scores (default: the guide's):
            a loss passes the one it was given, which may wrap the guide's (``SVI(
            poutine.scale(model, s), guide, ...)``) or stand in for one a pickled guide
            dropped."""
        model = guide.model if model is None else model
        # the run draws from the prior: leave the caller's random streams as they were
        with random_streams_kept(), torch.no_grad():
            full = poutine.block(poutine.trace(model).get_trace)(*args, **(kwargs or {}))
        from .elbo.checks import check_observed_finite  # the losses import this module

        # NaN data fail the first model run of any search with Pyro's message, which
        # names neither the count nor the fix
        check_observed_finite(full)
        space = cls(
            model,
            guide.prototype_trace,
            max(getattr(guide, "_max_plate_nesting", 0), max_plate_nesting, plate_nesting(full)),
            guide._unconstrained_shapes,
        )
        space.subsample_plates = _subsample_plates(full)
        space.crossed_subsample_plates = _crossed(full, space.subsample_plates)
        space.subsampled = space.subsampled or bool(space.subsample_plates)
        # Pyro's message for a site whose log-density has the wrong shape (data of shape
        # (N, 1) in a plate of N), before a search meets it as a broadcast error that
        # names no site
        check_trace_shapes(full, float("inf"))
        return space

    @classmethod
    def from_model(cls, model, args=(), kwargs=None, max_plate_nesting=0):
        """The space of ``model`` itself, for code that has no guide (draws handed in as
        a dict, NUTS draws, Pyro's own guides): Pyro's ``AutoContinuous`` builds the
        prototype trace from one prior run, with the caller's random streams restored.
        The space's ``init_loc`` holds the packed prior medians.

        :param int max_plate_nesting: a lower bound for the nesting (e.g. the user's)."""
        proto = AutoContinuous(model, init_loc_fn=init_to_median)
        with random_streams_kept():
            with torch.no_grad(), poutine.block(), prototype_errors_named(proto, "pyro_implicit"):
                proto._setup_prototype(*args, **(kwargs or {}))
            init_loc = proto._init_loc().detach()
        space = cls.from_guide(proto, args, kwargs, max_plate_nesting)
        #: packed prior medians (Pyro's ``init_to_median``): a start for a MAP search
        space.init_loc = init_loc
        return space

    # ------------------------------------------------------------------ packing
    def pack(self, values):
        """``(N, D)`` unconstrained rows from ``{site: (N, *site_shape) constrained}``."""
        rows = []
        num = None
        for s in self.sites:
            v = torch.as_tensor(values[s.name])
            u = s.transform.inv(v)
            num = u.shape[0] if num is None else num
            u = u.reshape(num, -1)
            if u.shape[-1] != s.stop - s.start:
                raise ValueError(
                    f"value of site '{s.name}' has shape {tuple(v.shape)}; expected (N, *{s.shape})"
                )
            rows.append(u)
        return torch.cat(rows, dim=-1)

    def unpack(self, u, log_jacobian=False, extra_dims=0):
        """Constrained, plate-aligned site values of the rows of ``u`` ``(N, D)`` (with the
        autograd graph), and with ``log_jacobian`` the per-row
        :math:`\\log|\\det \\partial T/\\partial u|` ``(N,)``.

        :param int extra_dims: singleton dims between the particle dim and the model's
            plates (a particle plate placed left of plates already in use).
        :return: ``values`` or ``(values, log_jacobian)``.
        """
        values, _, ladj = self.unpack_views(u, extra_dims, log_jacobian)
        return (values, ladj) if log_jacobian else values

    def unpack_views(self, u, extra_dims=0, log_jacobian=True):
        """``(values, views, log_jacobian)``: :meth:`unpack`'s values and log-Jacobian (0
        without ``log_jacobian``) and the plate-aligned unconstrained views they are
        computed from (so a gradient may be taken in either)."""
        if u.dim() != 2 or u.shape[-1] != self.latent_dim:
            raise ValueError(
                f"expected (N, {self.latent_dim}) packed latents, got {tuple(u.shape)}"
            )
        values, views = {}, {}
        ladj = u.new_zeros(u.shape[0])
        for s in self.sites:
            shape = s.vec_shape[:1] + (1,) * extra_dims + s.vec_shape[1:]
            part = u[:, s.start : s.stop].reshape(shape)
            value = s.transform(part)
            values[s.name], views[s.name] = value, part
            if not log_jacobian:
                continue
            j = s.transform.log_abs_det_jacobian(part, value)
            if torch.is_tensor(j) and j.dim() > 0:
                ladj = ladj + j.reshape(j.shape[0], -1).sum(-1)
            else:
                ladj = ladj + j
        return values, views, ladj

    def site_values(self, u):
        """``{site: (N, *site_shape)}`` constrained values of the rows of ``u``."""
        values = self.unpack(u)
        return {s.name: values[s.name].reshape((u.shape[0],) + s.shape) for s in self.sites}

    # ------------------------------------------------------------------ model runs
    def particle_dim(self):
        """The dim of the particle plate: ``-max_plate_nesting - 1``, or further left when
        an enclosing plate (e.g. a loss's own particle plate, around a guide that builds
        its preconditioner on its first call) already holds that dim."""
        dim = -self.max_plate_nesting - 1
        stack = getattr(_DIM_ALLOCATOR, "_stack", [])
        while -dim - 1 < len(stack) and stack[-dim - 1] is not None:
            dim -= 1
        return dim

    def trace(self, values, args=(), kwargs=None, size=1, name=None, dim=None):
        """Trace the model under the particle plate of ``size`` (at ``dim``, default
        :meth:`particle_dim`), conditioned on ``values``."""
        model = poutine.condition(self.model, data=values) if values else self.model
        dim = self.particle_dim() if dim is None else dim
        with pyro.plate(name or self.plate_name, size, dim=dim):
            return poutine.trace(model).get_trace(*args, **(kwargs or {}))

    @staticmethod
    def particle_sum(log_prob, num, dim):
        """One value per particle of a site's (scaled) log-density, particles at ``dim``."""
        from .elbo.base import particle_sum

        return particle_sum(log_prob, num, -dim)

    def log_density(self, u, args=(), kwargs=None, full_data=True):
        """The unconstrained log-density :math:`\\log p(x, T(u)) + \\log|\\det
        \\partial T/\\partial u|` of every row of ``u`` ``(N, D)``, one model run: ``(N,)``.
        Every sample site counts (latent and observed, with plate and ``subsample_size``
        scaling); ``pyro.deterministic`` sites do not.

        A model that subsamples a plate is evaluated on the full data, exactly: the mean
        of its minibatch terms over :meth:`covering_minibatches` (crossed plates' minibatches
        in every combination, independent ones side by side, wrapped rows masked and each
        plate's terms weighted, :meth:`minibatch_log_density`), so the result is a deterministic
        function of ``u``, as a MAP search, a Hessian and NUTS need; with
        ``full_data=False`` it is one minibatch estimate (as a stochastic method uses)."""
        return self._eager_log_density(u, args, kwargs, full_data)

    def log_likelihood(self, u, args=(), kwargs=None):
        """The full data's log-likelihood at every row of ``u`` ``(N, D)``: the observed
        sites' terms of :meth:`log_density` (``pyro.factor`` sites among them), with their
        plate scaling, without the latent sites' or the Jacobian's: ``(N,)``."""
        return self._eager_log_density(u, args, kwargs, observed_only=True)

    def _eager_log_density(self, u, args, kwargs, full_data=True, observed_only=False):
        if not self.subsample_plates or not full_data:
            return self._log_density(u, args, kwargs, observed_only)
        batches = self.covering_minibatches(u.device)
        total = 0.0
        for indices, keep in batches:
            term = self.minibatch_log_density(u, args, kwargs, indices, keep, observed_only)
            total = total + term
        return total / len(batches)

    def covering_minibatches(self, device=None):
        """``[(indices, keep)]``: the minibatches a full-data pass runs, ``indices``
        ``{plate: indices}`` for every subsampled plate, ``keep`` ``{plate: bool mask}``
        the rows counted (for the plates that need a mask). Each plate's consecutive
        minibatches cover its rows once, its last wrapping around to its first rows with
        those masked. Crossed plates (a site in two of them) run every combination of their
        minibatches (the Cartesian product, so that they meet in every block); otherwise
        the plates' minibatches run side by side, a plate with fewer fully masked once its
        own are done. With :meth:`full_data_factors` the mean over them is the full data.
        Empty for a model that does not subsample."""
        plates = self.subsample_plates
        if not plates:
            return []
        blocks = []
        for size, batch in plates.values():
            count = math.ceil(size / batch)
            positions = [
                torch.arange(k * batch, (k + 1) * batch, device=device) for k in range(count)
            ]
            blocks.append([(pos % size, pos < size) for pos in positions])
        if self.crossed_subsample_plates:
            combinations = list(itertools.product(*blocks))
        else:
            longest = max(len(b) for b in blocks)
            combinations = [
                tuple(b[k] if k < len(b) else (b[0][0], torch.zeros_like(b[0][1])) for b in blocks)
                for k in range(longest)
            ]
        names = list(plates)
        # a plate some minibatch masks carries its mask in every one (one graph for all)
        masked = {
            name
            for c in combinations
            for name, (_, keep) in zip(names, c, strict=True)
            if not keep.all()
        }
        return [
            (
                {name: indices for name, (indices, _) in zip(names, c, strict=True)},
                {name: keep for name, (_, keep) in zip(names, c, strict=True) if name in masked},
            )
            for c in combinations
        ]

    def full_data_factors(self):
        """``{plate: factor}``: each subsampled plate's terms in a minibatch of
        :meth:`covering_minibatches` are scaled by this beyond the model's own
        ``size / subsample_size``, so that their mean over the covering minibatches counts
        every row once: ``passes * subsample_size / (size * uses)``, where each row is
        counted in ``uses`` of the ``passes`` (1 where the minibatches tile the plate)."""
        plates = self.subsample_plates
        counts = {name: math.ceil(size / batch) for name, (size, batch) in plates.items()}
        if self.crossed_subsample_plates:
            passes = math.prod(counts.values())
            uses = {name: passes // count for name, count in counts.items()}
        else:
            passes = max(counts.values(), default=0)
            uses = dict.fromkeys(plates, 1)
        return {
            name: passes * batch / (size * uses[name]) for name, (size, batch) in plates.items()
        }

    def minibatch_log_density(self, u, args, kwargs, indices, keep=None, observed_only=False):
        """The log-density of the rows of ``u`` on the minibatch ``{plate: indices}`` (the
        plates' subsample sites conditioned on them) as one term of a full-data pass over
        :meth:`covering_minibatches`: each subsampled plate's sites scaled as the model's
        plates scale a minibatch and by :meth:`full_data_factors`, the rows ``keep``
        (``{plate: bool mask}``) leaves out masked, so that the mean over the covering
        minibatches is the full-data log-density (its observed sites' terms alone with
        ``observed_only``)."""
        model = self.model
        weights = {}
        for name, factor in self.full_data_factors().items():
            mask = (keep or {}).get(name)
            if factor != 1.0 or mask is not None:
                weights[name] = (factor, mask)
        try:
            conditioned = poutine.condition(model, data=indices)
            self.model = _PlateWeights(weights)(conditioned) if weights else conditioned
            return self._log_density(u, args, kwargs, observed_only)
        finally:
            self.model = model

    def _log_density(self, u, args, kwargs, observed_only=False):
        num = u.shape[0]
        dim = self.particle_dim()
        extra = -dim - 1 - self.max_plate_nesting
        # the likelihood alone leaves the Jacobian out: its ladj stays zeros
        values, _, ladj = self.unpack_views(u, extra, log_jacobian=not observed_only)
        with poutine.block():
            trace = self.trace(values, args, kwargs, size=num, dim=dim)
        # the latent sites, conditioned on u, are observed in this trace too
        latent = {s.name for s in self.sites} if observed_only else ()
        names = [
            name
            for name, site in trace.nodes.items()
            if site["type"] == "sample"
            and not site_is_subsample(site)
            and not _is_deterministic(site)
            and name not in latent
        ]
        trace.compute_log_prob(site_filter=lambda name, site: name in names)
        total = ladj
        for name in names:
            total = total + self.particle_sum(trace.nodes[name]["log_prob"], num, dim)
        return total

    def compile(self, backend="fx", max_signatures=8):
        """Serve :meth:`score` from traced graphs from now on
        (:class:`~pyro_implicit.compiled.CompiledLogDensity`: the model's Python and Pyro's
        handlers run once per input signature, not per call); a model that cannot be
        traced stays eager, with the reason logged.

        :return: ``self``."""
        from .compiled import CompiledLogDensity

        self.compiled = CompiledLogDensity(self, backend, max_signatures)
        return self

    #: the traced graphs behind :meth:`score` (``None``: eager; see :meth:`compile`)
    compiled = None

    def score(self, u, args=(), kwargs=None, full_data=True):
        """``(log_density, score)`` at the rows of ``u``: ``(N,)`` and ``(N, D)`` (on one
        minibatch with ``full_data=False``, see :meth:`log_density`), detached; from a
        traced graph after :meth:`compile`."""
        if self.compiled is not None:
            out = self.compiled.score(u, args, kwargs, full_data)
            if out is not None:
                return out
        with torch.enable_grad():
            u = u.detach().requires_grad_(True)
            lp = self.log_density(u, args, kwargs, full_data=full_data)
            (grad,) = torch.autograd.grad(lp.sum(), u)
        return lp.detach(), grad

    def hessian(self, u, args=(), kwargs=None):
        """The ``(D, D)`` Hessian of :meth:`log_density` at one point ``u`` ``(D,)``: row
        ``r`` is the gradient of the ``r``-th score coordinate, from a batch of copies of
        ``u`` (row ``r`` of the batch differentiated once more along coordinate ``r``)."""
        dim = self.latent_dim
        rows = []
        for start in range(0, dim, _HESSIAN_CHUNK):
            idx = torch.arange(start, min(start + _HESSIAN_CHUNK, dim), device=u.device)
            with torch.enable_grad():
                batch = u.detach().expand(len(idx), dim).clone().requires_grad_(True)
                lp = self.log_density(batch, args, kwargs)
                (grad,) = torch.autograd.grad(lp.sum(), batch, create_graph=True)
                picked = grad.gather(1, idx[:, None]).sum()
                (block,) = torch.autograd.grad(picked, batch)
            rows.append(block)
        hess = torch.cat(rows, dim=0)
        return 0.5 * (hess + hess.T)

    def hessian_diagonal(self, u, args=(), kwargs=None, num_probes=64, generator=None):
        """Hutchinson's estimate of the Hessian's diagonal, ``(D,)``: the mean of
        :math:`v \\odot Hv` over Rademacher probes ``v``, one batched model run."""
        dim = self.latent_dim
        v = torch.randint(0, 2, (num_probes, dim), generator=generator).to(u) * 2 - 1
        with torch.enable_grad():
            batch = u.detach().expand(num_probes, dim).clone().requires_grad_(True)
            lp = self.log_density(batch, args, kwargs)
            (grad,) = torch.autograd.grad(lp.sum(), batch, create_graph=True)
            (hv,) = torch.autograd.grad((grad * v).sum(), batch)
        return (v * hv).mean(0)


class Preconditioner(nn.Module):
    r"""An affine change of variables :math:`u = m + L z` of the packed latent space.

    ``L`` is lower triangular (dense, ``scale_tril``) or diagonal (``scale``); neither
    given is the identity (no preconditioning). The values are buffers, so they travel
    with the owner's ``state_dict`` and ``.to()``.

    :param torch.Tensor loc: :math:`m`, ``(D,)``.
    :param torch.Tensor scale_tril: :math:`L`, ``(D, D)`` lower triangular with positive
        diagonal.
    :param torch.Tensor scale: diagonal :math:`L`, ``(D,)`` positive.
    :param str source: how it was found (``"laplace"``, ``"gaussian_vi"``, ``"user"``,
        ``"particles"``: :meth:`WeightSpaceSVGD.refresh_preconditioner
        <pyro_implicit.particles.WeightSpaceSVGD.refresh_preconditioner>`, ``"identity"``),
        for diagnostics.
    """

    def __init__(self, loc=None, scale_tril=None, scale=None, source="user"):
        super().__init__()
        if scale_tril is not None and scale is not None:
            raise ValueError("give scale_tril (dense L) or scale (diagonal L), not both")
        if (scale_tril is not None or scale is not None) and loc is None:
            raise ValueError("a Preconditioner with a scale needs its loc")
        if loc is None:
            self.kind = "identity"
        else:
            self.kind = "dense" if scale_tril is not None else "diagonal"
        self.source = "identity" if loc is None else source
        if loc is not None:
            loc = torch.as_tensor(loc)
            if loc.dim() != 1:
                raise ValueError(f"loc must have shape (D,), got {tuple(loc.shape)}")
            self.register_buffer("loc", loc.detach().clone())
            if scale_tril is not None:
                scale_tril = torch.as_tensor(scale_tril, dtype=loc.dtype, device=loc.device)
                if scale_tril.shape != (loc.numel(), loc.numel()):
                    raise ValueError(
                        f"scale_tril must have shape (D, D) = {(loc.numel(),) * 2}, got "
                        f"{tuple(scale_tril.shape)}"
                    )
                diag = scale_tril.diagonal()
                if not (torch.isfinite(scale_tril).all() and (diag > 0).all()):
                    raise ValueError("scale_tril must be finite with a positive diagonal")
                self.register_buffer("scale_tril", scale_tril.detach().tril().clone())
            elif scale is not None:
                scale = torch.as_tensor(scale, dtype=loc.dtype, device=loc.device)
                if scale.shape != loc.shape or not (scale > 0).all():
                    raise ValueError("scale must be a positive (D,) tensor like loc")
                self.register_buffer("scale", scale.detach().clone())
            else:  # a shift only
                self.register_buffer("scale", torch.ones_like(loc))
                self.kind = "diagonal"

    @classmethod
    def identity(cls):
        """No preconditioning: ``u = z``."""
        return cls()

    @property
    def is_identity(self):
        return self.kind == "identity"

    def extra_repr(self):
        return f"kind={self.kind}, source={self.source}"

    # ------------------------------------------------------------------ the map
    def unwhiten(self, z):
        """:math:`u = m + L z` over the last dim of ``z`` (any leading shape)."""
        if self.kind == "identity":
            return z
        if self.kind == "dense":
            u = self.loc + z @ self.scale_tril.T
            # the guides whiten their own draws again to score them (a triangular solve
            # forward and back, a quarter of a BNN step): remember which z made this u
            # (not under torch.inference_mode, whose tensors have no version to check)
            if not (u.is_inference() or z.is_inference()):
                self._last_unwhitened = (
                    weakref.ref(u),
                    u._version,
                    z,
                    z._version,
                    self._state_versions(),
                )
            return u
        return self.loc + z * self.scale

    def _state_versions(self):
        return (id(self.loc), self.loc._version, id(self.scale_tril), self.scale_tril._version)

    def __getstate__(self):
        # the remembered draw is a cache of one step's tensors, not state
        state = super().__getstate__()
        state.pop("_last_unwhitened", None)
        return state

    def whiten(self, u):
        """:math:`z = L^{-1}(u - m)` over the last dim of ``u`` (any leading shape).

        For the ``u`` most recently returned by :meth:`unwhiten` (unchanged since, as are
        ``m`` and ``L``) this is the ``z`` it was made from: the same value and, since
        ``whiten`` undoes ``unwhiten``, the same gradient, without the solve."""
        if self.kind == "identity":
            return u
        last = getattr(self, "_last_unwhitened", None)
        if last is not None:
            ref, u_version, z, z_version, versions = last
            if (
                ref() is u
                and u._version == u_version
                and z._version == z_version
                and versions == self._state_versions()
            ):
                return z
        centred = u - self.loc
        if self.kind == "dense":
            flat = centred.reshape(-1, centred.shape[-1]).T
            white = torch.linalg.solve_triangular(self.scale_tril, flat, upper=False)
            return white.T.reshape(centred.shape)
        return centred / self.scale

    def whiten_score(self, score):
        r"""The score in :math:`z`, :math:`L^\top \nabla_u \log p`, over the last dim."""
        if self.kind == "identity":
            return score
        if self.kind == "dense":
            return score @ self.scale_tril
        return score * self.scale

    def log_abs_det(self):
        r""":math:`\log|\det L|` (0 for the identity): the entropy of :math:`u` is that of
        :math:`z` plus this."""
        if self.kind == "identity":
            return 0.0
        diag = self.scale_tril.diagonal() if self.kind == "dense" else self.scale
        return diag.log().sum()

    def covariance(self):
        """:math:`L L^\\top`, ``(D, D)`` (``None`` for the identity)."""
        if self.kind == "identity":
            return None
        if self.kind == "dense":
            return self.scale_tril @ self.scale_tril.T
        return torch.diag(self.scale.pow(2))

    def marginal(self, index):
        """The preconditioner of the coordinates ``index`` alone: the marginal Gaussian's
        mean and a Cholesky factor of its covariance block (an affine whitening of those
        coordinates)."""
        if self.kind == "identity":
            return self
        if self.kind == "diagonal":
            return Preconditioner(self.loc[index], scale=self.scale[index], source=self.source)
        # a factor of the block L_I L_I^T from the QR of L_I^T = Q R (then L_I L_I^T =
        # R^T R), without forming the block: its Cholesky squares L's condition number,
        # and failed on a Laplace with sds from 1e-6 to 1 (as the search once kept on CUDA)
        r = torch.linalg.qr(self.scale_tril[index].to(torch.float64).T, mode="r")[1]
        factor = (r * r.diagonal().sign()[:, None]).T.to(self.scale_tril.dtype)
        return Preconditioner(self.loc[index], scale_tril=factor, source=self.source)

    def diagonal(self):
        """The diagonal preconditioner with the same marginal sds."""
        if self.kind != "dense":
            return self
        sd = self.covariance().diagonal().sqrt()
        return Preconditioner(self.loc, scale=sd, source=self.source)

    def distribution(self):
        """The Gaussian :math:`N(m, LL^\\top)` (``None`` for the identity)."""
        if self.kind == "identity":
            return None
        if self.kind == "dense":
            return torch.distributions.MultivariateNormal(self.loc, scale_tril=self.scale_tril)
        return torch.distributions.Independent(torch.distributions.Normal(self.loc, self.scale), 1)


def preconditioner_of(guide):
    """The :class:`Preconditioner` of a guide of this library, the identity for any other
    guide (Pyro's autoguides, hand-written guides)."""
    found = getattr(guide, "preconditioner", None)
    return found if isinstance(found, Preconditioner) else Preconditioner.identity()


# ---------------------------------------------------------------------------- finding it
def _scorer(space, args, kwargs, backend=None):
    """``u -> (log_density, score)`` of a batch ``u`` ``(N, D)``, detached: replayed from a
    traced graph of the model (one per batch size, :class:`~pyro_implicit.compiled.
    CompiledLogDensity`) with ``backend``, else, and wherever the model cannot be traced,
    Pyro's eager run (:meth:`LatentSpace.score`). The search evaluates the model thousands
    of times at two batch sizes; on small models Pyro's tracing, not the arithmetic, is
    most of each evaluation."""
    compiled = None
    if backend:
        from .compiled import CompiledLogDensity

        compiled = CompiledLogDensity(space, backend)

    def score(u, full_data=True):
        out = None if compiled is None else compiled.score(u, args, kwargs, full_data)
        return out if out is not None else space.score(u, args, kwargs, full_data)

    return score


def _with_progress(score):
    """``(score, bar)``: ``score`` counting its calls on a ``tqdm`` bar that appears only
    once the search has run :data:`SEARCH_PROGRESS_DELAY` seconds."""
    from tqdm import tqdm

    bar = tqdm(
        desc="Preconditioner search",
        unit=" model calls",
        delay=SEARCH_PROGRESS_DELAY,
        **refresh_intervals(),
    )

    def counted(u, full_data=True):
        out = score(u, full_data)
        bar.update()
        return out

    return counted, bar


class _ReachedKnownMode(Exception):
    """Raised by an L-BFGS run of the mode search that has come within reach of a mode
    found already (not a ``RuntimeError``: it passes :func:`_map_by_lbfgs`'s handling)."""


def _map_by_lbfgs(space, u0, args, kwargs, max_iter, score=None, stop=None):
    """Maximise the unconstrained log-density from ``u0`` by L-BFGS; ``(u, log_density)``
    of the best finite point seen (``None`` if none was finite). ``score``: a
    :func:`_scorer` (default: the eager one); ``stop``: ``u -> bool``, asked at every
    finite point, ends the run by raising :class:`_ReachedKnownMode` where true."""
    score = score or _scorer(space, args, kwargs)
    u = u0.detach().clone().requires_grad_(True)
    best = {"u": None, "lp": -math.inf}
    opt = torch.optim.LBFGS(
        [u],
        lr=1.0,
        max_iter=max_iter,
        history_size=20,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        line_search_fn="strong_wolfe",
    )

    def closure():
        lp, grad = score(u.detach()[None])
        loss = -lp[0]
        if torch.isfinite(loss):
            u.grad = -grad[0]
            if lp[0].item() > best["lp"] and torch.isfinite(u.grad).all():
                best["u"], best["lp"] = u.detach().clone(), lp[0].item()
            if stop is not None and stop(u.detach()):
                raise _ReachedKnownMode
        else:
            # a non-finite value: make the line search back off
            loss = torch.full_like(loss, math.inf)
            u.grad = torch.zeros_like(u)
        return loss

    try:
        opt.step(closure)
    except (RuntimeError, ValueError) as e:  # e.g. a distribution's validation
        if best["u"] is None:
            raise RuntimeError(f"L-BFGS failed before a finite point: {e}") from e
    return best["u"], best["lp"]


def _find_modes(
    space, first, args, kwargs, max_iter, score, seed, num_starts=MODE_STARTS, merge=True
):
    r"""The distinct modes that L-BFGS reaches from ``first`` (the ``(u, log_density)`` it
    reached from the model's starting point) and from ``num_starts`` starts uniform on
    :math:`(-2, 2)^D`, heaviest first, and the importance correction's ``{"k_hat",
    "problem"}`` (empty for one mode). The modes are dicts with ``loc``, ``log_density``,
    ``laplace`` (the dense Laplace there), ``first`` (whether it is ``first``'s),
    ``laplace_weight``, the share of :math:`\tilde p(\hat u)\,|\Sigma|^{1/2}` (the Laplace
    estimate of each mode's mass), and ``weight``: where two or more modes are found, their
    masses by importance sampling (:func:`_importance_mode_weights`), or the Laplace
    weights where its k-hat refuses them.

    An end point counts only where it is a strict local maximum (a negative definite
    Hessian) that L-BFGS has converged to (:data:`_MODE_TOLERANCE`): an unbounded density
    (a funnel's neck) leaves none. Two end points within :data:`_SAME_MODE_DISTANCE`
    Laplace sds of each other are one mode, and a run from a start ends as soon as it
    comes that near a mode found already. Deterministic given ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.rand(num_starts, space.latent_dim, generator=gen, dtype=torch.float64)
    modes = []

    def add_mode(u, first=False):
        try:
            laplace = _laplace(space, u, args, kwargs, True, score)
        except ValueError:
            return
        if laplace.clamped:
            return
        lp, grad = score(laplace.loc[None])
        lp = lp[0].item()
        newton = (laplace.scale_tril.T.to(torch.float64) @ grad[0].to(torch.float64)).norm()
        if not (math.isfinite(lp) and newton < _MODE_TOLERANCE):
            return
        if any(
            _within(mode["laplace"], laplace.loc) and _within(laplace, mode["loc"])
            for mode in modes
        ):
            return
        log_mass = lp + float(laplace.log_abs_det())
        modes.append(
            {
                "loc": laplace.loc,
                "log_density": lp,
                "laplace": laplace,
                "log_mass": log_mass,
                "first": first,
            }
        )

    def known(u):
        return any(_within(mode["laplace"], u) for mode in modes)

    if first[0] is not None:
        add_mode(first[0], first=True)
    for start in (4 * starts - 2).to(first[0]):
        try:
            # a run that comes within a found mode's sd ends there: on a unimodal
            # posterior most of the search's cost would be runs to the one mode again
            u, _ = _map_by_lbfgs(space, start, args, kwargs, max_iter, score, stop=known)
        except (RuntimeError, _ReachedKnownMode):  # no finite point, or a known mode
            continue
        if u is not None:
            add_mode(u)
    if modes:
        log_mass = torch.tensor([mode["log_mass"] for mode in modes], dtype=torch.float64)
        for mode, weight in zip(
            modes, (log_mass - log_mass.logsumexp(0)).exp().tolist(), strict=True
        ):
            mode["weight"] = mode["laplace_weight"] = weight
    groups = _relabelling_groups(space, modes) if merge else [[i] for i in range(len(modes))]
    correction = {}
    if len(groups) > 1:
        # over every mode found, relabelled ones too: each is a part of the space whose
        # mass the others' parts must not take
        weights, k_hat, problem = _importance_mode_weights(space, modes, args, kwargs, gen)
        correction = {"k_hat": k_hat, "problem": problem}
        for mode, weight in zip(modes, weights or [], strict=False):
            mode["weight"] = weight
    # one labelling per mode: the weights among the modes the groups keep (every
    # relabelling of a mode holds the same mass, so the kept one's share stands for it
    # however many of its relabellings the starts reached)
    distinct = [modes[group[0]] for group in groups]
    for key in ("weight", "laplace_weight"):
        total = sum(mode[key] for mode in distinct)
        for mode in distinct:
            mode[key] = mode[key] / total
    for mode, group in zip(distinct, groups, strict=True):
        mode["copies"] = len(group)
    return sorted(distinct, key=lambda mode: -mode["weight"]), correction


def _site_values_sorted(space, loc):
    """Each site's constrained values at ``loc``, flattened and sorted."""
    with torch.no_grad():
        values = space.unpack(loc[None])
    return {name: value.reshape(-1).sort().values for name, value in values.items()}


def _relabelling_groups(space, modes):
    """The modes in groups of relabellings of one another (:data:`_RELABEL_LOG_DENSITY`),
    as lists of indices into ``modes``, each led by its first found (the model's own start's
    mode where it is one): a mixture whose components the model does not order has each
    mode once per order of its components, all of the same mass, and a posterior
    only up to that order."""
    values = [_site_values_sorted(space, mode["loc"]) for mode in modes]
    log_volume = [float(mode["laplace"].log_abs_det()) for mode in modes]

    def relabelled(i, j):
        if abs(modes[i]["log_density"] - modes[j]["log_density"]) > _RELABEL_LOG_DENSITY:
            return False
        if abs(log_volume[i] - log_volume[j]) > 10 * _RELABEL_LOG_DENSITY:
            return False
        for name, a in values[i].items():
            b = values[j][name]
            scale = max(a.abs().max().item(), b.abs().max().item(), 1e-12)
            if not torch.allclose(a, b, rtol=0.0, atol=_RELABEL_RTOL * scale):
                return False
        return True

    groups = []
    for i in range(len(modes)):
        for group in groups:
            if relabelled(group[0], i):
                group.append(i)
                break
        else:
            groups.append([i])
    return groups


def _mode_proposals_log_density(u, laplaces):
    r"""``(N, 2K)`` log-densities at the rows of ``u`` of the proposals of
    :func:`_importance_mode_weights`: each mode's Laplace :math:`N(m_k, \Sigma_k)`, then
    each mode's :math:`t_\nu(m_k, w^2 \Sigma_k)`, ``w`` :data:`_MODE_PROPOSAL_WIDTH`."""
    nu, dim = _MODE_PROPOSAL_DF, u.shape[-1]
    t_norm = math.lgamma((nu + dim) / 2) - math.lgamma(nu / 2) - dim / 2 * math.log(nu * math.pi)
    normal, student = [], []
    for laplace in laplaces:
        r2 = laplace.whiten(u).to(torch.float64).pow(2).sum(-1)
        log_det = float(laplace.log_abs_det())
        normal.append(-0.5 * r2 - dim / 2 * math.log(2 * math.pi) - log_det)
        r2 = r2 / _MODE_PROPOSAL_WIDTH**2
        log_det = log_det + dim * math.log(_MODE_PROPOSAL_WIDTH)
        student.append(t_norm - (nu + dim) / 2 * torch.log1p(r2 / nu) - log_det)
    return torch.stack(normal + student, -1)


def _importance_mode_weights(space, modes, args, kwargs, generator):
    r"""``(weights, k_hat, problem)``: the modes' masses by importance sampling, or
    ``weights = None`` and the ``problem`` that refused them.

    The proposal is the equal mixture ``q`` of each mode's Laplace and a Student-t of
    :data:`_MODE_PROPOSAL_DF` degrees of freedom, :data:`_MODE_PROPOSAL_WIDTH` times as
    wide, whose tails keep the weights bounded where a mode's are heavier than its
    Laplace's (defensive importance sampling); :data:`MODE_WEIGHT_DRAWS` draws per mode,
    half from each. A
    mode's mass :math:`\int_{A_k} \tilde p` is the regression estimator of Owen & Zhou
    (2000, "Safe and effective importance sampling", eq. 14) of the mean of
    :math:`\tilde p(u)\,1_{A_k}(u) / q(u)` with the proposals' densities over ``q`` as
    control variates (their means are known: one). Where the mode is as its Laplace, its
    weights are a multiple of a control variate and the estimate is exact; plain
    importance sampling left noise of 0.014 in a weight its Laplace had exactly
    (``benchmarks/results/audit_probes_s66.md``). :math:`A_k` is the part of the space
    :func:`mode_of` gives the mode under the weights themselves, found as a fixed point:
    the part :class:`~pyro_implicit.modes.ModeMixture` and ``compare``'s reference keep
    to the mode is the one whose mass this is. Refused where a mode's weights are
    heavy-tailed: their Pareto k-hat
    (:func:`~pyro_implicit.diagnostics.importance.pareto_smooth`) above 0.7 (Vehtari et
    al. 2024) and their peak above :data:`_MODE_WEIGHT_PEAK` times their mean."""
    from .diagnostics.importance import K_HAT_THRESHOLD, pareto_smooth

    laplaces = [mode["laplace"] for mode in modes]
    loc = laplaces[0].loc
    half = MODE_WEIGHT_DRAWS // 2
    normal, student = [], []
    # the same whitened draws for every mode (common random numbers): where the modes
    # share a non-Gaussian part (latents the modes do not move), its noise is then the
    # same in every mode's estimate and leaves their ratio
    z = torch.randn(2 * half, space.latent_dim, generator=generator, dtype=torch.float64)
    chi2 = torch.randn(half, _MODE_PROPOSAL_DF, generator=generator, dtype=torch.float64)
    z[half:] *= (
        _MODE_PROPOSAL_WIDTH / (chi2.pow(2).sum(-1, keepdim=True) / _MODE_PROPOSAL_DF).sqrt()
    )
    for laplace in laplaces:
        normal.append(laplace.unwhiten(z[:half].to(loc)))
        student.append(laplace.unwhiten(z[half:].to(loc)))
    u = torch.cat(normal + student)
    try:
        with torch.no_grad():
            log_p = torch.cat(
                [
                    space.log_density(block, args, kwargs).to(torch.float64)
                    for block in u.split(_MODE_WEIGHT_BLOCK)
                ]
            )
    except (ValueError, RuntimeError) as e:  # a draw the model's validation refuses
        return None, math.nan, f"the model refused a draw ({e})"
    if torch.isnan(log_p).any() or (log_p == math.inf).any():
        return None, math.nan, "the model's log-density was NaN or infinite at a draw"
    log_g = _mode_proposals_log_density(u, laplaces)
    log_q = log_g.logsumexp(-1) - math.log(log_g.shape[-1])
    log_w = log_p - log_q
    finite = torch.isfinite(log_w)  # -inf: a draw outside the support weighs nothing
    if int(finite.sum()) < 2:
        return None, math.nan, "no draw had a finite log-density"
    weight = (log_w - log_w[finite].max()).exp().cpu()
    # the control variates g_j / q - 1 have mean zero; they sum to zero over j, so one is
    # dropped, and the rest centred for the regression
    controls = (log_g - log_q[:, None]).exp().cpu()[:, 1:] - 1
    controls_mean = controls.mean(0)
    centred = controls - controls_mean
    # each draw's Laplace log-density under every mode: the proposals' Normal columns,
    # computed once for every round of the fixed point below
    laplace_log_density = log_g[:, : len(modes)].T.cpu()
    shares = [mode["laplace_weight"] for mode in modes]
    owner = None
    for _ in range(20):  # each mode's part moves with the weights; a few rounds settle it
        moved = _weighted_owner(laplace_log_density, shares)
        if owner is not None and torch.equal(moved, owner):
            break
        owner = moved
        mass = []
        for k in range(len(modes)):
            y = torch.where(owner == k, weight, 0.0)
            beta = torch.linalg.lstsq(centred, y - y.mean()).solution
            mass.append(max(float(y.mean() - controls_mean @ beta), 0.0))
        shares = [m / sum(mass) for m in mass]
    # the tail of each mode's own weights: pooled, the modes' weights sit at levels as
    # far apart as their Laplace weights' errors, and the Pareto fit to the top of such a
    # mixture read 3.7 where every mode's alone was below 0.3
    k_hats = []
    for k in range(len(modes)):
        own = log_w[finite & (owner == k).to(finite.device)]
        k_hats.append(pareto_smooth(own)[1] if own.numel() > 1 else math.inf)
        peak = (own.max() - own.logsumexp(0) + math.log(own.numel())).exp().item()
        if not k_hats[-1] <= K_HAT_THRESHOLD and peak > _MODE_WEIGHT_PEAK:
            return (
                None,
                k_hats[-1],
                (
                    f"mode {k}'s importance weights are heavy-tailed (k-hat {k_hats[-1]:.2f} > "
                    f"{K_HAT_THRESHOLD}, the largest {peak:.0f} times their mean)"
                ),
            )
    return shares, max(k_hats), None


def _within(laplace, u):
    """Whether ``u`` lies within :data:`_SAME_MODE_DISTANCE` sds of ``laplace``."""
    return laplace.whiten(u).norm().item() < _SAME_MODE_DISTANCE


def _heaviest_mode(find, u_map, lp_map, num_starts, diagnostics, progress):
    """``(u, log_density, laplace)`` of the heaviest mode that ``find`` (:func:`_find_modes`
    with all but its start given) finds besides ``u_map``, which stays where fewer than two
    modes are found (one mode, or an unbounded density's neck); ``laplace`` is a copy of
    the dense Laplace there, where the search made one (``None`` where ``u_map`` stays and
    is no mode). Warns where a second mode carries :data:`MINOR_MODE_WEIGHT` of the mass,
    and where modes are relabellings of one another. Records ``mode_weights``, ``modes``
    (each mode's Laplace, a :class:`Preconditioner`) and ``mode_search_seconds`` in
    ``diagnostics``."""
    import time

    from .errors import LabelSwitchingWarning, MultimodalPosteriorWarning

    mark = time.perf_counter()
    progress.set_postfix_str("modes", refresh=False)
    modes, correction = find((u_map, lp_map))
    diagnostics["mode_search_seconds"] = time.perf_counter() - mark
    diagnostics["mode_weights"] = [mode["weight"] for mode in modes]
    diagnostics["modes"] = [mode["laplace"] for mode in modes]
    copies = [mode["copies"] for mode in modes]
    if any(count > 1 for count in copies):
        diagnostics["mode_relabellings"] = copies
        warnings.warn(
            f"The search found {sum(copies)} modes, {sum(copies) - len(copies)} of them "
            "a relabelling of another: the same values in every site, in another order, at "
            "the same density (label switching, as an unordered mixture's components "
            "have). The methods fit one labelling, as NUTS does from one start; what does "
            "not depend on the labels is the same in every labelling. To fix the labels, "
            "give one site an ordered support (constraints.ordered_vector, e.g. the "
            "components' means), or relabel the draws after the fit. Where the order is not "
            "a labelling (coordinates that mean different things), pass precondition="
            "find_preconditioner(space, space.init_loc, args, merge_relabellings=False) "
            "(pyro_implicit.latent; space = LatentSpace.from_model(model, args)) to keep "
            "each as a mode.",
            LabelSwitchingWarning,
            stacklevel=4,
        )
    if correction:
        diagnostics["mode_laplace_weights"] = [mode["laplace_weight"] for mode in modes]
        diagnostics["mode_weights_k_hat"] = correction["k_hat"]
        diagnostics["mode_weights_source"] = "laplace" if correction["problem"] else "importance"
    if len(modes) < 2:
        own = [mode for mode in modes if mode["first"]]
        return u_map, lp_map, _copy_laplace(own[0]["laplace"]) if own else None
    heaviest = modes[0]
    diagnostics["map_log_density"] = heaviest["log_density"]
    if modes[1]["weight"] >= MINOR_MODE_WEIGHT:
        weights = ", ".join(f"{mode['weight']:.2f}" for mode in modes)
        if correction["problem"]:
            weighed = (
                f"their Laplace weights {weights}, which may be off: importance sampling "
                f"could not check them, as {correction['problem']}"
            )
        else:
            weighed = f"their weights by importance sampling {weights}"
        warnings.warn(
            f"The posterior has at least {len(modes)} modes (L-BFGS from "
            f"{num_starts + 1} starts; {weighed}). The guides start "
            "from one Gaussian at the heaviest and tend to stay in it: on a two-mode "
            "posterior every guide's default put (nearly) all its draws there, about 0.5 "
            "posterior sds off. WeightSpaceSVGD starts its particles in every mode by "
            "these weights, and kept them. For a guide, pyro_implicit.fit_per_mode fits "
            "it once per mode and mixes the fits by these weights (compare takes the "
            "mixture as a row: methods={'label': mixture}). "
            "pyro_implicit.compare's NUTS starts chains in every mode and weighs their "
            "draws the same way. Each mode's Laplace is in the preconditioner's "
            "diagnostics['modes'].",
            MultimodalPosteriorWarning,
            stacklevel=4,
        )
    return heaviest["loc"], heaviest["log_density"], _copy_laplace(heaviest["laplace"])


def significant_modes(preconditioner):
    """``(modes, weights)``: the Laplaces of the modes that ``preconditioner``'s search
    found holding at least :data:`MINOR_MODE_WEIGHT` of the mass each, their weights
    renormalised, where there are two or more; else ``([], [])``."""
    diagnostics = getattr(preconditioner, "diagnostics", None) or {}
    found = [
        (mode, weight)
        for mode, weight in zip(
            diagnostics.get("modes", []), diagnostics.get("mode_weights", []), strict=True
        )
        if weight >= MINOR_MODE_WEIGHT
    ]
    if len(found) < 2:
        return [], []
    total = sum(weight for _, weight in found)
    return [mode for mode, _ in found], [weight / total for _, weight in found]


def mode_counts(weights, total):
    """``total`` split by ``weights`` into whole counts (largest remainders), ``(K,)``
    long: how many particles or draws each mode gets."""
    shares = torch.tensor(weights, dtype=torch.float64) * total
    counts = shares.floor().long()
    counts[(shares - counts).argsort(descending=True)[: total - int(counts.sum())]] += 1
    return counts


def mode_of(u, modes, weights):
    r"""For each row of ``u`` ``(N, D)``, the index of the mode whose weighted Laplace
    density :math:`w_k N(u; m_k, \Sigma_k)` is highest there."""
    with torch.no_grad():
        u = u.to(modes[0].loc)
        return _weighted_owner(
            torch.stack([mode.distribution().log_prob(u) for mode in modes]), weights
        )


def _weighted_owner(log_densities, weights):
    """:func:`mode_of` from each mode's log-density at the draws, ``(K, N)``."""
    log_weights = torch.tensor(
        [math.log(w) if w > 0 else -math.inf for w in weights], dtype=log_densities.dtype
    ).to(log_densities.device)
    return (log_densities + log_weights[:, None]).argmax(0)


def _copy_laplace(laplace):
    """A Laplace of its own for the search to go on from (a method's preconditioner keeps
    its last draw, which the one in ``diagnostics["modes"]`` should not)."""
    found = Preconditioner(laplace.loc.clone(), scale_tril=laplace.scale_tril.clone())
    found.source, found.clamped = laplace.source, laplace.clamped
    return found


def spread_over_modes(preconditioner, z):
    """Whitened draws ``z`` ``(N, D)`` of ``N(0, I)`` spread over the modes the search found
    (:func:`_find_modes`, ``preconditioner.diagnostics["modes"]``): the first rows stay
    draws of the preconditioner's Gaussian (at the heaviest mode), and each other mode gets
    its weight's share of the rows (largest remainders), redrawn from its Laplace as
    :math:`L^{-1}(m_k + L_k z - m)`. Unchanged where fewer than two modes were found.

    SVGD keeps particles in modes far apart in the kernel's scale, so particles started
    this way keep the modes' weights: on two two-mode posteriors (masses 0.76 /
    0.24 and 0.78 / 0.22) ``WeightSpaceSVGD`` ended 0.003-0.021 posterior sds off at seeds
    0-2, against 0.14-0.52 from the heaviest mode's Gaussian alone
    (``benchmarks/results/audit_probes_s65.md``, section 2)."""
    diagnostics = getattr(preconditioner, "diagnostics", None) or {}
    modes, weights = diagnostics.get("modes", []), diagnostics.get("mode_weights", [])
    if len(modes) < 2:
        return z
    counts = mode_counts(weights, z.shape[0])
    spread = z.clone()
    stop = int(counts[0])
    for mode, count in zip(modes[1:], counts[1:].tolist(), strict=True):
        rows = slice(stop, stop + count)
        laplace = mode.to(dtype=z.dtype, device=z.device)
        spread[rows] = preconditioner.whiten(laplace.unwhiten(z[rows]))
        stop += count
    return spread


def _laplace(space, u_map, args, kwargs, dense, score=None):
    """The Laplace approximation at ``u_map`` (a :class:`Preconditioner` with
    ``clamped``, the number of curvatures raised to the floor); raises ``ValueError``
    where the Hessian is not finite or has no negative curvature at all.

    Dense: Newton steps first polish the L-BFGS mode (on a stiff posterior L-BFGS stops
    short along the flat directions; for a Gaussian one step is exact). Where the
    Hessian is not negative definite (a saddle, the flat directions of a network's
    weight symmetries) the curvatures are taken in absolute value, at least the smallest
    positive one: the metric of saddle-free Newton (Dauphin et al. 2014), instead of
    failing. ``score``: a :func:`_scorer` for the Newton steps' values and gradients
    (default: the eager one)."""
    score = score or _scorer(space, args, kwargs)
    if dense:
        for _ in range(_NEWTON_STEPS + 1):
            precision = -space.hessian(u_map, args, kwargs).to(torch.float64)
            if not torch.isfinite(precision).all():
                raise ValueError("the Hessian at the MAP is not finite")
            chol, info = torch.linalg.cholesky_ex(precision)
            if info.item() != 0:
                break
            lp, grad = score(u_map[None])
            step = torch.cholesky_solve(grad[0].to(torch.float64)[:, None], chol)[:, 0]
            if (chol.T @ step).norm() < 1e-8:
                break
            candidate = u_map + step.to(u_map.dtype)
            lp_new = score(candidate[None].detach())[0][0]
            if not lp_new >= lp[0] - 1e-10 * abs(lp[0]):
                break
            u_map = candidate.detach()
        clamped = 0
        if info.item() == 0:
            cov = torch.cholesky_inverse(chol)
        else:
            evals, evecs = torch.linalg.eigh(precision)
            positive = evals > 0
            if not positive.any():
                raise ValueError("the Hessian at the MAP has no negative curvature")
            floor = evals[positive].min()
            clamped = int((evals < floor).sum())
            evals = evals.abs().clamp(min=floor)
            cov = (evecs / evals) @ evecs.T
        scale_tril, info = torch.linalg.cholesky_ex(0.5 * (cov + cov.T))
        if info.item() != 0 or not torch.isfinite(scale_tril).all():
            raise ValueError("the Laplace covariance is numerically singular")
        found = Preconditioner(u_map, scale_tril=scale_tril.to(u_map.dtype), source="laplace")
        found.clamped = clamped
        return found
    gen = torch.Generator().manual_seed(0)
    diag = -space.hessian_diagonal(u_map, args, kwargs, generator=gen).to(torch.float64)
    if not torch.isfinite(diag).all() or not (diag > 0).any():
        raise ValueError("the Hessian diagonal at the MAP is not finite or not negative")
    # coordinates with a non-positive (noisy or non-convex) curvature get the median one
    floor = diag[diag > 0].median()
    clamped = int((diag <= 0).sum())
    diag = torch.where(diag > 0, diag, floor)
    found = Preconditioner(u_map, scale=diag.rsqrt().to(u_map.dtype), source="laplace")
    found.clamped = clamped
    return found


def _diagonal_start(loc, scale, dense):
    if dense:
        return Preconditioner(loc, scale_tril=torch.diag(scale))
    return Preconditioner(loc, scale=scale)


def _curvature_scales(space, u, args, kwargs):
    """Per-coordinate scales :math:`(-H_{ii})^{-1/2}` from Hutchinson's estimate of the
    Hessian's diagonal where it is finite and negative, 1 elsewhere: the start of a
    Gaussian fit where no Laplace exists."""
    try:
        gen = torch.Generator().manual_seed(0)
        diag = -space.hessian_diagonal(u, args, kwargs, generator=gen)
    except (RuntimeError, ValueError):
        return torch.ones_like(u)
    good = torch.isfinite(diag) & (diag > 0)
    return torch.where(good, diag.clamp(min=1e-30).rsqrt(), torch.ones_like(u))


def _elbo_draws(space, precond, eps, args, kwargs):
    """Per-draw :math:`\\log\\tilde p(u) - \\log q(u)` for ``u = m + L eps`` (the
    log-importance weights of the Gaussian ``q = N(m, LL^T)``)."""
    u = precond.unwhiten(eps)
    with torch.no_grad():
        lp = space.log_density(u, args, kwargs)
    log_q = (
        -0.5 * eps.pow(2).sum(-1)
        - 0.5 * eps.shape[-1] * math.log(2 * math.pi)
        - precond.log_abs_det()
    )
    return lp - log_q


def _check_vi_estimator(estimator):
    if estimator not in ("entropy", "stl"):
        raise ValueError(f"vi_estimator must be 'entropy' or 'stl', got {estimator!r}")


class _GaussianFit:
    r"""A Gaussian variational fit in the coordinates of ``start``: ``u = m + L (a + B e)``
    with lower-triangular ``B`` (diagonal for a diagonal ``start`` or beyond
    :data:`_VI_DENSE_LIMIT` coordinates, where ``L`` already carries the correlations), by
    Adam on the reparameterised ELBO. ``estimator="entropy"``: the model's term by its path
    derivative, the exact Gaussian entropy's gradient added; ``"stl"``: the path derivative
    of :math:`\log\tilde p - \log q` with q's parameters held in :math:`\log q`
    ("sticking the landing", Roeder, Wu & Duvenaud 2017): the same expectation,
    with q's own score as a control variate, so its noise vanishes where q matches the
    posterior. It runs in rounds (:meth:`run`) that resume one optimiser, so that
    :func:`find_preconditioner` can go on while the fit still improves and stop when it
    does not."""

    def __init__(
        self,
        space,
        start,
        args,
        kwargs,
        num_draws,
        lr,
        seed,
        check_eps,
        score=None,
        estimator="entropy",
    ):
        _check_vi_estimator(estimator)
        self.estimator = estimator
        self.space, self.start, self.args, self.kwargs = space, start, args, kwargs
        self.score = score or _scorer(space, args, kwargs)
        self.num_draws, self.check_eps, self.steps = num_draws, check_eps, 0
        dim = space.latent_dim
        self.dense = start.kind == "dense" and dim <= _VI_DENSE_LIMIT
        ref = start.loc
        # on the start's device: CPU parameters beside a CUDA start made every fit raise,
        # and the search kept a Laplace that had failed its check
        self.shift = torch.zeros(dim, dtype=ref.dtype, device=ref.device, requires_grad=True)
        # start a tenth as wide as ``start``: a Gaussian fit grows out of a narrow start
        # safely, while draws from a too-wide one (a Laplace along a network's flat
        # directions) can land where the log-density is astronomically low and its
        # gradient useless
        self.log_diag = torch.full(
            (dim,),
            math.log(_VI_START_SCALE),
            dtype=ref.dtype,
            device=ref.device,
            requires_grad=True,
        )
        self.params = [self.shift, self.log_diag]
        groups = [{"params": list(self.params)}]
        if self.dense:
            self.lower = torch.zeros(
                dim, dim, dtype=ref.dtype, device=ref.device, requires_grad=True
            )
            self.params.append(self.lower)
            # Adam moves every entry by about lr per step whatever its gradient: a row of
            # D off-diagonal entries would grow like lr sqrt(D) per step, so their rate is
            # lr / D
            groups.append({"params": [self.lower], "lr": lr / dim})
        self.opt = torch.optim.Adam(groups, lr=lr)
        self.base_lrs = [group["lr"] for group in self.opt.param_groups]
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def run(self, num_steps, decay=1.0, check_every=_VI_CHECK_EVERY):
        """``num_steps`` Adam steps, the rate decayed geometrically by ``decay`` over them
        (1: constant). Returns the mean ELBO of the fit on the check draws, read every
        ``check_every`` steps: a round's level, less noisy than its last iterate's. On a
        non-finite ELBO the fit returns to where the round began and raises
        :class:`ValueError`."""
        saved = [p.detach().clone() for p in self.params]
        steps, elbos = self.steps, []
        dim = self.shift.shape[-1]
        try:
            for step in range(num_steps):
                for group, base in zip(self.opt.param_groups, self.base_lrs, strict=True):
                    group["lr"] = base * decay ** (step / num_steps)
                eps = torch.randn(
                    self.num_draws, dim, generator=self.gen, dtype=self.shift.dtype
                ).to(self.shift.device)
                self.opt.zero_grad()
                self.surrogate(eps).backward()
                self.opt.step()
                self.steps += 1
                if (step + 1) % check_every == 0 or step + 1 == num_steps:
                    elbos.append(self.elbo())
        except (ValueError, RuntimeError):
            with torch.no_grad():
                for p, value in zip(self.params, saved, strict=True):
                    p.copy_(value)
            self.steps = steps
            raise
        return sum(elbos) / len(elbos)

    def surrogate(self, eps):
        """A scalar whose gradient is the estimate of -ELBO's gradient from the draws
        ``eps`` ``(N, D)``; raises :class:`ValueError` where the model's log-density is not
        finite there."""
        white = eps * self.log_diag.exp()
        if self.dense:
            white = white + eps @ self.lower.tril(-1).T
        w = self.shift + white
        u = self.start.unwhiten(w)
        lp, grad = self.score(u.detach())
        if not torch.isfinite(lp.mean() + self.log_diag.sum()):
            raise ValueError("the Gaussian variational fit reached a non-finite ELBO")
        # the reparameterised gradient of -ELBO: the model's score, passed back through
        # u = m + L(a + B e), and the exact Gaussian entropy's, or (stl) minus q's score
        # at w, -B^{-T} e, passed back the same way
        if self.estimator == "stl":
            entropy_part = (w * self._whitened_score(eps)).sum(-1).mean()
        else:
            entropy_part = -self.log_diag.sum()
        return entropy_part - (u * grad).sum(-1).mean()

    def _whitened_score(self, eps):
        r"""q's score at ``w = a + B e`` in the fit's coordinates, :math:`-B^{-\top} e` per
        row, without a gradient (the parameters held in :math:`\log q`)."""
        with torch.no_grad():
            if not self.dense:
                return -eps / self.log_diag.exp()
            # rows x with x^T = e^T B^{-1}, i.e. x = B^{-T} e
            return -torch.linalg.solve_triangular(
                self._dense_factor(), eps, upper=False, left=False
            )

    def _dense_factor(self):
        """The fit's lower-triangular ``B`` (dense fits)."""
        return self.lower.tril(-1) + torch.diag(self.log_diag.exp())

    def elbo(self):
        """The ELBO of the current fit on the check draws (common to every fit)."""
        lw = _elbo_draws(self.space, self.preconditioner(), self.check_eps, self.args, self.kwargs)
        return lw.mean().item() if torch.isfinite(lw).all() else -math.inf

    def expected_log_likelihood(self):
        """The data's log-likelihood averaged over the current fit's check draws
        (:meth:`LatentSpace.log_likelihood`); ``-inf`` where a draw's is not finite."""
        u = self.preconditioner().unwhiten(self.check_eps)
        try:
            with torch.no_grad():
                log_lik = self.space.log_likelihood(u, self.args, self.kwargs)
        except (ValueError, RuntimeError):  # a check draw the model refuses
            return -math.inf
        return log_lik.mean().item() if torch.isfinite(log_lik).all() else -math.inf

    def preconditioner(self):
        start = self.start
        with torch.no_grad():
            loc = start.unwhiten(self.shift)
            if self.dense:
                return Preconditioner(
                    loc, scale_tril=start.scale_tril @ self._dense_factor(), source="gaussian_vi"
                )
            if start.kind == "dense":  # L diag(s) is lower triangular too
                return Preconditioner(
                    loc, scale_tril=start.scale_tril * self.log_diag.exp(), source="gaussian_vi"
                )
            return Preconditioner(
                loc, scale=start.scale * self.log_diag.exp(), source="gaussian_vi"
            )


def _leading_fit(fits, diagnostics):
    """The ``(level, label, fit)`` of ``fits`` that goes on: the higher ELBO on the check
    draws, unless another fit's draws explain the data better by more than
    :data:`_DECISIVE_LOG_LIKELIHOOD` nats of expected log-likelihood; then that one.

    On a network's weights the ELBO ranks the fit from unit scales first (a near-constant
    network, wide and cheap in KL) while the one from the Laplace, about a network that
    fits the data, is what the methods need to start from: on the UCI BNNs (50 hidden
    units, ``compare``'s default ``kivi`` fit, seeds 0-1) the unit-scale fit led on ELBO in
    nine of ten races, by 40-1000 nats, the Laplace's on likelihood in all ten, by 197-851,
    and ``kivi`` fitted around the ELBO's choice ended at a test RMSE of 2.38 on ``energy``
    (0.36 around the Laplace's; 1.43 against 0.37 after 10 000 steps) and 1.36-1.47 on
    ``yacht`` (0.69-0.70). With 10 and 20 hidden units (82-162 weights) the ELBO keeps
    the near-constant network on ``yacht``, ``boston`` and ``wine`` too; keeping the
    Laplace's took ``yacht``'s RMSE from 1.18-1.37 to 0.64-0.78, and ``boston``'s and
    ``wine``'s test log-likelihood 0.01 nats lower. Where the posterior's bulk and a
    funnel's neck explain the data about equally, the ELBO decides: the centred eight
    schools' fit from the
    Laplace, in the neck, explains its eight data points better by at most 0.9 nats where
    the ELBO keeps the other, and every method collapsed into it when it was kept (1.08
    NUTS sds off at seeds 2-4, against 0.02-0.37). On centred hierarchical models with weak
    group effects (30-296 groups) the fit from unit scales explains the data better and
    wins on both counts (``benchmarks/results/preconditioner_start_likelihood.md``,
    ``preconditioner_decisive_likelihood.md``).
    """
    leader = max(fits, key=lambda entry: entry[0])
    if len(fits) == 1:
        return leader
    log_lik = {}
    for _, label, fit in fits:
        log_lik[label] = fit.expected_log_likelihood()
        diagnostics[f"gaussian_vi_log_likelihood_from_{label}"] = log_lik[label]
    explains = max(fits, key=lambda entry: (log_lik[entry[1]], entry[0]))
    if log_lik[explains[1]] > log_lik[leader[1]] + _DECISIVE_LOG_LIKELIHOOD:
        return explains
    return leader


def find_preconditioner(
    space,
    init_loc,
    args=(),
    kwargs=None,
    *,
    dense=None,
    max_iter=200,
    check_draws=256,
    max_log_weight_sd=0.3,
    vi_steps=300,
    vi_max_steps=None,
    vi_tol=0.05,
    vi_draws=16,
    vi_lr=0.05,
    vi_estimator="entropy",
    seed=0,
    compile="fx",
    mode_starts=MODE_STARTS,
    merge_relabellings=True,
):
    r"""Find :math:`(m, L)` with :math:`N(m, LL^\top)` close to the posterior of ``space``.

    1. MAP of the unconstrained log-density by L-BFGS from ``init_loc``;
    2. the Laplace approximation there: :math:`L L^\top = (-\nabla^2 \log\tilde p)^{-1}`
       (dense up to :data:`DENSE_LIMIT` coordinates; beyond, a diagonal from Hutchinson's
       estimate of the Hessian's diagonal);
    3. for a dense Laplace, a check by ``check_draws`` importance weights
       :math:`\log\tilde p - \log q`: where their sd exceeds ``max_log_weight_sd`` (the
       posterior is not Gaussian at its mode) Gaussian variational fits (Adam at rate
       ``vi_lr`` with ``vi_draws`` draws, the gradient estimated as ``vi_estimator``
       says) from two starts, the Laplace and the model's
       starting point with unit scales (a funnel's mode sits in its neck, where a fit
       started there stays). Each runs ``vi_steps`` steps; the one with the higher ELBO
       on the check draws (unless the other's draws explain the data better by more
       than :data:`_DECISIVE_LOG_LIKELIHOOD` nats of expected log-likelihood: on a
       network's weights the ELBO ranks a near-constant network first, a poor start for
       the methods) goes on in rounds of ``vi_steps`` while a round raises its mean
       ELBO by more than ``vi_tol`` nats (up to ``vi_max_steps`` steps in all; ``None``:
       :data:`_VI_MAX_STEPS`, but ``vi_steps`` for a network's weights beyond
       :data:`_VI_DENSE_LIMIT` coordinates, ``space.network``), then settles in a last
       round whose rate decays tenfold. With no
       room for rounds the starts race for a third of a round and the leader finishes
       it, its rate decaying. On a model that subsamples its
       data each step of the fit scores one minibatch (seeded by ``seed``), as SVI does;
       the ELBO on the check draws is the full data's. The fit replaces the Laplace if
       its ELBO, on the same check draws, is higher. A Hessian
       that is not negative definite has its curvatures taken in absolute value
       (saddle-free). Where the MAP or a finite Hessian cannot be had, the variational fits
       start from the best point L-BFGS reached and a :class:`PreconditionerWarning` says
       so. Where those fail too, the identity is returned with a warning: never a silent
       fallback.

    Deterministic given ``seed`` (its own generator; the global streams are untouched).

    :param LatentSpace space: the model's packed space.
    :param torch.Tensor init_loc: ``(D,)`` starting point (e.g. the guide's ``init_loc``).
    :param str vi_estimator: the Gaussian fit's gradient estimate: ``"entropy"``
        (default), the model's path derivative plus the exact Gaussian entropy's gradient,
        or ``"stl"``, the path derivative of :math:`\log\tilde p - \log q` with q's
        parameters held in :math:`\log q` (Roeder, Wu & Duvenaud 2017, "sticking the
        landing": the same expectation, q's own score a control variate whose noise
        vanishes where q is the posterior). ``"stl"`` finds the better Gaussian where the
        ELBO is flat: on the stiff benchmark's stochastic volatility 0.23-0.24 NUTS sds off
        against 0.33-0.38 with 16 draws per step, at an ELBO nearer the optimum
        (``benchmarks/results/preconditioner_stl.md``), and from it ``kivi``, ``sivi``,
        ``livi``, ``gpvi`` and ``asvgd`` end nearer NUTS there, but ``stein_score`` and
        ``wsvgd`` further (``benchmarks/results/stiff_stl.md``, and at held-out seeds
        ``benchmarks/results/stiff_loss_start.md``). So a guide's automatic search takes
        the estimator its loss asks for
        (:attr:`~pyro_implicit.elbo.base.ImplicitELBO.preconditioner_vi_estimator`);
        this function's default stays ``"entropy"``.
    :param int mode_starts: starts beyond ``init_loc`` from which L-BFGS looks for other
        modes (:data:`MODE_STARTS`; 0: none).
    :param bool merge_relabellings: keep one of the modes that are relabellings of one
        another (an unordered mixture's components; :func:`_relabelling_groups`), with a
        :class:`~pyro_implicit.errors.LabelSwitchingWarning`. ``False`` keeps each as a mode
        of its own, for a posterior whose coordinates are exchangeable but not labels.
    :param compile: ``"fx"`` (default): the MAP search and the Gaussian fits score the
        model with traced graphs (:class:`~pyro_implicit.compiled.CompiledLogDensity`, one
        per batch size; the same values to float rounding, and the eager run wherever a
        model cannot be traced); ``"inductor"`` compiles them too; ``False``: Pyro's eager
        run every time.
    :return: the preconditioner, with ``source`` saying which step produced it and
        ``diagnostics`` (a dict: MAP log-density, log-weight sd, ELBOs, seconds).
    :rtype: Preconditioner
    """
    import time

    start_time = time.perf_counter()
    _check_vi_estimator(vi_estimator)  # before the search: its fits' errors are caught
    kwargs = kwargs or {}
    dim = space.latent_dim
    dense = dim <= DENSE_LIMIT if dense is None else bool(dense)
    diagnostics = {"dense": dense}
    rng = pyro.util.get_rng_state()
    progress = None
    try:
        # a model that fails at its own starting point (NaN data, a shape error), or at
        # two draws at once (Python control flow on a latent, nn.Linear on sampled
        # weights), is the user's to fix: its error propagates here instead of becoming
        # a fallback (the search's batches met it as a failed fit, and a warning)
        with torch.no_grad():
            space.log_density(init_loc.expand(2, -1), args, kwargs)
        problem = None
        u_map = None
        score, progress = _with_progress(_scorer(space, args, kwargs, compile))
        progress.set_postfix_str("MAP", refresh=False)
        try:
            u_map, lp_map = _map_by_lbfgs(space, init_loc, args, kwargs, max_iter, score)
            diagnostics["map_seconds"] = time.perf_counter() - start_time
            diagnostics["map_log_density"] = lp_map
        except RuntimeError as e:
            problem = f"the MAP search failed ({e})"
        mode_laplace = None
        # not a network's weights (their symmetries make every start a mode), nor a model
        # that subsamples its data: each start's L-BFGS runs full-data passes, on a
        # 100 000-row regression 4.4 s more for a search of 3.3 s
        # (audit_probes_s65.md, section 2)
        if (
            u_map is not None
            and mode_starts
            and dense
            and dim <= MODE_SEARCH_LIMIT
            and not space.network
            and not space.subsample_plates
        ):
            find = functools.partial(
                _find_modes,
                space,
                args=args,
                kwargs=kwargs,
                max_iter=max_iter,
                score=score,
                seed=seed,
                num_starts=mode_starts,
                merge=merge_relabellings,
            )
            u_map, lp_map, mode_laplace = _heaviest_mode(
                find, u_map, lp_map, mode_starts, diagnostics, progress
            )
        laplace = None
        if u_map is not None:
            try:
                mark = time.perf_counter()
                progress.set_postfix_str("Laplace", refresh=False)
                # the mode search's Laplace at u_map where it made one (the same
                # computation: a dense Hessian is seconds on a model of much data)
                laplace = mode_laplace
                if laplace is None:
                    laplace = _laplace(space, u_map, args, kwargs, dense, score)
                diagnostics["laplace_seconds"] = time.perf_counter() - mark
            except ValueError as e:
                problem = f"{e}"
        chosen = laplace
        # beyond the dense limit the check is not run, nor are its draws made: the sd of
        # a sum of D noisy log-ratios grows like sqrt(D) (a diagonal from 64 probes at
        # D = 2e5 gave 4.6 on an exactly Gaussian posterior), a Gaussian fit there took
        # 50 s to end far below the Laplace's ELBO, and the check alone was half of a
        # 10 s search at D = 2e5 (check_draws full-data evaluations)
        needs_vi = laplace is None
        compared = False  # whether a Gaussian fit ended with a finite ELBO to compare
        if needs_vi or dense:  # the check draws: the importance check's and the fits'
            gen = torch.Generator().manual_seed(seed)
            eps = torch.randn(check_draws, dim, generator=gen, dtype=init_loc.dtype).to(init_loc)
        if laplace is not None:
            diagnostics["clamped_curvatures"] = laplace.clamped
        if laplace is not None and dense:
            try:
                lw = _elbo_draws(space, laplace, eps, args, kwargs)
            except (ValueError, RuntimeError):
                # a draw the model refuses (a wide Laplace along a log-scale overflows its
                # scale to inf, which the distribution's validation rejects) fails the check
                lw = torch.full((check_draws,), -math.inf)
            lw_sd = lw.std().item() if torch.isfinite(lw).all() else math.inf
            diagnostics["laplace_log_weight_sd"] = lw_sd
            diagnostics["laplace_elbo"] = lw.mean().item() if math.isfinite(lw_sd) else -math.inf
            needs_vi = not lw_sd <= max_log_weight_sd
        if needs_vi:
            # two starts: the Laplace (or, without one, the MAP with its curvature
            # scales), and the model's own starting point with unit scales, as ADVI
            # starts; the first is right for skewed posteriors, the second for funnels,
            # whose mode sits in the neck where a Gaussian started there stays
            starts = []
            if laplace is not None:
                starts.append(("laplace", laplace))
            elif u_map is not None:
                scale = _curvature_scales(space, u_map, args, kwargs)
                starts.append(("map", _diagonal_start(u_map, scale, dense)))
            starts.append(("init", _diagonal_start(init_loc, torch.ones_like(init_loc), dense)))
            best = diagnostics.get("laplace_elbo", -math.inf) if laplace is not None else None
            # a subsampled model's fit steps on one minibatch each (fresh draws of the
            # seeded stream), as SVI does: a full-data pass per step would cost the number
            # of minibatches times as much; its ELBO on the check draws stays full-data
            vi_score = score
            if space.subsample_plates:
                pyro.set_rng_seed(seed)
                vi_score = functools.partial(score, full_data=False)
            mark = time.perf_counter()
            diagnostics["gaussian_vi_estimator"] = vi_estimator
            progress.set_postfix_str("Gaussian fit", refresh=False)
            # beyond the dense limit the fit only rescales (and shifts) L's columns:
            # fewer draws per step suffice for D + D parameters
            draws = vi_draws if dim <= _VI_DENSE_LIMIT else max(4, vi_draws // 2)
            # a network's weights beyond it: a fit of their scales improves for thousands
            # of steps, and rounds until it stops cost more than the 10% of a default fit
            # the set-up may take (a BNN on boston: 14%, precondition_cost.md), so one
            # round per start, its rate decayed, is all. Any other model goes on in
            # rounds: a 296-group hierarchical regression's fit after one round was 8 NUTS
            # sds off in its scale, after rounds 0.06 (preconditioner_decisive_likelihood.md)
            max_steps = vi_max_steps
            if max_steps is None:
                one_round = dim > _VI_DENSE_LIMIT and space.network
                max_steps = vi_steps if one_round else _VI_MAX_STEPS
            rounds = max_steps >= 3 * vi_steps  # a first round, one more, the settling one
            # without rounds the starts race for a third of the round and only the better
            # one finishes it, its rate decaying: two full rounds were 2 s of a BNN's set-up
            # (boston, D = 751), the start that led at the third the one that won at the end
            race = vi_steps if rounds or len(starts) == 1 else max(1, vi_steps // 3)
            fits = []
            for label, vi_start in starts:
                try:
                    fit = _GaussianFit(
                        space,
                        vi_start,
                        args,
                        kwargs,
                        draws,
                        vi_lr,
                        seed,
                        eps,
                        vi_score,
                        vi_estimator,
                    )
                    level = fit.run(race, decay=1.0 if rounds or race < vi_steps else 0.1)
                except (ValueError, RuntimeError) as e:
                    problem = (problem + "; " if problem else "") + (
                        f"the Gaussian fit from the {label} failed ({e})"
                    )
                    continue
                diagnostics[f"gaussian_vi_elbo_from_{label}"] = level
                fits.append((level, label, fit))
            if fits:
                # only the better start goes on, round by round while its ELBO on the
                # check draws still rises: a funnel's fit widens for thousands of steps
                # (the centred eight schools: 1.5 NUTS sds off after 300, 0.3 after
                # 2000), a near-Gaussian one is done in a few hundred
                level, label, fit = _leading_fit(fits, diagnostics)
                try:
                    while rounds and fit.steps + 2 * vi_steps <= max_steps:
                        risen = fit.run(vi_steps)
                        if not risen > level + vi_tol:
                            break
                        level = risen
                    # a decaying rate settles the last iterate at the optimum instead of
                    # leaving it one draw of Adam's jitter around it
                    if rounds:
                        fit.run(vi_steps, decay=0.1)
                    elif race < vi_steps:
                        fit.run(vi_steps - race, decay=0.1)
                except (ValueError, RuntimeError) as e:
                    problem = (problem + "; " if problem else "") + (
                        f"the Gaussian fit from the {label} failed after {fit.steps} steps "
                        f"({e}); its last finite state is kept"
                    )
                vi = fit.preconditioner()
                try:
                    elbo_vi = fit.elbo()
                except (ValueError, RuntimeError):  # a check draw the model refuses
                    elbo_vi = -math.inf
                diagnostics["gaussian_vi_start"] = label
                diagnostics["gaussian_vi_steps"] = fit.steps
                if not math.isfinite(elbo_vi):
                    problem = (problem + "; " if problem else "") + (
                        f"the Gaussian fit from the {label} ended at a non-finite ELBO"
                    )
                else:
                    compared = True
                    if best is None or elbo_vi > best:
                        best, chosen = elbo_vi, vi
                        diagnostics["gaussian_vi_elbo"] = elbo_vi
            diagnostics["gaussian_vi_seconds"] = time.perf_counter() - mark
        if laplace is not None and needs_vi and not compared:
            warnings.warn(
                "Preconditioner: the Laplace approximation failed its importance check "
                f"(log-weight sd {diagnostics['laplace_log_weight_sd']:.3g} > "
                f"{max_log_weight_sd}) and no Gaussian fit could replace it ({problem}); "
                "the Laplace is used. Pass precondition=Preconditioner(loc, scale_tril) to "
                "give one, or precondition=False to run unpreconditioned.",
                PreconditionerWarning,
                stacklevel=3,
            )
        if laplace is None:
            if chosen is not None:
                warnings.warn(
                    f"Preconditioner: the Laplace approximation failed ({problem}); using a "
                    "Gaussian variational fit instead.",
                    PreconditionerWarning,
                    stacklevel=3,
                )
            else:
                warnings.warn(
                    f"Preconditioner: no Gaussian fit could be found ({problem}); the method "
                    "runs unpreconditioned (raw unconstrained coordinates). Pass "
                    "precondition=Preconditioner(loc, scale_tril) to give one, or "
                    "precondition=False to silence this.",
                    PreconditionerWarning,
                    stacklevel=3,
                )
                chosen = Preconditioner.identity()
    finally:
        pyro.util.set_rng_state(rng)
        if progress is not None:
            progress.close()
    if dim > _VI_DENSE_LIMIT and chosen.kind == "dense" and not chosen.scale_tril.tril(-1).any():
        # beyond _VI_DENSE_LIMIT coordinates the Gaussian fit from unit scales (a network's
        # usual choice) is diagonal in a dense factor: kept diagonal, the same map, every
        # step's (un)whitening D products instead of D^2 (on the Boston BNN, D = 752, a
        # 100-particle product of 57 million)
        chosen = Preconditioner(
            chosen.loc, scale=chosen.scale_tril.diagonal(), source=chosen.source
        )
    diagnostics["seconds"] = time.perf_counter() - start_time
    chosen.diagnostics = diagnostics
    return chosen


def check_precondition(precondition, latent_dim=None):
    """Refuse a ``precondition`` argument other than ``True``, ``False``, ``None`` or a
    :class:`Preconditioner` (``TypeError``), and, given the model's packed size
    ``latent_dim``, a :class:`Preconditioner` of another size (``ValueError``)."""
    if isinstance(precondition, Preconditioner):
        size = None if precondition.is_identity else precondition.loc.numel()
        if latent_dim is not None and size is not None and size != latent_dim:
            raise ValueError(
                f"the given Preconditioner has D={size} but the model's packed latent has "
                f"D={latent_dim}"
            )
    elif not (isinstance(precondition, bool) or precondition is None):
        raise TypeError(
            "precondition must be True (automatic), False (none) or a "
            f"pyro_implicit.latent.Preconditioner, got {precondition!r}"
        )


def resolve_precondition(
    precondition, space, init_loc, args, kwargs, dense=None, vi_estimator="entropy"
):
    """The :class:`Preconditioner` that a method's ``precondition`` argument asks for:
    ``True`` (find it, :func:`find_preconditioner` with ``dense`` and ``vi_estimator``),
    ``False``/``None`` (identity), or a :class:`Preconditioner` given by the user (checked
    against the space's size)."""
    check_precondition(precondition, space.latent_dim)
    if precondition is None or precondition is False:
        return Preconditioner.identity()
    if isinstance(precondition, Preconditioner):
        return precondition.to(dtype=init_loc.dtype, device=init_loc.device)
    if space.subsampled and not space.subsample_plates:
        warnings.warn(
            "Preconditioner: the model subsamples a plate whose minibatches cannot be "
            "enumerated, so no automatic MAP/Laplace fit is made; the method runs "
            "unpreconditioned. Pass precondition=Preconditioner(loc, scale=...) (e.g. from "
            "a full-data fit) or precondition=False to silence this.",
            PreconditionerWarning,
            stacklevel=3,
        )
        return Preconditioner.identity()
    # the search differentiates the model even when a guide is first called under
    # torch.no_grad() (e.g. by Predictive)
    with torch.enable_grad():
        return find_preconditioner(
            space, init_loc, args, kwargs, dense=dense, vi_estimator=vi_estimator
        )
