"""Monte Carlo throughput of generator → ResNet-50 pipelines: cbcert.engine vs a PyTorch loop.

Two pipelines, each sample = one noisy latent ``z + σ ε`` through the generator, the classifier
preprocessing (bilinear resize, ImageNet normalisation) and a ResNet-50, argmax counted:

1. StyleGAN2 ("skip", NVlabs layout) + CB-AE: ``z → g1 (mapping, ψ = 0.7) → E → D → g2``;
2. BigGAN-deep for one class: ``z → [ψ z ; E y] → generator``.

Random weights on both sides: the PyTorch references of the parity tests
(``tests/test_convert_{stylegan2,cbae,biggan,resnet}.py``, written from the papers with upstream
state_dict names) are built with random weights and converted with cbcert's converters; logits
and images are checked against PyTorch before anything is timed (the script stops if they
differ). The engine runs ``cbcert.engine.sampler.count_classes`` on ``World.latent_apply`` as
``certify latent`` does (``--dtype bfloat16``: parameters cast as the runner casts them); the
PyTorch side is ``benchmarks/engine_throughput.py``'s loop in the style of Cohen et al.'s
``Smooth._sample_noise`` at each batch size of ``--batches``. Printed, from one run: samples/s,
the ratios engine / PyTorch at batch 8 and at PyTorch's best batch, model FLOPs per sample
(convolutions and matmuls, counted by PyTorch's FlopCounterMode; XLA's count of the JAX program
alongside), achieved FLOP/s and MFU against the measured matmul peak, versions and command.

    PYTHONPATH=. python benchmarks/generator_throughput.py           # reduced: < 5 min, 2 cores
    PYTHONPATH=. python benchmarks/generator_throughput.py --pipeline biggan
    PYTHONPATH=. python benchmarks/generator_throughput.py --scale full --threads 16 \\
        --dtype bfloat16                                              # on a GPU
    PYTHONPATH=. python benchmarks/generator_throughput.py --scale full --parity-only  # ~1 min

Scales: ``full`` is StyleGAN2-256 (NVlabs paper256: channel_base 16384, channel_max 512, 512-d
w, 14 ws, conv_clamp 256) with a 512-d CB-AE, BigGAN-deep-128 (ch 128, 1000 classes), images
resized to 224 for ResNet-50. ``reduced`` keeps every structure at a quarter of the resolution
(64 px StyleGAN2 with widths ≤ 128 and 128-d w, 32 px BigGAN-deep with ch 16, ResNet-50 at 56
px) so both pipelines run in minutes on two CPU cores. On a GPU the PyTorch model runs on
``cuda`` (its noise is still drawn on the host, as the loop draws it, then moved: latents are
small) and the peak is measured with 8192³ matmuls.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

SCALES = {
    "reduced": dict(
        stylegan2=dict(z_dim=128, w_dim=128, resolution=64, channel_base=2048, channel_max=128),
        cbae=dict(concepts=8, unsup=16),
        biggan=dict(output_dim=32, z_dim=128, channel_width=16, num_classes=1000,
                    layers=[[False, 16, 16], [True, 16, 8], [False, 8, 8], [True, 8, 4],
                            [False, 4, 4], [True, 4, 2], [False, 2, 2], [False, 2, 1]],
                    attention_layer_position=6),
        classifier_size=56, num=128, inputs=2, batches=(8, 32, 128), chunks=(32,)),
    "full": dict(
        stylegan2=dict(z_dim=512, w_dim=512, resolution=256, channel_base=16384, channel_max=512),
        cbae=dict(concepts=8, unsup=16),
        biggan=dict(output_dim=128, z_dim=128, channel_width=128, num_classes=1000,
                    layers=[[False, 16, 16], [True, 16, 16], [False, 16, 16], [True, 16, 8],
                            [False, 8, 8], [True, 8, 4], [False, 4, 4], [True, 4, 2],
                            [False, 2, 2], [True, 2, 1]],
                    attention_layer_position=8),
        classifier_size=224, num=1024, inputs=4, batches=(8, 32, 128, 512), chunks=(256,)),
}
TRUNCATION_PSI = 0.7  # StyleGAN2 mapping, all layers
BIGGAN_TRUNCATION = 0.5
BIGGAN_CLASS = 207
CONV_CLAMP = 256.0  # NVlabs' conv_clamp for the paper configs
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=tuple(SCALES), default="reduced")
    parser.add_argument("--pipeline", choices=("all", "stylegan2", "biggan"), default="all")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for both frameworks")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of the timed runs (parity is checked in float32)")
    parser.add_argument("--num", type=int, help="noisy samples per input (default: by scale)")
    parser.add_argument("--inputs", type=int, help="clean latents (default: by scale)")
    parser.add_argument("--batches", type=int, nargs="+",
                        help="PyTorch loop batch sizes, must include 8 (default: by scale)")
    parser.add_argument("--chunks", type=int, nargs="*",
                        help="fixed engine chunk sizes besides the automatic one (default: by "
                             "scale)")
    parser.add_argument("--parity-only", action="store_true",
                        help="build, check parity and count FLOPs, time nothing (e.g. --scale "
                             "full on a CPU before spending accelerator time)")
    args = parser.parse_args()
    defaults = SCALES[args.scale]
    for name in ("num", "inputs", "batches", "chunks"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if 8 not in args.batches or min(args.batches) < 1 or args.threads < 1 or args.num < 1 \
            or args.inputs < 1 or any(c < 1 for c in args.chunks):
        parser.error(f"--batches={args.batches} (must include 8), --threads={args.threads}, "
                     f"--num={args.num}, --inputs={args.inputs}, --chunks={args.chunks}: "
                     "all must be >= 1")
    return args


ARGS = parse_args()
# Thread pools are sized when the libraries start: pin them before jax and torch are imported.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from resnet50_throughput import pin_threads  # noqa: E402

pin_threads(ARGS.threads)

import engine_throughput as et  # noqa: E402  (imports jax and torch)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

F = nn.functional
# The PyTorch references of the parity tests, imported rather than copied: the test modules
# stay self-contained and define only classes and functions at import (pytest.importorskip
# passes because torch is importable; they set torch's thread count, reset below).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_convert_biggan as biggan_ref  # noqa: E402
import test_convert_cbae as cbae_ref  # noqa: E402
import test_convert_resnet as resnet_ref  # noqa: E402
import test_convert_stylegan2 as stylegan2_ref  # noqa: E402

from cbcert.convert.biggan import biggan_from_state_dict, config_from_dict  # noqa: E402
from cbcert.convert.cbae import cbae_from_state_dict  # noqa: E402
from cbcert.convert.stylegan2 import stylegan2_from_state_dict  # noqa: E402
from cbcert.convert.torchvision import resnet_from_state_dict  # noqa: E402
from cbcert.generators.biggan import biggan_generator  # noqa: E402
from cbcert.generators.cbae import CBAEConfig  # noqa: E402
from cbcert.generators.stylegan2 import config as sg_config  # noqa: E402
from cbcert.generators.stylegan2.generator import stylegan2_generator  # noqa: E402
from cbcert.io.registry import pure_apply  # noqa: E402
from cbcert.worlds.manifest import Preprocess  # noqa: E402
from cbcert.worlds.world import World  # noqa: E402

state_dict_numpy = resnet_ref.state_dict_numpy

torch.set_num_threads(ARGS.threads)
# XLA's CPU runtime flushes denormals to zero; torch must too (see resnet50_throughput.py).
torch.set_flush_denormal(True)
ON_GPU = jax.default_backend() != "cpu"
TORCH_DEVICE = "cuda" if ON_GPU and torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------- PyTorch pipelines


class TorchStyleGAN2Images(nn.Module):
    """``z[B, d] → [0, 1] images [B, 3, H, W]``: mapping (ψ), CB-AE ``dec(enc(ws))``, synthesis."""

    def __init__(self, generator: nn.Module, cbae: nn.Module, psi: float):
        super().__init__()
        self.generator, self.cbae, self.psi = generator, cbae, psi

    def forward(self, z):
        ws = self.cbae.dec(self.cbae.enc(self.generator.mapping(z, self.psi, None)))
        return ((self.generator.synthesis(ws) + 1) / 2).clamp(0, 1)


class TorchBigGANImages(nn.Module):
    """``z[B, d] → [0, 1] images [B, 3, H, W]`` of one class at truncation ψ."""

    def __init__(self, model: nn.Module, class_index: int, num_classes: int, truncation: float):
        super().__init__()
        self.model, self.truncation = model, truncation
        self.register_buffer("onehot", F.one_hot(torch.tensor([class_index]), num_classes).float())

    def forward(self, z):
        y = self.onehot.expand(z.shape[0], -1)
        return (self.model(self.truncation * z, y, self.truncation) + 1) / 2


class TorchPipeline(nn.Module):
    """Images → bilinear (antialiased) resize → ImageNet normalisation → classifier logits."""

    def __init__(self, images: nn.Module, classifier: nn.Module, size: int):
        super().__init__()
        self.images, self.classifier, self.size = images, classifier, (size, size)
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).reshape(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD).reshape(1, 3, 1, 1))

    def preprocess(self, x):
        if tuple(x.shape[-2:]) != self.size:  # in float32: torch's CPU kernel has no bf16
            x = F.interpolate(x.float(), self.size, mode="bilinear", align_corners=False,
                              antialias=True).to(x.dtype)
        return (x - self.mean) / self.std

    def forward(self, z):
        return self.classifier(self.preprocess(self.images(z)))


class OnDevice(nn.Module):
    """``model`` moved (in place) to ``device`` and ``dtype`` for the host-side loop.

    Takes and returns float32 tensors on the host: noise is drawn there, as the loop draws it.
    """

    def __init__(self, model: nn.Module, device: str, dtype: torch.dtype):
        super().__init__()
        self.model, self.device, self.dtype = model.to(device=device, dtype=dtype), device, dtype

    def forward(self, z):
        return self.model(z.to(self.device, self.dtype)).float().cpu()


# ------------------------------------------------------------- models with random weights


def build_resnet50(num_classes: int):
    """Random-weight ResNet-50 (torchvision layout) and its conversion."""
    reference = resnet_ref.torch_resnet("resnet50", num_classes=num_classes, seed=0)
    apply_fn, params = pure_apply(resnet_from_state_dict("resnet50",
                                                         state_dict_numpy(reference)))
    return reference, apply_fn, params


def build_stylegan2(spec: dict, cbae_spec: dict):
    """Random StyleGAN2 + CB-AE (PyTorch) and cbcert's ``Generator`` converted from them."""
    channels = sg_config.channels_from_base(spec["channel_base"], spec["channel_max"],
                                     spec["resolution"])
    torch.manual_seed(0)
    generator = stylegan2_ref.Generator(
        z_dim=spec["z_dim"], w_dim=spec["w_dim"], resolution=spec["resolution"],
        channels=channels, clamp=CONV_CLAMP, mapping_layers=8, seed=0).eval()
    with torch.no_grad():
        # Unit-scale random ToRGB layers saturate ~75 % of the pixels. The image is linear in
        # their weights and biases, so one scale brings its spread to a trained model's.
        ws = generator.mapping(torch.randn(8, spec["z_dim"]), TRUNCATION_PSI, None)
        gain = 0.5 / float(generator.synthesis(ws).std())
        for name, tensor in generator.named_parameters():
            if name.endswith(("torgb.weight", "torgb.bias")):
                tensor.mul_(gain)
    config = sg_config.StyleGAN2Config(
        z_dim=spec["z_dim"], w_dim=spec["w_dim"], img_resolution=spec["resolution"],
        img_channels=3, channels=channels, mapping_layers=8, conv_clamp=CONV_CLAMP)
    ported = stylegan2_from_state_dict(config, state_dict_numpy(generator))

    cb_config = CBAEConfig(latent_dim=spec["w_dim"], num_ws=config.num_ws,
                           concept_names=tuple(f"c{i}" for i in range(cbae_spec["concepts"])),
                           num_unsup=cbae_spec["unsup"])
    cbae = cbae_ref.TorchCBAE(spec["w_dim"], cb_config.concept_dim, config.num_ws)
    with torch.no_grad():  # eval-mode statistics as in the CB-AE parity test
        for module in cbae.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.3)
                module.running_mean.normal_(0, 0.5)
                module.running_var.uniform_(0.3, 2.0)
    cbae.eval()
    ported_cbae = cbae_from_state_dict(cb_config, state_dict_numpy(cbae))
    gen = stylegan2_generator(ported, ported_cbae, TRUNCATION_PSI, None)
    description = (f"StyleGAN2-{spec['resolution']} (channels {channels}, w {spec['w_dim']}, "
                   f"{config.num_ws} ws, conv_clamp {CONV_CLAMP:g}, ψ {TRUNCATION_PSI}) + CB-AE "
                   f"(K={cb_config.num_concepts}, U={cb_config.num_unsup})")
    return TorchStyleGAN2Images(generator, cbae, TRUNCATION_PSI), gen, description


def build_biggan(spec: dict):
    """Random BigGAN-deep (PyTorch, spectral norm) and cbcert's ``Generator`` converted from it.

    As in the BigGAN parity test: consistent random power-iteration vectors, random biases, and
    batch-norm statistic tables calibrated on one batch, which keeps activations O(1) through
    the depth as a trained model's are.
    """
    fields = dict(spec, class_embed_dim=spec["z_dim"], eps=1e-4, n_stats=51)
    torch.manual_seed(0)
    model = biggan_ref.TorchBigGAN(fields)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_u"):
                matrix = module.weight_orig.reshape(module.weight_orig.shape[0], -1)
                module.weight_v.copy_(F.normalize(torch.randn(matrix.shape[1]), dim=0))
                module.weight_u.copy_(F.normalize(matrix @ module.weight_v, dim=0))
            if isinstance(module, nn.Conv2d | nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.2)
        norms = [m for m in model.modules() if isinstance(m, biggan_ref.TorchCBN)]
        model.eval()
        for norm in norms:
            norm.calibrate = True
        classes = torch.arange(16) % spec["num_classes"]
        model(torch.randn(16, spec["z_dim"]), F.one_hot(classes, spec["num_classes"]).float(),
              1.0)
        for norm in norms:
            norm.calibrate = False
    ported = biggan_from_state_dict(config_from_dict(fields), state_dict_numpy(model))
    gen = biggan_generator(ported, BIGGAN_CLASS, BIGGAN_TRUNCATION)
    description = (f"BigGAN-deep-{spec['output_dim']} (ch {spec['channel_width']}, "
                   f"{len(spec['layers'])} blocks, {spec['num_classes']} classes, class "
                   f"{BIGGAN_CLASS}, truncation {BIGGAN_TRUNCATION})")
    return (TorchBigGANImages(model, BIGGAN_CLASS, spec["num_classes"], BIGGAN_TRUNCATION), gen,
            description)


def make_world(name: str, generator, resnet_apply, resnet_params, size: int) -> World:
    """A one-classifier ``World`` whose ``classify`` is built like ``worlds.load_world_dir``'s."""
    preprocess = Preprocess(size=(size, size), mean=IMAGENET_MEAN, std=IMAGENET_STD)
    apply_fns = {"std": resnet_apply}

    def classify(p, x, names):
        x = preprocess(x)
        return jnp.stack([apply_fns[m](p[m], x) for m in names], axis=1)

    def concept_scores(p, x):
        raise NotImplementedError("no concept classifier in this benchmark")

    return World(name=name, generator=generator, classify=classify,
                 concept_scores=concept_scores, classifier_params={"std": resnet_params},
                 model_names=("std",), class_names=tuple(str(c) for c in range(1000)))


# ------------------------------------------------------------------------ measurements


def check_parity(world: World, apply_fn, model: TorchPipeline, z: np.ndarray) -> None:
    """Images and logits of JAX vs PyTorch on the same latents; exits if they differ."""
    jax_images = np.array(jax.jit(world.latent_images)(world.params, z))  # writable copy
    jax_logits = np.asarray(jax.jit(apply_fn)(world.params, z))[:, 0]
    with torch.inference_mode():
        zt = torch.from_numpy(z)
        torch_images = model.images(zt).permute(0, 2, 3, 1).numpy()
        torch_logits = model(zt).numpy()
        # The classifier alone on JAX's images separates its error from the generator's.
        same = model.classifier(model.preprocess(
            torch.from_numpy(jax_images).permute(0, 3, 1, 2))).numpy()
    image_error = float(np.abs(jax_images - torch_images).max())
    logit_error = float(np.abs(jax_logits - torch_logits).max())
    scale = float(np.abs(torch_logits).max())
    agree = float((jax_logits.argmax(-1) == torch_logits.argmax(-1)).mean())
    clipped = float(np.mean((torch_images == 0) | (torch_images == 1)))
    print(f"  parity ({len(z)} noisy latents): max |Δ image| {image_error:.1e} ({clipped:.0%} of "
          f"pixels clipped), max |Δ logit| {logit_error:.1e} (classifier on the same images "
          f"{np.abs(jax_logits - same).max():.1e}; largest |logit| {scale:.1f}), argmax "
          f"agreement {agree:.0%}")
    tolerance = 1e-3  # float32; the realised errors are ~100x smaller
    if ON_GPU:  # TF32 convolutions (the default on both sides)
        tolerance = 3e-2
    if image_error > tolerance or logit_error > tolerance * (1 + scale):
        raise SystemExit(f"parity FAILED: |Δ image| {image_error:.2e}, |Δ logit| "
                         f"{logit_error:.2e} > tolerance {tolerance:g}; not timing a different "
                         "model")


def gpu_matmul_gflops(n: int = 8192) -> dict[str, float]:
    """Measured dense matmul throughput (GFLOP/s) on the accelerator, fp32 and bf16."""
    flops, out = 2.0 * n**3, {}
    for name, dtype in (("jax fp32", jnp.float32), ("jax bf16", jnp.bfloat16)):
        a = jnp.ones((n, n), dtype)
        f = jax.jit(lambda x: x @ x)
        out[name] = flops / et.best_time(lambda f=f, a=a: f(a).block_until_ready(), 4) / 1e9
    if TORCH_DEVICE == "cuda":
        for name, dtype in (("torch fp32", torch.float32), ("torch bf16", torch.bfloat16)):
            a = torch.ones((n, n), dtype=dtype, device="cuda")

            def run(a=a):
                a @ a
                torch.cuda.synchronize()

            out[name] = flops / et.best_time(run, 4) / 1e9
    return out


def measured_peak() -> float:
    """The matmul peak of ``ARGS.dtype`` (GFLOP/s), printing every measurement."""
    if ON_GPU:
        matmul, size = gpu_matmul_gflops(), 8192
    else:
        matmul, size = et.matmul_gflops(), 1024
    print(f"matmul {size}^3 GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in matmul.items()))
    kind = "fp32" if ARGS.dtype == "float32" else "bf16"
    peak = max(v for k, v in matmul.items() if k.split(" ")[1] == kind)
    print(f"MFU below is relative to the measured {kind} peak {peak:.0f} GFLOP/s")
    return peak


def run_pipeline(name: str, torch_images: nn.Module, gen, description: str, scale: dict,
                 peak: float) -> None:
    print(f"\n{name}: {description} → resize {scale['classifier_size']} → ResNet-50 "
          f"(1000 classes), random weights")
    reference, resnet_apply, resnet_params = build_resnet50(1000)  # the same weights each time
    model = TorchPipeline(torch_images, reference, scale["classifier_size"]).eval()
    world = make_world(name, gen, resnet_apply, resnet_params, scale["classifier_size"])
    apply_fn, params, classes = world.latent_apply(("std",)), world.params, world.num_classes

    rng = np.random.default_rng(1)
    latents = rng.standard_normal((ARGS.inputs, gen.latent_dim)).astype(np.float32)
    probe = latents[np.arange(4) % ARGS.inputs]
    probe = probe + et.SIGMA * rng.standard_normal(probe.shape).astype(np.float32)
    check_parity(world, apply_fn, model, probe)

    model_flops = et.torch_matmul_flops(model, torch.from_numpy(probe))
    xla_flops = et.flops_per_sample(apply_fn, params, latents.shape[1:])
    print(f"  forward pass: {model_flops / 1e9:.3f} GFLOP/sample in convolutions and matmuls "
          f"(PyTorch FlopCounterMode; MFU uses this), {xla_flops / 1e9:.3f} GFLOP/sample in the "
          f"JAX program (XLA cost analysis, all ops)")
    if ARGS.parity_only:
        return

    torch_dtype = torch.float32 if ARGS.dtype == "float32" else torch.bfloat16
    timed = model
    if TORCH_DEVICE != "cpu" or torch_dtype != torch.float32:
        timed = OnDevice(model, TORCH_DEVICE, torch_dtype)
    # PyTorch first, before XLA's thread pool is busy in this case.
    rates = et.torch_rates(timed, torch.from_numpy(latents), ARGS.num, ARGS.batches, classes)
    best_batch = max(rates, key=rates.get)

    kwargs = {}
    if ARGS.dtype == "bfloat16":  # as cbcert.runs.certify does for --dtype bfloat16
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16)
                              if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
        kwargs["dtype"] = jnp.bfloat16
    engine = {}
    for chunk in (None, *ARGS.chunks):
        chunks_seen = []
        rate = et.engine_rate(apply_fn, params, latents, ARGS.num, classes, chunk_size=chunk,
                              progress=lambda done, total, seen=chunks_seen: seen.append(done),
                              **kwargs)
        short = "fp32" if ARGS.dtype == "float32" else "bf16"
        label = f"auto chunk ({chunks_seen[0]})" if chunk is None else f"chunk {chunk}"
        engine[f"engine {short}, {label}"] = rate
    et.report(rates, best_batch, engine, model_flops, peak)


def main() -> None:
    started = time.perf_counter()
    print("command: " + " ".join([os.path.basename(sys.executable), *sys.argv]))
    import flax
    import jaxlib

    print(f"versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib "
          f"{jaxlib.__version__}, flax {flax.__version__}, torch {torch.__version__}, numpy "
          f"{np.__version__}; {platform.machine()}, {os.cpu_count()} logical CPUs, "
          f"{ARGS.threads} threads (XLA and torch); JAX devices {jax.devices()}, torch device "
          f"{TORCH_DEVICE}")
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"scale {ARGS.scale}, dtype {ARGS.dtype}, σ = {et.SIGMA} Gaussian noise on the latent, "
          f"{ARGS.inputs} inputs x {ARGS.num} samples per measurement | load average {load} "
          "(other jobs on the machine skew every number)")
    peak = 0.0 if ARGS.parity_only else measured_peak()
    scale = SCALES[ARGS.scale]
    if ARGS.pipeline in ("all", "stylegan2"):
        run_pipeline("StyleGAN2 + CB-AE", *build_stylegan2(scale["stylegan2"], scale["cbae"]),
                     scale, peak)
    if ARGS.pipeline in ("all", "biggan"):
        run_pipeline("BigGAN-deep", *build_biggan(scale["biggan"]), scale, peak)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    print(f"\ntotal {time.perf_counter() - started:.0f} s, load average at the end {load}")


if __name__ == "__main__":
    main()
