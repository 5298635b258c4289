"""DenseNet (Huang et al., CVPR 2017, "Densely connected convolutional networks") in Flax NNX.

Channel-last port of the torchvision architecture: every dense layer sees the concatenation of
all earlier feature maps of its block (BN-ReLU-1x1 conv to ``bn_size * growth`` channels,
BN-ReLU-3x3 conv to ``growth`` channels); transitions halve channels and resolution. Batch norm
runs in inference mode (eps 1e-5) and dropout is absent, as in ``model.eval()``.

The network can be truncated after any element of ``stage_names(config)`` (PixPNet's names);
only the layers up to there are built.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.models.resnet import batch_norm, conv, max_pool_3x3_s2


@dataclasses.dataclass(frozen=True)
class DenseNetConfig:
    """Static structure of a DenseNet.

    Attributes:
      growth_rate: channels each dense layer adds (torchvision ``growth_rate``).
      block_config: dense layers per block.
      num_init_features: channels of the stem convolution.
      bn_size: bottleneck width factor of the 1x1 conv (``bn_size * growth_rate``).
      num_classes: width of the classifier.
      feature_layer: ``None`` for the full classifier, else the last stage kept (one of
        ``stage_names(config)``, e.g. ``"denseblock3"``).
    """

    growth_rate: int
    block_config: tuple[int, ...]
    num_init_features: int
    bn_size: int = 4
    num_classes: int = 1000
    feature_layer: str | None = None

    def __post_init__(self):
        if self.growth_rate < 1 or self.num_init_features < 1 or self.bn_size < 1:
            raise ValueError(f"growth_rate={self.growth_rate}, num_init_features="
                             f"{self.num_init_features}, bn_size={self.bn_size}; all must be >= 1")
        if not self.block_config or min(self.block_config) < 1:
            raise ValueError(f"block_config={self.block_config!r}; need positive layer counts")
        if self.num_classes < 1:
            raise ValueError(f"num_classes={self.num_classes}; must be >= 1")
        names = stage_names(self)
        if self.feature_layer is not None and self.feature_layer not in names:
            raise ValueError(f"feature_layer={self.feature_layer!r}; allowed: None or {names}")

    @property
    def num_stages(self) -> int:
        """How many of ``stage_names(config)`` are built."""
        names = stage_names(self)
        return len(names) if self.feature_layer is None else names.index(self.feature_layer) + 1

    def block_channels(self) -> list[tuple[int, int]]:
        """``(input channels, output channels)`` of every dense block."""
        out, cin = [], self.num_init_features
        for i, depth in enumerate(self.block_config):
            cout = cin + depth * self.growth_rate
            out.append((cin, cout))
            cin = cout // 2 if i < len(self.block_config) - 1 else cout
        return out

    @property
    def embedding_dim(self) -> int:
        """Channels of ``norm5`` (= the pooled embedding used by PCBM)."""
        return self.block_channels()[-1][1]

    @property
    def feature_channels(self) -> int:
        """Channels of the output of the last built stage."""
        name = stage_names(self)[self.num_stages - 1]
        if name in ("conv0", "norm0", "relu0", "pool0"):
            return self.num_init_features
        if name.startswith("denseblock"):
            return self.block_channels()[int(name[10:]) - 1][1]
        if name.startswith("transition"):
            return self.block_channels()[int(name[10:]) - 1][1] // 2
        return self.embedding_dim

    @classmethod
    def from_name(cls, name: str, **overrides) -> DenseNetConfig:
        """Preset for a torchvision name (``densenet121/161/169/201``)."""
        if name not in DENSENET_PRESETS:
            raise ValueError(f"name={name!r}; allowed: {sorted(DENSENET_PRESETS)}")
        growth, blocks, init = DENSENET_PRESETS[name]
        return cls(growth_rate=growth, block_config=blocks, num_init_features=init, **overrides)


DENSENET_PRESETS: dict[str, tuple[int, tuple[int, ...], int]] = {
    "densenet121": (32, (6, 12, 24, 16), 64),
    "densenet161": (48, (6, 12, 36, 24), 96),
    "densenet169": (32, (6, 12, 32, 32), 64),
    "densenet201": (32, (6, 12, 48, 32), 64),
}


def stage_names(config: DenseNetConfig) -> tuple[str, ...]:
    """torchvision's ``features`` children in order (PixPNet's cut points)."""
    names = ["conv0", "norm0", "relu0", "pool0"]
    for i in range(1, len(config.block_config) + 1):
        names.append(f"denseblock{i}")
        if i < len(config.block_config):
            names.append(f"transition{i}")
    return (*names, "norm5")


class DenseLayer(nnx.Module):
    """``conv2(relu(norm2(conv1(relu(norm1(x))))))``: ``[B, H, W, cin] -> [B, H, W, growth]``."""

    def __init__(self, cin: int, growth: int, bn_size: int, rngs: nnx.Rngs):
        self.norm1 = batch_norm(cin, rngs)
        self.conv1 = conv(cin, bn_size * growth, 1, 1, rngs)
        self.norm2 = batch_norm(bn_size * growth, rngs)
        self.conv2 = conv(bn_size * growth, growth, 3, 1, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.conv1(nnx.relu(self.norm1(x)))
        return self.conv2(nnx.relu(self.norm2(y)))


class DenseBlock(nnx.Module):
    """Dense connectivity: layer k sees ``concat(x, y_1, ..., y_{k-1})`` on the channel axis."""

    def __init__(self, cin: int, depth: int, growth: int, bn_size: int, rngs: nnx.Rngs):
        self.layers = nnx.List([DenseLayer(cin + k * growth, growth, bn_size, rngs)
                                for k in range(depth)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = jnp.concatenate([x, layer(x)], axis=-1)
        return x


class Transition(nnx.Module):
    """BN-ReLU-1x1 conv to ``cout`` then 2x2 average pooling, stride 2."""

    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs):
        self.norm = batch_norm(cin, rngs)
        self.conv = conv(cin, cout, 1, 1, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.conv(nnx.relu(self.norm(x)))  # [B, H, W, cout]
        b, h, w, c = y.shape
        # AvgPool2d(2, 2) floors odd sizes: drop the last row/column like PyTorch.
        y = y[:, : h // 2 * 2, : w // 2 * 2]
        return y.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


class DenseNet(nnx.Module):
    """torchvision DenseNet, NHWC. ``model(x[B, H, W, 3]) -> logits[B, num_classes]``."""

    def __init__(self, config: DenseNetConfig, *, rngs: nnx.Rngs):
        self.config = config
        names = stage_names(config)[: config.num_stages]
        self.conv0 = conv(3, config.num_init_features, 7, 2, rngs)
        self.norm0 = batch_norm(config.num_init_features, rngs) if "norm0" in names else None
        channels = config.block_channels()
        self.blocks = nnx.List([
            DenseBlock(channels[i][0], depth, config.growth_rate, config.bn_size, rngs)
            for i, depth in enumerate(config.block_config) if f"denseblock{i + 1}" in names])
        self.transitions = nnx.List([
            Transition(channels[i][1], channels[i][1] // 2, rngs)
            for i in range(len(config.block_config) - 1) if f"transition{i + 1}" in names])
        self.norm5 = batch_norm(config.embedding_dim, rngs) if "norm5" in names else None
        self.classifier = (nnx.Linear(config.embedding_dim, config.num_classes, rngs=rngs)
                           if config.feature_layer is None else None)

    def features(self, x: jax.Array) -> jax.Array:
        """Output of the last built stage of ``features``: ``[B, H, W, 3] -> [B, h, w, C]``.

        For the full network this is ``norm5`` (before the final ReLU), as in torchvision.
        """
        names = stage_names(self.config)[: self.config.num_stages]
        x = self.conv0(x)
        if "norm0" in names:
            x = self.norm0(x)
        if "relu0" in names:
            x = nnx.relu(x)
        if "pool0" in names:
            x = max_pool_3x3_s2(x)
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        if self.norm5 is not None:
            x = self.norm5(x)
        return x

    def embed(self, x: jax.Array) -> jax.Array:
        """Pooled embedding ``e = mean_{h,w} relu(norm5(x))``: ``[B, H, W, 3] -> [B, D]``, summed
        and returned in float32 whatever the compute dtype (float32 logits under bfloat16)."""
        if self.config.feature_layer is not None:
            raise ValueError(f"feature_layer={self.config.feature_layer!r}; the pooled embedding "
                             "needs the full network (feature_layer=None)")
        return jnp.mean(nnx.relu(self.features(x)), axis=(1, 2), dtype=jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``classifier(embed(x))``: ``[B, H, W, 3] -> [B, num_classes]``."""
        return self.classifier(self.embed(x))
