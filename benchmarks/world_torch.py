"""PyTorch twin of the built-in world pipeline, for benchmarks only.

``WorldTorch(world, models)(z[B, d]) -> logits[B, len(models), C]`` computes the same maths as
``world.latent_apply(models)`` (``cbcert.generators.concept_world`` renderer and
``g = g2 ∘ D ∘ E ∘ g1``,
then the ``cbcert.models.world_classifiers`` classifiers) with the same weights, written the way a
PyTorch user would: NCHW images, ``F.conv2d`` for the ``PatchConv`` layers (kernels HWIO → OIHW).
It mirrors ``world.render`` as of commit 95b2fb0; the benchmark's parity check catches drift.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cbcert.generators.concept_world import _NUISANCE_NAMED, VOCABULARY


def _tensor(value) -> torch.Tensor:
    return torch.from_numpy(np.array(value, dtype=np.float32))


def _colour(rgb) -> torch.Tensor:  # [1, 3, 1, 1]
    return torch.tensor(rgb, dtype=torch.float32).view(1, 3, 1, 1)


def _over(base, colour, alpha):
    """Alpha-composite ``colour`` over ``base`` (NCHW), as ``world._over``."""
    return base * (1.0 - alpha) + colour * alpha


class TorchGenerator(nn.Module):
    """``g(z) = g2(D(E(g1(z))))`` of ``cbcert.generators.concept_world``:
    ``z[B, d] -> x[B, 3, H, W]``."""

    def __init__(self, config, params: dict):
        super().__init__()
        self.config = config
        self.k = config.num_concepts
        for name in ("A", "M", "tex_freq", "tex_phase"):
            self.register_buffer(name, _tensor(params[name]))
        self.names = [n for n, _ in VOCABULARY[: self.k]]
        h = config.image_size
        grid = (torch.arange(h, dtype=torch.float32) + 0.5) / h
        yy, xx = torch.meshgrid(grid, grid, indexing="ij")
        self.register_buffer("X", xx.view(1, 1, h, h))
        self.register_buffer("Y", yy.view(1, 1, h, h))

    def g1(self, z):
        t = z @ self.A.T
        v = torch.cat([torch.sin(self.config.frequency * t[:, : self.k]), t[:, self.k :]], -1)
        return v @ self.M.T

    def encode(self, w):
        v = w @ self.M
        gamma = self.config.logit_scale
        pairs = torch.stack([0.5 * gamma * v[:, : self.k], -0.5 * gamma * v[:, : self.k]], -1)
        return torch.cat([pairs.reshape(w.shape[0], 2 * self.k), v[:, self.k :]], -1)

    def decode(self, c):
        k2 = 2 * self.k
        s = (c[:, 0:k2:2] - c[:, 1:k2:2]) / self.config.logit_scale
        return torch.cat([s, c[:, k2:]], -1) @ self.M.T

    def g2(self, w):
        v = w @ self.M
        return self.render(torch.sigmoid(self.config.sharpness * v[:, : self.k]), v[:, self.k :])

    def forward(self, z):
        return self.g2(self.decode(self.encode(self.g1(z))))

    def render(self, a, u):  # noqa: PLR0915 - one straight-line renderer, as in world.render
        """``world.render`` in NCHW: ``a[B, K], u[B, U] -> [B, 3, H, W]``."""
        zeros = torch.zeros(a.shape[0], dtype=a.dtype)

        def on(name):  # [B, 1, 1, 1]
            s = a[:, self.names.index(name)] if name in self.names else zeros
            return s.view(-1, 1, 1, 1)

        def nz(i):
            return u[:, i].view(-1, 1, 1, 1)

        X, Y, h = self.X, self.Y, self.config.image_size
        edge = float(h) * 2.0
        cx, cy = 0.5 + 0.07 * torch.tanh(nz(0)), 0.5 + 0.07 * torch.tanh(nz(1))
        theta = 0.6 * nz(2)
        scale = 1.0 + 0.08 * torch.tanh(nz(3))
        hue = 0.08 * torch.tanh(nz(4))
        brightness = 0.06 * torch.tanh(nz(5))
        diamond_angle = 2.0 * nz(6)

        grey = 0.82 + (0.18 - 0.82) * on("dark_background") + brightness
        tint = on("tint") * _colour([0.14, -0.1, 0.16])
        waves = torch.cos(
            2 * math.pi * (X[0] * self.tex_freq[:, 0, None, None]
                           + Y[0] * self.tex_freq[:, 1, None, None])
            + self.tex_phase[:, None, None]
        )  # [T, H, W]
        texture = 0.035 * torch.einsum("bt,thw->bhw", torch.tanh(u[:, _NUISANCE_NAMED:]), waves)
        img = (grey + tint + texture[:, None]).expand(a.shape[0], 3, h, h)

        dots = torch.sigmoid(
            (torch.sin(2 * math.pi * 5 * X) * torch.sin(2 * math.pi * 5 * Y) - 0.75) * 12)
        img = _over(img, 1.0 - grey, on("dots") * dots)
        horizon = torch.sigmoid((0.035 - torch.abs(Y - 0.86)) * edge)
        img = _over(img, _colour([0.95, 0.9, 0.15]), on("horizon") * horizon)
        border = torch.minimum(torch.minimum(X, 1 - X), torch.minimum(Y, 1 - Y))
        frame = torch.sigmoid((0.07 - border) * edge)
        img = _over(img, _colour([0.85, 0.1, 0.85]), on("frame") * frame)
        corner = torch.sigmoid((0.16 - torch.maximum(X, Y)) * edge)
        img = _over(img, _colour([0.1, 0.85, 0.9]), on("corner_marker") * corner)

        radius = (0.2 + 0.1 * on("large")) * scale
        dx, dy = X - cx, Y - cy
        xr = torch.cos(theta) * dx + torch.sin(theta) * dy
        yr = -torch.sin(theta) * dx + torch.cos(theta) * dy
        stretch = 1.0 + 0.6 * on("elongated")
        p = xr / (radius * stretch)
        q = yr * stretch / radius
        rho = torch.sqrt(p * p + q * q + 1e-12)
        box = torch.logsumexp(12.0 * torch.stack([p, -p, q, -q]), 0) / 12.0 - math.log(2) / 12
        sdf = (rho - 1.0) + ((box - 1.0) - (rho - 1.0)) * on("square")
        px = radius * edge
        body = torch.sigmoid(-sdf * px)

        under = torch.sigmoid((0.12 - torch.abs(q - 1.35)) * px)
        under = under * torch.sigmoid((0.9 - torch.abs(p)) * px)
        img = _over(img, _colour([1.0, 0.55, 0.05]), on("underline") * under)

        red, blue = _colour([0.9, 0.15, 0.1]), _colour([0.12, 0.28, 0.92])
        colour = red + (blue - red) * on("blue") + hue * _colour([1.0, 0.5, -1.0])
        stripes = torch.sigmoid(4.0 * torch.sin(2 * math.pi * 1.25 * q))
        colour = colour * (1.0 - 0.8 * on("stripes") * stripes)
        hole = torch.sigmoid((0.55 - rho) * px)
        alpha = body * (1.0 - on("hole") * hole)
        img = _over(img, colour, alpha)
        cross = torch.maximum(torch.sigmoid((0.18 - torch.abs(p)) * px),
                              torch.sigmoid((0.18 - torch.abs(q)) * px))
        img = _over(img, _colour([1.0, 1.0, 1.0]), on("cross") * cross * alpha)
        outline = torch.sigmoid((0.16 - torch.abs(sdf)) * px)
        img = _over(img, _colour([0.0, 0.0, 0.0]), on("outline") * outline)

        dcx = 0.5 + 0.36 * torch.cos(diamond_angle)
        dcy = 0.5 + 0.36 * torch.sin(diamond_angle)
        diamond = torch.sigmoid((0.085 - torch.abs(X - dcx) - torch.abs(Y - dcy)) * edge)
        img = _over(img, _colour([0.1, 0.8, 0.2]), on("second_object") * diamond)
        return torch.clamp(img, 0.0, 1.0)


class Conv(nn.Module):
    """``PatchConv`` as ``F.conv2d``: kernel ``[kh, kw, I, O]`` (HWIO) → weight OIHW."""

    def __init__(self, params: dict, stride: int = 1, padding: int = 0):
        super().__init__()
        self.weight = nn.Parameter(_tensor(params["kernel"]).permute(3, 2, 0, 1).contiguous())
        self.bias = nn.Parameter(_tensor(params["bias"]))
        self.stride, self.padding = stride, padding

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class Linear(nn.Module):
    """``nnx.Linear``: ``x @ kernel[in, out] + bias``."""

    def __init__(self, params: dict):
        super().__init__()
        self.kernel = nn.Parameter(_tensor(params["kernel"]))
        self.bias = nn.Parameter(_tensor(params["bias"]))

    def forward(self, x):
        return x @ self.kernel + self.bias


class Block(nn.Module):
    """``BasicBlock``: ``relu(x' + alpha · conv2(relu(conv1(x))))`` (SkipInit scalar alpha)."""

    def __init__(self, params: dict, stride: int):
        super().__init__()
        self.conv1 = Conv(params["conv1"], stride, 1)
        self.conv2 = Conv(params["conv2"], 1, 1)
        self.alpha = nn.Parameter(_tensor(params["alpha"]))
        self.proj = Conv(params["proj"], stride, 0) if "proj" in params else None

    def forward(self, x):
        skip = x if self.proj is None else self.proj(x)
        return torch.relu(skip + self.alpha * self.conv2(torch.relu(self.conv1(x))))


class TorchClassifiers(nn.Module):
    """``WorldClassifiers.heads`` in NCHW: ``x[B, 3, H, W] -> logits[B, len(models), C]``."""

    def __init__(self, params: dict, models: tuple[str, ...]):
        super().__init__()
        unknown = set(models) - {"std", "cbm", "cbmh", "proto"}
        if unknown:
            raise ValueError(f"models={models!r}: unknown {sorted(unknown)}")
        self.models = models
        backbone = params["backbone"]
        self.stem = Conv(backbone["stem"], 1, 1)
        self.stage1 = Block(backbone["stage1"], 1)
        self.stage2 = Block(backbone["stage2"], 2)
        self.stage3 = Block(backbone["stage3"], 2)
        self.std_head = Linear(params["std_head"])
        pcbm = params["pcbm"]
        self.cav = nn.Parameter(_tensor(pcbm["cav"]))
        self.cav_bias = nn.Parameter(_tensor(pcbm["cav_bias"]))
        self.concept_head = Linear(pcbm["head"])
        self.residual = Linear(pcbm["residual"])
        proto = params["proto"]
        self.add1, self.add2 = Conv(proto["add1"]), Conv(proto["add2"])
        self.prototypes = nn.Parameter(_tensor(proto["prototypes"]))
        self.last = nn.Parameter(_tensor(proto["last"]))

    def proto_logits(self, t):
        f = torch.sigmoid(self.add2(torch.relu(self.add1(t))))  # [B, D, h, w]
        d2 = (
            (f * f).sum(1, keepdim=True)
            - 2.0 * torch.einsum("bdhw,pd->bphw", f, self.prototypes)
            + (self.prototypes * self.prototypes).sum(-1).view(1, -1, 1, 1)
        )
        d = torch.relu(d2).amin(dim=(2, 3))  # [B, P]
        return torch.log((d + 1.0) / (d + 1e-4)) @ self.last

    def forward(self, x):
        t = self.stage2(self.stage1(torch.relu(self.stem(2.0 * x - 1.0))))
        e = self.stage3(t).mean(dim=(2, 3))
        out = []
        for name in self.models:
            if name == "std":
                out.append(self.std_head(e))
            elif name == "proto":
                out.append(self.proto_logits(t))
            else:
                r = (e @ self.cav.T + self.cav_bias) / torch.linalg.norm(self.cav, dim=1)
                logits = self.concept_head(r)
                out.append(logits + self.residual(e) if name == "cbmh" else logits)
        return torch.stack(out, 1)


class WorldTorch(nn.Module):
    """``f_m(g(z))`` for each model m: ``z[B, d] -> logits[B, len(models), C]``."""

    def __init__(self, config, gen_params: dict, clf_params: dict, models: tuple[str, ...]):
        super().__init__()
        self.generator = TorchGenerator(config, gen_params)
        self.classifiers = TorchClassifiers(clf_params, models)

    def forward(self, z):
        return self.classifiers(self.generator(z))
