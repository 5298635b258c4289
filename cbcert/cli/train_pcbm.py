"""``certify train pcbm``: a post-hoc concept bottleneck model (and PCBM-h) on a classifier's
embeddings, its concept bank learned from CUB's or RIVAL-10's attribute annotations
(`cbcert.training.pcbm`, `cbcert.training.pcbm_run`)."""

from __future__ import annotations

from pathlib import Path

import click

from cbcert.cli import common
from cbcert.cli.progress import bar
from cbcert.cli.train_classifier import dataset_split, load_classifier
from cbcert.cli.worlds import train
from cbcert.schema import ConfigError

FLAGS = {"n_samples": "--n-samples", "svm_c": "--svm-c", "lam": "--lam",
         "l1_ratio": "--l1-ratio", "hybrid_epochs": "--hybrid-epochs",
         "hybrid_lr": "--hybrid-lr", "hybrid_batch_size": "--batch-size",
         "l2_penalty": "--l2-penalty", "backbone": "--backbone", "hybrid_out": "--hybrid-out"}


def concept_choice(spec: str) -> str | int | list[str]:
    """``--concepts``: ``all``, a count, or a file with one attribute name per line."""
    if spec == "all":
        return "all"
    if spec.isdigit():
        return int(spec)
    path = Path(spec)
    if not path.is_file():
        raise click.BadParameter(f"got {spec!r}; expected all, a count (e.g. 18) or a file of "
                                 "attribute names, one per line", param_hint="--concepts")
    names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not names:
        raise click.BadParameter(f"{spec}: no attribute name in the file",
                                 param_hint="--concepts")
    return names


@train.command("pcbm")
@click.option("--backbone", "backbone_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The classifier whose embedding the PCBM reads: a `certify convert`ed or "
                   "`certify train classifier` resnet*/densenet* directory.")
@click.option("--dataset", required=True, metavar="cub:ROOT|rival10:ROOT",
              help="Images and attribute annotations in their published layout; its test "
                   "split is evaluated.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New directory for the PCBM (an unfinished run there is resumed).")
@click.option("--hybrid-out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also train PCBM-h (a residual head on the embedding) into this new "
                   "directory.")
@click.option("--concepts", "concepts_spec", default="all", show_default=True,
              metavar="all|K|FILE",
              help="The concept vocabulary: every usable attribute, the K attributes whose "
                   "training positive rate is closest to 1/2, or the names in FILE.")
@click.option("--concept-labels", type=click.Choice(["auto", "class", "image"]), default="auto",
              show_default=True,
              help="class: an image has a concept iff most training images of its class do "
                   "(CBM's processed CUB data, which PCBM uses); image: its own annotation. "
                   "auto: class for CUB, image for RIVAL-10.")
@click.option("--n-samples", type=int, default=50, show_default=True,
              help="Images with and without each concept that train its SVM (as many again "
                   "measure it).")
@click.option("--svm-c", type=float, default=0.1, show_default=True, help="The SVMs' C.")
@click.option("--lam", type=float, default=1e-5, show_default=True,
              help="λ of the head's elastic net.")
@click.option("--l1-ratio", type=float, default=0.99, show_default=True,
              help="The head's ℓ1 share of the elastic net.")
@click.option("--hybrid-epochs", type=int, default=20, show_default=True)
@click.option("--hybrid-lr", type=float, default=0.01, show_default=True)
@click.option("--l2-penalty", type=float, default=1e-3, show_default=True,
              help="PCBM-h: weight of mean(W_res²) in the loss.")
@click.option("--batch-size", type=int, default=64, show_default=True,
              help="Images per embedding batch and PCBM-h's mini-batch.")
@click.option("--image-size", type=int, default=224, show_default=True,
              help="Images are centre-cropped to a square and resized to this size.")
@click.option("--seed", type=int, default=42, show_default=True,
              help="Concept samples, the residual's initialisation and PCBM-h's data order.")
@click.option("--save-every", type=int, default=200, show_default=True,
              help="Embedding batches / PCBM-h steps between progress checkpoints.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_pcbm_cmd(backbone_dir: Path, dataset: str, out: Path, hybrid_out: Path | None,
                   concepts_spec: str, concept_labels: str, n_samples: int, svm_c: float,
                   lam: float, l1_ratio: float, hybrid_epochs: int, hybrid_lr: float,
                   l2_penalty: float, batch_size: int, image_size: int, seed: int,
                   save_every: int, quiet: bool) -> None:
    """Train a PCBM (Yuksekgonul et al., 2023) on a classifier's embeddings: one linear SVM
    per concept (the concept bank), an elastic-net logistic head on the concept margins and,
    with --hybrid-out, PCBM-h's residual.

    Example: certify train pcbm --backbone std --dataset cub:CUB_200_2011 --concepts 18
    --out cbm --hybrid-out cbmh
    """
    from cbcert.datasets.common import DatasetError
    from cbcert.training.pcbm import PCBMTrainConfig, select_concepts
    from cbcert.training.pcbm_run import PCBMData, run

    common.check_at_least(("--save-every", save_every, 1), ("--image-size", image_size, 16))
    choice = concept_choice(concepts_spec)
    with common.bad_input(FLAGS):
        config = PCBMTrainConfig(n_samples=n_samples, svm_c=svm_c, lam=lam, l1_ratio=l1_ratio,
                                 hybrid_epochs=hybrid_epochs, hybrid_lr=hybrid_lr,
                                 hybrid_batch_size=batch_size, l2_penalty=l2_penalty,
                                 seed=seed)
    backbone, manifest = load_classifier(backbone_dir, "--backbone")
    kind = manifest["kind"]
    if hybrid_out is not None and hybrid_out.absolute() == out.absolute():
        raise click.BadParameter(f"got {hybrid_out}, the same as --out; PCBM-h needs its own "
                                 "directory", param_hint="--hybrid-out")
    train_set, test_set = dataset_split(dataset, "train"), dataset_split(dataset, "test")
    name = dataset.partition(":")[0]
    if concept_labels == "auto":
        concept_labels = "class" if name == "cub" else "image"
    with common.bad_input(FLAGS):
        if concept_labels == "class":
            from cbcert.datasets.cub import class_attribute_majority

            attributes = class_attribute_majority(train_set)[train_set.labels()]
        else:
            attributes = train_set.attribute_matrix()
        picked, names = select_concepts(attributes, train_set.attribute_names, choice)
    data = PCBMData(train=train_set.items, test=test_set.items,
                    concepts=attributes[:, picked], concept_names=names,
                    num_classes=train_set.num_classes)
    identity = {"backbone": {"kind": kind, "params_sha256": manifest["params_sha256"]},
                "dataset": name, "train_images": len(train_set.items),
                "concept_labels": concept_labels}
    log = (lambda s: None) if quiet else (lambda s: common.err_console.print(s))
    try:
        with bar("train pcbm", quiet, unit="steps") as update:
            written = run(backbone, kind, data, config, out, hybrid_out=hybrid_out,
                          batch_size=batch_size, image_size=image_size, identity=identity,
                          save_every=save_every, log=log,
                          on_progress=(lambda _, done, total: update(done, total))
                          if update else None)
    except ConfigError as err:
        raise click.BadParameter(err.detail, param_hint=common.flag_of(err.key, FLAGS)) from None
    except DatasetError as err:  # an image that cannot be decoded (names the file)
        raise click.BadParameter(str(err), param_hint="--dataset") from None
    except ValueError as err:  # a damaged progress checkpoint in --out (names the file)
        raise click.BadParameter(str(err), param_hint="--out") from None
    metrics = {"pcbm": written["pcbm"]["metrics"]}
    if written["pcbmh"] is not None:
        metrics["pcbmh"] = written["pcbmh"]["metrics"]["hybrid"]
    common.console.print_json(data=metrics)
    where = f"{out} and {hybrid_out}" if hybrid_out is not None else str(out)
    common.console.print(f"wrote {where}; use them as a world directory's classifiers.cbm / "
                         f"cbmh or with `certify latent --world pixels:IMAGES --classifier {out}`")


COMMANDS: tuple = ()  # the command joins `certify train` (cbcert.cli.worlds.train)
