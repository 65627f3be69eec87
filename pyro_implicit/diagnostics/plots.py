"""Plots of a fitted approximation against NUTS (matplotlib).

Every function returns a ``matplotlib.figure.Figure`` built without ``pyplot``, so no
global figure state is touched and no GUI backend is needed: save it with
``fig.savefig(path)``, or show it in a notebook as the cell's value. ::

    from pyro_implicit.diagnostics.plots import loss_curves, pair_plot

    result = compare(model, *args)
    pair_plot(result.methods["kivi"].samples, result.nuts.samples,
              label="kivi").savefig("kivi.png")
    loss_curves(result).savefig("losses.png")

* :func:`pair_plot`: marginal histograms on the diagonal and pairwise scatter below it,
  the method over NUTS, for chosen sites or coordinates.
* :func:`loss_curves`: every method's optimisation trace, one panel each (the losses of
  different methods measure different things, so they do not share an axis).
* :func:`regression_predictive_plot`: for a regression model (e.g. a
  :class:`~pyro_implicit.bnn.BNNRegression`), the predictive mean and central band of
  each method against NUTS's at test inputs.
"""

import math
import textwrap

import torch

from .metrics import flatten_samples

__all__ = ["loss_curves", "pair_plot", "regression_predictive_plot", "select_coordinates"]

#: colours: the method, the NUTS reference
METHOD_COLOR = "tab:blue"
NUTS_COLOR = "0.35"


def _figure(width, height):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def select_coordinates(samples, coords=None, max_coords=6):
    """Flattened coordinates to plot.

    :param dict samples: site name -> ``(S, ...)`` draws (the reference's sites).
    :param coords: site names (all of a site's coordinates) and/or coordinate names such
        as ``"theta[3]"``, ``"beta[0]"``; ``None`` takes the first ``max_coords``
        coordinates in site order that vary (constant ones, such as the fixed entries of an
        LKJ Cholesky factor, make empty panels).
    :param int max_coords: cap on the number of coordinates.
    :return: ``(x, names)``: ``(S, K)`` float64 draws and the K coordinate names.
    :rtype: tuple[torch.Tensor, list[str]]
    :raises ValueError: for a name that is neither a site nor a coordinate.
    """
    x, names = flatten_samples(samples)
    x = x.cpu()  # matplotlib reads numpy: draws made on a GPU are plotted from the CPU
    if coords is None:
        spread = x.std(0) if x.shape[0] > 1 else torch.ones(x.shape[1], dtype=x.dtype)
        varying = [
            i for i in range(len(names)) if spread[i] > 1e-12 * (1 + float(x[:, i].abs().max()))
        ]
        keep = (varying or list(range(len(names))))[:max_coords]
    else:
        if isinstance(coords, str):
            coords = [coords]
        keep = []
        for c in coords:
            hits = [i for i, n in enumerate(names) if n == c or n.startswith(c + "[")]
            if not hits:
                raise ValueError(f"no site or coordinate {c!r}; coordinates are {names}")
            keep += [i for i in hits if i not in keep]
        keep = keep[:max_coords]
    return x[:, keep], [names[i] for i in keep]


def _thin(x, max_points, generator):
    if x.shape[0] <= max_points:
        return x
    return x[torch.randperm(x.shape[0], generator=generator)[:max_points]]


def pair_plot(
    samples,
    reference,
    coords=None,
    max_coords=6,
    label="method",
    reference_label="NUTS",
    bins=40,
    max_points=600,
    seed=0,
):
    """Marginals and pairwise scatter of an approximation over the reference draws.

    The diagonal holds the two marginal histograms (densities, shared bins), the lower
    triangle scatter plots of up to ``max_points`` draws of each (reference below, method
    on top), the upper triangle is left empty.

    :param dict samples: site name -> ``(S, ...)`` draws of the method.
    :param dict reference: site name -> ``(R, ...)`` NUTS draws (same sites).
    :param coords: sites or coordinates to plot (see :func:`select_coordinates`).
    :param int max_coords: cap on the number of coordinates.
    :param str label: legend name of the method.
    :param str reference_label: legend name of the reference.
    :param int bins: histogram bins.
    :param int max_points: draws per set shown in a scatter panel.
    :param int seed: seed of the thinning (a private generator).
    :rtype: matplotlib.figure.Figure
    """
    # the method's site order (the model's), not the reference's (NUTS sorts its sites)
    reference = {
        k: reference[k] for k in list(samples) + list(reference) if k in reference and k in samples
    }
    ref, names = select_coordinates(reference, coords, max_coords)
    full, all_names = flatten_samples({k: samples[k] for k in reference})
    full = full.cpu()
    index = {n: i for i, n in enumerate(all_names)}
    draws = full[:, [index[n] for n in names]]
    k = len(names)
    size = max(2.0, min(2.2, 12.0 / k))
    fig = _figure(size * k + 0.5, size * k + 0.3)
    axes = fig.subplots(k, k, squeeze=False)
    generator = torch.Generator().manual_seed(seed)
    ref_pts = _thin(ref, max_points, generator).numpy()
    draw_pts = _thin(draws, max_points, generator).numpy()
    for i in range(k):
        for j in range(k):
            ax = axes[i, j]
            if j > i:
                ax.set_axis_off()
                continue
            if i == j:
                both = torch.cat([ref[:, i], draws[:, i]])
                finite = both[torch.isfinite(both)]
                lo, hi = (float(finite.min()), float(finite.max())) if finite.numel() else (0, 1)
                edges = torch.linspace(lo, hi if hi > lo else lo + 1.0, bins + 1).numpy()
                ax.hist(
                    ref[:, i].numpy(),
                    bins=edges,
                    density=True,
                    color=NUTS_COLOR,
                    alpha=0.45,
                    label=reference_label,
                )
                ax.hist(
                    draws[:, i].numpy(),
                    bins=edges,
                    density=True,
                    histtype="step",
                    color=METHOD_COLOR,
                    linewidth=1.5,
                    label=label,
                )
                ax.set_yticks([])
            else:
                ax.scatter(
                    ref_pts[:, j], ref_pts[:, i], s=3, color=NUTS_COLOR, alpha=0.35, linewidths=0
                )
                # a small set (particles) is drawn larger and opaque, so it stays visible
                few = draw_pts.shape[0] <= 200
                ax.scatter(
                    draw_pts[:, j],
                    draw_pts[:, i],
                    s=10 if few else 3,
                    color=METHOD_COLOR,
                    alpha=0.9 if few else 0.35,
                    linewidths=0,
                )
            if i == k - 1:
                ax.set_xlabel(names[j])
            if j == 0 and i > 0:
                ax.set_ylabel(names[i])
    axes[0, 0].legend(fontsize="small", loc="upper right", frameon=False)
    if k == 1:
        axes[0, 0].set_xlabel(names[0])
    fig.suptitle(f"{label} over {reference_label}")
    return fig


def _moving_average(values, window):
    t = torch.as_tensor(values, dtype=torch.float64)
    if window <= 1 or t.numel() < window:
        return t
    kernel = torch.full((1, 1, window), 1.0 / window, dtype=torch.float64)
    return torch.nn.functional.conv1d(t.view(1, 1, -1), kernel).view(-1)


def loss_curves(traces, window=None):
    """Optimisation traces, one panel per method, raw (light) and a moving average.

    :param traces: a :class:`~pyro_implicit.diagnostics.compare.ComparisonResult` (its
        methods with a loss trace) or a dict ``name -> list of losses`` or ``name ->
        (losses, y-axis label)``.
    :param int window: moving-average width (default: a fiftieth of the run, at least 1).
    :rtype: matplotlib.figure.Figure
    :raises ValueError: if no method has a trace.
    """
    if hasattr(traces, "methods"):
        traces = {n: (r.losses, r.loss_label) for n, r in traces.methods.items() if r.losses}
    items = []
    for name, value in traces.items():
        losses, ylabel = value if isinstance(value, tuple) else (value, "loss")
        if len(losses):
            items.append((name, [float(v) for v in losses], ylabel))
    if not items:
        raise ValueError("no loss traces to plot")
    cols = min(3, len(items))
    rows = math.ceil(len(items) / cols)
    fig = _figure(4.2 * cols, 2.8 * rows)
    axes = fig.subplots(rows, cols, squeeze=False).reshape(-1)
    for ax, (name, losses, ylabel) in zip(axes, items, strict=False):
        steps = torch.arange(1, len(losses) + 1)
        w = window or max(1, len(losses) // 50)
        smooth = _moving_average(losses, w)
        ax.plot(steps.numpy(), losses, color=METHOD_COLOR, alpha=0.25, linewidth=0.8)
        ax.plot(
            steps[w - 1 : w - 1 + smooth.numel()].numpy(),
            smooth.numpy(),
            color=METHOD_COLOR,
            linewidth=1.5,
        )
        # the first steps are often orders of magnitude above the rest
        tail = torch.tensor(losses[len(losses) // 10 :])
        tail = tail[torch.isfinite(tail)]
        if tail.numel() > 1:
            lo, hi = float(tail.min()), float(tail.max())
            pad = 0.1 * (hi - lo) or 1.0
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("\n".join(textwrap.wrap(ylabel, 30)), fontsize="small")
    for ax in axes[len(items) :]:
        ax.set_axis_off()
    return fig


def _band(values, prob):
    lo = torch.quantile(values, (1 - prob) / 2, dim=0)
    hi = torch.quantile(values, (1 + prob) / 2, dim=0)
    return values.mean(0), lo, hi


def regression_predictive_plot(
    model,
    x,
    draws,
    reference,
    y=None,
    kwargs=None,
    max_plate_nesting=None,
    mean_site="f",
    obs_site="obs",
    prob=0.9,
    seed=0,
):
    """Predictive mean and central ``prob`` band of each method against NUTS at inputs
    ``x``, for a regression model ``model(x, y=None, **kwargs)`` with a function-value
    site (``mean_site``, a ``pyro.deterministic``) and a Gaussian-like observed site.

    Test points are ordered by the NUTS predictive mean (or by ``x`` itself for a single
    input feature). Each panel shows NUTS's mean line and band in grey, the method's in
    colour, and the targets ``y`` as dots.

    :param callable model: the regression model (e.g.
        :class:`~pyro_implicit.bnn.BNNRegression`), vectorisation-safe.
    :param torch.Tensor x: ``(n, in_dim)`` test inputs.
    :param dict draws: method name -> ``{site: (S, ...)}`` posterior draws.
    :param dict reference: ``{site: (R, ...)}`` NUTS draws.
    :param torch.Tensor y: ``(n,)`` test targets to overlay, optional.
    :param dict kwargs: further keyword arguments of ``model``.
    :param int max_plate_nesting: the model's plate nesting (guessed if ``None``).
    :param str mean_site: site of the function values (the line).
    :param str obs_site: observed site whose draws give the band (noise included).
    :param float prob: mass of the central band.
    :param int seed: seed of the predictive noise draws.
    :rtype: matplotlib.figure.Figure
    """
    from .arviz import predictive_samples

    kwargs = dict(kwargs or {})
    sites = [mean_site, obs_site]

    def predict(d):
        out = predictive_samples(
            model, (x,), kwargs, d, sites=sites, max_plate_nesting=max_plate_nesting, seed=seed
        )
        return out[mean_site].to("cpu", torch.float64).mean(0), _band(
            out[obs_site].to("cpu", torch.float64), prob
        )

    ref_mean, (_, ref_lo, ref_hi) = predict(reference)
    if x.shape[-1] == 1:
        order = torch.argsort(x[:, 0].cpu())
        pos = x[:, 0].cpu()[order]
        xlabel = "x"
    else:
        order = torch.argsort(ref_mean)
        pos = torch.arange(x.shape[0], dtype=torch.float64)
        xlabel = "test point (ordered by the NUTS predictive mean)"
    pos = pos.numpy()

    cols = min(3, len(draws))
    rows = math.ceil(len(draws) / cols)
    fig = _figure(4.5 * cols, 3.0 * rows)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).reshape(-1)
    pct = f"{100 * prob:g}%"
    for ax, (name, d) in zip(axes, draws.items(), strict=False):
        mean, (_, lo, hi) = predict(d)
        ax.fill_between(
            pos,
            ref_lo[order].numpy(),
            ref_hi[order].numpy(),
            color=NUTS_COLOR,
            alpha=0.3,
            linewidth=0,
            label=f"NUTS {pct}",
        )
        ax.plot(pos, ref_mean[order].numpy(), color=NUTS_COLOR, linewidth=1.2, label="NUTS mean")
        ax.fill_between(
            pos,
            lo[order].numpy(),
            hi[order].numpy(),
            color=METHOD_COLOR,
            alpha=0.25,
            linewidth=0,
            label=f"{name} {pct}",
        )
        ax.plot(pos, mean[order].numpy(), color=METHOD_COLOR, linewidth=1.2, label=f"{name} mean")
        if y is not None:
            ax.scatter(pos, y.cpu()[order].numpy(), s=5, color="k", zorder=3, label="y")
        ax.set_title(name)
        ax.set_xlabel(xlabel, fontsize="small")
        ax.legend(fontsize="x-small", frameon=False)
    for ax in axes[len(draws) :]:
        ax.set_axis_off()
    return fig
