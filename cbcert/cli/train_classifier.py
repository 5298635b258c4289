"""``certify train classifier``: fine-tune a converted torchvision classifier on CUB or
RIVAL-10 in their published layouts (`cbcert.datasets`, `cbcert.training.classifier_run`)."""

from __future__ import annotations

from pathlib import Path

import click

from cbcert.cli import common
from cbcert.cli.progress import bar
from cbcert.cli.worlds import train
from cbcert.schema import ConfigError

DATASETS = ("cub", "rival10")


def dataset_split(spec: str, split: str):
    """The ``split`` of ``spec`` (``cub:ROOT`` or ``rival10:ROOT``), or exit 2 naming
    --dataset (a malformed spec, or a dataset file that is missing, short or inconsistent:
    the message names the file and line)."""
    from cbcert.datasets.common import DatasetError

    kind, _, root = spec.partition(":")
    if kind not in DATASETS or not root:
        raise click.BadParameter(f"got {spec!r}; expected cub:ROOT or rival10:ROOT",
                                 param_hint="--dataset")
    try:
        if kind == "cub":
            from cbcert.datasets.cub import load_cub

            return load_cub(Path(root), split)
        from cbcert.datasets.rival10 import load_rival10

        return load_rival10(Path(root), split)
    except DatasetError as err:
        raise click.BadParameter(str(err), param_hint="--dataset") from None


def attribute_columns(path: Path | None, names: tuple[str, ...], target: str) -> list[int]:
    """The attribute columns a labeler learns: every one, or those named in ``path`` (one name
    per line, in output order); exit 2 naming --attributes for an unknown or repeated name,
    or a file given with --target class."""
    if path is None:
        return list(range(len(names)))
    if target != "attributes":
        raise click.BadParameter("only with --target attributes", param_hint="--attributes")
    wanted = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    index = {name: i for i, name in enumerate(names)}
    for name in wanted:
        if name not in index:
            raise click.BadParameter(f"{path}: {name!r} is not an attribute of the dataset "
                                     f"(e.g. {names[0]!r})", param_hint="--attributes")
    if not wanted or len(set(wanted)) != len(wanted):
        raise click.BadParameter(f"{path}: need distinct attribute names, one per line",
                                 param_hint="--attributes")
    return [index[name] for name in wanted]


def load_classifier(path: Path, flag: str):
    """``(module, manifest)`` of a `certify convert`ed or trained torchvision resnet*/densenet*
    at ``path``, or exit 2 naming ``flag`` (unreadable, or another kind of checkpoint)."""
    from cbcert.io.checkpoint import CheckpointError
    from cbcert.io.registry import DENSENET_NAMES, RESNET_NAMES, load_module

    try:
        module, manifest = load_module(path)
    except CheckpointError as err:
        raise click.BadParameter(str(err), param_hint=flag) from None
    if manifest["kind"] not in RESNET_NAMES + DENSENET_NAMES:
        raise click.BadParameter(f"{path} holds a {manifest['kind']!r}; allowed: a converted "
                                 f"{', '.join(RESNET_NAMES + DENSENET_NAMES)}",
                                 param_hint=flag)
    return module, manifest


@train.command("classifier")
@click.option("--init", "init", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Starting weights: a `certify convert`ed torchvision resnet*/densenet* "
                   "directory (its last layer is replaced when the class count differs).")
@click.option("--dataset", required=True, metavar="cub:ROOT|rival10:ROOT",
              help="Training data in its published layout; its test split is evaluated.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New directory for the classifier (an unfinished run there is resumed).")
@click.option("--steps", type=int, default=2000, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--lr", type=float, default=0.01, show_default=True,
              help="Peak SGD learning rate.")
@click.option("--momentum", type=float, default=0.9, show_default=True)
@click.option("--weight-decay", type=float, default=1e-4, show_default=True)
@click.option("--schedule", type=click.Choice(["cosine", "constant"]), default="cosine",
              show_default=True)
@click.option("--image-size", type=int, default=224, show_default=True,
              help="Images are centre-cropped to a square and resized to this size.")
@click.option("--target", type=click.Choice(["class", "attributes"]), default="class",
              show_default=True, help="class: a classifier (softmax cross-entropy); "
              "attributes: an attribute labeler, one logit per annotated attribute (binary "
              "cross-entropy), the concept classifier a CB-AE is trained with.")
@click.option("--attributes", "attributes_file", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="With --target attributes: a file of attribute names, one per line, the "
                   "labeler's outputs in that order (default: every annotated attribute), e.g. "
                   "the K concepts of a CB-AE.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Data order and a new last layer's initialisation.")
@click.option("--save-every", type=int, default=200, show_default=True,
              help="Steps between progress checkpoints.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_classifier_cmd(init: Path, dataset: str, out: Path, steps: int, batch_size: int,
                         lr: float, momentum: float, weight_decay: float, schedule: str,
                         image_size: int, target: str, attributes_file: Path | None, seed: int,
                         save_every: int, quiet: bool) -> None:
    """Fine-tune a converted torchvision classifier on CUB or RIVAL-10 (torchvision's recipe:
    SGD with momentum, batch norm in training mode, ImageNet normalisation).

    Example: certify train classifier --init resnet50 --dataset cub:CUB_200_2011 --out std
    """
    import numpy as np

    from cbcert.datasets.common import DatasetError, batches
    from cbcert.training.classifier import ClassifierTrainConfig
    from cbcert.training.classifier_run import run

    common.check_at_least(("--save-every", save_every, 1), ("--image-size", image_size, 16))
    try:
        config = ClassifierTrainConfig(steps=steps, batch_size=batch_size, lr=lr,
                                       momentum=momentum, weight_decay=weight_decay,
                                       schedule=schedule, seed=seed, target=target)
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=common.flag_of(err.key)) from None
    module, manifest = load_classifier(init, "--init")
    kind = manifest["kind"]
    train_set, test_set = dataset_split(dataset, "train"), dataset_split(dataset, "test")
    per_epoch = len(train_set.items) // batch_size
    columns = attribute_columns(attributes_file, train_set.attribute_names, target)
    outputs = len(columns) if target == "attributes" else train_set.num_classes

    def selected(stream):
        for batch in stream:
            if "attributes" in batch:
                batch = {**batch, "attributes": batch["attributes"][:, columns]}
            yield batch

    def train_batches(epoch: int, start: int):
        return selected(batches(train_set.items, batch_size=batch_size, image_size=image_size,
                                seed=seed, epoch=epoch, shuffle=True, drop_last=True,
                                start=start))

    def evaluate(trained) -> dict:
        from cbcert.engine import compiler
        from cbcert.io.registry import pure_apply

        apply_fn, params = pure_apply(trained)
        logits = compiler.jit(lambda p, x: apply_fn(p, (x - mean) / std))
        correct = total = images = 0
        for batch in selected(batches(test_set.items, batch_size=batch_size,
                                      image_size=image_size, seed=seed, shuffle=False)):
            out = np.asarray(logits(params, batch["image"]))
            images += len(out)
            if target == "attributes":
                correct += int(np.sum((out > 0) == (batch["attributes"] > 0)))
                total += out.size
            else:
                correct += int(np.sum(out.argmax(-1) == batch["label"]))
                total += len(out)
        name = "attribute_accuracy" if target == "attributes" else "accuracy"
        return {f"test_{name}": correct / max(total, 1), "test_images": images}

    mean = np.asarray(config.mean, np.float32)
    std = np.asarray(config.std, np.float32)
    identity = {"init": {"kind": kind, "params_sha256": manifest["params_sha256"]},
                "dataset": dataset.partition(":")[0], "train_images": len(train_set.items),
                "image_size": image_size}
    if attributes_file is not None:
        identity["attributes"] = [train_set.attribute_names[i] for i in columns]
    log = (lambda s: None) if quiet else (lambda s: common.err_console.print(s))
    try:
        with bar("train classifier", quiet, unit="steps") as update:
            result = run(module, kind, train_batches, per_epoch, config, out,
                         num_classes=outputs, identity=identity,
                         save_every=save_every, evaluate=evaluate, log=log,
                         on_step=(lambda step, _: update(step, steps)) if update else None)
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=common.flag_of(err.key)) from None
    except DatasetError as err:  # an image that cannot be decoded (names the file)
        raise click.BadParameter(str(err), param_hint="--dataset") from None
    except ValueError as err:  # a damaged progress checkpoint in --out (names the file)
        raise click.BadParameter(str(err), param_hint="--out") from None
    common.console.print_json(data=result["metrics"])
    common.console.print(f"wrote {out}; use it as a world directory's classifier or with "
                         f"`certify latent --world pixels:IMAGES --classifier {out}`")


COMMANDS: tuple = ()  # the command joins `certify train` (cbcert.cli.worlds.train)
