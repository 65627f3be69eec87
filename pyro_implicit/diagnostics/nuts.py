"""Reference posteriors from Pyro's NUTS, run one chain at a time.

Chains run sequentially in this process (one :class:`~pyro.infer.mcmc.MCMC` per chain with
its own seed) rather than through Pyro's multiprocessing: on a small machine parallel
chains only compete for the same cores, and sequential chains keep every run in a single
process that tests and notebooks can control.
"""

import dataclasses
import functools
import math
import sys
import time

import numpy as np
import pyro
import pyro.poutine as poutine
import pyro.util
import torch
from pyro.infer.autoguide.initialization import init_to_value
from pyro.infer.mcmc import MCMC, NUTS
from pyro.ops.stats import effective_sample_size, split_gelman_rubin

from ..errors import ModelError
from ..latent import (
    LatentSpace,
    check_fixed_supports,
    check_no_point_mass_latents,
    check_no_subsampled_local_latents,
    check_trace_continuous,
    completed_model,
    mode_counts,
    mode_of,
    plate_nesting,
)
from ..progress import refresh_intervals

__all__ = [
    "MAX_R_HAT",
    "MIN_ESS",
    "NUTSResult",
    "check_continuous_latents",
    "check_trace_continuous",
    "run_nuts",
    "weigh_by_modes",
]

#: a reference with a larger R-hat is flagged as weak (Vehtari et al. 2021)
MAX_R_HAT = 1.01
#: a reference with a smaller effective sample size is flagged as weak (idem)
MIN_ESS = 400


@dataclasses.dataclass
class NUTSResult:
    """Output of :func:`run_nuts`.

    :ivar dict samples: site name -> ``(num_chains * num_samples, ...)`` constrained draws,
        chain after chain.
    :ivar dict samples_by_chain: site name -> ``(num_chains, num_samples, ...)``.
    :ivar dict diagnostics: site name -> ``{"r_hat": Tensor, "ess": Tensor}`` with the
        site's event shape: split Gelman-Rubin R-hat and effective sample size over all
        chains (:mod:`pyro.ops.stats`).
    :ivar int num_divergences: post-warmup divergent transitions over all chains.
    :ivar float wall_time: seconds for the whole call.
    :ivar list divergences_by_chain: post-warmup divergences of each chain.
    :ivar list acceptance_rate_by_chain: mean post-warmup acceptance rate of each chain.
    :ivar list seeds: the seed each chain ran with.
    :ivar list diverging_draws: per chain, the indices of its post-warmup draws whose
        transition diverged (ArviZ's ``sample_stats.diverging``).
    :ivar list mode_weights: ``None``, or, for a run whose chains started in several modes
        (:func:`weigh_by_modes`), the modes' weights that ``samples`` follow; its
        ``samples_by_chain`` are then the chains as run, and ``diagnostics`` are taken
        within each mode, the worst kept.
    """

    samples: dict
    samples_by_chain: dict
    diagnostics: dict
    num_divergences: int
    wall_time: float
    divergences_by_chain: list = dataclasses.field(default_factory=list)
    acceptance_rate_by_chain: list = dataclasses.field(default_factory=list)
    seeds: list = dataclasses.field(default_factory=list)
    diverging_draws: list = dataclasses.field(default_factory=list)
    mode_weights: list = None

    def _finite(self, key):
        values = [d[key].reshape(-1) for d in self.diagnostics.values()]
        values = torch.cat(values) if values else torch.zeros(0)
        return values[torch.isfinite(values)]

    @property
    def max_r_hat(self):
        """Largest R-hat over all sites and coordinates. Coordinates that are constant in
        every chain (the fixed entries of an LKJ Cholesky factor) have none and are left
        out; ``nan`` only if no coordinate has one."""
        values = self._finite("r_hat")
        return float(values.max()) if values.numel() else math.nan

    @property
    def min_ess(self):
        """Smallest effective sample size over all sites and (non-constant) coordinates."""
        values = self._finite("ess")
        return float(values.min()) if values.numel() else math.nan

    def weakness(self):
        """Why this run is a weak reference (``None`` if it is not): an R-hat above
        :data:`MAX_R_HAT` or an effective sample size below :data:`MIN_ESS` (Vehtari et al.
        2021), or divergences. Its error columns are then noisy or biased."""
        reasons = []
        if self.max_r_hat > MAX_R_HAT:
            reasons.append(f"max r_hat {self.max_r_hat:.3f} > {MAX_R_HAT}")
        if self.min_ess < MIN_ESS:
            reasons.append(f"min ESS {self.min_ess:.0f} < {MIN_ESS}")
        if self.num_divergences:
            reasons.append(f"{self.num_divergences} divergences")
        return "; ".join(reasons) or None


def _full_data_space(model, args, kwargs, max_plate_nesting):
    """The model's :class:`~pyro_implicit.latent.LatentSpace` when it subsamples a plate
    (NUTS then samples its full-data posterior through a potential function), else
    ``None``. Refuses a support that moves with another latent (:func:`~pyro_implicit.
    latent.check_fixed_supports`)."""
    from ..latent import _is_subsampled

    rng = pyro.util.get_rng_state()
    try:
        with torch.no_grad(), poutine.block():
            trace = poutine.trace(model).get_trace(*args, **kwargs)
    finally:
        pyro.util.set_rng_state(rng)
    # Pyro's NUTS maps each site through one transform too
    check_no_point_mass_latents(trace, "NUTS")
    check_fixed_supports(model, trace, args, kwargs, "NUTS")
    if not _is_subsampled(trace):
        return None
    check_no_subsampled_local_latents(trace, "NUTS on the full data")
    mpn = plate_nesting(trace) if max_plate_nesting is None else max_plate_nesting
    space = LatentSpace.from_model(model, args, kwargs, mpn).compile()
    if not space.subsample_plates:
        raise ModelError(
            "the model subsamples a plate whose minibatches cannot be enumerated, so NUTS "
            "has no full-data likelihood to sample: run the reference without subsampling "
            "(subsample_size=None)"
        )
    return space


class _Potential(torch.autograd.Function):
    """Minus the log-density of one packed point from ``score``, a ``u -> (log_density,
    score)`` of a batch (:meth:`~pyro_implicit.latent.LatentSpace.score`), with the score
    as its gradient: a traced graph then serves NUTS's every gradient."""

    @staticmethod
    def forward(ctx, u, score):
        log_density, grad = score(u.detach()[None])
        ctx.save_for_backward(grad[0])
        return -log_density[0]

    @staticmethod
    def backward(ctx, upstream):
        (grad,) = ctx.saved_tensors
        return -upstream * grad, None


def _full_data_kernel(space, args, kwargs, nuts_kwargs):
    """NUTS on the packed unconstrained latent of a subsampled model, whose potential is
    minus the full-data log-density (the mean of minibatches covering every index, see
    :meth:`~pyro_implicit.latent.LatentSpace.log_density`): a stochastic minibatch
    potential would break NUTS's energy conservation. The space's traced graph
    (:meth:`~pyro_implicit.latent.LatentSpace.compile`) gives the potential and its
    gradient, the minibatches stacked in one replay where they are few; a model that
    cannot be traced runs eagerly."""

    def score(u):
        return space.score(u, args, kwargs)

    def potential(params):
        return _Potential.apply(params["u"], score)

    options = {k: v for k, v in nuts_kwargs.items() if k != "max_plate_nesting"}
    return NUTS(potential_fn=potential, **options), {"u": space.init_loc.clone()}


def check_continuous_latents(model, *args, **kwargs):
    """Trace ``model`` once and raise if it has a discrete latent sample site.

    A site counts as discrete if it is not observed and its distribution has enumerable
    support or a discrete support constraint. Plate subsample sites are ignored. The
    model is run with the current global RNG state.

    :param callable model: a Pyro model.
    :raises ModelError: naming the first discrete latent site.
    """
    check_trace_continuous(poutine.trace(model).get_trace(*args, **kwargs))


def _chain_seeds(seed, num_chains):
    # Independent, well-mixed seeds per chain: seed + i would make chain 1 of seed 0
    # identical to chain 0 of seed 1.
    states = np.random.SeedSequence(seed).spawn(num_chains)
    return [int(s.generate_state(1, dtype=np.uint32)[0]) for s in states]


def run_nuts(
    model,
    *args,
    num_samples=1000,
    warmup_steps=500,
    num_chains=2,
    seed=0,
    max_plate_nesting=None,
    progress_bar=True,
    nuts_kwargs=None,
    initial_points=None,
    **kwargs,
):
    """Sample a Pyro model's posterior with NUTS, chains run one after another.

    Each chain is its own :class:`~pyro.infer.mcmc.MCMC` run (own warmup and step-size /
    mass-matrix adaptation) seeded from ``seed``; the global RNG state (torch, numpy,
    random) is saved and restored, so the call does not perturb the caller's streams.
    ``jit_compile`` is off.

    :param callable model: a Pyro model with continuous latent sites only.
    :param args: positional arguments of ``model``.
    :param int num_samples: post-warmup draws per chain (at least 4, for R-hat).
    :param int warmup_steps: warmup (adaptation) steps per chain.
    :param int num_chains: number of chains.
    :param int seed: master seed; the per-chain seeds are derived from it.
    :param int max_plate_nesting: passed to :class:`~pyro.infer.mcmc.NUTS`; giving it
        skips Pyro's extra trace to guess it.
    :param bool progress_bar: show Pyro's progress bar.
    :param dict nuts_kwargs: further keyword arguments of :class:`~pyro.infer.mcmc.NUTS`
        (e.g. ``target_accept_prob``, ``init_strategy``).
    :param list initial_points: where each chain starts (one per chain): packed
        unconstrained points of the model's :class:`~pyro_implicit.latent.LatentSpace`
        (e.g. the modes of a preconditioner's search); ``None``: NUTS's own start.
    :param kwargs: keyword arguments of ``model`` (so ``model`` may not take keywords
        named like the parameters above).
    A model that subsamples a plate (``pyro.plate(..., subsample_size=...)``) is sampled
    on its full data: NUTS runs on the packed unconstrained latent with minus the full-data
    log-density as its potential (minibatch potentials would break NUTS).

    :return: samples in the constrained space, convergence diagnostics and timing.
    :rtype: NUTSResult
    :raises ValueError: if the model has a discrete latent site, or for invalid counts.
    """
    if num_chains < 1:
        raise ValueError(f"num_chains must be at least 1, got {num_chains}")
    if num_samples < 4:
        raise ValueError(f"num_samples must be at least 4 (split R-hat), got {num_samples}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps}")
    model = completed_model(model)  # obs_mask proper, flat priors drawable
    nuts_kwargs = dict(nuts_kwargs or {})
    nuts_kwargs.setdefault("jit_compile", False)
    if max_plate_nesting is not None:
        nuts_kwargs["max_plate_nesting"] = max_plate_nesting
    if initial_points is not None and len(initial_points) != num_chains:
        raise ValueError(
            f"initial_points needs one point per chain: {len(initial_points)} for "
            f"num_chains={num_chains}"
        )
    seeds = _chain_seeds(seed, num_chains)
    space = _full_data_space(model, args, kwargs, max_plate_nesting)
    starts = _chain_starts(model, args, kwargs, max_plate_nesting, space, initial_points)
    starts = starts or [None] * num_chains

    start = time.perf_counter()
    rng_state = pyro.util.get_rng_state()
    try:
        pyro.set_rng_seed(seeds[0])
        check_continuous_latents(model, *args, **kwargs)
        chains, diverging, acceptance = [], [], []
        # Pyro's bar redraws several times a second: written to a log, a line per chain
        in_log = progress_bar and bool(refresh_intervals())
        for number, chain_seed in enumerate(seeds, 1):
            if in_log:
                print(
                    f"NUTS chain {number}/{len(seeds)}: {warmup_steps} warmup + "
                    f"{num_samples} draws",
                    file=sys.stderr,
                    flush=True,
                )
            pyro.set_rng_seed(chain_seed)
            start_at = starts[number - 1]
            if space is None:
                options = dict(nuts_kwargs)
                if start_at is not None:
                    options["init_strategy"] = init_to_value(values=start_at)
                kernel, initial = NUTS(model, **options), None
            else:
                kernel, initial = _full_data_kernel(space, args, kwargs, nuts_kwargs)
                if start_at is not None:
                    initial = {"u": start_at}
            mcmc = MCMC(
                kernel,
                num_samples=num_samples,
                warmup_steps=warmup_steps,
                num_chains=1,
                disable_progbar=not progress_bar or in_log,
                initial_params=initial,
            )
            mcmc.run(*args, **kwargs)
            draws = mcmc.get_samples(group_by_chain=True)
            if space is not None:
                packed = draws["u"].reshape(-1, space.latent_dim)
                draws = {k: v.unsqueeze(0) for k, v in space.site_values(packed).items()}
            chains.append(draws)
            chain_diag = mcmc.diagnostics()
            diverging.append(list(chain_diag.get("divergences", {}).get("chain 0", [])))
            acceptance.append(float(chain_diag.get("acceptance rate", {}).get("chain 0", math.nan)))
    finally:
        pyro.util.set_rng_state(rng_state)

    samples_by_chain = {
        name: torch.cat([c[name] for c in chains], dim=0).detach() for name in chains[0]
    }
    samples = {name: v.reshape((-1,) + v.shape[2:]) for name, v in samples_by_chain.items()}
    return NUTSResult(
        samples=samples,
        samples_by_chain=samples_by_chain,
        diagnostics=_chain_diagnostics(samples_by_chain),
        num_divergences=sum(len(d) for d in diverging),
        wall_time=time.perf_counter() - start,
        divergences_by_chain=[len(d) for d in diverging],
        acceptance_rate_by_chain=acceptance,
        seeds=seeds,
        diverging_draws=diverging,
    )


def _chain_diagnostics(samples_by_chain):
    """Split R-hat and effective sample size of each site over the chains."""
    return {
        name: {
            "r_hat": split_gelman_rubin(v, chain_dim=0, sample_dim=1),
            "ess": effective_sample_size(v, chain_dim=0, sample_dim=1),
        }
        for name, v in samples_by_chain.items()
    }


def _chain_starts(model, args, kwargs, max_plate_nesting, space, initial_points):
    """Per chain, what its kernel starts from: the constrained site values of its initial
    point, or, on a subsampled model's packed potential (``space``), the point itself;
    ``None`` where ``initial_points`` is ``None`` (NUTS's own start)."""
    if initial_points is None:
        return None
    if space is not None:
        return [torch.as_tensor(u).detach() for u in initial_points]
    rng = pyro.util.get_rng_state()
    try:
        with torch.no_grad(), poutine.block():
            if max_plate_nesting is None:
                max_plate_nesting = plate_nesting(poutine.trace(model).get_trace(*args, **kwargs))
            space = LatentSpace.from_model(model, args, kwargs, max_plate_nesting)
            points = torch.stack([torch.as_tensor(u) for u in initial_points]).to(space.init_loc)
            values = space.site_values(points)
    finally:
        pyro.util.set_rng_state(rng)
    return [{name: v[c] for name, v in values.items()} for c in range(len(initial_points))]


def weigh_by_modes(result, space, modes, weights, seed=0):
    r"""A reference from chains started in several modes of a posterior that NUTS does
    not cross between (:func:`run_nuts` with ``initial_points`` at the modes): each draw
    belongs to the mode whose weighted Laplace density :math:`w_k N(u; m_k, \Sigma_k)` is
    highest at it, and ``samples`` are the draws resampled so that mode ``k`` holds
    ``weights[k]`` of them (evenly spaced within its draws, the modes' draws then shuffled
    by ``seed``). Within a mode NUTS's draws stand; across modes the weights are the
    search's estimate of each mode's mass
    (:func:`~pyro_implicit.latent.find_preconditioner`), which chains that stay in their
    modes cannot give. R-hat and the effective sample size are taken within each mode:
    over the chains that spend most of their draws there (a chain may settle in another
    mode than the one it started in, during its warmup's first long steps), each with its
    draws in that mode, the worst kept.

    :param ~pyro_implicit.latent.LatentSpace space: the packing of the modes' locations.
    :param list modes: each mode's Laplace (:class:`~pyro_implicit.latent.Preconditioner`).
    :param list weights: the modes' weights (summing to 1).
    :rtype: NUTSResult
    :raises ValueError: where a mode with a positive share holds none of the draws.
    """
    with torch.no_grad():
        u = space.pack({s.name: result.samples[s.name] for s in space.sites})
    owner = mode_of(u, modes, weights)
    counts = mode_counts(weights, owner.numel())
    chosen = []
    for k, count in enumerate(counts.tolist()):
        held = (owner == k).nonzero().flatten()
        if count and not held.numel():
            raise ValueError(
                f"no NUTS draw lies in mode {k} (weight {weights[k]:.2f}): its chains left it"
            )
        if count:
            chosen.append(held[torch.linspace(0, held.numel() - 1, count).round().long()])
    order = torch.cat(chosen)
    order = order[torch.randperm(order.numel(), generator=torch.Generator().manual_seed(seed))]
    samples = {name: v[order.to(v.device)] for name, v in result.samples.items()}
    per_group = []
    by_chain = owner.reshape(next(iter(result.samples_by_chain.values())).shape[:2])
    home = by_chain.mode(-1).values  # each chain's mode: where most of its draws lie
    for k in range(len(modes)):
        chains = (home == k).nonzero().flatten().tolist()
        # each home chain's draws in its mode, cut to the shortest (R-hat needs equal runs)
        length = min(((by_chain[c] == k).sum().item() for c in chains), default=0)
        if length >= 4:
            per_group.append(
                _chain_diagnostics(
                    {
                        name: torch.stack([v[c][by_chain[c] == k][:length] for c in chains])
                        for name, v in result.samples_by_chain.items()
                    }
                )
            )
    if not per_group:  # no mode holds four draws of its chains: the chains' own stand
        per_group = [result.diagnostics]
    diagnostics = {
        name: {
            # fmax / fmin: a coordinate constant in one group (no R-hat, nan) keeps the
            # other groups' value
            "r_hat": functools.reduce(torch.fmax, [d[name]["r_hat"] for d in per_group]),
            "ess": functools.reduce(torch.fmin, [d[name]["ess"] for d in per_group]),
        }
        for name in result.diagnostics
    }
    return dataclasses.replace(
        result, samples=samples, diagnostics=diagnostics, mode_weights=list(weights)
    )
