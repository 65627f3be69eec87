"""The method registry: every method :func:`~pyro_implicit.diagnostics.compare.compare`,
the command line (``--methods``) and the benchmarks build by name, with its settings.

Every method of the library runs with its defaults, which include the automatic
preconditioner (:mod:`pyro_implicit.latent`; ``precondition=False`` fits in the raw space).

* ``"implicit"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.KernelRatioELBO` ``()``: 100 particles, the
  preconditioner's Gaussian as the ratio's contrast.
* ``"sivi"``: :class:`~pyro_implicit.guides.SemiImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.SIVI_ELBO` ``(num_particles=50, num_mixing=100)`` (the SIVI
  paper's settings).
* ``"livi"``: :class:`~pyro_implicit.guides.LinearizedGuide` trained with
  :class:`~pyro_implicit.elbo.LIVI_ELBO` ``(bound="det")`` (eq. 15, whole Jacobians: cheap
  at these sizes).
* ``"gpvi"``: :class:`~pyro_implicit.guides.ImplicitGuide` with the skip generator
  ``gpvi_generator()`` trained with :class:`~pyro_implicit.elbo.GPVI_ELBO`
  ``(num_particles=64)`` (its default solves with the exact Jacobian up to D = 64, the
  paper's "exact Jacobian" variant: with the helper network and 1000 steps the
  eight-schools fit was still far too narrow, at learning rates 1e-2 and 1e-3).
* ``"asvgd"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.AmortizedSVGD_ELBO` ``(num_particles=64)`` (Wang & Liu's
  amortised SVGD: the SVGD direction pulled back into the generator).
* ``"autonormal"``, ``"automvn"``: Pyro's ``AutoNormal`` and ``AutoMultivariateNormal``
  with ``Trace_ELBO(num_particles=8, vectorize_particles=True)``.
* ``"svgd"``: Pyro's own ``pyro.infer.SVGD`` with ``RBFSteinKernel()`` and
  ``mode="multivariate"`` (Liu & Wang's SVGD; the default "univariate" mode fails on
  correlated posteriors). Pyro 1.9 packs multi-site particles site-major but reshapes them
  particle-major in ``step()``, so on a model with several latent sites its kernel mixes
  coordinates of different particles: the row shows stock Pyro, defect included.
* ``"wsvgd"``: :class:`~pyro_implicit.particles.WeightSpaceSVGD`, the same algorithm with
  particle-major packing, in the preconditioner's whitened coordinates, with an RBF
  kernel whose length scale is the median distance.
"""

import dataclasses

from pyro.infer import SVGD, RBFSteinKernel, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from ..elbo import GPVI_ELBO, LIVI_ELBO, SIVI_ELBO, AmortizedSVGD_ELBO, KernelRatioELBO
from ..elbo.gpvi import gpvi_generator
from ..guides import ImplicitGuide, LinearizedGuide, SemiImplicitGuide
from ..particles import WeightSpaceSVGD

__all__ = ["DEFAULT_METHODS", "METHODS", "NUM_PARTICLES", "Method"]


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the registry: how :func:`~pyro_implicit.diagnostics.compare.compare`,
    the command line and the benchmarks build it.

    :ivar str description: what it is, with its settings (the table's key).
    :ivar float lr: its initial learning rate in :func:`compare`.
    :ivar build: ``(model, mpn, precondition=...) -> (guide, loss)`` for SVI methods,
        ``(model, mpn, optim, precondition=...) -> particle object`` for particle methods.
    :ivar str kind: ``"svi"`` (a guide: iid draws) or ``"particles"`` (a fixed set).
    :ivar str trace_label: what its per-step trace holds.
    :ivar str paper: where the method comes from.
    """

    description: str
    lr: float
    build: object  # svi: (model, mpn) -> (guide, loss); particles: (model, mpn, optim) -> obj
    kind: str = "svi"  # "svi" (a guide: iid draws) or "particles" (a fixed set)
    trace_label: str = "loss (-ELBO estimate)"
    paper: str = ""


def _build_implicit(model, mpn, precondition=True):
    loss = KernelRatioELBO(max_plate_nesting=mpn)
    return ImplicitGuide(model, precondition=precondition), loss


def _build_sivi(model, mpn, precondition=True):
    return SemiImplicitGuide(model, precondition=precondition), SIVI_ELBO(
        num_particles=50, num_mixing=100, max_plate_nesting=mpn
    )


def _build_livi(model, mpn, precondition=True):
    return LinearizedGuide(model, precondition=precondition), LIVI_ELBO(
        num_particles=8, bound="det", max_plate_nesting=mpn
    )


def _build_gpvi(model, mpn, precondition=True):
    loss = GPVI_ELBO(num_particles=64, max_plate_nesting=mpn)
    return ImplicitGuide(model, generator=gpvi_generator(), precondition=precondition), loss


def _build_asvgd(model, mpn, precondition=True):
    return ImplicitGuide(model, precondition=precondition), AmortizedSVGD_ELBO(
        num_particles=64, max_plate_nesting=mpn
    )


def _autoguide_builder(cls):
    def build(model, mpn, precondition=True):
        # Pyro's guides have no preconditioner: the row is the same either way
        return cls(model), Trace_ELBO(num_particles=8, vectorize_particles=True,
                                      max_plate_nesting=mpn)

    return build


#: particles of the two SVGD methods
NUM_PARTICLES = 100


def _build_pyro_svgd(model, mpn, optim, precondition=True):
    return SVGD(model, RBFSteinKernel(), optim, num_particles=NUM_PARTICLES,
                max_plate_nesting=mpn, mode="multivariate")


def _build_wsvgd(model, mpn, optim, precondition=True):
    return WeightSpaceSVGD(model, optim, num_particles=NUM_PARTICLES, max_plate_nesting=mpn,
                           precondition=precondition)


#: method name -> how it is built; the keys are the valid ``methods`` of :func:`compare`
METHODS = {
    "implicit": Method(
        "ImplicitGuide + KernelRatioELBO() (100 particles, the preconditioner's Gaussian as "
        "contrast)",
        1e-2,
        _build_implicit,
        paper="KIVI: Shi, Sun & Zhu, ICLR 2018",
    ),
    "sivi": Method(
        "SemiImplicitGuide + SIVI_ELBO(num_particles=50, num_mixing=100)",
        1e-2,
        _build_sivi,
        paper="SIVI: Yin & Zhou, ICML 2018",
    ),
    "livi": Method(
        "LinearizedGuide + LIVI_ELBO(num_particles=8, bound='det')",
        1e-2,
        _build_livi,
        paper="LIVI: Uppal et al., NeurIPS 2023",
    ),
    "gpvi": Method(
        "ImplicitGuide(generator=gpvi_generator()) + GPVI_ELBO(num_particles=64) (exact "
        "Jacobian solve up to D = 64)",
        3e-3,
        _build_gpvi,
        trace_label="-(mean log target of the step's draws)",
        paper="GPVI: Ratzlaff et al., ICML 2021",
    ),
    "asvgd": Method(
        "ImplicitGuide + AmortizedSVGD_ELBO(num_particles=64)",
        1e-2,
        _build_asvgd,
        trace_label="-(mean log target of the step's draws)",
        paper="amortised SVGD: Feng, Wang & Liu, UAI 2017",
    ),
    "autonormal": Method(
        "AutoNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoNormal),
        paper="ADVI, mean field: Kucukelbir et al., JMLR 2017",
    ),
    "automvn": Method(
        "AutoMultivariateNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoMultivariateNormal),
        paper="ADVI, full rank: Kucukelbir et al., JMLR 2017",
    ),
    "svgd": Method(
        f"pyro.infer.SVGD(RBFSteinKernel(), num_particles={NUM_PARTICLES}, "
        "mode='multivariate'), stock Pyro 1.9: multi-site particles are mis-packed",
        5e-2,
        _build_pyro_svgd,
        kind="particles",
        trace_label="Stein force (mean squared particle gradient, summed over sites)",
        paper="SVGD: Liu & Wang, NeurIPS 2016",
    ),
    "wsvgd": Method(
        f"WeightSpaceSVGD(num_particles={NUM_PARTICLES}), particle-major SVGD, RBF kernel with "
        "the median distance as length scale",
        5e-2,
        _build_wsvgd,
        kind="particles",
        trace_label="-(mean log joint of the particles)",
        paper="SVGD: Liu & Wang, NeurIPS 2016; f-POVI Table 1",
    ),
}

#: what :func:`compare` and the command line run when no methods are named
DEFAULT_METHODS = tuple(METHODS)
