"""ResNet (He et al., CVPR 2016, "Deep residual learning for image recognition") in Flax NNX.

Channel-last (NHWC) port of the torchvision architecture (v1.5: the stride of a bottleneck block
sits on its 3x3 convolution). Padding is explicit and symmetric as in PyTorch, batch norm runs
in inference mode on its running statistics, so a converted torchvision checkpoint gives the
same logits (see ``cbcert.convert.torchvision``).

The network can be truncated after any stage of ``STAGES`` (PixPNet reads the feature map of an
intermediate stage); only the layers up to that stage are then built.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.nn.layers import PatchConv, TorchBatchNorm, conv2d

BN_EPS = 1e-5  # torch.nn.BatchNorm2d default; flax's default (1e-6) would change the outputs
# PixPNet's names for the points where a torchvision ResNet can be cut ("conv1" = after its ReLU).
STAGES = ("conv1", "maxpool", "layer1", "layer2", "layer3", "layer4")


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Static structure of a ResNet.

    Attributes:
      block: ``"basic"`` (two 3x3 convs, expansion 1) or ``"bottleneck"`` (1x1-3x3-1x1,
        expansion 4).
      layers: number of blocks in each of the four stages.
      num_classes: width of the final linear layer.
      feature_layer: ``None`` for the full classifier, else the last stage kept (one of
        ``STAGES``); a truncated network has no pooling and no linear layer.
    """

    block: Literal["basic", "bottleneck"]
    layers: tuple[int, int, int, int]
    num_classes: int = 1000
    feature_layer: str | None = None

    def __post_init__(self):
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"block={self.block!r}; allowed: 'basic', 'bottleneck'")
        if len(self.layers) != 4 or min(self.layers) < 1:
            raise ValueError(f"layers={self.layers!r}; need four positive block counts")
        if self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}; must be >= 1")
        if self.feature_layer is not None and self.feature_layer not in STAGES:
            raise ValueError(f"feature_layer={self.feature_layer!r}; allowed: None or {STAGES}")

    @property
    def expansion(self) -> int:
        return 1 if self.block == "basic" else 4

    @property
    def embedding_dim(self) -> int:
        """Channels of the layer4 output (= the pooled embedding used by PCBM)."""
        return 512 * self.expansion

    @property
    def num_stages(self) -> int:
        """How many of ``STAGES`` are built."""
        return len(STAGES) if self.feature_layer is None else STAGES.index(self.feature_layer) + 1

    @property
    def feature_channels(self) -> int:
        """Channels of the output of the last built stage."""
        if self.num_stages <= 2:
            return 64
        return 64 * 2 ** (self.num_stages - 3) * self.expansion

    @classmethod
    def from_name(cls, name: str, **overrides) -> ResNetConfig:
        """Preset for a torchvision name (``resnet18`` ... ``resnet152``)."""
        if name not in RESNET_PRESETS:
            raise ValueError(f"name={name!r}; allowed: {sorted(RESNET_PRESETS)}")
        block, layers = RESNET_PRESETS[name]
        return cls(block=block, layers=layers, **overrides)


RESNET_PRESETS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}


def conv(cin: int, cout: int, kernel: int, stride: int, rngs: nnx.Rngs,
         bias: bool = False) -> PatchConv:
    """``torch.nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2)`` in NHWC.

    PyTorch pads symmetrically by ``kernel // 2`` (flax's ``"SAME"`` would pad asymmetrically
    for even inputs with stride 2). ``nnx.Conv``'s parameter layout, computed by
    ``cbcert.nn.layers.conv`` (patch matmul on small CPU maps, native convolution otherwise).
    """
    return conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, use_bias=bias,
                  rngs=rngs)


def batch_norm(channels: int, rngs: nnx.Rngs) -> TorchBatchNorm:
    """Inference-mode batch norm: ``(x - running_mean) / sqrt(running_var + 1e-5) * w + b``;
    in training mode (``module.train()``, the trainers) PyTorch's (`TorchBatchNorm`)."""
    return TorchBatchNorm(channels, use_running_average=True, epsilon=BN_EPS, rngs=rngs)


def max_pool_3x3_s2(x: jax.Array) -> jax.Array:
    """``torch.nn.MaxPool2d(3, stride=2, padding=1)`` on ``x[B, H, W, C]``.

    Padded cells are -inf (PyTorch semantics), never zero: a zero pad would beat negative
    activations at the border.
    """
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                 ((0, 0), (1, 1), (1, 1), (0, 0)))


class BasicBlock(nnx.Module):
    """Two 3x3 convs with an identity (or 1x1 projection) shortcut; expansion 1."""

    def __init__(self, cin: int, width: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = conv(cin, width, 3, stride, rngs)
        self.bn1 = batch_norm(width, rngs)
        self.conv2 = conv(width, width, 3, 1, rngs)
        self.bn2 = batch_norm(width, rngs)
        self.downsample = _projection(cin, width, stride, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return nnx.relu(y + _shortcut(self.downsample, x))


class Bottleneck(nnx.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus shortcut."""

    def __init__(self, cin: int, width: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = conv(cin, width, 1, 1, rngs)
        self.bn1 = batch_norm(width, rngs)
        self.conv2 = conv(width, width, 3, stride, rngs)
        self.bn2 = batch_norm(width, rngs)
        self.conv3 = conv(width, width * 4, 1, 1, rngs)
        self.bn3 = batch_norm(width * 4, rngs)
        self.downsample = _projection(cin, width * 4, stride, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = nnx.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return nnx.relu(y + _shortcut(self.downsample, x))


def _projection(cin: int, cout: int, stride: int, rngs: nnx.Rngs) -> nnx.List | None:
    """torchvision's ``downsample = Sequential(conv1x1, bn)`` when the shape changes."""
    if stride == 1 and cin == cout:
        return None
    return nnx.List([conv(cin, cout, 1, stride, rngs), batch_norm(cout, rngs)])


def _shortcut(downsample: nnx.List | None, x: jax.Array) -> jax.Array:
    if downsample is None:
        return x
    projection, norm = downsample
    return norm(projection(x))


class ResNet(nnx.Module):
    """torchvision ResNet, NHWC. ``model(x[B, H, W, 3]) -> logits[B, num_classes]``."""

    def __init__(self, config: ResNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.conv1 = conv(3, 64, 7, 2, rngs)
        self.bn1 = batch_norm(64, rngs)
        block = BasicBlock if config.block == "basic" else Bottleneck
        stages = []
        cin = 64
        for i, depth in enumerate(config.layers[: max(config.num_stages - 2, 0)]):
            width = 64 * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(block(cin, width, 2 if (i > 0 and j == 0) else 1, rngs))
                cin = width * config.expansion
            stages.append(nnx.List(blocks))
        self.stages = nnx.List(stages)
        self.fc = (nnx.Linear(cin, config.num_classes, rngs=rngs)
                   if config.feature_layer is None else None)

    def features(self, x: jax.Array) -> jax.Array:
        """Feature map after the last built stage: ``x[B, H, W, 3] -> [B, h, w, C]``.

        For the full network this is the layer4 output (``h = ceil(H / 32)``).
        """
        x = nnx.relu(self.bn1(self.conv1(x)))
        if self.config.num_stages >= 2:
            x = max_pool_3x3_s2(x)
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return x

    def embed(self, x: jax.Array) -> jax.Array:
        """Pooled embedding ``e = mean_{h,w} layer4(x)``: ``[B, H, W, 3] -> [B, 512 * expansion]``.

        This is torchvision's input to ``fc`` and PCBM's backbone embedding. Summed and returned
        in float32 whatever the compute dtype, so ``fc`` (whose parameters promote to float32)
        gives float32 logits when the network runs in bfloat16; unchanged in float32.
        """
        if self.config.feature_layer is not None:
            raise ValueError(f"feature_layer={self.config.feature_layer!r}; the pooled embedding "
                             "needs the full network (feature_layer=None)")
        return jnp.mean(self.features(x), axis=(1, 2), dtype=jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``fc(embed(x))``: ``[B, H, W, 3] -> [B, num_classes]``."""
        return self.fc(self.embed(x))
