r"""Amortised SVGD (Wang & Liu 2016; the GPVI paper's main baseline, eq. 14) as a Pyro
loss: :class:`AmortizedSVGD_ELBO`.

References

[1] `Learning to Draw Samples: With Application to Amortized MLE for Generative
    Adversarial Learning`, Dilin Wang, Qiang Liu, 2016.
[2] `Generative Particle Variational Inference via Estimation of Functional Gradients`,
    Roman Ratzlaff, Qinxun Bai, Li Fuxin, Wei Xu, ICML 2021 (Sec. 3.5).
"""

from ..errors import PairingError
from ..guides.base import ImplicitAutoGuide
from ..kernels import (
    MultiScaleRBFKernel,
    kernel_and_derivative,
    squared_distances,
    svgd_bandwidth_factor,
)
from ..latent import preconditioner_of
from .functional_gradient import _FunctionalGradientELBO

__all__ = ["AmortizedSVGD_ELBO"]


class AmortizedSVGD_ELBO(_FunctionalGradientELBO):
    r"""Amortised SVGD (Wang & Liu 2016; GPVI paper eq. 14), GPVI's main baseline, as a
    Pyro loss for any :class:`~pyro_implicit.guides.base.ImplicitAutoGuide`.

    The same step as :class:`GPVI_ELBO` with the SVGD direction computed on the generator's
    *outputs* (Sec. 3.5: the RKHS lives on u, not z), so no Jacobian is needed:

    .. math::
        G_b = -\frac1N \sum_a \big[s'_a\, k(u'_a, u_b) + \beta\, \nabla_{u'_a} k(u'_a,
        u_b)\big] = -\phi^*(u_b) \quad\text{(eq. 13)},

    back-propagated through :math:`u_b` by the surrogate :math:`\frac1N\sum_b \langle
    \mathrm{sg}(G_b), u_b\rangle` (eq. 14). The scored batch :math:`u'` and the
    gradient batch :math:`u` are independent draws by default (as the GPVI authors' code
    runs its baseline); ``independent_batches=False`` is Wang & Liu's original single
    batch. Kernel sums are matrix products: :math:`O(N^2 + N D)` memory.

    The returned loss and :attr:`diagnostics` are as for :class:`GPVI_ELBO` (the mean
    negative log target; no helper). Swapping the two losses is the one-line comparison::

        svi = SVI(model, guide, optim, AmortizedSVGD_ELBO(num_particles=64))

    :param int num_particles: N, the size of each batch.
    :param kernel: kernel on u. Default: :meth:`default_kernel`, RBF terms at Liu & Wang's
        length scale (:math:`h = \mathrm{med}^2/\log N`) and at the median distance
        itself. The paper's kernel, the first term alone, is
        ``RBFKernel(bandwidth_factor=svgd_bandwidth_factor(num_particles))``.
    :param bool independent_batches: see above.
    :param int max_plate_nesting: the model's plate nesting (guessed if omitted).
    :param bool check_vectorization: check once that the model is safe under the particle
        plate.

    References

    [1] `Learning to Draw Samples: With Application to Amortized MLE for Generative
        Adversarial Learning`, Dilin Wang, Qiang Liu, 2016.
    [2] `Generative Particle Variational Inference via Estimation of Functional
        Gradients`, Roman Ratzlaff et al., ICML 2021 (Sec. 3.5).
    """

    pairing_hint = (
        "AmortizedSVGD_ELBO trains a guide that packs all latents into one implicit "
        "sampler: ImplicitGuide, SemiImplicitGuide or LinearizedGuide."
    )

    # the STL Gaussian fit: see ImplicitELBO.preconditioner_vi_estimator
    preconditioner_vi_estimator = "stl"

    @staticmethod
    def default_kernel(num_particles):
        """An equal mixture of RBF kernels (:class:`~pyro_implicit.kernels.MultiScaleRBFKernel`)
        at Liu & Wang's length scale and at the median distance.

        Liu & Wang's length scale alone (0.35 median distances at 64 particles) lets the
        draws of a funnel's scale drift 0.3 NUTS sds off from a start 0.03 off; the median
        distance alone keeps them there but loses a banana's curve (0.16 -> 0.42 sds,
        ``benchmarks/results/fg_bandwidth_asvgd.md``). With both terms, over seeds 0-5, the
        funnel ends 0.02 sds off and the banana 0.28 (0.19 with the first term alone), and
        the method is no further from NUTS than AutoMultivariateNormal on the seed means of
        every posterior of the stiff benchmark; energy distances grow on six of the eight
        (``benchmarks/results/asvgd_multiscale.md``)."""
        return MultiScaleRBFKernel((svgd_bandwidth_factor(num_particles), 1.0))

    def _check_packed_guide(self, guide, model_trace):
        if not isinstance(guide, ImplicitAutoGuide):
            raise PairingError(
                f"{type(guide).__name__} is not a packed guide. {self._pairing_hint()}"
            )

    def _direction(self, guide, draws, score, scale):
        n = self.num_particles
        pre = preconditioner_of(guide)
        # in the preconditioner's whitened coordinates (identity for an unpreconditioned
        # guide): the kernel's one bandwidth then suits every direction
        rows = pre.whiten(draws.latent)
        u_score = rows.detach()
        if self.independent_batches:
            outputs = guide.sample_whitened(n)
        else:
            outputs = rows
        u = outputs.detach()
        # translation invariant: centre for a well-conditioned Gram identity
        shift = u_score.mean(0)
        a, b = u_score - shift, u - shift
        if self.independent_batches:
            sigma = self._bandwidth(a, b)
        else:
            sigma = self._bandwidth(a)
        d2 = squared_distances(a, b)
        k, dk = kernel_and_derivative(self.kernel, d2, sigma)
        # sum_a grad_{u'_a} k(u'_a, u_b) = 2 sum_a dk_ab (u'_a - u_b)
        kernel_grad = 2.0 * (dk.T @ a - dk.sum(0).unsqueeze(-1) * b)
        attraction = k.T @ score.detach()
        repulsion = scale * kernel_grad
        direction = -(attraction + repulsion) / n
        self.diagnostics = {
            "bandwidth": float(sigma),
            "attraction": attraction.norm(dim=-1).mean().item() / n,
            "repulsion": repulsion.norm(dim=-1).mean().item() / n,
        }
        return direction, outputs
