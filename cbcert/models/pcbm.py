"""Post-hoc concept bottleneck models (Yuksekgonul et al., ICLR 2023, "Post-hoc Concept
Bottleneck Models") on a torchvision or pytorchcv backbone, in Flax NNX.

A backbone gives the pooled embedding ``e`` (``[B, D]``). A concept bank of K concept activation
vectors (CAVs, one linear SVM per concept) gives the signed geometric margins

    r = (V e + b) / ||V||        V: [K, D] CAVs, b: [K] intercepts, ||V||: [K] row norms,

and the prediction is a linear head on the margins, ``h(r) = W r + c``. PCBM-h adds a residual
linear head on the embedding: ``logits = h(r) + W_res e + c_res``.

A binary PCBM trained with scikit-learn keeps a single logit ``s`` (class 1 iff ``s > 0``,
``P(class 1) = sigmoid(s)``); it is returned as the two logits ``[0, s]``, which give the same
argmax and the same softmax probabilities. A binary PCBM-h adds the single logit to both
residual logits, as PyTorch broadcasting does in the reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from cbcert.models.densenet import DENSENET_PRESETS, DenseNet, DenseNetConfig
from cbcert.models.resnet import RESNET_PRESETS, ResNet, ResNetConfig

# pytorchcv (osmr/imgclsmob) backbones, as the torchvision architecture that computes the same
# feature map. post-hoc-cbm's CUB model is pytorchcv's "resnet18_cub" (200 classes). pytorchcv
# ends its features with a fixed AvgPool2d(7) instead of an adaptive pool, so the embedding
# exists only for a 7x7 last feature map (193..224 px inputs; post-hoc-cbm center-crops to 224).
PYTORCHCV_BACKBONES: dict[str, str] = {"resnet18_cub": "resnet18"}
PYTORCHCV_POOL = 7
BACKBONES = (*sorted(RESNET_PRESETS), *sorted(DENSENET_PRESETS), *sorted(PYTORCHCV_BACKBONES))


@dataclasses.dataclass(frozen=True)
class PCBMConfig:
    """Static structure of a PCBM / PCBM-h.

    Attributes:
      backbone: torchvision model name (``resnet18`` ... ``densenet201``) or pytorchcv name
        (``resnet18_cub``, see ``PYTORCHCV_BACKBONES``).
      backbone_classes: width of the backbone's own classifier (kept, unused by the PCBM).
      num_concepts: K, rows of the concept bank.
      head_outputs: width of the concept head (1 for a binary scikit-learn head).
      residual_outputs: width of the PCBM-h residual head; 0 for a plain PCBM.
    """

    backbone: str
    backbone_classes: int
    num_concepts: int
    head_outputs: int
    residual_outputs: int = 0

    def __post_init__(self):
        if self.backbone not in BACKBONES:
            raise ValueError(f"backbone={self.backbone!r}; allowed: {BACKBONES}")
        for name in ("backbone_classes", "num_concepts", "head_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.residual_outputs < 0:
            raise ValueError(f"residual_outputs={self.residual_outputs}; must be >= 0")
        if self.residual_outputs and self.head_outputs not in (1, self.residual_outputs):
            raise ValueError(f"head_outputs={self.head_outputs} with residual_outputs="
                             f"{self.residual_outputs}; the heads must match or the concept "
                             "head must be a single (broadcast) logit")

    @property
    def num_classes(self) -> int:
        """Width of the logits ``PCBM.__call__`` returns."""
        if self.residual_outputs:
            return self.residual_outputs
        return 2 if self.head_outputs == 1 else self.head_outputs

    def backbone_config(self) -> ResNetConfig | DenseNetConfig:
        name = PYTORCHCV_BACKBONES.get(self.backbone, self.backbone)
        if name in RESNET_PRESETS:
            return ResNetConfig.from_name(name, num_classes=self.backbone_classes)
        return DenseNetConfig.from_name(name, num_classes=self.backbone_classes)


class PCBM(nnx.Module):
    """PCBM / PCBM-h: ``model(x[B, H, W, 3]) -> logits[B, config.num_classes]``."""

    def __init__(self, config: PCBMConfig, *, rngs: nnx.Rngs):
        self.config = config
        backbone_config = config.backbone_config()
        self.backbone = (ResNet(backbone_config, rngs=rngs)
                         if isinstance(backbone_config, ResNetConfig)
                         else DenseNet(backbone_config, rngs=rngs))
        k, d = config.num_concepts, backbone_config.embedding_dim
        self.cavs = nnx.Param(jnp.zeros((k, d)))  # [K, D]
        self.intercepts = nnx.Param(jnp.zeros((k,)))  # [K]
        self.norms = nnx.Param(jnp.ones((k,)))  # [K], ||V_k||_2 of the float32 CAVs
        self.head = nnx.Linear(k, config.head_outputs, rngs=rngs)
        self.residual = (nnx.Linear(d, config.residual_outputs, rngs=rngs)
                         if config.residual_outputs else None)

    def embed(self, x: jax.Array) -> jax.Array:
        """Backbone embedding ``e``: ``[B, H, W, 3] -> [B, D]``.

        Raises:
          ValueError: a pytorchcv backbone on inputs whose last feature map is not 7x7.
        """
        if self.config.backbone not in PYTORCHCV_BACKBONES:
            return self.backbone.embed(x)
        features = self.backbone.features(x)  # [B, h, w, D]
        if features.shape[1:3] != (PYTORCHCV_POOL, PYTORCHCV_POOL):
            raise ValueError(
                f"backbone={self.config.backbone!r} pools with AvgPool2d({PYTORCHCV_POOL}), so its "
                f"last feature map must be {PYTORCHCV_POOL}x{PYTORCHCV_POOL}; inputs of "
                f"{x.shape[1]}x{x.shape[2]} px give {features.shape[1]}x{features.shape[2]}. "
                "Use 193..224 px inputs (post-hoc-cbm center-crops to 224)")
        return jnp.mean(features, axis=(1, 2), dtype=jnp.float32)  # float32 heads under bf16

    def margins(self, embedding: jax.Array) -> jax.Array:
        """Concept margins ``r = (V e + b) / ||V||``: ``[B, D] -> [B, K]``."""
        return (embedding @ self.cavs[...].T + self.intercepts[...]) / self.norms[...]

    def concept_scores(self, x: jax.Array) -> jax.Array:
        """Concept margins of images: ``[B, H, W, 3] -> [B, K]``."""
        return self.margins(self.embed(x))

    def class_head(self) -> tuple[jax.Array, jax.Array]:
        """The linear head on the margins as ``(W[C, K], b[C])``: the concept part of the
        logits is ``r Wᵀ + b`` (PCBM-h adds its residual on e).

        A multi-class head gives its own weights. A single-logit head ``t = r·w + b0`` gives
        ``W = [-w/2 ; w/2]``, ``b = [-b0/2, b0/2]`` for a plain binary PCBM (logits ``[0, t]``
        up to the shift ``-t/2`` common to both classes: the same softmax and argmax, and the
        contributions ``∓ r_i w_i / 2`` are the evidence for each class), and ``w``, ``b0``
        repeated for every class where the single logit broadcasts onto a residual head.
        """
        w, b0 = self.head.kernel[...].T, self.head.bias[...]  # [head_outputs, K], [head]
        c = self.config.num_classes
        if self.config.head_outputs == c:
            return w, b0
        if self.residual is not None:
            return jnp.tile(w, (c, 1)), jnp.tile(b0, c)
        return jnp.concatenate([-w / 2, w / 2]), jnp.concatenate([-b0 / 2, b0 / 2])

    def logits_from_embedding(self, embedding: jax.Array) -> jax.Array:
        """Class logits from ``e``: ``[B, D] -> [B, num_classes]`` (see module docstring)."""
        out = self.head(self.margins(embedding))  # [B, head_outputs]
        if self.residual is not None:
            return out + self.residual(embedding)  # a single concept logit broadcasts
        if self.config.head_outputs == 1:
            return jnp.concatenate([jnp.zeros_like(out), out], axis=-1)
        return out

    def __call__(self, x: jax.Array) -> jax.Array:
        """Class logits of images: ``[B, H, W, 3] -> [B, num_classes]``."""
        return self.logits_from_embedding(self.embed(x))
