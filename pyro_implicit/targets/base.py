"""A log-density as a Pyro model whose posterior is that density."""

import pyro
import pyro.distributions as dist
import torch

__all__ = ["density_model"]


def density_model(log_density, dim, name="x", reference_scale=3.0):
    r"""Wrap an unnormalised log-density :math:`\log \tilde p(x)` on :math:`\mathbb R^d` as a
    Pyro model whose posterior is :math:`p(x) \propto \tilde p(x)`.

    The latent is drawn from a reference :math:`r = \mathcal N(0, s^2 I_d)` and a
    ``pyro.factor`` adds :math:`\log \tilde p(x) - \log r(x)`, so the joint is
    :math:`\tilde p(x)` exactly. The reference is a proper prior, so methods that need prior
    draws (``KernelRatioELBO``) and NUTS initialisation work unchanged; its scale only
    matters to them, never to the target.

    The model broadcasts: under a particle plate ``x`` has shape ``(..., d)`` and
    ``log_density`` must reduce the last dimension only.

    :param callable log_density: maps ``(..., d)`` to ``(...)``.
    :param int dim: dimension d.
    :param str name: name of the latent site.
    :param float reference_scale: standard deviation s of the reference.
    :returns: a Pyro model taking no arguments.
    """
    if dim < 1:
        raise ValueError(f"dim must be at least 1, got {dim}")

    def model():
        zero = torch.zeros(())
        reference = dist.Normal(zero, reference_scale).expand([dim]).to_event(1)
        x = pyro.sample(name, reference)
        pyro.factor(f"{name}_target", log_density(x) - reference.log_prob(x))

    model.__doc__ = f"Posterior over ``{name}`` ({dim}-D) equal to {log_density.__name__!r}."
    return model
