"""Data-parallel SVI on two CPU processes (gloo): the same parameters as one process
stepping over the same global minibatches."""

import os
import tempfile

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoDelta

from pyro_implicit import SIVI_ELBO, SemiImplicitGuide
from pyro_implicit.distributed import (
    DistributedOptim,
    load_checkpoint,
    rank_shard,
    save_checkpoint,
)

N, GLOBAL_BATCH, STEPS = 40, 8, 15


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 2, generator=g, dtype=torch.float64)
    y = (x * torch.tensor([1.0, -2.0], dtype=torch.float64)).sum(-1)
    return x, y + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)


def model(x, y, subsample):
    w = pyro.sample("w", dist.Normal(torch.zeros(2, dtype=x.dtype), 1.0).to_event(1))
    with pyro.plate("data", N, subsample=subsample) as i:
        pyro.sample("obs", dist.Normal((x[i] * w).sum(-1), 0.3), obs=y[i])


def _fit(method, shard):
    """Fit ``method``, each step on ``shard(global minibatch)``; the parameters at the end."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    # plain SGD for the point estimate: Adam would hide a wrong gradient scale
    optim = pyro.optim.SGD({"lr": 2e-3}) if method == "delta" else pyro.optim.Adam({"lr": 0.05})
    if tdist.is_initialized():
        optim = DistributedOptim(optim)
    if method == "delta":
        guide, loss = AutoDelta(model), Trace_ELBO()
    else:
        guide = SemiImplicitGuide(model, precondition=False)
        loss = SIVI_ELBO(num_particles=4, num_mixing=8, max_plate_nesting=1)
    svi = SVI(model, guide, optim, loss)
    batches = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        svi.step(x, y, shard(batch))
    return {k: v.detach().clone() for k, v in guide.named_parameters()}


def _rank(rank, world, store, out, method):
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        params = _fit(method, rank_shard)
        if rank == 0:
            torch.save(params, out)
        tdist.barrier()  # neither rank leaves while the other still talks
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("method", ["delta", "sivi"])
def test_two_processes_match_one(method, tmp_path):
    """Two ranks, each on half of every global minibatch, end where one process on the
    whole minibatches ends (float tolerance): the gradient averaging and the N / B
    scaling are right, and the lazily built parameters agree."""
    out = tmp_path / "params.pt"
    for attempt in range(2):
        store = os.path.join(tempfile.mkdtemp(), "store")
        try:
            mp.spawn(_rank, args=(2, store, str(out), method), nprocs=2)
            break
        except mp.ProcessExitedException:
            # a gloo worker aborted at exit (3 of 13 runs before the barrier in _rank, none
            # of 13 since): one retry; a real error fails both attempts
            if attempt:
                raise
    distributed = torch.load(out)
    single = _fit(method, lambda batch: batch)
    assert distributed.keys() == single.keys() and single
    for name in single:
        assert torch.allclose(distributed[name], single[name], rtol=1e-9, atol=1e-10), name


def test_without_a_process_group_it_says_so():
    with pytest.raises(RuntimeError, match="init_process_group"):
        rank_shard(torch.arange(4))


def _fit_steps(start, stop, save=None, load=None):
    """AutoDelta + Adam over the global minibatches ``start:stop`` (each rank on its share
    when torch.distributed is up), from a checkpoint and to one if given."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    optim = pyro.optim.Adam({"lr": 0.05})
    shard = lambda batch: batch  # noqa: E731
    if tdist.is_initialized():
        optim, shard = DistributedOptim(optim), rank_shard
    if load is not None:
        load_checkpoint(load, optim)
    guide = AutoDelta(model)
    svi = SVI(model, guide, optim, Trace_ELBO())
    batches = torch.Generator().manual_seed(1)
    for step in range(stop):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        if step >= start:
            svi.step(x, y, shard(batch))
    if save is not None:
        save_checkpoint(save, optim)
    return {k: v.detach().clone() for k, v in guide.named_parameters()}


def _checkpoint_rank(rank, world, store, path):
    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _fit_steps(0, 6, save=path)
    finally:
        tdist.destroy_process_group()


def test_a_checkpoint_of_two_ranks_resumes_in_one_process(tmp_path):
    """Parameters and Adam's moments saved by rank 0 of a two-rank run, resumed by one
    process: the end is that of one uninterrupted process."""
    path = str(tmp_path / "checkpoint.pt")
    for attempt in range(2):
        store = os.path.join(tempfile.mkdtemp(), "store")
        try:
            mp.spawn(_checkpoint_rank, args=(2, store, path), nprocs=2)
            break
        except mp.ProcessExitedException:  # see test_two_processes_match_one
            if attempt:
                raise
    resumed = _fit_steps(6, 12, load=path)
    straight = _fit_steps(0, 12)
    for name in straight:
        assert torch.allclose(resumed[name], straight[name], rtol=1e-9, atol=1e-10), name


# ---------------------------------------------------------------- particle layouts
# WeightSpaceSVGD across two ranks: "replicated" (all particles on each rank, each rank on
# half of every global minibatch) and "sharded" (half of the particles on each rank, the
# whole minibatch on each), against one process with all particles on the whole minibatch.

PARTICLES, SVGD_STEPS = 8, 8
#: the step before which WeightSpaceSVGD's fits refresh their preconditioner from the
#: particles (all N of them, gathered across ranks when sharded)
REFRESH_AT = 5


def svgd_model(x, y, subsample):
    """Vectorised over a particle plate; a model parameter in the prior and one in the
    likelihood (their gradients are combined across ranks too)."""
    prior_scale = pyro.param("prior_scale", torch.tensor(1.0), constraint=dist.constraints.positive)
    noise = pyro.param("noise", torch.tensor(0.5), constraint=dist.constraints.positive)
    w = pyro.sample("w", dist.Normal(torch.zeros(2), prior_scale).to_event(1))
    with pyro.plate("data", N, subsample=subsample) as i:
        pyro.sample("obs", dist.Normal((x[i] * w).sum(-1), noise), obs=y[i])


def _spawn(fn, args):
    """``fn(rank, 2, store, *args)`` on two gloo processes (one retry if a gloo worker
    aborts at exit, as in test_two_processes_match_one)."""
    for attempt in range(2):
        store = os.path.join(tempfile.mkdtemp(), "store")
        try:
            mp.spawn(fn, args=(2, store) + tuple(args), nprocs=2)
            return
        except mp.ProcessExitedException:
            if attempt:
                raise


def _init(rank, world, store):
    # a collective that waits longer than this fails instead of hanging the test
    from datetime import timedelta

    tdist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )


def _fit_svgd(layout, method, start=0, stop=SVGD_STEPS, save=None, load=None):
    """Steps ``start:stop`` of WeightSpaceSVGD (from the checkpoint ``load``, to the
    checkpoint ``save`` if given), the preconditioner refreshed from the particles before
    step ``REFRESH_AT``; all particles and the model parameters at the end."""
    from pyro_implicit.distributed import gather_named_particles
    from pyro_implicit.particles import WeightSpaceSVGD

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    svgd = WeightSpaceSVGD(
        svgd_model,
        pyro.optim.Adam({"lr": 0.05}),
        PARTICLES,
        max_plate_nesting=1,
        method=method,
        precondition=False,
        layout=layout,
    )
    if load is not None:
        load_checkpoint(load, svgd)
    shard = rank_shard if layout == "replicated" else (lambda batch: batch)
    batches = torch.Generator().manual_seed(1)
    for step in range(stop):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        if step >= start:
            if step == REFRESH_AT:
                svgd.refresh_preconditioner()
            svgd.step(x, y, shard(batch))
    if save is not None:
        save_checkpoint(save, svgd)
    out = gather_named_particles(svgd)
    out.update({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    return out


def _fit_fsvgd(layout, method, start=0, stop=SVGD_STEPS, save=None, load=None):
    """Steps ``start:stop`` of FunctionSpaceSVGD on a small BNN (a learnt noise scale, so
    model-parameter gradients too), random minibatches, extra points and prior draws (the
    checkpoints as in _fit_svgd); all particles and the noise scale at the end."""
    from pyro_implicit.bnn import BNNRegression
    from pyro_implicit.distributed import gather_named_particles
    from pyro_implicit.particles import FunctionSpaceSVGD, KDEInputs

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    bnn = BNNRegression(2, (4,), precision_prior=None, learn_noise=True)
    fsvgd = FunctionSpaceSVGD(
        bnn,
        pyro.optim.Adam({"lr": 0.02}),
        PARTICLES,
        1,
        method=method,
        num_prior_samples=10,
        nu=KDEInputs(6),
        layout=layout,
    )
    if load is not None:
        load_checkpoint(load, fsvgd)
    for _ in range(start, stop):
        fsvgd.step(x, y, subsample_size=GLOBAL_BATCH)
    if save is not None:
        save_checkpoint(save, fsvgd)
    out = gather_named_particles(fsvgd)
    out.update({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    return out


def function_model(x, y=None, subsample=None):
    """A small non-linear regression recording ``f``; a per-particle noise scale (a site
    that does not feed ``f``) and a model parameter in the likelihood."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    scale = pyro.sample("scale", dist.LogNormal(-1.0, 0.5))
    shift = pyro.param("shift", torch.tensor(0.1))
    with pyro.plate("data", len(x), subsample=subsample) as i:
        f = pyro.deterministic("f", torch.tanh((x[i] * w).sum(-1)) * 2.0, event_dim=0)
        pyro.sample("obs", dist.Normal(f + shift, scale), obs=None if y is None else y[i])


def _fit_fsvgd_shards(layout, method, save=None):
    """SVGD_STEPS steps of FunctionSpaceSVGD on function_model, the global minibatches
    passed as the data plate's subsample (each rank's share with layout="replicated"),
    extra points and prior draws from the random streams; all particles and the model
    parameter at the end."""
    from pyro_implicit.distributed import gather_named_particles
    from pyro_implicit.particles import FunctionSpaceSVGD, KDEInputs

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    x, y = _data()
    fsvgd = FunctionSpaceSVGD(
        function_model,
        pyro.optim.Adam({"lr": 0.05}),
        PARTICLES,
        1,
        method=method,
        num_prior_samples=10,
        nu=KDEInputs(6),
        layout=layout,
    )
    shard = rank_shard if layout == "replicated" else (lambda batch: batch)
    batches = torch.Generator().manual_seed(1)
    for _ in range(SVGD_STEPS):
        batch = torch.randperm(N, generator=batches)[:GLOBAL_BATCH]
        fsvgd.step(x, y, shard(batch))
    if save is not None:
        save_checkpoint(save, fsvgd)
    out = gather_named_particles(fsvgd)
    out.update({k: v.detach().clone() for k, v in pyro.get_param_store().items()})
    return out


#: (method, layout, rule) runs compared with one process: w-SGLD's row sums and GFSF's
#: solve need the whole kernel, gathered in the sharded layout (summed over the ranks'
#: rows in the function-space replicated layout)
SVGD_RUNS = [
    ("wsvgd", "replicated", "svgd"),
    ("wsvgd", "sharded", "svgd"),
    ("wsvgd", "sharded", "wsgld"),
    ("wsvgd", "sharded", "gfsf"),
    ("fsvgd", "sharded", "svgd"),
    ("fsvgd_shards", "replicated", "svgd"),
    ("fsvgd_shards", "replicated", "gfsf"),
]
FITS = {"wsvgd": _fit_svgd, "fsvgd": _fit_fsvgd, "fsvgd_shards": _fit_fsvgd_shards}


def test_svgd_layouts_on_two_processes_match_one(two_rank_svgd):
    """After SVGD_STEPS steps the particles (all of them) and the model's parameters of
    two ranks are those of one process on the same global minibatches (float64
    rounding): the averaged scores with the prior counted once, the gathered particles
    (or function values) and kernel blocks, the shared initial particles and random
    streams, and the combined parameter gradients."""
    fits, _, _ = two_rank_svgd
    assert list(fits) == SVGD_RUNS
    for (kind, layout, method), distributed in fits.items():
        single = FITS[kind](None, method)
        assert distributed.keys() == single.keys() and len(single) >= 3
        assert all(len(distributed[k]) == PARTICLES for k in ("w", "layer0") if k in single)
        assert len({tuple(v.shape) for v in distributed.values()}) > 1  # not all empty
        for name in single:
            assert torch.allclose(distributed[name], single[name], rtol=1e-9, atol=1e-10), (
                kind,
                layout,
                method,
                name,
            )


def local_latent_model(x, y, subsample):
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", N, subsample=subsample) as i:
        shift = pyro.sample("shift", dist.Normal(0.0, 1.0))
        pyro.sample("obs", dist.Normal((x[i] * w).sum(-1) + shift, 0.3), obs=y[i])


def failing_model(x, y=None, subsample=None):
    """Raises where ``_fail`` is set (on rank 1 only, after two good steps)."""
    if _fail:
        raise ValueError("rank 1's model fails")
    w = pyro.sample("w", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    with pyro.plate("data", len(x), subsample=subsample) as i:
        f = pyro.deterministic("f", (x[i] * w).sum(-1), event_dim=0)
        pyro.sample("obs", dist.Normal(f, 0.3), obs=None if y is None else y[i])


_fail = False


def _fail_on_rank_1(x, y, batch, good_steps, function_space=False):
    from pyro_implicit.particles import FunctionSpaceSVGD, WeightSpaceSVGD

    global _fail
    _fail = False
    if function_space:
        svgd = FunctionSpaceSVGD(
            failing_model,
            pyro.optim.Adam({"lr": 0.05}),
            4,
            1,
            num_prior_samples=4,
            nu=None,
            layout="sharded",
        )
    else:
        svgd = WeightSpaceSVGD(
            failing_model,
            pyro.optim.Adam({"lr": 0.05}),
            4,
            max_plate_nesting=1,
            precondition=False,
            compile=False,
            layout="sharded",
        )
    svgd.run(good_steps, x, y, batch)
    _fail = tdist.get_rank() == 1
    svgd.step(x, y, batch)


def rank_dependent_model(x, y, subsample):
    """A latent whose size depends on the rank (as a local latent of data sharded by
    hand would)."""
    w = pyro.sample("w", dist.Normal(torch.zeros(2 + tdist.get_rank()), 1.0).to_event(1))
    with pyro.plate("data", N, subsample=subsample) as i:
        pyro.sample("obs", dist.Normal((x[i] * w[..., :2]).sum(-1), 0.3), obs=y[i])


def _checkpoint(out, run):
    return f"{out}.checkpoint.{'.'.join(run)}"


#: the two-rank runs whose checkpoints one process resumes
RESUMED_RUNS = [
    ("wsvgd", "replicated", "svgd"),
    ("wsvgd", "sharded", "svgd"),
    ("fsvgd", "sharded", "svgd"),
]


def _svgd_rank(rank, world, store, out):
    """Every SVGD_RUNS fit (checkpointed at its end), the one-process checkpoint
    ``out.single`` resumed in the sharded layout, then every error case; rank r saves
    ``(fits, errors, resumed)`` to ``out.r`` (rank 0's fits only)."""
    from pyro_implicit.particles import WeightSpaceSVGD

    _init(rank, world, store)
    torch.set_default_dtype(torch.float64)
    caught = {}
    x, y = _data()
    batch = torch.arange(GLOBAL_BATCH)
    cases = {
        # 2 ranks cannot share 5 particles evenly
        "divide": lambda: WeightSpaceSVGD(
            svgd_model, pyro.optim.Adam({"lr": 0.05}), 5, max_plate_nesting=1, layout="sharded"
        ),
        # a local latent in the sharded data plate
        "local": lambda: WeightSpaceSVGD(
            local_latent_model,
            pyro.optim.Adam({"lr": 0.05}),
            4,
            max_plate_nesting=1,
            precondition=False,
            layout="replicated",
        ).step(x, y, rank_shard(batch)),
        # latent spaces that differ between the ranks
        "differ": lambda: WeightSpaceSVGD(
            rank_dependent_model,
            pyro.optim.Adam({"lr": 0.05}),
            4,
            max_plate_nesting=1,
            precondition=False,
            layout="replicated",
        ).step(x, y, rank_shard(batch)),
        # the model raises on rank 1 only: in the set-up, and on the third step
        "one rank, set-up": lambda: _fail_on_rank_1(x, y, batch, 0),
        "one rank": lambda: _fail_on_rank_1(x, y, batch, 2),
        "one rank, function space": lambda: _fail_on_rank_1(x, y, batch, 2, True),
    }
    try:
        fits = {
            run: FITS[run[0]](*run[1:], save=_checkpoint(out, run) if run in RESUMED_RUNS else None)
            for run in SVGD_RUNS
        }
        # one process's checkpoint after SVGD_STEPS steps, resumed with half of the
        # particles (and of their Adam moments) on each rank
        resumed = _fit_fsvgd("sharded", "svgd", SVGD_STEPS, 2 * SVGD_STEPS, load=f"{out}.single")
        for name, case in cases.items():
            pyro.clear_param_store()
            try:
                case()
                caught[name] = None
            except Exception as e:  # noqa: BLE001 - what each rank raised is the test
                caught[name] = (type(e).__name__, str(e), getattr(e, "__notes__", []))
        torch.save((fits if rank == 0 else None, caught, resumed), f"{out}.{rank}")
        tdist.barrier()
    finally:
        tdist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_svgd(tmp_path_factory):
    """One two-rank run (a spawn costs seconds) for the particle-layout tests: rank 0's
    fits, what each rank raised, and each rank's fit resumed from a one-process
    checkpoint; the two-rank checkpoints are files next to ``out``."""
    out = tmp_path_factory.mktemp("svgd") / "result"
    _fit_fsvgd(None, "svgd", save=f"{out}.single")
    _spawn(_svgd_rank, (str(out),))
    ranks = [torch.load(f"{out}.{rank}") for rank in range(2)]
    return ranks[0][0], [caught for _, caught, _ in ranks], (str(out), [r for *_, r in ranks])


def test_particle_checkpoints_resume_with_another_number_of_ranks(two_rank_svgd):
    """A checkpoint of two ranks after SVGD_STEPS steps (replicated, sharded; weight and
    function space), resumed in one process for SVGD_STEPS more, ends where one
    uninterrupted process ends; so does one process's checkpoint resumed on two ranks
    with the particles sharded. The checkpoint holds all N particles (gathered), their
    Adam moments (gathered, then re-sharded), the model's parameters and the random
    streams (the function-space runs draw minibatches, extra points and prior
    functions from them)."""
    _, _, (out, resumed_on_two) = two_rank_svgd
    straight = {kind: FITS[kind](None, "svgd", stop=2 * SVGD_STEPS) for kind in ("wsvgd", "fsvgd")}
    runs = {
        run: FITS[run[0]](None, run[2], SVGD_STEPS, 2 * SVGD_STEPS, load=_checkpoint(out, run))
        for run in RESUMED_RUNS
    }
    runs.update(
        {
            ("fsvgd", "one process to two ranks", rank): fit
            for rank, fit in enumerate(resumed_on_two)
        }
    )
    for run, resumed in runs.items():
        single = straight[run[0]]
        assert resumed.keys() == single.keys() and len(single) >= 3
        for name in single:
            assert torch.allclose(resumed[name], single[name], rtol=1e-9, atol=1e-10), (run, name)


def test_svgd_layout_errors_are_raised_on_every_rank(two_rank_svgd):
    """A world size that does not divide the particles (sharded), a local latent in the
    sharded data plate (replicated), latent spaces that differ between ranks and a model
    failing on one rank only: every rank raises, none waits in a collective (whose
    timeout would then fail the run)."""
    _, ranks, _ = two_rank_svgd
    for caught in ranks:
        kind, message, _ = caught["divide"]
        assert kind == "ValueError" and "multiple of the world size" in message
        kind, message, _ = caught["local"]
        assert kind == "UnsupportedModelError" and "'shift'" in message
        assert "subsampled plate 'data'" in message
        kind, message, _ = caught["differ"]
        assert kind == "ValueError" and "different latent spaces" in message
        for case in ("one rank, set-up", "one rank", "one rank, function space"):
            kind, message, _ = caught[case]
            assert kind == "ValueError" and "rank 1's model fails" in message, case
            # rank 0 raises rank 1's error, and says so
            assert "rank 1 of 2" in " ".join(ranks[0][case][2]), case
