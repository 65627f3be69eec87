"""Traced log-density graphs: the same numbers as the eager path, and eager where a graph
would be wrong."""

import logging

import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_implicit.compiled import CompiledLogDensity
from pyro_implicit.latent import LatentSpace
from pyro_implicit.models import load_model


def eager_and_compiled(model, args, kwargs=None, mpn=1, backend="fx"):
    eager = LatentSpace.from_model(model, args, kwargs, mpn)
    compiled = LatentSpace.from_model(model, args, kwargs, mpn).compile(backend)
    return eager, compiled


def test_same_numbers_as_eager_on_eight_schools():
    m = load_model("eight_schools")
    eager, compiled = eager_and_compiled(m.model, m.args, m.kwargs, m.max_plate_nesting)
    for num in (5, 50):
        u = torch.randn(num, eager.latent_dim)
        lp, score = eager.score(u, m.args, m.kwargs)
        lp_c, score_c = compiled.score(u, m.args, m.kwargs)
        assert torch.allclose(lp_c, lp, rtol=1e-12, atol=1e-12)
        assert torch.allclose(score_c, score, rtol=1e-12, atol=1e-12)
    # one graph per batch shape, replayed on new values
    assert compiled.compiled.active and compiled.compiled.stats["traces"] == 2
    u = torch.randn(50, eager.latent_dim)
    expected = eager.score(u, m.args, m.kwargs)[1]
    assert torch.allclose(compiled.score(u, m.args, m.kwargs)[1], expected)
    assert compiled.compiled.stats["traces"] == 2


def grouped(x, group, shifted, y):
    # group-level coefficients gathered per row (beta[..., group, :]) and a group-level
    # offset gathered by a constant index holding -1 (which aten.index wraps)
    beta = pyro.sample("beta", dist.Normal(torch.zeros(3, 2), 1.0).to_event(2))
    offset = pyro.sample("offset", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("data", x.shape[0]):
        loc = (x * beta[..., group, :]).sum(-1) + offset[..., shifted]
        pyro.sample("obs", dist.Normal(loc, 0.5), obs=y)


def test_gathers_along_one_dim_are_rewritten_with_the_same_numbers():
    """``beta[..., group, :]`` and its gradient become ``index_select`` / ``index_add``
    (faster on the CPU); an index with -1 in it keeps ``aten.index`` (which wraps it); the
    score is the eager one either way."""
    g = torch.Generator().manual_seed(0)
    group = torch.arange(40) % 3
    args = (torch.randn(40, 2, generator=g), group, group - 1, torch.randn(40, generator=g))
    eager, compiled = eager_and_compiled(grouped, args)
    u = torch.randn(16, eager.latent_dim, generator=g)
    for expected, got in zip(eager.score(u, args), compiled.score(u, args), strict=True):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    # beta's gather and its gradient; offset's (by an index with -1) stay as traced
    assert compiled.compiled.stats["rewritten_nodes"] == 2


def _traced_twice(function, *inputs):
    """``function`` traced by ``make_fx`` twice: as traced, and simplified."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from pyro_implicit.compiled import _simplify

    as_traced, simplified = make_fx(function)(*inputs), make_fx(function)(*inputs)
    removed = _simplify(simplified)
    return as_traced, simplified, removed


def test_simplified_graphs_give_the_same_bits_with_fewer_nodes():
    """Eight schools' score graph simplified: the same scores and log-densities to the bit
    as the graph as traced (and as the eager run to float rounding), from fewer nodes."""
    from unittest import mock

    from pyro_implicit.compiled import CompiledLogDensity

    m = load_model("eight_schools")
    eager = LatentSpace.from_model(m.model, m.args, m.kwargs, m.max_plate_nesting)
    simplified = LatentSpace.from_model(m.model, m.args, m.kwargs, 1).compile()
    with mock.patch.object(CompiledLogDensity, "simplify", False):
        as_traced = LatentSpace.from_model(m.model, m.args, m.kwargs, 1).compile()
        u = torch.randn(7, eager.latent_dim)
        expected = as_traced.score(u, m.args, m.kwargs)
    got = simplified.score(u, m.args, m.kwargs)
    assert as_traced.compiled.stats["removed_nodes"] == 0
    assert simplified.compiled.stats["removed_nodes"] > 20  # of about 160
    for a, b, c in zip(expected, got, eager.score(u, m.args, m.kwargs), strict=True):
        assert torch.equal(a, b)
        assert torch.allclose(b, c, rtol=1e-12, atol=1e-12)


def test_simplify_keeps_what_an_in_place_write_separates():
    """A copy of a tensor that is written afterwards (``c = b * 1`` before ``b.add_``, also
    through ``_unsafe_view``, an alias its schema does not declare), and a repeat of an
    operation whose first result is written (two ``exp``), stay; the idle ``x + 0`` of an
    unwritten tensor goes."""

    def written_after_copies(x):
        b = x * 2
        c = b * 1
        b.add_(1)
        e1 = x.exp()
        e1.mul_(3)
        e2 = x.exp()
        f = x * 3
        g = f * 1
        torch.ops.aten._unsafe_view(f, [2, 2]).add_(1)
        return (x + 0) * 5 + c + b + e1 + e2 + f + g

    x = torch.randn(4)
    as_traced, simplified, removed = _traced_twice(written_after_copies, x)
    assert removed >= 1
    assert torch.equal(simplified(x), written_after_copies(x))
    assert torch.equal(simplified(x), as_traced(x))


def test_simplify_keeps_unused_random_draws():
    """A draw whose value is unused still advances the random stream (a subsample's
    indices: the next draws must be the ones the eager run makes); repeated draws are not
    merged."""

    def draws(x):
        torch.randperm(5)
        return x + torch.rand(3) + torch.rand(3)

    x = torch.zeros(3)
    as_traced, simplified, _ = _traced_twice(draws, x)
    torch.manual_seed(1)
    expected, after = as_traced(x), torch.rand(1)
    torch.manual_seed(1)
    got, got_after = simplified(x), torch.rand(1)
    assert torch.equal(got, expected) and torch.equal(got_after, after)


def test_simplify_computes_constants_once_but_not_what_is_written():
    """What does not depend on the input (a constant's logarithm broadcast, zeros of the
    input's shape) becomes a buffer; zeros that are written in place on every call stay
    an operation of the graph (as a buffer they would carry the last call's sum into the
    next)."""

    def constants(x):
        scale = torch.tensor([2.0, 3.0, 4.0])
        total = torch.zeros_like(x)
        total.add_(x)
        return x * scale.log().expand(3) + torch.ones_like(x) + total

    x = torch.randn(3)
    as_traced, simplified, _ = _traced_twice(constants, x)
    targets = [n.target for n in simplified.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.log.default not in targets
    assert torch.ops.aten.ones_like.default not in targets
    assert torch.ops.aten.zeros_like.default in targets
    for _ in range(2):
        assert torch.equal(simplified(x), as_traced(x))
        assert torch.equal(simplified(x), constants(x))


def test_simplify_merges_repeats_and_drops_unused_results():
    def repeats(x):
        x.sin()  # unused
        return x.exp() + x.exp()

    x = torch.randn(3)
    _, simplified, removed = _traced_twice(repeats, x)
    targets = [n.target for n in simplified.graph.nodes if n.op == "call_function"]
    assert removed == 2 and targets.count(torch.ops.aten.exp.default) == 1
    assert torch.ops.aten.sin.default not in targets
    assert torch.equal(simplified(x), 2 * x.exp())


def subsampled(x, y, subsample_size=None):
    beta = pyro.sample("beta", dist.Normal(torch.zeros(2), 2.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(0.0, 1.0))
    with pyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
        pyro.sample("obs", dist.Normal((x[idx] * beta).sum(-1), scale), obs=y[idx])


def test_subsampled_model_full_data_and_fresh_minibatches():
    """The full-data score is exact; a minibatch score draws fresh indices on every call
    (the subsample is an operation in the graph, not a constant) from the same random
    stream as the eager path."""
    g = torch.Generator().manual_seed(0)
    # 45 rows in minibatches of 10: the fifth wraps around to the first rows
    x, y = torch.randn(45, 2, generator=g), torch.randn(45, generator=g)
    kwargs = {"subsample_size": 10}
    eager, compiled = eager_and_compiled(subsampled, (x, y), kwargs)
    u = torch.randn(8, 3)
    # the full data through one minibatch's graph, its indices an input
    for expected, got in zip(
        eager.score(u, (x, y), kwargs), compiled.score(u, (x, y), kwargs), strict=True
    ):
        assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert compiled.compiled.active and compiled.compiled.stats["traces"] == 1
    draws = []
    for space in (eager, compiled):
        pyro.set_rng_seed(3)
        draws.append([space.score(u, (x, y), kwargs, full_data=False)[0] for _ in range(3)])
    for e, c in zip(*draws, strict=True):
        assert torch.allclose(c, e)
    assert not torch.allclose(draws[1][0], draws[1][1])  # a new minibatch each call


@pytest.mark.parametrize("stackable", [True, False])
def test_full_data_of_few_draws_runs_its_minibatches_stacked(stackable, monkeypatch):
    """At few draws the full data's minibatches run stacked through one vmapped graph, in
    as many replays as :data:`~pyro_implicit.compiled.STACKED_MINIBATCH_DRAWS` asks for
    (a padded last stack counts its real minibatches only); a model that cannot run so
    replays one minibatch at a time. The same numbers either way, and as eager's."""
    if not stackable:
        monkeypatch.setattr(CompiledLogDensity, "_trace_stacked", staticmethod(lambda *a: None))
    g = torch.Generator().manual_seed(2)
    # 45 rows in minibatches of 10: five minibatches, the fifth wrapping around
    x, y = torch.randn(45, 2, generator=g), torch.randn(45, generator=g)
    kwargs = {"subsample_size": 10}
    eager, compiled = eager_and_compiled(subsampled, (x, y), kwargs)
    # 1 and 8 draws: one stack of five; 20: stacks of two, the third padded; 64: one by one
    for num, stacked in ((1, 1), (8, 2), (20, 3), (64, 3)):
        u = torch.randn(num, 3, generator=g)
        for expected, got in zip(
            eager.score(u, (x, y), kwargs), compiled.score(u, (x, y), kwargs), strict=True
        ):
            assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
        assert compiled.compiled.stats["stacked_traces"] == (stacked if stackable else 0)
    assert compiled.compiled.active


def two_data_sets(ya, yb, sizes=(None, None)):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    nu = pyro.sample("nu", dist.LogNormal(0.0, 1.0))
    with pyro.plate("a", ya.shape[0], subsample_size=sizes[0]) as i:
        pyro.sample("ya", dist.Normal(mu, nu), obs=ya[i])
    with pyro.plate("b", yb.shape[0], subsample_size=sizes[1]) as j:
        pyro.sample("yb", dist.Normal(-mu, 1.0), obs=yb[j])


def crossed(y, sizes=(None, None)):
    rows = pyro.sample("rows", dist.Normal(0.0, 1.0).expand([y.shape[0]]).to_event(1))
    cols = pyro.sample("cols", dist.Normal(0.0, 1.0).expand([y.shape[1]]).to_event(1))
    with pyro.plate("r", y.shape[0], subsample_size=sizes[0], dim=-2) as r:
        with pyro.plate("c", y.shape[1], subsample_size=sizes[1], dim=-1) as c:
            mean = rows[..., r].unsqueeze(-1) + cols[..., c].unsqueeze(-2)
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y[r][:, c])


@pytest.mark.parametrize(
    "layout",
    [
        "one plate, wrapped",
        "two data sets",
        "two data sets, wrapped",
        "crossed",
        "crossed, wrapped",
    ],
)
def test_full_data_of_any_subsampled_layout_is_exact(layout):
    """The full data of a subsampled model, eager and traced (minibatches stacked or one by
    one), is the unsubsampled model's log-density and score: independent plates each
    cover their data side by side, crossed plates meet in every block, and the rows a
    wrapped last minibatch repeats are masked (each plate's terms weighted to make up for
    them)."""
    g = torch.Generator().manual_seed(4)
    if layout == "one plate":  # 45 rows in minibatches of 10: the fifth wraps
        x, y = torch.randn(45, 2, generator=g), torch.randn(45, generator=g)
        model, args, mpn, dim = subsampled, (x, y), 1, 3
        sub, full = {"subsample_size": 10}, {}
    elif layout.startswith("two data sets"):
        model, mpn, dim = two_data_sets, 1, 2
        args = (torch.randn(60, generator=g), torch.randn(20, generator=g))
        sub, full = {"sizes": (10, 6 if "wrapped" in layout else 5)}, {}
    else:
        model, args, mpn = crossed, (torch.randn(12, 8, generator=g),), 2
        dim = 20
        sub, full = {"sizes": (5 if "wrapped" in layout else 6, 4)}, {}
    exact = LatentSpace.from_model(model, args, full, mpn)
    eager, compiled = eager_and_compiled(model, args, sub, mpn)
    # independent plates side by side (the longer's count), crossed ones in every pair
    passes = {"one plate": 5, "two data sets": 6, "crossed": 4, "crossed, wrapped": 6}
    assert len(eager.covering_minibatches()) == passes.get(layout, 6)
    for num in (1, 8, 64):
        u = 0.3 * torch.randn(num, dim, generator=g)
        expected = exact.score(u, args, full)
        for space in (eager, compiled):
            for got, want in zip(space.score(u, args, sub), expected, strict=True):
                assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
    assert compiled.compiled.active and compiled.compiled.stats["stacked_traces"] >= 1


def counts_positives(x, y, subsample_size=None):
    # a Python number computed from the minibatch's data: a graph freezes it
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", y.shape[0], subsample_size=subsample_size) as idx:
        positives = len(torch.nonzero(y[idx] > 0))
        scale = 0.3 + 0.1 * positives
        pyro.sample("obs", dist.Normal((x[idx] * w).sum(-1), scale), obs=y[idx])


def masks_positives(x, y, subsample_size=None):
    # a shape computed from the minibatch's data: a graph's replay on another fails
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with pyro.plate("data", y.shape[0], subsample_size=subsample_size) as idx:
        mean = (x[idx] * w).sum(-1)
        pyro.sample("obs", dist.Normal(mean, 0.5), obs=y[idx])
    positive = y[idx] > 0
    pyro.factor("penalty", -((y[idx] - mean)[..., positive] ** 2).sum(-1))


@pytest.mark.parametrize("model", [counts_positives, masks_positives])
@pytest.mark.parametrize("full_data", [True, False])
def test_a_model_whose_graph_depends_on_the_datas_values_runs_eagerly(model, full_data):
    """A number or a shape the model computes from a minibatch's data is frozen in the
    traced graph: its replay on other minibatches gave another log-density or failed.
    The trace is checked against the eager model on other minibatches, and the space runs
    eagerly, saying why."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(60, 2, generator=g), torch.randn(60, generator=g)
    kwargs = {"subsample_size": 10}
    eager, compiled = eager_and_compiled(model, (x, y), kwargs)
    u = torch.randn(4, 2, generator=g)
    for _ in range(3):  # fresh minibatches on every call where full_data=False
        pyro.set_rng_seed(7)
        want = eager.score(u, (x, y), kwargs, full_data)
        pyro.set_rng_seed(7)
        got = compiled.score(u, (x, y), kwargs, full_data)
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
    assert not compiled.compiled.active
    assert "other minibatch" in compiled.compiled.fallback_reason


def test_new_data_is_traced_anew():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 2, generator=g), torch.randn(30, generator=g)
    eager, compiled = eager_and_compiled(subsampled, (x, y))
    u = torch.randn(4, 3)
    compiled.score(u, (x, y))
    y2 = y + 1.0
    assert torch.allclose(compiled.score(u, (x, y2))[1], eager.score(u, (x, y2))[1])
    y2.add_(1.0)  # changed in place: traced anew too
    assert torch.allclose(compiled.score(u, (x, y2))[1], eager.score(u, (x, y2))[1])
    assert compiled.compiled.stats["traces"] == 3


def with_parameter(y):
    scale = pyro.param("scale", torch.tensor(1.0), constraint=dist.constraints.positive)
    mu = pyro.sample("mu", dist.Normal(torch.tensor(0.0), 1.0))
    with pyro.plate("data", y.shape[0]):
        pyro.sample("obs", dist.Normal(mu, scale), obs=y)


def test_model_parameters_stay_eager_with_the_reason_logged(caplog):
    y = torch.tensor([0.3, 1.0, -0.2])
    eager, compiled = eager_and_compiled(with_parameter, (y,))
    u = torch.randn(5, 1)
    with caplog.at_level(logging.INFO, logger="pyro_implicit.compiled"):
        lp, score = compiled.score(u, (y,))
    assert not compiled.compiled.active
    assert "parameters ['scale']" in compiled.compiled.fallback_reason
    assert "runs eagerly" in caplog.text
    assert torch.allclose(score, eager.score(u, (y,))[1])
    # the eager path follows the parameter as it trains
    with torch.no_grad():
        pyro.param("scale").unconstrained().fill_(1.0)  # scale = e
    assert torch.allclose(compiled.score(u, (y,))[1], eager.score(u, (y,))[1])
    assert not torch.allclose(compiled.score(u, (y,))[1], score)


def test_too_many_signatures_fall_back():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 2, generator=g)
    space = LatentSpace.from_model(subsampled, (x, torch.randn(20)), None, 1).compile(
        max_signatures=2
    )
    u = torch.randn(3, 3)
    for _ in range(3):
        space.score(u, (x, torch.randn(20, generator=g)))
    assert not space.compiled.active and "signatures" in space.compiled.fallback_reason


def _fit_losses(
    loss_cls, compile, model, args, kwargs, mpn, steps=25, guide_cls=None, **loss_kwargs
):
    from pyro.infer import SVI

    from pyro_implicit import ImplicitGuide

    precondition = _preconditioner(model, args, kwargs)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = (guide_cls or ImplicitGuide)(model, precondition=precondition)
    loss = loss_cls(max_plate_nesting=mpn, compile=compile, **loss_kwargs)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), loss)
    losses = [svi.step(*args, **kwargs) for _ in range(steps)]
    params = torch.cat([p.detach().flatten() for p in guide.parameters()])
    return losses, params, loss


_PRECONDITIONERS = {}


def _preconditioner(model, args, kwargs):
    """The model's automatic preconditioner, searched once per model in this module: the
    fits here compare two code paths from one start, and eight schools' search (a
    Gaussian fit in rounds) would otherwise run before every one of them."""
    from pyro_implicit import ImplicitGuide

    key = (model.__module__, model.__qualname__, tuple(sorted(kwargs.items())))
    if key not in _PRECONDITIONERS:
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        guide = ImplicitGuide(model)
        guide(*args, **kwargs)
        _PRECONDITIONERS[key] = guide.preconditioner
        pyro.clear_param_store()
    return _PRECONDITIONERS[key]


def _eight_schools():
    """``(model, args, kwargs, max_plate_nesting)`` of eight schools."""
    m = load_model("eight_schools")
    return m.model, m.args, m.kwargs, m.max_plate_nesting


def _eight_schools_and_subsampled():
    """``(model, args, kwargs, max_plate_nesting)`` of eight schools and of a subsampled
    model (a fresh minibatch every step)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 2, generator=g), torch.randn(40, generator=g)
    return [
        _eight_schools(),
        (subsampled, (x, y), {"subsample_size": 10}, 1),
    ]


def _assert_traced_path_matches(loss_cls, model, args, kwargs, mpn, **fit_kwargs):
    """Fit with the traced path and with Pyro's traces from one seed: the same losses and
    parameters, step for step (float64, the conftest's dtype). Returns the traced fit's
    loss, for the caller to check that the path was taken."""
    fast, p_fast, loss = _fit_losses(loss_cls, "fx", model, args, kwargs, mpn, **fit_kwargs)
    slow, p_slow, _ = _fit_losses(loss_cls, False, model, args, kwargs, mpn, **fit_kwargs)
    assert max(abs(a - b) for a, b in zip(fast, slow, strict=True)) < 1e-8
    assert (p_fast - p_slow).abs().max() < 1e-8
    return loss


def _took_the_direct_path(loss):
    (space,) = loss._fast_spaces.values()
    return space is not None and space.compiled.active


def test_kernel_losses_traced_path_matches_the_pyro_traces():
    """KernelRatioELBO and SteinScoreELBO after their first step draw the guide directly
    and score the draws with the traced graph: the same losses and parameters, step for
    step (the random streams are consumed in the same order), on eight schools and on a
    subsampled model (a fresh minibatch every step)."""
    from pyro_implicit import KernelRatioELBO, SteinScoreELBO

    for loss_cls in (KernelRatioELBO, SteinScoreELBO):
        for problem in _eight_schools_and_subsampled():
            loss = _assert_traced_path_matches(loss_cls, *problem)
            (plan,) = loss._fast_plans.values()
            assert plan is not None and plan[0].compiled.active  # the path was taken


def test_kernel_losses_keep_pyro_traces_where_the_graph_does_not_apply():
    from pyro_implicit import KernelRatioELBO

    # the prior as contrast needs prior draws from a model run: no plan
    _, _, loss = _fit_losses(
        KernelRatioELBO, "fx", *_eight_schools(), steps=2, adaptive_contrast=False
    )
    assert list(loss._fast_plans.values()) == [None]


def test_sivi_traced_path_matches_the_pyro_traces():
    """SIVI_ELBO after its first step draws the semi-implicit guide directly (noise, mixing
    layer, conditional), scores the draws with the traced graph and then draws its K
    extra mixing values: the same losses and parameters as Pyro's traces, step for step,
    on eight schools and on a subsampled model, with K from a schedule too."""
    from pyro_implicit import SIVI_ELBO, SemiImplicitGuide
    from pyro_implicit.elbo.sivi import linear_schedule

    eight_schools, subsampled_problem = _eight_schools_and_subsampled()

    def mixed(model, **options):  # the scale mixed too: psi has 2D entries
        return SemiImplicitGuide(model, conditional="mixed", **options)

    cases = [
        (eight_schools, {}, SemiImplicitGuide),
        (subsampled_problem, {}, SemiImplicitGuide),
        (eight_schools, {"schedule": linear_schedule(0, 20, 20)}, SemiImplicitGuide),
        (eight_schools, {}, mixed),
    ]
    for problem, extra, guide_cls in cases:
        loss = _assert_traced_path_matches(
            SIVI_ELBO,
            *problem,
            guide_cls=guide_cls,
            num_particles=8,
            num_mixing=10,
            **extra,
        )
        assert _took_the_direct_path(loss)


def test_livi_traced_path_matches_the_pyro_traces():
    """LIVI_ELBO after its first step draws the linearised guide directly (z, then the
    output noise) and scores the draws with the traced graph: the same losses and
    parameters as Pyro's traces, step for step, with either bound and on a subsampled
    model; a prior weight (which needs the prior apart) keeps the traces."""
    from pyro_implicit import LIVI_ELBO, LinearizedGuide

    eight_schools, subsampled_problem = _eight_schools_and_subsampled()
    cases = [(eight_schools, {}), (eight_schools, {"bound": "svd"}), (subsampled_problem, {})]
    for problem, extra in cases:
        loss = _assert_traced_path_matches(LIVI_ELBO, *problem, guide_cls=LinearizedGuide, **extra)
        assert _took_the_direct_path(loss)
    with pytest.warns(UserWarning, match="prior_weight"):
        _, _, loss = _fit_losses(
            LIVI_ELBO, "fx", *eight_schools, steps=2, guide_cls=LinearizedGuide, prior_weight=0.5
        )
    assert loss._fast_spaces == {}


def test_sivi_keeps_pyro_traces_for_guide_lists():
    from pyro.infer.autoguide import AutoGuideList

    from pyro_implicit import SIVI_ELBO, SemiImplicitGuide

    def guide_list(model, **options):
        guides = AutoGuideList(model)
        guides.append(SemiImplicitGuide(model, **options))
        return guides

    _, _, loss = _fit_losses(
        SIVI_ELBO,
        "fx",
        *_eight_schools(),
        steps=2,
        guide_cls=guide_list,
        num_particles=4,
        num_mixing=4,
    )
    assert list(loss._fast_spaces.values()) == [None]


def test_folded_constants_stay_within_their_storage_budget(monkeypatch):
    """Past the total budget, what would be folded is computed on every call instead: the
    same values, no buffer beyond the budget."""
    from pyro_implicit import compiled

    def priors(x):
        return x * torch.tensor([2.0, 3.0]).log() + torch.tensor([4.0, 5.0]).sqrt()

    x = torch.randn(2)
    monkeypatch.setattr(compiled, "_FOLD_MAX_TOTAL_BYTES", 16)  # one float64 pair
    _, simplified, _ = _traced_twice(priors, x)
    folded = [b for name, b in simplified.named_buffers() if name.startswith("_folded")]
    assert len(folded) == 1 and folded[0].untyped_storage().nbytes() == 16
    assert torch.equal(simplified(x), priors(x))
