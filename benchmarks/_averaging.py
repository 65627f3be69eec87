r"""Iterate averaging beside any Pyro optimiser, for measuring how much of a fit's error
is the optimiser's jitter (``stiff.py --average``, ``exact_defaults.py --average``,
``benchmarks/results/stiff_average.md``).

With a constant learning rate, stochastic-gradient VI does not converge to the optimum but
to a stationary distribution around it: the last iterate is one draw from it (Polyak &
Juditsky 1992; for VI, Dhaka et al. 2020). :class:`Averaged` keeps the average of the
iterates beside any :class:`~pyro.optim.PyroOptim` and swaps it in for drawing::

    optim = Averaged(pyro.optim.Adam({"lr": 1e-2}))
    svi = SVI(model, guide, optim, loss)
    for _ in range(2000):
        svi.step(data)
    with optim.averaged():                 # the guide's parameters are the averages here
        draws = guide.sample_posterior(2000)

Training itself is unchanged: the optimiser steps the raw iterates, and leaving the
``with`` block puts them back. The average is the polynomial-decay average of Shamir &
Zhang (2013),

.. math:: \bar\theta_t = \bar\theta_{t-1} + \frac{\eta + 1}{t + \eta}
          (\theta_t - \bar\theta_{t-1}),

which weighs iterate :math:`s` about :math:`(s / t)^\eta` (``eta = 0``: the plain average).

It is a measuring tool here, not part of the library (it was ``pyro_implicit.optim`` for
the runs of 2026-11-26 that name it; moved unchanged). Averaging a generator's weights is
not averaging its distribution (q is not linear in the weights): LIVI's 1-D exact
posteriors came out with sd ratios 0.74 and 0.80 from the averaged weights, against
0.97-1.10 from the last iterate (why LIVI's in particular was not measured); and on
posteriors still converging at the last step (funnels, the banana) the average lags
behind (``benchmarks/results/stiff_average.md``).

References

[1] B. T. Polyak and A. B. Juditsky, `Acceleration of stochastic approximation by
    averaging`, SIAM J. Control Optim. 30(4), 1992.
[2] O. Shamir and T. Zhang, `Stochastic gradient descent for non-smooth optimization:
    convergence results and optimal averaging schemes`, ICML 2013.
[3] A. K. Dhaka, A. Catalina, M. R. Andersen, M. Magnusson, J. H. Huggins and A. Vehtari,
    `Robust, accurate stochastic optimization for variational inference`, NeurIPS 2020.
"""

import contextlib

import torch
from pyro.optim import PyroOptim

__all__ = ["Averaged"]


class WrappedOptim(PyroOptim):
    """A :class:`~pyro.optim.PyroOptim` around another one, which holds the state: its
    attributes (``optim_objs``, ...) and checkpoints (``get_state`` / ``set_state``) are
    the wrapped optimiser's. Subclasses add to :meth:`__call__`."""

    def __init__(self, optim):
        name = type(self).__name__
        if not isinstance(optim, PyroOptim):
            raise TypeError(
                f"{name} wraps a pyro.optim.PyroOptim, e.g. "
                f"{name}(pyro.optim.Adam({{'lr': 1e-2}})); got {type(optim).__name__}"
            )
        # no PyroOptim.__init__: the wrapped optimiser holds the state
        self.optim = optim

    def __getattr__(self, name):
        # only reached for attributes not found on self: the wrapped optimiser's
        if name == "optim":
            raise AttributeError(name)
        return getattr(self.optim, name)

    def __call__(self, params, *args, **kwargs):
        self.optim(params, *args, **kwargs)

    def get_state(self):
        return self.optim.get_state()

    def set_state(self, state_dict):
        self.optim.set_state(state_dict)


class Averaged(WrappedOptim):
    """A :class:`~pyro.optim.PyroOptim` that steps ``optim`` and keeps the
    polynomial-decay average of each parameter's iterates (see the module).

    :param pyro.optim.PyroOptim optim: the optimiser that trains (e.g.
        ``pyro.optim.Adam({"lr": 1e-2})``); its state, learning-rate schedule and
        checkpoints (``get_state`` / ``set_state``) are its own.
    :param float eta: the average's decay :math:`\\eta \\ge 0` (default 2: iterate
        :math:`s` of :math:`t` weighs about :math:`(s/t)^2`, so the average's mean age is
        the last quarter of the run).
    """

    def __init__(self, optim, eta=2.0):
        super().__init__(optim)
        if isinstance(optim, Averaged):
            raise TypeError("the optimiser is already Averaged")
        if not eta >= 0:
            raise ValueError(f"eta must be >= 0, got {eta!r}")
        self.eta = float(eta)
        #: ``{parameter: (average, number of iterates)}``, keyed by the stepped tensors
        self.averages = {}
        self._swapped = False

    def __call__(self, params, *args, **kwargs):
        if self._swapped:
            raise RuntimeError(
                "a step inside `with optim.averaged():` would train the averages: leave "
                "the block first"
            )
        params = list(params)
        self.optim(params, *args, **kwargs)
        with torch.no_grad():
            for p in params:
                average, count = self.averages.get(p, (None, 0))
                count += 1
                if average is None or average.shape != p.shape:
                    average, count = p.detach().clone(), 1
                else:
                    average.add_(p.detach() - average, alpha=(self.eta + 1) / (count + self.eta))
                self.averages[p] = (average, count)

    @contextlib.contextmanager
    def averaged(self):
        """Within the block every parameter this optimiser has stepped holds its average
        (in place, so guides, ``Predictive`` and particle methods read it); on leaving,
        the iterates are put back. A step inside the block is refused."""
        if self._swapped:
            raise RuntimeError("already inside `with optim.averaged():`")
        saved = []
        with torch.no_grad():
            for p, (average, _) in self.averages.items():
                saved.append((p, p.detach().clone()))
                p.copy_(average)
        self._swapped = True
        try:
            yield self
        finally:
            with torch.no_grad():
                for p, value in saved:
                    p.copy_(value)
            self._swapped = False
