"""The method registry: every method :func:`~pyro_implicit.diagnostics.compare.compare`,
the command line (``--methods``) and the benchmarks build by name, with its guide, loss,
settings, description and paper. One name per method: :func:`resolve_name` turns an old
name (:data:`ALIASES`, kept for one release with a ``FutureWarning``) into it, and
compare, the command line and the benchmarks all call it. The README's guide x loss
table (:mod:`pyro_implicit.elbo.grid`) names the registry's method in each cell it
covers, and the registry refuses a pair the grid says does not train.

Every method of the library runs with its defaults, which include the automatic
preconditioner (:mod:`pyro_implicit.latent`; ``precondition=False`` fits in the raw space).

* ``"kivi"``: :class:`~pyro_implicit.guides.ImplicitGuide` trained with
  :class:`~pyro_implicit.elbo.KernelRatioELBO` ``()``: 100 particles, the
  preconditioner's Gaussian as the ratio's contrast.
  (``"implicit"`` until 0.1: ambiguous, as ``"gpvi"`` and ``"asvgd"`` use
  ``ImplicitGuide`` too.)
* ``"sivi"``: :class:`~pyro_implicit.guides.SemiImplicitGuide` (its default, mixed
  conditional: the mixing layer sets each draw's scale too) trained with
  :class:`~pyro_implicit.elbo.SIVI_ELBO` ``(num_particles=50, num_mixing=100)`` (the SIVI
  paper's settings).
* ``"livi"``: :class:`~pyro_implicit.guides.LinearizedGuide` trained with
  :class:`~pyro_implicit.elbo.LIVI_ELBO` ``(num_particles=32, bound="det")`` (eq. 15, whole
  Jacobians: cheap at these sizes; 32 draws per step instead of the loss's default 8,
  see ``_LIVI``).
* ``"gpvi"``: :class:`~pyro_implicit.guides.ImplicitGuide` with the skip generator
  ``gpvi_generator()`` trained with :class:`~pyro_implicit.elbo.GPVI_ELBO`
  ``(num_particles=64)`` (its default solves with the exact Jacobian, the paper's "exact
  Jacobian" variant, above D = 64 through the skip generator's k x k block: with the
  helper network and 1000 steps the eight-schools fit was still far too narrow, at
  learning rates 1e-2 and 1e-3).
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
import warnings
from collections.abc import Mapping

from pyro.infer import SVGD, RBFSteinKernel, Trace_ELBO
from pyro.infer.autoguide import AutoMultivariateNormal, AutoNormal

from ..elbo import (
    GPVI_ELBO,
    LIVI_ELBO,
    SIVI_ELBO,
    AmortizedSVGD_ELBO,
    KernelRatioELBO,
    SteinScoreELBO,
)
from ..elbo.gpvi import gpvi_generator
from ..elbo.grid import GRID
from ..guides import ImplicitGuide, LinearizedGuide, SemiImplicitGuide
from ..particles import WeightSpaceSVGD

__all__ = [
    "ALIASES",
    "DEFAULT_METHODS",
    "METHODS",
    "NUM_PARTICLES",
    "Method",
    "grid_method",
    "resolve_name",
]


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
    :ivar str name: its one name (the registry's key).
    :ivar str guide: the class that draws: the guide's (``"ImplicitGuide"``) or, for a
        particle method, the particle object's.
    :ivar str loss: the loss's class (``None`` for particle methods).
    :ivar dict settings: the keyword arguments the loss (or particle object) is built
        with, besides ``max_plate_nesting``; ``{}`` for its defaults.
    :ivar bool preconditioned: whether ``build``'s ``precondition`` reaches the method
        (the library's methods) or is ignored (Pyro's own guides and SVGD).
    """

    description: str
    lr: float
    build: object  # svi: (model, mpn) -> (guide, loss); particles: (model, mpn, optim) -> obj
    kind: str = "svi"  # "svi" (a guide: iid draws) or "particles" (a fixed set)
    trace_label: str = "loss (-ELBO estimate)"
    paper: str = ""
    name: str = ""
    guide: str = ""
    loss: str = None
    settings: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
    preconditioned: bool = True

    @property
    def vi_estimator(self):
        """The gradient estimate of its automatic preconditioner's Gaussian fit: its
        loss's :attr:`~pyro_implicit.elbo.base.ImplicitELBO.preconditioner_vi_estimator`
        (``"entropy"`` for particle methods)."""
        from .. import elbo

        loss = getattr(elbo, self.loss, None) if self.loss else None
        return getattr(loss, "preconditioner_vi_estimator", "entropy")


def _build_implicit(model, mpn, precondition=True):
    loss = KernelRatioELBO(max_plate_nesting=mpn)
    return ImplicitGuide(model, precondition=precondition), loss


def _build_stein_score(model, mpn, precondition=True):
    loss = SteinScoreELBO(max_plate_nesting=mpn)
    return ImplicitGuide(model, precondition=precondition), loss


#: the loss settings of each SVI method (the registry's ``settings``), read by its builder
_SIVI = {"num_particles": 50, "num_mixing": 100}
#: 32 draws per step, not LIVI_ELBO's 8: on the stiff benchmark over seeds 0-5
#: (``benchmarks/results/livi_particles_automvn_6seeds.md``) the seed-mean error fell on
#: seven of eight posteriors (the banana 0.34 -> 0.17 NUTS sds, the centred eight schools
#: 0.18 -> 0.15; Neal's funnel 0.03 -> 0.04) and the energy distance on all eight, and
#: ``livi`` became no worse than AutoMVN on all eight (``livi_particles_cost.md``: the step)
_LIVI = {"num_particles": 32, "bound": "det"}
_GPVI = {"num_particles": 64}
_ASVGD = {"num_particles": 64}
_AUTOGUIDE = {"num_particles": 8, "vectorize_particles": True}


def _build_sivi(model, mpn, precondition=True):
    return SemiImplicitGuide(model, precondition=precondition), SIVI_ELBO(
        **_SIVI, max_plate_nesting=mpn
    )


def _build_livi(model, mpn, precondition=True):
    return LinearizedGuide(model, precondition=precondition), LIVI_ELBO(
        **_LIVI, max_plate_nesting=mpn
    )


def _build_gpvi(model, mpn, precondition=True):
    loss = GPVI_ELBO(**_GPVI, max_plate_nesting=mpn)
    return ImplicitGuide(model, generator=gpvi_generator(), precondition=precondition), loss


def _build_asvgd(model, mpn, precondition=True):
    return ImplicitGuide(model, precondition=precondition), AmortizedSVGD_ELBO(
        **_ASVGD, max_plate_nesting=mpn
    )


def _autoguide_builder(cls):
    def build(model, mpn, precondition=True):
        # Pyro's guides have no preconditioner: the row is the same either way
        return cls(model), Trace_ELBO(**_AUTOGUIDE, max_plate_nesting=mpn)

    return build


#: particles of Pyro's SVGD
NUM_PARTICLES = 100
#: particles of ``wsvgd``: WeightSpaceSVGD's own default, thirty per latent dimension
#: within 100-300 (:func:`~pyro_implicit.particles.svgd.auto_num_particles`)
WSVGD_PARTICLES = "auto"


def _build_pyro_svgd(model, mpn, optim, precondition=True):
    return SVGD(
        model,
        RBFSteinKernel(),
        optim,
        num_particles=NUM_PARTICLES,
        max_plate_nesting=mpn,
        mode="multivariate",
    )


# fmt: off
def _build_wsvgd(model, mpn, optim, precondition=True):
    return WeightSpaceSVGD(model, optim, num_particles=WSVGD_PARTICLES, max_plate_nesting=mpn,
                           precondition=precondition)
# fmt: on


_REGISTRY = (
    Method(
        "ImplicitGuide + KernelRatioELBO() (100 particles, the preconditioner's Gaussian as "
        "contrast, the implied score under Stein's identities)",
        1e-2,
        _build_implicit,
        paper="KIVI: Shi, Sun & Zhu, ICLR 2018",
        name="kivi",
        guide="ImplicitGuide",
        loss="KernelRatioELBO",
    ),
    Method(
        "ImplicitGuide + SteinScoreELBO() (200 particles up to 100 latent dimensions, 100 "
        "beyond: the Gaussian of the draws plus a Stein residual with an IMQ kernel)",
        1e-2,
        _build_stein_score,
        paper="Stein gradient estimator: Li & Turner, ICLR 2018 (with a Gaussian control)",
        name="stein_score",
        guide="ImplicitGuide",
        loss="SteinScoreELBO",
    ),
    Method(
        "SemiImplicitGuide + SIVI_ELBO(num_particles=50, num_mixing=100)",
        1e-2,
        _build_sivi,
        paper="SIVI: Yin & Zhou, ICML 2018",
        name="sivi",
        guide="SemiImplicitGuide",
        loss="SIVI_ELBO",
        settings=_SIVI,
    ),
    Method(
        "LinearizedGuide + LIVI_ELBO(num_particles=32, bound='det')",
        1e-2,
        _build_livi,
        paper="LIVI: Uppal et al., NeurIPS 2023",
        name="livi",
        guide="LinearizedGuide",
        loss="LIVI_ELBO",
        settings=_LIVI,
    ),
    Method(
        "ImplicitGuide(generator=gpvi_generator()) + GPVI_ELBO(num_particles=64) (exact "
        "Jacobian solve, through a k x k block above D = 64)",
        3e-3,
        _build_gpvi,
        trace_label="-(mean log target of the step's draws)",
        paper="GPVI: Ratzlaff et al., ICML 2021",
        name="gpvi",
        guide="ImplicitGuide",
        loss="GPVI_ELBO",
        settings=_GPVI,
    ),
    Method(
        "ImplicitGuide + AmortizedSVGD_ELBO(num_particles=64)",
        1e-2,
        _build_asvgd,
        trace_label="-(mean log target of the step's draws)",
        paper="amortised SVGD: Feng, Wang & Liu, UAI 2017",
        name="asvgd",
        guide="ImplicitGuide",
        loss="AmortizedSVGD_ELBO",
        settings=_ASVGD,
    ),
    Method(
        "AutoNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoNormal),
        paper="ADVI, mean field: Kucukelbir et al., JMLR 2017",
        name="autonormal",
        guide="AutoNormal",
        preconditioned=False,
        loss="Trace_ELBO",
        settings=_AUTOGUIDE,
    ),
    Method(
        "AutoMultivariateNormal + Trace_ELBO(num_particles=8, vectorize_particles=True)",
        5e-2,
        _autoguide_builder(AutoMultivariateNormal),
        paper="ADVI, full rank: Kucukelbir et al., JMLR 2017",
        name="automvn",
        guide="AutoMultivariateNormal",
        preconditioned=False,
        loss="Trace_ELBO",
        settings=_AUTOGUIDE,
    ),
    Method(
        f"pyro.infer.SVGD(RBFSteinKernel(), num_particles={NUM_PARTICLES}, "
        "mode='multivariate'), stock Pyro 1.9: multi-site particles are mis-packed",
        5e-2,
        _build_pyro_svgd,
        kind="particles",
        trace_label="Stein force (mean squared particle gradient, summed over sites)",
        paper="SVGD: Liu & Wang, NeurIPS 2016",
        name="svgd",
        guide="pyro.infer.SVGD",
        preconditioned=False,
        settings={"num_particles": NUM_PARTICLES, "mode": "multivariate"},
    ),
    Method(
        f"WeightSpaceSVGD(num_particles={WSVGD_PARTICLES!r}: 30 per latent dimension within "
        "100-300), particle-major SVGD, RBF kernel with 1.4 median distances as length scale",
        5e-2,
        _build_wsvgd,
        kind="particles",
        trace_label="-(mean log joint of the particles)",
        paper="SVGD: Liu & Wang, NeurIPS 2016; f-POVI Table 1",
        name="wsvgd",
        guide="WeightSpaceSVGD",
        settings={"num_particles": WSVGD_PARTICLES},
    ),
)

#: old name -> the method's one name; each still works for one release, with a
#: ``FutureWarning`` (:func:`resolve_name`). ``"implicit"`` was ambiguous (GPVI and
#: amortised SVGD train ``ImplicitGuide`` too); the ``Guide+Loss`` names are the
#: conformance grid's.
ALIASES = {
    "implicit": "kivi",
    "ImplicitGuide+KernelRatioELBO": "kivi",
    "SemiImplicitGuide+SIVI_ELBO": "sivi",
    "LinearizedGuide+LIVI_ELBO": "livi",
}


def resolve_name(name, stacklevel=2):
    """The one name of method ``name``: ``name`` itself, or for an old name of
    :data:`ALIASES` its new name, with a ``FutureWarning`` that names it. Other names
    come back unchanged (each caller refuses unknown names in its own words), so callers
    with methods of their own (the UCI runner's ``map``) can use it too.

    :param str name: a method name, old or new.
    :param int stacklevel: as :func:`warnings.warn`'s, counted from the caller of this
        function (2: the line that called it).
    :rtype: str
    """
    new = ALIASES.get(name)
    if new is None:
        return name
    warnings.warn(
        f"method name {name!r} is deprecated and will be removed in the next release: use "
        f"{new!r} (the same method: {_BY_NAME[new].description})",
        FutureWarning,
        stacklevel=stacklevel + 1,
    )
    return new


class _Registry(Mapping):
    """``name -> Method``, in the registry's order; an old name (:data:`ALIASES`) looks
    up its method with a ``FutureWarning`` but is not listed."""

    def __init__(self, methods):
        self._methods = methods

    def __getitem__(self, name):
        return self._methods[resolve_name(name, stacklevel=3)]

    def __contains__(self, name):
        return name in self._methods or name in ALIASES

    def __iter__(self):
        return iter(self._methods)

    def __len__(self):
        return len(self._methods)

    def __repr__(self):
        return f"METHODS({', '.join(self._methods)})"


_BY_NAME = {m.name: m for m in _REGISTRY}

#: method name -> how it is built; the keys are the valid ``methods`` of :func:`compare`
#: (old names still work: :data:`ALIASES`)
METHODS = _Registry(_BY_NAME)

#: what :func:`compare` and the command line run when no methods are named
DEFAULT_METHODS = tuple(METHODS)


def grid_method(guide, loss):
    """The registry's name of the method that trains ``guide`` with ``loss`` (class
    names), or ``None``."""
    for method in _REGISTRY:
        if (method.guide, method.loss) == (guide, loss):
            return method.name
    return None


def _check_against_grid():
    """A registry method whose pair the README's grid covers must be one that trains."""
    trains = {(guide, loss): ok for guide, loss, ok, _ in GRID}
    for method in _REGISTRY:
        if not trains.get((method.guide, method.loss), True):
            raise AssertionError(
                f"method {method.name!r} pairs {method.guide} with {method.loss}, which "
                "pyro_implicit.elbo.grid.GRID says does not train"
            )


_check_against_grid()
