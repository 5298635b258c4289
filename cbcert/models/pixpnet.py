"""PixPNet / ProtoPNet-style prototype networks (Carmichael et al., WACV 2024, "Pixel-grounded
prototypical part networks"; Chen et al., NeurIPS 2019) in Flax NNX.

Pipeline on ``x[B, H, W, 3]``:

1. ``f``: a torchvision backbone (ResNet, DenseNet or VGG) truncated after ``feature_layer``.
2. add-on layers: 1x1 convs with ReLU between them and a final sigmoid -> ``z[B, h, w, D]``.
3. distances to P prototypes ``p_j`` (1x1 patches), either squared L2
   ``d = max(||z||^2 - 2 z.p + ||p||^2, 0)`` or cosine ``d = 1 - clip(cos(z, p), -1, 1)``.
4. global min-pool over positions: ``d_j = min_{h,w} d[:, h, w, j]``.
5. similarity ``s_j = log(1 / (d_j + eps) + 1)`` (``"log"``; equals ``log((d + 1) / (d + eps))``
   up to the ``eps`` in the numerator) or ``"linear"`` (``1 - d`` for cosine, ``-d`` for L2).
6. readout to C classes: ``"linear"`` (``W s``, no bias), ``"sparse"`` (prototype group c of
   P/C consecutive prototypes weighted only into class c) or ``"proto"`` (sum of group c).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.models.densenet import DENSENET_PRESETS, DenseNet, DenseNetConfig
from cbcert.models.resnet import RESNET_PRESETS, ResNet, ResNetConfig, batch_norm
from cbcert.nn.layers import conv2d

VGG_LAYOUTS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}
VGG_NAMES = tuple(sorted([*VGG_LAYOUTS, *(f"{n}_bn" for n in VGG_LAYOUTS)]))


def vgg_sequence(name: str) -> tuple[tuple[str, str, int, int], ...]:
    """PixPNet's layer names for a torchvision VGG ``features``: ``(name, op, index, channels)``.

    Ops: ``"conv"`` (3x3, pad 1, bias; named ``conv_no_act{i}``), ``"bn"`` (``bn{i}``),
    ``"relu"`` (named ``conv{i}``: "conv i with its activation"), ``"pool"`` (2x2 max pool,
    ``maxpool{m}``). ``index`` counts convs (for conv/bn/relu) or pools.
    """
    if name not in VGG_NAMES:
        raise ValueError(f"feature_extractor={name!r}; allowed VGGs: {VGG_NAMES}")
    batch_norm_ = name.endswith("_bn")
    out, convs, pools = [], 0, 0
    for item in VGG_LAYOUTS[name.removesuffix("_bn")]:
        if item == "M":
            pools += 1
            out.append((f"maxpool{pools}", "pool", pools, out[-1][3]))
            continue
        convs += 1
        out.append((f"conv_no_act{convs}", "conv", convs, item))
        if batch_norm_:
            out.append((f"bn{convs}", "bn", convs, item))
        out.append((f"conv{convs}", "relu", convs, item))
    return tuple(out)


class VGGFeatures(nnx.Module):
    """torchvision VGG ``features`` truncated after ``feature_layer`` (NHWC)."""

    def __init__(self, name: str, feature_layer: str, *, rngs: nnx.Rngs):
        sequence = vgg_sequence(name)
        names = [layer[0] for layer in sequence]
        if feature_layer not in names:
            raise ValueError(f"feature_layer={feature_layer!r}; allowed for {name}: {names}")
        self.sequence = sequence[: names.index(feature_layer) + 1]
        convs, norms, cin = [], [], 3
        for _, op, _, channels in self.sequence:
            if op == "conv":
                convs.append(conv2d(cin, channels, 3, padding=1, rngs=rngs))
                cin = channels
            elif op == "bn":
                norms.append(batch_norm(channels, rngs))
        self.convs = nnx.List(convs)
        self.norms = nnx.List(norms)

    @property
    def out_channels(self) -> int:
        return self.sequence[-1][3]

    def features(self, x: jax.Array) -> jax.Array:
        """``[B, H, W, 3] -> [B, h, w, C]``; max pools floor odd sizes like PyTorch."""
        for _, op, index, _ in self.sequence:
            if op == "conv":
                x = self.convs[index - 1](x)
            elif op == "bn":
                x = self.norms[index - 1](x)
            elif op == "relu":
                x = nnx.relu(x)
            else:
                x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                          "VALID")
        return x


@dataclasses.dataclass(frozen=True)
class PixPNetConfig:
    """Static structure of a PixPNet (field names follow its ``config.yaml``, snake_case).

    Attributes:
      feature_extractor: torchvision name: ``resnet*``, ``densenet*``, ``vgg*`` or ``vgg*_bn``.
      feature_layer: PixPNet's name of the last backbone layer kept (e.g. ``layer3``,
        ``maxpool4``, ``denseblock3``).
      num_prototypes: P.
      prototype_dim: D, channels of the add-on output and of each prototype.
      num_classes: C.
      add_on_layers_type: ``"regular"`` (two 1x1 convs) or ``"bottleneck"`` (halving pairs).
      distance: ``"l2"`` (squared) or ``"cosine"``.
      prototype_activation: ``"log"`` or ``"linear"`` distance-to-similarity map.
      readout_type: ``"linear"``, ``"sparse"`` or ``"proto"``.
      epsilon: the ``eps`` of the log similarity.
    """

    feature_extractor: str
    feature_layer: str
    num_prototypes: int
    prototype_dim: int
    num_classes: int
    add_on_layers_type: Literal["regular", "bottleneck"] = "regular"
    distance: Literal["l2", "cosine"] = "l2"
    prototype_activation: Literal["log", "linear"] = "log"
    readout_type: Literal["linear", "sparse", "proto"] = "linear"
    epsilon: float = 1e-6

    def __post_init__(self):
        choices = {"add_on_layers_type": ("regular", "bottleneck"), "distance": ("l2", "cosine"),
                   "prototype_activation": ("log", "linear"),
                   "readout_type": ("linear", "sparse", "proto")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {allowed}")
        for name in ("num_prototypes", "prototype_dim", "num_classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.readout_type != "linear" and self.num_prototypes % self.num_classes:
            raise ValueError(f"num_prototypes={self.num_prototypes}; readout_type="
                             f"{self.readout_type!r} needs a multiple of num_classes="
                             f"{self.num_classes}")
        if not self.epsilon > 0:
            raise ValueError(f"epsilon={self.epsilon}; must be > 0")
        self.backbone_out_channels()  # validates feature_extractor and feature_layer

    def backbone_config(self) -> ResNetConfig | DenseNetConfig | None:
        """Truncated torchvision config, or None for a VGG."""
        if self.feature_extractor in RESNET_PRESETS:
            return ResNetConfig.from_name(self.feature_extractor, feature_layer=self.feature_layer)
        if self.feature_extractor in DENSENET_PRESETS:
            return DenseNetConfig.from_name(self.feature_extractor,
                                            feature_layer=self.feature_layer)
        return None

    def backbone_out_channels(self) -> int:
        """Channels of the truncated backbone output."""
        if self.feature_extractor in VGG_NAMES:
            sequence = vgg_sequence(self.feature_extractor)
            names = [layer[0] for layer in sequence]
            if self.feature_layer not in names:
                raise ValueError(f"feature_layer={self.feature_layer!r}; allowed for "
                                 f"{self.feature_extractor}: {names}")
            return sequence[names.index(self.feature_layer)][3]
        if self.feature_extractor in RESNET_PRESETS or self.feature_extractor in DENSENET_PRESETS:
            return self.backbone_config().feature_channels
        raise ValueError(f"feature_extractor={self.feature_extractor!r}; allowed: "
                         f"{sorted(RESNET_PRESETS) + sorted(DENSENET_PRESETS) + list(VGG_NAMES)}")


def add_on_layer_specs(config: PixPNetConfig) -> tuple[tuple[str, int, int, str], ...]:
    """``(name, in, out, activation)`` of the add-on 1x1 convs, named as in the checkpoint.

    ``"regular"``: ``conv1`` (C -> D, ReLU), ``conv_last`` (D -> D, sigmoid).
    ``"bottleneck"``: pairs of convs halving the width, ``max(D, c // 2)``, until it reaches D;
    the last conv of the last pair is ``conv_last`` with the sigmoid.
    """
    cin, dim = config.backbone_out_channels(), config.prototype_dim
    if config.add_on_layers_type == "regular":
        return (("conv1", cin, dim, "relu"), ("conv_last", dim, dim, "sigmoid"))
    specs, index, current = [], 1, cin
    while current > dim or not specs:
        cout = max(dim, current // 2)
        last = cout == dim
        specs.append((f"conv{index}", current, cout, "relu"))
        specs.append(("conv_last" if last else f"conv{index + 1}", cout, cout,
                      "sigmoid" if last else "relu"))
        current //= 2
        index += 2
    return tuple(specs)


def squared_l2_distances(z: jax.Array, prototypes: jax.Array) -> jax.Array:
    """``max(||z||^2 - 2 z.p + ||p||^2, 0)``: ``z[B, h, w, D], p[P, D] -> [B, h, w, P]``.

    The expanded form is the reference's (ProtoPNet's ``l2_convolution``); the clamp removes
    rounding below zero.
    """
    z2 = jnp.sum(z * z, axis=-1, keepdims=True)  # [B, h, w, 1]
    p2 = jnp.sum(prototypes * prototypes, axis=-1)  # [P]
    zp = jnp.einsum("bhwd,pd->bhwp", z, prototypes)
    return jax.nn.relu(z2 - (zp + zp) + p2)


def cosine_distances(z: jax.Array, prototypes: jax.Array) -> jax.Array:
    """``1 - clip(cos(z, p), -1, 1)`` in [0, 2]: ``z[B, h, w, D], p[P, D] -> [B, h, w, P]``.

    Vectors are normalised as ``torch.nn.functional.normalize``: ``v / max(||v||, 1e-12)``.
    """
    def normalize(v):
        return v / jnp.maximum(jnp.linalg.norm(v, axis=-1, keepdims=True), 1e-12)

    cos = jnp.einsum("bhwd,pd->bhwp", normalize(z), normalize(prototypes))
    return 1.0 - jnp.clip(cos, -1.0, 1.0)


class PixPNet(nnx.Module):
    """Prototype network: ``model(x[B, H, W, 3]) -> logits[B, num_classes]``."""

    def __init__(self, config: PixPNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        backbone_config = config.backbone_config()
        if isinstance(backbone_config, ResNetConfig):
            self.backbone = ResNet(backbone_config, rngs=rngs)
        elif isinstance(backbone_config, DenseNetConfig):
            self.backbone = DenseNet(backbone_config, rngs=rngs)
        else:
            self.backbone = VGGFeatures(config.feature_extractor, config.feature_layer, rngs=rngs)
        self.add_on = nnx.List([conv2d(cin, cout, 1, rngs=rngs)
                                for _, cin, cout, _ in add_on_layer_specs(config)])
        p, c = config.num_prototypes, config.num_classes
        self.prototypes = nnx.Param(jnp.zeros((p, config.prototype_dim)))  # [P, D]
        self.readout = (nnx.Linear(p, c, use_bias=False, rngs=rngs)
                        if config.readout_type == "linear" else None)
        self.readout_weight = (nnx.Param(jnp.zeros((c, p // c)))  # [C, P/C]
                               if config.readout_type == "sparse" else None)

    def latent(self, x: jax.Array) -> jax.Array:
        """Add-on output ``z``: ``[B, H, W, 3] -> [B, h, w, D]``, entries in (0, 1)."""
        z = self.backbone.features(x)
        for conv, (_, _, _, act) in zip(self.add_on, add_on_layer_specs(self.config),
                                        strict=True):
            z = conv(z)
            z = nnx.sigmoid(z) if act == "sigmoid" else nnx.relu(z)
        return z

    def distances(self, x: jax.Array) -> jax.Array:
        """Prototype distance maps: ``[B, H, W, 3] -> [B, h, w, P]``.

        In float32 whatever the compute dtype (``--dtype bfloat16``): the expanded L2 form
        cancels near a prototype, where the log similarity is steepest (see
        ``world_classifiers.PrototypeLayer.distances``). In float32 the program is unchanged."""
        z = self.latent(x)
        z = z.astype(jnp.promote_types(z.dtype, jnp.float32))
        prototypes = self.prototypes[...].astype(z.dtype)
        if self.config.distance == "l2":
            return squared_l2_distances(z, prototypes)
        return cosine_distances(z, prototypes)

    def similarities(self, x: jax.Array) -> jax.Array:
        """Max-pooled prototype similarities (global min-pool of distances): ``-> [B, P]``."""
        return self.similarity(jnp.min(self.distances(x), axis=(1, 2)))  # [B, P]

    def similarity(self, d: jax.Array) -> jax.Array:
        """The distance-to-similarity map of step 5 on min-pooled distances ``d[B, P]``."""
        if self.config.prototype_activation == "log":
            return jnp.log(1.0 / (d + self.config.epsilon) + 1.0)
        return 1.0 - d if self.config.distance == "cosine" else -d

    def readout_from_distances(self, d: jax.Array) -> jax.Array:
        """Class logits from min-pooled distances ``d[B, P]`` (the trainer's losses read ``d``
        too): ``-> [B, num_classes]``."""
        return self.read_out(self.similarity(d))

    def class_weights(self) -> tuple[jax.Array, jax.Array]:
        """The readout as ``(W[C, P], owner[P])``: logits ``= s Wᵀ`` (no bias) and the class
        each prototype belongs to: its group ``j // (P/C)`` for the ``sparse`` and ``proto``
        readouts (W zero outside the group; ones for ``proto``), the class its weight favours
        most (``argmax_c W[c, j]``) for the ``linear`` one."""
        p, c = self.config.num_prototypes, self.config.num_classes
        if self.readout is not None:
            w = self.readout.kernel[...].T  # [C, P]
            return w, jnp.argmax(w, axis=0)
        owner = jnp.arange(p) // (p // c)
        group = jax.nn.one_hot(owner, c, dtype=jnp.float32).T  # [C, P]
        if self.readout_weight is None:
            return group, owner
        return group * self.readout_weight[...].reshape(-1)[None, :], owner

    def __call__(self, x: jax.Array) -> jax.Array:
        """Class logits: ``[B, H, W, 3] -> [B, num_classes]``."""
        return self.read_out(self.similarities(x))

    def read_out(self, s: jax.Array) -> jax.Array:
        """Step 6, the readout: similarities ``s[B, P] -> logits[B, num_classes]``."""
        if self.readout is not None:
            return self.readout(s)
        grouped = s.reshape(s.shape[0], self.config.num_classes, -1)  # [B, C, P/C]
        if self.readout_weight is not None:
            return jnp.sum(grouped * self.readout_weight[...], axis=-1)
        return jnp.sum(grouped, axis=-1)
