"""One fit per mode of a posterior with several modes, mixed by the modes' weights.

A guide fitted by a reverse-KL loss from a Gaussian at one mode stays in that mode: on a
two-mode posterior every guide of the library, started at the heaviest mode, was about
0.5 posterior sds off (``benchmarks/results/audit_probes_s65.md``). The preconditioner's
search finds the modes and weighs them by their mass
(:func:`~pyro_implicit.latent.find_preconditioner`); :func:`fit_per_mode` fits the method
once per mode, started at that mode's Laplace, and :class:`ModeMixture` draws from each
fit its mode's share. A fit that wanders out of its mode (a shallow valley) is kept to it:
its draws are those that lie in its mode, each draw's mode being the one whose weighted
Laplace density is highest there (:func:`~pyro_implicit.latent.mode_of`), as the
mode-weighted NUTS reference of :func:`~pyro_implicit.diagnostics.compare` does.
"""

import pyro
import torch
from pyro.infer import SVI
from tqdm import tqdm

from .latent import (
    LatentSpace,
    mode_counts,
    mode_of,
    resolve_precondition,
    significant_modes,
)
from .progress import refresh_intervals
from .random_streams import random_streams_kept

__all__ = ["ModeMixture", "fit_per_mode"]

#: least share of a fit's draws that must lie in its own mode
MIN_SHARE_IN_MODE = 0.05


class ModeMixture:
    """Guides fitted one per mode, drawn from in proportion to the modes' weights.

    :param list guides: one fitted guide per mode (each with ``sample_unconstrained`` and
        ``unpack``, as the library's guides have).
    :param list states: each guide's parameter-store state (Pyro's
        :meth:`~pyro.params.param_store.ParamStoreDict.scope`), so that guides whose
        parameters share names do not read each other's.
    :param list modes: each mode's Laplace (:class:`~pyro_implicit.latent.Preconditioner`).
    :param list weights: the modes' weights, summing to one.
    """

    def __init__(self, guides, states, modes, weights):
        self.guides, self.states = list(guides), list(states)
        self.modes, self.weights = list(modes), list(weights)

    def sample_unconstrained(self, num_samples, max_rounds=20):
        """``(num_samples, D)`` packed unconstrained draws: mode ``k``'s share (largest
        remainders) from its guide's draws that lie in mode ``k``, in random order.

        :raises RuntimeError: where a guide's draws leave its mode (fewer than
            :data:`MIN_SHARE_IN_MODE` of them in it, or too few after ``max_rounds``
            rounds): that fit has not found its mode's mass.
        """
        counts = mode_counts(self.weights, num_samples)
        store = pyro.get_param_store()
        parts = []
        for k, (guide, state, count) in enumerate(
            zip(self.guides, self.states, counts.tolist(), strict=True)
        ):
            if not count:
                continue
            kept, drawn = [], 0
            with store.scope(state), torch.no_grad():
                for _ in range(max_rounds):
                    if sum(len(x) for x in kept) >= count:
                        break
                    u = guide.sample_unconstrained(max(count, 100))
                    drawn += u.shape[0]
                    kept.append(u[mode_of(u, self.modes, self.weights) == k])
                    if sum(len(x) for x in kept) < MIN_SHARE_IN_MODE * drawn:
                        break
            kept = torch.cat(kept)
            if kept.shape[0] < count:
                raise RuntimeError(
                    f"the fit started in mode {k} left it ({kept.shape[0]} of {drawn} "
                    "draws in it): fit that mode with more steps or a lower rate, or use "
                    "WeightSpaceSVGD, whose particles keep their modes"
                )
            parts.append(kept[:count])
        u = torch.cat(parts)
        return u[torch.randperm(u.shape[0])]

    def sample_posterior(self, num_samples):
        """``{site: (num_samples, *shape)}`` constrained draws of every latent site."""
        u = self.sample_unconstrained(num_samples)
        with pyro.get_param_store().scope(self.states[0]), torch.no_grad():
            return self.guides[0].unpack(u)


def fit_per_mode(
    model,
    build,
    *args,
    num_steps=2000,
    lr=1e-2,
    seed=0,
    max_plate_nesting=None,
    progress=True,
    **kwargs,
):
    """Fit a guide once per mode of ``model``'s posterior, started at that mode.

    The preconditioner's search (:func:`~pyro_implicit.latent.find_preconditioner`, from
    the prior medians drawn at ``seed``) finds the modes; each holding at least
    :data:`~pyro_implicit.latent.MINOR_MODE_WEIGHT` of the mass gets a fit of
    ``build(model, precondition=that mode's Laplace)``, ``num_steps`` steps of
    ``pyro.optim.Adam({"lr": lr})`` in its own parameter-store scope, from
    ``pyro.set_rng_seed(seed)``. With one mode this is one ordinary fit.

    On a two-mode posterior (masses 0.78 / 0.22, a valley of 8.5 nats) every guide default
    of the library fitted this way was 0.008-0.061 posterior sds off at seeds 0-1, against
    0.52-0.53 for one fit from the heaviest mode. On a shallower one (0.76 / 0.24, 4 nats)
    the fits from the lighter mode of ``sivi``, ``gpvi`` and ``asvgd`` wandered into the other
    (a fifth to a third of their draws stayed). Mixed without keeping each fit to its
    mode they were 0.37-0.46 off; kept to it, every default was 0.002-0.129 off
    (``benchmarks/results/audit_probes_s65.md``, section 4).

    :param callable build: ``(model, precondition) -> (guide, loss)``, e.g.
        ``lambda m, p: (ImplicitGuide(m, precondition=p), SteinScoreELBO())``.
    :return: the fits and the modes' weights; :func:`~pyro_implicit.diagnostics.compare`
        takes it as a fitted row (``methods={"label": mixture}``) to set it beside NUTS.
    :rtype: ModeMixture
    """
    if max_plate_nesting is None:
        from .diagnostics.draws import guess_max_plate_nesting  # diagnostics import this

        max_plate_nesting = guess_max_plate_nesting(model, *args, **kwargs)
    with random_streams_kept(seed):
        space = LatentSpace.from_model(model, args, kwargs, max_plate_nesting)
    found = resolve_precondition(True, space, space.init_loc, args, kwargs)
    modes, weights = significant_modes(found)
    if not modes:
        modes, weights = [found], [1.0]
    store = pyro.get_param_store()
    guides, states = [], []
    for k, mode in enumerate(modes):
        with store.scope() as state:
            pyro.set_rng_seed(seed)
            guide, loss = build(model, mode)
            svi = SVI(model, guide, pyro.optim.Adam({"lr": lr}), loss)
            steps = tqdm(
                range(num_steps),
                desc=f"mode {k + 1}/{len(modes)}",
                disable=not progress,
                **refresh_intervals(),
            )
            for _ in steps:
                svi.step(*args, **kwargs)
        guides.append(guide)
        states.append(state)
    return ModeMixture(guides, states, modes, weights)
