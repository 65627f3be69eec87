"""The machinery GPVI and amortised SVGD share (:mod:`pyro_implicit.elbo.gpvi`,
:mod:`pyro_implicit.elbo.amortized_svgd`): one vectorised trace of particles scored under
the model, a direction for a second batch of generator outputs, and the surrogate whose
gradient pulls that direction back into the generator (Ratzlaff et al. 2021, eq. 4)."""

import torch

from ..compiled import BACKENDS
from ..errors import PairingError
from ..guides.base import implicit_site_info
from ..kernels import RBFKernel, svgd_bandwidth_factor
from ..latent import LatentSpace, preconditioner_of
from .base import ImplicitELBO, implicit_guide_sites, packed_particles

__all__ = []


class _Draws:
    """One step's draws of the guide: ``latent``, the ``(N, D)`` packed rows (with the
    autograd graph to the sampler), and ``noise``, the ``(N, noise_dim)`` noise they came
    from (read when first asked for: from the guide's trace, or given)."""

    def __init__(self, latent, noise=None, read_noise=None):
        self.latent = latent
        self._noise = noise
        self._read_noise = read_noise

    @property
    def noise(self):
        if self._noise is None:
            self._noise = self._read_noise()
        return self._noise


class _FunctionalGradientELBO(ImplicitELBO):
    """Shared machinery: one vectorised trace of N particles u' = f(z') scored under the
    model, a direction G for N generator outputs u = f(z), and the surrogate
    mean_b <stopgrad(G_b), u_b> whose gradient is the pulled-back direction (eq. 4)."""

    def __init__(
        self,
        num_particles=64,
        kernel=None,
        independent_batches=True,
        max_plate_nesting=float("inf"),
        check_vectorization=True,
        retain_graph=None,
        compile="fx",
    ):
        super().__init__(num_particles, max_plate_nesting, check_vectorization, retain_graph)
        if compile not in (None, False) and compile not in BACKENDS:
            raise ValueError(f"compile must be False or one of {BACKENDS}, got {compile!r}")
        #: ``"fx"`` / ``"inductor"``: after the first step, score the draws with the traced
        #: graph of the model's log-density (:meth:`LatentSpace.compile`) instead of a Pyro
        #: trace of the model; ``None``: always trace
        self.compile = compile or None
        self._spaces = {}
        #: (id(model), id(guide)) -> whether the traced path may draw the guide directly
        #: (without a Pyro trace of it: it is the whole guide and its site is unscaled)
        self._direct = {}
        self.kernel = self.default_kernel(num_particles) if kernel is None else kernel
        self.independent_batches = bool(independent_batches)

    @staticmethod
    def default_kernel(num_particles):
        """The kernel when none is given: RBF at Liu & Wang's length scale,
        :math:`h = \\mathrm{med}^2 / \\log N`, the one the GPVI paper gives every kernel
        method (Ratzlaff et al. 2021, App. B.2)."""
        return RBFKernel(bandwidth_factor=svgd_bandwidth_factor(num_particles))

    # -------------------------------------------------------------- guide checks
    def _check_packed_guide(self, guide, model_trace):
        raise NotImplementedError

    def _implicit_site(self, model_trace, guide_trace):
        sites = implicit_guide_sites(guide_trace)
        if len(sites) != 1:
            raise PairingError(
                f"{type(self).__name__} trains one implicit guide over all latent sites; the "
                f"guide has {len(sites)} implicit latent sites. {self._pairing_hint()}"
            )
        site = sites[0]
        guide = implicit_site_info(site)["guide"]
        self._check_packed_guide(guide, model_trace)
        latents = {s["name"] for s in self.latent_sites(model_trace)}
        packed = set(guide._unconstrained_shapes)
        if latents != packed:
            raise PairingError(
                f"{type(self).__name__} needs one implicit guide covering every latent site "
                f"(a functional gradient of the joint KL): the model has {sorted(latents)} but "
                f"{type(guide).__name__} covers {sorted(packed)}. Do not mix it with other "
                "guides in an AutoGuideList."
            )
        return site, guide

    # -------------------------------------------------------------- score batch
    def _log_target(self, model_trace, guide_trace):
        r"""Per particle :math:`\log \tilde p(u) = \log p(x, T(u)) + \log|\det \partial T /
        \partial u|`: every model site (with plate scaling), minus the guide's ``biject_to``
        Delta sites, whose log-density is :math:`-\log|\det \partial T/\partial u|`."""
        return self.log_joint_particles(model_trace) - self.explicit_guide_log_prob(guide_trace)

    def loss(self, model, guide, *args, **kwargs):
        r"""The monitoring value :math:`-\frac1N\sum_a \log\tilde p(u'_a)` (see the class
        docstring) on a fresh batch; no helper update, no gradient."""
        # a guide built by this call gets the layers this loss asks for, as in a step
        with torch.no_grad(), self._requests():
            model_trace, guide_trace = self._traces(model, guide, args, kwargs)
            self._implicit_site(model_trace, guide_trace)
            loss = -self._log_target(model_trace, guide_trace).mean()
            self._check_divergence(loss)
            return loss.item()

    def _loss_and_surrogate(self, model, guide, args, kwargs):
        key = (id(model), id(guide))
        space = self._spaces.get(key)
        if space is not None and space.compiled.active:
            out = self._traced_loss_and_surrogate(
                space, guide, args, kwargs, direct=self._direct.get(key, False)
            )
            if out is not None:
                return out
        model_trace, guide_trace = self._traces(model, guide, args, kwargs)
        site, guide_obj = self._implicit_site(model_trace, guide_trace)
        n, mpn = self.num_particles, self.max_plate_nesting
        latent = site["value"]
        if not latent.requires_grad:
            raise RuntimeError(
                f"{type(self).__name__} differentiates the model at the guide's draws: call "
                "loss_and_grads / differentiable_loss with autograd enabled"
            )
        log_target = self._log_target(model_trace, guide_trace)
        # the model's own pyro.params (e.g. an observation scale) descend minus the mean log
        # target, the ELBO's gradient in them, as pyro.infer.SVGD trains them
        model_params = any(
            site["type"] == "param" and site["value"].requires_grad
            for site in model_trace.nodes.values()
        )
        # score of the unconstrained target at the draws (no gradient into the generator)
        (latent_score,) = torch.autograd.grad(
            log_target.sum(), latent, retain_graph=model_params or not self.independent_batches
        )
        # the direction acts on the generator's whitened output w (u = m + L w), where the
        # kernel's one bandwidth suits every coordinate: the score there is L^T grad_u
        score = preconditioner_of(guide_obj).whiten_score(packed_particles(latent_score, n, mpn))
        scale = site["scale"]
        scale = scale.item() if torch.is_tensor(scale) else float(scale)
        draws = _Draws(
            packed_particles(latent, n, mpn),
            read_noise=lambda: self._noise_rows(guide_obj, guide_trace),
        )
        direction, outputs = self._direction(guide_obj, draws, score, scale)
        # eq. (4): d/dtheta mean_b <G_b, f(z_b)> = E_z[(df/dtheta)^T G]
        surrogate = (direction.detach() * outputs).sum(-1).mean()
        if model_params:
            # -mean log p with the path through the draws cancelled (its gradient in the
            # generator is score . du, exactly what the subtracted term gives): only the
            # model's parameters get a gradient from it
            through_draws = (latent_score.detach() * latent).sum() / n
            surrogate = surrogate - (log_target.mean() - through_draws)
        self.diagnostics["log_target"] = log_target.mean().item()
        if self.compile and not model_params and (id(model), id(guide)) not in self._spaces:
            # checked and validated once by the step above: later steps may use the graph,
            # and draw the guide directly when it is the whole guide, unscaled
            space = LatentSpace.from_guide(guide_obj, args, kwargs, mpn - 1, model)
            self._spaces[(id(model), id(guide))] = space.compile(self.compile)
            self._direct[(id(model), id(guide))] = guide_obj is guide and scale == 1.0
        return -log_target.detach().mean(), surrogate

    def _traced_loss_and_surrogate(self, space, guide, args, kwargs, direct=False):
        """The step above without a Pyro trace of the model: the guide's draws are scored by
        the traced graph of the log-density (one minibatch where the model subsamples, as
        a model trace would give). Where the guide is the whole guide and unscaled, it is
        drawn directly too (its noise, then its sampler: the random stream is consumed as
        its trace would). ``None`` when the graph is unavailable or a draw is not finite
        (the caller then traces, and names the sites if the fit has diverged)."""
        n, mpn = self.num_particles, self.max_plate_nesting
        if direct:
            with guide.drawing_directly():
                noise = guide.standard_normal(n, guide.noise_dim)
                latent = guide.preconditioner.unwhiten(guide._latent_from_noise(noise))
            draws, guide_obj, scale = _Draws(latent, noise=noise), guide, 1.0
            self._last_traces = None
        else:
            # as the traced-model path does: a failure at non-finite draws names the sites
            guide_trace = self._run_traced(
                self._vectorized_num_particles(guide), args, kwargs, "the guide"
            )
            site = implicit_guide_sites(guide_trace)[0]
            guide_obj = implicit_site_info(site)["guide"]
            draws = _Draws(
                packed_particles(site["value"], n, mpn),
                read_noise=lambda: self._noise_rows(guide_obj, guide_trace),
            )
            scale = site["scale"]
            scale = scale.item() if torch.is_tensor(scale) else float(scale)
            self._last_traces = (None, guide_trace)  # for the divergence check's message
        out = self._compiled_score(space, draws.latent, args, kwargs)
        if out is None:
            return None  # the traced-model path stops it with a DivergenceError naming sites
        log_target, latent_score = out
        score = preconditioner_of(guide_obj).whiten_score(latent_score)
        direction, outputs = self._direction(guide_obj, draws, score, scale)
        surrogate = (direction.detach() * outputs).sum(-1).mean()
        self.diagnostics["log_target"] = log_target.mean().item()
        return -log_target.mean(), surrogate

    def _direction(self, guide, draws, score, scale):
        """``(direction, outputs)`` for the step's :class:`_Draws` and their whitened score."""
        raise NotImplementedError

    def _noise_rows(self, guide, guide_trace):
        name = f"_{guide._pyro_name}_noise"
        if name not in guide_trace.nodes:
            raise TypeError(f"{type(guide).__name__} has no noise site {name!r} in its trace")
        return packed_particles(
            guide_trace.nodes[name]["value"], self.num_particles, self.max_plate_nesting
        ).detach()

    def _bandwidth(self, *points):
        return self.kernel.bandwidth(*points)
