"""The import contract of docs/DESIGN.md, checked with ``ast`` on every module of the package.

Every ``import`` counts, including the lazy ones inside functions: a dependency deferred to run
time is still a dependency. Imports run one way:

    cli → runs → api → (certify | attacks | robustness | report) → engine → concepts, schema
    worlds → (models | generators | io) → nn        convert → io, models, generators

* the engine imports only jax, numpy, the standard library and `cbcert.concepts`;
* the kernels (certify, attacks, robustness) import no flax, models, generators, worlds, runs
  or the public API built on them;
* models and generators never import each other, io, convert, worlds or runs;
* worlds never import convert or training; torch is imported only in convert;
* runs never import the report (the CLI draws what runners return) nor a generator or model
  (they reach them through the world);
* nothing imports the CLI; `concepts` and `schema` import nothing from cbcert;
* no circle: the graph of which module imports which has no cycle.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "cbcert"
STDLIB = set(sys.stdlib_module_names)
KERNELS = ("cbcert.certify", "cbcert.attacks", "cbcert.robustness")

# (importing package, forbidden import prefixes)
FORBIDDEN = [
    *[(k, ("flax", "torch", "cbcert.models", "cbcert.generators", "cbcert.worlds", "cbcert.runs",
           "cbcert.io", "cbcert.convert", "cbcert.training", "cbcert.report", "cbcert.nn",
           "cbcert.api"))
      for k in KERNELS],
    ("cbcert.models", ("cbcert.generators", "cbcert.io", "cbcert.convert", "cbcert.worlds",
                       "cbcert.runs", "cbcert.training")),
    ("cbcert.generators", ("cbcert.models", "cbcert.io", "cbcert.convert", "cbcert.worlds",
                           "cbcert.runs", "cbcert.training")),
    ("cbcert.nn", ("cbcert.models", "cbcert.generators", "cbcert.io", "cbcert.convert",
                   "cbcert.worlds", "cbcert.runs")),
    ("cbcert.io", ("torch", "cbcert.convert", "cbcert.worlds", "cbcert.runs", "cbcert.training")),
    ("cbcert.worlds", ("cbcert.convert", "cbcert.training", "cbcert.runs")),
    ("cbcert.runs", ("cbcert.convert", "cbcert.training", "cbcert.report", "cbcert.generators",
                     "cbcert.models")),
    ("cbcert.report", ("cbcert.convert", "cbcert.training", "cbcert.engine")),
    # The public API sits on the kernels and the engine; runs build on it, not the reverse.
    ("cbcert.api", ("cbcert.runs", "cbcert.convert", "cbcert.training", "cbcert.report",
                    "cbcert.worlds", "flax", "torch")),
]
ENGINE_ALLOWED = ("jax", "numpy", "cbcert.engine", "cbcert.concepts")
LEAVES = ("cbcert.concepts", "cbcert.schema")
# Documented exceptions (importer module, imported module): each needs a reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("cbcert.__main__", "cbcert.cli"): "``python -m cbcert`` is the CLI's entry point",
    ("cbcert.worlds.directory", "cbcert.convert"): "the convenience path of world.json naming "
    "upstream .pkl/.pt/.bin files converts them at load (strict key tables, torch); converted "
    "parts never take it",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # ``from cbcert import cli`` imports the submodule cbcert.cli
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if base == "cbcert"]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_package_has_modules():
    assert len(MODULES) > 40


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_contract(path):
    importer = _module_name(path)
    problems = []
    for line, imported in _imports(path):
        if (importer, imported) in EXCEPTIONS:
            continue
        where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported}"
        top = imported.split(".")[0]
        if _under(imported, "cbcert.cli") and not _under(importer, "cbcert.cli"):
            problems.append(f"{where}: nothing imports the CLI")
        if top == "torch" and not _under(importer, "cbcert.convert"):
            problems.append(f"{where}: torch only in cbcert.convert")
        if _under(importer, "cbcert.engine") and top not in STDLIB and not any(
                _under(imported, allowed) for allowed in ENGINE_ALLOWED):
            problems.append(f"{where}: the engine imports only jax, numpy and concepts")
        if importer in LEAVES and _under(imported, "cbcert"):
            problems.append(f"{where}: {importer} is a leaf")
        for package, forbidden in FORBIDDEN:
            if _under(importer, package):
                problems += [f"{where}: {package} must not import {f}"
                             for f in forbidden if _under(imported, f)]
    assert not problems, "\n".join(problems)


def _loaded(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that the file's imports run (lazy ones included): ``import a.b``
    runs ``a.b``; ``from a import b`` runs the submodule ``a.b`` where there is one, and ``a``
    itself where a name comes from ``a``'s ``__init__``. Parent packages run on the way are
    left out: a package's ``__init__`` importing its submodules, which import each other, is
    no circle."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            submodules = {f"{base}.{a.name}" for a in node.names} & modules
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(base)
    return (found & modules) - {name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[m0, m1, …, m0]`` of the directed graph, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_no_import_cycle():
    """No module reaches itself through imports, lazy ones included (a deferred import hides a
    circle from Python, not from the design: each end then depends on the other)."""
    modules = {_module_name(path) for path in MODULES}
    graph = {_module_name(path): _loaded(path, modules) for path in MODULES}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " → ".join(cycle)


def test_the_cycle_check_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_module_is_small_or_says_why():
    """No module over ~400 lines without a reason at its top (``Size:`` in its docstring)."""
    large = []
    for path in MODULES:
        text = path.read_text()
        if text.count("\n") > 420 and "Size:" not in text[:3000]:
            large.append(f"{path.relative_to(PACKAGE.parent)}: {text.count(chr(10))} lines")
    assert not large, "\n".join(large)


def test_one_class_per_concept():
    """One ``World``, one ``ConfigError``, one checkpoint error type in the package."""
    definitions: dict[str, list[str]] = {}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                definitions.setdefault(node.name, []).append(_module_name(path))
    for name in ("World", "ConfigError", "CheckpointError", "Generator"):
        assert len(definitions.get(name, [])) <= 1, (name, definitions.get(name))
