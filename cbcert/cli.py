"""``certify``: the command-line front end. Parse, build objects, call the library, print.

Bad input exits with code 2 and a message naming the flag, the value and the allowed range.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from cbcert.config import ConfigError, validate, validate_sample_sizes

console = Console()
err_console = Console(stderr=True)


def _check(rule: str, value, flag: str) -> None:
    try:
        validate(rule, value, label=flag)
    except ConfigError as err:
        raise click.BadParameter(str(err).split(": ", 1)[-1], param_hint=flag) from None


def _models(value: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in value.split(",") if m.strip())


def _load_world(preset: str):
    from cbcert.builtin import load_builtin
    from cbcert.checkpoint import CheckpointError

    try:
        return load_builtin(preset)
    except CheckpointError as err:
        raise click.ClickException(str(err)) from None
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None


@contextlib.contextmanager
def _progress(description: str, quiet: bool):
    """A rich progress bar on stderr (inputs done, inputs/s); silent when quiet or not a TTY."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cbcert")
def main() -> None:
    """cbcert: certify and stress-test classifiers under perturbations made through a generator.

    Runs on the built-in concept world unless told otherwise; results go under results/.
    """


# ---------------------------------------------------------------------------- certification


def _certify_options(fn):
    options = [
        click.option("--n", "n", type=int, default=1000, show_default=True,
                     help="Estimation samples per input (Cohen et al.'s n)."),
        click.option("--n0", type=int, default=100, show_default=True,
                     help="Selection samples per input (Cohen et al.'s n0)."),
        click.option("--alpha", type=float, default=0.001, show_default=True,
                     help="Probability that a certificate is wrong."),
        click.option("--inputs", type=int, default=100, show_default=True,
                     help="Inputs certified, from the std/cbm agreement set of the pool."),
        click.option("--batch", type=int, default=10, show_default=True,
                     help="Inputs per engine call (unit of progress and resumption)."),
        click.option("--models", default="std,cbm,proto", show_default=True,
                     help="Comma-separated models: std, cbm, cbmh (PCBM-h), proto."),
        click.option("--two-class", is_flag=True,
                     help="Two-class bound with the runner-up (α split between the bounds)."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
                     show_default=True, help="Compute dtype of generator and classifiers."),
        click.option("--world", "world_name", default="default", show_default=True,
                     help="Built-in world preset (default, k8, k16, px64, similar5, …)."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Root seed of the pool and of all noise."),
        click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output directory (default results/<command>-<scale>-seed<seed>); "
                          "rerunning with the same --out resumes."),
        click.option("--chunk-size", type=int, default=None,
                     help="Samples per device step (default: from --max-memory)."),
        click.option("--max-memory", type=int, default=None,
                     help="Bytes per device a chunk may use (default: from the device)."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _validate_common(n, n0, alpha, inputs, batch, seed, chunk_size, max_memory, mode) -> None:
    _check("count", n, "--n")
    _check("alpha", alpha, "--alpha")
    _check("count", inputs, "--inputs")
    _check("count", batch, "--batch")
    _check("seed", seed, "--seed")
    if mode == "certify":
        _check("count", n0, "--n0")
        try:
            validate_sample_sizes(n0, n, n0_label="--n0", n_label="--n")
        except ConfigError as err:
            raise click.BadParameter(str(err).split(": ", 1)[-1], param_hint="--n0") from None
    if chunk_size is not None:
        _check("count", chunk_size, "--chunk-size")
    if max_memory is not None:
        _check("count", max_memory, "--max-memory")


def _run_certification(noise: str, scale: float, mode: str, opts: dict, default_out: str):
    from cbcert.certify.runner import CertifyJob, RunMismatchError, run

    _validate_common(opts["n"], opts["n0"], opts["alpha"], opts["inputs"], opts["batch"],
                     opts["seed"], opts["chunk_size"], opts["max_memory"], mode)
    models = _models(opts["models"])
    world = _load_world(opts["world_name"])
    try:
        world.check_models(models)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--models") from None
    if "std" not in world.model_names or "cbm" not in world.model_names:
        raise click.ClickException("the agreement set needs a world with 'std' and 'cbm' models")
    job = CertifyJob(noise=noise, scale=scale, mode=mode, n0=opts["n0"], n=opts["n"],
                     alpha=opts["alpha"], two_class=opts["two_class"], models=models,
                     seed=opts["seed"], num_inputs=opts["inputs"], batch=opts["batch"],
                     dtype=opts["dtype"])
    out = opts["out"] or Path("results") / f"{default_out}-seed{opts['seed']}"
    try:
        with _progress(f"{mode} {default_out}", opts["quiet"]) as progress:
            summary = run(world, job, out, progress=progress, chunk_size=opts["chunk_size"],
                          max_memory=opts["max_memory"])
    except RunMismatchError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    if not opts["quiet"]:
        _print_summary(summary, job, world, out)
    return summary


def _print_summary(summary: dict, job, world, out: Path) -> None:
    hamming = job.hamming
    unit = "Hamming" if hamming else "L2"
    scale_name = {"gaussian": "σ", "bernoulli": "ρ", "fixed": "m"}[job.noise]
    title = (f"{job.mode} on {world.name}: {scale_name} = {job.scale:g}, n0 = {job.n0}, "
             f"n = {job.n}, α = {job.alpha:g}, {job.num_inputs} inputs")
    table = Table(title=title)
    table.add_column("model")
    table.add_column("SmAcc", justify="right")
    if job.mode == "certify":
        table.add_column("ACR-H" if hamming else "ACR", justify="right")
        marks = [1.0, 2.0] if hamming else [job.scale / 2, job.scale]
        for r in marks:
            table.add_column(f"CA@{r:g}", justify="right")
    table.add_column("abstain", justify="right")
    table.add_column("time/input", justify="right")
    for model, m in summary["models"].items():
        row = [model, f"{100 * m['smoothed_accuracy']:.1f}%"]
        if job.mode == "certify":
            row.append(f"{m['acr']:.3f}")
            grid = m["radius_grid"]
            for r in marks:
                hits = [ca for g, ca in zip(grid, m["certified_accuracy"], strict=True)
                        if abs(g - r) < 1e-9]
                row.append(f"{100 * hits[0]:.1f}%" if hits else "-")
        row += [f"{100 * m['abstain_rate']:.1f}%", f"{m['seconds_per_input']:.3f}s"]
        table.add_row(*row)
    console.print(table)
    console.print(f"{unit} radii; records and summary in {out}/")


@main.command()
@click.option("--sigma", type=float, required=True, help="Std of the Gaussian latent noise, > 0.")
@_certify_options
def latent(sigma: float, **opts) -> None:
    """Gaussian latent smoothing: certified L2 radii in the generator's latent space.

    Example: certify latent --sigma 0.1
    """
    _check("sigma", sigma, "--sigma")
    _run_certification("gaussian", sigma, "certify", opts, f"latent-sigma{sigma:g}")


@main.command()
@click.option("--rho", type=float, default=None,
              help="Flip probability of each concept, in (0, 0.5).")
@click.option("--flips", type=int, default=None,
              help="Fixed-count smoothing: flip exactly this many uniformly chosen concepts.")
@_certify_options
def concept(rho: float | None, flips: int | None, **opts) -> None:
    """Concept-flip smoothing: certified Hamming radii in the explicit concept space.

    Example: certify concept --rho 0.2
    """
    noise, scale, name = _concept_noise(rho, flips, opts["world_name"])
    _run_certification(noise, scale, "certify", opts, name)


def _concept_noise(rho, flips, world_name):
    if (rho is None) == (flips is None):
        raise click.UsageError("give exactly one of --rho (Bernoulli flips) or --flips "
                               "(fixed-count flips)")
    if rho is not None:
        _check("rho", rho, "--rho")
        return "bernoulli", rho, f"concept-rho{rho:g}"
    _check("count", flips, "--flips")
    return "fixed", flips, f"concept-flips{flips}"


@main.command()
@click.option("--space", type=click.Choice(["latent", "concept"]), default="latent",
              show_default=True)
@click.option("--sigma", type=float, default=None, help="Latent noise std (space latent).")
@click.option("--rho", type=float, default=None, help="Concept flip probability (space concept).")
@click.option("--flips", type=int, default=None, help="Fixed-count concept flips (space concept).")
@_certify_options
def predict(space: str, sigma, rho, flips, **opts) -> None:
    """Smoothed prediction alone (Cohen et al. PREDICT, abstains when not significant)."""
    if space == "latent":
        if sigma is None:
            raise click.UsageError("--space latent needs --sigma")
        _check("sigma", sigma, "--sigma")
        noise, scale, name = "gaussian", sigma, f"predict-latent-sigma{sigma:g}"
    else:
        noise, scale, name = _concept_noise(rho, flips, opts["world_name"])
        name = "predict-" + name
    _run_certification(noise, scale, "predict", opts, name)


# ---------------------------------------------------------------------------- world


@main.group()
def world() -> None:
    """Look at the built-in concept world."""


@world.command("show")
@click.option("--n", "n", type=int, default=16, show_default=True, help="Samples in the grid.")
@click.option("--flip", type=int, default=None,
              help="Show each sample beside its counterfactual with this concept flipped.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("grid.png"),
              show_default=True)
@click.option("--world", "world_name", default="default", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def world_show(n: int, flip: int | None, out: Path, world_name: str, seed: int) -> None:
    """Render a grid of samples with their concept vectors and class names."""
    from cbcert.generators.world import WorldConfig, make_world
    from cbcert.viz import world_grid

    _check("count", n, "--n")
    _check("seed", seed, "--seed")
    try:
        w = make_world(WorldConfig.from_preset(world_name))
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None
    k = w.generator.num_concepts
    if flip is not None and not 0 <= flip < k:
        raise click.BadParameter(f"got {flip}, allowed range [0, {k - 1}]", param_hint="--flip")
    world_grid(w, n=n, seed=seed, flip=flip, out=out)
    console.print(f"wrote {out}")


# ---------------------------------------------------------------------------- training


@main.group()
def train() -> None:
    """Retrain shipped models."""


@train.command("world")
@click.option("--preset", default="default", show_default=True, help="World preset.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Checkpoint directory (default: the package's shipped weights for --preset).")
@click.option("--quick", is_flag=True, help="A few steps of each phase (smoke test, not accurate).")
def train_world(preset: str, seed: int, out: Path | None, quick: bool) -> None:
    """Train f_std, PCBM (+ PCBM-h) and the prototype net on a world, reproducibly from --seed."""
    from cbcert.builtin import weights_path
    from cbcert.generators.world import WorldConfig, make_world
    from cbcert.train_world import TrainConfig, save_trained, train

    _check("seed", seed, "--seed")
    try:
        config = WorldConfig.from_preset(preset)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--preset") from None
    tc = TrainConfig(seed=seed)
    if quick:
        tc = TrainConfig.quick(seed)
    world_obj = make_world(config)
    result = train(world_obj, tc, log=lambda s: err_console.print(s))
    path = save_trained(out or weights_path(preset), config, result)
    metrics = result[-1]
    console.print_json(data={"accuracy": metrics["accuracy"],
                             "concept_accuracy": metrics["concept_accuracy"]})
    console.print(f"wrote {path}")
