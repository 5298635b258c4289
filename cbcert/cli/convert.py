"""``certify convert``: upstream checkpoints to cbcert checkpoints (the write side)."""

from __future__ import annotations

from pathlib import Path

import click

from cbcert.cli import common

# Arguments of `cbcert.convert.convert` whose flag is not ``--`` + the name with dashes.
FLAGS = {"concept_bank_path": "--concept-bank", "config_path": "--config"}


@click.command("convert")
@click.argument("kind")
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--backbone", default=None,
              help="pcbm: backbone name: a torchvision resnet*/densenet* (e.g. resnet18) or "
                   "resnet18_cub (pytorchcv, the official PCBM CUB model).")
@click.option("--backbone-path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="pcbm: the backbone's state_dict (torchvision or pytorchcv).")
@click.option("--concept-bank", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="pcbm: concept bank pickle (must match the checkpoint's).")
@click.option("--config", "config_path", default=None,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="pixpnet: its config.yaml; biggan: its config.json; cbae: the YAML it was "
                   "trained with.")
@click.option("--network", default=None,
              help="stylegan2: the generator in the pickle  [default: G_ema]")
def convert_cmd(kind, checkpoint, out_dir, backbone, backbone_path, concept_bank, config_path,
                network):
    """Convert an upstream checkpoint to a cbcert checkpoint (orbax params + manifest.json).

    KIND: classifiers resnet18/34/50/101/152, densenet121/161/169/201, pcbm, pixpnet;
    generators stylegan2 (a stylegan2-ada-pytorch network pickle, read without torch), biggan
    (pytorch_model.bin with --config config.json), cbae (a CB-AE .pt with --config cbae.yaml).
    All but stylegan2 need torch (pip install 'cbcert[torch]'); loading the result does not.
    """
    from cbcert.convert import KINDS, convert

    if kind not in KINDS:
        raise click.BadParameter(f"got {kind!r}, allowed: {', '.join(KINDS)}", param_hint="KIND")
    try:
        with common.bad_input(FLAGS):
            manifest = convert(kind, checkpoint, out_dir, backbone=backbone,
                               backbone_path=backbone_path, concept_bank_path=concept_bank,
                               config_path=config_path, network=network)
    except ImportError as err:
        raise click.ClickException(f"{err}; install the torch extra: pip install "
                                   "'cbcert[torch]'") from None
    except ValueError as err:  # a bad checkpoint, bank or config is bad input: exit 2
        raise click.UsageError(str(err)) from None
    common.console.print(f"wrote {out_dir} ({manifest.get('kind', kind)})")


COMMANDS = (convert_cmd,)
