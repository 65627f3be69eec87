import pytest
import torch

from pyro_implicit.guides import BlockGenerator, MatrixGenerator, MLPGenerator


def test_affine_generator_pushes_standard_normal_to_gaussian():
    gen = MLPGenerator(3, 4, hidden_dims=())
    w, b = gen.output.weight.detach(), gen.output.bias.detach()
    samples = gen(torch.randn(200000, 3)).detach()
    assert torch.allclose(samples.mean(0), b, atol=0.02)
    assert torch.allclose(torch.cov(samples.T), w @ w.T, atol=0.03)


def test_init_output_sets_location_and_spread():
    gen = MLPGenerator(5, 7, hidden_dims=(16, 16))
    loc = torch.arange(7.0)
    gen.init_output(loc, 0.3)
    out = gen(torch.randn(20000, 5)).detach()
    assert torch.allclose(out.mean(0), loc, atol=0.02)
    assert out.std(0).mean().item() == pytest.approx(0.3, rel=0.05)


def test_matrix_generator_parameter_count_and_shapes():
    # KIVI Algorithm 2: an (M0 x N0) -> (M x N) layer has M M0 + M N0 + N0 N + M N params
    gen = MatrixGenerator((30, 30), (79, 40), hidden_shapes=[(50, 50)])
    expected = (50 * 30 + 50 * 30 + 30 * 50 + 50 * 50) + (79 * 50 + 79 * 50 + 50 * 40 + 79 * 40)
    assert sum(p.numel() for p in gen.parameters()) == expected
    assert gen(torch.randn(2, 3, 900)).shape == (2, 3, 79 * 40)
    gen.init_output(torch.zeros(79 * 40), 0.1)
    assert gen(torch.randn(256, 900)).std(0).mean().item() == pytest.approx(0.1, rel=0.1)


def test_block_generator_factorises():
    a, b = MLPGenerator(2, 3, ()), MLPGenerator(1, 2, ())
    gen = BlockGenerator([a, b], names=["x", "y"])
    noise = torch.randn(5, 3)
    out = gen(noise)
    assert torch.allclose(out[:, :3], a(noise[:, :2]))
    assert torch.allclose(out[:, 3:], b(noise[:, 2:]))
    with pytest.raises(ValueError, match="activation"):
        MLPGenerator(2, 2, (3,), activation="swish")


@pytest.mark.parametrize("skip", [False, True])
def test_scaled_layers_are_the_same_function_with_the_exact_jacobian(skip):
    torch.manual_seed(0)
    plain = MLPGenerator(5, 7, hidden_dims=(16, 16), activation="elu", skip=skip)
    torch.manual_seed(0)
    scaled = MLPGenerator(5, 7, hidden_dims=(16, 16), activation="elu", skip=skip, scaled=True)
    noise = torch.randn(9, 5)
    torch.testing.assert_close(scaled(noise), plain(noise))
    assert {n for n, _ in scaled.named_parameters()} == {
        "hidden.0.raw_weight", "hidden.0.bias", "hidden.2.raw_weight", "hidden.2.bias",
        "output.raw_weight", "output.bias",
    }  # fmt: skip
    scaled.init_output(torch.arange(7.0), 0.3)
    out = scaled(torch.randn(20000, 5)).detach()
    assert torch.allclose(out.mean(0), torch.arange(7.0), atol=0.05)
    if not skip:
        assert out.std(0).mean().item() == pytest.approx(0.3, rel=0.05)
    jac = torch.func.vmap(torch.func.jacrev(scaled))(noise)
    torch.testing.assert_close(scaled.jacobian(noise), jac)


def test_ntk_layers_are_the_same_function_with_the_exact_jacobian():
    torch.manual_seed(0)
    plain = MLPGenerator(5, 7, hidden_dims=(16, 16), activation="elu")
    torch.manual_seed(0)
    ntk = MLPGenerator(5, 7, hidden_dims=(16, 16), activation="elu", scaled="ntk")
    noise = torch.randn(9, 5)
    torch.testing.assert_close(ntk(noise), plain(noise))
    assert ntk.output.multiplier == pytest.approx(16**-0.5)
    assert ntk.hidden[2].multiplier == pytest.approx(16**-0.5)
    jac = torch.func.vmap(torch.func.jacrev(ntk))(noise)
    torch.testing.assert_close(ntk.jacobian(noise), jac)
    with pytest.raises(ValueError, match="scaled must be one of"):
        MLPGenerator(5, 7, (16,), scaled="mup")


def test_one_adam_step_moves_scaled_layers_far_less_than_standard_ones():
    # the first Adam step moves every stored value by lr in the sign of its gradient: a
    # standard layer's outputs then move by up to fan-in learning rates (here 7 output sds;
    # scaled layers 0.7); ntk layers in between (up to sqrt(fan-in) of them)
    moves = {}
    for scaled in (False, True, "ntk"):
        torch.manual_seed(0)
        gen = MLPGenerator(10, 10, hidden_dims=(256, 256), activation="elu", scaled=scaled)
        gen.init_output(torch.zeros(10), 1.0)
        noise = torch.randn(512, 10)
        before = gen(noise).mean(0).detach()
        optim = torch.optim.Adam(gen.parameters(), lr=1e-2)
        gen(noise).mean(0).sum().backward()  # every output pushed the same way
        optim.step()
        moves[scaled] = (gen(noise).mean(0).detach() - before).abs().max().item()
    assert moves[False] > 2.0 and moves[True] < moves[False] / 5
    assert moves[True] < moves["ntk"] < moves[False]


@pytest.mark.parametrize("scaled", [False, True, "ntk"])
def test_recycled_units_keep_the_function_and_can_learn_again(scaled):
    torch.manual_seed(0)
    gen = MLPGenerator(4, 3, hidden_dims=(16, 16), skip=True, scaled=scaled)
    with torch.no_grad():  # switch off six units of each layer for every draw
        for linear in list(gen.hidden)[::2]:
            linear.bias[:6] = -1e3
    noise = torch.randn(256, 4)
    before = gen(noise)
    assert gen.recycle_dead_units() == 12
    assert torch.allclose(gen(noise), before, atol=1e-6)  # the same function
    first, second = list(gen.hidden)[::2]
    alive = first(noise) > 0
    assert alive[:, :6].any(0).all()  # each recycled unit fires for some draws
    # zero out of a recycled unit (the second layer's recycled rows start fresh)
    assert (second.weight[6:, :6] == 0).all() and (gen.output.weight[:, :6] == 0).all()
    # its outgoing weights get a gradient again
    gen(noise).pow(2).sum().backward()
    out = gen.output
    stored = out.raw_weight if hasattr(out, "raw_weight") else out.weight
    assert stored.grad[:, :6].abs().sum() > 0


def test_only_relu_generators_recycle():
    assert MLPGenerator(4, 3, hidden_dims=(8,), activation="elu").recycle_dead_units() == 0
    assert MLPGenerator(4, 3, hidden_dims=()).recycle_dead_units() == 0
