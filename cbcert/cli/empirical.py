"""``certify perturb`` (empirical flip rates) and ``certify attack`` (APGD)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.table import Table

from cbcert.certify.smoothing import attack_name, of_space
from cbcert.cli import common
from cbcert.cli.distributed import distributed_options
from cbcert.cli.progress import bar
from cbcert.runs.attack import AttackJob
from cbcert.runs.perturb import PerturbJob

# PerturbJob's ``num_inputs`` is ``--pool``: agreement inputs perturbed, not certified.
PERTURB_FLAGS = {"num_inputs": "--pool", "num_subsets": "--subsets", "eps": "--eps",
                 "tau": "--tau", "sigma": "--sigma", "rho": "--rho", "explain": "--explain"}


def _perturb_default(name: str):
    return common.default_of(PerturbJob, name)


def _attack_default(name: str):
    return common.default_of(AttackJob, name)


def _csv(values) -> str:
    return ",".join(f"{v:g}" for v in values)


@click.command()
@click.option("--eps", "eps_list", default=_csv(_perturb_default("eps")), show_default=True,
              help="Geometric budgets: latent shift norms ε > 0, comma-separated ('' for none).")
@click.option("--tau", "tau_list", default=_csv(_perturb_default("tau")), show_default=True,
              help="Semantic budgets: numbers of flipped concepts τ in [1, K] ('' for none).")
@click.option("--sigma", "sigma_list", default="", show_default=True,
              help="Smoothing budgets: latent Gaussian noise σ (certify latent's noise), "
                   "comma-separated.")
@click.option("--rho", "rho_list", default="", show_default=True,
              help="Smoothing budgets: Bernoulli concept flip probabilities ρ in (0, 0.5) "
                   "(certify concept's noise), comma-separated.")
@click.option("--models", default=",".join(_perturb_default("models")), show_default=True,
              help="Comma-separated models; Δ compares the first with each other one.")
@click.option("--samples", type=int, default=_perturb_default("samples"), show_default=True,
              help="Perturbations per input and budget.")
@click.option("--ball", is_flag=True, help="ε-shifts uniform in the ball, not on the sphere.")
@click.option("--subsets", type=int, default=_perturb_default("num_subsets"), show_default=True,
              help="Random subsets k of the paired design (>= 2).")
@click.option("--subset-size", type=int, default=_perturb_default("subset_size"),
              show_default=True, help="Inputs n per subset.")
@click.option("--pool", type=int, default=None,
              help="Agreement inputs perturbed, >= --subset-size (default 2 × --subset-size).")
@click.option("--batch", type=int, default=_perturb_default("batch"), show_default=True,
              help="Inputs per engine call (unit of progress and resumption).")
@common.world_option()
@click.option("--seed", type=int, default=_perturb_default("seed"), show_default=True,
              help="Root seed of the pool, the perturbations and the subsets.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/perturb-seed<seed>); rerunning with the "
                   "same --out resumes.")
@click.option("--explain", is_flag=True,
              help="Also record the top-5 explanations of cbm/cbmh (concepts) and proto "
                   "(prototypes), clean and perturbed, "
                   "and report their stability (overlap, Kendall τ).")
@common.memory_options
@distributed_options
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
def perturb(eps_list: str, tau_list: str, sigma_list: str, rho_list: str, models: str,
            samples: int, ball: bool, subsets: int,
            subset_size: int, pool: int | None, batch: int, world_name: str, seed: int,
            out: Path | None, explain: bool, chunk_size: int | None, max_memory: int | None,
            quiet: bool) -> None:
    """Empirical robustness: PFR, CFR and DFS under latent shifts (ε), concept flips (τ) and
    the smoothing noises (σ, ρ).

    Perturbs the std/cbm agreement set of a generated pool, then reports mean ± sd over random
    subsets and paired tests of PFR differences with Holm-corrected p-values (SPEC §3).

    Example: certify perturb --eps 0.3 --tau 5 --sigma 0.1 --rho 0.2
    """
    from cbcert.runs.perturb import check_budgets, run

    eps = common.budgets(eps_list, "--eps", float)
    tau = common.budgets(tau_list, "--tau", int)
    sigma = common.budgets(sigma_list, "--sigma", float)
    rho = common.budgets(rho_list, "--rho", float)
    if not (eps or tau or sigma or rho):
        raise click.UsageError("give at least one budget with --eps, --tau, --sigma or --rho")
    if pool is not None and pool < 1:  # PerturbJob would read num_inputs=0 as its default
        raise click.BadParameter(f"got {pool}, allowed range [subset_size={subset_size}, inf)",
                                 param_hint="--pool")
    with common.bad_input(PERTURB_FLAGS):
        job = PerturbJob(eps=eps, tau=tau, sigma=sigma, rho=rho, models=common.names(models),
                         seed=seed,
                         samples=samples, ball=ball, num_subsets=subsets,
                         subset_size=subset_size, num_inputs=pool or 0, batch=batch,
                         explain=explain)
    common.check_memory(chunk_size, max_memory)
    out = common.writable_out(out or Path("results") / f"perturb-seed{seed}")
    world = common.load_agreement_world(world_name, job.models)
    with common.bad_input(PERTURB_FLAGS):
        check_budgets(job, world.generator.num_concepts)
        with bar("perturb", quiet, unit="inputs") as progress:
            result = run(world, job, out, progress=progress, chunk_size=chunk_size,
                         max_memory=max_memory)
    if not quiet:
        _print_perturb(result, job, world, out)


def _print_perturb(result, job: PerturbJob, world, out: Path) -> None:
    from cbcert.robustness.protocol import table_cells

    titles = {"eps": "geometric: z̃ = z + ε·u" + (", u in the unit ball" if job.ball else ""),
              "tau": "semantic: τ uniformly chosen concepts flipped",
              "sigma": "smoothing noise: z̃ = z + σ·N(0, I)",
              "rho": "smoothing noise: each concept flipped with probability ρ"}
    for kind, title in titles.items():
        rows = [row for row in result.extras["rows"] if row.kind == kind]
        if not rows:
            continue
        headers, body = table_cells(rows)
        table = Table(title=f"{world.name}, {title}")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 else "right")
        for cells in body:
            table.add_row(*cells)
        common.console.print(table)
    if "explanations" in result.summary:
        _print_explanations(result.summary["explanations"], world)
    tests = sum(len(row.comparisons) for row in result.extras["rows"])
    common.console.print(
        f"mean ± sd over {job.num_subsets} subsets of {job.subset_size} of "
        f"{job.num_inputs} agreement inputs, {job.samples} perturbation(s) each; "
        f"Δ = PFR difference; p: paired sign-flip permutation test over the subsets' inputs, "
        f"p_Holm: Holm over {tests} tests. "
        f"Records and summary in {out}/"
    )


def _print_explanations(rows: list[dict], world) -> None:
    """Explanation stability per budget: top-5 overlap and Kendall τ, mean ± sd per model."""
    def cell(entry: dict) -> str:
        return "–" if entry["mean"] is None else f"{entry['mean']:.3f} ± {entry['sd']:.3f}"

    models = list(rows[0]["overlap"])
    table = Table(title=f"{world.name}, explanation stability (top-5 concepts; proto: prototypes)")
    table.add_column("budget")
    for m in models:
        table.add_column(f"overlap {m}", justify="right")
        table.add_column(f"Kendall τ {m}", justify="right")
    for row in rows:
        table.add_row(f"{row['kind']} {row['value']:g}", *(
            c for m in models for c in (cell(row["overlap"][m]), cell(row["kendall"][m]))))
    common.console.print(table)


@click.command()
@click.option("--space", type=click.Choice(["latent", "concept"]),
              default=_attack_default("space"), show_default=True,
              help="Perturb the latent z, or the concept representation c = E(g1(z)).")
@click.option("--eps", "eps_list", default=_csv(_attack_default("eps")), show_default=True,
              help="Attack budgets ε > 0 (radii of the --norm ball), comma-separated.")
@click.option("--norm", type=click.Choice(["linf", "l2"]), default=_attack_default("norm"),
              show_default=True)
@click.option("--iters", type=int, default=_attack_default("iters"), show_default=True,
              help="APGD iterations per restart.")
@click.option("--restarts", type=int, default=_attack_default("restarts"), show_default=True,
              help="APGD restarts.")
@click.option("--loss", type=click.Choice(["ce", "dlr"]), default=_attack_default("loss"),
              show_default=True, help="APGD-CE or APGD-DLR (DLR needs >= 3 classes).")
@click.option("--smoothed", is_flag=True,
              help="Attack the smoothed classifier (EOT loss), judge it with PREDICT.")
@click.option("--sigma", type=float, default=None,
              help="Gaussian smoothing std (--smoothed, --space latent).")
@click.option("--rho", type=float, default=None,
              help="Concept flip probability (--smoothed, --space concept), in (0, 0.5).")
@click.option("--eot", type=int, default=_attack_default("eot"), show_default=True,
              help="Noise samples in the attack's expected softmax (--smoothed).")
@click.option("--n", "n", type=int, default=_attack_default("n"), show_default=True,
              help="PREDICT samples per input (--smoothed).")
@click.option("--alpha", type=float, default=_attack_default("alpha"), show_default=True,
              help="PREDICT level; it abstains (counted wrong) when not significant.")
@click.option("--inputs", type=int, default=_attack_default("num_inputs"), show_default=True,
              help="Inputs attacked, from the std/cbm agreement set of the pool.")
@click.option("--batch", type=int, default=_attack_default("batch"), show_default=True,
              help="Inputs per APGD call (unit of progress and resumption).")
@click.option("--models", default=",".join(_attack_default("models")), show_default=True,
              help="Comma-separated models, each attacked on its own.")
@click.option("--explain", is_flag=True,
              help="Record cbm/cbmh/proto explanations at the clean and the adversarial point "
                   "(base attacks).")
@common.world_option()
@click.option("--seed", type=int, default=_attack_default("seed"), show_default=True,
              help="Root seed of the pool, the random starts and all noise.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/attack-<space>[-smoothed-…]-seed<seed>); "
                   "rerunning with the same --out resumes.")
@common.memory_options
@common.units_option("(batch, model, ε) units")
@distributed_options
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
def attack(space: str, eps_list: str, norm: str, iters: int, restarts: int, loss: str,
           smoothed: bool, sigma: float | None, rho: float | None, eot: int, n: int,
           alpha: float, inputs: int, batch: int, models: str, explain: bool, world_name: str,
           seed: int, out: Path | None, chunk_size: int | None, max_memory: int | None,
           units: int | None, quiet: bool) -> None:
    """APGD through generator and classifier: clean and robust accuracy per model and ε.

    Each model is attacked on its own, on the std/cbm agreement set, labelled with the shared
    clean prediction (SPEC §5). With --smoothed the attack maximises the smoothed classifier's
    EOT loss and robustness is judged with Monte Carlo PREDICT, abstain counting as wrong.

    Example: certify attack --space latent --eps 0.03
    """
    from cbcert.runs.attack import run

    eps = common.budgets(eps_list, "--eps", float)
    scale = _attack_scale(space, smoothed, sigma, rho)
    with common.bad_input():
        job = AttackJob(space=space, eps=eps, norm=norm, iters=iters, restarts=restarts,
                        loss=loss, smoothed=smoothed, scale=scale, eot=eot, n=n, alpha=alpha,
                        models=common.names(models), seed=seed, num_inputs=inputs, batch=batch,
                        explain=explain)
    common.check_memory(chunk_size, max_memory)
    common.check_units(units)
    name = attack_name(space, scale if smoothed else None)
    out = common.writable_out(out or Path("results") / f"{name}-seed{seed}")
    world = common.load_agreement_world(world_name, job.models, concepts=space == "concept")
    if loss == "dlr" and world.num_classes < 3:
        raise click.BadParameter(f"DLR needs >= 3 classes, {world.name} has "
                                 f"{world.num_classes}", param_hint="--loss")
    with common.bad_input(), bar(f"attack {space}", quiet, unit="units") as progress:
        summary = run(world, job, out, progress=progress, chunk_size=chunk_size,
                      max_memory=max_memory, units=units)
    if not quiet:
        _print_attack(summary, job, world, out)


def _attack_scale(space: str, smoothed: bool, sigma, rho) -> float | None:
    """The smoothing scale an attack's flags give (None when not smoothed)."""
    key = of_space(space).key
    value, other = (sigma, rho) if key == "sigma" else (rho, sigma)
    flag, other_flag = f"--{key}", "--rho" if key == "sigma" else "--sigma"
    if other is not None:
        raise click.UsageError(f"{other_flag} does not apply to --space {space} (use {flag})")
    if not smoothed:
        if value is not None:
            raise click.UsageError(f"{flag} needs --smoothed")
        return None
    if value is None:
        raise click.UsageError(f"--smoothed --space {space} needs {flag}")
    return value


def _print_attack(summary: dict, job: AttackJob, world, out: Path) -> None:
    attack_name = f"APGD-{job.loss.upper()}"
    target = "base classifiers"
    if job.smoothed:
        target = (f"smoothed classifiers ({of_space(job.space).symbol} = {job.scale:g}, "
                  f"EOT {job.eot}, PREDICT n = {job.n}, α = {job.alpha:g})")
    table = Table(title=f"{attack_name} ({job.norm}) in {job.space} space, {world.name}",
                  caption=f"{job.iters} iterations, {job.restarts} restart(s), {target}")
    table.add_column("model")
    table.add_column("clean", justify="right")
    for eps in job.eps:
        table.add_column(f"ε={eps:g}", justify="right")
    for model, entry in summary["models"].items():
        cells = [f"{100 * b['robust_accuracy']:.1f}%" for b in entry["budgets"]]
        table.add_row(model, f"{100 * entry['clean_accuracy']:.1f}%", *cells)
    common.console.print(table)
    common.console.print(f"accuracy on {job.num_inputs} agreement inputs (abstain counts as "
                         f"wrong); records and summary in {out}/")


COMMANDS = (perturb, attack)
