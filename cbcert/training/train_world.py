"""Train the built-in world's classifiers reproducibly from one seed (``certify train world``).

Phases, all with optax on freshly generated data (the world is an infinite data source):

0. backbone pre-training on a generic pretext task: regress every attribute of the 16-concept
   vocabulary to ±1 (squared loss) from images of the 16-concept variant of the world —
   the analogue of the ImageNet pre-training of the paper's backbones; it makes the 10-way
   task learnable in minutes on a CPU;
1. ``f_std``: the pre-trained backbone, frozen, and a linear head trained with cross-entropy
   on class labels only (a linear probe, the "original model" of PCBM's CLIP experiments;
   fine-tuning the backbone on class labels eroded its concept code and lowered accuracy);
2. PCBM concept bank: one CAV per concept by L2-regularised logistic regression on the frozen
   backbone's embeddings (Yuksekgonul et al. learn CAVs with a linear SVM; logistic regression
   gives the same kind of separating hyperplane and is differentiable end to end);
3. PCBM head: elastic-net regularised multinomial regression on concept scores ``r``
   (PCBM's sparse head), then PCBM-h's residual linear head on ``e`` with the concept head frozen;
4. prototype head: add-on layers, prototypes and readout on the frozen truncated backbone with
   ProtoPNet's loss ``CE + 0.8·cluster − 0.08·separation``, then a prototype push onto the
   nearest training patch of the prototype's class, then readout fine-tuning with an L1 penalty
   on connections to other classes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from cbcert.engine import compiler
from cbcert.generators.concept_world import ConceptWorld, make_world
from cbcert.io.registry import save_module
from cbcert.models.world_classifiers import NetConfig, WorldClassifiers


@dataclass(frozen=True)
class TrainConfig:
    """Training schedule (defaults train the shipped weights in ~10 min on 2 CPU cores)."""

    seed: int = 0
    batch: int = 128
    pretrain_steps: int = 2000
    backbone_lr: float = 2e-3
    std_steps: int = 1500
    embed_samples: int = 16384
    cav_steps: int = 600
    head_steps: int = 1500
    head_l1: float = 1e-3
    proto_steps: int = 400
    push_samples: int = 4096
    last_layer_steps: int = 300
    eval_samples: int = 4000

    @classmethod
    def quick(cls, seed: int) -> TrainConfig:
        """A few steps of every phase: exercises the whole pipeline in about a minute."""
        return cls(seed=seed, pretrain_steps=10, std_steps=20, embed_samples=1024,
                   cav_steps=20, head_steps=20, proto_steps=10, push_samples=512,
                   last_layer_steps=10, eval_samples=1000)


def split_model(model: WorldClassifiers):
    """``(graphdef, state, params)``: params is the module's state as a plain nested dict."""
    graphdef, state = nnx.split(model)
    return graphdef, state, nnx.to_pure_dict(state)


def merge(graphdef, state, params: dict) -> WorldClassifiers:
    """Rebuild the module from its graphdef and a plain params dict (inside or outside jit)."""
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def _data(world: ConceptWorld, key: jax.Array, n: int):
    """``n`` generated samples: ``(z[n, d], x[n, H, W, 3], concepts[n, K], labels[n])``."""
    g = world.generator
    z = world.sample_latents(key, n)
    return z, g.image(g.params, z), world.concepts_of(g.params, z), world.label_of(g.params, z)


def _fit(loss_fn: Callable, params, steps: int, lr: float, key: jax.Array, log, name: str):
    """Adam with cosine decay on ``loss_fn(params, key) -> (loss, aux)``; returns params."""
    opt = optax.adam(optax.cosine_decay_schedule(lr, steps, alpha=0.05))
    opt_state = opt.init(params)

    @compiler.jit
    def step(params, opt_state, key):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    start = time.time()
    for i in range(steps):
        params, opt_state, loss, aux = step(params, opt_state, jax.random.fold_in(key, i))
        if (i + 1) % max(1, steps // 5) == 0 or i + 1 == steps:
            log(f"  {name} step {i + 1}/{steps}: loss {float(loss):.4f} acc {float(aux):.3f}"
                f" ({time.time() - start:.0f}s)")
    return params


def _batched(fn: Callable, x: jax.Array, batch: int = 512):
    return jnp.concatenate([fn(x[i : i + batch]) for i in range(0, x.shape[0], batch)])


# World fields the pretext task reads (phase 0 renders a 16-concept world with them; class
# structure and the classifier's K play no part in it).
PRETEXT_WORLD_FIELDS = ("latent_dim", "image_size", "frequency", "sharpness", "logit_scale",
                        "structure_seed")
# Training settings phase 0 reads.
PRETEXT_TRAIN_FIELDS = ("seed", "batch", "pretrain_steps", "backbone_lr")


def pretext_backbone(directory: str | Path, world_config, config: TrainConfig,
                     label: str | None = None) -> tuple[dict, dict]:
    """The backbone of a trained world-classifiers checkpoint, for a world trained on the same
    pretext task: phase 0 of `train` then need not run again.

    Phase 0 pre-trains the backbone on the 16 attributes of a pretext world that depends only
    on `PRETEXT_WORLD_FIELDS`, from an initialisation and batches that depend only on
    `PRETEXT_TRAIN_FIELDS`; the later phases freeze it. So every variant preset trained with
    the same settings gets the same backbone (as the method's variants share one ImageNet
    backbone), and this checks exactly those fields before lending it.

    Returns:
      ``(backbone params, source)``; ``source`` (``from``: ``label`` or the directory, and the
      checkpoint's params sha256) goes into the new checkpoint's metrics.
    Raises:
      ValueError (``CheckpointError``): not a world-classifiers checkpoint, or trained on
        another pretext (the differing field named).
    """
    from cbcert.io.checkpoint import CheckpointError
    from cbcert.io.registry import load_module

    module, manifest = load_module(directory)
    if manifest.get("kind") != "world-classifiers":
        raise CheckpointError(f"{directory}: kind={manifest.get('kind')!r}, not "
                              "'world-classifiers'")
    theirs = {**manifest.get("world_config", {}),
              **{f"train.{k}": v for k, v in
                 manifest.get("metrics", {}).get("train_config", {}).items()}}
    mine = {**asdict(world_config), **{f"train.{k}": v for k, v in asdict(config).items()}}
    fields = [*PRETEXT_WORLD_FIELDS, *(f"train.{k}" for k in PRETEXT_TRAIN_FIELDS)]
    for key in fields:
        if theirs.get(key) != mine[key]:
            raise CheckpointError(f"{directory}: its backbone was pre-trained with {key}="
                                  f"{theirs.get(key)!r}, this run needs {mine[key]!r}; "
                                  "train without a borrowed backbone")
    if tuple(module.config.widths) != NetConfig().widths:
        raise CheckpointError(f"{directory}: backbone widths {module.config.widths} differ")
    backbone = nnx.to_pure_dict(nnx.state(module))["backbone"]
    return backbone, {"from": label or str(Path(directory).absolute()),
                      "params_sha256": manifest.get("params_sha256")}


def _pretrain(world: ConceptWorld, config: TrainConfig, graphdef, state, params, root, log):
    """Phase 0: the backbone regresses the 16 attributes of the pretext world (±1 targets)."""
    wc = world.config
    log("phase 0/4: backbone pre-training on the 16-attribute pretext task")
    pretext = make_world(replace(wc, num_concepts=16, extra_similar=0, extra_dissimilar=0,
                                 label_concepts=0, structure_seed=wc.structure_seed + 1000))
    embed_dim = NetConfig(num_classes=wc.num_classes, num_concepts=wc.num_concepts).embed_dim
    pretext_head = nnx.Linear(embed_dim, 16, rngs=nnx.Rngs(config.seed))
    head_params = nnx.to_pure_dict(nnx.split(pretext_head)[1])

    def pretext_loss(trainable, key):
        _, x, c, _ = _data(pretext, key, config.batch)
        m = merge(graphdef, state, {**params, "backbone": trainable["backbone"]})
        e = m.embed(x)
        out = e @ trainable["head"]["kernel"] + trainable["head"]["bias"]
        # Regress ±1 (not a logistic loss): the embedding then codes each attribute with a
        # near-constant magnitude, so linear heads (f_std's, PCBM's) can weigh them equally.
        loss = jnp.mean((out - (2.0 * c - 1.0)) ** 2)
        return loss, jnp.mean((out > 0) == c)

    trained = _fit(pretext_loss, {"backbone": params["backbone"], "head": head_params},
                   config.pretrain_steps, config.backbone_lr, jax.random.fold_in(root, 10), log,
                   "pretext")
    return {**params, "backbone": trained["backbone"]}


def train(world: ConceptWorld, config: TrainConfig, log: Callable[[str], None] = print,
          backbone: tuple[dict, dict] | None = None):
    """Train all world classifiers. Returns ``(net_config, graphdef, state, params, metrics)``.

    ``backbone``: `pretext_backbone`'s ``(params, source)`` to skip phase 0 (the pretext
    pre-training); ``metrics["backbone_from"]`` then names the source.
    """
    wc = world.config
    net_config = NetConfig(num_classes=wc.num_classes, num_concepts=wc.num_concepts)
    root = jax.random.key(config.seed)
    model = WorldClassifiers(net_config, rngs=nnx.Rngs(jax.random.fold_in(root, 0)))
    graphdef, state, params = split_model(model)

    def batch_data(key):
        _, x, c, y = _data(world, key, config.batch)
        return x, c, y

    # 0. pretext pre-training: all 16 vocabulary attributes, read off a 16-concept world.
    if backbone is not None:
        log(f"phase 0/4: backbone from {backbone[1]['from']} (same pretext task)")
        params = {**params, "backbone": backbone[0]}
    else:
        params = _pretrain(world, config, graphdef, state, params, root, log)

    # 1-2. embeddings of a fixed training set under the frozen backbone; f_std's linear head.
    _, x_emb, c_emb, y_emb = _data(world, jax.random.fold_in(root, 2), config.embed_samples)
    embed = compiler.jit(lambda x: merge(graphdef, state, params).embed(x))
    e = _batched(embed, x_emb)  # [N, E]
    e_mean, e_std = jnp.mean(e), jnp.std(e)

    log("phase 1/4: standard classifier (linear head on class labels, frozen backbone)")

    def std_loss(head, _key):
        logits = e @ head["kernel"] + head["bias"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_emb).mean()
        return loss, jnp.mean(jnp.argmax(logits, -1) == y_emb)

    std_head = _fit(std_loss, params["std_head"], config.std_steps, 0.02,
                    jax.random.fold_in(root, 1), log, "std")
    params = {**params, "std_head": std_head}

    # 2. CAVs on the same frozen embeddings.
    log("phase 2/4: PCBM concept bank (CAVs)")

    def cav_loss(cav, _key):
        logits = ((e - e_mean) / e_std) @ cav["w"].T + cav["b"]  # [N, K]
        loss = optax.sigmoid_binary_cross_entropy(logits, c_emb.astype(jnp.float32)).mean()
        loss = loss + 1e-4 * jnp.sum(cav["w"] ** 2)
        return loss, jnp.mean((logits > 0) == c_emb)

    k, dim = wc.num_concepts, net_config.embed_dim
    cav = _fit(cav_loss, {"w": jnp.zeros((k, dim)), "b": jnp.zeros((k,))}, config.cav_steps,
               0.05, jax.random.fold_in(root, 3), log, "cav")
    # Undo the standardisation so that r = (V e + b)/‖V‖ acts on raw embeddings.
    v = cav["w"] / e_std
    b = cav["b"] - e_mean * jnp.sum(v, axis=1)
    pcbm = {**params["pcbm"], "cav": v, "cav_bias": b}
    r = (e @ v.T + b) / jnp.linalg.norm(v, axis=1)

    # 3. sparse concept head, then PCBM-h residual.
    log("phase 3/4: PCBM head and PCBM-h residual")

    def head_loss(head, _key):
        logits = r @ head["kernel"] + head["bias"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_emb).mean()
        w = head["kernel"]
        loss = loss + config.head_l1 * (0.99 * jnp.abs(w).sum() + 0.01 * (w**2).sum())
        return loss, jnp.mean(jnp.argmax(logits, -1) == y_emb)

    head = _fit(head_loss, pcbm["head"], config.head_steps, 0.02, jax.random.fold_in(root, 4),
                log, "pcbm-head")
    pcbm = {**pcbm, "head": head}
    head_logits = r @ head["kernel"] + head["bias"]

    def residual_loss(res, _key):
        logits = head_logits + e @ res["kernel"] + res["bias"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_emb).mean()
        return loss + 1e-4 * jnp.sum(res["kernel"] ** 2), jnp.mean(jnp.argmax(logits, -1) == y_emb)

    residual = _fit(residual_loss, pcbm["residual"], config.head_steps // 2, 0.01,
                    jax.random.fold_in(root, 5), log, "pcbm-h")
    params = {**params, "pcbm": {**pcbm, "residual": residual}}

    # 4. prototype head on the frozen trunk.
    log("phase 4/4: prototype network")
    frozen = params
    identity = params["proto"]["class_identity"]  # [P, C]

    def proto_loss(proto, key):
        x, _, y = batch_data(key)
        m = merge(graphdef, state, {**frozen, "proto": proto})
        t = jax.lax.stop_gradient(m.backbone.trunk(x))
        logits, d = m.proto(t)
        own = identity[:, y].T  # [B, P]
        cluster = jnp.min(jnp.where(own > 0, d, jnp.inf), axis=1).mean()
        separation = jnp.min(jnp.where(own > 0, jnp.inf, d), axis=1).mean()
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.8 * cluster - 0.08 * separation, jnp.mean(jnp.argmax(logits, -1) == y)

    proto = _fit(proto_loss, params["proto"], config.proto_steps, 3e-3,
                 jax.random.fold_in(root, 6), log, "proto")
    proto = _push(world, graphdef, state, {**params, "proto": proto}, config,
                  jax.random.fold_in(root, 7))
    log("  pushed prototypes onto nearest training patches of their class")

    def last_loss(last, key):
        x, _, y = batch_data(key)
        m = merge(graphdef, state, {**frozen, "proto": {**proto, "last": last}})
        logits, _ = m.proto(jax.lax.stop_gradient(m.backbone.trunk(x)))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        l1 = jnp.abs(last * (1.0 - identity)).sum()
        return ce + 1e-4 * l1, jnp.mean(jnp.argmax(logits, -1) == y)

    last = _fit(last_loss, proto["last"], config.last_layer_steps, 3e-3,
                jax.random.fold_in(root, 8), log, "proto-last")
    params = {**params, "proto": {**proto, "last": last}}

    metrics = evaluate(world, graphdef, state, params, jax.random.fold_in(root, 9),
                       config.eval_samples)
    metrics["train_config"] = asdict(config)
    if backbone is not None:
        metrics["backbone_from"] = backbone[1]
    return net_config, graphdef, state, params, metrics


def _push(world, graphdef, state, params, config: TrainConfig, key):
    """Replace each prototype by the nearest add-on feature vector of an image of its class."""
    _, x, _, y = _data(world, key, config.push_samples)
    m = merge(graphdef, state, params)
    proto = params["proto"]

    @compiler.jit
    def features(x):
        mm = merge(graphdef, state, params)
        t = mm.backbone.trunk(x)
        return jax.nn.sigmoid(mm.proto.add2(jax.nn.relu(mm.proto.add1(t))))

    f = _batched(features, x)  # [N, h, w, D]
    f = f.reshape(f.shape[0], -1, f.shape[-1])  # [N, hw, D]
    protos = np.asarray(proto["prototypes"])
    owner = np.asarray(jnp.argmax(proto["class_identity"], axis=1))
    y = np.asarray(y)
    new = protos.copy()
    for j in range(protos.shape[0]):
        own = f[y == owner[j]]  # [n_j, hw, D]
        if own.shape[0] == 0:
            continue
        d = jnp.sum((own - protos[j]) ** 2, axis=-1).reshape(-1)
        new[j] = np.asarray(own.reshape(-1, own.shape[-1])[int(jnp.argmin(d))])
    del m
    return {**proto, "prototypes": jnp.asarray(new)}


def evaluate(world: ConceptWorld, graphdef, state, params, key, n: int) -> dict:
    """Clean accuracy of every head and PCBM concept accuracy on ``n`` held-out samples."""
    from cbcert.models.world_classifiers import HEADS

    _, x, c, y = _data(world, key, n)

    @compiler.jit
    def run(x):
        m = merge(graphdef, state, params)
        return m.heads(x, HEADS), m.concept_scores(x)

    logits, r = [], []
    for i in range(0, n, 500):
        lg, sc = run(x[i : i + 500])
        logits.append(lg)
        r.append(sc)
    logits, r = jnp.concatenate(logits), jnp.concatenate(r)
    acc = {h: float(jnp.mean(jnp.argmax(logits[:, i], -1) == y)) for i, h in enumerate(HEADS)}
    per_concept = np.asarray(jnp.mean((r > 0) == c, axis=0))
    return {
        "eval_samples": n,
        "accuracy": acc,
        "concept_accuracy": float(per_concept.mean()),
        "concept_accuracy_per_concept": dict(
            zip(world.generator.concept_names, map(float, per_concept), strict=True)
        ),
        "agreement_std_cbm": float(jnp.mean(jnp.argmax(logits[:, 0], -1)
                                            == jnp.argmax(logits[:, 1], -1))),
        "class_frequencies": np.bincount(np.asarray(y), minlength=world.num_classes).tolist(),
    }


def save_trained(directory, world_config, result) -> Path:
    """Write trained classifiers as a checkpoint of kind ``"world-classifiers"`` (``cbcert.io``).

    The manifest's ``config`` is the ``NetConfig``; ``world_config`` (what ``load_builtin``
    checks against its preset) and ``metrics`` (with ``train_config``) are stored beside it.
    An existing ``directory`` is replaced. Returns its absolute path.
    """
    _net_config, graphdef, state, params, metrics = result
    save_module(directory, "world-classifiers", merge(graphdef, state, params),
                {"world_config": world_config.identity(), "metrics": metrics}, replace=True)
    return Path(directory).absolute()
