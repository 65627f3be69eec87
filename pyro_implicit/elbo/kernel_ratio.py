r"""``KernelRatioELBO``: KIVI's kernel density-ratio estimate of KL(q || p).

Shi, Sun & Zhu (2018), *Kernel Implicit Variational Inference*. For an implicit q the ELBO

.. math:: \mathcal L = \mathbb E_q[\log p(x \mid z)] - \mathrm{KL}(q \,\|\, p)

has an intractable KL term. KIVI fits the ratio :math:`r = p / q` (the *reverse ratio
trick*, Sec. 3.3: the squared loss is then an expectation under q, like the KL) in an RKHS
by regularised least squares. The fit has a closed form (eq. 6, with p and q swapped):

.. math::
   \hat r(z) = \sum_{i=1}^{n_q} \alpha_i k(z_i^q, z) + \sum_{j=1}^{n_p} \beta_j k(z_j^p, z),
   \quad \beta = \tfrac{1}{\lambda n_p} 1,
   \quad \alpha = -\tfrac{1}{\lambda n_q n_p} (\tfrac{1}{n_q} K_q + \lambda I)^{-1} K_{qp} 1,

and :math:`\widehat{\mathrm{KL}} = -\tfrac{1}{n_q} \sum_j \log \max(\hat r(z^q_j), c)` with
clip value c. Its gradient flows only through the evaluation points :math:`z_j^q = g_\phi
(\epsilon_j)`; the fitted function (coefficients, centres, bandwidth) is held fixed (eq. 7).

Not in the paper: with an adaptive contrast, the loss by default corrects the score of q that
this gradient implies so that it satisfies Stein's identities for constant and linear
functions under the step's draws (:func:`stein_identity_correction`); the paper's estimate
is ``KernelRatioELBO(stein_identity=None)``.
"""

import math
import warnings

import pyro
import torch
from pyro import poutine
from pyro.distributions import MaskedDistribution
from pyro.distributions.torch_distribution import ExpandedDistribution
from pyro.distributions.util import scale_and_mask
from pyro.infer.autoguide import AutoGuideList
from pyro.infer.inspect import get_dependencies

from ..compiled import BACKENDS
from ..contract import SAMPLE
from ..errors import RunawayWarning, UnsupportedPairError
from ..guides.base import implicit_site_info
from ..kernels import RBFKernel, kernel_and_derivative, solve_kernel_system, squared_distances
from ..latent import (
    DrawableFlatPrior,
    LatentSpace,
    preconditioner_of,
    subsampled_plate_of,
    wraps_distribution,
)
from ..random_streams import random_streams_kept
from .base import (
    RUNAWAY_DRIFT,
    ImplicitELBO,
    _StopAfter,
    _StopAfterLatents,
    implicit_guide_sites,
    particle_sum,
    prior_particles,
    unconstrained_particles,
)

__all__ = [
    "RUNAWAY_DRIFT",
    "STEIN_BANDWIDTH_FACTOR",
    "KernelRatioELBO",
    "kernel_kl",
    "kernel_log_ratio",
    "stein_identity_correction",
]


#: the default kernel's length scale under the Stein identity correction, in units of the
#: median pairwise distance of the draws (the paper's median rule without the correction)
STEIN_BANDWIDTH_FACTOR = 0.7

#: ``contrast_rate="auto"`` for a model with its own ``pyro.param``: its posterior moves
#: while q is fitted (empirical Bayes), away from the preconditioner's Gaussian; with the
#: contrast left there q's width wandered 0.47-1.29 and 0.20-1.03 of the exact posterior's
#: (a Normal mean and a regression whose noise scale is learned, seeds 0-2, steps
#: 1000-4000), with r following q at 0.02 0.83-1.03 and from step 2000 0.94-1.03
#: (``benchmarks/results/audit_probes_s59.md``, section 6)
MOVING_CONTRAST_RATE = 0.02


def kernel_log_ratio(q_samples, p_samples, regularizer=1e-3, clip=1e-8, kernel=None):
    r"""Clipped log of KIVI's reverse-ratio estimate :math:`\hat r_{pq} = p / q` at the q
    samples.

    The value uses the cancellation-free form at the q samples,
    :math:`\hat r(Z^q) = \tfrac{1}{n_p}(K_q / n_q + \lambda I)^{-1} K_{qp} 1`; the gradient
    is that of the function form of eq. (5)-(6) with coefficients, kernel centres and
    bandwidth detached (eq. 7). Clipped points have zero gradient. Computed in float64.

    :param torch.Tensor q_samples: ``(n_q, D)`` samples of q (with autograd graph).
    :param torch.Tensor p_samples: ``(n_p, D)`` samples of p (treated as constants).
    :param float regularizer: :math:`\lambda`.
    :param float clip: lower clip of :math:`\hat r` before the log.
    :param kernel: a kernel from :mod:`pyro_implicit.kernels` (default RBF, median rule).
    :return: ``(log_r, info)``: ``(n_q,)`` tensor in the dtype of ``q_samples`` and a dict
        with ``bandwidth``, ``clipped_fraction`` and ``log_ratio_gradient`` (the detached
        ``(n_q, D)`` gradient of ``log_r`` at each draw, float64).
    """
    kernel = RBFKernel() if kernel is None else kernel
    dtype = q_samples.dtype
    q = q_samples.to(torch.float64)
    n_q, n_p = q.shape[0], p_samples.shape[0]
    with torch.no_grad():
        # Kernel centres: the detached q samples, then the prior samples.
        centres = torch.cat([q.detach(), p_samples.detach().to(torch.float64)])
        gram = squared_distances(centres)
        bandwidth = kernel.bandwidth_from_squared_distances(gram)
        # only the q rows: k(q_i, c_j), and dk/d|c - q|^2 for the gradient (by symmetry the
        # transpose of what the centres' columns would give)
        k_rows, dk_rows = kernel_and_derivative(kernel, gram[:n_q], bandwidth)
        k_q, k_qp = k_rows[:, :n_q], k_rows[:, n_q:]
        system = k_q / n_q + regularizer * torch.eye(n_q, dtype=q.dtype, device=q.device)
        rhs = (k_qp.sum(-1) / n_p)[:, None]
        r_value = solve_kernel_system(system, rhs)[:, 0]
        # eq. (6) with p and q swapped: alpha = -r(Z^q) / (lambda n_q), beta = 1/(lambda n_p)
        coef = torch.cat(
            [
                -r_value / (regularizer * n_q),
                torch.full((n_p,), 1.0 / (regularizer * n_p), dtype=q.dtype, device=q.device),
            ]
        )
        # r(z) as a function of the evaluation points only (eq. 7): its gradient at z = q_j
        # is sum_i coef_i dk(c_i, q_j)/dq_j = 2 sum_i coef_i k'_ji (q_j - c_i), with
        # k' = dk/d|c - q|^2 read off the Gram matrix already computed (q_j is centre j).
        weights = dk_rows * coef
        grad_r = 2.0 * (weights.sum(-1, keepdim=True) * centres[:n_q] - weights @ centres)
    # value r_value, gradient grad_r: a first-order surrogate in the evaluation points
    r = r_value + (grad_r * (q - q.detach())).sum(-1)
    log_r = torch.log(torch.clamp(r, min=clip))
    unclipped = r_value > clip
    info = {
        "bandwidth": bandwidth.item(),
        "clipped_fraction": 1.0 - unclipped.double().mean().item(),
        # the gradient of log_r at each draw, without a backward pass (the Stein identity
        # correction reads it)
        "log_ratio_gradient": torch.where(unclipped[:, None], grad_r / r_value[:, None], 0.0),
    }
    return log_r.to(dtype), info


def kernel_kl(q_samples, p_samples, regularizer=1e-3, clip=1e-8, kernel=None):
    r"""KIVI's estimate of :math:`\mathrm{KL}(q \| p)` from samples of both,
    :math:`-\mathrm{mean}_j \log \max(\hat r_{pq}(z^q_j), c)`, differentiable through the q
    samples as in eq. (7). See :func:`kernel_log_ratio` for the arguments.

    :return: ``(kl, info)``.
    """
    log_r, info = kernel_log_ratio(q_samples, p_samples, regularizer, clip, kernel)
    return -log_r.mean(), info


class KernelRatioELBO(ImplicitELBO):
    r"""The ELBO with KIVI's kernel density-ratio estimate of the KL term (Shi et al.,
    2018, Algorithm 1), for any guide that can be sampled by reparameterisation.

    Per step it draws ``num_particles`` joint samples of the guide (one vectorised trace),
    ``num_prior_samples`` samples of the model's prior (the model run forward under a
    particle plate, stopped before the likelihood), maps both to the model's unconstrained
    space (where the KL is the same, as it is invariant under bijections), and estimates

    .. math::
        \hat{\mathcal L} = \frac{1}{n_q} \sum_j \log p(x \mid z_j) - \widehat{\mathrm{KL}},

    where :math:`\log p(x\mid z)` collects all observed sites and factors with Pyro's plate
    scaling (so ``subsample_size`` minibatches are unbiased) and the latents' prior enters
    only through the KL. The KL is estimated jointly over all latent sites, or per group
    when both the guide and the prior factorise across the groups
    (``ImplicitGuide(per_site=True)`` on a BNN: KIVI's layer-wise estimate). Groups whose
    prior is linked (a site's prior depends on another's value, as in a hierarchical model;
    read once with :func:`pyro.infer.inspect.get_dependencies`) are merged, since a sum of
    marginal KLs is not the joint KL there. A ``poutine.scale`` weights the densities as
    ``Trace_ELBO`` does: the model's scale of a latent site multiplies the prior's
    log-density, the guide's scale multiplies :math:`\log q` (the entropy estimate and the
    constraint Jacobian). So ``poutine.scale(model, s)`` tempers the posterior, and KL
    annealing scales the site in both model and guide (:math:`\beta\,\mathrm{KL}`). With
    the prior as contrast the kernel estimates the whole KL at the guide's weight, and the
    prior's remaining weight enters through its exact log-density at q's draws.
    Parameters inside the prior (``pyro.param`` in a latent's distribution) get the exact
    gradient :math:`\mathbb E_q[\nabla_\theta \log p_\theta(z)]`; the kernel estimate
    alone, built from prior draws, would leave them unchanged.

    **What the returned loss is.** ``-``:math:`\hat{\mathcal L}`. The KL *value* is a
    biased estimate: every clipped point contributes :math:`-\log c` (18.4 for the default
    c = 1e-8), so at small ``regularizer`` it is dominated by clipped points, and a large
    ``regularizer`` biases it upward. Use it to monitor training, not as log evidence.
    The *gradient* never sees the clip (clipped points have zero gradient) and is the
    paper's (eq. 7). :attr:`diagnostics` holds the last step's KL, bandwidth and clipped
    fraction per group.

    **The guide's layers.** A guide of this library built by this loss (its first call,
    ``parametrization="auto"``) gets scaled generator layers
    (:class:`~pyro_implicit.guides.networks.ScaledLinear`), which one Adam step cannot
    move by a layer width's worth of learning rates: with standard layers the fits on the
    stiff benchmark ran away from the contrast on most seeds (see ``contrast_rate``).
    q then tends to be too narrow where the posterior is far from the preconditioner's
    Gaussian. Build the guide with ``parametrization="standard"`` for the old behaviour.

    **Gradient spikes.** The gradient of :math:`\log \hat r` is :math:`\nabla \hat r /
    \hat r`, so a draw whose ratio lands just above the clip gets a very large gradient,
    which Adam turns into a step of up to about 30 learning rates. On a UCI BNN with the
    paper's settings this shows as occasional loss spikes that undo the fit for a few
    hundred steps (``benchmarks/results/kivi_spikes.md``: yacht split 3 ends on one, test
    RMSE 6.02 against about 1 between spikes). ``pyro.optim.ClippedAdam`` with
    ``clip_norm=10``, which clamps each gradient element to +-10, removed them there (final
    RMSE 1.51), but it does not make the fit settle: on a yacht split without a final
    spike the test RMSE kept moving between 0.7 and 1.3 with either optimiser, so check
    the result on held-out data (``benchmarks/results/uci.md``). The paper uses plain Adam.

    Usage::

        svi = SVI(model, ImplicitGuide(model), pyro.optim.Adam({"lr": 1e-3}),
                  KernelRatioELBO(num_particles=100))

    :param int num_particles: :math:`n_q`, guide draws per step (KIVI: 100; 10 for large
        BNNs). All enter both the likelihood term and the ratio fit.
    :param int num_prior_samples: :math:`n_p` (default :math:`n_q`).
    :param float regularizer: :math:`\lambda` (KIVI: 1e-3).
    :param float clip: lower clip of the ratio (KIVI: 1e-8; the paper finds training
        insensitive to it).
    :param kernel: kernel object. Default: :class:`~pyro_implicit.kernels.RBFKernel` at
        :data:`STEIN_BANDWIDTH_FACTOR` (0.7) times the median length scale under the Stein
        identity correction, whose residual is a local feature: with the paper's median
        rule eight schools' heavy-tailed ``tau`` kept narrowing over long runs (sd ratio
        0.40-0.59 after 5000 steps at seeds 0-2, 0.77-0.79 at 0.7;
        ``benchmarks/results/kivi_bandwidth.md``). With ``stein_identity=None`` the paper's
        median rule. A shorter length scale biases the KL *value* further upward.
    :param bool per_group: estimate the KL per group of sites when the guide says it
        factorises (default True); False always estimates one joint KL.
    :param adaptive_contrast: the distribution r that q is compared with. ``False``:
        the prior (the paper's BNN estimator, from prior draws). Otherwise KIVI's
        adaptive contrast (App. D): the kernel estimates KL(q || r) for a Gaussian r and
        :math:`\mathbb E_q[\log p(z) - \log r(z)]` is added exactly (the model's prior
        density and the constraint Jacobians); it is far more accurate whenever the
        posterior is much narrower than the prior, and needs no prior samples. r is a
        diagonal (``"diag"`` or ``True``, the paper's) or full-covariance (``"full"``)
        Gaussian fitted to q's samples each step, ``"moments"``: the full-covariance
        Gaussian of the draws' own maximum-likelihood moments, unshrunk while
        ``num_particles > D + 1`` (its score is then exact at the draws for an affine
        generator; the kernel ratio estimates the rest; ``benchmarks/results/
        stein_score_diagnosis.md`` measured it: the ratio's residual makes q too wide), or
        ``"preconditioner"``: the fixed
        Gaussian :math:`N(m, LL^\top)` of the guide's preconditioner
        (:mod:`pyro_implicit.latent`), so the kernel acts on the whitened draws, where q
        starts exactly at r (a ratio of 1 is where kernel ratio fits are most accurate),
        re-anchored at q's moments when the ratio saturates (``contrast_rate``).
        Default ``"auto"``: ``"preconditioner"`` when every kernel-estimated site is drawn
        by a preconditioned guide whose draws can fill the space (a generator with at
        least as many noise values as outputs: the default up to D = 64), ``"full"`` for a
        preconditioned guide of lower rank (a fixed full-rank contrast is infinitely far
        from it; on a UCI BNN the fit diverged), else ``False`` (the paper's).
    :param contrast_rate: with the ``"preconditioner"`` contrast, the weight of
        each step's draws in a moving average of q's whitened moments that r follows.
        Default ``"auto"``: :data:`MOVING_CONTRAST_RATE` (0.02) for a model with its own
        ``pyro.param``, whose posterior moves away from the preconditioner while q is
        fitted (with r left there q's width wandered 0.20-1.29 of the exact posterior's),
        else 0. At 0 r stays at the preconditioner's Gaussian, the most accurate choice on
        exact Gaussian posteriors (worst mean error over five of them 0.13-0.41 sd at
        seeds 1-3, against 0.19-0.81 at 0.02, seeds 0-3: r's lagging centre biases q);
        but there the exact term :math:`\mathbb E_q[-\log r]` rewards q for leaving r
        while the clipped ratio cannot push back, and on the stiff benchmark 26 of 32 fits
        (8 posteriors, seeds 0-3) ran away with a guide of standard layers, some to
        1e4-1e5 posterior sds with every number finite; at 0.02 none did (largest error
        0.99 sd; ``benchmarks/results/kivi_runaway.md``). With the scaled layers this loss
        asks its guide for (:attr:`guide_parametrization`) none ran away at rate 0 either
        (4 of 32 ended more than 1 sd off, the largest 1.88;
        ``benchmarks/results/kivi_parametrization.md``). Whatever the rate, a step on
        which more than half the ratios were clipped (q has left r) re-anchors r at q's
        moments. A fit whose draws move
        :data:`RUNAWAY_DRIFT` of the preconditioner's sds from its mean gets a
        :class:`~pyro_implicit.RunawayWarning` (once; ``diagnostics[group]["drift"]``
        holds the distance every step).
    :param stein_identity: with an adaptive contrast, make the score of q that the
        ratio's gradient implies satisfy Stein's identities under each step's draws
        (:func:`stein_identity_correction`). Default ``"affine"``: its sample mean is zero
        and its affine part is the draws' own Gaussian's, so the kernel ratio supplies only
        q's non-Gaussian shape. ``"mean"``: only the mean. ``None``: the paper's estimate,
        whose noisy mean no term pulls back: under Adam at a constant rate q's mean
        random-walks, 0.30-0.57 posterior sds on an exact Gaussian posterior at two of five
        seeds (0.03-0.08 at all five with ``"affine"``,
        ``benchmarks/results/kivi_stein_identity.md``). Beyond ``num_particles - 2``
        dimensions per group only the mean is corrected, and there the estimate's gradient
        says nothing of q's spread (about the same at every width in 300 dimensions from
        100 draws; ``benchmarks/results/audit_probes_s64.md``, section 1). UCI BNNs' fits
        did not change when that gradient was made exact; on a 300-latent hierarchical
        model the learning rate and the start set q's spread.
    :param exact_sites: names of latent sites whose guide has a density, such as the
        explicit Gamma q of a noise precision in KIVI's UCI models (App. E), composed with
        an implicit guide through Pyro's ``AutoGuideList`` (a hand-written guide or any of
        Pyro's autoguides). Their part of the KL is the exact Monte Carlo term
        :math:`\mathbb E_q[\log q(z) - \log p(z)]` of ``Trace_ELBO`` (reparameterised)
        instead of the kernel estimate; the kernel estimate covers the sites drawn by
        implicit guides. Every latent site not drawn by an implicit guide must then be named
        here, and a site drawn by an implicit guide is refused. The split needs the prior
        to factorise between these sites and the rest (true of KIVI's BNNs: weights and
        precision are independent); a prior link between them is refused. The default
        ``"auto"`` takes every site not drawn by an implicit guide (so with Pyro's
        ``AutoNormal`` alone the loss is ``Trace_ELBO``'s: a density is never replaced
        by an estimate of it), unless the prior links such a site with a kernel-estimated
        one, in which case every site is kernel-estimated; ``()`` kernel-estimates every
        site, as the paper does.
    :param int max_plate_nesting: the model's plate nesting (guessed if omitted).
    :param bool check_vectorization: check once that the model is safe under the particle
        plate (see :func:`~pyro_implicit.elbo.base.check_vectorized_log_joint`).
    :param compile: ``"fx"`` (default): after the first step, which traces the model and
        the guide through Pyro and checks them, the steps draw the guide's packed latents
        directly and score them with a traced graph of the model's log-density
        (:meth:`~pyro_implicit.latent.LatentSpace.compile`; the same loss to float
        rounding); ``"inductor"`` also compiles that graph; ``False`` traces every step.
        It applies to one implicit guide over every latent site with an adaptive contrast
        (the default); an ``AutoGuideList``, ``exact_sites``, several groups, the prior as
        contrast, KL annealing scales or a model with its own ``pyro.param`` keep the
        traced steps.

    An explicit precision beside a layer-wise implicit BNN posterior (KIVI's UCI set-up)::

        def precision_guide(x, y, subsample_size=None):
            shape = pyro.param("q_shape", torch.tensor(6.0), constraint=constraints.positive)
            rate = pyro.param("q_rate", torch.tensor(6.0), constraint=constraints.positive)
            pyro.sample("precision", dist.Gamma(shape, rate))

        guide = AutoGuideList(model)
        guide.append(ImplicitGuide(poutine.block(model, hide=["precision"]), per_site=True))
        guide.append(precision_guide)
        elbo = KernelRatioELBO(num_particles=100, exact_sites=["precision"])

    References

    [1] `Kernel Implicit Variational Inference`, Jiaxin Shi, Shengyang Sun, Jun Zhu,
        ICLR 2018.
    """

    required_capability = SAMPLE

    # scaled layers: with standard ones Adam's steps, each up to a layer width's worth of
    # learning rates, carried q away from the contrast on 26 of 32 stiff fits (seeds 0-3);
    # with scaled ones 4 of 32 ended more than 1 sd off and none ran away
    # (benchmarks/results/kivi_parametrization.md)
    guide_parametrization = "scaled"

    # its draws' drift is checked every step, with its own advice (_check_runaway)
    checks_own_runaway = True

    # the STL Gaussian fit: see ImplicitELBO.preconditioner_vi_estimator
    preconditioner_vi_estimator = "stl"

    def __init__(
        self,
        num_particles=100,
        num_prior_samples=None,
        regularizer=1e-3,
        clip=1e-8,
        kernel=None,
        per_group=True,
        adaptive_contrast="auto",
        contrast_rate="auto",
        stein_identity="affine",
        exact_sites="auto",
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
        compile="fx",
    ):
        if compile not in (None, False) and compile not in BACKENDS:
            raise ValueError(f"compile must be False or one of {BACKENDS}, got {compile!r}")
        #: backend of the traced log-density of the steps after the first (``None``: every
        #: step traces the model and the guide through Pyro)
        self.compile = compile or None
        self._fast_plans = {}  # (id(model), id(guide)) -> plan of the traced path, or None
        if exact_sites == "auto":
            self.exact_sites = "auto"
        else:
            if isinstance(exact_sites, str):
                exact_sites = (exact_sites,)
            self.exact_sites = tuple(exact_sites)
        if regularizer <= 0:
            raise ValueError(f"regularizer must be positive, got {regularizer}")
        if not 0 < clip < 1:
            raise ValueError(f"clip must lie in (0, 1), got {clip}")
        super().__init__(num_particles, max_plate_nesting, check_vectorization, retain_graph)
        self.num_prior_samples = int(num_prior_samples or num_particles)
        if self.num_prior_samples < 2:
            raise ValueError("num_prior_samples must be at least 2")
        self.regularizer = float(regularizer)
        self.clip = float(clip)
        if kernel is None:
            # under the correction the kernel supplies only q's non-Gaussian residual, a
            # local feature: a shorter length scale kept eight schools' heavy tau from
            # narrowing over long runs (benchmarks/results/kivi_bandwidth.md)
            factor = STEIN_BANDWIDTH_FACTOR if stein_identity else 1.0
            kernel = RBFKernel(bandwidth_factor=factor)
        self.kernel = kernel
        self.per_group = per_group
        if adaptive_contrast not in (
            False,
            True,
            "auto",
            "diag",
            "full",
            "moments",
            "preconditioner",
        ):
            raise ValueError(
                "adaptive_contrast must be 'auto', False, 'diag' (True), 'full', 'moments' or "
                f"'preconditioner', got {adaptive_contrast!r}"
            )
        self.adaptive_contrast = "diag" if adaptive_contrast is True else adaptive_contrast
        if contrast_rate != "auto":
            if isinstance(contrast_rate, str) or not 0 <= contrast_rate <= 1:
                raise ValueError(
                    f"contrast_rate must be 'auto' or lie in [0, 1], got {contrast_rate!r}"
                )
            contrast_rate = float(contrast_rate)
        self.contrast_rate = contrast_rate
        self._model_has_params = False  # read from each traced step's model trace
        if stein_identity not in (None, False, "mean", "affine"):
            raise ValueError(
                f"stein_identity must be 'affine', 'mean' or None, got {stein_identity!r}"
            )
        #: which of Stein's identities the score implied by the ratio is made to satisfy
        self.stein_identity = stein_identity or None
        self._links = {}  # id(model) -> prior links between latent sites (None: unknown)
        # group -> (mean, covariance) of q in the preconditioner's whitened coordinates,
        # an exponential moving average over steps (the "preconditioner" contrast)
        self._contrast_moments = {}
        self._saturated = {}
        self._last_contrast_key = None
        self._last_drift = None
        self._warned_runaway = False

    def _groups(self, guide, names, links):
        """Groups of the kernel-estimated sites: the guide's factorisation, coarsened so
        that no prior link crosses two groups (``links``: pairs of linked latent sites)."""
        groups = None
        if self.per_group:
            groups = [[n for n in g if n in names] for g in _latent_groups(guide)]
            groups = [g for g in groups if g]
            covered = {n for g in groups for n in g}
            rest = [n for n in names if n not in covered]
            if rest:
                groups.append(rest)
        groups = groups or [list(names)]
        if len(groups) == 1:
            return groups
        # union-find over the groups, joined by every prior link
        parent = list(range(len(groups)))
        group_of = {n: i for i, g in enumerate(groups) for n in g}

        def root(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for a, b in links:
            if a in group_of and b in group_of:
                parent[root(group_of[a])] = root(group_of[b])
        merged = {}
        for i, g in enumerate(groups):
            merged.setdefault(root(i), []).extend(g)
        return list(merged.values())

    def _prior_links(self, model, args, kwargs):
        """Pairs of latent sites whose prior is linked (one's distribution depends on the
        other's value), read once per model with Pyro's dependency tracer."""
        key = id(model)
        if key not in self._links:
            try:
                with random_streams_kept():  # reading the structure leaves the stream as is
                    deps = get_dependencies(model, args, kwargs)["prior_dependencies"]
            except Exception as e:  # the tracer cannot follow every model
                warnings.warn(
                    f"KernelRatioELBO could not read the model's prior dependencies ({e!r}); "
                    "it estimates one joint KL over all latent sites instead of one per "
                    "group (always valid, less accurate in high dimension)",
                    stacklevel=4,
                )
                deps = None
            self._links[key] = (
                None if deps is None else {(a, b) for a, ups in deps.items() for b in ups if b != a}
            )
        return self._links[key]

    def _contrast_rate(self):
        """:attr:`contrast_rate`, with ``"auto"`` resolved: :data:`MOVING_CONTRAST_RATE`
        for a model with its own ``pyro.param`` (its posterior moves while q is fitted),
        else 0."""
        if self.contrast_rate != "auto":
            return self.contrast_rate
        return MOVING_CONTRAST_RATE if self._model_has_params else 0.0

    def _tracking_contrast(self, preconditioners, group, q):
        r"""The ``"preconditioner"`` contrast of a group, :math:`r = N(m + L\mu, L\Sigma
        L^\top)` with :math:`(\mu, \Sigma)` the moments of q's whitened draws, averaged
        over steps with weight :attr:`contrast_rate` per step and starting at :math:`(0,
        I)`, the preconditioner's Gaussian itself. Near a Gaussian posterior q stays at the
        preconditioner and so does r (a ratio near 1, where the kernel fit is accurate);
        where q must travel (a funnel's neck), r follows it a few steps behind, so the
        ratio never saturates at the clip (a fixed r let the fit run away there: the exact
        term :math:`\mathbb E_q[-\log r]` rewards moving away from r, and clipped points
        get no pull back).

        Computed in the preconditioner's coordinates :math:`z = L^{-1}(u - m)` (for the
        draws a guide has just unwhitened, its own z: no solve), where r is
        :math:`N(\mu, TT^\top)`, :math:`T T^\top = \Sigma`, and at the start the
        standard normal.

        :return: ``(w, log_r)``: the draws whitened by r, :math:`T^{-1}(z - \mu)`, and
            :math:`\log r(u)` at them, both with the graph of ``q``.
        """
        pre = _preconditioner_marginal(preconditioners, group)
        z = pre.whiten(q)
        z64 = z.detach().to(torch.float64)
        # one average per guide (its preconditioner) and group
        key = (id(preconditioners[group[0]][0]), tuple(group))
        self._last_contrast_key = key
        batch_mean = z64.mean(0)
        # how far q has moved from where it started (the preconditioner's Gaussian)
        self._last_drift = batch_mean.abs().max().item()
        # a saturated ratio (most draws clipped on the last step: q has left r) re-anchors r
        # at q's current moments; otherwise r moves by contrast_rate
        rate = 1.0 if self._saturated.get(key, False) else self._contrast_rate()
        if rate > 0:
            self._contrast_moments[key] = self._moved_moments(
                self._contrast_moments.get(key), z64, batch_mean, rate
            )
        moments = self._contrast_moments.get(key)
        if moments is None:  # r is still the preconditioner's Gaussian: z is r-whitened
            w = z
            log_det = 0.0
        else:
            mean, _, tril = moments
            centred = (z - mean.to(z.dtype)).T
            w = torch.linalg.solve_triangular(tril.to(z.dtype), centred, upper=False).T
            log_det = tril.diagonal().log().sum().to(z.dtype)
        return w, _standard_log_density(w) - log_det - pre.log_abs_det()

    @staticmethod
    def _moved_moments(moments, z, batch_mean, rate):
        """The moving average ``(mean, cov, cholesky factor)`` of the whitened draws ``z``
        after one step of weight ``rate`` (``moments`` ``None``: the start, ``(0, I)``)."""
        dim = z.shape[-1]
        eye = torch.eye(dim, dtype=z.dtype, device=z.device)
        mean, cov = (z.new_zeros(dim), eye) if moments is None else moments[:2]
        centred = z - batch_mean
        batch_cov = centred.T @ centred / max(z.shape[0] - 1, 1)
        # shrunk towards its diagonal, so it stays well conditioned (as _fit_contrast)
        shrink = min(1.0, dim / z.shape[0])
        batch_cov = (1 - shrink) * batch_cov + shrink * torch.diag(batch_cov.diagonal())
        delta = batch_mean - mean
        new_mean = mean + rate * delta
        new_cov = (1 - rate) * (cov + rate * torch.outer(delta, delta)) + rate * batch_cov
        new_cov = 0.5 * (new_cov + new_cov.T)
        new_tril, info = torch.linalg.cholesky_ex(new_cov + 1e-10 * eye)
        if info.item() == 0 and torch.isfinite(new_tril).all():
            return new_mean, new_cov, new_tril
        # q's draws have (nearly) collapsed: keep r where it was
        return moments

    def _contrast_kind(self, guide_trace, names):
        """The contrast of this step (``False``: the prior) and, for
        ``"preconditioner"``, ``{site: (preconditioner, slice of its packed vector)}``."""
        kind = self.adaptive_contrast
        if kind not in ("auto", "preconditioner"):
            return kind, None
        found = {}
        full_rank = True
        for site in implicit_guide_sites(guide_trace):
            guide = implicit_site_info(site)["guide"]
            full_rank = full_rank and getattr(guide, "full_rank", True)
            found.update(_packed_preconditioners(guide))
        if all(name in found for name in names):
            if kind == "auto" and not full_rank:
                # q lives on a manifold of the noise's size: its KL to a fixed full-rank
                # Gaussian is unbounded, and the fit diverges (a UCI BNN, D = 752); a
                # contrast fitted to q's own draws stays usable
                return "full", None
            return "preconditioner", found
        if kind == "preconditioner":
            missing = sorted(set(names) - set(found))
            raise ValueError(
                f"adaptive_contrast='preconditioner' needs every kernel-estimated site drawn "
                f"by a preconditioned guide of this library; {missing} are not (build the "
                "guide with precondition=True, or choose another contrast)"
            )
        return False, None  # "auto" without a preconditioner: the paper's prior contrast

    def _loss_and_surrogate(self, model, guide, args, kwargs):
        plan = self._fast_plans.get((id(model), id(guide)))
        if plan is not None:
            self._model_has_params = False  # a plan is made only for such models
            out = self._fast_loss_and_surrogate(plan, guide, args, kwargs)
            if out is not None:
                return out
        model_trace, guide_trace = self._traces(model, guide, args, kwargs)
        self._model_has_params = any(s["type"] == "param" for s in model_trace.nodes.values())
        n, mpn = self.num_particles, self.max_plate_nesting
        loglik = self.log_likelihood_particles(model_trace).mean()

        latents = {site["name"]: site for site in self.latent_sites(model_trace)}
        self.diagnostics = {}
        links = self._prior_links(model, args, kwargs) if len(latents) > 1 else set()
        exact_sites = self._resolve_exact_sites(latents, guide_trace, links)
        latent_term = self._exact_term(latents, guide_trace, links, exact_sites)
        names = [name for name in latents if name not in exact_sites]
        _refuse_subsampled_latents([latents[name] for name in names])
        ac, preconditioners = self._contrast_kind(guide_trace, names)
        if names and not ac:  # adaptive contrast differentiates log p(z) itself
            latent_term = latent_term + self._prior_parameter_term(
                model, args, kwargs, model_trace, names
            )
        q_parts, log_jac = {}, {}
        for name in names:
            site = latents[name]
            if ac:
                q_parts[name], log_jac[name] = unconstrained_particles(site, n, mpn, True)
            else:
                q_parts[name] = unconstrained_particles(site, n, mpn)
        if names and not ac:
            p_parts = prior_particles(model, args, kwargs, names, self.num_prior_samples, mpn)

        if links is None:  # unknown prior structure: one joint estimate is always valid
            groups = [names] if names else []
        else:
            groups = self._groups(guide, names, links) if names else []
        for group in groups:
            # Pyro's meaning (Trace_ELBO's): the model's scale and mask weight the prior's
            # log-density, element by element; the guide's scale weights log q, the
            # constraint Jacobians included, and is one number for the group's joint q
            priors = [latents[name] for name in group]
            guide_scale = _common_scale([guide_trace.nodes[name] for name in group])
            q = torch.cat([q_parts[name] for name in group], dim=-1)
            apart = any(_drawn_apart(site) or _scaled_apart(site, guide_scale) for site in priors)
            if ac or apart:
                # E_q[log p(z)] per draw, as the model weights it
                log_prior = sum(particle_sum(site["log_prob"], n, mpn) for site in priors)
            if ac:
                log_jacobian = sum(log_jac[name] for name in group)
                contrast_term, kl, info = self._contrast_term(ac, preconditioners, group, q)
                group_term = log_prior.mean() + guide_scale * (log_jacobian.mean() + contrast_term)
            else:
                p = torch.cat([p_parts[name] for name in group], dim=-1).to(q.dtype)
                kl, info = kernel_kl(q, p, self.regularizer, self.clip, self.kernel)
                del info["log_ratio_gradient"]  # diagnostics hold numbers
                group_term = -guide_scale * kl
                if apart:
                    # -KL(q || r) is E_q[log r] + H[q], r the distribution the prior's draws
                    # come from (the prior without its mask or scale, a flat prior's
                    # noise): at the guide's weight the kernel estimate carries r, and
                    # E_q[log p - guide_scale * log r] enters exactly
                    log_r = sum(particle_sum(_drawing_log_prob(site), n, mpn) for site in priors)
                    group_term = group_term + (log_prior.mean() - guide_scale * log_r.mean())
            latent_term = latent_term + group_term
            info["kl"] = kl.item()
            self.diagnostics["+".join(group)] = info

        elbo = loglik + latent_term
        key = (id(model), id(guide))
        if self.compile and key not in self._fast_plans:
            self._fast_plans[key] = self._fast_plan(
                model,
                model_trace,
                guide_trace,
                guide,
                args,
                kwargs,
                latents,
                names,
                exact_sites,
                groups,
                ac,
            )
        # The KL estimate is built to have the eq. (7) gradient, so value and surrogate
        # coincide here.
        return -elbo.detach(), -elbo

    def _contrast_term(self, ac, preconditioners, group, q):
        r"""Adaptive contrast (KIVI App. D): :math:`\mathrm{KL}(q\|p) = \mathbb E_q[\log r -
        \log p] + \mathrm{KL}(q\|r)` with r a Gaussian matched to q (moments detached);
        :math:`\mathrm{KL}(q\|r)` equals the KL of the whitened q to N(0, I), which the kernel
        estimator handles far better than a comparison with a distant prior. Returns
        ``(-E_q[log r] - KL(q||r), KL estimate, info)`` for the draws ``q`` (with graph)."""
        if ac == "preconditioner":
            whitened, log_r = self._tracking_contrast(preconditioners, group, q)
            key = self._last_contrast_key
        else:
            contrast = _fit_contrast(q.detach(), ac)
            whitened = _whiten(contrast, q)
            log_r = _contrast_log_density(contrast, whitened)
        kl, info = self._whitened_kl(whitened)
        log_ratio_gradient = info.pop("log_ratio_gradient", None)
        if self.stein_identity and kl.requires_grad:
            # kl = -mean_j log r(w_j): its gradient at draw j is -grad log r(w_j) / n
            kl_gradient = (
                None if log_ratio_gradient is None else -log_ratio_gradient / whitened.shape[0]
            )
            kl = kl + stein_identity_correction(kl, whitened, self.stein_identity, kl_gradient)
        if ac == "preconditioner":
            self._saturated[key] = info["clipped_fraction"] > 0.5
            info["drift"] = self._last_drift
            self._check_runaway(self._last_drift)
        return -log_r.mean() - kl, kl, info

    def _check_runaway(self, drift):
        """Warn once when q's draws have moved :data:`RUNAWAY_DRIFT` preconditioner sds from
        where they started: the sign of the kernel ratio's runaway, which mostly ends far
        off with every number finite (``benchmarks/results/kivi_runaway.md``,
        ``kivi_drift.md``)."""
        if drift <= RUNAWAY_DRIFT or self._warned_runaway:
            return
        self._warned_runaway = True
        warnings.warn(
            f"KernelRatioELBO: the mean of q's draws has moved {drift:.1f} of the "
            "preconditioner's sds from the preconditioner's mean, where posteriors sit within "
            f"{RUNAWAY_DRIFT:.0f}: the kernel ratio is running away (its known failure on "
            "stiff posteriors). Most such fits end far off, some come back; check this one "
            "(diagnostics[...]['drift'] at the end) before trusting it, or lower the "
            "learning rate (pyro.optim.Adam({'lr': 1e-3}), KIVI's own, where this ran away "
            "at 1e-2 on a 300-latent hierarchical regression), or train the same guide "
            "with SteinScoreELBO(), or use KernelRatioELBO(contrast_rate=0.02), whose "
            "contrast follows q (docs/choosing_settings.md, 'Choosing KernelRatioELBO's "
            "settings').",
            RunawayWarning,
            stacklevel=5,
        )

    def _fast_plan(
        self,
        model,
        model_trace,
        guide_trace,
        guide,
        args,
        kwargs,
        latents,
        names,
        exact_sites,
        groups,
        ac,
    ):
        """What the traced path of the next steps needs, read once from a full step; ``None``
        where a step needs Pyro's traces: an ``AutoGuideList`` or several implicit guides,
        sites with an exact KL term, several groups, the prior as contrast, latent scales
        other than 1, or the model's own parameters. The compiled log-density (the model's
        Python run once per input signature, :meth:`LatentSpace.compile`) then scores the
        guide's draws."""
        sites = implicit_guide_sites(guide_trace)
        if (
            not ac
            or exact_sites
            or len(groups) != 1
            or len(sites) != 1
            or implicit_site_info(sites[0])["guide"] is not guide
            or list(guide._unconstrained_shapes) != groups[0]
            or any(_scaled_apart(latents[name], 1.0) for name in names)
            or _common_scale([guide_trace.nodes[name] for name in names]) != 1.0
            or self._model_has_params  # read from this step's model trace
        ):
            return None
        space = LatentSpace.from_guide(guide, args, kwargs, self.max_plate_nesting - 1, model)
        return space.compile(self.compile), ac, groups[0]

    def _fast_loss_and_surrogate(self, plan, guide, args, kwargs):
        """A step without Pyro traces: the guide's draws ``u`` (with graph), the log-density
        and its score from the compiled graph (one minibatch where the model subsamples, as
        a model trace gives), and the same contrast and kernel terms as a traced step.
        ``None`` where the graph is not available, or a draw or its log-density is not finite
        or beyond :attr:`max_abs_draw` (the traced step then runs, and names the sites if
        the fit has diverged)."""
        space, ac, group = plan
        if not space.compiled.active:
            return None
        # read anew: a loaded state may have replaced the guide's preconditioner
        preconditioners = _packed_preconditioners(guide) if ac == "preconditioner" else None
        with guide.drawing_directly():
            u = guide.sample_unconstrained(self.num_particles)
        log_target = self._compiled_log_target(space, u, args, kwargs)
        if log_target is None:
            return None
        self._last_traces = None
        # the model term: value E[log p(x, u)], gradient E[score . du]
        model_term = log_target.mean()
        contrast_term, kl, info = self._contrast_term(ac, preconditioners, group, u)
        info["kl"] = kl.item()
        self.diagnostics = {"+".join(group): info}
        elbo = model_term + contrast_term
        return -elbo.detach(), -elbo

    def _whitened_kl(self, z):
        """KL(q~ || N(0, I)) of the whitened draws ``z`` (with graph): the kernel estimate,
        against ``num_prior_samples`` standard normal draws. ``(kl, info)``."""
        p = torch.randn(self.num_prior_samples, z.shape[-1], dtype=z.dtype, device=z.device)
        return kernel_kl(z, p, self.regularizer, self.clip, self.kernel)

    def _prior_parameter_term(self, model, args, kwargs, model_trace, names):
        r"""Zero in value, :math:`\mathbb E_q[\nabla_\theta \log p_\theta(z)]` in gradient
        for parameters :math:`\theta` inside the priors of the kernel-estimated sites.

        The kernel estimate sees the prior only through draws, which carry no gradient.
        The model's prior is re-run on the detached draws (stopping before the likelihood)
        so that the gradient reaches the parameters and not the guide through upstream
        latents. Models without ``pyro.param`` calls skip this (a plain 0)."""
        if not self._model_has_params:
            return 0.0
        n, mpn = self.num_particles, self.max_plate_nesting
        detached = poutine.Trace()
        for name in names:
            node = model_trace.nodes[name]
            detached.add_node(name, **{**node, "value": node["value"].detach()})
        vectorized = pyro.plate("_prior_parameters", n, dim=-mpn)(model)
        tracer = poutine.trace(_StopAfterLatents(names)(poutine.replay(vectorized, detached)))
        with poutine.block():
            try:
                tracer(*args, **kwargs)
            except _StopAfter:
                pass
        term = 0.0
        for name in names:
            site = tracer.msngr.trace.nodes[name]
            log_p = site["fn"].log_prob(site["value"])
            if log_p.requires_grad:
                log_p = scale_and_mask(log_p, site["scale"], site["mask"])
                log_p = particle_sum(log_p, n, mpn).mean()
                term = term + (log_p - log_p.detach())
        return term

    def _resolve_exact_sites(self, latents, guide_trace, links):
        """The sites whose KL term is exact: :attr:`exact_sites`, or with ``"auto"`` every
        latent site not drawn by an implicit guide (none if the prior links one of them
        with a kernel-estimated site)."""
        if self.exact_sites != "auto":
            return self.exact_sites
        implicit = _implicitly_drawn(guide_trace)
        exact = tuple(name for name in latents if name not in implicit)
        if links and exact and len(exact) < len(latents):
            if any((a in exact) != (b in exact) for a, b in links if a in latents and b in latents):
                return ()
        return exact

    def _exact_term(self, latents, guide_trace, links, exact_sites):
        r""":math:`\mathbb E_q[\log p(z) - \log q(z)]` over :attr:`exact_sites`, from the
        densities in the two traces with Pyro's own scaling (as ``Trace_ELBO``): the
        model's prior of those sites against every guide site that has a density and is
        not an implicit guide's record of a kernel-estimated site (an autoguide's
        auxiliary site and its ``biject_to`` Jacobian Delta both count)."""
        if not exact_sites:
            return 0.0
        n, mpn = self.num_particles, self.max_plate_nesting
        implicit = _implicitly_drawn(guide_trace)
        for name in exact_sites:
            if name not in latents:
                raise ValueError(
                    f"exact_sites names {name!r}, which is not a latent site of the model "
                    f"(latent sites: {sorted(latents)})"
                )
            if name in implicit:
                raise ValueError(
                    f"exact_sites names {name!r}, but an implicit guide draws it (no density): "
                    "give that site a guide of its own with a density (e.g. through "
                    "AutoGuideList, with the implicit guide built on "
                    f"poutine.block(model, hide=[{name!r}])), or leave it to the kernel estimate"
                )
        unnamed = sorted(set(latents) - implicit - set(exact_sites))
        if unnamed:
            raise ValueError(
                f"latent sites {unnamed} are drawn by a guide with a density but are not in "
                "exact_sites: with exact_sites, name every site not drawn by an implicit "
                "guide, so that the guide's log-density is split correctly"
            )
        if links:
            exact = set(exact_sites)
            crossing = sorted(
                (a, b)
                for a, b in links
                if a in latents and b in latents and (a in exact) != (b in exact)
            )
            if crossing:
                raise ValueError(
                    f"exact_sites {list(exact_sites)} and the other latent sites have "
                    f"linked priors {crossing}: the exact and kernel KL terms add up to the "
                    "KL only when the prior factorises between them"
                )
        log_p = sum(particle_sum(latents[name]["log_prob"], n, mpn) for name in exact_sites)
        log_q = sum(
            particle_sum(site["log_prob"], n, mpn)
            for site in guide_trace.nodes.values()
            if site["type"] == "sample"
            and implicit_site_info(site) is None
            and site["name"] not in implicit
        )
        value = (log_p - log_q).mean()
        self.diagnostics["+".join(exact_sites)] = {
            "kl": -value.item(),
            "clipped_fraction": 0.0,
            "exact": True,
        }
        return value


def _packed_preconditioners(guide):
    """``{site: (preconditioner, slice of the guide's packed vector)}`` of a preconditioned
    guide (empty without a preconditioner)."""
    pre = preconditioner_of(guide)
    found, start = {}, 0
    for name, shape in guide._unconstrained_shapes.items():
        size = math.prod(shape)
        if not pre.is_identity:
            found[name] = (pre, slice(start, start + size))
        start += size
    return found


def _implicitly_drawn(guide_trace):
    """Names of the latent sites drawn by an implicit guide (no density) in this trace."""
    return {
        name
        for site in implicit_guide_sites(guide_trace)
        for name in implicit_site_info(site)["guide"]._unconstrained_shapes
    }


def _latent_groups(guide):
    """Groups of site names across which a guide says q factorises (looking into the parts
    of an ``AutoGuideList``); empty if it says nothing."""
    if hasattr(guide, "latent_groups"):
        return list(guide.latent_groups())
    if isinstance(guide, AutoGuideList):
        return [group for part in guide for group in _latent_groups(part)]
    return []


def _preconditioner_marginal(preconditioners, group):
    """The preconditioner of the group's sites (in group order)."""
    pre = preconditioners[group[0]][0]
    if any(preconditioners[name][0] is not pre for name in group):
        raise ValueError(
            f"sites {group} share one KL estimate but are drawn by different preconditioned "
            "guides; give them one guide"
        )
    slices = [preconditioners[name][1] for name in group]
    contiguous = all(a.stop == b.start for a, b in zip(slices, slices[1:], strict=False))
    if contiguous and slices[0].start == 0 and slices[-1].stop == pre.loc.numel():
        return pre  # the whole packed vector, in order: nothing to marginalise
    index = torch.cat([torch.arange(sl.start, sl.stop) for sl in slices]).to(pre.loc.device)
    return pre.marginal(index)


def _fit_contrast(q, kind):
    """Gaussian r matched to the q samples (moments detached; not validated: its factors
    come from a Cholesky or clamped sds): diagonal (KIVI App. D) or,
    for ``"full"``, with the sample covariance (shrunk towards its diagonal so it stays
    well conditioned when D approaches the number of samples)."""
    n, d = q.shape
    loc = q.mean(0)
    if kind == "moments":
        # the draws' own maximum-likelihood moments while they determine them (n > d + 1):
        # the Gaussian score at the draws is then exact for any affine generator
        # (stein_score.sample_score); beyond, their variances alone (a covariance of rank
        # n - 1 < d has no inverse, and a d x d factor would cost O(d^3) per step)
        centred = q - loc
        sd = centred.pow(2).mean(0).sqrt().clamp(min=1e-12)
        if d >= n - 1:
            return _diagonal_gaussian(loc, sd)
        return _dense_gaussian(loc, centred, n, 1e-12, sd)
    if kind == "full" and d > 1:
        centred = q - loc
        shrink = min(1.0, d / n)
        if shrink == 1.0:
            # shrunk all the way to its diagonal (d >= n): the same Gaussian without a
            # d x d factor (a BNN's D = 753 cost 0.3 s per step that way)
            var = centred.pow(2).sum(0) / (n - 1)
            return _diagonal_gaussian(loc, (var + 1e-10 * var.mean()).sqrt())
        return _dense_gaussian(loc, centred, n - 1, 1e-10, q.std(0), shrink)
    return _diagonal_gaussian(loc, q.std(0).clamp(min=1e-12))


def _diagonal_gaussian(loc, sd):
    return torch.distributions.Independent(
        torch.distributions.Normal(loc, sd, validate_args=False), 1, validate_args=False
    )


def _dense_gaussian(loc, centred, divisor, jitter, sd, shrink=0.0):
    """The Gaussian of the draws' covariance ``centred^T centred / divisor`` (shrunk by
    ``shrink`` towards its diagonal, ``jitter`` times its mean variance added), factored
    in float64: float32 draws that spanned 10 of 40 dimensions (under a degenerate
    preconditioner the search once kept on CUDA, ``gpu_preconditioner_probe.md``) gave a
    covariance whose float32 Cholesky failed. Where even float64 finds no factor, the
    diagonal Gaussian of the sds ``sd``, as for D >= N."""
    c = centred.double()
    cov = c.T @ c / divisor
    if shrink:
        cov = (1 - shrink) * cov + shrink * torch.diag(cov.diagonal())
    cov = cov + jitter * cov.diagonal().mean() * torch.eye(
        cov.shape[-1], dtype=cov.dtype, device=cov.device
    )
    factor, info = torch.linalg.cholesky_ex(cov)
    if info.item() != 0:
        return _diagonal_gaussian(loc, sd.clamp(min=1e-12))
    return torch.distributions.MultivariateNormal(
        loc, scale_tril=factor.to(loc.dtype), validate_args=False
    )


def stein_identity_correction(kl, w, identity="affine", kl_gradient=None):
    r"""Zero in value; in gradient, the correction that makes the score of q implied by a
    KL estimate's gradient satisfy Stein's identities under q's draws.

    For draws :math:`w_j` of q and the contrast :math:`N(0, I)`, the path gradient of
    :math:`\mathrm{KL}(q \| N(0, I))` at draw j is :math:`(w_j + s_j) / n` with
    :math:`s = \nabla \log q`, so an estimate's gradient ``n * grad - w`` *implies* a score
    :math:`\hat s_j`. The true score satisfies, for every q,
    :math:`\mathbb E_q[\nabla \log q] = 0` (Stein's identity for a constant function) and
    :math:`\mathbb E_q[\nabla \log q\, (w - \bar w)^\top] = -I` (for a linear one). A
    kernel estimate from ~100 draws breaks both: its sample mean is noise that no term
    pulls back, so under Adam q's mean random-walks (``benchmarks/results/
    kivi_stein_identity.md``). The correction subtracts the sample mean of :math:`\hat s`
    (``"mean"``) and, with ``"affine"`` and more draws than dimensions plus one, replaces
    the least-squares affine part of :math:`\hat s` in :math:`w` by the one the identity
    fixes, :math:`-\hat C^{-1}(w - \bar w)` (:math:`\hat C` the draws' covariance): the
    score of the draws' own Gaussian, exact at the draws for an affine generator. The
    kernel estimate then contributes only its part orthogonal to affine functions, the
    non-Gaussian shape. With fewer draws than that, only the mean is corrected.

    :param torch.Tensor kl: the estimate, a scalar with the graph of ``w``.
    :param torch.Tensor w: ``(n, D)`` draws of q in coordinates where the contrast is
        :math:`N(0, I)`.
    :param str identity: ``"mean"`` or ``"affine"``.
    :param torch.Tensor kl_gradient: the ``(n, D)`` gradient of ``kl`` in ``w`` if known
        (else one backward pass finds it).
    :return: a scalar tensor, zero, whose gradient is the correction.
    """
    if kl_gradient is None:
        (kl_gradient,) = torch.autograd.grad(kl, w, retain_graph=True)
    n, dim = w.shape
    draws = w.detach().to(torch.float64)
    score = n * kl_gradient.detach().to(torch.float64) - draws  # the implied score
    shift = score.mean(0)
    if identity == "affine" and n > dim + 1:
        centred = draws - draws.mean(0)
        # E[s (w - w_bar)^T] (-I for the true score; the mean of s drops out) and the
        # draws' covariance C; B C = E[s (w - w_bar)^T] + I: B (w - w_bar) is the affine
        # part of s beyond the -C^-1 (w - w_bar) that the identity fixes
        cov = centred.T @ centred / n
        cross = score.T @ centred / n
        cross.diagonal().add_(1.0)
        shift = shift + centred @ torch.linalg.solve(cov, cross, left=False).T
    term = -(shift.to(w.dtype) * w).sum(-1).mean()
    return term - term.detach()


def _standard_log_density(w):
    r""":math:`\log N(w; 0, I)` over the last dim: with the log-determinant of the map that
    whitened them, a Gaussian's log-density at its draws from the one solve that whitens
    them (``log_prob`` would solve again)."""
    return -0.5 * w.pow(2).sum(-1) - 0.5 * w.shape[-1] * math.log(2 * math.pi)


def _contrast_log_density(contrast, whitened):
    r""":math:`\log r` of a Gaussian of :func:`_fit_contrast` at the draws it has whitened
    (:func:`_whiten`): the standard normal's log-density there less the log-determinant of
    the whitening map."""
    if isinstance(contrast, torch.distributions.MultivariateNormal):
        log_det = contrast.scale_tril.diagonal().log().sum()
    else:
        log_det = contrast.base_dist.scale.log().sum()
    return _standard_log_density(whitened) - log_det


def _whiten(contrast, q):
    """Map q samples through the affine map that sends r to N(0, I)."""
    if isinstance(contrast, torch.distributions.MultivariateNormal):
        # one solve with every draw as a right-hand side, not one small solve per draw
        centred = q - contrast.loc
        flat = centred.reshape(-1, centred.shape[-1]).T
        white = torch.linalg.solve_triangular(contrast.scale_tril, flat, upper=False)
        return white.T.reshape(centred.shape)
    base = contrast.base_dist
    return (q - base.loc) / base.scale


def _common_scale(sites):
    """The one ``poutine.scale`` of the guide's sites of a group (q's joint log-density
    has one weight)."""
    scales = set()
    for site in sites:
        scale = torch.as_tensor(site["scale"])
        scales.update(scale.unique().tolist())
    if len(scales) != 1:
        raise UnsupportedPairError(
            "latent sites "
            + ", ".join(repr(s["name"]) for s in sites)
            + f" share one KL estimate but the guide weights them by different scales "
            f"{sorted(scales)}: the estimate is of their joint q, which has one weight. "
            "Scale the guide's sites alike; the model's may differ (its prior is weighted "
            "element by element)"
        )
    return scales.pop()


def _scaled_apart(site, scale):
    """Whether the model weights a latent site's prior by other than ``scale`` anywhere."""
    return bool((torch.as_tensor(site["scale"]) != scale).any())


#: priors whose draws come from another distribution than their density: a
#: ``MaskedDistribution`` (e.g. ``.mask(False)``) draws from its base, a flat prior from
#: its :class:`~pyro_implicit.latent.DrawableFlatPrior` noise
DRAWN_APART = (MaskedDistribution, DrawableFlatPrior)


def _drawn_apart(site):
    """Whether a latent site's prior draws come from another distribution than the model's
    density of it: masked by ``poutine.mask``, or one of :data:`DRAWN_APART`."""
    return site["mask"] is not None or wraps_distribution(site["fn"], DRAWN_APART)


def _drawing(fn):
    """The distribution ``fn``'s draws come from: every ``MaskedDistribution`` in its chain
    of wrappers taken out, a flat prior's noise in place of its zero density."""
    if isinstance(fn, MaskedDistribution):
        return _drawing(fn.base_dist)
    if isinstance(fn, DrawableFlatPrior):
        return fn.noise_distribution()
    if isinstance(fn, torch.distributions.Independent):
        return torch.distributions.Independent(_drawing(fn.base_dist), fn.reinterpreted_batch_ndims)
    if isinstance(fn, ExpandedDistribution):
        return _drawing(fn.base_dist).expand(fn.batch_shape)
    return fn


def _drawing_log_prob(site):
    """The log-density, without mask or scale, of the distribution a latent site's prior
    draws come from (:func:`~pyro_implicit.elbo.traces.prior_particles`)."""
    drawing = _drawing(site["fn"])
    if wraps_distribution(drawing, DRAWN_APART):
        raise UnsupportedPairError(
            f"latent site {site['name']!r}: its prior {site['fn']} holds a mask or a flat "
            "prior inside a wrapper this loss cannot see through, so the prior contrast "
            "cannot score its draws; use KernelRatioELBO(adaptive_contrast='full'), or "
            "poutine.mask around the site instead of the distribution's .mask()"
        )
    return drawing.log_prob(site["value"])


def _refuse_subsampled_latents(sites):
    for site in sites:
        frame = subsampled_plate_of(site)
        if frame is not None:
            raise UnsupportedPairError(
                f"Latent site {site['name']!r} is a local latent inside the subsampled "
                f"plate {frame.name!r} (size {frame.full_size}, subsample_size "
                f"{frame.size}): KernelRatioELBO estimates the KL of global latents "
                "from joint draws and cannot estimate a minibatch of local ones. "
                "Sample local latents outside the subsampled plate, or train them with "
                "SIVI_ELBO and a SemiImplicitEncoder."
            )
