"""Semi-implicit VAE (SIVAE, Yin & Zhou 2018 Sec. 5.5) against a Gaussian-encoder VAE on
MNIST-10k, both written in Pyro with per-image latents in a subsampled plate.

* Data: the 10,000 MNIST test images (the only ones available locally), split by
  ``load_mnist(num_train=9000, seed=0)`` (a fixed permutation, 9,000 train / 1,000 test).
  Training images are binarised afresh every epoch (pixel ~ Bernoulli(intensity),
  "dynamic binarisation" as the authors' code); test images once, with a fixed seed.
* Model: z ~ N(0, I_latent), x | z ~ Bernoulli(decoder(z)), decoder latent -> H -> H -> 784.
* SIVAE: ``SemiImplicitEncoder`` (eq. 12 with M = len(--noise-dims) stochastic layers,
  default one: psi = MLP([x, eps]), x -> H -> latent with eps ~ N(0, I_32) injected;
  diagonal-Gaussian conditional whose log-scale is a network x -> H -> latent) trained
  with ``SIVI_ELBO`` (J particles, K extra mixing draws per image, K ramped linearly).
  Gaussian VAE: the same two networks without the noise input (mean x -> H -> latent,
  log-scale x -> H -> latent), trained with ``Trace_ELBO`` with the same J. Both: Adam,
  the same batch size, epochs and learning-rate schedule.
* Test marginal log-likelihood: importance sampling with S samples per image,
  log p(x) ~= logsumexp_s [log p(x, z_s) - log q(z_s | x)] - log S. For the Gaussian
  encoder q is its exact density; for SIVAE log q is the mixture over the generating psi
  and K_eval extra psi (the IW-SIVI bound of Sec. 3.3 with K~ = S): both estimates are
  stochastic lower bounds of log p(x) in expectation.

Usage::

    nice -n 10 python benchmarks/sivae_mnist.py --seed 0
    python benchmarks/sivae_mnist.py --smoke
"""

import argparse
import math
import time

import _provenance  # noqa: F401  (pyro_implicit importable from a bare checkout)
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Trace_ELBO
from torch import nn

from pyro_implicit.datasets import load_mnist
from pyro_implicit.elbo.sivi import SIVI_ELBO, linear_schedule
from pyro_implicit.guides.amortized import SemiImplicitEncoder

PIXELS = 784


def mlp(sizes):
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class GaussianEncoder(nn.Module):
    """The standard VAE encoder with the SIVAE encoder's shape minus the noise: a mean
    network x -> H -> latent and a log-scale network x -> H -> latent."""

    def __init__(self, latent, hidden):
        super().__init__()
        self.loc = mlp([PIXELS, hidden, latent])
        self.log_scale = mlp([PIXELS, hidden, latent])

    def forward(self, x):
        return self.loc(x), self.log_scale(x)


def make_model(decoder, latent):
    def model(x, batch_size=None):
        pyro.module("decoder", decoder)
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            z = pyro.sample("z", dist.Normal(x.new_zeros(()), 1.0).expand([latent]).to_event(1))
            pyro.sample("x", dist.Bernoulli(logits=decoder(z)).to_event(1), obs=x[idx])

    return model


def make_sivae_guide(encoder):
    def guide(x, batch_size=None):
        pyro.module("encoder", encoder)
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            encoder.sample("z", x[idx])

    return guide


def make_gaussian_guide(encoder):
    def guide(x, batch_size=None):
        pyro.module("encoder", encoder)
        with pyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
            loc, log_scale = encoder(x[idx])
            pyro.sample("z", dist.Normal(loc, log_scale.exp()).to_event(1))

    return guide


def log_joint(decoder, z, x):
    logits = decoder(z)
    log_lik = dist.Bernoulli(logits=logits).log_prob(x).sum(-1)
    return log_lik + dist.Normal(0.0, 1.0).log_prob(z).sum(-1)


@torch.no_grad()
def test_log_likelihood(kind, encoder, decoder, x_test, num_samples, num_mixing, chunk=20):
    """Per-image importance-sampling estimates of log p(x), ``(n_test,)``."""
    out = []
    for start in range(0, x_test.shape[0], chunk):
        x = x_test[start : start + chunk]
        if kind == "gaussian":
            loc, log_scale = encoder(x)
            q = dist.Normal(loc, log_scale.exp()).to_event(1)
            z = q.sample((num_samples,))
            log_q = q.log_prob(z)
        else:
            psi = encoder.sample_mixing(num_samples, x)  # (S, B, D)
            z = psi + torch.randn_like(psi) * encoder.log_scale(x).exp()
            own = encoder.conditional_log_prob(z, psi, x).unsqueeze(1)  # (S, 1, B)
            extra = encoder.sample_mixing(num_mixing, x)  # (K, B, D), shared by the S
            log_qk = encoder.conditional_log_prob(z.unsqueeze(1), extra, x)  # (S, K, B)
            log_q = torch.logsumexp(torch.cat([own, log_qk], 1), 1) - math.log(num_mixing + 1)
        log_w = log_joint(decoder, z, x) - log_q
        out.append(torch.logsumexp(log_w, 0) - math.log(num_samples))
    return torch.cat(out)


def train(kind, args, x_train, x_test, binarise_gen):
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    decoder = mlp([args.latent, args.hidden, args.hidden, PIXELS])
    model = make_model(decoder, args.latent)
    steps_per_epoch = x_train.shape[0] // args.batch
    total = steps_per_epoch * args.epochs
    if kind == "sivae":
        encoder = SemiImplicitEncoder(
            PIXELS, args.latent, noise_dims=tuple(args.noise_dims), hidden_dims=(args.hidden,)
        )
        guide = make_sivae_guide(encoder)
        schedule = linear_schedule(1, args.num_mixing, max(total // 2, 1))
        loss = SIVI_ELBO(
            num_particles=args.particles,
            schedule=schedule,
            max_plate_nesting=1,
            check_vectorization=False,
        )
    else:
        encoder = GaussianEncoder(args.latent, args.hidden)
        guide = make_gaussian_guide(encoder)
        loss = Trace_ELBO(
            num_particles=args.particles, vectorize_particles=True, max_plate_nesting=1
        )
    optim = pyro.optim.ClippedAdam({"lr": args.lr, "lrd": args.lr_decay ** (1 / max(total, 1))})
    svi = SVI(model, guide, optim, loss)
    n_enc = sum(p.numel() for p in encoder.parameters())
    print(f"[{kind}] encoder parameters: {n_enc}, {total} steps", flush=True)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        x_bin = torch.bernoulli(x_train, generator=binarise_gen)
        running = 0.0
        for _ in range(steps_per_epoch):
            running += svi.step(x_bin, args.batch)
        k = loss.diagnostics.get("num_mixing", "-") if kind == "sivae" else "-"
        print(
            f"[{kind}] epoch {epoch + 1}/{args.epochs}  train -ELBO/image "
            f"{running / steps_per_epoch / x_train.shape[0]:.2f}  K={k}  "
            f"{time.perf_counter() - start:.0f}s",
            flush=True,
        )
    train_seconds = time.perf_counter() - start
    encoder.eval()
    start = time.perf_counter()
    ll = test_log_likelihood(kind, encoder, decoder, x_test, args.is_samples, args.eval_mixing)
    print(
        f"[{kind}] test log p(x) {ll.mean():.2f} ({time.perf_counter() - start:.0f}s)", flush=True
    )
    return ll, train_seconds, n_enc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="tiny run for tests")
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--latent", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--noise-dims", type=int, nargs="+", default=[32])
    parser.add_argument("--particles", type=int, default=2, help="J (both methods)")
    parser.add_argument("--num-mixing", type=int, default=50, help="final training K")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay", type=float, default=0.3, help="total decay factor")
    parser.add_argument("--is-samples", type=int, default=500, help="S per test image")
    parser.add_argument("--eval-mixing", type=int, default=100, help="K at evaluation")
    parser.add_argument("--methods", nargs="+", default=["gaussian", "sivae"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)  # networks and pixels alike
    split = load_mnist(num_train=9000, seed=0)
    x_train, x_test = split.x_train, split.x_test
    if args.smoke:
        x_train, x_test = x_train[:200], x_test[:20]
        args.epochs, args.batch, args.hidden, args.latent = 1, 50, 32, 4
        args.is_samples, args.eval_mixing, args.num_mixing = 10, 5, 3
    print(split.split_description if not args.smoke else "smoke subset", flush=True)
    x_test_bin = torch.bernoulli(x_test, generator=torch.Generator().manual_seed(1234))
    results = {}
    for kind in args.methods:
        gen = torch.Generator().manual_seed(args.seed)
        results[kind] = train(kind, args, x_train, x_test_bin, gen)
    print()
    print(
        f"MNIST-10k: {x_train.shape[0]} train / {x_test.shape[0]} test, latent {args.latent}, "
        f"hidden {args.hidden}, {args.epochs} epochs of batch {args.batch}, J = {args.particles}, "
        f"K 1 -> {args.num_mixing}; IS with S = {args.is_samples} (SIVAE: K_eval = "
        f"{args.eval_mixing} + own psi); seed {args.seed}"
    )
    print("| encoder | parameters | train time (s) | test log p(x) (mean +- s.e. over images) |")
    print("|---|---:|---:|---:|")
    for kind, (ll, seconds, n_enc) in results.items():
        se = ll.std() / math.sqrt(ll.numel())
        print(f"| {kind} | {n_enc} | {seconds:.0f} | {ll.mean():.2f} +- {se:.2f} |")
    if len(results) == 2:
        diff = results["sivae"][0] - results["gaussian"][0]
        print(
            f"paired difference SIVAE - Gaussian: {diff.mean():.2f} +- "
            f"{diff.std() / math.sqrt(diff.numel()):.2f} nats/image"
        )
    return results


if __name__ == "__main__":
    main()
