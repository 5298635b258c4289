"""``certify latent``, ``certify concept``, ``certify predict``: randomized-smoothing runs."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from cbcert.certify.smoothing import smoothing
from cbcert.cli import common
from cbcert.cli.distributed import distributed_options
from cbcert.cli.progress import bar
from cbcert.runs.certify import CertifyJob

SCHEDULE_KEYS = ("schedule", "target_radius", "radius_tolerance", "first_checkpoint",
                 "checkpoint_ratio", "final_alpha_share")


def _default(name: str):
    return common.default_of(CertifyJob, name)


def certify_options(fn):
    """The options every certification command shares (defaults from `CertifyJob`)."""
    options = [
        click.option("--n", "n", type=int, default=_default("n"), show_default=True,
                     help="Estimation samples per input (Cohen et al.'s n)."),
        click.option("--n0", type=int, default=_default("n0"), show_default=True,
                     help="Selection samples per input (Cohen et al.'s n0)."),
        click.option("--alpha", type=float, default=_default("alpha"), show_default=True,
                     help="Probability that a certificate is wrong."),
        click.option("--inputs", type=int, default=_default("num_inputs"), show_default=True,
                     help="Inputs certified, from the std/cbm agreement set of the pool."),
        click.option("--batch", type=int, default=_default("batch"), show_default=True,
                     help="Inputs per engine call (unit of progress and resumption)."),
        click.option("--models", default=None,
                     help="Comma-separated models: std, cbm, cbmh (PCBM-h), proto "
                          f"[default: {','.join(_default('models'))}; pixels worlds: std]."),
        click.option("--two-class", is_flag=True,
                     help="Two-class bound with the runner-up (α split between the bounds)."),
        click.option("--schedule", type=click.Choice(["fixed", "sequential", "anytime"]),
                     default=_default("schedule"), show_default=True,
                     help="fixed: --n estimation samples per input (Cohen's CERTIFY); "
                          "sequential: anytime-valid checkpoints up to --n, each input stops "
                          "once decided (not with --flips); anytime: a confidence sequence "
                          "read at every checkpoint, no α spent on them (certify only)."),
        click.option("--target-radius", type=float, default=None,
                     help="Sequential: stop an input once certified at this radius, or once "
                          "it is out of reach."),
        click.option("--radius-tolerance", type=float, default=None,
                     help="Sequential: stop an input once at most this much radius could "
                          "still be gained."),
        click.option("--first-checkpoint", type=int, default=None,
                     help="Sequential: first checkpoint, at most --n [default: 32; anytime: "
                          "1]; the next ones grow by --checkpoint-ratio up to --n."),
        click.option("--checkpoint-ratio", type=float, default=None,
                     help="Sequential: growth factor of the checkpoints [default: 2; anytime: "
                          "1.05]."),
        click.option("--final-alpha-share", type=float, default=None,
                     help="Sequential: share of --alpha spent at the last checkpoint --n "
                          "[default: 0.5]; the rest is split evenly over the earlier ones."),
        click.option("--bound", type=click.Choice(["clopper-pearson", "randomized"]),
                     default="clopper-pearson", show_default=True,
                     help="randomized: the randomized Clopper–Pearson bound (exact coverage, "
                          "never below the standard one), whose certificate also depends on a "
                          "uniform draw keyed by --seed and the input (fixed and sequential "
                          "certify runs)."),
        click.option("--subsets", type=int, default=0, show_default=True,
                     help="Also report SmAcc, ACR and the radius of correct inputs as mean ± sd "
                          "over this many random subsets of the certified inputs, with paired "
                          "tests between models (0: off; else >= 2, with --subset-size)."),
        click.option("--subset-size", type=int, default=0, show_default=True,
                     help="Inputs per subset for --subsets, in [1, --inputs]."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16"]),
                     default=_default("dtype"), show_default=True,
                     help="Compute dtype of generator and classifiers."),
        common.world_option("Built-in world preset (default, k8, k16, px64, similar5, …), a "
                            "world directory with a world.json, or pixels:IMAGES (an .npz "
                            "with x[N,H,W,3] in [0,1] and y[N], or a folder of PNGs with "
                            "labels.txt) with --classifier: pixel-space smoothing, σ in pixel "
                            "units on [0, 1]."),
        click.option("--classifier", type=click.Path(path_type=Path), default=None,
                     help="pixels worlds: a `certify convert`ed resnet*/densenet* directory "
                          "(the model std)."),
        click.option("--normalize", type=click.Choice(["imagenet", "cifar10", "none"]),
                     default="imagenet", show_default=True,
                     help="pixels worlds: per-channel mean/std applied after the noise."),
        click.option("--export", type=click.Choice(["cohen"]), default=None,
                     help="Also write cohen-<model>.tsv: locuslab/smoothing's columns "
                          "(idx label predict [radius] correct time)."),
        click.option("--seed", type=int, default=_default("seed"), show_default=True,
                     help="Root seed of the pool and of all noise."),
        click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output directory (default results/<command>-<scale>-seed<seed>); "
                          "rerunning with the same --out resumes."),
        common.units_option("Batches of inputs (fixed schedule)"),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return distributed_options(common.memory_options(fn))


def run_certification(noise: str, scale, mode: str, opts: dict) -> dict:
    """Build the job (every value checked), load the world, run, print the table."""
    from cbcert.runs.certify import run

    kind = smoothing(noise)
    pixels = opts["world_name"].startswith("pixels:")
    models = opts["models"]
    if models is None:  # '' names no model: refused by the job, not read as the default
        models = "std" if pixels else ",".join(_default("models"))
    with common.bad_input():
        job = CertifyJob(noise=noise, scale=scale, mode=mode, n0=opts["n0"], n=opts["n"],
                         alpha=opts["alpha"], two_class=opts["two_class"],
                         models=common.names(models), seed=opts["seed"],
                         num_inputs=opts["inputs"], batch=opts["batch"], dtype=opts["dtype"],
                         num_subsets=opts["subsets"], subset_size=opts["subset_size"],
                         bound=opts["bound"].replace("-", "_"),
                         **{key: opts[key] for key in SCHEDULE_KEYS})
    common.check_memory(opts["chunk_size"], opts["max_memory"])
    common.check_units(opts["units"])
    prefix = "predict-" if mode == "predict" else ""
    name = f"{prefix}{kind.name(scale)}"
    out = common.writable_out(opts["out"] or Path("results") / f"{name}-seed{job.seed}")
    world = common.load_agreement_world(opts["world_name"], job.models,
                                        concepts=kind.space == "concept",
                                        classifier=opts["classifier"],
                                        normalize=opts["normalize"], pixels=True)
    with common.bad_input():
        with bar(f"{mode} {name}", opts["quiet"]) as progress:
            summary = run(world, job, out, progress=progress, chunk_size=opts["chunk_size"],
                          max_memory=opts["max_memory"], preflight=True,
                          export=opts["export"], units=opts["units"])
    if not opts["quiet"]:
        print_summary(summary, job, world, out)
    return summary


def print_summary(summary: dict, job: CertifyJob, world, out: Path) -> None:
    hamming = job.hamming
    unit = "Hamming" if hamming else "L2"
    title = (f"{job.mode} on {world.name}: {job.smoothing.symbol} = {job.scale:g}, "
             f"n0 = {job.n0}, n {'=' if job.schedule == 'fixed' else '≤'} {job.n}, "
             f"α = {job.alpha:g}, {job.num_inputs} inputs")
    table = Table(title=title)
    table.add_column("model")
    table.add_column("SmAcc", justify="right")
    if job.mode == "certify":
        table.add_column("ACR-H" if hamming else "ACR", justify="right")
        marks = [1.0, 2.0] if hamming else [job.scale / 2, job.scale]
        for r in marks:
            table.add_column(f"CA@{r:g}", justify="right")
    table.add_column("abstain", justify="right")
    sequential = job.schedule != "fixed"
    if sequential:
        table.add_column("samples/input", justify="right")
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
        row.append(f"{100 * m['abstain_rate']:.1f}%")
        if sequential:
            row.append(f"{m['samples_per_input']:.0f}")
        row.append(f"{m['seconds_per_input']:.3f}s")
        table.add_row(*row)
    common.console.print(table)
    if "subsets" in summary:
        _print_subsets(summary["subsets"], job)
    if sequential:
        drawn = summary["samples"]
        common.console.print(f"{job.schedule}: {drawn['per_input']:.0f} samples drawn per input "
                             f"(fixed schedule: {drawn['fixed_schedule_per_input']}), "
                             f"{drawn['total']} in all")
    common.console.print(f"{unit} radii; records and summary in {out}/")


def _print_subsets(subsets: dict, job: CertifyJob) -> None:
    """Mean ± sd over subsets per model and the paired tests (`robustness.certification`)."""
    table = Table(title=f"over {subsets['num_subsets']} random subsets of "
                        f"{subsets['subset_size']} inputs (mean ± sd)")
    for column in ("model", "SmAcc", "ACR-H" if job.hamming else "ACR", "radius of correct"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for model, m in subsets["models"].items():
        cells = [f"{m[k]['mean']:.3f} ± {m[k]['sd']:.3f}" if m[k]["mean"] is not None else "–"
                 for k in ("smoothed_accuracy", "acr", "radius_of_correct")]
        table.add_row(model, *cells)
    common.console.print(table)
    for c in subsets["comparisons"]:
        common.console.print(f"Δ {c['metric']} {c['model_a']}−{c['model_b']} = "
                             f"{c['delta']['mean']:.3f} ± {c['delta']['sd']:.3f}, p = {c['p']:.2g}"
                             f" (p_Holm {c['p_holm']:.2g}; {c['test']}, {c['inputs']} inputs)")


@click.command()
@click.option("--sigma", type=float, required=True,
              help="Std of the Gaussian latent noise, in [1e-30, 1e30] (pixels worlds: "
                   "pixel units on [0, 1]).")
@certify_options
def latent(sigma: float, **opts) -> None:
    """Gaussian latent smoothing: certified L2 radii in the generator's latent space.

    Example: certify latent --sigma 0.1
    """
    run_certification("gaussian", sigma, "certify", opts)


def _concept_noise(rho: float | None, flips: int | None) -> tuple[str, float | int]:
    if (rho is None) == (flips is None):
        raise click.UsageError("give exactly one of --rho (Bernoulli flips) or --flips "
                               "(fixed-count flips)")
    return ("bernoulli", rho) if rho is not None else ("fixed", flips)


@click.command()
@click.option("--rho", type=float, default=None,
              help="Flip probability of each concept, in (0, 0.5).")
@click.option("--flips", type=int, default=None,
              help="Fixed-count smoothing: flip exactly this many uniformly chosen concepts.")
@certify_options
def concept(rho: float | None, flips: int | None, **opts) -> None:
    """Concept-flip smoothing: certified Hamming radii in the explicit concept space.

    Example: certify concept --rho 0.2
    """
    run_certification(*_concept_noise(rho, flips), "certify", opts)


@click.command()
@click.option("--space", type=click.Choice(["latent", "concept"]), default="latent",
              show_default=True)
@click.option("--sigma", type=float, default=None, help="Latent noise std (space latent).")
@click.option("--rho", type=float, default=None, help="Concept flip probability (space concept).")
@click.option("--flips", type=int, default=None, help="Fixed-count concept flips (space concept).")
@certify_options
def predict(space: str, sigma, rho, flips, **opts) -> None:
    """Smoothed prediction alone (Cohen et al. PREDICT, abstains when not significant)."""
    if space == "latent":
        if sigma is None:
            raise click.UsageError("--space latent needs --sigma")
        noise, scale = "gaussian", sigma
    else:
        noise, scale = _concept_noise(rho, flips)
    run_certification(noise, scale, "predict", opts)


COMMANDS = (latent, concept, predict)
