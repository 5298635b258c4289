"""The embedded default world: the procedural generator plus the shipped trained classifiers.

Shipped weights live in ``cbcert/worlds/weights/<preset>/``, a checkpoint of kind
``"world-classifiers"`` in cbcert's one format (``cbcert.io.checkpoint``: orbax params and a
manifest of sha256 hashes, checked at load time, plus the world config they were trained for
and their metrics). ``certify train world`` re-creates them from a seed, writing into the
user's data directory (`user_dir`), never into the installed package; `weights_path` prefers a
preset's weights there over the shipped ones, so every runner loads what the user trained.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbcert.generators.concept_world import ConceptWorld, ConceptWorldConfig, make_world
from cbcert.io import checkpoint
from cbcert.models.world_classifiers import HEADS, NetConfig, WorldClassifiers
from cbcert.schema import shorten
from cbcert.worlds.editors import EditorDefects, imperfect_editor
from cbcert.worlds.world import ClassRule, World

WEIGHTS_DIR = Path(__file__).parent / "weights"  # shipped with the package, read only
KIND = "world-classifiers"
HOME_ENV = "CBCERT_HOME"


def user_dir() -> Path:
    """Where trained world weights go: ``$CBCERT_HOME/worlds`` if set, else
    ``$XDG_DATA_HOME/cbcert/worlds`` (``~/.local/share/cbcert/worlds`` by default)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / "worlds"
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data).expanduser() / "cbcert" / "worlds"


def user_path(preset: str) -> Path:
    """Directory ``certify train world --preset preset`` writes by default."""
    return user_dir() / preset


def shipped_path(preset: str) -> Path:
    """Directory of the weights shipped in the package for ``preset`` (may not exist)."""
    return WEIGHTS_DIR / preset


def weights_path(preset: str) -> Path:
    """The weights a runner loads for ``preset``: the user's (`user_path`) if they have been
    trained, else the shipped ones (`shipped_path`)."""
    user = user_path(preset)
    return user if (user / checkpoint.MANIFEST).is_file() else shipped_path(preset)


def net_config_for(config: ConceptWorldConfig) -> NetConfig:
    """Classifier architecture for a world configuration."""
    return NetConfig(num_classes=config.num_classes, num_concepts=config.num_concepts)


def abstract_classifiers(net_config: NetConfig):
    """``(graphdef, state)`` of the classifiers without allocating weights."""
    model = nnx.eval_shape(lambda: WorldClassifiers(net_config, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def classifier_functions(graphdef, state):
    """Pure ``classify(params, x, names)`` and ``concept_scores(params, x)`` for the engine."""
    module = _module_of(graphdef, state)

    def classify(params, x, names):
        return module(params).heads(x, tuple(names))

    def concept_scores(params, x):
        return module(params).concept_scores(x)

    return classify, concept_scores


def embedding_function(graphdef, state):
    """Pure ``embed(params, x[B, H, W, 3]) -> e[B, E]``: the shared backbone's pooled embedding
    (the standard classifier's penultimate features)."""
    module = _module_of(graphdef, state)
    return lambda params, x: module(params).embed(x)


def concept_head_function(graphdef, state):
    """Pure ``concept_head(params) -> (W[C, K], b[C])``: the PCBM's linear head on the concept
    scores r (``cbm`` logits ``= r Wᵀ + b``; PCBM-h adds its residual on e)."""
    module = _module_of(graphdef, state)

    def concept_head(params):
        head = module(params).pcbm.head
        return head.kernel[...].T, head.bias[...]

    return concept_head


def prototype_functions(graphdef, state):
    """Pure ``prototypes(params, x[B, H, W, 3]) -> s[B, P]`` (the proto head's log
    similarities) and ``prototype_head(params) -> (W[C, P], owner[P])`` (``proto`` logits
    ``= s Wᵀ``; owner: the class each prototype was made for)."""
    module = _module_of(graphdef, state)

    def prototypes(params, x):
        return module(params).prototype_similarities(x)

    def prototype_head(params):
        proto = module(params).proto
        return proto.last[...].T, jnp.argmax(proto.class_identity[...], axis=1)

    return prototypes, prototype_head


def _module_of(graphdef, state):
    def module(params) -> WorldClassifiers:
        s = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(s, params)
        return nnx.merge(graphdef, s)

    return module


# Worlds that are a preset with another concept editor (`cbcert.worlds.editors`): same
# generator, classifiers and weights; counterfactual edits fail or leak as designed.
EDITOR_VARIANTS = {"imperfect-editor": ("default", EditorDefects(fail=0.2, leak=0.1))}


def load_builtin(preset: str = "default", weights: str | Path | None = None) -> World:
    """Load a built-in world preset with its trained classifiers.

    ``imperfect-editor`` (`EDITOR_VARIANTS`) is ``default`` whose counterfactual editor fails
    per target concept with probability 0.2 and otherwise leaks to the concept's partner with
    probability 0.1 (`cbcert.worlds.editors.imperfect_editor`; ``metadata["editor"]``).

    Args:
      preset: world preset (``ConceptWorldConfig.from_preset``) or editor variant.
      weights: checkpoint directory; default `weights_path` (the user's trained weights for
        ``preset`` if any, else the shipped ones).
    Raises:
      ValueError (``CheckpointError``) if the weights are missing, corrupted or do not match.
    """
    if preset in EDITOR_VARIANTS:
        base, defects = EDITOR_VARIANTS[preset]
        world = load_builtin(base, weights)
        return dataclasses.replace(
            world, name=f"builtin:{preset}",
            editor=imperfect_editor(world.generator.num_concepts, defects),
            metadata={**world.metadata, "editor": dataclasses.asdict(defects)})
    try:
        config = ConceptWorldConfig.from_preset(preset)
    except ValueError as err:
        raise ValueError(f"{err}; editor variants: {', '.join(EDITOR_VARIANTS)}") from None
    path = Path(weights) if weights is not None else weights_path(preset)
    if not (path / checkpoint.MANIFEST).is_file():
        where = path if weights is not None else f"{user_path(preset)} or {shipped_path(preset)}"
        raise checkpoint.CheckpointError(
            f"no trained weights for world preset {preset!r} at {where}; "
            f"train them with `certify train world` (preset {preset!r})"
        )
    manifest = checkpoint.read_manifest(path)
    if manifest.get("kind") != KIND:
        raise checkpoint.CheckpointError(
            f"{path}: kind={shorten(repr(manifest.get('kind')), 80)}, not {KIND!r}; "
            f"train world weights with `certify train world` (preset {preset!r})"
        )
    trained_for = manifest.get("world_config")
    if trained_for != _config_dict(config):
        raise checkpoint.CheckpointError(
            f"{path}: weights were trained for world {shorten(repr(trained_for))}, "
            f"not for preset {preset!r}"
        )
    graphdef, state = abstract_classifiers(net_config_for(config))
    params, manifest = checkpoint.load(path, nnx.to_pure_dict(state), manifest)
    return _assemble(f"builtin:{preset}", make_world(config), graphdef, state, params,
                     {"weights": str(path), "metrics": manifest.get("metrics", {})})


def untrained_world(preset: str = "default", seed: int = 0) -> World:
    """A built-in world with randomly initialised classifiers (for tests and benchmarks).

    Same generator and architectures as ``load_builtin`` but no checkpoint: predictions are
    meaningless, shapes, determinism and speed are not. The standard head is standardised on
    256 generated images (zero-mean, unit-variance logits: a raw random head predicts one class
    almost everywhere), and the PCBM is set to reproduce it exactly (CAV k = column k of the
    standard head, concept head = diag(‖V_k‖)), so std and cbm agree on the whole pool. With
    more classes than concepts (C > K) the standard head is first cut to its best rank-K part
    and the PCBM reproduces that from its SVD (CAV k = s_k u_k, head row k = s_k v_kᵀ).
    """
    config = ConceptWorldConfig.from_preset(preset)
    model = WorldClassifiers(net_config_for(config), rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    c = config.num_classes
    world = make_world(config)
    gen = world.generator
    z = world.sample_latents(jax.random.key(seed), 256)
    e = model.embed(gen.image(gen.params, z))  # [256, E]
    logits = e @ params["std_head"]["kernel"] + params["std_head"]["bias"]
    scale = 1.0 / jnp.std(logits, axis=0)
    kernel = params["std_head"]["kernel"] * scale
    bias = (params["std_head"]["bias"] - jnp.mean(logits, axis=0)) * scale
    k = config.num_concepts
    if c > k:  # more classes than concepts: a rank-K standard head, which a PCBM can express
        u, sv, vt = jnp.linalg.svd(kernel, full_matrices=False)  # [E, C], [C], [C, C]
        kernel = (u[:, :k] * sv[:k]) @ vt[:k]
    params["std_head"] = {"kernel": kernel, "bias": bias}  # [E, C], [C]
    if c <= k:
        cav = params["pcbm"]["cav"].at[:c].set(kernel.T)
        cav_bias = params["pcbm"]["cav_bias"].at[:c].set(bias)
        head = jnp.zeros_like(params["pcbm"]["head"]["kernel"]).at[:c].set(
            jnp.diag(jnp.linalg.norm(kernel, axis=0)))
        head_bias = jnp.zeros((c,))
    else:  # kernel = U_K S_K V_Kᵀ exactly: CAV k = s_k u_k, so score_k = u_kᵀ e
        cav = (u[:, :k] * sv[:k]).T  # [K, E]
        cav_bias = jnp.zeros((k,))
        head = sv[:k, None] * vt[:k]  # [K, C]
        head_bias = bias
    params["pcbm"] = {**params["pcbm"], "cav": cav, "cav_bias": cav_bias,
                      "head": {"kernel": head, "bias": head_bias}}
    return _assemble(f"untrained:{preset}", world, graphdef, state, params, {"weights": None})


def _assemble(name: str, world, graphdef, state, params, metadata: dict) -> World:
    """The ``World`` of a concept world and its classifiers' parameters."""
    classify, concept_scores = classifier_functions(graphdef, state)
    prototypes, prototype_head = prototype_functions(graphdef, state)
    return World(
        name=name,
        generator=world.generator,
        classify=classify,
        concept_scores=concept_scores,
        classifier_params=params,
        model_names=HEADS,
        class_names=world.class_names,
        true_label=world.label_of,
        metadata=metadata,
        embed=embedding_function(graphdef, state),
        concept_head=concept_head_function(graphdef, state),
        prototypes=prototypes,
        prototype_head=prototype_head,
        class_rule=class_rule(world),
        latent_prior=world.condition if world.conditional else None,
    )


def class_rule(world: ConceptWorld) -> ClassRule:
    """The concept world's class rule: ``label`` = nearest class pattern of the state (the
    ground truth of ``true_label``), ``defining[y] = patterns[y]`` on the ``Kc`` concepts the
    patterns cover (``patterns``: ``[C, Kc]``, Kc ≤ K), False on the rest."""
    patterns = np.asarray(world.params["patterns"], bool)  # [C, Kc]
    defining = np.zeros((len(patterns), world.config.num_concepts), bool)  # [C, K]
    defining[:, : patterns.shape[1]] = patterns
    return ClassRule(label=functools.partial(world.label_of_concepts, world.params),
                     defining=defining)


def _config_dict(config) -> dict:
    """The world identity checked against a checkpoint's ``world_config``."""
    return config.identity()
