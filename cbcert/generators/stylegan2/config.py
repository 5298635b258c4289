"""StyleGAN2 architecture settings (`StyleGAN2Config`) and the constants of NVlabs' layout.

See `cbcert.generators.stylegan2.network` for the maths.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

NoiseMode = Literal["const", "random", "none"]
ARCHITECTURES = ("orig", "skip", "resnet")
LRELU_SLOPE = 0.2
LRELU_GAIN = math.sqrt(2.0)
KERNEL_SIZE = 3


@dataclasses.dataclass(frozen=True)
class StyleGAN2Config:
    """Static structure of a stylegan2-ada-pytorch generator.

    Attributes:
      z_dim: latent width d.
      w_dim: style width.
      img_resolution: output side (a power of two >= 4).
      img_channels: output channels (3 for RGB).
      channels: feature channels of the blocks at 4, 8, ..., img_resolution
        (NVlabs: ``min(channel_base // res, channel_max)``, see ``channels_from_base``).
      c_dim: conditioning label width (0: unconditional).
      mapping_layers: fully connected layers of the mapping network.
      mapping_features: width of the hidden mapping layers.
      embed_features: width of the label embedding (only used when ``c_dim > 0``).
      lr_multiplier: equalised-lr multiplier of the mapping layers (0.01 in StyleGAN2).
      conv_clamp: clamp of every conv and ToRGB output, or None.
      filter_size: side of the stored 2-D FIR up-sampling filter (4 for ``[1, 3, 3, 1]``).
      use_noise: whether the conv layers have noise inputs.
      has_w_avg: whether the mapping network tracks ``w_avg`` (needed for truncation).
      architecture: synthesis architecture, one of ``ARCHITECTURES`` (module docstring).
    """

    z_dim: int
    w_dim: int
    img_resolution: int
    img_channels: int
    channels: tuple[int, ...]
    c_dim: int = 0
    mapping_layers: int = 8
    mapping_features: int | None = None
    embed_features: int | None = None
    lr_multiplier: float = 0.01
    conv_clamp: float | None = None
    filter_size: int = 4
    use_noise: bool = True
    has_w_avg: bool = True
    architecture: str = "skip"

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}; allowed: "
                             f"{', '.join(map(repr, ARCHITECTURES))}")
        res = self.img_resolution
        if res < 4 or res & (res - 1):
            raise ValueError(f"img_resolution={res}; must be a power of two >= 4")
        if len(self.channels) != len(self.block_resolutions) or min(self.channels) < 1:
            raise ValueError(f"channels={self.channels}; need {len(self.block_resolutions)} "
                             f"positive widths (one per block resolution {self.block_resolutions})")
        for name in ("z_dim", "w_dim", "img_channels", "mapping_layers", "filter_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; must be >= 1")
        if self.c_dim < 0:
            raise ValueError(f"c_dim={self.c_dim}; must be >= 0")

    @property
    def block_resolutions(self) -> tuple[int, ...]:
        """4, 8, ..., img_resolution."""
        return tuple(2**i for i in range(2, int(math.log2(self.img_resolution)) + 1))

    @property
    def num_ws(self) -> int:
        """Per-layer styles: 2 per block (1 in the 4×4 block) plus the last ToRGB."""
        return 2 * len(self.block_resolutions)

    @property
    def hidden_features(self) -> int:
        return self.w_dim if self.mapping_features is None else self.mapping_features

    @property
    def embed_width(self) -> int:
        if self.c_dim == 0:
            return 0
        return self.w_dim if self.embed_features is None else self.embed_features


def channels_from_base(channel_base: int, channel_max: int, img_resolution: int
                       ) -> tuple[int, ...]:
    """NVlabs' widths ``min(channel_base // res, channel_max)`` for res = 4 ... img_resolution."""
    log2 = int(math.log2(img_resolution))
    return tuple(min(channel_base // 2**i, channel_max) for i in range(2, log2 + 1))


# ----------------------------------------------------------------------------- pure ops
