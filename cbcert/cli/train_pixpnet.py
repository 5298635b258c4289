"""``certify train pixpnet``: a PixPNet / ProtoPNet prototype network on a classifier's truncated
backbone, trained on CUB or RIVAL-10 by ProtoPNet's recipe (`cbcert.training.pixpnet`,
`cbcert.training.pixpnet_run`)."""

from __future__ import annotations

from pathlib import Path

import click

from cbcert.cli import common
from cbcert.cli.progress import bar
from cbcert.cli.train_classifier import dataset_split, load_classifier
from cbcert.cli.worlds import train
from cbcert.schema import ConfigError

FLAGS = {"warm_steps": "--warm-steps", "joint_steps": "--joint-steps",
         "last_steps": "--last-steps", "lr_features": "--lr-features",
         "lr_add_on": "--lr-add-on", "lr_prototypes": "--lr-prototypes", "lr_last": "--lr-last",
         "init": "--init"}


@train.command("pixpnet")
@click.option("--init", "init", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The backbone's weights: a `certify convert`ed or `certify train "
                   "classifier` resnet*/densenet* directory (truncated at --feature-layer).")
@click.option("--dataset", required=True, metavar="cub:ROOT|rival10:ROOT",
              help="Training data in its published layout; its test split is evaluated.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New directory for the PixPNet (an unfinished run there is resumed).")
@click.option("--feature-layer", default="layer3", show_default=True,
              help="The last backbone stage kept (layer1..layer4; denseblock*/transition* "
                   "for a DenseNet): smaller receptive fields ground prototypes in pixels.")
@click.option("--prototypes-per-class", type=int, default=10, show_default=True)
@click.option("--prototype-dim", type=int, default=128, show_default=True)
@click.option("--distance", type=click.Choice(["l2", "cosine"]), default="l2",
              show_default=True)
@click.option("--readout", type=click.Choice(["linear", "sparse", "proto"]), default="linear",
              show_default=True)
@click.option("--warm-steps", type=int, default=500, show_default=True,
              help="Add-on layers and prototypes only.")
@click.option("--joint-steps", type=int, default=2000, show_default=True,
              help="Backbone, add-on layers and prototypes; then the push.")
@click.option("--last-steps", type=int, default=200, show_default=True,
              help="The readout only, after the push.")
@click.option("--lr-features", type=float, default=1e-4, show_default=True)
@click.option("--lr-add-on", type=float, default=3e-3, show_default=True)
@click.option("--lr-prototypes", type=float, default=3e-3, show_default=True)
@click.option("--lr-last", type=float, default=1e-4, show_default=True)
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--image-size", type=int, default=224, show_default=True,
              help="Images are centre-cropped to a square and resized to this size.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Data order and the new layers' initialisation.")
@click.option("--save-every", type=int, default=200, show_default=True,
              help="Steps between progress checkpoints.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_pixpnet_cmd(init: Path, dataset: str, out: Path, feature_layer: str,
                      prototypes_per_class: int, prototype_dim: int, distance: str,
                      readout: str, warm_steps: int, joint_steps: int, last_steps: int,
                      lr_features: float, lr_add_on: float, lr_prototypes: float,
                      lr_last: float, batch_size: int, image_size: int, seed: int,
                      save_every: int, quiet: bool) -> None:
    """Train a PixPNet (ProtoPNet's prototype layer on a truncated backbone): warm-up of the
    add-on layers and prototypes, joint training, the push onto training patches, then the
    readout.

    Example: certify train pixpnet --init cub-resnet50 --dataset cub:CUB_200_2011 --out proto
    """
    import numpy as np

    from cbcert.datasets.common import DatasetError, batches
    from cbcert.models.pixpnet import PixPNetConfig
    from cbcert.training.pixpnet import PixPNetTrainConfig
    from cbcert.training.pixpnet_run import new_pixpnet, run

    common.check_at_least(("--save-every", save_every, 1), ("--image-size", image_size, 16),
                          ("--prototypes-per-class", prototypes_per_class, 1),
                          ("--prototype-dim", prototype_dim, 1))
    with common.bad_input(FLAGS):
        config = PixPNetTrainConfig(warm_steps=warm_steps, joint_steps=joint_steps,
                                    last_steps=last_steps, batch_size=batch_size,
                                    lr_features=lr_features, lr_add_on=lr_add_on,
                                    lr_prototypes=lr_prototypes, lr_last=lr_last, seed=seed)
    classifier, manifest = load_classifier(init, "--init")
    kind = manifest["kind"]
    train_set, test_set = dataset_split(dataset, "train"), dataset_split(dataset, "test")
    classes = train_set.num_classes
    try:
        model_config = PixPNetConfig(kind, feature_layer, classes * prototypes_per_class,
                                     prototype_dim, classes, distance=distance,
                                     readout_type=readout)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--feature-layer") from None
    with common.bad_input(FLAGS):
        module = new_pixpnet(classifier, model_config, seed)
    per_epoch = len(train_set.items) // batch_size

    def train_batches(epoch: int, start: int):
        return batches(train_set.items, batch_size=batch_size, image_size=image_size,
                       seed=seed, epoch=epoch, shuffle=True, drop_last=True, start=start)

    def push_batches():
        return batches(train_set.items, batch_size=batch_size, image_size=image_size,
                       seed=seed, shuffle=False)

    def evaluate(trained) -> dict:
        from cbcert.engine import compiler
        from cbcert.io.registry import pure_apply
        from cbcert.training.classifier import IMAGENET_MEAN, IMAGENET_STD

        apply_fn, params = pure_apply(trained)
        mean = np.asarray(IMAGENET_MEAN, np.float32)
        std = np.asarray(IMAGENET_STD, np.float32)
        logits = compiler.jit(lambda p, x: apply_fn(p, (x - mean) / std))
        correct = total = 0
        for batch in batches(test_set.items, batch_size=batch_size, image_size=image_size,
                             seed=seed, shuffle=False):
            correct += int(np.sum(np.asarray(logits(params, batch["image"])).argmax(-1)
                                  == batch["label"]))
            total += len(batch["label"])
        return {"test_accuracy": correct / max(total, 1), "test_images": total}

    identity = {"init": {"kind": kind, "params_sha256": manifest["params_sha256"]},
                "dataset": dataset.partition(":")[0], "train_images": len(train_set.items),
                "image_size": image_size}
    log = (lambda s: None) if quiet else (lambda s: common.err_console.print(s))
    try:
        with bar("train pixpnet", quiet, unit="steps") as update:
            result = run(module, train_batches, per_epoch, push_batches, config, out,
                         identity=identity, save_every=save_every, evaluate=evaluate, log=log,
                         on_step=(lambda step, _: update(step, config.steps))
                         if update else None)
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=common.flag_of(err.key, FLAGS)) from None
    except DatasetError as err:  # an image that cannot be decoded (names the file)
        raise click.BadParameter(str(err), param_hint="--dataset") from None
    except ValueError as err:  # a damaged progress checkpoint in --out (names the file)
        raise click.BadParameter(str(err), param_hint="--out") from None
    common.console.print_json(data=result["metrics"])
    common.console.print(f"wrote {out}; use it as a world directory's classifiers.proto")


COMMANDS: tuple = ()  # the command joins `certify train` (cbcert.cli.worlds.train)
