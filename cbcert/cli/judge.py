"""``certify judge``: a council's scores of a judge bundle, read back into a report."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from cbcert.cli import common


def _cell(entry) -> str:
    if entry is None:
        return "–"
    return f"{entry['mean']:.2f} [{entry['low']:.2f}, {entry['high']:.2f}] (n={entry['items']})"


def _number(value) -> str:
    return "–" if value is None else f"{value:.3f}"


@click.command()
@click.argument("bundle_dir", metavar="BUNDLE",
                type=click.Path(file_okay=False, path_type=Path))
@click.argument("scores", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--known-answer", is_flag=True,
              help="Seat the built-in known-answer scorer (1 + 8·F1) on the council as judge "
                   "'known-answer' (bundles of worlds with a class rule).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Report file [default: BUNDLE/judge.json].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the bootstrap intervals.")
@click.option("--quiet", "-q", is_flag=True, help="No table.")
def judge(bundle_dir: Path, scores: tuple[Path, ...], known_answer: bool, out: Path | None,
          seed: int, quiet: bool) -> None:
    """Read judges' scores (one JSONL file per judge: {"judge", "id", "score"} per line,
    scores 1–9) of a bundle written by `certify explain --export BUNDLE`, and report per-model
    mean scores with intervals, the judges' agreement (Krippendorff's α, pairwise), each
    judge's agreement with the known answer, and paired tests between models.

    Example: certify judge bundle scores-gpt.jsonl scores-alice.jsonl --known-answer
    """
    from cbcert.robustness.judges import ScoreFileError, read_scores
    from cbcert.runs.directory import write_json
    from cbcert.runs.judge import REPORT, BundleError, known_answer_judge, read_bundle, report

    common.check("seed", seed, "--seed")
    try:
        bundle = read_bundle(bundle_dir)
    except BundleError as err:
        raise click.BadParameter(str(err), param_hint="BUNDLE") from None
    out = common.writable_file(out or bundle_dir / REPORT, "--out")
    low, high = bundle.manifest["score_range"]
    council = []
    for path in scores:
        try:
            council.append(read_scores(path, bundle.ids, low=low, high=high))
        except ScoreFileError as err:
            raise click.BadParameter(str(err), param_hint="SCORES") from None
    if known_answer:
        try:
            council.append(known_answer_judge(bundle))
        except BundleError as err:
            raise click.BadParameter(str(err), param_hint="--known-answer") from None
    if not council:
        raise click.BadParameter("no judge: give score files and/or --known-answer",
                                 param_hint="SCORES")
    seen: dict[str, str] = {}
    for j in council:
        if j.judge in seen:
            raise click.BadParameter(f"judge {j.judge!r} in {seen[j.judge]} and {j.path}: one "
                                     "file per judge, each judge once", param_hint="SCORES")
        seen[j.judge] = j.path
    result = report(bundle, council, seed=seed)
    write_json(out, result)
    if not quiet:
        _print(result, out)


def _print(result: dict, out: Path) -> None:
    table = Table(title=f"{result['world']}: judged explanations ({result['items']} items, "
                        f"{len(result['judges'])} judges)")
    table.add_column("model")
    table.add_column("mean score [95 % bootstrap]", justify="right")
    for j in result["judges"]:
        table.add_column(j["judge"], justify="right")
    for model, entry in result["models"].items():
        table.add_row(model, _cell(entry),
                      *(_number(j["means"][model]) for j in result["judges"]))
    common.console.print(table)
    alpha = result["agreement"]["krippendorff_alpha"]
    lines = [f"Krippendorff's α: interval {_number(alpha['interval'])}, "
             f"ordinal {_number(alpha['ordinal'])}"]
    lines += [f"pairwise agreement {p['judge_a']} – {p['judge_b']}: {_number(p['agreement'])} "
              f"over {p['items']} items" for p in result["agreement"]["pairwise"]]
    for name, k in (result["known_answer"] or {}).items():
        lines.append(f"{name} vs the known answer: pairwise {_number(k['pairwise'])}, α "
                     f"{_number(k['alpha_interval'])} over {k['items']} items")
    lines += [f"{c['model_a']} − {c['model_b']}: {c['delta']:+.2f} over {c['inputs']} inputs, "
              f"p = {c['pvalue']:.3g} (Holm {c['pvalue_holm']:.3g})"
              for c in result["comparisons"]]
    common.console.print("\n".join(lines) + f"\nreport in {out}")


COMMANDS = [judge]
