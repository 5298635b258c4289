"""A StyleGAN2 (+ CB-AE) as cbcert's ``Generator``: ``g1`` the mapping network, ``E``/``D`` the
CB-AE, ``g2`` the synthesis network (SPEC §1)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx

from cbcert.generators.base import Generator, condition_labels, resolve_class_index
from cbcert.generators.cbae import CBAE
from cbcert.generators.stylegan2.network import StyleGAN2


def stylegan2_generator(model: StyleGAN2, cbae: CBAE | None = None,
                        truncation_psi: float = 1.0, truncation_cutoff: int | None = None,
                        name: str = "stylegan2",
                        class_index: int | Sequence[int] | None = None) -> Generator:
    """StyleGAN2 (+ optional CB-AE) as cbcert's ``Generator`` (``g = g2 ∘ D ∘ E ∘ g1``).

    * ``g1(z) = map(z, c, ψ, cutoff)`` flattened to ``w[B, num_ws · w_dim]``; for a
      conditional generator (``c_dim > 0``) ``c`` is the one-hot label of ``class_index``
      (required, in ``[0, c_dim)``; fixed for the whole world, as BigGAN's class) or, when
      ``class_index`` is a list, the generator's ``classes``: input ``[z ; k]`` renders
      ``class_index[k]`` (`Generator`); for an unconditional one there is no label and
      ``class_index`` must be None.
    * ``E``/``D``: the CB-AE's (``cbcert.generators.cbae.CBAE``); without one, K = 0 and
      ``E = D = identity`` (``U = num_ws · w_dim``).
    * ``g2(w) = clip((synthesize(w, noise_mode="const") + 1) / 2, 0, 1)`` as ``[B, H, W, C]``:
      the stored constant noise makes ``g2`` a deterministic function of ``w``.

    Raises:
      ValueError: a conditional generator without ``class_index`` or with one outside
        ``[0, c_dim)``, an unconditional one with a ``class_index``, or a CB-AE whose latent
        shape differs from the generator's.
    """
    config = model.config
    if config.c_dim and class_index is None:
        raise ValueError(f"class_index=None; this StyleGAN2 is conditional (c_dim="
                         f"{config.c_dim}): pick a class in 0..{config.c_dim - 1}")
    if not config.c_dim and class_index is not None:
        raise ValueError(f"class_index={class_index!r}; this StyleGAN2 is unconditional "
                         "(c_dim=0) and takes no class")
    classes = () if class_index is None else resolve_class_index(
        class_index, config.c_dim, f" (c_dim={config.c_dim})")
    if cbae is not None and (cbae.config.latent_dim, cbae.config.num_ws) != (config.w_dim,
                                                                             config.num_ws):
        raise ValueError(f"CB-AE latent (num_ws={cbae.config.num_ws}, latent_dim="
                         f"{cbae.config.latent_dim}) does not match the generator's (num_ws="
                         f"{config.num_ws}, w_dim={config.w_dim})")
    graphdef, params = nnx.split(model)
    cb_graphdef, cb_params = nnx.split(cbae) if cbae is not None else (None, None)
    labels = (None if class_index is None
              else condition_labels(classes, class_index, config.c_dim, config.z_dim))

    def g1(p, z):
        c = None if labels is None else labels(z)
        ws = nnx.merge(graphdef, p["stylegan2"]).map(z[:, :config.z_dim], c, truncation_psi,
                                                      truncation_cutoff)
        return ws.reshape(z.shape[0], -1)

    def g2(p, w):
        ws = w.reshape(w.shape[0], config.num_ws, config.w_dim)
        img = nnx.merge(graphdef, p["stylegan2"]).synthesize(ws, "const")
        return jnp.clip((img + 1) / 2, 0, 1)

    def encode(p, w):
        return w if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).encode(w)

    def decode(p, c):
        return c if cbae is None else nnx.merge(cb_graphdef, p["cbae"]).decode(c)

    return Generator(
        name=name, latent_dim=config.z_dim,
        concept_names=() if cbae is None else cbae.config.concept_names,
        num_unsup=config.num_ws * config.w_dim if cbae is None else cbae.config.num_unsup,
        image_shape=(config.img_resolution, config.img_resolution, config.img_channels),
        params={"stylegan2": params, "cbae": cb_params}, g1=g1, encode=encode, decode=decode,
        g2=g2, classes=classes, num_ws=config.num_ws)
