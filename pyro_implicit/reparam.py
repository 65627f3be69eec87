r"""Non-centring: the change of a model's coordinates that removes a funnel's neck.

A funnel is a latent whose scale is another latent (``theta ~ Normal(mu, tau)``,
``h ~ MultivariateNormal(mu, Q(phi, sigma)^-1)``): where the scale is small the posterior
of the lower latent is a narrow neck, where it is large a wide mouth. No affine change of
variables (:class:`~pyro_implicit.latent.Preconditioner`, NUTS's dense mass matrix) fits
both, and every fit then misses the neck's scale latent (``benchmarks/results/stiff*.md``:
the stochastic-volatility path's scale ``sigma`` is too narrow in every fit, ours and
Pyro's). Drawing the lower latent as standard noise and a deterministic transform of it,

.. math:: x = \mathrm{loc} + L\,\varepsilon, \qquad \varepsilon \sim \mathcal N(0, I),

takes the neck out of the prior: :math:`\varepsilon`'s prior no longer depends on the
scale, and where the data say little about the lower latent neither does its posterior
(Papaspiliopoulos, Roberts & Skold 2007; Gorinova, Moore & Hoffman 2020).

Pyro's :class:`~pyro.infer.reparam.strategies.AutoReparam` ``(centered=0.0)`` does this for
the location-scale families (``Normal``, ``StudentT``, ...) but leaves a
``MultivariateNormal`` site (a Gaussian process or an autoregressive path written as one
vector) as it is. :class:`MultivariateNormalReparam` non-centres those, and
:class:`NonCentred` is ``AutoReparam(centered=0.0)`` with it::

    from pyro_implicit.reparam import NonCentred

    non_centred = NonCentred()(model)       # = poutine.reparam(model, config=NonCentred())
    guide = ImplicitGuide(non_centred)
    svi = SVI(non_centred, guide, pyro.optim.Adam({"lr": 1e-2}), KernelRatioELBO())

Fit the non-centred model with the guide, the loss and ``SVI`` alike. The original sites
become deterministic functions of the new ``{name}_decentered`` latents, so
:class:`~pyro.infer.Predictive` returns them (``return_sites=[...]``) and the posterior
of the original sites is unchanged. Non-centring helps where the data say little about
each lower latent (few observations per group); with many observations per group the
centred form is the better one (Papaspiliopoulos et al. 2007), so it is a switch, not a
default. Measured on the stiff benchmark (``stiff_reparam.md``): non-centred, Neal's
funnel comes within 3.3x NUTS's noise floor for every method of ours and most methods end
closer on the centred eight schools; on the stochastic-volatility path ``sigma`` widens in
every fit, but three methods end closer to NUTS and three further.
"""

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.reparam.reparam import Reparam
from pyro.infer.reparam.strategies import AutoReparam, Strategy

__all__ = ["MultivariateNormalReparam", "NonCentred"]

#: the Gaussian families it non-centres (both have ``loc`` and a ``scale_tril``)
GAUSSIANS = (torch.distributions.MultivariateNormal, torch.distributions.LowRankMultivariateNormal)


class MultivariateNormalReparam(Reparam):
    r"""Non-centres a latent ``MultivariateNormal`` or ``LowRankMultivariateNormal`` site
    (possibly under ``.to_event``): a new latent ``{name}_decentered`` of standard normal noise
    :math:`\varepsilon` of the same shape, and the original site the deterministic
    :math:`\mathrm{loc} + L\varepsilon` (:math:`L` the distribution's ``scale_tril``,
    however it was given: covariance, precision or factor).

    The density of the model in the new coordinates is the original one at
    :math:`x` times :math:`|\det L|`, the Jacobian of the map: the noise's standard normal
    density is :math:`\mathcal N(x; \mathrm{loc}, LL^\top) |\det L|`. A given value of
    the original site (an initial value, or Pyro's ``condition``) is carried over as
    :math:`\varepsilon = L^{-1}(x - \mathrm{loc})`, observed if it was (a model
    conditioned on the original site before it is reparameterised), as
    :class:`~pyro.infer.reparam.LocScaleReparam` does.
    """

    def apply(self, msg):
        name, fn, value = msg["name"], msg["fn"], msg["value"]
        mvn, event_dim = self._unwrap(fn)
        if not isinstance(mvn, GAUSSIANS):
            raise TypeError(
                f"MultivariateNormalReparam: site {name!r} is a {type(mvn).__name__}, not a "
                "MultivariateNormal or LowRankMultivariateNormal (use "
                "pyro.infer.reparam.LocScaleReparam for Normal-like sites, or NonCentred() "
                "to choose per site)"
            )
        loc, scale_tril = mvn.loc, mvn.scale_tril
        shape = mvn.batch_shape + mvn.event_shape
        noise = dist.Normal(loc.new_zeros(()), 1.0).expand(shape).to_event(1)

        decentered = None
        if value is not None:
            # differentiably invert the map, so an initial value is kept
            centred = (value - loc).unsqueeze(-1)
            decentered = torch.linalg.solve_triangular(scale_tril, centred, upper=False)
            decentered = decentered.squeeze(-1)
        decentered = pyro.sample(
            f"{name}_decentered",
            self._wrap(noise, event_dim),
            obs=decentered,
            infer={"is_observed": msg["is_observed"]},
        )
        if value is None:  # a given value stays the same object, as Pyro expects
            value = loc + torch.matmul(scale_tril, decentered.unsqueeze(-1)).squeeze(-1)
        # a pyro.deterministic() site: the value, and no density of its own
        return {
            "fn": dist.Delta(value, event_dim=event_dim).mask(False),
            "value": value,
            "is_observed": True,
        }


class NonCentred(Strategy):
    """A strategy that fully non-centres every latent site it can: Pyro's
    :class:`~pyro.infer.reparam.strategies.AutoReparam` ``(centered=0.0)``
    (location-scale families decentred by
    :class:`~pyro.infer.reparam.LocScaleReparam`, transformed distributions through
    their base) and :class:`MultivariateNormalReparam` for ``MultivariateNormal`` and
    ``LowRankMultivariateNormal`` sites, which ``AutoReparam`` leaves centred.

    Use it as Pyro's strategies: ``NonCentred()(model)``, or
    ``poutine.reparam(model, config=NonCentred())``. After the first run of the model its
    ``config`` says what each site got.
    """

    def __init__(self):
        super().__init__()
        self._auto = AutoReparam(centered=0.0)

    def configure(self, msg):
        if not msg["is_observed"]:
            fn = msg["fn"]
            while isinstance(fn, torch.distributions.Independent):
                fn = fn.base_dist
            if isinstance(fn, GAUSSIANS):
                return MultivariateNormalReparam()
        return self._auto.configure(msg)
