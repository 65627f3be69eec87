"""Every method with nothing but its constructors' defaults and ``Adam({"lr": 1e-2})``
recovers exact posteriors (the preconditioning issue's bar: mean error < 0.2 posterior
sd, sd ratios in [0.85, 1.15], correlation error < 0.1).

The grid and its scoring are ``benchmarks/exact_defaults.py``, whose recorded run
(``benchmarks/results/exact_defaults.md``) these tests repeat: 2000 steps, the issue's
budget. (At 1000 steps KIVI's mean on Beta-Bernoulli was 0.22 sd off: with a constant
learning rate its final iterate wanders by about that much.)
"""

import pyro
import pytest
import torch
from pyro import poutine

from pyro_implicit.targets.conjugate import EXACT_PROBLEMS, exact_problem, score_draws

STEPS = 2000
METHODS = ("kivi", "sivi", "livi", "gpvi", "asvgd", "wsvgd")


@pytest.fixture(autouse=True)
def _setup():
    torch.set_num_threads(1)
    dtype = torch.get_default_dtype()
    pyro.enable_validation(True)
    yield
    torch.set_default_dtype(dtype)


@pytest.mark.parametrize(
    "method, problem",
    [pytest.param(m, p, id=f"{m}-{p}") for m in METHODS for p in EXACT_PROBLEMS],
)
def test_defaults_recover_the_exact_posterior(method, problem, load_benchmark):
    # the recorded run's code path, seed and dtype (float32, a user's default)
    bench = load_benchmark("exact_defaults")
    (row,) = bench.run(
        [method], [problem], STEPS, True, "defaults", 0, torch.float32, log=lambda *args: None
    )
    assert row["passes"], row


def test_the_bar_catches_an_unpreconditioned_fit(load_benchmark):
    # the same check fails for the papers' raw-space KIVI on raw predictors
    bench = load_benchmark("exact_defaults")
    torch.set_default_dtype(torch.float32)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    p = exact_problem("raw_blr")
    draws = bench.fit_default("kivi", p, 200, precondition=False)
    assert not bench.passes(score_draws(draws, p.posterior))


@pytest.mark.parametrize("seed", [1])
def test_kivi_default_recovers_the_raw_regression_at_other_seeds(seed, load_benchmark):
    # the paper's estimate (stein_identity=None) missed here by its mean at seeds 1 and 2,
    # 0.57 and 0.30 sd: its noisy score mean random-walked q under Adam (seeds 0-4 in
    # kivi_stein_identity.md; one seed here, for the suite's time)
    bench = load_benchmark("exact_defaults")
    (row,) = bench.run(
        ["kivi"], ["raw_blr"], STEPS, True, "defaults", seed, torch.float32, log=lambda *a: None
    )
    assert row["passes"], row


@pytest.mark.parametrize("guide_name", ["ImplicitGuide", "LinearizedGuide"])
def test_a_guide_of_150_latents_starts_at_its_preconditioners_gaussian(guide_name):
    """With a dense Gaussian posterior (``wide_blr``, D = 150) the preconditioner is the
    posterior itself, and the guide's first draws must be too: noise of fewer than D
    coordinates would put them on a surface of lower rank (correlation errors of 0.3
    with 73, the noise both guides had above 64 latents)."""
    import pyro_implicit

    problem = exact_problem("wide_blr")
    guide = getattr(pyro_implicit, guide_name)(problem.model)
    guide(*problem.args)
    score = score_draws(guide.sample_posterior(4000)[problem.site], problem.posterior)
    assert score["correlation_error"] < 0.1 and 0.9 < score["sd_ratio_min"], score


@pytest.mark.parametrize("guide_name", ["ImplicitGuide", "LinearizedGuide"])
def test_beyond_256_latents_only_a_networks_weights_get_less_noise_than_d(guide_name):
    """Beyond 256 latents the default noise is D (here a 300-coefficient regression whose
    exact Gaussian posterior is given, and the guide starts at it), whatever the
    preconditioner: with less, the draws lie on a surface of that rank (the network's 76
    left the default ``kivi`` fit 0.68 off in correlation after 2000 steps,
    ``benchmarks/results/audit_probes_s61.md``). Only a network's weights, sites marked
    ``NETWORK_WEIGHTS``, get a network's noise."""
    import pyro_implicit
    from pyro_implicit.guides.base import network_noise_dim
    from pyro_implicit.latent import NETWORK_WEIGHTS, Preconditioner
    from pyro_implicit.targets.conjugate import ExactProblem, _blr

    model, args, site, posterior = _blr(torch.Generator().manual_seed(0), (1.0,) * 300, num=600)
    problem = ExactProblem("blr300", model, args, site, posterior)
    cls = getattr(pyro_implicit, guide_name)

    def built_around(pre, model=problem.model):
        pyro.clear_param_store()
        guide = cls(model, precondition=pre)
        guide(*problem.args)
        return guide

    guide = built_around(Preconditioner(posterior.loc, scale_tril=posterior.scale_tril))
    assert guide.noise_dim == 300
    score = score_draws(guide.sample_posterior(4000)[problem.site], problem.posterior)
    assert score["correlation_error"] < 0.1 and 0.9 < score["sd_ratio_min"], score
    diagonal = Preconditioner(posterior.loc, scale=posterior.variance.sqrt())
    assert built_around(diagonal).noise_dim == 300
    fitted = Preconditioner(posterior.loc, scale_tril=posterior.scale_tril, source="gaussian_vi")
    assert built_around(fitted).noise_dim == 300
    network = poutine.infer_config(
        problem.model, lambda msg: {NETWORK_WEIGHTS: True} if msg["name"] == site else {}
    )
    assert built_around(fitted, network).noise_dim == network_noise_dim(300)
