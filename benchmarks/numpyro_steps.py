"""NumPyro's jitted SVI step on the models of ``compiled_score.py``, the reference the
fast-steps goal is measured against (AutoNormal + ``Trace_ELBO``, vectorised particles).

NumPyro and JAX are never dependencies of the library: this script runs under an
interpreter that has them (``--numpyro-python`` of ``compiled_score.py`` starts it) and
needs nothing else from the checkout. The data come in an ``.npz`` file written by the
caller, so both libraries see the same numbers. JAX is held to one CPU thread, as torch is
in the caller, unless the caller sets ``JAX_PLATFORMS=cuda`` (``--device cuda`` there).

Usage (by hand)::

    /path/to/numpyro-env/bin/python benchmarks/numpyro_steps.py data.npz \\
        --particles 100 --steps 100 --repeats 2

prints one JSON object: ``{model: {"ms_per_step": ..., "compile_s": ...}}``.
"""

import os

# one thread, like torch in the caller; must be set before jax is imported
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402


def eight_schools(y, sigma):
    """The non-centred eight schools of ``pyro_implicit.models.eight_schools_model``."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("schools", y.shape[-1]):
        theta_tilde = numpyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        numpyro.sample("obs", dist.Normal(mu + tau * theta_tilde, sigma), obs=y)


def bnn(x, y, subsample_size):
    """``pyro_implicit.bnn.BNNRegression(13, hidden_dims=(50,))``: bias-augmented weight
    matrices with N(0, 1) priors, a Gamma(6, 6) noise precision, ReLU, minibatches."""
    w0 = numpyro.sample("layer0", dist.Normal(0.0, 1.0).expand((x.shape[1] + 1, 50)).to_event(2))
    w1 = numpyro.sample("layer1", dist.Normal(0.0, 1.0).expand((51, 1)).to_event(2))
    precision = numpyro.sample("precision", dist.Gamma(6.0, 6.0))
    with numpyro.plate("data", x.shape[0], subsample_size=subsample_size) as idx:
        xb, yb = x[idx], y[idx]
        h = jax.nn.relu(xb @ w0[:-1] + w0[-1])
        f = (h @ w1[:-1] + w1[-1])[..., 0]
        numpyro.sample("obs", dist.Normal(f, jax.lax.rsqrt(precision)), obs=yb)


def time_svi(model, model_args, particles, steps, repeats, seed):
    """``(ms per step, seconds of the first step)``: the first step traces and compiles."""
    guide = AutoNormal(model)
    loss = Trace_ELBO(num_particles=particles, vectorize_particles=True)
    svi = SVI(model, guide, numpyro.optim.Adam(1e-3), loss)
    state = svi.init(jax.random.PRNGKey(seed), *model_args)
    update = jax.jit(svi.update)
    start = time.perf_counter()
    state, value = update(state, *model_args)
    value.block_until_ready()
    compile_s = time.perf_counter() - start
    for _ in range(5):
        state, value = update(state, *model_args)
    value.block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state, value = update(state, *model_args)
        value.block_until_ready()
        best = min(best, 1000 * (time.perf_counter() - start) / steps)
    return best, compile_s


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help=".npz with y, sigma (eight schools) and optionally x, t (BNN)")
    p.add_argument("--particles", type=int, default=100)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    data = np.load(args.data)
    out = {"versions": {"jax": jax.__version__, "numpyro": numpyro.__version__}}
    models = {
        "eight_schools": (eight_schools, (jnp.asarray(data["y"]), jnp.asarray(data["sigma"])))
    }
    if "x" in data:
        models["boston_bnn"] = (
            lambda x, y: bnn(x, y, int(data["subsample_size"])),
            (jnp.asarray(data["x"]), jnp.asarray(data["t"])),
        )
    for name, (model, model_args) in models.items():
        for particles in sorted({1, args.particles}):
            ms, compile_s = time_svi(
                model, model_args, particles, args.steps, args.repeats, args.seed
            )
            out.setdefault(name, {})[str(particles)] = {"ms_per_step": ms, "compile_s": compile_s}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
