"""Plots: figure layout and that what is drawn is the data handed in."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from pyro_implicit.bnn import BNNRegression  # noqa: E402
from pyro_implicit.diagnostics.plots import (  # noqa: E402
    loss_curves,
    pair_plot,
    regression_predictive_plot,
    select_coordinates,
)


def _draws(n, shift=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "mu": torch.randn(n, generator=g) + shift,
        "theta": torch.randn(n, 3, generator=g) + shift,
    }


def test_select_coordinates():
    draws = _draws(50)
    x, names = select_coordinates(draws)
    assert names == ["mu", "theta[0]", "theta[1]", "theta[2]"] and x.shape == (50, 4)
    x, names = select_coordinates(draws, coords=["theta[2]", "mu"])
    assert names == ["theta[2]", "mu"]
    assert torch.equal(x[:, 0], draws["theta"][:, 2].double())
    _, names = select_coordinates(draws, coords="theta", max_coords=2)
    assert names == ["theta[0]", "theta[1]"]
    with pytest.raises(ValueError, match="no site or coordinate 'nope'"):
        select_coordinates(draws, coords=["nope"])


def test_pair_plot_layout_and_data(tmp_path):
    method, nuts = _draws(300, shift=1.0, seed=1), _draws(200, seed=2)
    fig = pair_plot(method, nuts, coords=["mu", "theta[1]"], label="implicit", max_points=100)
    axes = fig.axes
    assert len(axes) == 4  # 2 x 2 grid, upper triangle switched off
    assert not axes[1].axison
    assert axes[2].get_xlabel() == "mu" and axes[2].get_ylabel() == "theta[1]"
    # lower-left panel: reference points then method points, 100 of each, with the
    # method's x coordinates taken from its own mu draws
    ref_pts, method_pts = (c.get_offsets() for c in axes[2].collections)
    assert ref_pts.shape == (100, 2) and method_pts.shape == (100, 2)
    mu = method["mu"].double().numpy()
    assert all(any(abs(v - m) < 1e-12 for m in mu) for v in method_pts[:, 0])
    # diagonal histograms integrate to one (densities on shared bins)
    from matplotlib.patches import Rectangle

    bars = [p for p in axes[0].patches if isinstance(p, Rectangle)]  # the filled reference
    heights = [p.get_height() * p.get_width() for p in bars]
    assert abs(sum(heights) - 1.0) < 1e-6
    assert axes[0].get_legend() is not None
    fig.savefig(tmp_path / "pairs.png")
    assert (tmp_path / "pairs.png").stat().st_size > 0


def test_loss_curves():
    traces = {"a": [5.0, 4.0, 3.0, 2.5, 2.0] * 20, "b": ([1.0, 0.5] * 50, "force"), "c": []}
    fig = loss_curves(traces, window=1)
    drawn = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == ["a", "b"]  # empty traces skipped
    assert drawn[1].get_ylabel() == "force"
    assert list(drawn[0].lines[0].get_ydata()) == traces["a"]
    with pytest.raises(ValueError, match="no loss traces"):
        loss_curves({"c": []})


def test_regression_predictive_plot():
    torch.manual_seed(0)
    bnn = BNNRegression(1, hidden_dims=(4,), activation="tanh")
    x = torch.linspace(-2, 2, 15).unsqueeze(-1)
    y = torch.sin(x[:, 0])

    def draws(n, scale):
        return {
            "layer0": scale * torch.randn(n, 2, 4),
            "layer1": scale * torch.randn(n, 5, 1),
            "precision": torch.full((n,), 100.0),
        }

    nuts, method = draws(200, 1.0), draws(150, 0.5)
    fig = regression_predictive_plot(bnn, x, {"m": method}, nuts, y=y, max_plate_nesting=1)
    (ax,) = [a for a in fig.axes if a.axison]
    nuts_line, method_line = ax.lines
    # one input feature: points ordered by x, lines are the mean of the function values
    assert list(nuts_line.get_xdata()) == x[:, 0].tolist()
    expected = bnn.forward({k: method[k] for k in ("layer0", "layer1")}, x).mean(0)
    assert torch.allclose(torch.as_tensor(method_line.get_ydata()), expected, atol=1e-10)
    assert ax.get_title() == "m"


def test_default_coordinates_skip_constant_ones_and_follow_the_method():
    """An LKJ factor's fixed entries (constant in every draw) make no panel, and the
    coordinates come in the method's (the model's) site order, not the reference's."""
    chol = torch.zeros(300, 2, 2)
    chol[:, 0, 0] = 1.0
    chol[:, 1, 0] = torch.rand(300) - 0.5
    chol[:, 1, 1] = (1 - chol[:, 1, 0] ** 2).sqrt()
    _, names = select_coordinates({"L": chol})
    assert names == ["L[1,0]", "L[1,1]"]
    method = {"z": torch.randn(50), "a": torch.randn(50)}
    reference = {"a": torch.randn(300), "z": torch.randn(300)}  # NUTS: sorted
    fig = pair_plot(method, reference)
    assert [ax.get_xlabel() for ax in fig.axes if ax.get_xlabel()] == ["z", "a"]
