"""One exception type per kind of problem, so that callers can tell them apart:

* :class:`ModelError`: the model cannot be fitted as written (a discrete latent site, a
  model that mixes particles under a vectorised plate, a density that is NaN or fails at
  a draw of its latents); :class:`UnsupportedModelError` is one that uses a construct no
  method here supports (a sequential plate, a local latent of a subsampled plate);
* :class:`PairingError`: a guide that the loss cannot train, or that does not fit the
  loss's rules (:mod:`pyro_implicit.contract`); the message names the pair that works;
* :class:`DataError`: the data are unusable (NaN or infinite observations, a malformed
  data file);
* :class:`DivergenceError`: a fit that has diverged (not a bad input: a run that went
  wrong).

Four warnings live here too: :class:`RunawayWarning`, a fit whose estimator has left the
region where it is accurate (every number finite, the posterior not to be trusted),
:class:`FewParticlesWarning`, a particle method set up with too few particles for its
latent dimension, :class:`MultimodalPosteriorWarning`, a posterior whose search found
more than one mode, and :class:`LabelSwitchingWarning`, modes that are relabellings of
one another.

Each is also the built-in exception these problems raised before it existed
(``ValueError``, ``TypeError``; :class:`UnsupportedPairError` is a ``PairingError`` and a
``NotImplementedError``, :class:`UnsupportedModelError` a ``ModelError`` and a
``NotImplementedError``), so ``except ValueError`` and ``pytest.raises(TypeError)`` keep
working. :class:`PyroImplicitError` is the base of them all.
"""

import numbers

__all__ = [
    "DataError",
    "DivergenceError",
    "FewParticlesWarning",
    "ModelError",
    "LabelSwitchingWarning",
    "MultimodalPosteriorWarning",
    "PairingError",
    "PyroImplicitError",
    "RunawayWarning",
    "UnsupportedModelError",
    "UnsupportedPairError",
    "VectorizationError",
]


def check_count(name, value, least=1):
    """Refuse a count that is not an integer ``>= least`` (``ValueError`` naming it): a
    float such as 2.5 would otherwise be truncated somewhere, or fail deep inside torch."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


class PyroImplicitError(Exception):
    """Base of the library's exceptions."""


class ModelError(PyroImplicitError, ValueError):
    """The model cannot be fitted as written; the message names the site and the fix."""


class VectorizationError(ModelError):
    """The model gives different log-densities under a vectorised particle plate than
    when each draw is evaluated on its own."""


class UnsupportedModelError(ModelError, NotImplementedError):
    """The model uses a construct no method here supports (a sequential plate, a local
    latent inside a subsampled plate); the message names the site and the rewrite."""


class PairingError(PyroImplicitError, TypeError):
    """A guide that the loss cannot train (it lacks the capability the loss needs, see
    :mod:`pyro_implicit.contract`); the message names the loss or guide that fits."""


class UnsupportedPairError(PairingError, NotImplementedError):
    """A guide the loss cannot train for want of something no loss offers to work around
    (e.g. a guide site that is not reparameterised)."""


class DataError(PyroImplicitError, ValueError):
    """The data are unusable: NaN or infinite observations, a malformed data file."""


class DivergenceError(PyroImplicitError, ValueError):
    """A fit has diverged: a non-finite loss, non-finite or exploding draws, or a model
    that fails at draws the fit has moved to. The message names the sites and what to
    try."""


class RunawayWarning(UserWarning):
    """A fit's draws have moved where its estimator is known to fail (e.g.
    ``KernelRatioELBO``'s kernel ratio far from its contrast): the numbers may all be finite,
    but the posterior should not be trusted. The message names what to use instead."""


class FewParticlesWarning(UserWarning):
    """A particle method has too few particles for its latent dimension: SVGD's particles
    lose spread as the dimension grows against their number (Ba et al., 2022,
    *Understanding the variance collapse of SVGD in high dimensions*), and a scale that
    many latents share drifts to make up for it. The message gives the count to pass."""


class LabelSwitchingWarning(UserWarning):
    """The preconditioner's search found modes that are relabellings of one another: the
    same values in every site, in another order, at the same density, as the components
    of a mixture that the model does not order have. The search keeps one labelling
    (each labelling is the whole answer up to the order of the labels); the message says
    how to fix the labels in the model."""


class MultimodalPosteriorWarning(UserWarning):
    """The preconditioner's search found more than one mode of the posterior, each carrying
    a real share of its mass (estimated by importance sampling, or by the modes' Laplace
    volumes where that was refused). Every method starts from one Gaussian
    at the heaviest mode, and a fit started there tends to stay in it: its draws then miss
    the other modes' mass. The message gives the modes' weights and what to use instead
    (``WeightSpaceSVGD``, or :func:`~pyro_implicit.modes.fit_per_mode` for a guide)."""
