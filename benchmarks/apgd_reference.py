"""Compare cbcert's JAX APGD with torchattacks' PyTorch APGD on twin CNNs.

A small CNN is trained in PyTorch on a synthetic 4-class image task (the class is the
brightest quadrant of a noisy 12x12 image), then copied weight for weight into JAX.
Both attacks run with the same eps, norm, 100 iterations and restarts on the same
test images; the script prints clean and robust accuracies and wall times. The two
should agree within ~2 points (they differ only by their random starts; the spread of
the JAX attack over the keys of the timed rounds is printed for scale).

Timing (``benchmarks/timing.py``'s rule): after one call of each (the JAX one compiles; its
time is printed apart), every setting runs both attacks once per round, in alternating order,
for ``--rounds`` rounds (the JAX attack with a new key each round); the speed-up is the median
of the per-round ratios torchattacks seconds / JAX seconds, with its range. A second table
splits one iteration into the model's forward+backward pass (the same loss gradient repeated
``n_iter`` times in a compiled loop / a torch loop) and the rest (the attack's own work), so a
gap can be put on the model or on the attack.

Reference package: ``pip install --no-deps torchattacks==3.5.1`` (its declared
torchvision/requests pins are not needed by ``torchattacks.APGD``).

Run: ``PYTHONPATH=. python benchmarks/apgd_reference.py`` (~65 s on 2 CPUs).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torchattacks
from torch import nn

from cbcert.attacks.apgd import apgd
from cbcert.nn import layers

SIZE = 12
CLASSES = 4


def make_data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Noisy 12x12 images in [0, 1] whose label is the brightened quadrant: [n,1,12,12], [n]."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, CLASSES, n)
    images = 0.5 + 0.2 * rng.standard_normal((n, 1, SIZE, SIZE))
    half = SIZE // 2
    for quadrant in range(CLASSES):
        rows = slice(0, half) if quadrant < 2 else slice(half, SIZE)
        cols = slice(0, half) if quadrant % 2 == 0 else slice(half, SIZE)
        images[labels == quadrant, :, rows, cols] += 0.12
    return np.clip(images, 0.0, 1.0).astype(np.float32), labels.astype(np.int64)


def torch_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * (SIZE // 2) ** 2, CLASSES),
    )


def train(model: nn.Module, images: np.ndarray, labels: np.ndarray, steps: int) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        batch = torch.randint(0, len(x), (128,), generator=generator)
        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def jax_twin(model: nn.Module, conv_path: str = "engine"):
    """The same CNN as a pure JAX function of NCHW images, with the torch weights.

    ``conv_path="engine"``: convolutions by ``cbcert.nn.layers.conv``, as cbcert's own models
    run them (a patch matmul on CPU for small maps); ``"native"``: ``lax.conv_general_dilated``.
    """
    p = {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()}

    def conv(x, w, b, stride):
        if conv_path == "native":
            out = jax.lax.conv_general_dilated(x, w, (stride, stride), [(1, 1), (1, 1)],
                                               dimension_numbers=("NCHW", "OIHW", "NCHW"))
        else:  # NHWC and HWIO for the engine's layer; back to NCHW for torch's flatten order
            out = layers.conv(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), stride, 1)
            out = out.transpose(0, 3, 1, 2)
        return out + b[None, :, None, None]

    def logits_fn(x):  # [B, 1, 12, 12] -> [B, 4]
        h = jax.nn.relu(conv(x, p["0.weight"], p["0.bias"], 1))
        h = jax.nn.relu(conv(h, p["2.weight"], p["2.bias"], 2))
        return h.reshape(h.shape[0], -1) @ p["5.weight"].T + p["5.bias"]

    return logits_fn


def run_torch(model, images, labels, eps, norm, n_iter, n_restarts):
    attack = torchattacks.APGD(
        model,
        norm={"linf": "Linf", "l2": "L2"}[norm],
        eps=eps,
        steps=n_iter,
        n_restarts=n_restarts,
        seed=0,
        loss="ce",
    )
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    start = time.perf_counter()
    x_adv = attack(x, y)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        robust = (model(x_adv).argmax(1) == y).float().mean().item()
    return robust, seconds


def run_jax(logits_fn, images, labels, eps, norm, n_iter, n_restarts, seed):
    x, y = jnp.asarray(images), jnp.asarray(labels)
    kwargs = dict(norm=norm, n_iter=n_iter, n_restarts=n_restarts, lower=0.0, upper=1.0)
    start = time.perf_counter()
    x_adv, info = apgd(logits_fn, x, y, eps=eps, key=jax.random.key(seed), **kwargs)
    jax.block_until_ready(x_adv)
    seconds = time.perf_counter() - start
    return float(1.0 - info.fooled.mean()), seconds


def gradient_seconds(model, logits_fn, images, labels, n_iter) -> tuple[float, float]:
    """Seconds per loss gradient of the model alone: ``(jax, torch)``.

    ``n_iter`` gradients of the summed cross-entropy w.r.t. the ``[B, 1, 12, 12]`` inputs, each
    step moving the inputs by ``1e-6 * sign(grad)`` so that no step can be skipped or hoisted;
    JAX runs them in one compiled ``fori_loop`` (as the attack does), torch in a Python loop
    (as torchattacks does). Best of two timed runs after a warm-up, divided by ``n_iter``.
    """
    y = jnp.asarray(labels)

    def loss(x):
        logits = logits_fn(x)
        true = jnp.take_along_axis(logits, y[:, None], 1)[:, 0]
        return (jax.nn.logsumexp(logits, -1) - true).sum()

    @jax.jit
    def jax_loop(x):
        return jax.lax.fori_loop(0, n_iter, lambda i, x: x + 1e-6 * jnp.sign(jax.grad(loss)(x)), x)

    xt, yt = torch.from_numpy(images), torch.from_numpy(labels)

    def torch_loop():
        x = xt
        for _ in range(n_iter):
            x = x.clone().requires_grad_()
            loss = nn.functional.cross_entropy(model(x), yt, reduction="sum")
            grad, = torch.autograd.grad(loss, x)
            x = (x + 1e-6 * grad.sign()).detach()
        return x

    def best(fn):
        fn()
        times = []
        for _ in range(2):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        return min(times) / n_iter

    return best(lambda: jax_loop(jnp.asarray(images))), best(torch_loop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="attacked test inputs")
    parser.add_argument("--n-iter", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per setting (both attacks once per round)")
    parser.add_argument("--conv", choices=("engine", "native"), default="engine",
                        help="the JAX twin's convolutions: cbcert.nn.layers.conv (as cbcert's "
                             "models run them) or lax.conv_general_dilated")
    args = parser.parse_args()
    if min(args.n, args.n_iter, args.restarts, args.rounds) < 1:
        parser.error(f"--n={args.n}, --n-iter={args.n_iter}, --restarts={args.restarts}, "
                     f"--rounds={args.rounds}: each must be >= 1")
    torch.manual_seed(0)
    torch.set_num_threads(2)

    model = torch_cnn()
    train(model, *make_data(8192, seed=1), steps=400)
    model.eval()
    images, labels = make_data(args.n, seed=2)
    logits_fn = jax_twin(model, args.conv)
    with torch.no_grad():
        torch_logits = model(torch.from_numpy(images)).numpy()
    twin_gap = np.abs(np.asarray(logits_fn(jnp.asarray(images))) - torch_logits).max()
    clean = float((torch_logits.argmax(1) == labels).mean())
    print(f"inputs {args.n}, n_iter {args.n_iter}, restarts {args.restarts}, rounds "
          f"{args.rounds}, JAX convolutions {args.conv}; jax {jax.__version__}, torch "
          f"{torch.__version__}, torchattacks {torchattacks.__version__}")
    print(f"clean accuracy {clean:.3f}; max |logit torch - logit jax| {twin_gap:.2e}")
    attack = (args.n_iter, args.restarts)
    settings = [(norm, eps) for norm, epsilons in (("linf", (0.03, 0.06)), ("l2", (0.3, 0.6)))
                for eps in epsilons]
    rows = {}
    for norm, eps in settings:  # warm-up calls: torch's first run, JAX's compiling one (key 0)
        torch_acc, _ = run_torch(model, images, labels, eps, norm, *attack)
        jax_acc, first = run_jax(logits_fn, images, labels, eps, norm, *attack, 0)
        rows[norm, eps] = dict(torch_acc=torch_acc, jax_acc=[jax_acc], first=first,
                               torch_s=[], jax_s=[])
    for r in range(args.rounds):
        for i, (norm, eps) in enumerate(settings):
            row = rows[norm, eps]

            def time_torch(row=row, norm=norm, eps=eps):
                row["torch_s"].append(run_torch(model, images, labels, eps, norm, *attack)[1])

            def time_jax(row=row, norm=norm, eps=eps, seed=r + 1):
                acc, seconds = run_jax(logits_fn, images, labels, eps, norm, *attack, seed)
                row["jax_acc"].append(acc)
                row["jax_s"].append(seconds)

            for run in ((time_torch, time_jax) if (r + i) % 2 == 0 else (time_jax, time_torch)):
                run()
    print("norm  eps   robust accuracy: torch  jax key 0  keys 1.. (min-max)  jax - torch | "
          "seconds (median over rounds): torch  jax first call  jax  | speed-up torch/jax "
          "per round: median (range)")
    all_ratios = []
    for (norm, eps), row in rows.items():
        ratios = [t / j for t, j in zip(row["torch_s"], row["jax_s"], strict=True)]
        all_ratios += ratios
        later = row["jax_acc"][1:]
        steady = float(np.median(row["jax_s"]))
        print(f"{norm:4s}  {eps:.2f}                   {row['torch_acc']:.3f}  "
              f"{row['jax_acc'][0]:.3f}      {min(later):.3f}-{max(later):.3f}     "
              f"{100 * (row['jax_acc'][0] - row['torch_acc']):+5.1f} pts | "
              f"{np.median(row['torch_s']):6.2f}  {row['first']:6.2f} (compilation "
              f"~{row['first'] - steady:.1f})  {steady:6.2f} | x{np.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"steady-state speed-up (torchattacks seconds / jax seconds, same model, inputs, "
          f"iterations; {len(all_ratios)} paired runs): median x{np.median(all_ratios):.2f}, "
          f"range {min(all_ratios):.2f}-{max(all_ratios):.2f}; compilation is paid once per "
          f"(norm, model, batch shape)")
    jax_grad, torch_grad = gradient_seconds(model, logits_fn, images, labels, args.n_iter)
    for name, grad, key in (("jax", jax_grad, "jax_s"), ("torch", torch_grad, "torch_s")):
        per_iter = float(np.median([s for row in rows.values() for s in row[key]])) / (
            args.n_iter * args.restarts)
        print(f"per iteration, {name:5s}: {1e3 * per_iter:6.2f} ms = model forward+backward "
              f"{1e3 * grad:6.2f} ms + attack {1e3 * (per_iter - grad):+6.2f} ms")


if __name__ == "__main__":
    main()
