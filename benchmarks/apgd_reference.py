"""Compare cbcert's JAX APGD with torchattacks' PyTorch APGD on twin CNNs.

A small CNN is trained in PyTorch on a synthetic 4-class image task (the class is the
brightest quadrant of a noisy 12x12 image), then copied weight for weight into JAX.
Both attacks run with the same eps, norm, 100 iterations and restarts on the same
test images; the script prints clean and robust accuracies, the wall times of both (torch:
best of two runs; jax: the first call, which compiles, apart from the steady state, the best
of two later calls with other keys) and the steady-state speed-up. The two
should agree within ~2 points (they differ only by their random starts; the spread of
the JAX attack over three keys is printed for scale).

Reference package: ``pip install --no-deps torchattacks==3.5.1`` (its declared
torchvision/requests pins are not needed by ``torchattacks.APGD``).

Run: ``PYTHONPATH=. python benchmarks/apgd_reference.py`` (about a minute on 2 CPUs).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="attacked test inputs")
    parser.add_argument("--n-iter", type=int, default=100)
    parser.add_argument("--restarts", type=int, default=1)
    parser.add_argument("--conv", choices=("engine", "native"), default="engine",
                        help="the JAX twin's convolutions: cbcert.nn.layers.conv (as cbcert's "
                             "models run them) or lax.conv_general_dilated")
    args = parser.parse_args()
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
    print(f"inputs {args.n}, n_iter {args.n_iter}, restarts {args.restarts}, JAX convolutions "
          f"{args.conv}; jax {jax.__version__}, torch {torch.__version__}, torchattacks "
          f"{torchattacks.__version__}")
    print(f"clean accuracy {clean:.3f}; max |logit torch - logit jax| {twin_gap:.2e}")
    print("norm  eps   robust accuracy: torch  jax key 0  keys 1, 2  jax - torch | seconds: "
          "torch (best of 2)  jax first call  jax steady (best of keys 1, 2)  speed-up")
    ratios = []
    for norm, epsilons in (("linf", (0.03, 0.06)), ("l2", (0.3, 0.6))):
        for eps in epsilons:
            refs = [run_torch(model, images, labels, eps, norm, args.n_iter, args.restarts)
                    for _ in range(2)]
            ref, ref_s = refs[0][0], min(r[1] for r in refs)
            ours = [
                run_jax(logits_fn, images, labels, eps, norm, args.n_iter, args.restarts, s)
                for s in range(3)
            ]
            steady = min(ours[1][1], ours[2][1])
            ratios.append(ref_s / steady)
            print(
                f"{norm:4s}  {eps:.2f}                   {ref:.3f}  {ours[0][0]:.3f}      "
                f"{ours[1][0]:.3f} {ours[2][0]:.3f}  {100 * (ours[0][0] - ref):+5.1f} pts | "
                f"{ref_s:6.2f}  {ours[0][1]:6.2f} (compilation ~{ours[0][1] - steady:.1f})  "
                f"{steady:6.2f}  x{ref_s / steady:.2f}"
            )
    print(f"steady-state speed-up (torchattacks seconds / jax seconds, same model, inputs, "
          f"iterations): median x{np.median(ratios):.2f}, range {min(ratios):.2f}-"
          f"{max(ratios):.2f}; compilation is paid once per (norm, model, batch shape)")

if __name__ == "__main__":
    main()
