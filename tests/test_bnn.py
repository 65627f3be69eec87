"""Tests of pyro_implicit.bnn: vectorised evaluation must equal per-sample evaluation."""

import pyro
import pyro.poutine as poutine
import pytest
import torch
from pyro.infer import Predictive, Trace_ELBO
from pyro.infer.autoguide import AutoDelta, AutoNormal
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.poutine.util import prune_subsample_sites

from pyro_implicit.bnn import BNNClassification, BNNRegression, mlp_forward

torch.set_num_threads(1)

F64 = torch.float64
S = 4


@pytest.fixture(autouse=True)
def _fresh_param_store():
    # autoguide parameters live in Pyro's global store; tests must not see each other's
    pyro.clear_param_store()
    yield
    pyro.clear_param_store()


def _data(n=7, d=3, classes=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    if classes is None:
        y = torch.randn(n, generator=g, dtype=F64)
    else:
        y = torch.randint(classes, (n,), generator=g)
    return x, y


def _draws(model, seed=1):
    """S independent draws of the model's global latents, stacked along a leading dim."""
    g = torch.Generator().manual_seed(seed)
    draws = {
        name: torch.randn((S,) + shape, generator=g, dtype=F64)
        for name, shape in zip(model.layer_names, model.layer_shapes, strict=True)
    }
    if getattr(model, "precision_prior", None) is not None:
        draws["precision"] = torch.rand(S, generator=g, dtype=F64) + 0.5
    return draws


def _per_particle_log_joint(trace, num):
    trace = prune_subsample_sites(trace)
    trace.compute_log_prob()
    total = torch.zeros(num, dtype=F64)
    for site in trace.nodes.values():
        if site["type"] == "sample" and "log_prob" in site:
            total = total + site["log_prob"].reshape(num, -1).sum(-1)
    return total


MODELS = [
    pytest.param(lambda: BNNRegression(3, hidden_dims=(5, 4)), None, id="regression"),
    pytest.param(
        lambda: BNNRegression(
            3, hidden_dims=(6,), activation="tanh", precision_prior=None, noise_scale=0.3
        ),
        None,
        id="regression-fixed-noise",
    ),
    pytest.param(lambda: BNNClassification(3, 4, hidden_dims=(5,)), 4, id="classification"),
]


@pytest.mark.parametrize("make_model,classes", MODELS)
def test_vectorised_log_joint_matches_per_sample(make_model, classes):
    model = make_model()
    x, y = _data(classes=classes)
    draws = _draws(model)
    out_site = "logits" if classes else "f"

    # vectorised: particle plate at dim -2, global latents stacked as (S, 1) + event shape
    stacked = {k: v.unsqueeze(1) if k != "precision" else v.unsqueeze(-1) for k, v in draws.items()}
    with pyro.plate("particles", S, dim=-2):
        trace = poutine.trace(poutine.condition(model, stacked)).get_trace(x, y)
    assert trace.nodes["obs"]["fn"].batch_shape == (S, x.shape[0])
    vec = _per_particle_log_joint(trace, S)
    vec_out = trace.nodes[out_site]["value"]
    assert vec_out.shape[:2] == (S, x.shape[0])

    for s in range(S):
        single = {k: v[s] for k, v in draws.items()}
        tr = poutine.trace(poutine.condition(model, single)).get_trace(x, y)
        tr.compute_log_prob()
        assert torch.allclose(vec[s], tr.log_prob_sum(), rtol=0, atol=1e-10)
        assert torch.allclose(vec_out[s], tr.nodes[out_site]["value"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("make_model,classes", MODELS)
def test_vectorised_elbo_equals_single_particle_for_point_guide(make_model, classes):
    # AutoDelta is deterministic, so every particle gives the same ELBO: the vectorised
    # estimate must equal the single-particle one (an (S, S, n) broadcast would not)
    pyro.set_rng_seed(0)
    model = make_model()
    x, y = _data(classes=classes)
    guide = AutoDelta(model, init_loc_fn=init_to_sample)
    single = Trace_ELBO(max_plate_nesting=1).loss(model, guide, x, y)
    vec = Trace_ELBO(num_particles=S, vectorize_particles=True, max_plate_nesting=1).loss(
        model, guide, x, y
    )
    assert vec == pytest.approx(single, rel=1e-12)


def test_predictive_parallel_matches_forward():
    pyro.set_rng_seed(0)
    model = BNNRegression(3, hidden_dims=(5,))
    x, y = _data()
    guide = AutoNormal(model)
    guide(x, y)  # initialise the guide's parameters
    sites = model.layer_names + ["precision", "f", "obs"]
    pred = Predictive(model, guide=guide, num_samples=6, parallel=True, return_sites=sites)(x)
    assert pred["f"].shape == (6, 7)
    assert pred["obs"].shape == (6, 7)
    assert pred["layer0"].shape == (6, 1, 4, 5)
    weights = {k: pred[k] for k in model.layer_names}
    expected = model.forward(weights, x).squeeze(1)  # (6, 1, 7) -> (6, 7)
    assert torch.allclose(pred["f"], expected, rtol=0, atol=1e-12)


def test_predictive_with_stacked_draws_parallel_equals_sequential():
    # the (S, in + 1, out) layout of stacked MCMC draws, without the data-plate slot
    model = BNNRegression(3, hidden_dims=(5,))
    x, _ = _data()
    draws = _draws(model)
    par = Predictive(model, posterior_samples=draws, parallel=True, return_sites=["f"])(x)
    seq = Predictive(model, posterior_samples=draws, parallel=False, return_sites=["f"])(x)
    assert par["f"].shape == seq["f"].shape == (S, 7)
    assert torch.allclose(par["f"], seq["f"], rtol=0, atol=1e-12)


def test_classification_predictive_shapes():
    pyro.set_rng_seed(0)
    model = BNNClassification(3, 4, hidden_dims=(5,))
    x, y = _data(classes=4)
    guide = AutoNormal(model)
    guide(x, y)
    pred = Predictive(model, guide=guide, num_samples=5, parallel=True)(x)
    assert pred["logits"].shape == (5, 7, 4)
    # recorded normalised (f-POVI App. A.3): raw logits' shift per input is unidentified
    assert torch.allclose(pred["logits"].exp().sum(-1), torch.ones(5, 7))
    assert pred["obs"].shape == (5, 7)
    assert int(pred["obs"].min()) >= 0 and int(pred["obs"].max()) < 4


def test_mlp_forward_bias_in_last_row():
    x = torch.tensor([[1.0, 2.0]], dtype=F64)
    w0 = torch.tensor([[1.0, -1.0], [0.5, 1.0], [0.25, -3.0]], dtype=F64)  # last row: bias
    w1 = torch.tensor([[2.0], [1.0], [-1.0]], dtype=F64)
    # hidden = relu([1 + 1 + 0.25, -1 + 2 - 3]) = [2.25, 0]; out = 2 * 2.25 + 0 - 1 = 3.5
    out = mlp_forward([w0, w1], x)
    assert out.shape == (1, 1)
    assert out.item() == pytest.approx(3.5)
    # a batch of weights broadcasts: batch + (n, out)
    out = mlp_forward([w0.expand(2, 3, 3, 2), w1.expand(2, 3, 3, 1)], x.expand(5, 2))
    assert out.shape == (2, 3, 5, 1)


def test_subsample_scales_likelihood():
    model = BNNRegression(3, hidden_dims=(5,))
    x, y = _data(n=10)
    trace = poutine.trace(model).get_trace(x, y, subsample_size=4)
    trace.compute_log_prob()
    assert trace.nodes["obs"]["log_prob"].shape == (4,)
    assert trace.nodes["obs"]["scale"] == pytest.approx(10 / 4)
    assert trace.nodes["f"]["value"].shape == (4,)


def test_fixed_noise_has_no_precision_site():
    model = BNNRegression(3, hidden_dims=(5,), precision_prior=None, noise_scale=0.2)
    x, y = _data()
    trace = poutine.trace(model).get_trace(x, y)
    assert "precision" not in trace.nodes
    assert torch.all(trace.nodes["obs"]["fn"].scale == 0.2)
    assert trace.nodes["layer0"]["value"].dtype == F64


def test_bad_input_messages():
    model = BNNRegression(3)
    x, y = _data()
    with pytest.raises(ValueError, match=r"x must be a tensor of shape \(n, 3\)"):
        model(x[:, :2], y)
    with pytest.raises(ValueError, match="y must be a tensor of shape"):
        model(x, y[:3])
    with pytest.raises(ValueError, match="Unknown activation"):
        BNNRegression(3, activation="swishy")
    with pytest.raises(KeyError, match="layer1"):
        model.forward({"layer0": torch.zeros(4, 50, dtype=F64)}, x)
    with pytest.raises(ValueError, match="num_classes"):
        BNNClassification(3, 1)
    with pytest.raises(ValueError, match="does not fit inputs"):
        mlp_forward([torch.zeros(3, 2)], torch.zeros(1, 3))
    assert model.num_weights == 4 * 50 + 51 * 1


def test_fan_out_prior_and_noise_std_prior():
    """f-POVI's options: per-layer N(0, 1/n_out) weights and InverseGamma on the noise std;
    the defaults (KIVI's model) are unchanged."""
    default = BNNRegression(3, hidden_dims=(5,))
    assert default.prior_scale == 1.0 and default.layer_prior_scales == [1.0, 1.0]
    model = BNNRegression(
        3, hidden_dims=(5,), prior_scale="fan_out", precision_prior=None, noise_std_prior=(1.0, 0.1)
    )
    assert model.layer_prior_scales == pytest.approx([5**-0.5, 1.0])
    x, y = torch.randn(4, 3), torch.randn(4)
    trace = poutine.trace(model).get_trace(x, y)
    assert "precision" not in trace.nodes
    assert trace.nodes["layer0"]["fn"].base_dist.scale == pytest.approx(5**-0.5)
    noise = trace.nodes["noise_std"]
    assert isinstance(noise["fn"], pyro.distributions.InverseGamma)
    assert torch.all(trace.nodes["obs"]["fn"].scale == noise["value"])
    with pytest.raises(ValueError, match="not both"):
        BNNRegression(3, noise_std_prior=(1.0, 0.1))
    with pytest.raises(ValueError, match="entries"):
        BNNRegression(3, hidden_dims=(5,), prior_scale=(1.0,))


def test_learned_noise_is_the_maximum_likelihood_scale():
    """learn_noise=True: the noise scale is a positive Pyro parameter; with the weights fixed
    at zero (f = 0) maximising the likelihood must give sqrt(mean(y^2))."""
    pyro.clear_param_store()
    model = BNNRegression(
        2, hidden_dims=(3,), precision_prior=None, noise_scale=1.0, learn_noise=True
    )
    x = torch.randn(50, 2, dtype=F64)
    y = 0.3 * torch.randn(50, dtype=F64)
    zeros = {"layer0": torch.zeros(3, 3, dtype=F64), "layer1": torch.zeros(4, 1, dtype=F64)}
    fixed = poutine.condition(model, data=zeros)
    svi = pyro.infer.SVI(
        fixed, lambda x, y: None, pyro.optim.Adam({"lr": 0.05}), pyro.infer.Trace_ELBO()
    )
    for _ in range(400):
        svi.step(x, y)
    expected = y.pow(2).mean().sqrt()
    assert pyro.param("noise_scale").item() == pytest.approx(expected.item(), rel=1e-3)
    trace = poutine.trace(model).get_trace(x, y)
    assert "noise_scale" in trace.nodes and "precision" not in trace.nodes
    with pytest.raises(ValueError, match="learn_noise"):
        BNNRegression(2, learn_noise=True)  # the default Gamma precision prior
    pyro.clear_param_store()
