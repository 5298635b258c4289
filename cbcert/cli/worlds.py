"""``certify world show``, ``certify train world``, ``certify train cbae``."""

from __future__ import annotations

from pathlib import Path

import click

from cbcert.cli import common
from cbcert.cli.progress import bar
from cbcert.schema import ConfigError

# `certify train cbae`: library keys (CBAETrainConfig's fields, the run's settings) whose flag
# is not ``--`` + the key.
CBAE_FLAGS = {"recon_lr": "--lr", "interv_lr": "--lr", "num_unsup": "--unsup",
              "concept_names": "--concepts", "generator": "--world"}


@click.group()
def world() -> None:
    """Look at the built-in concept world."""


@world.command("show")
@click.option("--n", "n", type=int, default=16, show_default=True, help="Samples in the grid.")
@click.option("--flip", type=int, default=None,
              help="Show each sample beside its counterfactual with this concept flipped.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("grid.png"),
              show_default=True)
@click.option("--world", "world_name", default="default", show_default=True,
              help="Built-in world preset (default, k8, k16, px64, similar5, …).")
@click.option("--seed", type=int, default=0, show_default=True)
def world_show(n: int, flip: int | None, out: Path, world_name: str, seed: int) -> None:
    """Render a grid of samples with their concept vectors and class names."""
    from cbcert.generators.concept_world import ConceptWorldConfig, make_world
    from cbcert.report.world_grid import check_image_path, world_grid

    common.check("count", n, "--n")
    common.check("seed", seed, "--seed")
    common.writable_file(out, "--out")
    try:
        check_image_path(out)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    try:
        w = make_world(ConceptWorldConfig.from_preset(world_name))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None
    k = w.generator.num_concepts
    if flip is not None and not 0 <= flip < k:
        raise click.BadParameter(f"got {flip}, allowed range [0, {k - 1}]", param_hint="--flip")
    world_grid(w, n=n, seed=seed, flip=flip, out=out)
    common.console.print(f"wrote {out}")


@world.command("classes")
@common.world_option()
@click.option("--samples", type=int, default=2000, show_default=True,
              help="Generated inputs embedded (their class counts are reported).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the pool.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/classes-<world>-seed<seed>).")
@common.memory_options
def world_classes(world_name: str, samples: int, seed: int, out: Path | None,
                  chunk_size: int | None, max_memory: int | None) -> None:
    """Class similarity: distances between class centroids in f_std's feature space.

    Writes class_distances.json (counts, the C×C matrix, mean off-diagonal distance, each
    class's nearest class), class_distances.csv and the heatmap class_distances.png.
    """
    import json

    from cbcert.report.figures import figure_class_distances
    from cbcert.runs.classes import class_distances
    from cbcert.schema import value_name

    common.check("samples", samples, "--samples")
    common.check("seed", seed, "--seed")
    common.check_memory(chunk_size, max_memory)
    slug = world_name.replace("/", "_").replace(":", "_").strip("._") or "world"
    out = common.writable_out(out or Path("results") / f"classes-{slug}-seed{value_name(seed)}")
    world_obj = common.load_world(world_name)
    with common.bad_input():
        result = class_distances(world_obj, samples=samples, seed=seed, chunk_size=chunk_size,
                                 max_memory=max_memory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "class_distances.json").write_text(json.dumps(result, indent=2) + "\n")
    names = result["class_names"]
    rows = [",".join(["class", *names])]
    rows += [",".join([name, *("" if v is None else repr(v) for v in row)])
             for name, row in zip(names, result["distances"], strict=True)]
    (out / "class_distances.csv").write_text("\n".join(rows) + "\n")
    figure_class_distances(result, out / "class_distances.png")
    mean = result["mean_off_diagonal"]
    common.console.print(f"{result['world']}: mean distance between class centroids "
                         f"{'n/a (under two classes)' if mean is None else f'{mean:.4g}'} over "
                         f"{result['samples']} samples "
                         f"({result['labels']} labels); wrote {out}/class_distances.*")


@click.group()
def train() -> None:
    """Retrain shipped models."""


@train.command("world")
@click.option("--preset", default="default", show_default=True, help="World preset.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Checkpoint directory (default: <user data dir>/worlds/<preset>, i.e. "
                   "$CBCERT_HOME/worlds/<preset> or ~/.local/share/cbcert/worlds/<preset>; "
                   "runners load it instead of the shipped weights).")
@click.option("--quick", is_flag=True, help="A few steps of each phase (smoke test, not accurate).")
@click.option("--backbone-from", "backbone_from", default=None, metavar="PRESET|DIR",
              help="Skip the backbone's pretext pre-training (phase 0) and take the backbone of "
                   "this trained preset (its loaded weights) or world-classifiers checkpoint; "
                   "refused unless it was pre-trained with the same pretext settings, so the "
                   "backbone is the one phase 0 would train.")
def train_world(preset: str, seed: int, out: Path | None, quick: bool,
                backbone_from: str | None) -> None:
    """Train f_std, PCBM (+ PCBM-h) and the prototype net on a world, reproducibly from --seed.

    Example: certify train world --preset similar5 --backbone-from default
    """
    from cbcert.generators.concept_world import ConceptWorldConfig, make_world
    from cbcert.training.train_world import TrainConfig, pretext_backbone, save_trained, train
    from cbcert.worlds.builtin import user_path, weights_path

    common.check("seed", seed, "--seed")
    try:
        config = ConceptWorldConfig.from_preset(preset)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--preset") from None
    target = common.writable_out(out or user_path(preset))  # checked before minutes of training
    tc = TrainConfig(seed=seed)
    if quick:
        tc = TrainConfig.quick(seed)
    backbone = None
    if backbone_from is not None:
        source = Path(backbone_from)
        if not source.is_dir():
            try:
                ConceptWorldConfig.from_preset(backbone_from)
            except ValueError as err:
                raise click.BadParameter(f"{backbone_from!r} is neither a directory nor a "
                                         f"preset ({err})", param_hint="--backbone-from") from None
            source = weights_path(backbone_from)
        try:
            backbone = pretext_backbone(source, config, tc, label=backbone_from)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--backbone-from") from None
    world_obj = make_world(config)
    result = train(world_obj, tc, log=lambda s: common.err_console.print(s), backbone=backbone)
    path = save_trained(target, config, result)
    metrics = result[-1]
    common.console.print_json(data={"accuracy": metrics["accuracy"],
                             "concept_accuracy": metrics["concept_accuracy"]})
    common.console.print(f"wrote {path}")


def _concept_labeler(directory: Path, preprocess, num_concepts: int):
    """``x -> s[B, K]`` from a converted torchvision classifier with K sigmoid outputs."""
    from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, load_converted

    try:
        apply_fn, params, manifest = load_converted(directory)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--concept-classifier") from None
    if manifest["kind"] not in (*RESNET_NAMES, *DENSENET_NAMES):
        raise click.BadParameter(f"{directory} is kind={manifest['kind']!r}; need a converted "
                                 "torchvision resnet*/densenet* with one logit per concept",
                                 param_hint="--concept-classifier")
    outputs = manifest["config"].get("num_classes")
    if outputs != num_concepts:
        raise click.BadParameter(f"{directory} outputs {outputs} logits but --concepts names "
                                 f"{num_concepts}; they must be equal (one sigmoid logit per "
                                 "concept)", param_hint="--concepts")

    def labeler(x):
        return apply_fn(params, preprocess(x))

    return labeler, {"kind": manifest["kind"], "params_sha256": manifest["params_sha256"]}


@train.command("cbae")
@click.option("--world", "world_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="World directory with a biggan or stylegan2 generator and no cbae yet.")
@click.option("--concept-classifier", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Pseudo-labeler: a `certify convert`ed resnet*/densenet* whose K outputs are "
                   "per-concept logits (present iff > 0); fed the world's preprocessing.")
@click.option("--concepts", required=True, help="Comma-separated names of the K concepts, in "
              "the classifier's output order.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New directory for the CB-AE (an unfinished run there is resumed).")
@click.option("--steps", type=int, default=5000, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--lr", type=float, default=2e-4, show_default=True,
              help="Adam learning rate of both phases (betas 0.5, 0.99).")
@click.option("--threshold", type=float, default=0.9, show_default=True,
              help="Pseudo-label confidence below which a concept label is ignored.")
@click.option("--unsup", type=int, default=10, show_default=True,
              help="Unsupervised bottleneck dims after the 2K concept logits.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--save-every", type=int, default=500, show_default=True,
              help="Steps between progress checkpoints.")
@click.option("--eval-samples", type=int, default=512, show_default=True,
              help="Held-out latents for the final quality report.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_cbae_cmd(world_dir: Path, concept_classifier: Path, concepts: str, out: Path,
                   steps: int, batch_size: int, lr: float, threshold: float, unsup: int,
                   seed: int, save_every: int, eval_samples: int, quiet: bool) -> None:
    """Train a CB-AE for a BigGAN world (on its [t·z ; class embedding] latent) or a StyleGAN2
    world (on w+, as upstream's), with upstream's losses."""
    from cbcert.training.cbae import CBAETrainConfig
    from cbcert.training.cbae_run import run
    from cbcert.worlds.directory import build_generator, generator_identity
    from cbcert.worlds.manifest import read_manifest

    names = common.names(concepts)
    if not names or len(set(names)) != len(names):
        raise click.BadParameter(f"got {concepts!r}; need distinct, comma-separated names",
                                 param_hint="--concepts")
    for flag, value, low in (("--save-every", save_every, 1), ("--eval-samples", eval_samples, 1)):
        if value < low:
            raise click.BadParameter(f"got {value}, allowed range [{low}, ∞)", param_hint=flag)
    try:
        config = CBAETrainConfig(steps=steps, batch_size=batch_size, recon_lr=lr, interv_lr=lr,
                                 threshold=threshold, num_unsup=unsup, seed=seed)
    except ConfigError as err:
        raise click.BadParameter(str(err), param_hint=common.flag_of(err.key, CBAE_FLAGS)) \
            from None
    try:
        spec = read_manifest(world_dir)
        if spec.cbae is not None:
            raise ValueError(f"{world_dir} already has a CB-AE (cbae in world.json); train on "
                             "a world without one")
        identity = {"generator": generator_identity(spec)}
        generator = build_generator(spec)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None
    labeler, labeler_id = _concept_labeler(concept_classifier, spec.preprocess, len(names))
    identity["labeler"] = labeler_id
    identity["preprocess"] = {"size": spec.preprocess.size, "mean": spec.preprocess.mean,
                              "std": spec.preprocess.std}
    log = (lambda s: None) if quiet else (lambda s: common.err_console.print(s))
    try:
        with bar("train cbae", quiet, unit="steps") as update:
            def on_step(step, logs):
                if update is not None:
                    update(step, steps)

            manifest = run(generator, labeler, names, config, out, identity=identity,
                           save_every=save_every, eval_samples=eval_samples, log=log,
                           on_step=on_step)
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=common.flag_of(err.key, CBAE_FLAGS)) \
            from None
    except ValueError as err:  # e.g. damaged progress checkpoints in --out
        raise click.BadParameter(str(err), param_hint="--out") from None
    metrics = manifest["metrics"]
    common.console.print_json(
        data={k: v for k, v in metrics.items() if not k.endswith("per_concept")})
    common.console.print(f"wrote {out}; plug it into {world_dir / 'world.json'} as "
                         f'"cbae": {{"trained": "<path relative to the world>"}}')


COMMANDS = (world, train)
