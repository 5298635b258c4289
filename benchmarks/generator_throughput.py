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
``certify latent`` does (``--dtype bfloat16``: parameters and samples cast as
``cbcert.runs.certify`` casts them, logits float32, counts integers). The PyTorch side is the
loop of Cohen et al.'s ``Smooth._sample_noise`` (repeat, ``randn_like`` on the model's device,
forward, argmax, counts to the host each batch) at each batch size of ``--batches``; at its best
fp32 batch it is also timed with ``channels_last`` weights and under bf16 autocast.

Printed, from one run: samples/s of every contender, the ratios engine / PyTorch at batch 8 and
at PyTorch's best batch, model FLOPs per sample (convolutions and matmuls, counted by PyTorch's
FlopCounterMode; XLA's count of the JAX program alongside), MFU against the measured matmul peak
of the contender's dtype, each engine run's first call (compilation) apart from its steady
rate, peak device memory (GPU: each framework's allocator; CPU: the process's peak RSS), the
argmax agreement of the engine's bf16 labels with its fp32 labels on the same noisy samples
(``--agreement`` samples, exact 95 % interval), versions and the command.

    PYTHONPATH=. python benchmarks/generator_throughput.py           # reduced: < 5 min, 2 cores
    PYTHONPATH=. python benchmarks/generator_throughput.py --pipeline biggan --chunks 8 32
    PYTHONPATH=. python benchmarks/generator_throughput.py --scale full --parity-only  # CPU check
    bash benchmarks/accelerator.sh       # full size, fp32 and bf16, on a GPU (or TPU) machine

Scales: ``full`` is StyleGAN2-256 with config-f widths (channel_base 32768, channel_max 512,
512-d w, 14 ws, conv_clamp 256) and a 512-d CB-AE, BigGAN-deep-256 (ch 128, 12 blocks, 1000
classes), images resized to 224 for ResNet-50. ``reduced`` keeps every structure at a quarter
of the resolution (64 px StyleGAN2 with widths ≤ 128 and 128-d w, 32 px BigGAN-deep with ch 16,
ResNet-50 at 56 px) so both pipelines run in minutes on two CPU cores; ``tiny`` (32 px, ResNet-50
at 32 px, a few samples) only proves the script runs end to end (its test). On a GPU the PyTorch
model and its noise live on ``cuda`` and the peaks are measured with 8192³ matmuls.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

SCALES = {
    "tiny": dict(
        stylegan2=dict(z_dim=32, w_dim=32, resolution=32, channel_base=256, channel_max=16),
        cbae=dict(concepts=4, unsup=4),
        biggan=dict(output_dim=32, z_dim=32, channel_width=4, num_classes=1000,
                    layers=[[False, 16, 16], [True, 16, 8], [True, 8, 4], [True, 4, 2],
                            [False, 2, 1]],
                    attention_layer_position=3),
        classifier_size=32, num=16, inputs=2, batches=(8, 16), chunks=(), agreement=64),
    "reduced": dict(
        stylegan2=dict(z_dim=128, w_dim=128, resolution=64, channel_base=2048, channel_max=128),
        cbae=dict(concepts=8, unsup=16),
        biggan=dict(output_dim=32, z_dim=128, channel_width=16, num_classes=1000,
                    layers=[[False, 16, 16], [True, 16, 8], [False, 8, 8], [True, 8, 4],
                            [False, 4, 4], [True, 4, 2], [False, 2, 2], [False, 2, 1]],
                    attention_layer_position=6),
        classifier_size=56, num=128, inputs=2, batches=(8, 32, 128), chunks=(32,),
        agreement=1024),
    "full": dict(  # StyleGAN2 config-f widths at 256 px; BigGAN-deep-256
        stylegan2=dict(z_dim=512, w_dim=512, resolution=256, channel_base=32768, channel_max=512),
        cbae=dict(concepts=8, unsup=16),
        biggan=dict(output_dim=256, z_dim=128, channel_width=128, num_classes=1000,
                    layers=[[False, 16, 16], [True, 16, 16], [False, 16, 16], [True, 16, 8],
                            [False, 8, 8], [True, 8, 8], [False, 8, 8], [True, 8, 4],
                            [False, 4, 4], [True, 4, 2], [False, 2, 2], [True, 2, 1]],
                    attention_layer_position=8),
        classifier_size=224, num=512, inputs=2, batches=(8, 32, 128, 512), chunks=(),
        agreement=10_000),
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
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32",
                        help="compute dtype of the engine's timed runs; 'both' also times the "
                             "PyTorch loop under bf16 autocast and reports the bf16 labels' "
                             "agreement with fp32 (parity is checked in float32)")
    parser.add_argument("--num", type=int, help="noisy samples per input (default: by scale)")
    parser.add_argument("--inputs", type=int, help="clean latents (default: by scale)")
    parser.add_argument("--batches", type=int, nargs="+",
                        help="PyTorch loop batch sizes, must include 8 (default: by scale)")
    parser.add_argument("--chunks", type=int, nargs="*",
                        help="fixed engine chunk sizes besides the automatic one (default: by "
                             "scale)")
    parser.add_argument("--agreement", type=int,
                        help="noisy samples on which bf16 labels are compared with fp32 labels "
                             "when bf16 is timed (default: by scale; 0 skips)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of interleaved timing (every contender once per round)")
    parser.add_argument("--torch-bf16", choices=("auto", "on", "off"), default="auto",
                        help="time PyTorch under bf16 autocast (auto: unless its bf16 matmul "
                             "is slower than fp32, i.e. the CPU has no bf16 units)")
    parser.add_argument("--parity-only", action="store_true",
                        help="build, check parity and count FLOPs, time nothing (e.g. --scale "
                             "full on a CPU before spending accelerator time)")
    args = parser.parse_args()
    defaults = SCALES[args.scale]
    for name in ("num", "inputs", "batches", "chunks", "agreement"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if 8 not in args.batches or min(args.batches) < 1 or args.threads < 1 or args.num < 1 \
            or args.inputs < 1 or any(c < 1 for c in args.chunks) or args.agreement < 0 \
            or args.rounds < 1:
        parser.error(f"--batches={args.batches} (must include 8), --threads={args.threads}, "
                     f"--num={args.num}, --inputs={args.inputs}, --chunks={args.chunks}: "
                     f"--rounds={args.rounds}: all must be >= 1; "
                     f"--agreement={args.agreement} must be >= 0")
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
import timing  # noqa: E402
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

from cbcert.certify.bounds import clopper_pearson_lower, clopper_pearson_upper  # noqa: E402
from cbcert.convert.biggan import biggan_from_state_dict, config_from_dict  # noqa: E402
from cbcert.convert.cbae import cbae_from_state_dict  # noqa: E402
from cbcert.convert.stylegan2 import stylegan2_from_state_dict  # noqa: E402
from cbcert.convert.torchvision import resnet_from_state_dict  # noqa: E402
from cbcert.engine import keys, noise, sampler  # noqa: E402
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


def cohen_counts(model: nn.Module, x: torch.Tensor, num: int, batch: int, num_classes: int,
                 autocast: bool = False) -> np.ndarray:
    """Class counts ``[C]`` of ``model``'s argmax on ``num`` noisy copies of the latent ``x``.

    Cohen et al.'s ``Smooth._sample_noise`` loop: ``x.repeat``, ``randn_like`` (on ``x``'s
    device), forward, argmax, counts to the host each batch; ``autocast`` runs the forward
    pass under ``torch.autocast(bfloat16)``.
    """
    counts = np.zeros(num_classes, np.int64)
    remaining = num
    with torch.inference_mode(), torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        while remaining > 0:
            size = min(batch, remaining)
            remaining -= size
            copies = x.unsqueeze(0).repeat(size, 1)
            labels = model(copies + et.SIGMA * torch.randn_like(copies)).argmax(-1)
            counts += torch.bincount(labels, minlength=num_classes).cpu().numpy()
    return counts


def torch_sweep(model: nn.Module, latents: torch.Tensor, num_classes: int
                ) -> tuple[dict[int, float], dict[int, float | None]]:
    """One `torch_work` pass at each ``--batches`` size (after one warm-up pass each):
    samples/s and peak device bytes (None off GPU), to find PyTorch's best batch."""
    rates, peaks = {}, {}
    for batch in ARGS.batches:
        if TORCH_DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        work = torch_work(model, latents, batch, num_classes)
        work()
        rates[batch] = timing.timed_rate(work, 0.0)
        peaks[batch] = torch.cuda.max_memory_allocated() if TORCH_DEVICE == "cuda" else None
    return rates, peaks


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
    # Full float32 on both sides (GPUs would otherwise run TF32 convolutions and matmuls).
    with jax.default_matmul_precision("highest"):
        jax_images = np.array(jax.jit(world.latent_images)(world.params, z))  # writable copy
        jax_logits = np.asarray(jax.jit(apply_fn)(world.params, z))[:, 0]
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    with torch.inference_mode():
        zt = torch.from_numpy(z)
        torch_images = model.images(zt).permute(0, 2, 3, 1).numpy()
        torch_logits = model(zt).numpy()
        # The classifier alone on JAX's images separates its error from the generator's.
        same = model.classifier(model.preprocess(
            torch.from_numpy(jax_images).permute(0, 3, 1, 2))).numpy()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
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
    if ON_GPU:  # other convolution algorithms than on a CPU (cuDNN's, XLA's)
        tolerance = 1e-2
    if image_error > tolerance or logit_error > tolerance * (1 + scale):
        raise SystemExit(f"parity FAILED: |Δ image| {image_error:.2e}, |Δ logit| "
                         f"{logit_error:.2e} > tolerance {tolerance:g}; not timing a different "
                         "model")


def gpu_matmul_gflops(n: int = 8192) -> dict[str, float]:
    """Measured dense matmul throughput (GFLOP/s) on the accelerator, fp32 and bf16.

    Each framework's default precision: JAX's fp32 dot runs in TF32 on NVIDIA GPUs, PyTorch's
    does not (``torch.backends.cuda.matmul.allow_tf32`` is off; its convolutions use TF32).
    """
    flops, out = 2.0 * n**3, {}
    for name, dtype in (("jax fp32", jnp.float32), ("jax bf16", jnp.bfloat16)):
        a = jax.random.normal(jax.random.key(0), (n, n), dtype)  # zeros/ones run faster
        f = jax.jit(lambda x: x @ x)
        out[name] = flops / et.best_time(lambda f=f, a=a: f(a).block_until_ready(), 4) / 1e9
    if TORCH_DEVICE == "cuda":
        for name, dtype in (("torch fp32", torch.float32), ("torch bf16", torch.bfloat16)):
            a = torch.randn((n, n), dtype=dtype, device="cuda")

            def run(a=a):
                a @ a
                torch.cuda.synchronize()

            out[name] = flops / et.best_time(run, 4) / 1e9
    return out


def measured_peaks() -> dict[str, float]:
    """The best measured matmul rate (GFLOP/s) per dtype, ``{"fp32": ., "bf16": .}``, and
    PyTorch's own (``"torch fp32"``, ``"torch bf16"``)."""
    if ON_GPU:
        matmul, size = gpu_matmul_gflops(), 8192
    else:
        size = 256 if ARGS.scale == "tiny" else 1024  # tiny: a smoke test, not a measurement
        matmul = et.matmul_gflops(size)
    print(f"matmul {size}^3 GFLOP/s: " + ", ".join(f"{k} {v:.0f}" for k, v in matmul.items()))
    peaks = {kind: max(v for k, v in matmul.items() if k.split(" ")[1] == kind)
             for kind in ("fp32", "bf16")}
    peaks.update((k, v) for k, v in matmul.items() if k in ("torch fp32", "torch bf16"))
    print(f"MFU below is relative to the measured peak of the contender's dtype: fp32 "
          f"{peaks['fp32']:.0f}, bf16 {peaks['bf16']:.0f} GFLOP/s")
    return peaks


def torch_bf16_wanted(peaks: dict[str, float]) -> bool:
    """Whether to time PyTorch under bf16 autocast (``--torch-bf16``)."""
    if ARGS.torch_bf16 != "auto":
        return ARGS.torch_bf16 == "on"
    if ON_GPU:
        return True
    fp32, bf16 = peaks["torch fp32"], peaks["torch bf16"]
    if bf16 < fp32:
        print(f"  torch bf16 autocast not timed: its bf16 matmul runs at {bf16:.0f} GFLOP/s vs "
              f"fp32 {fp32:.0f} on this CPU (no bf16 units; --torch-bf16 on forces it)")
        return False
    return True


def memory_text(peak: float | None) -> str:
    return "" if peak is None else f"   peak {peak / 2**30:.2f} GiB"


def jax_peak() -> float | None:
    """Peak bytes of JAX's first device (GPU/TPU), or the process's peak RSS on CPU."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return float(stats["peak_bytes_in_use"])
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux: KiB


def bf16_agreement(apply_fn, params, bf16_params, latents: np.ndarray, samples: int,
                   classes: int, chunks: dict[str, int]) -> None:
    """Prints how often the engine's bf16 argmax equals its fp32 argmax on the same samples.

    ``sample_labels`` with one key: the same noisy latents (drawn in float32, then cast) go
    through the fp32 and the bf16 pipeline, each at the chunk it was timed at (``chunks``,
    keyed "fp32"/"bf16"), so each runs the timed program instead of compiling another; the
    exact (Clopper–Pearson) 95 % interval of the agreement rate is printed. Certificates never
    see these numbers: counts are integers.
    """
    per_input = -(-samples // len(latents))
    key = keys.stream_key(jax.random.key(2), keys.STREAM_ESTIMATE)

    def labels(p, dtype, chunk):
        return sampler.sample_labels(apply_fn, p, latents, noise.Gaussian(), key, per_input,
                                     scale=et.SIGMA, num_classes=classes, chunk_size=chunk,
                                     dtype=dtype)

    fp32 = labels(params, None, chunks["fp32"])
    same = fp32 == labels(bf16_params, jnp.bfloat16, chunks["bf16"])
    total, agree = same.size, int(same.sum())
    _, counts = np.unique(fp32, return_counts=True)
    low = float(clopper_pearson_lower(agree, total, 0.025))
    high = float(clopper_pearson_upper(agree, total, 0.025))
    print(f"  bf16 vs fp32 argmax agreement (engine, same noisy samples): {agree}/{total} = "
          f"{agree / total:.2%} [{low:.2%}, {high:.2%}] (95 %, exact); the fp32 labels take "
          f"{len(counts)} classes, the most frequent {counts.max() / total:.0%} of samples "
          "(random weights: a near-constant classifier agrees trivially)")


def engine_work(apply_fn, params, latents, classes: int, seen: list, **kwargs):
    """``count_classes`` over all latents as ``certify latent`` runs it; returns the samples."""
    key = keys.stream_key(jax.random.key(0), keys.STREAM_ESTIMATE)

    def work():
        sampler.count_classes(apply_fn, params, latents, noise.Gaussian(), key,
                              ARGS.num, scale=et.SIGMA, num_classes=classes,
                              progress=lambda done, total: seen.append(done), **kwargs)
        return len(latents) * ARGS.num

    return work


def torch_work(model: nn.Module, latents: torch.Tensor, batch: int, classes: int,
               autocast: bool = False, channels_last: bool = False):
    """One pass of `cohen_counts` over all latents; returns the samples.

    ``channels_last`` converts the weights for the pass and back after it (the model is shared
    with the other contenders and cannot be deep-copied; the conversion, ~0.1 GB of weights,
    is timed with the pass).
    """
    def work():
        if channels_last:
            model.to(memory_format=torch.channels_last)
        for x in latents:
            cohen_counts(model, x, ARGS.num, batch, classes, autocast)
        if channels_last:
            model.to(memory_format=torch.contiguous_format)
        return len(latents) * ARGS.num

    return work


def run_pipeline(name: str, torch_images: nn.Module, gen, description: str, scale: dict,
                 peaks: dict[str, float]) -> None:
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

    flops = et.torch_matmul_flops(model, torch.from_numpy(probe))
    x = jax.ShapeDtypeStruct((8, *latents.shape[1:]), jnp.float32)
    xla_flops = float(jax.jit(apply_fn).lower(params, x).cost_analysis()["flops"]) / 8
    print(f"  forward pass: {flops / 1e9:.3f} GFLOP/sample in convolutions and matmuls "
          f"(PyTorch FlopCounterMode; MFU uses this), {xla_flops / 1e9:.3f} GFLOP/sample in the "
          f"JAX program (XLA cost analysis, all ops)")
    if ARGS.parity_only:
        return

    # PyTorch's batch sweep first, before XLA's thread pool (or its GPU memory) is busy.
    model = model.to(TORCH_DEVICE)
    z = torch.from_numpy(latents).to(TORCH_DEVICE)
    sweep, torch_memory = torch_sweep(model, z, classes)
    best = max(sweep, key=sweep.get)
    print("  torch fp32 batch sweep (one pass each): " + ", ".join(
        f"{b}: {r:.0f}{memory_text(torch_memory[b])}" for b, r in sweep.items())
          + f" samples/s; best batch {best}")

    # Every batch of the sweep again in the rounds (PyTorch's best batch is judged on the
    # medians); channels_last and bf16 autocast at the sweep's best batch.
    kinds = {f"torch fp32, batch {b}": "fp32" for b in ARGS.batches}
    contenders = {f"torch fp32, batch {b}": torch_work(model, z, b, classes)
                  for b in ARGS.batches}
    kinds[f"torch channels_last, batch {best}"] = "fp32"
    contenders[f"torch channels_last, batch {best}"] = torch_work(model, z, best, classes,
                                                                 channels_last=True)
    if ARGS.dtype != "float32" and torch_bf16_wanted(peaks):
        kinds[f"torch bf16 autocast, batch {best}"] = "bf16"
        contenders[f"torch bf16 autocast, batch {best}"] = torch_work(model, z, best, classes,
                                                                     autocast=True)
    chunks = {}
    if ARGS.dtype in ("float32", "both"):
        for chunk in (None, *ARGS.chunks):
            label = "engine fp32" + ("" if chunk is None else f", chunk {chunk}")
            chunks[label] = []
            kinds[label] = "fp32"
            contenders[label] = engine_work(apply_fn, params, latents, classes, chunks[label],
                                            chunk_size=chunk)
    bf16_params = None
    if ARGS.dtype in ("bfloat16", "both"):
        # as cbcert.runs.certify does for --dtype bfloat16: parameters and samples cast
        bf16_params = sampler.cast_floating(params, jnp.bfloat16)
        chunks["engine bf16"] = []
        kinds["engine bf16"] = "bf16"
        contenders["engine bf16"] = engine_work(apply_fn, bf16_params, latents, classes,
                                                chunks["engine bf16"], dtype=jnp.bfloat16)

    rates, first = timing.interleaved(contenders, ARGS.rounds, 0.0)
    best = max(ARGS.batches, key=lambda b: timing.median(rates[f"torch fp32, batch {b}"]))
    print(f"  {ARGS.rounds} rounds, every contender once per round in rotated order; samples/s "
          "is the median over rounds, each ratio the median of per-round ratios (range):")
    engines = [n for n in rates if n.startswith("engine")]
    for label, values in rates.items():
        rate = timing.median(values)
        mfu = rate * flops / 1e9 / peaks[kinds[label]]
        text = f"  {label:<34}: {rate:10.0f} samples/s   MFU {mfu:.1%}"
        if label.startswith("engine"):
            chunk = f"auto {chunks[label][0]}" if "chunk" not in label else label.split()[-1]
            text += (f", chunk {chunk}, first call {first[label]:.1f} s (compilation)\n"
                     f"  {'':<34}  {timing.format_ratio(values, rates['torch fp32, batch 8'])} vs "
                     "torch fp32 batch 8")
            if best != 8:
                text += (f", {timing.format_ratio(values, rates[f'torch fp32, batch {best}'])} "
                         f"vs torch fp32 batch {best} (its best)")
            autocast = next((n for n in rates if n.startswith("torch bf16 autocast")), None)
            if label == "engine bf16" and autocast is not None:
                text += f", {timing.format_ratio(values, rates[autocast])} vs torch bf16 autocast"
        print(text)
    peak = jax_peak()
    if peak is not None:
        where = "JAX device peak" if ON_GPU else "process peak RSS (both frameworks)"
        print(f"  {where}: {peak / 2**30:.2f} GiB")
    if bf16_params is not None and ARGS.agreement:
        timed = {"bf16": chunks["engine bf16"][0],
                 "fp32": chunks["engine fp32"][0] if "engine fp32" in chunks else None}
        bf16_agreement(apply_fn, params, bf16_params, latents, ARGS.agreement, classes, timed)
    best_engine = max(engines, key=lambda n: timing.median(rates[n]))
    best_torch = max((n for n in rates if n.startswith("torch")),
                     key=lambda n: timing.median(rates[n]))
    print(f"  PyTorch's best batch over the rounds: {best} (fp32)")
    print(f"  best engine ({best_engine}) vs best PyTorch ({best_torch}): "
          f"{timing.format_ratio(rates[best_engine], rates[best_torch])}")


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
    peak = {} if ARGS.parity_only else measured_peaks()
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
