"""``certify explain``: concept-model explanations, clean and perturbed, certified and scored."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from cbcert.cli import common
from cbcert.cli.progress import bar
from cbcert.runs.explain import ExplainJob

# "explain": the world gives no concept head (runs.explanations.check), so --world is at fault.
FLAGS = {"num_inputs": "--inputs", "top_k": "--top-k", "figure_inputs": "--figure-inputs",
         "world": "--world", "flip_radius": "--flip-radius", "explain": "--world",
         "judge_inputs": "--judge-inputs"}


def _default(name: str):
    return common.default_of(ExplainJob, name)


@click.command()
@click.option("--models", default=",".join(_default("models")), show_default=True,
              help="Models to explain: cbm, cbmh (concepts), proto (prototypes).")
@click.option("--inputs", "num_inputs", type=int, default=_default("num_inputs"),
              show_default=True, help="Agreement inputs explained.")
@click.option("--eps", type=float, default=_default("eps"), show_default=True,
              help="Latent shift norm ε of the perturbed explanation.")
@click.option("--tau", type=int, default=_default("tau"), show_default=True,
              help="Concepts flipped (τ) for the semantic perturbed explanation.")
@click.option("--sigma", type=float, default=_default("sigma"), show_default=True,
              help="Latent noise σ of the concept-sign certificate.")
@click.option("--radius", type=float, default=None,
              help="Radius R at which cited concepts must keep their sign [default: σ/4].")
@click.option("--n0", type=int, default=_default("n0"), show_default=True,
              help="Selection samples of each concept's sign.")
@click.option("--n", type=int, default=_default("n"), show_default=True,
              help="Estimation samples of each concept's sign.")
@click.option("--alpha", type=float, default=_default("alpha"), show_default=True,
              help="Family-wise error level over the cited concepts of an input.")
@click.option("--rho", type=float, default=None,
              help="Also certify the cited concepts' signs under Bernoulli concept flips with "
                   "probability ρ (Hamming radius --flip-radius).")
@click.option("--flip-radius", type=int, default=_default("flip_radius"), show_default=True,
              help="Hamming radius at which cited concepts must keep their sign (--rho), in "
                   "[1, K].")
@click.option("--top-k", type=int, default=_default("top_k"), show_default=True,
              help="Concepts per explanation.")
@click.option("--figure-inputs", type=int, default=_default("figure_inputs"),
              show_default=True, help="Inputs drawn in explain.png (0: no figure).")
@common.world_option()
@click.option("--seed", type=int, default=_default("seed"), show_default=True,
              help="Root seed of the pool, the perturbations, the noise and the bootstrap.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/explain-seed<seed>).")
@click.option("--export", "export_path", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Also write a judge bundle into this new folder: images, "
                                 "explanations and a JSONL manifest of the pre-registered "
                                 "inputs, for `certify judge` (docs/commands.md).")
@click.option("--judge-inputs", type=int, default=None,
              help="Inputs of the judge bundle, drawn from the seed before any explanation "
                   "[default: min(20, --inputs)].")
@common.memory_options
@click.option("--quiet", "-q", is_flag=True, help="No table.")
def explain(models: str, num_inputs: int, eps: float, tau: int, sigma: float,
            radius: float | None, n0: int, n: int, alpha: float, rho: float | None,
            flip_radius: int, top_k: int,
            figure_inputs: int, world_name: str, seed: int, out: Path | None,
            export_path: Path | None, judge_inputs: int | None, chunk_size: int | None,
            max_memory: int | None, quiet: bool) -> None:
    """Explanations of the concept models (and proto's prototypes): how stable they are under a
    latent shift and concept flips, which cited units stay provably (certified), and how well
    they cite the concepts that define the class (known answer; built-in worlds).

    Example: certify explain --inputs 100 --eps 0.3 --tau 1 --sigma 0.1 --export bundle
    """
    from cbcert.runs.explain import run

    with common.bad_input(FLAGS):
        job = ExplainJob(models=common.names(models), num_inputs=num_inputs, eps=eps, tau=tau,
                         sigma=sigma, radius=radius, n0=n0, n=n, alpha=alpha, top_k=top_k,
                         seed=seed, figure_inputs=figure_inputs, rho=rho,
                         flip_radius=flip_radius, judge_inputs=judge_inputs)
    common.check_memory(chunk_size, max_memory)
    out = common.writable_out(out or Path("results") / f"explain-seed{seed}")
    if export_path is not None:
        new_folder(export_path, "--export")
    world = common.load_agreement_world(world_name, job.models)
    with common.bad_input(FLAGS), bar("explain", quiet, unit="steps") as progress:
        result = run(world, job, out, progress=progress, chunk_size=chunk_size,
                     max_memory=max_memory, judge_bundle=export_path is not None)
    draw_figure(result, out)
    if export_path is not None:
        write_judge_bundle(result, out, world, export_path)
        if not quiet:
            items = len(result.extras["bundle"].items)
            common.console.print(f"judge bundle: {items} items ({job.judge_inputs} "
                                 f"pre-registered inputs) in {export_path}/; score them and "
                                 f"run `certify judge {export_path} SCORES.jsonl …`")
    if not quiet:
        _print(result.summary, world, job, out)


def new_folder(path: Path, flag: str) -> Path:
    """A folder a command creates when it ends, checked before any work: its parent must exist
    and be writable, and the folder must not hold a bundle already (exit 2 naming ``flag``):
    a judged bundle is never overwritten."""
    from cbcert.runs.bundle import MANIFEST

    common.writable_file(path, flag)
    if path.exists() and not path.is_dir():
        raise click.BadParameter(f"{path} is a file, not a folder", param_hint=flag)
    if (path / MANIFEST).exists():
        raise click.BadParameter(f"{path} already holds a judge bundle ({MANIFEST}); choose "
                                 "another folder", param_hint=flag)
    return path


def write_judge_bundle(result, out: Path, world, folder: Path) -> None:
    """Write an explain run's judge bundle (``extras["bundle"]``) into ``folder``, with the
    run's clean explanations as ``explanations.json`` (`cbcert.runs.explain.export`)."""
    from cbcert.report.bundle import write_bundle
    from cbcert.runs.bundle import EXPLANATIONS
    from cbcert.runs.explain import export

    folder.mkdir(exist_ok=True)
    export(out, world, folder / EXPLANATIONS)
    write_bundle(result.extras["bundle"], folder)


def draw_figure(result, out: Path) -> None:
    """Draw an explain run's figure (its `RunSummary`'s ``extras["figure"]``, a
    `cbcert.runs.explain.ExplanationFigure`) as ``out/explain.png``; nothing when the run drew
    no inputs (``--figure-inputs 0``)."""
    from cbcert.report.explain import draw_explanations
    from cbcert.runs.explain import FIGURE

    figure = result.extras["figure"]
    if figure is not None:
        draw_explanations(figure.rows, figure.titles, figure.model, out / FIGURE)


def _print(summary: dict, world, job: ExplainJob, out: Path) -> None:
    def cell(entry) -> str:
        if entry is None:
            return "–"
        return f"{entry['mean']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    from cbcert.report.tables import EXPLAIN_MEASURES

    measured = summary["models"]
    rows = [(label.replace(" at R", f" at R = {job.radius:g}"), key)
            for key, label in EXPLAIN_MEASURES if any(key in measured[m] for m in job.models)]
    table = Table(title=f"{world.name}: explanations of {job.num_inputs} agreement inputs "
                        f"(top {job.top_k}; ε = {job.eps:g}, τ = {job.tau}, σ = {job.sigma:g})")
    table.add_column("measure")
    for m in job.models:
        table.add_column(m, justify="right")
    for label, key in rows:  # "–": undefined, or not measured for that model (proto)
        table.add_row(label, *(cell(measured[m].get(key)) for m in job.models))
    common.console.print(table)
    edited = [m for m in job.models if "single_edits" in measured[m]]
    discarded = ", ".join(
        f"{m}: {sum(measured[m][f'{k}_edits']['discarded'] for k in ('single', 'all'))}"
        f" of {sum(measured[m][f'{k}_edits']['attempted'] for k in ('single', 'all'))}"
        for m in edited)
    edits = (f"counterfactual edits discarded by the concept read-out: {discarded}; "
             if edited else "")
    common.console.print(f"mean [95 % bootstrap interval over inputs]; {edits}records, summary "
                         f"and figure in {out}/")

COMMANDS = [explain]
