"""Reports: Markdown + CSV tables and PNG figures from the cell directories of a run.

Reads only what the runners wrote (``run.json`` and ``summary.json`` of every cell; analysis is
separate from sampling) and writes into ``<run>/report/``:

* ``certification_latent.csv`` / ``certification_concept.csv``: per cell (σ, ρ or m) and model,
  smoothed accuracy (abstain = wrong), ACR (ACR-H), certified accuracy at σ/2, σ, 2σ (Hamming
  radii 1, 2, 3), abstain rate and seconds per input;
* ``perturb.csv``: per budget, mean and sd over subsets of CFR, flipped-concept count, PFR per
  model and DFS per concept model; ``perturb_tests.csv``: Δ = PFR_a − PFR_b with the paired
  t-test's p and the Holm-corrected p (SPEC §3);
* ``attack.csv``: clean and robust accuracy per cell, model and ε;
* ``report.md`` with every table, and the figures (matplotlib, Agg): PFR vs ε and vs τ, certified
  accuracy vs radius per certification cell, SmAcc and ACR vs σ and vs ρ, the std-vs-cbm
  robustness-gap heatmap (positive = CBM more robust) and CFR / DFS vs PFR. A figure whose
  data are absent is skipped with a note.

CSV cells hold the summary's numbers at full precision (``repr`` of the float); Markdown rounds
to 4 significant digits and shows ``mean ± sd`` pairs in one column.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cbcert.runs.directory import value_name

REPORT_DIR = "report"
RUN = "run.json"
SUMMARY = "summary.json"
MANIFEST = "manifest.json"
# Certified-accuracy columns: multiples of σ for L2 radii, absolute Hamming radii.
L2_MARKS = (0.5, 1.0, 2.0)
HAMMING_MARKS = (1, 2, 3)


class ReportError(ValueError):
    """The directory holds no finished runner cell."""


@dataclass(frozen=True)
class CellResult:
    """A finished runner directory.

    Attributes:
      name: directory name (the sweep's cell name).
      kind: ``certify``, ``perturb`` or ``attack`` (read from ``run.json``).
      run: the parsed ``run.json``; summary: the parsed ``summary.json``.
    """

    name: str
    kind: Literal["certify", "perturb", "attack"]
    run: dict[str, Any]
    summary: dict[str, Any]


def cell_kind(run: dict[str, Any]) -> str:
    """Which runner wrote a ``run.json``: perturb pins ``settings``, the others a ``job``."""
    if "settings" in run:
        return "perturb"
    job = run.get("job", {})
    if "noise" in job:
        return "certify"
    if "eps" in job and "space" in job:
        return "attack"
    raise ReportError(f"run.json with unknown layout (keys {sorted(run)})")


def find_cells(run_dir: str | Path, log: Callable[[str], None] = print) -> tuple[CellResult, ...]:
    """The finished cells of a sweep directory, or the one cell of a runner's output directory.

    Cells without ``summary.json`` (still running or interrupted) are skipped with a note.
    Raises ReportError if none is found.
    """
    run_dir = Path(run_dir)
    dirs = [run_dir] if (run_dir / RUN).is_file() else sorted(
        (d for d in run_dir.iterdir() if (d / RUN).is_file()), key=_cell_order(run_dir))
    cells = []
    for d in dirs:
        if not (d / SUMMARY).is_file():
            log(f"note: {d} has no {SUMMARY} (unfinished); rerun it to include it")
            continue
        run = json.loads((d / RUN).read_text())
        cells.append(CellResult(d.name, cell_kind(run), run, json.loads((d / SUMMARY).read_text())))
    if not cells:
        raise ReportError(f"{run_dir}: no finished runner directory (run.json + summary.json)")
    return tuple(cells)


def _cell_order(run_dir: Path) -> Callable[[Path], tuple[int, str]]:
    """Sort key: a sweep's manifest order (latent, concept, perturb, attack), then by name."""
    path = run_dir / MANIFEST
    names = [c["name"] for c in json.loads(path.read_text())["cells"]] if path.is_file() else []
    return lambda d: (names.index(d.name) if d.name in names else len(names), d.name)


# ---------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Table:
    """A report table: raw values (str, int, float, bool or None) under named columns."""

    name: str
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def to_csv(self) -> str:
        """CSV with full-precision numbers; None is an empty cell."""
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(self.columns)
        for row in self.rows:
            writer.writerow(["" if v is None else repr(v) if isinstance(v, float) else v
                             for v in row])
        return buffer.getvalue()

    def to_markdown(self) -> str:
        """A GitHub Markdown table; ``x_mean``/``x_sd`` column pairs become one ``x`` column."""
        groups: list[tuple[str, tuple[int, ...]]] = []
        i = 0
        while i < len(self.columns):
            col = self.columns[i]
            pair = col.endswith("_mean") and i + 1 < len(self.columns) and \
                self.columns[i + 1] == col[: -len("_mean")] + "_sd"
            groups.append((col[: -len("_mean")], (i, i + 1)) if pair else (col, (i,)))
            i += 2 if pair else 1
        lines = ["| " + " | ".join(name for name, _ in groups) + " |",
                 "|" + "|".join("---" for _ in groups) + "|"]
        for row in self.rows:
            cells = [" ± ".join(_fmt(row[j]) for j in idx) if row[idx[0]] is not None else "–"
                     for _, idx in groups]
            lines.append("| " + " | ".join(cells) + " |")
        return f"### {self.title}\n\n" + "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _ca_at(entry: dict[str, Any], radius: float) -> float | None:
    """Certified accuracy at ``radius`` from the summary's curve, None if not on the grid."""
    for r, ca in zip(entry.get("radius_grid", ()), entry.get("certified_accuracy", ()),
                     strict=True):
        if math.isclose(r, radius, rel_tol=1e-9, abs_tol=1e-12):
            return ca
    return None


def certification_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Latent (L2) and concept (Hamming) certification tables, one row per cell and model."""
    latent, concept = [], []
    for cell in cells:
        if cell.kind != "certify":
            continue
        s = cell.summary
        for model, m in s["models"].items():
            head = (cell.name, s["mode"])
            tail = (m.get("abstain_rate"), m.get("seconds_per_input"))
            if s["noise"] == "gaussian":
                marks = tuple(_ca_at(m, f * s["scale"]) for f in L2_MARKS)
                latent.append((*head, s["scale"], model, m["num_inputs"],
                               m["smoothed_accuracy"], m.get("acr"), *marks, *tail))
            else:
                marks = tuple(_ca_at(m, r) for r in HAMMING_MARKS)
                concept.append((*head, s["noise"], s["scale"], model, m["num_inputs"],
                                m["smoothed_accuracy"], m.get("acr"), *marks, *tail))
    tables = []
    if latent:
        tables.append(Table(
            "certification_latent", "Certified L2 radii in latent space (Gaussian smoothing)",
            ("cell", "mode", "sigma", "model", "inputs", "smoothed_accuracy", "acr",
             "ca_at_half_sigma", "ca_at_sigma", "ca_at_2sigma", "abstain_rate",
             "seconds_per_input"), tuple(latent)))
    if concept:
        tables.append(Table(
            "certification_concept",
            "Certified Hamming radii in concept space (bernoulli: scale ρ; fixed: m flips)",
            ("cell", "mode", "noise", "scale", "model", "inputs", "smoothed_accuracy", "acr_h",
             *(f"ca_at_{r}" for r in HAMMING_MARKS), "abstain_rate", "seconds_per_input"),
            tuple(concept)))
    return tables


def _budget_label(kind: str, value: float) -> str:
    return f"{kind}{value_name(value)}"


def perturb_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Empirical rates per budget (mean, sd over subsets) and the paired PFR tests."""
    tables = []
    for cell in cells:
        if cell.kind != "perturb":
            continue
        models = cell.summary["settings"]["models"]
        budgets = cell.summary["budgets"]
        dfs_models = [m for m in models if any(m in b["dfs"] for b in budgets)]
        columns = ["cell", "budget", "kind", "value", "subsets", "subset_size",
                   "cfr_mean", "cfr_sd", "cfr_count_mean", "cfr_count_sd"]
        columns += [f"pfr_{m}_{s}" for m in models for s in ("mean", "sd")]
        columns += [f"dfs_{m}_{s}" for m in dfs_models for s in ("mean", "sd")]
        rows, tests = [], []
        for b in budgets:
            label = _budget_label(b["kind"], b["value"])
            row = [cell.name, label, b["kind"], b["value"], b["num_subsets"], b["subset_size"]]
            for key in ("cfr", "cfr_count"):
                row += [b[key]["mean"], b[key]["sd"]] if b[key] else [None, None]
            row += [b["pfr"][m][s] for m in models for s in ("mean", "sd")]
            row += [b["dfs"][m][s] if m in b["dfs"] else None
                    for m in dfs_models for s in ("mean", "sd")]
            rows.append(tuple(row))
            tests += [(cell.name, label, c["model_a"], c["model_b"], c["delta"]["mean"],
                       c["delta"]["sd"], c["t"], c["df"], c["p"], c["p_holm"])
                      for c in b["comparisons"]]
        suffix = "" if _count(cells, "perturb") == 1 else f"_{cell.name}"
        tables.append(Table(f"perturb{suffix}",
                            f"Empirical flip rates, mean ± sd over subsets ({cell.name})",
                            tuple(columns), tuple(rows)))
        tables.append(Table(f"perturb_tests{suffix}",
                            f"Δ = PFR_a − PFR_b, paired t-test, Holm-corrected p ({cell.name})",
                            ("cell", "budget", "model_a", "model_b", "delta_mean", "delta_sd",
                             "t", "df", "p", "p_holm"), tuple(tests)))
    return tables


def attack_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Clean and robust accuracy per attack cell, model and ε (abstain counts as wrong)."""
    rows = []
    for cell in cells:
        if cell.kind != "attack":
            continue
        s, job = cell.summary, cell.run["job"]
        for model, entry in s["models"].items():
            for b in entry["budgets"]:
                rows.append((cell.name, s["space"], s["norm"], s["loss"], s["smoothed"],
                             job.get("scale"), model, b["num_inputs"], entry["clean_accuracy"],
                             b["eps"], b["robust_accuracy"], b["adversarial_abstain_rate"]))
    if not rows:
        return []
    return [Table("attack", "APGD through the generator: clean and robust accuracy",
                  ("cell", "space", "norm", "loss", "smoothed", "scale", "model", "inputs",
                   "clean_accuracy", "eps", "robust_accuracy", "adversarial_abstain_rate"),
                  tuple(rows))]


def _count(cells: Sequence[CellResult], kind: str) -> int:
    return sum(c.kind == kind for c in cells)


# ---------------------------------------------------------------------------- figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def figure_pfr(cell: CellResult, kind: str, path: Path) -> Path | None:
    """PFR (mean ± sd over subsets) per model vs ε (``kind='eps'``) or τ (``'tau'``)."""
    budgets = [b for b in cell.summary["budgets"] if b["kind"] == kind]
    if not budgets:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [b["value"] for b in budgets]
    for model in cell.summary["settings"]["models"]:
        ax.errorbar(x, [b["pfr"][model]["mean"] for b in budgets],
                    yerr=[b["pfr"][model]["sd"] for b in budgets], marker="o", capsize=3,
                    label=model)
    ax.set(xlabel="ε (latent L2 shift)" if kind == "eps" else "τ (concepts flipped)",
           ylabel="PFR", title=f"Prediction flip rate vs {'ε' if kind == 'eps' else 'τ'}")
    ax.legend()
    return _save(fig, path)


def figure_certified_accuracy(cell: CellResult, path: Path) -> Path | None:
    """Certified accuracy vs radius, one curve per model, for one certification cell."""
    s = cell.summary
    if s["mode"] != "certify":
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model, m in s["models"].items():
        ax.step(m["radius_grid"], m["certified_accuracy"], where="post", label=model)
    symbol = {"gaussian": "σ", "bernoulli": "ρ", "fixed": "m"}[s["noise"]]
    unit = "L2 radius" if s["noise"] == "gaussian" else "Hamming radius"
    ax.set(xlabel=unit, ylabel="certified accuracy", ylim=(0, 1.02),
           title=f"Certified accuracy, {symbol} = {s['scale']:g}")
    ax.legend()
    return _save(fig, path)


def figure_vs_scale(cells: Sequence[CellResult], noise: str, path: Path) -> Path | None:
    """SmAcc and ACR (ACR-H) per model vs σ (``gaussian``) or ρ (``bernoulli``)."""
    chosen = sorted((c for c in cells if c.kind == "certify" and c.summary["noise"] == noise
                     and c.summary["mode"] == "certify"), key=lambda c: c.summary["scale"])
    if not chosen:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    scales = [c.summary["scale"] for c in chosen]
    for model in chosen[0].summary["models"]:
        for ax, key in zip(axes, ("smoothed_accuracy", "acr"), strict=True):
            ax.plot(scales, [c.summary["models"][model][key] for c in chosen], marker="o",
                    label=model)
    symbol = "σ" if noise == "gaussian" else "ρ"
    axes[0].set(xlabel=symbol, ylabel="smoothed accuracy", title=f"SmAcc vs {symbol}")
    axes[1].set(xlabel=symbol, ylabel="ACR" if noise == "gaussian" else "ACR-H",
                title=f"{'ACR' if noise == 'gaussian' else 'ACR-H'} vs {symbol}")
    axes[0].legend()
    return _save(fig, path)


def robustness_gaps(cells: Sequence[CellResult]) -> tuple[list[str], list[str], list[list[float]]]:
    """Rows (budgets), columns (metrics) and values of the std-vs-cbm gap, positive = CBM better.

    Metrics: ``ΔPFR = PFR_std − PFR_cbm`` (perturb), ``ΔSmAcc`` and ``ΔACR = cbm − std``
    (certification), ``ΔRobAcc = cbm − std`` (attacks). Missing combinations are NaN.
    """
    columns = ["ΔPFR (std−cbm)", "ΔSmAcc (cbm−std)", "ΔACR (cbm−std)", "ΔRobAcc (cbm−std)"]
    rows: dict[str, dict[str, float]] = {}
    for cell in cells:
        s = cell.summary
        if cell.kind == "perturb" and {"std", "cbm"} <= set(s["settings"]["models"]):
            for b in s["budgets"]:
                label = f"{'ε' if b['kind'] == 'eps' else 'τ'}={b['value']:g} (perturb)"
                rows.setdefault(label, {})[columns[0]] = (
                    b["pfr"]["std"]["mean"] - b["pfr"]["cbm"]["mean"])
        elif cell.kind == "certify" and {"std", "cbm"} <= set(s["models"]):
            std, cbm = s["models"]["std"], s["models"]["cbm"]
            symbol = {"gaussian": "σ", "bernoulli": "ρ", "fixed": "m"}[s["noise"]]
            entry = rows.setdefault(f"{symbol}={s['scale']:g} ({s['mode']})", {})
            entry[columns[1]] = cbm["smoothed_accuracy"] - std["smoothed_accuracy"]
            if "acr" in std:
                entry[columns[2]] = cbm["acr"] - std["acr"]
        elif cell.kind == "attack" and {"std", "cbm"} <= set(s["models"]):
            for b_std, b_cbm in zip(s["models"]["std"]["budgets"], s["models"]["cbm"]["budgets"],
                                    strict=True):
                label = f"ε={b_std['eps']:g} ({cell.name})"
                rows.setdefault(label, {})[columns[3]] = (
                    b_cbm["robust_accuracy"] - b_std["robust_accuracy"])
    values = [[row.get(c, math.nan) for c in columns] for row in rows.values()]
    return list(rows), columns, values


def figure_gap_heatmap(cells: Sequence[CellResult], path: Path) -> Path | None:
    """Heatmap of `robustness_gaps` (diverging colours centred on 0, values annotated)."""
    import numpy as np

    rows, columns, values = robustness_gaps(cells)
    if not rows:
        return None
    data = np.array(values, dtype=np.float64)  # [budgets, metrics]
    keep = ~np.all(np.isnan(data), axis=0)
    data, columns = data[:, keep], [c for c, k in zip(columns, keep, strict=True) if k]
    plt = _pyplot()
    bound = max(float(np.nanmax(np.abs(data))), 1e-9)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(columns), 1.2 + 0.35 * len(rows)))
    image = ax.imshow(np.ma.masked_invalid(data), cmap="RdBu", vmin=-bound, vmax=bound,
                      aspect="auto")
    ax.set_xticks(range(len(columns)), columns, rotation=20, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    for (i, j), v in np.ndenumerate(data):
        if not np.isnan(v):
            ax.text(j, i, f"{v:+.3f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="gap (positive = CBM more robust)")
    ax.set_title("std vs cbm robustness gap")
    return _save(fig, path)


def figure_flips_vs_pfr(cell: CellResult, path: Path) -> Path | None:
    """CFR vs PFR (every model) and DFS vs PFR (concept models), one point per budget."""
    budgets = [b for b in cell.summary["budgets"] if b["cfr"] is not None]
    if not budgets:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for h, model in enumerate(cell.summary["settings"]["models"]):
        pfr = [b["pfr"][model]["mean"] for b in budgets]
        # One colour per model in both panels.
        style = {"label": model, "color": f"C{h}"}
        axes[0].scatter(pfr, [b["cfr"]["mean"] for b in budgets], **style)
        if all(model in b["dfs"] for b in budgets):
            axes[1].scatter(pfr, [b["dfs"][model]["mean"] for b in budgets], **style)
    for b in budgets:
        axes[0].annotate(_budget_label(b["kind"], b["value"]),
                         (b["pfr"]["std"]["mean"] if "std" in b["pfr"] else 0, b["cfr"]["mean"]),
                         fontsize=7)
    axes[0].set(xlabel="PFR", ylabel="CFR", title="Concept vs prediction flips")
    axes[1].set(xlabel="PFR", ylabel="DFS ‖r(x) − r(x̃)‖₂", title="Decision shift vs PFR")
    axes[0].legend()
    if axes[1].has_data():
        axes[1].legend()
    return _save(fig, path)


def write_figures(cells: Sequence[CellResult], out: Path,
                  log: Callable[[str], None] = print) -> list[Path]:
    """Every figure the cells have data for, as PNGs in ``out``; notes for the skipped ones."""
    plans: list[tuple[str, Callable[[Path], Path | None]]] = []
    perturbs = [c for c in cells if c.kind == "perturb"]
    for cell in perturbs:
        prefix = "" if len(perturbs) == 1 else f"{cell.name}_"
        for kind in ("eps", "tau"):
            plans.append((f"{prefix}pfr_vs_{kind}.png",
                          lambda p, c=cell, k=kind: figure_pfr(c, k, p)))
        plans.append((f"{prefix}cfr_dfs_vs_pfr.png", lambda p, c=cell: figure_flips_vs_pfr(c, p)))
    for cell in cells:
        if cell.kind == "certify":
            plans.append((f"certified_accuracy_{cell.name}.png",
                          lambda p, c=cell: figure_certified_accuracy(c, p)))
    plans.append(("smacc_acr_vs_sigma.png", lambda p: figure_vs_scale(cells, "gaussian", p)))
    plans.append(("smacc_acr_vs_rho.png", lambda p: figure_vs_scale(cells, "bernoulli", p)))
    plans.append(("robustness_gap.png", lambda p: figure_gap_heatmap(cells, p)))
    if not perturbs:
        log("note: no perturb cell; skipped pfr_vs_eps, pfr_vs_tau and cfr_dfs_vs_pfr")
    written = []
    for name, draw in plans:
        path = draw(out / name)
        if path is None:
            log(f"note: skipped {name} (no data for it in this run)")
        else:
            written.append(path)
    return written


# ---------------------------------------------------------------------------- report


def tables(cells: Sequence[CellResult]) -> list[Table]:
    """All tables of a run, in report order."""
    return [*certification_tables(cells), *perturb_tables(cells), *attack_tables(cells)]


def _header(run_dir: Path) -> str:
    lines = [f"# Report: {run_dir.resolve().name}", ""]
    path = run_dir / MANIFEST
    if path.is_file():
        m = json.loads(path.read_text())
        versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
        lines += [f"Config `{m['config']['name']}`, world `{m.get('world')}`, "
                  f"seed {m.get('seed')}, git `{m.get('git_revision')}`; {versions}; "
                  f"devices {m.get('devices')}.", ""]
    return "\n".join(lines)


def write_report(run_dir: str | Path, log: Callable[[str], None] = print) -> list[Path]:
    """Write the tables (CSV + ``report.md``) and figures of a run into ``<run_dir>/report/``.

    Returns the written paths. Raises ReportError if ``run_dir`` holds no finished cell.
    """
    run_dir = Path(run_dir)
    cells = find_cells(run_dir, log)
    out = run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    written = []
    all_tables = tables(cells)
    for table in all_tables:
        path = out / f"{table.name}.csv"
        path.write_text(table.to_csv())
        written.append(path)
    figures = write_figures(cells, out, log)
    markdown = [_header(run_dir), *(t.to_markdown() for t in all_tables), "## Figures", ""]
    markdown += [f"![{f.stem}]({f.name})" for f in figures]
    path = out / "report.md"
    path.write_text("\n".join(markdown) + "\n")
    return [*written, *figures, path]


__all__ = [
    "CellResult", "ReportError", "Table", "attack_tables", "cell_kind", "certification_tables",
    "find_cells", "perturb_tables", "robustness_gaps", "tables", "write_figures", "write_report",
]
