"""A world: a generator plus the classifiers compared on it, as pure functions for the engine.

Every classifier family is evaluated through the same interface ``F_m(z) = f_m(g(z))``
(SPEC §2); the engine sees one ``apply_fn(params, x[B, *event]) -> logits[B, H, C]`` whose H
heads are the requested models evaluated on the *same* generated image.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.engine import compiler
from cbcert.engine.noise import restrict
from cbcert.generators.base import Generator
from cbcert.schema import ConfigError

Params = Any


@dataclass(frozen=True, eq=False)
class ClassRule:
    """The rule by which a world's concepts decide its class (its ground truth), for worlds
    that know it (the built-in concept worlds): what explanations are scored against.

    Attributes:
      label: ``(state bool[..., K]) -> int32[...]``, the class the rule gives a concept state
        ``C(c)`` (built-in worlds: the nearest class pattern in Hamming distance over the
        concepts the rule reads, `cbcert.generators.concept_world.label_of`).
      defining: ``bool[C, K]``; ``defining[y, i]``: concept i is read by the rule and on in
        class y's pattern (concepts the rule does not read: False in every row).
    """

    label: Callable[[jax.Array], jax.Array]
    defining: np.ndarray


@dataclass(frozen=True, eq=False)
class World:
    """Generator, classifiers and (optionally) ground truth of one world.

    Attributes:
      name: e.g. ``builtin:default``.
      generator: the ``g = g2 ∘ D ∘ E ∘ g1`` bundle.
      classify: ``(params, x[B, H, W, 3], names) -> logits[B, len(names), C]``; ``names`` static.
      concept_scores: ``(params, x[B, H, W, 3]) -> r[B, K]``, the CBM's concept scores (DFS).
      classifier_params: parameters of ``classify``/``concept_scores``.
      model_names: the models this world offers, e.g. ``("std", "cbm", "cbmh", "proto")``.
      class_names: ``C`` names.
      true_label: optional ``(gen_params, z[B, d]) -> int32[B]`` ground-truth classes.
      metadata: provenance (weights manifest, documented accuracies…); ``metadata["identity"]``,
        when present, is pinned in every run directory (``run.json``) with the name.
      embed: ``(params, x[B, H, W, 3]) -> e[B, D]``, the standard classifier's penultimate
        features (pooled embedding) of images: class centroids, class similarity; None if the
        world cannot give them.
      dataset: fixed inputs instead of generated ones (``cbcert.worlds.pixels.Dataset``:
        ``latents[N, d]``, ``labels[N]``): the pool is these inputs in order, each with its
        own label, and there is no agreement set; None for generated worlds.
      concept_head: ``(classifier_params) -> (W[C, K], b[C])``, the CBM's linear head on its
        concept scores r (``cbm`` logits ``= r Wᵀ + b``): the concept contributions
        ``r_i · W[y, i]`` of `cbcert.robustness.explain`; None where the world does not expose
        it (world directories, for now).
      prototypes: ``(classifier_params, x[B, H, W, 3]) -> s[B, P]``, the prototype network's
        (``proto``) max-pooled prototype similarities; None where not exposed.
      prototype_head: ``(classifier_params) -> (W[C, P], owner[P])``, the prototype network's
        class readout (``proto`` logits ``= s Wᵀ``) and the class each prototype belongs to:
        prototype contributions ``s_j · W[y, j]``; None where not exposed.
      class_rule: the `ClassRule` deciding the class from the concepts (known-answer scores
        and counterfactuals of explanations); None where the world does not know it (world
        directories, pixels).
      editor: the concept editor of counterfactual edits, ``(key, c[2K + U], targets bool[K])
        -> c'`` (`cbcert.worlds.editors`); None: the perfect editor (the targets' logit pairs
        swapped).
      concept_readout: ``(classifier_params, x[B, H, W, 3]) -> bool[B, K]``, a concept
        classifier reading the generator's K concepts off an image (edit verification on the
        edited image); None: verification reads the generator's own ``C(E(D(c')))``.
      latent_prior: ``(gen_params, z[B, d], keys[B]) -> z'[B, d]``, the world's prior of
        inputs as a transform of standard normal draws, input b drawing what else it needs
        from ``keys[b]`` (the saturated worlds' class-conditional prior,
        `cbcert.generators.concept_world.ConceptWorld.condition`); None: ``z ~ N(0, I)``. Only
        which inputs are drawn depends on it: noise, shifts and attacks act on z as anywhere.
    """

    name: str
    generator: Generator
    classify: Callable[[Params, jax.Array, tuple[str, ...]], jax.Array]
    concept_scores: Callable[[Params, jax.Array], jax.Array]
    classifier_params: Params
    model_names: tuple[str, ...]
    class_names: tuple[str, ...]
    true_label: Callable[[Params, jax.Array], jax.Array] | None = None
    metadata: dict | None = None
    dataset: Any = None
    embed: Callable[[Params, jax.Array], jax.Array] | None = None
    concept_head: Callable[[Params], tuple[jax.Array, jax.Array]] | None = None
    prototypes: Callable[[Params, jax.Array], jax.Array] | None = None
    prototype_head: Callable[[Params], tuple[jax.Array, jax.Array]] | None = None
    class_rule: ClassRule | None = None
    editor: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None
    concept_readout: Callable[[Params, jax.Array], jax.Array] | None = None
    latent_prior: Callable[[Params, jax.Array, jax.Array], jax.Array] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def params(self) -> dict:
        """Parameters of every ``apply`` function below: ``{"gen": …, "clf": …}``."""
        return {"gen": self.generator.params, "clf": self.classifier_params}

    def edit(self, keys: jax.Array, c: jax.Array, targets: jax.Array) -> jax.Array:
        """Counterfactual edits ``c'[B, 2K + U]`` of ``c[B, 2K + U]`` flipping ``targets
        bool[B, K]``, edit b drawing from ``keys[b]`` (the world's `editor`, mapped)."""
        from cbcert.worlds.editors import perfect_editor

        editor = self.editor or perfect_editor(self.generator.num_concepts)
        return jax.vmap(editor)(keys, c, jnp.asarray(targets, bool))

    def check_models(self, models: tuple[str, ...]) -> tuple[str, ...]:
        """Validate model names (`ConfigError`, key ``models``, naming the unknown and allowed)."""
        unknown = [m for m in models if m not in self.model_names]
        if unknown or not models:
            detail = (f"unknown model(s) {unknown or list(models)} "
                      f"(allowed: {', '.join(self.model_names)})")
            raise ConfigError(detail, key="models", value=models,
                              allowed=", ".join(self.model_names), detail=detail)
        return tuple(models)

    def latent_apply(self, models: tuple[str, ...]) -> Callable:
        """``apply(params, z[B, d]) -> logits[B, H, C]`` = ``f_m(g(z))`` for each model m.

        The same function object is returned for the same models, so jit caches keyed on it
        (the engine's) compile once per world and model set.
        """
        return _latent_apply(self, self.check_models(models))

    def concept_apply(self, models: tuple[str, ...]) -> Callable:
        """``apply(params, c[B, 2K+U]) -> logits[B, H, C]`` = ``f_m(g2(D(c)))`` for each model m."""
        return _concept_apply(self, self.check_models(models))

    def apply(self, space: str, models: tuple[str, ...]) -> Callable:
        """`latent_apply` (``space="latent"``) or `concept_apply` (``"concept"``)."""
        return self.latent_apply(models) if space == "latent" else self.concept_apply(models)

    def perturbed_size(self, space: str) -> int | None:
        """Coordinates of a ``space`` input that noise, shifts and attacks may move.

        ``d`` for latents of a multi-class conditional generator (its inputs ``[z ; k]`` carry
        the class position k after z, `cbcert.generators.base.Generator`), else None (all).
        """
        gen = self.generator
        return gen.latent_dim if space == "latent" and gen.classes else None

    def noise(self, noise, space: str):
        """The engine noise ``noise`` acting on ``space`` inputs of this world: restricted to
        z when they carry a class (`perturbed_size`, `cbcert.engine.noise.restrict`)."""
        return restrict(noise, self.perturbed_size(space))

    def latent_images(self, params, z: jax.Array) -> jax.Array:
        """``g(z)``: ``[B, d] -> [B, H, W, 3]``."""
        return self.generator.image(params["gen"], z)

    def encode_latents(self, params, z: jax.Array) -> jax.Array:
        """``c = E(g1(z))``: ``[B, d] -> [B, 2K + U]``."""
        return self.generator.concepts(params["gen"], z)


@functools.lru_cache(maxsize=32)
def _latent_apply(world: World, models: tuple[str, ...]) -> Callable:
    gen, classify = world.generator, world.classify

    def apply(params, z):
        return classify(params["clf"], gen.image(params["gen"], z), models)

    return apply


@functools.lru_cache(maxsize=32)
def _concept_apply(world: World, models: tuple[str, ...]) -> Callable:
    gen, classify = world.generator, world.classify

    def apply(params, c):
        return classify(params["clf"], gen.image_from_concepts(params["gen"], c), models)

    return apply


@functools.lru_cache(maxsize=32)
def clean_predictor(world: World, space: str, models: tuple[str, ...]) -> Callable:
    """Jitted ``(params, z[B, d]) -> labels[B, H]`` on the clean image of each latent.

    ``space="latent"``: the image ``g(z)``; ``space="concept"``: the autoencoded image
    ``g2(D(E(g1(z))))``, the clean reference of semantic perturbations (SPEC §1).
    """
    gen, classify = world.generator, world.classify

    @compiler.jit
    def predict(params, z):
        if space == "latent":
            x = gen.image(params["gen"], z)
        else:
            x = gen.image_from_concepts(params["gen"], gen.concepts(params["gen"], z))
        return jnp.argmax(classify(params["clf"], x, models), axis=-1)

    return predict
