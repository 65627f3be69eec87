r"""A learning rate that decays only once the fit has stopped moving: a measuring tool for
``stiff.py --schedule stationary`` (``benchmarks/results/stiff_average.md``).

At 2000 steps of constant-rate Adam the stiff benchmark fails two opposite ways: jitter on
the near-Gaussian posteriors, which a decaying rate removes, and unfinished convergence on
the funnels, which a decaying rate makes worse. This schedule decays only where the
gradient is mostly noise: Adam's own moment estimates give the test. With
:math:`m, v` Adam's bias-corrected first and second moments of every parameter, the ratio

.. math:: r = \sum m^2 / \sum v

is :math:`(1 - \beta_1) / (1 + \beta_1) \approx 0.053` for pure noise and near 1 for a
steady drift. Every ``every`` steps after ``warmup``, where :math:`r` is below ``factor``
times the noise level, every learning rate is multiplied by ``decay``, down to ``floor``
times its start. The idea of a statistical test for stationarity that triggers a rate
drop is SASA's (Lang, Xiao & Zhang 2019); this test is a simpler one.

References

[1] H. Lang, L. Xiao and P. Zhang, `Using statistics to automate stochastic
    optimization`, NeurIPS 2019.
"""

import torch
from _averaging import WrappedOptim


class StationaryDecay(WrappedOptim):
    """Steps a Pyro Adam-type optimiser and decays its rates once the gradient is noise
    (see the module).

    :param pyro.optim.PyroOptim optim: e.g. ``pyro.optim.Adam({"lr": 1e-2})``.
    """

    def __init__(self, optim, every=50, warmup=200, factor=2.0, decay=0.7, floor=0.05):
        super().__init__(optim)
        self.every, self.warmup = int(every), int(warmup)
        self.factor, self.decay, self.floor = float(factor), float(decay), float(floor)
        self.steps = 0
        self.scale = 1.0
        #: ``(step, ratio, scale)`` at every test
        self.history = []
        self._base = {}

    def __call__(self, params, *args, **kwargs):
        params = list(params)
        self.optim(params, *args, **kwargs)
        self.steps += 1
        if self.steps >= self.warmup and self.steps % self.every == 0:
            self._test()

    def _moments(self):
        num = den = 0.0
        beta1 = None
        for opt in self.optim.optim_objs.values():
            for group in opt.param_groups:
                b1, b2 = group["betas"]
                beta1 = b1
                for p in group["params"]:
                    state = opt.state.get(p)
                    if not state or "exp_avg" not in state:
                        continue
                    t = float(state["step"])
                    m = state["exp_avg"] / (1 - b1**t)
                    v = state["exp_avg_sq"] / (1 - b2**t)
                    num += m.pow(2).sum().item()
                    den += v.sum().item()
        return num, den, beta1

    def _test(self):
        num, den, beta1 = self._moments()
        if beta1 is None or den <= 0:
            return
        ratio = num / den
        noise = (1 - beta1) / (1 + beta1)
        if ratio < self.factor * noise:
            self._decay()
        self.history.append((self.steps, ratio, self.scale))

    def _decay(self):
        """Multiply every rate by ``decay``, down to ``floor`` times its start."""
        if self.scale <= self.floor:
            return
        new = max(self.floor, self.scale * self.decay)
        for opt in self.optim.optim_objs.values():
            for group in opt.param_groups:
                base = self._base.setdefault(id(group), group["lr"] / self.scale)
                group["lr"] = base * new
        self.scale = new


def _self_check():
    """Pure-noise gradients decay the rate; a steady gradient does not."""
    import pyro

    for drift, expect_decay in ((0.0, True), (1.0, False)):
        pyro.clear_param_store()
        theta = pyro.param("theta", torch.zeros(1000))
        p = theta.unconstrained()
        optim = StationaryDecay(pyro.optim.Adam({"lr": 1e-2}))
        for _ in range(600):
            p.grad = drift + torch.randn(1000)
            optim([p])
        assert (optim.scale < 1.0) == expect_decay, (drift, optim.history[-3:])
    return True


if __name__ == "__main__":
    print(_self_check())


class PlateauDecay(StationaryDecay):
    """The same decay, triggered by the loss instead: every ``every`` steps (after two
    windows), the mean loss of the last ``window`` steps against the window before; where
    it has not fallen by more than ``z`` standard errors (batch means of ten batches per
    window, which allow for the iterates' autocorrelation), the rates decay. The fitting
    loop hands it each step's loss (:meth:`record`)."""

    def __init__(self, optim, window=200, z=2.0, decay=0.5, floor=0.05):
        super().__init__(optim, every=window, warmup=2 * window, decay=decay, floor=floor)
        self.window, self.z = int(window), float(z)
        self.losses = []

    def record(self, loss):
        self.losses.append(float(loss))

    def _test(self):
        w = self.window
        if len(self.losses) < 2 * w:
            return
        last = torch.tensor(self.losses[-w:])
        prev = torch.tensor(self.losses[-2 * w : -w])
        batches = 10
        se = (
            last.reshape(batches, -1).mean(1).var() / batches
            + prev.reshape(batches, -1).mean(1).var() / batches
        ).sqrt()
        fall = (prev.mean() - last.mean()).item()
        if fall < self.z * se.item():
            self._decay()
        self.history.append((self.steps, fall / max(se.item(), 1e-12), self.scale))
