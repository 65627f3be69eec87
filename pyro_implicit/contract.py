"""The guide-loss contract: what a guide offers, what a loss needs, and the error that
names the right pair.

Every guide of this library draws the packed unconstrained latent ``u`` of a model (see
:mod:`pyro_implicit.guides.base`); a loss (:mod:`pyro_implicit.elbo`) turns draws of it
into an ELBO estimate. Which guide trains with which loss is decided here, by
*capabilities*: names of what a guide can give a loss.

**What a guide offers.** A guide class declares ``capabilities``, a frozenset of the
names below, and publishes them with each implicit latent site it draws: the site's
``infer[IMPLICIT_FLAG]`` (:data:`IMPLICIT_FLAG`) holds the record ``{"guide": the guide,
"capabilities": ..., <record keys below>}`` that :func:`site_record` reads. A site
without the record has a density of its own (Pyro's autoguides, the Jacobian ``Delta`` of
a packed guide): every loss scores it exactly, which is :data:`LOG_DENSITY`.

* ``"sample"``: draws of ``u`` (:class:`SamplingGuide`);
* ``"conditional_density"``: a Gaussian conditional q(u | psi) and fresh mixing draws
  psi; the record names under ``"mixing_site"`` the auxiliary site of each draw's psi
  (:class:`ConditionalDensityGuide`);
* ``"jacobian"``: ``u = g(z) + sigma xi`` with a differentiable generator g; the record
  names under ``"base_site"`` the auxiliary site of each draw's z (:class:`JacobianGuide`);
* ``"local"``: with ``"conditional_density"``, local latents inside the model's data
  plate, conditional on the record's ``"context"`` (the subsample's data)
  (:class:`LocalConditionalGuide`);
* ``"log_density"``: a site without the record; its ``log_prob`` is exact.

The library's guides offer: ``ImplicitGuide`` sample; ``SemiImplicitGuide`` sample,
conditional_density; ``LinearizedGuide`` sample, conditional_density, jacobian;
``SemiImplicitEncoder`` conditional_density, local; Pyro's autoguides log_density.

**What each loss needs.** A loss class declares the one capability it needs in
``required_capability`` and, in ``pairing_hint``, which loss or guide to use instead;
:func:`requirements` lists them:

* ``KernelRatioELBO``: sample (packed global latents: no ``"local"``);
* ``SIVI_ELBO``: conditional_density (a ``LinearizedGuide`` only with sigma >= 0.1);
* ``LIVI_ELBO``: jacobian;
* ``GPVI_ELBO``: sample, from one ``ImplicitGuide`` over every latent site whose
  generator is square and invertible;
* ``AmortizedSVGD_ELBO``: sample, from one packed guide over every latent site.

Every loss also needs reparameterised guide sites, and a guide that covers every latent
site of the model (:func:`pyro_implicit.elbo.base.check_guide_covers_model`).
:func:`check_guide_site` is the one check of the capability and of reparameterisation
(every loss calls it on every guide site) and raises the error that names the pair and
the right one. The README's guide x loss table (:mod:`pyro_implicit.elbo.grid`) is the
outcome of these rules.

To add a capability: name it here (a constant, an entry of the lists above, a protocol),
have the guide list it in ``capabilities`` and put what the loss reads in its record.
"""

from typing import Protocol, runtime_checkable

from .errors import PairingError, UnsupportedPairError

#: key of the ``infer`` dict entry that marks a site whose density a loss must estimate
IMPLICIT_FLAG = "pyro_implicit"


def implicit_site_info(site):
    """The ``infer[IMPLICIT_FLAG]`` record of a trace site (an implicit guide's draw), or
    ``None``."""
    infer = site.get("infer") or {}
    return infer.get(IMPLICIT_FLAG)


__all__ = [
    "BASE_SITE",
    "CAPABILITIES",
    "CONDITIONAL_DENSITY",
    "CONTEXT",
    "ConditionalDensityGuide",
    "IMPLICIT_FLAG",
    "JACOBIAN",
    "JacobianGuide",
    "LOCAL",
    "LOG_DENSITY",
    "LocalConditionalGuide",
    "MIXING_SITE",
    "PROTOCOLS",
    "SAMPLE",
    "SamplingGuide",
    "capabilities_of",
    "check_guide_site",
    "pairing_error",
    "requirements",
    "site_record",
]

#: draws of the packed latent u
SAMPLE = "sample"
#: a Gaussian conditional q(u | psi) with mixing draws psi (semi-implicit)
CONDITIONAL_DENSITY = "conditional_density"
#: u = g(z) + sigma xi with a differentiable generator g (linearised)
JACOBIAN = "jacobian"
#: local latents inside the data plate, conditional on the subsample (amortised)
LOCAL = "local"
#: an exact log-density: every site drawn without an implicit record
LOG_DENSITY = "log_density"

#: capability -> what a guide offering it provides
CAPABILITIES = {
    SAMPLE: "draws of the packed latent u",
    CONDITIONAL_DENSITY: "a Gaussian conditional q(u | psi), fresh mixing draws psi, and "
    "the auxiliary site of each draw's psi (record key 'mixing_site')",
    JACOBIAN: "u = g(z) + sigma xi with a differentiable generator g and the auxiliary "
    "site of each draw's z (record key 'base_site')",
    LOCAL: "local latents in the data plate, conditional on the record's 'context'",
    LOG_DENSITY: "an exact log-density (a site without the implicit record)",
}

#: record key: the auxiliary site holding each draw's mixing value psi
MIXING_SITE = "mixing_site"
#: record key: the auxiliary site holding each draw's generator input z
BASE_SITE = "base_site"
#: record key: the data points a local latent is conditional on
CONTEXT = "context"


@runtime_checkable
class SamplingGuide(Protocol):
    """``"sample"``: a guide whose packed latent can be drawn."""

    capabilities: frozenset

    def sample_unconstrained(self, num_samples):
        """``(num_samples, D)`` draws of the packed unconstrained latent."""


@runtime_checkable
class ConditionalDensityGuide(Protocol):
    """``"conditional_density"``: a semi-implicit guide, q(u) = E_psi N(u | psi)."""

    def conditional_log_prob(self, u, psi):
        """log q(u | psi), broadcasting ``u`` ``(..., D)`` against ``psi`` ``(..., P)``."""

    def sample_mixing(self, num_mixing):
        """``(num_mixing, P)`` fresh mixing draws psi, with gradient."""


@runtime_checkable
class JacobianGuide(Protocol):
    """``"jacobian"``: u = g(z) + sigma xi, whose entropy LIVI linearises around g."""

    generator: object  # (..., d) -> (..., D), rows independently
    sigma: float


@runtime_checkable
class LocalConditionalGuide(Protocol):
    """``"local"`` with ``"conditional_density"``: amortised local latents (SIVAE)."""

    def conditional_log_prob(self, z, psi, context):
        """log q(z | psi, x) per data point of ``context``."""

    def sample_mixing(self, num_mixing, context):
        """``(num_mixing, *context batch, D)`` mixing draws per data point."""


#: capability -> the interface a guide offering it implements
PROTOCOLS = {
    SAMPLE: SamplingGuide,
    CONDITIONAL_DENSITY: ConditionalDensityGuide,
    JACOBIAN: JacobianGuide,
    LOCAL: LocalConditionalGuide,
}


def site_record(site):
    """The implicit record (``infer[IMPLICIT_FLAG]``) of a trace site, or ``None`` for a
    site with a density of its own."""
    return implicit_site_info(site)


def capabilities_of(site):
    """What the guide that drew ``site`` offers a loss (a frozenset of capability names;
    ``{"log_density"}`` for a site with a density of its own)."""
    record = site_record(site)
    return frozenset({LOG_DENSITY}) if record is None else frozenset(record["capabilities"])


def requirements():
    """``{loss class name: required capability}`` of the library's losses, read from the
    classes."""
    from .elbo import (
        GPVI_ELBO,
        LIVI_ELBO,
        SIVI_ELBO,
        AmortizedSVGD_ELBO,
        KernelRatioELBO,
        SteinScoreELBO,
    )

    losses = (KernelRatioELBO, SteinScoreELBO, SIVI_ELBO, LIVI_ELBO, GPVI_ELBO, AmortizedSVGD_ELBO)
    return {cls.__name__: cls.required_capability for cls in losses}


def pairing_error(loss, guide, offered):
    """The error for a guide that lacks what ``loss`` needs: it names the loss, the
    capability, what the guide offers and (the loss's ``pairing_hint``) the right pair.

    :rtype: ~pyro_implicit.errors.PairingError
    """
    return PairingError(
        f"{type(loss).__name__} needs a guide that provides "
        f"'{loss.required_capability}', but {type(guide).__name__} only "
        f"provides {sorted(offered)}. {loss._pairing_hint()}"
    )


def check_guide_site(loss, name, site):
    """Refuse a guide sample site that ``loss`` cannot train: an implicit site whose guide
    lacks the loss's ``required_capability`` (:func:`pairing_error`), or a site that is
    not reparameterised.

    :raises ~pyro_implicit.errors.PairingError: (a ``TypeError``) for a missing
        capability.
    :raises ~pyro_implicit.errors.UnsupportedPairError: (a ``NotImplementedError``) for a
        site without ``rsample``.
    """
    record = site_record(site)
    if record is not None and loss.required_capability not in record["capabilities"]:
        raise pairing_error(loss, record["guide"], record["capabilities"])
    if not site["fn"].has_rsample:
        raise UnsupportedPairError(
            f"Guide site '{name}' ({type(site['fn']).__name__}) is not "
            f"reparameterisable; {type(loss).__name__} needs reparameterised guides."
        )
