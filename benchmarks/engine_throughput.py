"""Monte Carlo throughput of cbcert.engine against a PyTorch loop in the style of Cohen et al.

The PyTorch baseline follows the structure of ``Smooth._sample_noise`` described in Cohen,
Rosenfeld & Kolter (ICML 2019): for each input, repeat it ``batch`` times, add Gaussian noise,
take the argmax of the logits and accumulate a bincount, until ``num`` samples are drawn.
The engine runs ``cbcert.engine.sampler.count_classes`` on the same architecture with the same
weights. Printed: samples/s, ratios, achieved FLOP/s against a measured float32 matmul peak
(MFU), and the bfloat16 paths.

    PYTHONPATH=. python benchmarks/engine_throughput.py            # full run, < 5 min on 2 cores
    PYTHONPATH=. python benchmarks/engine_throughput.py --quick    # smoke run
    PYTHONPATH=. python benchmarks/engine_throughput.py --case world
    PYTHONPATH=. python benchmarks/engine_throughput.py --cpu-devices 2   # one XLA device per core
    PYTHONPATH=. python benchmarks/engine_throughput.py --case multihost  # 1 vs 2 processes

Cases: (a) a ResNet-18-sized classifier (torchvision layout, 1000 classes) on 64×64 images with
random weights (copied from torch to JAX); (b) the built-in default world pipeline
``f_m(g2(D(E(g1(z)))))`` for m in std/cbm/proto on the same noisy latent, against its PyTorch
twin ``benchmarks/world_torch.py`` loaded with the same weights (copied from JAX to torch; the
shipped trained weights when present, else ``untrained_world()``); (c) a small MLP on latents,
where per-batch overhead dominates; (d) ``multihost``: the default-world pipeline counted by
one process with one CPU device, then by a ``jax.distributed`` job of two processes with one
device each (gloo collectives on loopback), printing both rates and their ratio.
"""
import argparse
import copy
import json
import os
import platform
import socket
import subprocess
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (smoke test)")
    parser.add_argument("--case", choices=("all", "resnet18", "world", "mlp", "multihost"),
                        default="all",
                        help="run one case only (default: all)")
    parser.add_argument("--cpu-devices", type=int, default=1,
                        help="XLA CPU devices (--xla_force_host_platform_device_count); the "
                             "engine splits every chunk over them with shard_map")
    args = parser.parse_args()
    if args.cpu_devices < 1:
        parser.error(f"--cpu-devices={args.cpu_devices}; allowed: >= 1")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
# Pin every thread pool to the cores this process may use, before the libraries start.
THREADS = len(os.sched_getaffinity(0))
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, str(THREADS))
if ARGS is not None and ARGS.cpu_devices > 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={ARGS.cpu_devices}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from cbcert.engine import keys, memory, noise, sampler  # noqa: E402
from cbcert.nn.layers import conv_patches  # noqa: E402

# A timed run here stands for a slice of a long certification (n = 10^5 per input), which takes
# the compute-bound chunk on CPU; the short timed run alone would keep the probe's
# (cbcert.engine.memory.repays_second_compilation). generator_throughput.py imports this too.
memory.COMPUTE_BOUND_MIN_RUN_FLOPS = 0.0

torch.set_num_threads(THREADS)
torch.set_num_interop_threads(1)

SIGMA = 0.25


# ----------------------------------------------------------------------------- timing helpers


def best_time(fn, repeats: int = 2) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs after one warm-up run (compilation)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(n: int = 1024) -> dict[str, float]:
    """Measured dense matmul throughput (GFLOP/s) of XLA:CPU and PyTorch, fp32 and bf16."""
    flops = 2.0 * n**3
    out = {}
    for name, dtype in (("torch fp32", torch.float32), ("torch bf16", torch.bfloat16)):
        a = torch.ones((n, n), dtype=dtype)
        out[name] = flops / best_time(lambda a=a: a @ a, 4) / 1e9
    for name, dtype, acc in (
        ("jax fp32", jnp.float32, None),
        ("jax bf16", jnp.bfloat16, None),
        ("jax bf16 in, fp32 acc", jnp.bfloat16, jnp.float32),
    ):
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda x, acc=acc: jnp.dot(x, x, preferred_element_type=acc))
        out[name] = flops / best_time(lambda f=f, a=a: f(a).block_until_ready(), 4) / 1e9
    return out


def cohen_loop(model, x: torch.Tensor, num: int, batch: int, num_classes: int) -> np.ndarray:
    """Counts ``[H, num_classes]`` of argmax labels of ``model`` on ``num`` noisy copies of ``x``.

    ``model(x[b, *event])`` returns logits ``[b, C]`` (one head) or ``[b, H, C]``.
    """
    counts = None
    remaining = num
    with torch.inference_mode():
        while remaining > 0:
            size = min(batch, remaining)
            remaining -= size
            copies = x.unsqueeze(0).repeat(size, *([1] * x.dim()))
            predictions = model(copies + SIGMA * torch.randn_like(copies)).argmax(-1)
            predictions = predictions.reshape(size, -1)  # [b, H]
            heads = predictions.shape[1]
            flat = (torch.arange(heads) * num_classes + predictions).ravel()
            found = torch.bincount(flat, minlength=heads * num_classes).numpy()
            counts = found if counts is None else counts + found
    return counts.reshape(-1, num_classes)


def torch_rates(model, inputs: torch.Tensor, num: int, batches, num_classes: int) -> dict:
    """samples/s of ``cohen_loop`` over all ``inputs`` for each batch size."""
    rates = {}
    for batch in batches:
        seconds = best_time(
            lambda b=batch: [cohen_loop(model, x, num, b, num_classes) for x in inputs], 1
        )
        rates[batch] = len(inputs) * num / seconds
    return rates


def engine_rate(apply_fn, params, inputs, num: int, num_classes: int, repeats: int = 1,
                **kwargs) -> float:
    """samples/s of ``count_classes`` (compilation excluded), best of ``repeats`` runs."""
    key = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)

    def run():
        return sampler.count_classes(apply_fn, params, inputs, noise.Gaussian(), key, num,
                                     scale=SIGMA,
                                     num_classes=num_classes, **kwargs)

    return len(inputs) * num / best_time(run, repeats)


def flops_per_sample(apply_fn, params, event_shape, batch: int = 8) -> float:
    """FLOPs of one forward pass, from XLA's cost analysis of ``apply_fn`` at ``batch``."""
    x = jax.ShapeDtypeStruct((batch, *event_shape), jnp.float32)
    cost = jax.jit(apply_fn).lower(params, x).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"]) / batch


# ------------------------------------------------------------- (a) ResNet-18 in both frameworks


class TorchBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class TorchResNet18(nn.Module):
    """ResNet-18 (He et al. 2016) in the torchvision layout, NCHW."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        widths, cin, stages = (64, 128, 256, 512), 64, []
        for s, width in enumerate(widths):
            stride = 1 if s == 0 else 2
            blocks = (TorchBlock(cin, width, stride), TorchBlock(width, width, 1))
            stages.append(nn.Sequential(*blocks))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = nn.functional.max_pool2d(x, 3, 2, 1)
        return self.fc(self.stages(x).mean(dim=(2, 3)))


def random_torch_resnet18() -> TorchResNet18:
    torch.manual_seed(0)
    model = TorchResNet18()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):  # non-trivial eval-mode statistics
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
    return model.eval()


def jax_params_from_torch(model: nn.Module) -> dict:
    """State dict → flat dict of jnp arrays; conv kernels OIHW → HWIO for NHWC convolutions."""
    params = {}
    for name, tensor in model.state_dict().items():
        value = tensor.detach().numpy()
        if value.ndim == 4:
            value = value.transpose(2, 3, 1, 0)
        params[name] = jnp.asarray(value)
    return params


def conv_im2col(x: jax.Array, w: jax.Array, stride: int, pad: int, acc_dtype) -> jax.Array:
    """NHWC convolution as one patch matmul (``cbcert.nn.layers.conv_patches``, what the
    models use), accumulating in ``acc_dtype``."""
    return conv_patches(x, w, stride, pad, preferred_element_type=acc_dtype)


def conv_native(x: jax.Array, w: jax.Array, stride: int, pad: int, acc_dtype) -> jax.Array:
    """NHWC convolution with ``lax.conv_general_dilated`` (XLA's own convolution)."""
    return jax.lax.conv_general_dilated(
        x, w, (stride, stride), [(pad, pad), (pad, pad)],
        dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=acc_dtype)


def jax_resnet18(params: dict, x: jax.Array, compute_dtype=jnp.float32,
                 conv=conv_im2col) -> jax.Array:
    """ResNet-18 on NHWC images ``x[B, H, W, 3]`` → logits ``[B, 1, 1000]`` (one head).

    ``compute_dtype`` is the dtype of convolution inputs and kernels; accumulation and the
    rest of the network stay in the input's dtype (float32: mixed precision).
    """
    act_dtype = x.dtype

    def conv_layer(name, h, stride, pad):
        w = params[name].astype(compute_dtype)
        return conv(h.astype(compute_dtype), w, stride, pad, act_dtype)

    def bn(name, h):
        scale = params[f"{name}.weight"] * jax.lax.rsqrt(params[f"{name}.running_var"] + 1e-5)
        shift = params[f"{name}.bias"] - params[f"{name}.running_mean"] * scale
        return h * scale.astype(act_dtype) + shift.astype(act_dtype)

    h = jax.nn.relu(bn("bn1", conv_layer("conv1.weight", x, 2, 3)))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                              [(0, 0), (1, 1), (1, 1), (0, 0)])
    for s in range(4):
        for b in range(2):
            p = f"stages.{s}.{b}"
            stride = 2 if (s > 0 and b == 0) else 1
            y = jax.nn.relu(bn(f"{p}.bn1", conv_layer(f"{p}.conv1.weight", h, stride, 1)))
            y = bn(f"{p}.bn2", conv_layer(f"{p}.conv2.weight", y, 1, 1))
            if f"{p}.down.0.weight" in params:
                h = bn(f"{p}.down.1", conv_layer(f"{p}.down.0.weight", h, stride, 0))
            h = jax.nn.relu(y + h)
    pooled = h.mean(axis=(1, 2)).astype(jnp.float32)  # [B, 512]
    return (pooled @ params["fc.weight"].T + params["fc.bias"])[:, None, :]


def case_resnet18(quick: bool, peak: float) -> None:
    print("\n(a) ResNet-18-sized classifier, 64x64x3 inputs, 1000 classes, random weights")
    model = random_torch_resnet18()
    images = np.random.default_rng(0).uniform(0, 1, (2, 64, 64, 3)).astype(np.float32)
    num = 32 if quick else 128
    torch_in = torch.from_numpy(images.transpose(0, 3, 1, 2))
    # PyTorch first, before XLA's thread pool is busy in this case.
    rates = torch_rates(model, torch_in, num, (8, 32) if quick else (8, 32, 128), 1000)
    best_batch = max(rates, key=rates.get)
    params = jax_params_from_torch(model)
    with torch.inference_mode():
        reference = model(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    for conv in (conv_im2col, conv_native):
        ours = np.asarray(jax.jit(jax_resnet18, static_argnums=(2, 3))(
            params, jnp.asarray(images), jnp.float32, conv))[:, 0]
        print(f"  parity ({conv.__name__}): max |logit_jax - logit_torch| = "
              f"{np.abs(ours - reference).max():.2e}")

    flops = flops_per_sample(jax_resnet18, params, images.shape[1:])
    print(f"  forward pass: {flops / 1e9:.3f} GFLOP/sample (XLA cost analysis)")
    engine = {
        "engine fp32, auto chunk": engine_rate(jax_resnet18, params, images, num, 1000),
        "engine fp32, chunk 32": engine_rate(jax_resnet18, params, images, num, 1000,
                                             chunk_size=32),
        "engine fp32, XLA native conv": engine_rate(
            lambda p, x: jax_resnet18(p, x, conv=conv_native), params, images, num, 1000),
        "engine bf16 convs, fp32 acc": engine_rate(
            lambda p, x: jax_resnet18(p, x, jnp.bfloat16), params, images, num, 1000),
        "engine bf16 everywhere": engine_rate(
            lambda p, x: jax_resnet18(p, x, jnp.bfloat16).astype(jnp.float32), params, images,
            num, 1000, dtype=jnp.bfloat16),
    }
    report(rates, best_batch, engine, flops, peak)


# ------------------------------------------------------------------ (c) small MLP on latents


def case_mlp(quick: bool, peak: float) -> None:
    print("\n(c) MLP on 64-d latents (64-256-256-10), per-batch overhead dominates")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10)).eval()
    params = {k: jnp.asarray(v.numpy()) for k, v in model.state_dict().items()}

    def mlp(p, z):
        h = jax.nn.relu(z @ p["0.weight"].T + p["0.bias"])
        h = jax.nn.relu(h @ p["2.weight"].T + p["2.bias"])
        return (h @ p["4.weight"].T + p["4.bias"])[:, None, :]

    latents = np.random.default_rng(1).normal(size=(4, 64)).astype(np.float32)
    num = 2000 if quick else 10_000
    rates = torch_rates(model, torch.from_numpy(latents), num, (8, 100, 1000), 10)
    best_batch = max(rates, key=rates.get)
    flops = flops_per_sample(mlp, params, (64,))
    engine = {"engine fp32, auto chunk": engine_rate(mlp, params, latents, num, 10)}
    report(rates, best_batch, engine, flops, peak)


# ------------------------------------------------------------- (b) the default world pipeline

WORLD_MODELS = ("std", "cbm", "proto")


def load_default_world():
    """The default world with the shipped trained weights if present, else untrained ones."""
    from cbcert.io import checkpoint
    from cbcert.worlds import builtin

    if (builtin.weights_path("default") / checkpoint.MANIFEST).is_file():
        return builtin.load_builtin("default"), "trained (shipped checkpoint)"
    return builtin.untrained_world("default"), "untrained_world() (no shipped checkpoint yet)"


def torch_world(world, clf_params) -> nn.Module:
    """The PyTorch twin of ``world.latent_apply(WORLD_MODELS)`` with ``clf_params``."""
    from world_torch import WorldTorch

    from cbcert.generators.concept_world import ConceptWorldConfig

    to_numpy = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
    return WorldTorch(ConceptWorldConfig.from_preset("default"), to_numpy(world.generator.params),
                      to_numpy(clf_params), WORLD_MODELS).eval()


def world_parity(world, apply_fn, params, model, z: np.ndarray, label: str) -> None:
    """Prints max |Δ image|, max |Δ logits| and argmax agreement per head, torch vs JAX."""
    jax_images = np.array(jax.jit(world.latent_images)(params, z))  # [B, H, W, 3]
    jax_logits = np.asarray(jax.jit(apply_fn)(params, z))  # [B, heads, C]
    with torch.inference_mode():
        torch_images = model.generator(torch.from_numpy(z)).permute(0, 2, 3, 1).numpy()
        torch_logits = model(torch.from_numpy(z)).numpy()
        # The classifiers alone, on JAX's images: separates their error from the renderer's.
        same_images = model.classifiers(torch.from_numpy(jax_images).permute(0, 3, 1, 2)).numpy()
    agree = (jax_logits.argmax(-1) == torch_logits.argmax(-1)).mean(0)
    print(f"  parity ({label}, {len(z)} noisy latents): max |Δ image| "
          f"{np.abs(jax_images - torch_images).max():.1e}, max |Δ logits| "
          f"{np.abs(jax_logits - torch_logits).max():.1e} (classifiers on the same images "
          f"{np.abs(jax_logits - same_images).max():.1e}; largest |logit| "
          f"{np.abs(jax_logits).max():.1f}), argmax agreement "
          + ", ".join(f"{m} {a:.2%}" for m, a in zip(WORLD_MODELS, agree, strict=True)))


def with_alphas(clf_params, value: float):
    """Copy of the classifier params with every SkipInit ``alpha`` set to ``value``."""
    backbone = {name: ({**block, "alpha": jnp.asarray(value, jnp.float32)}
                       if "alpha" in block else block)
                for name, block in clf_params["backbone"].items()}
    return {**clf_params, "backbone": backbone}


def torch_matmul_flops(model: nn.Module, z: torch.Tensor) -> float:
    """Conv + matmul FLOPs per sample of ``model(z)``, counted by PyTorch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.inference_mode(), counter:
        model(z)
    return counter.get_total_flops() / len(z)


def case_world(quick: bool, peak: float) -> None:
    print(f"\n(b) default-world pipeline: generator g(z) = g2(D(E(g1(z)))) + "
          f"{'/'.join(WORLD_MODELS)} heads on the same noisy latent")
    world, source = load_default_world()
    apply_fn = world.latent_apply(WORLD_MODELS)
    params = world.params
    classes = world.num_classes
    model = torch_world(world, world.classifier_params)
    print(f"  weights: {source}; {classes} classes, latent d={world.generator.latent_dim}, "
          f"images {world.generator.image_shape}")

    latents = np.array(jax.random.normal(jax.random.key(1), (2, world.generator.latent_dim)))
    probe = np.repeat(latents, 256, axis=0)
    probe = probe + SIGMA * np.random.default_rng(2).standard_normal(probe.shape, np.float32)
    world_parity(world, apply_fn, params, model, probe, "benchmarked weights")
    alphas = [block["alpha"] for block in world.classifier_params["backbone"].values()
              if "alpha" in block]
    if all(float(alpha) == 0.0 for alpha in alphas):
        # SkipInit alphas of 0 hide the residual convs from the logits; check them too.
        perturbed = with_alphas(world.classifier_params, 0.5)
        world_parity(world, apply_fn, {**params, "clf": perturbed},
                     torch_world(world, perturbed), probe, "SkipInit alpha = 0.5")

    flops = flops_per_sample(apply_fn, params, latents.shape[1:])
    matmul_flops = torch_matmul_flops(model, torch.from_numpy(probe[:8]))
    print(f"  forward pass: {flops / 1e6:.1f} MFLOP/sample (XLA cost analysis, all ops); "
          f"{matmul_flops / 1e6:.1f} MFLOP/sample in convs and matmuls (torch FlopCounterMode)")

    num = 128 if quick else 512
    # PyTorch first, before XLA's thread pool is busy in this case.
    rates = torch_rates(model, torch.from_numpy(latents), num,
                        (8, 128) if quick else (8, 32, 128, 512), classes)
    best_batch = max(rates, key=rates.get)
    torch_bf16 = TorchMixedBF16(model)
    rates_bf16 = torch_rates(torch_bf16, torch.from_numpy(latents), num, (best_batch,), classes)

    def mixed_bf16(p, z):  # generator in fp32, classifiers (weights and images) in bf16
        clf = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a,
                           p["clf"])
        images = world.latent_images(p, z).astype(jnp.bfloat16)
        return world.classify(clf, images, WORLD_MODELS).astype(jnp.float32)

    engine = {}
    for chunk in (None, 8, 64, 512):
        engine[f"engine fp32, chunk {chunk or 'auto'}"] = engine_rate(
            apply_fn, params, latents, num, classes, 3, chunk_size=chunk)
    # as cbcert.runs.certify runs --dtype bfloat16: parameters and samples cast
    bf16_params = sampler.cast_floating(params, jnp.bfloat16)
    engine["engine dtype=bf16 (as shipped)"] = engine_rate(
        apply_fn, bf16_params, latents, num, classes, 3, dtype=jnp.bfloat16)
    engine["engine bf16 classifiers"] = engine_rate(mixed_bf16, params, latents, num, classes, 3)
    report(rates, best_batch, engine, flops, peak)
    rate = rates_bf16[best_batch]
    print(f"  torch bf16 classifiers, batch {best_batch}: {rate:10.0f} samples/s   "
          f"x{rate / rates[best_batch]:.2f} vs torch fp32 at that batch")

    # Per-sample argmax agreement with fp32 on 10^4 noisy samples (10 latents x 1000), the
    # same noise for every dtype (drawn in float32, then cast): trained classifiers, so the
    # labels spread over the classes and disagreements show where bf16 moves a boundary.
    key = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)
    pool = np.array(jax.random.normal(jax.random.key(3), (10, world.generator.latent_dim)))

    def labels(fn, p, **kwargs):
        return sampler.map_samples(lambda q, clean, noisy: jnp.argmax(fn(q, noisy), axis=-1),
                                   p, pool, noise.Gaussian(), key, 1000, scale=SIGMA, **kwargs)

    reference = labels(apply_fn, params)  # [10, 1000, H]
    for name, fn, p, kwargs in (
            ("dtype=bf16 (as shipped: parameters and samples cast)", apply_fn, bf16_params,
             {"dtype": jnp.bfloat16}),
            ("bf16 classifiers", mixed_bf16, params, {})):
        same = (labels(fn, p, **kwargs) == reference).reshape(-1, len(WORLD_MODELS))
        print(f"  argmax agreement with fp32 on {len(same)} noisy samples, {name}: " + ", ".join(
            f"{m} {a:.2%}" for m, a in zip(WORLD_MODELS, same.mean(0), strict=True)))
    print("  fp32 labels per head take " + ", ".join(
        f"{m} {len(np.unique(reference[..., h]))}" for h, m in enumerate(WORLD_MODELS))
        + f" of {classes} classes")


class TorchMixedBF16(nn.Module):
    """The torch twin with the generator in fp32 and the classifiers in bf16."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.generator = model.generator
        self.classifiers = copy.deepcopy(model.classifiers).to(torch.bfloat16)

    def forward(self, z):
        return self.classifiers(self.generator(z).to(torch.bfloat16)).float()


# ------------------------------------------------ (d) one process vs a two-process JAX job

MULTIHOST_WORKER = """
import json, sys, time
rank, count, port, num = (int(a) for a in sys.argv[1:5])
from cbcert.engine import distributed
if count > 1:
    distributed.initialize(f"127.0.0.1:{port}", num_processes=count, process_id=rank,
                           cpu_collectives="gloo", timeout=60)
import jax, numpy as np
from cbcert.engine import keys, noise, sampler
from cbcert.worlds.builtin import load_builtin
world = load_builtin("default")
apply_fn = world.latent_apply(("std", "cbm", "proto"))
latents = np.asarray(jax.random.normal(jax.random.key(1), (4, world.generator.latent_dim)))
key = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)
run = lambda: sampler.count_classes(apply_fn, world.params, latents, noise.Gaussian(), 0.25, key,
                                    num, num_classes=world.num_classes, chunk_size=64)
counts = run()  # compiles
best = float("inf")
for _ in range(2):
    start = time.perf_counter()
    again = run()
    best = min(best, time.perf_counter() - start)
assert (again == counts).all()
print("RESULT " + json.dumps({"rate": len(latents) * num / best, "counts": counts.tolist()}))
if count > 1:
    distributed.finish()
"""


def multihost_rate(processes: int, num: int) -> tuple[float, list]:
    """samples/s of the default world counted by a job of ``processes`` × 1 CPU device."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
                   os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])))
    workers = [subprocess.Popen([sys.executable, "-c", MULTIHOST_WORKER, str(rank), str(processes),
                                 str(port), str(num)], env=env, stdout=subprocess.PIPE, text=True)
               for rank in range(processes)]
    outputs = [worker.communicate(timeout=900)[0] for worker in workers]
    results = [json.loads(line[len("RESULT "):]) for out in outputs for line in out.splitlines()
               if line.startswith("RESULT ")]
    if len(results) != processes:
        raise RuntimeError(f"a worker failed: {outputs}")
    return results[0]["rate"], [r["counts"] for r in results]


def case_multihost(quick: bool, peak: float) -> None:
    del peak
    print("\n(d) default-world pipeline (std/cbm/proto), one process with 1 CPU device vs a "
          "jax.distributed job of 2 processes x 1 CPU device (gloo on loopback), chunks of 64")
    num = 256 if quick else 1024
    one, counts_one = multihost_rate(1, num)
    two, counts_two = multihost_rate(2, num)
    same = all(c == counts_one[0] for c in counts_two)
    print(f"  1 process  x 1 device : {one:10.0f} samples/s")
    print(f"  2 processes x 1 device: {two:10.0f} samples/s   x{two / one:.2f} vs 1 process "
          f"(counts identical on every process and to 1 process: {same}; both share the "
          f"{THREADS} cores of this machine)")


# --------------------------------------------------------------------------------- reporting


def report(rates: dict, best_batch: int, engine: dict, flops: float, peak: float) -> None:
    for batch, rate in rates.items():
        print(f"  torch loop, batch {batch:<5}: {rate:10.0f} samples/s   "
              f"MFU {rate * flops / 1e9 / peak:.1%}")
    for name, rate in engine.items():
        print(f"  {name:<31}: {rate:10.0f} samples/s   x{rate / rates[8]:.2f} vs batch 8, "
              f"x{rate / rates[best_batch]:.2f} vs best torch (batch {best_batch}), "
              f"MFU {rate * flops / 1e9 / peak:.1%}")


def main() -> None:
    args = ARGS
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"python {platform.python_version()}, jax {jax.__version__}, numpy {np.__version__}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{THREADS} threads, devices {jax.devices()}")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print("XLA_FLAGS:", os.environ.get("XLA_FLAGS", "(none)"),
          f"| load average {load} (other jobs on the machine skew every number)")
    matmul = matmul_gflops()
    peak = max(matmul["jax fp32"], matmul["torch fp32"])
    print("matmul 1024^3 GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in matmul.items()))
    print(f"MFU below is relative to the measured fp32 peak {peak:.0f} GFLOP/s")
    started = time.perf_counter()
    cases = {"resnet18": case_resnet18, "world": case_world, "mlp": case_mlp,
             "multihost": case_multihost}
    for name, case in cases.items():
        if args.case in ("all", name):
            case(args.quick, peak)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end {load}")


if __name__ == "__main__":
    main()
