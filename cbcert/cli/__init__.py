"""``certify``: the command-line front end. Parse, build objects, call the library, print.

One module per command group (`certify`, `empirical`, `worlds`, `convert`, `sweep`); what they
share is in `common`. Bad input exits with code 2 and a message naming the flag, the value and
the allowed range: the library raises `cbcert.schema.ConfigError` carrying a key, and only this
package turns keys into flags.
"""

from __future__ import annotations

import click

from cbcert.cli import (
    certify,
    convert,
    empirical,
    explain,
    judge,
    sweep,
    train_classifier,
    train_pcbm,
    train_pixpnet,
    worlds,
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cbcert")
def main() -> None:
    """cbcert: certify and stress-test classifiers under perturbations made through a generator.

    Runs on the built-in concept world unless told otherwise; results go under results/.
    """


# train_classifier, train_pcbm and train_pixpnet add `certify train classifier|pcbm|pixpnet`
# to worlds' `train` group (no own COMMANDS).
for _module in (certify, empirical, explain, judge, worlds, train_classifier, train_pcbm,
                train_pixpnet, convert, sweep):
    for _command in _module.COMMANDS:
        main.add_command(_command)
