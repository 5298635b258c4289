"""Session-wide test settings: a private, empty user data directory; the reduced paper run.

`certify train world` writes to the user's data directory and runners prefer weights found
there over the shipped ones (`cbcert.worlds.builtin.weights_path`). Pointing ``CBCERT_HOME`` at
a fresh directory for the session keeps the suite hermetic: weights a developer trained on this
machine never replace the shipped ones under test, and no test writes into the real home.
Subprocesses inherit the setting.

``paper_run`` is configs/paper.yaml swept and reported at reduced sizes on the shipped weights
(minutes of compilation and figure drawing, so run and reported once, and shared read-only by
tests/test_paper.py and tests/test_report_worlds.py).

Compile once: most of the suite's time is XLA compiling programs that other tests, other modules
(after ``jax.clear_caches`` below) and ``certify`` subprocesses build again. JAX's persistent
compilation cache in one fresh directory per pytest run, with no minimum compile time or size,
turns every repeat into a load from disk. The settings travel through the environment, so
subprocesses and pytest-xdist workers share the run's directory; a fresh directory per run means
no program compiled by another version of the code (or another XLA flag set) is ever reused.
The run also compiles with LLVM at optimisation level 1 (XLA's default: 3): ~1.5x faster
compilation, the users' float32 bits (checked by tests/test_reproducibility.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Set by the first process of a run (xdist's controller, or pytest alone) and inherited by its
# workers and subprocesses: they share its home and cache, and only it removes them.
_OWNER = "CBCERT_TEST_RUN_OWNER"
# XLA's LLVM optimisation level for every program of the run (see below).
SUITE_OPTIMIZATION_LEVEL = "--xla_backend_optimization_level=1"
if _OWNER not in os.environ:
    os.environ[_OWNER] = str(os.getpid())
    os.environ["CBCERT_HOME"] = tempfile.mkdtemp(prefix="cbcert-test-home-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cbcert-test-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    # XLA flags of the whole run, each unless the developer's XLA_FLAGS already names it:
    # * the options cbcert compiles its own programs with (`cbcert.engine.compiler`), for every
    #   program of the run: the tests' reference computations and eager operations compile about
    #   twice as fast (docs/DEVELOPMENT.md); cbcert's programs are compiled exactly as without it;
    # * LLVM at optimisation level 1 instead of XLA's default 3: every program of the run
    #   compiles ~1.5x faster, with the same bits (FMA contraction happens at instruction
    #   selection, which runs at level 1 as at 3; no fast-math reassociation at either level).
    #   Checked on every record of results/reference/ and, on every run, by
    #   tests/test_reproducibility.py's `test_the_suites_optimisation_level_gives_the_users_bits`.
    for _flag in ("--xla_cpu_use_fusion_emitters=false", SUITE_OPTIMIZATION_LEVEL):
        if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(), _flag])
_HOME = os.environ["CBCERT_HOME"]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """After each test module, drop every compiled XLA program (``jax.clear_caches``).

    One pytest process compiles thousands of programs; each holds executable memory mappings,
    and the full suite once died with a segmentation fault inside XLA's compiler after ~90 % of
    the tests while each module alone passes — the signature of a per-process resource
    (``vm.max_map_count`` = 65530 mappings here) running out. Tests within a module keep their
    compilations (compile-once checks are per module).
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_sessionfinish(session, exitstatus):
    del session, exitstatus
    if os.environ[_OWNER] == str(os.getpid()):
        shutil.rmtree(_HOME, ignore_errors=True)
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


PAPER = Path(__file__).resolve().parents[1] / "configs" / "paper.yaml"


def reduced_paper(data: dict) -> dict:
    """configs/paper.yaml cut to seconds: one world per family, every section and every
    certification cell kept (same σ, ρ, budgets), sizes shrunk, the first attack section only
    (each attack section costs three APGD compilations per world; the four kinds are covered
    by tests/test_runs_attack.py and tests/test_report.py)."""
    data = dict(data)
    families: dict = {}
    for entry in data["worlds"]:
        families.setdefault(entry.get("family"), entry)
    data["worlds"] = list(families.values())
    data["world"] = {**data["world"], "num_inputs": 6}
    for section in ("latent", "concept"):
        data[section] = {**data[section], "n0": 4, "n": 12, "subsets": 2, "subset_size": 3}
    data["perturb"] = {**data["perturb"], "subsets": 2, "subset_size": 3}
    data["attack"] = [{**data["attack"][0], "iters": 2, "inputs": 2}]
    data["classes"] = {"samples": 48}
    return data


LATE_WORLD = "late"


@pytest.fixture(scope="session")
def paper_run(tmp_path_factory):
    """``certify sweep`` + ``certify report`` of `reduced_paper` (a directory; do not modify).

    Before the report, the sweep's manifest gains a world the sweep has not reached
    (``LATE_WORLD``: listed, no directory, as while another shard is still running), so the one
    report run also covers an unfinished world. The report's printed notes are in
    `paper_report_output`.
    """
    import json

    import yaml
    from click.testing import CliRunner

    from cbcert.cli import main
    from cbcert.runs import sweep

    tmp = tmp_path_factory.mktemp("paper")
    config = tmp / "paper.yaml"
    config.write_text(yaml.safe_dump(reduced_paper(yaml.safe_load(PAPER.read_text())),
                                     allow_unicode=True))
    out = tmp / "run"
    result = CliRunner().invoke(main, ["sweep", str(config), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / sweep.MANIFEST).read_text())
    manifest["worlds"].append({"name": LATE_WORLD, "family": ""})
    (out / sweep.MANIFEST).write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    (tmp / "report.out").write_text(result.output)
    return out


@pytest.fixture(scope="session")
def paper_report_output(paper_run) -> str:
    """What ``certify report`` printed for `paper_run` (its notes and written files)."""
    return (paper_run.parent / "report.out").read_text()


# Two workers (pytest-xdist, `-n auto` in pyproject.toml) overlap the single-threaded XLA
# compilations on a 2-core machine. Each test module runs whole on one worker (its module-scoped
# fixtures are built once), the modules sharing ``paper_run`` run together, and the modules are
# handed out longest first so that no long module starts last (measured with `--durations=0` on
# the 2-core CI machine; docs/DEVELOPMENT.md). Unlisted modules keep collection order after these.
_LONGEST_FIRST = (
    "test_worlds", "test_benchmarks", "test_paper", "test_report_worlds", "test_runs_attack",
    "test_train_cbae", "test_runs_distributed", "test_runs_certify", "test_reproducibility",
    "test_runs_perturb", "test_cli", "test_api", "test_runs_explain", "test_builtin",
    "test_apgd", "test_examples", "test_runs_sweep",
)
_GROUPS = {"test_paper": "paper_run", "test_report_worlds": "paper_run",
           "test_report_family": "paper_run", "test_report_method": "paper_run"}
_MAX_WORKERS = 4  # each worker holds GiBs of compiled programs


def pytest_collection_modifyitems(items):
    """Order the modules longest first (stable: the order within a module is kept)."""
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU, at most `_MAX_WORKERS`."""
    del config
    return max(1, min(os.cpu_count() or 1, _MAX_WORKERS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Hand out whole modules (``paper_run``'s two as one unit) in collection order.

    xdist's own ``--dist loadgroup`` marks groups by rewriting ``item._nodeid``, which pytest 9
    no longer reads (pytest-xdist 3.8), so the unit of work is chosen here instead.
    """
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return _GROUPS.get(Path(module).stem, module)

    config.option.loadscopereorder = False  # keep the longest-first order
    return ModuleScheduling(config, log)


@pytest.fixture
def kept_figures(monkeypatch):
    """Keep a report module's figures instead of writing them: ``kept_figures(module)`` patches
    ``module.save`` for this test and returns the list each saved figure is appended to (the
    figure's axes can then be checked; nothing is drawn to disk)."""

    def patch(module) -> list:
        figures = []

        def keep(fig, path, **options):
            del options
            figures.append(fig)
            return path

        monkeypatch.setattr(module, "save", keep)
        return figures

    return patch


@pytest.fixture(scope="session")
def resnet18_dir(tmp_path_factory) -> Path:
    """A torchvision-architecture ResNet-18 checkpoint (kind ``resnet18``, random weights, 10
    classes): the starting point the PCBM and PixPNet trainer tests share (do not modify)."""
    from flax import nnx

    from cbcert.io.registry import save_module
    from cbcert.models.resnet import ResNet, ResNetConfig

    out = tmp_path_factory.mktemp("resnet18") / "resnet18"
    module = ResNet(ResNetConfig.from_name("resnet18", num_classes=10), rngs=nnx.Rngs(0))
    save_module(out, "resnet18", module, {"sources": {}})
    return out
