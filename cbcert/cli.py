"""``certify``: the command-line front end. Parse, build objects, call the library, print.

Bad input exits with code 2 and a message naming the flag, the value and the allowed range.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from cbcert.config import ConfigError, validate, validate_sample_sizes
from cbcert.runs.directory import RunDirError, check_writable, value_name

# Off a terminal rich would wrap tables at 80 columns; logs and pipes get wide tables.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _check(rule: str, value, flag: str) -> None:
    try:
        validate(rule, value, label=flag)
    except ConfigError as err:
        raise click.BadParameter(str(err).split(": ", 1)[-1], param_hint=flag) from None


def _models(value: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in value.split(",") if m.strip())


def _load_world(preset: str):
    """A world directory (``world.json``) if ``preset`` is an existing directory, else a preset.

    Missing, damaged or mismatched weights and manifests are bad input: exit 2 naming --world.
    """
    from cbcert.builtin import load_builtin

    try:
        if Path(preset).is_dir():
            from cbcert.worlds import load_world_dir

            return load_world_dir(preset)
        return load_builtin(preset)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None


def _writable_out(out: Path) -> Path:
    """``--out`` checked before any work: not under a file, writable."""
    try:
        check_writable(out)
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    return out


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
                     help="Built-in world preset (default, k8, k16, px64, similar5, …) or "
                          "a world directory with a world.json."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Root seed of the pool and of all noise."),
        click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="Output directory (default results/<command>-<scale>-seed<seed>); "
                          "rerunning with the same --out resumes."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return _memory_options(fn)


def _memory_options(fn):
    """``--chunk-size`` and ``--max-memory``: every generator/classifier call stays within them."""
    options = [
        click.option("--chunk-size", type=int, default=None,
                     help="Samples per device step (default: from --max-memory)."),
        click.option("--max-memory", type=int, default=None,
                     help="Bytes per device a chunk may use (default: a quarter of the device "
                          "memory; 8 MiB on CPU)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _check_memory(chunk_size, max_memory) -> None:
    if chunk_size is not None:
        _check("count", chunk_size, "--chunk-size")
    if max_memory is not None:
        _check("count", max_memory, "--max-memory")


def _validate_common(n, n0, alpha, inputs, batch, seed, chunk_size, max_memory, mode) -> None:
    _check("samples", n, "--n")
    _check("alpha", alpha, "--alpha")
    _check("count", inputs, "--inputs")
    _check("count", batch, "--batch")
    _check("seed", seed, "--seed")
    if mode == "certify":
        _check("samples", n0, "--n0")
        try:
            validate_sample_sizes(n0, n, n0_label="--n0", n_label="--n")
        except ConfigError as err:
            raise click.BadParameter(str(err).split(": ", 1)[-1], param_hint="--n0") from None
    _check_memory(chunk_size, max_memory)


def _run_certification(noise: str, scale: float, mode: str, opts: dict, default_out: str):
    from cbcert.certify.runner import CertifyJob, PoolTooSmallError, run

    _validate_common(opts["n"], opts["n0"], opts["alpha"], opts["inputs"], opts["batch"],
                     opts["seed"], opts["chunk_size"], opts["max_memory"], mode)
    if mode == "predict" and opts["two_class"]:
        raise click.BadParameter("PREDICT has no two-class form (its binomial test already "
                                 "compares the top two counts); use it with latent/concept",
                                 param_hint="--two-class")
    models = _distinct_models(opts["models"])
    out = _writable_out(opts["out"] or Path("results") / f"{default_out}-seed{opts['seed']}")
    world = _load_agreement_world(opts["world_name"], models)
    _require_concepts(world, noise != "gaussian")
    k = world.generator.num_concepts
    if noise == "fixed" and scale > k:
        raise click.BadParameter(f"got {scale}, allowed range [1, K={k}] (concepts of "
                                 f"{world.name})", param_hint="--flips")
    job = CertifyJob(noise=noise, scale=scale, mode=mode, n0=opts["n0"], n=opts["n"],
                     alpha=opts["alpha"], two_class=opts["two_class"], models=models,
                     seed=opts["seed"], num_inputs=opts["inputs"], batch=opts["batch"],
                     dtype=opts["dtype"])
    try:
        with _progress(f"{mode} {default_out}", opts["quiet"]) as progress:
            summary = run(world, job, out, progress=progress, chunk_size=opts["chunk_size"],
                          max_memory=opts["max_memory"])
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    except PoolTooSmallError as err:
        raise click.BadParameter(str(err), param_hint="--inputs") from None
    if not opts["quiet"]:
        _print_summary(summary, job, world, out)
    return summary


def _load_agreement_world(world_name: str, models: tuple[str, ...]):
    """Load a world for a command on the std/cbm agreement set and check ``--models``."""
    world = _load_world(world_name)
    try:
        world.check_models(models)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--models") from None
    if "std" not in world.model_names or "cbm" not in world.model_names:
        raise click.BadParameter("the agreement set needs a world with 'std' and 'cbm' models",
                                 param_hint="--world")
    return world


def _distinct_models(value: str) -> tuple[str, ...]:
    """``--models`` as a tuple; each model once (a repeated model would be counted twice)."""
    names = _models(value)
    if len(set(names)) != len(names):
        raise click.BadParameter(f"got {value!r}; name each model once", param_hint="--models")
    return names


def _require_concepts(world, needed: bool) -> None:
    if needed and world.generator.num_concepts == 0:
        raise click.BadParameter(f"{world.name} has no concept bottleneck (no CB-AE): "
                                 "concept-space commands are unavailable", param_hint="--world")


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
    _run_certification("gaussian", sigma, "certify", opts, f"latent-sigma{value_name(sigma)}")


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
        return "bernoulli", rho, f"concept-rho{value_name(rho)}"
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
        noise, scale, name = "gaussian", sigma, f"predict-latent-sigma{value_name(sigma)}"
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
@click.option("--world", "world_name", default="default", show_default=True,
              help="Built-in world preset (default, k8, k16, px64, similar5, …).")
@click.option("--seed", type=int, default=0, show_default=True)
def world_show(n: int, flip: int | None, out: Path, world_name: str, seed: int) -> None:
    """Render a grid of samples with their concept vectors and class names."""
    from cbcert.generators.world import WorldConfig, make_world
    from cbcert.viz import world_grid

    _check("count", n, "--n")
    _check("seed", seed, "--seed")
    folder = out.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        problem = "does not exist" if not folder.exists() else "is not a writable directory"
        raise click.BadParameter(f"{out}: the folder {folder} {problem}", param_hint="--out")
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


def _concept_labeler(directory: Path, preprocess, num_concepts: int):
    """``x -> s[B, K]`` from a converted torchvision classifier with K sigmoid outputs."""
    from cbcert.convert import load_converted
    from cbcert.convert.torchvision import DENSENET_NAMES, RESNET_NAMES

    try:
        apply_fn, params, manifest = load_converted(directory)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--concept-classifier") from None
    if manifest["kind"] not in (*RESNET_NAMES, *DENSENET_NAMES):
        raise click.BadParameter(f"{directory} is kind={manifest['kind']!r}; need a converted "
                                 "torchvision resnet*/densenet* with one logit per concept",
                                 param_hint="--concept-classifier")
    outputs = manifest["config"].get("num_classes")
    if outputs != num_concepts:
        raise click.BadParameter(f"{directory} outputs {outputs} logits but --concepts names "
                                 f"{num_concepts}; they must be equal (one sigmoid logit per "
                                 "concept)", param_hint="--concepts")

    def labeler(x):
        return apply_fn(params, preprocess(x))

    return labeler, {"kind": manifest["kind"], "params_sha256": manifest["params_sha256"]}


@train.command("cbae")
@click.option("--world", "world_dir", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="World directory with a biggan generator and no cbae yet.")
@click.option("--concept-classifier", required=True,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Pseudo-labeler: a `certify convert`ed resnet*/densenet* whose K outputs are "
                   "per-concept logits (present iff > 0); fed the world's preprocessing.")
@click.option("--concepts", required=True, help="Comma-separated names of the K concepts, in "
              "the classifier's output order.")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="New directory for the CB-AE (an unfinished run there is resumed).")
@click.option("--steps", type=int, default=5000, show_default=True)
@click.option("--batch-size", type=int, default=16, show_default=True)
@click.option("--lr", type=float, default=2e-4, show_default=True,
              help="Adam learning rate of both phases (betas 0.5, 0.99).")
@click.option("--threshold", type=float, default=0.9, show_default=True,
              help="Pseudo-label confidence below which a concept label is ignored.")
@click.option("--unsup", type=int, default=10, show_default=True,
              help="Unsupervised bottleneck dims after the 2K concept logits.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--save-every", type=int, default=500, show_default=True,
              help="Steps between progress checkpoints.")
@click.option("--eval-samples", type=int, default=512, show_default=True,
              help="Held-out latents for the final quality report.")
@click.option("--quiet", is_flag=True, help="No progress output.")
def train_cbae_cmd(world_dir: Path, concept_classifier: Path, concepts: str, out: Path,
                   steps: int, batch_size: int, lr: float, threshold: float, unsup: int,
                   seed: int, save_every: int, eval_samples: int, quiet: bool) -> None:
    """Train a CB-AE for a BigGAN world on its [t·z ; class embedding] latent (upstream losses)."""
    from cbcert.train_cbae import CBAETrainConfig, run
    from cbcert.worlds import build_generator, generator_identity, read_manifest

    names = tuple(_models(concepts))
    if not names or len(set(names)) != len(names):
        raise click.BadParameter(f"got {concepts!r}; need distinct, comma-separated names",
                                 param_hint="--concepts")
    for flag, value, low in (("--save-every", save_every, 1), ("--eval-samples", eval_samples, 1)):
        if value < low:
            raise click.BadParameter(f"got {value}, allowed range [{low}, ∞)", param_hint=flag)
    try:
        config = CBAETrainConfig(steps=steps, batch_size=batch_size, recon_lr=lr, interv_lr=lr,
                                 threshold=threshold, num_unsup=unsup, seed=seed)
    except ValueError as err:
        field = str(err).split("=", 1)[0]
        flag = {"recon_lr": "--lr", "num_unsup": "--unsup"}.get(
            field, "--" + field.replace("_", "-"))
        raise click.BadParameter(str(err), param_hint=flag) from None
    try:
        spec = read_manifest(world_dir)
        if spec.cbae is not None:
            raise ValueError(f"{world_dir} already has a CB-AE (cbae in world.json); train on "
                             "a world without one")
        identity = {"generator": generator_identity(spec)}
        generator = build_generator(spec)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--world") from None
    labeler, labeler_id = _concept_labeler(concept_classifier, spec.preprocess, len(names))
    identity["labeler"] = labeler_id
    identity["preprocess"] = {"size": spec.preprocess.size, "mean": spec.preprocess.mean,
                              "std": spec.preprocess.std}
    log = (lambda s: None) if quiet else (lambda s: err_console.print(s))
    try:
        with _progress("train cbae (steps)", quiet) as update:
            def on_step(step, logs):
                if update is not None:
                    update(step, steps)

            manifest = run(generator, labeler, names, config, out, identity=identity,
                           save_every=save_every, eval_samples=eval_samples, log=log,
                           on_step=on_step)
    except ValueError as err:
        raise click.BadParameter(str(err).removeprefix(f"--out {out}: "),
                                 param_hint="--out") from None
    metrics = manifest["metrics"]
    console.print_json(data={k: v for k, v in metrics.items() if not k.endswith("per_concept")})
    console.print(f"wrote {out}; plug it into {world_dir / 'world.json'} as "
                  f'"cbae": {{"trained": "<path relative to the world>"}}')


# ---------------------------------------------------------------------------- empirical robustness


def _budget_list(value: str, flag: str, parse, rule: str) -> tuple:
    """Comma-separated budgets (empty: none of this kind), each checked against ``rule``."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    try:
        budgets = tuple(parse(item) for item in items)
    except ValueError:
        kind = "integers" if parse is int else "numbers"
        raise click.BadParameter(f"expected comma-separated {kind}, got {value!r}",
                                 param_hint=flag) from None
    for budget in budgets:
        _check(rule, budget, flag)
    if len(set(budgets)) != len(budgets):
        raise click.BadParameter(f"got {value!r}; each budget once", param_hint=flag)
    return budgets


@main.command()
@click.option("--eps", "eps_list", default="0.05,0.1,0.3,0.5,0.8", show_default=True,
              help="Geometric budgets: latent shift norms ε > 0, comma-separated ('' for none).")
@click.option("--tau", "tau_list", default="1,2,5,10", show_default=True,
              help="Semantic budgets: numbers of flipped concepts τ in [1, K] ('' for none).")
@click.option("--models", default="std,cbm,proto", show_default=True,
              help="Comma-separated models; Δ compares the first with each other one.")
@click.option("--samples", type=int, default=1, show_default=True,
              help="Perturbations per input and budget.")
@click.option("--ball", is_flag=True, help="ε-shifts uniform in the ball, not on the sphere.")
@click.option("--subsets", type=int, default=5, show_default=True,
              help="Random subsets k of the paired design (>= 2).")
@click.option("--subset-size", type=int, default=200, show_default=True,
              help="Inputs n per subset.")
@click.option("--pool", type=int, default=None,
              help="Agreement inputs perturbed, >= --subset-size (default 2 × --subset-size).")
@click.option("--batch", type=int, default=100, show_default=True,
              help="Inputs per engine call (unit of progress and resumption).")
@click.option("--world", "world_name", default="default", show_default=True,
              help="Built-in world preset or a world directory with a world.json.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Root seed of the pool, the perturbations and the subsets.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/perturb-seed<seed>); rerunning with the "
                   "same --out resumes.")
@_memory_options
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
def perturb(eps_list: str, tau_list: str, models: str, samples: int, ball: bool, subsets: int,
            subset_size: int, pool: int | None, batch: int, world_name: str, seed: int,
            out: Path | None, chunk_size: int | None, max_memory: int | None,
            quiet: bool) -> None:
    """Empirical robustness: PFR, CFR and DFS under latent shifts (ε) and concept flips (τ).

    Perturbs the std/cbm agreement set of a generated pool, then reports mean ± sd over random
    subsets, paired t-tests of PFR differences and Holm-corrected p-values (SPEC §3).

    Example: certify perturb --eps 0.3 --tau 5
    """
    from cbcert.certify.runner import PoolTooSmallError
    from cbcert.robustness.runner import PerturbJob, check_budgets, run

    eps = _budget_list(eps_list, "--eps", float, "eps")
    tau = _budget_list(tau_list, "--tau", int, "count")
    if not eps and not tau:
        raise click.UsageError("give at least one budget with --eps or --tau")
    _check("samples", samples, "--samples")
    for value, flag in ((subset_size, "--subset-size"), (batch, "--batch")):
        _check("count", value, flag)
    _check("subsets", subsets, "--subsets")
    _check("seed", seed, "--seed")
    _check_memory(chunk_size, max_memory)
    if pool is not None and pool < subset_size:
        raise click.BadParameter(f"got {pool}, allowed range [--subset-size={subset_size}, inf)",
                                 param_hint="--pool")
    names = _models(models)
    if len(set(names)) < 2 or len(set(names)) != len(names):
        raise click.BadParameter(f"got {models!r}; give at least two distinct models",
                                 param_hint="--models")
    out = _writable_out(out or Path("results") / f"perturb-seed{seed}")
    world_obj = _load_agreement_world(world_name, names)
    job = PerturbJob(eps=eps, tau=tau, models=names, seed=seed, samples=samples, ball=ball,
                     num_subsets=subsets, subset_size=subset_size, num_inputs=pool or 0,
                     batch=batch)
    k = world_obj.generator.num_concepts
    try:
        check_budgets(job, k)
    except ValueError:
        raise click.BadParameter(f"got {max(tau)}, allowed range [1, K={k}] (concepts of "
                                 f"{world_obj.name})", param_hint="--tau") from None
    try:
        with _progress("perturb", quiet) as progress:
            result = run(world_obj, job, out, progress=progress, chunk_size=chunk_size,
                         max_memory=max_memory)
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    except PoolTooSmallError as err:
        raise click.BadParameter(str(err), param_hint="--pool") from None
    if not quiet:
        _print_perturb(result, job, world_obj, out)


def _print_perturb(result, job, world_obj, out: Path) -> None:
    from cbcert.robustness.protocol import table_cells

    titles = {"eps": "geometric: z̃ = z + ε·u" + (", u in the unit ball" if job.ball else ""),
              "tau": "semantic: τ uniformly chosen concepts flipped"}
    for kind, title in titles.items():
        rows = [row for row in result.rows if row.kind == kind]
        if not rows:
            continue
        headers, body = table_cells(rows)
        table = Table(title=f"{world_obj.name}, {title}")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 else "right")
        for cells in body:
            table.add_row(*cells)
        console.print(table)
    tests = sum(len(row.comparisons) for row in result.rows)
    console.print(
        f"mean ± sd over {job.num_subsets} subsets of {job.subset_size} of "
        f"{job.num_inputs} agreement inputs, {job.samples} perturbation(s) each; "
        f"Δ = PFR difference, p: paired two-sided t-test, p_Holm: Holm over {tests} tests. "
        f"Records and summary in {out}/"
    )


# ---------------------------------------------------------------------------- adversarial


@main.command()
@click.option("--space", type=click.Choice(["latent", "concept"]), default="latent",
              show_default=True,
              help="Perturb the latent z, or the concept representation c = E(g1(z)).")
@click.option("--eps", "eps_list", default="0.01,0.03", show_default=True,
              help="Attack budgets ε > 0 (radii of the --norm ball), comma-separated.")
@click.option("--norm", type=click.Choice(["linf", "l2"]), default="linf", show_default=True)
@click.option("--iters", type=int, default=100, show_default=True,
              help="APGD iterations per restart.")
@click.option("--restarts", type=int, default=1, show_default=True, help="APGD restarts.")
@click.option("--loss", type=click.Choice(["ce", "dlr"]), default="ce", show_default=True,
              help="APGD-CE or APGD-DLR (DLR needs >= 3 classes).")
@click.option("--smoothed", is_flag=True,
              help="Attack the smoothed classifier (EOT loss), judge it with PREDICT.")
@click.option("--sigma", type=float, default=None,
              help="Gaussian smoothing std (--smoothed, --space latent), > 0.")
@click.option("--rho", type=float, default=None,
              help="Concept flip probability (--smoothed, --space concept), in (0, 0.5).")
@click.option("--eot", type=int, default=8, show_default=True,
              help="Noise samples in the attack's expected softmax (--smoothed).")
@click.option("--n", "n", type=int, default=1000, show_default=True,
              help="PREDICT samples per input (--smoothed).")
@click.option("--alpha", type=float, default=0.001, show_default=True,
              help="PREDICT level; it abstains (counted wrong) when not significant.")
@click.option("--inputs", type=int, default=64, show_default=True,
              help="Inputs attacked, from the std/cbm agreement set of the pool.")
@click.option("--batch", type=int, default=16, show_default=True,
              help="Inputs per APGD call (unit of progress and resumption).")
@click.option("--models", default="std,cbm,proto", show_default=True,
              help="Comma-separated models, each attacked on its own.")
@click.option("--world", "world_name", default="default", show_default=True,
              help="Built-in world preset or a world directory with a world.json.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Root seed of the pool, the random starts and all noise.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Output directory (default results/attack-<space>[-smoothed-…]-seed<seed>); "
                   "rerunning with the same --out resumes.")
@_memory_options
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no table.")
def attack(space: str, eps_list: str, norm: str, iters: int, restarts: int, loss: str,
           smoothed: bool, sigma: float | None, rho: float | None, eot: int, n: int,
           alpha: float, inputs: int, batch: int, models: str, world_name: str, seed: int,
           out: Path | None, chunk_size: int | None, max_memory: int | None,
           quiet: bool) -> None:
    """APGD through generator and classifier: clean and robust accuracy per model and ε.

    Each model is attacked on its own, on the std/cbm agreement set, labelled with the shared
    clean prediction (SPEC §5). With --smoothed the attack maximises the smoothed classifier's
    EOT loss and robustness is judged with Monte Carlo PREDICT, abstain counting as wrong.

    Example: certify attack --space latent --eps 0.03
    """
    from cbcert.attacks.runner import AttackJob, run
    from cbcert.certify.runner import PoolTooSmallError

    eps = _budget_list(eps_list, "--eps", float, "eps")
    if not eps:
        raise click.BadParameter(f"got {eps_list!r}; give one or more distinct budgets",
                                 param_hint="--eps")
    for value, flag in ((iters, "--iters"), (restarts, "--restarts"), (inputs, "--inputs"),
                        (batch, "--batch")):
        _check("count", value, flag)
    _check("samples", eot, "--eot")
    _check("samples", n, "--n")
    _check("alpha", alpha, "--alpha")
    _check("seed", seed, "--seed")
    _check_memory(chunk_size, max_memory)
    scale, name = _attack_smoothing(space, smoothed, sigma, rho)
    names = _distinct_models(models)
    out = _writable_out(out or Path("results") / f"attack-{space}{name}-seed{seed}")
    world_obj = _load_agreement_world(world_name, names)
    _require_concepts(world_obj, space == "concept")
    if loss == "dlr" and world_obj.num_classes < 3:
        raise click.BadParameter(f"DLR needs >= 3 classes, {world_obj.name} has "
                                 f"{world_obj.num_classes}", param_hint="--loss")
    job = AttackJob(space=space, eps=eps, norm=norm, iters=iters, restarts=restarts, loss=loss,
                    smoothed=smoothed, scale=scale, eot=eot, n=n, alpha=alpha, models=names,
                    seed=seed, num_inputs=inputs, batch=batch)
    try:
        with _progress(f"attack {space}", quiet) as progress:
            summary = run(world_obj, job, out, progress=progress, chunk_size=chunk_size,
                          max_memory=max_memory)
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    except PoolTooSmallError as err:
        raise click.BadParameter(str(err), param_hint="--inputs") from None
    if not quiet:
        _print_attack(summary, job, world_obj, out)


def _attack_smoothing(space: str, smoothed: bool, sigma, rho) -> tuple[float | None, str]:
    """The smoothing scale of an attack and its output-name suffix (None, '' when not smoothed)."""
    flag, value, other_flag, other = (("--sigma", sigma, "--rho", rho) if space == "latent"
                                      else ("--rho", rho, "--sigma", sigma))
    if other is not None:
        raise click.UsageError(f"{other_flag} does not apply to --space {space} (use {flag})")
    if not smoothed:
        if value is not None:
            raise click.UsageError(f"{flag} needs --smoothed")
        return None, ""
    if value is None:
        raise click.UsageError(f"--smoothed --space {space} needs {flag}")
    _check(flag.lstrip("-"), value, flag)
    return value, f"-smoothed-{flag.lstrip('-')}{value_name(value)}"


def _print_attack(summary: dict, job, world_obj, out: Path) -> None:
    attack_name = f"APGD-{job.loss.upper()}"
    target = "base classifiers"
    if job.smoothed:
        symbol = "σ" if job.space == "latent" else "ρ"
        target = (f"smoothed classifiers ({symbol} = {job.scale:g}, EOT {job.eot}, "
                  f"PREDICT n = {job.n}, α = {job.alpha:g})")
    table = Table(title=f"{attack_name} ({job.norm}) in {job.space} space, {world_obj.name}",
                  caption=f"{job.iters} iterations, {job.restarts} restart(s), {target}")
    table.add_column("model")
    table.add_column("clean", justify="right")
    for eps in job.eps:
        table.add_column(f"ε={eps:g}", justify="right")
    for model, entry in summary["models"].items():
        cells = [f"{100 * b['robust_accuracy']:.1f}%" for b in entry["budgets"]]
        table.add_row(model, f"{100 * entry['clean_accuracy']:.1f}%", *cells)
    console.print(table)
    console.print(f"accuracy on {job.num_inputs} agreement inputs (abstain counts as wrong); "
                  f"records and summary in {out}/")


# ---------------------------------------------------------------------------- conversion


@main.command("convert")
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
              help="pixpnet: its config.yaml.")
def convert_cmd(kind, checkpoint, out_dir, backbone, backbone_path, concept_bank, config_path):
    """Convert a PyTorch classifier checkpoint to a Flax/orbax checkpoint with a manifest.

    KIND: resnet18/34/50/101/152, densenet121/161/169/201, pcbm or pixpnet. Needs torch
    (pip install 'cbcert[torch]').
    """
    from cbcert.convert import KINDS, convert

    if kind not in KINDS:
        raise click.BadParameter(f"got {kind!r}, allowed: {', '.join(KINDS)}", param_hint="KIND")
    try:
        manifest = convert(kind, checkpoint, out_dir, backbone=backbone,
                           backbone_path=backbone_path, concept_bank_path=concept_bank,
                           config_path=config_path)
    except ImportError as err:
        raise click.ClickException(f"{err}; install the torch extra: pip install "
                                   "'cbcert[torch]'") from None
    except ValueError as err:  # a bad checkpoint, bank or config is bad input: exit 2
        raise click.UsageError(str(err)) from None
    console.print(f"wrote {out_dir} ({manifest.get('kind', kind)})")


# ---------------------------------------------------------------------------- sweeps and reports


@contextlib.contextmanager
def _sweep_progress(quiet: bool):
    """``cell name -> callback(done, total)``: one rich bar per cell; None when quiet/no TTY."""
    if quiet or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=err_console) as bar:

        def for_cell(name: str):
            task = bar.add_task(name, total=None)
            return lambda done, total: bar.update(task, completed=done, total=total)

        yield for_cell


def _sweep_world(preset: str):
    from cbcert.builtin import load_builtin

    try:
        return load_builtin(preset)
    except ValueError as err:
        raise click.BadParameter(f"section 'world', key 'preset': {err}",
                                 param_hint="CONFIG") from None


@main.command("sweep")
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Sweep directory (default results/<config file name>); rerunning resumes.")
@click.option("--world", "world_name", default=None,
              help="Run the config on this world instead of its world.preset: a built-in preset "
                   "or a world directory with a world.json.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no per-cell lines.")
def sweep_cmd(config_path: Path, out: Path | None, world_name: str | None, quiet: bool) -> None:
    """Run every cell of an experiment config into OUT/<cell>/ and write OUT/manifest.json.

    Cells: one certification per σ (latent) and per ρ and fixed flip count m (concept), one
    perturb run with all budgets, one attack run. Only the sections the file names are swept
    (all four if it names none). Interrupted sweeps resume when rerun with the same --out.

    Example: certify sweep configs/reference.yaml --out results/reference
    (add --world <dir> to run the same cells on a world from real parts).
    """
    from cbcert import sweep
    from cbcert.certify.runner import PoolTooSmallError
    from cbcert.config import load_config

    try:
        config = load_config(config_path)
        sections = sweep.sections_in_file(config_path)
    except ConfigError as err:
        raise click.BadParameter(str(err), param_hint="CONFIG") from None
    out = _writable_out(out or Path("results") / config_path.stem)

    def done(cell, summary) -> None:
        if not quiet:
            console.print(f"{cell.name}: done, records and summary in {out / cell.name}/")

    try:
        with _sweep_progress(quiet) as progress:
            load = _sweep_world if world_name is None else (lambda _: _load_world(world_name))
            sweep.run_sweep(config, out, sections=sections, load_world=load,
                            progress=progress, on_cell=done)
    except RunDirError as err:
        raise click.BadParameter(str(err), param_hint="--out") from None
    except PoolTooSmallError as err:
        raise click.BadParameter(f"section 'world', key 'num_inputs': {err}",
                                 param_hint="CONFIG") from None
    except ConfigError as err:
        raise click.BadParameter(f"{config_path}: {err}", param_hint="CONFIG") from None
    if not quiet:
        console.print(f"sweep finished; manifest in {out / sweep.MANIFEST}; "
                      f"tables and figures: certify report {out}")


@main.command("report")
@click.argument("run_dir", metavar="RUN_DIR",
                type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="No notes and no list of written files.")
def report_cmd(run_dir: Path, quiet: bool) -> None:
    """Markdown + CSV tables and PNG figures of a sweep (or one runner's) directory.

    Written to RUN_DIR/report/; figures whose data are absent are skipped with a note.

    Example: certify report results/reference
    """
    from cbcert import report

    try:
        written = report.write_report(run_dir, log=(lambda _: None) if quiet else console.print)
    except report.ReportError as err:
        raise click.BadParameter(str(err), param_hint="RUN_DIR") from None
    if not quiet:
        console.print(f"wrote {len(written)} files to {run_dir / report.REPORT_DIR}/")
