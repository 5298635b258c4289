"""The method's figures and tables by number, in the method's layouts, from a run's cells.

The method (``../shared/method/``, "Interpretable but Fragile?") numbers ten figures and sixteen
tables. `write_method_outputs` writes every one the run's cells can regenerate into the
report folder under the method's number (`OUTPUTS`); `ABSENT` says why the others are not.
Which world plays which of the method's settings is `cbcert.report.method_settings`'s
business; a setting whose world is not in the run is left out of a figure or table (its
title says so), and a number none of whose data are in the run is skipped with a note.

Conventions, the method's throughout:

* f_std is the ``std`` model (the method's ResNet), f_cbm the ``cbm`` model (PCBM), PixPNet
  the ``proto`` model; cbcert's ``cbmh`` is not one of the method's models and is left out.
* R (latent, L2) and Δ⋆ (concept, Hamming) are R̄, the mean certified radius over the
  correctly classified, non-abstaining inputs of a subset (never ACR over all inputs, which
  counts wrong and abstaining inputs as radius 0); the method's "ACR" of Tables 14 and 16 is
  defined the same way and is R̄ here too. SmAcc counts abstentions as wrong.
* Mean ± sd over the 5 random subsets of 200 certified inputs (the summaries' ``subsets``);
  paired tests are two-sided paired t-tests over the subsets' values (df = 4), Holm over the
  family the method names for each table.
* CFR is the mean number of concepts flipped per input (the method's Table 1 lists CFR = τ
  for τ flips), PFR is in percent, DFS is f_cbm's concept-score shift ‖r(x) − r(x̃)‖₂.
* Figures colour by perturbation type (`TYPE_COLOURS`: geometric ε, σ; semantic τ, ρ) where
  the method does (Figures 3, 6(c), 9) and by model (`model_colour`) everywhere else; where the
  method colours by dataset or setting, the setting is the line style or hatch instead.

Budgets are the method's (ε ∈ {0.05, 0.1, 0.3, 0.5, 0.8}, τ ∈ {1, 2, 5, 10}, with 7 where its
table lists it, σ ∈ {0.01, 0.05, 0.1, 0.3}, ρ ∈ {0.05, 0.1, 0.2}, m ∈ {1, 2, 4}); a budget the
run lacks is left out and the title says so.

The builders live in small modules that this one imports: `cbcert.report.method_run` (the
run accessor `MethodRun` and the shared models, budgets and settings),
`cbcert.report.method_tables` (Tables 1–16), `cbcert.report.method_figures` (Figures 1(b)–5
and 9) and `cbcert.report.method_setting_figures` (Figures 6, 7 and 10), the two figure
modules sharing their axes helpers through `cbcert.report.method_plotting`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cbcert.report.method_figures import (
    figure1b,
    figure1c,
    figure2,
    figure3,
    figure4,
    figure5,
    figure9,
)
from cbcert.report.method_run import MethodRun
from cbcert.report.method_setting_figures import figure6, figure7, figure10
from cbcert.report.method_tables import (
    table1,
    table2,
    table3,
    table4,
    table5,
    table6,
    table7,
    table8,
    table9,
    table12,
    table13,
    table14,
    table15,
    table16,
)
from cbcert.report.plotting import draw_plans
from cbcert.report.tables import Table

if TYPE_CHECKING:
    from cbcert.report.worlds import WorldCells

# The method's number → the file written for it (report folder).
OUTPUTS: dict[str, str] = {
    "fig1b": "fig1b_robustness_gap.png",
    "fig1c": "fig1c_concept_radius_contrast.png",
    "fig2": "fig2_pfr_geometric_semantic.png",
    "fig3": "fig3_pfr_vs_dfs_cfr.png",
    "fig4": "fig4_smoothing.png",
    "fig5": "fig5_attacks.png",
    "fig6": "fig6_class_structure.png",
    "fig7": "fig7_vocabulary.png",
    "fig9": "fig9_pfr_dfs_cfr.png",
    "fig10": "fig10_class_distances.png",
    "table1": "table1_empirical.csv",
    "table2": "table2_pfr_tests.csv",
    "table3": "table3_smoothing.csv",
    "table4": "table4_latent_smoothing_tests.csv",
    "table5": "table5_concept_smoothing_tests.csv",
    "table6": "table6_class_structure_empirical.csv",
    "table7": "table7_class_structure_smoothing.csv",
    "table8": "table8_vocabulary_empirical.csv",
    "table9": "table9_vocabulary_smoothing.csv",
    "table12": "table12_attacks.csv",
    "table13": "table13_prototype_pfr.csv",
    "table14": "table14_families_latent_smoothing.csv",
    "table15": "table15_prototype_concept_smacc.csv",
    "table16": "table16_prototype_concept_certified.csv",
}
# The method's number → why no run of cbcert regenerates it.
ABSENT: dict[str, str] = {
    "fig1a": "a schematic of the evaluation framework (geometric vs semantic perturbations, "
             "empirical vs certified criteria); it holds no data",
    "fig8": "a schematic of the generator-based perturbation pipeline (latent shifts within ε, "
            "τ concept flips before decoding); it holds no data",
    "table10": "DenseNet-161 as a second standard backbone: every built-in world has one "
               "standard classifier architecture (the ResNet-style f_std), so there is no "
               "f_dn to compare",
    "table11": "latent smoothing of the DenseNet-161 models: no second architecture in the "
               "worlds (see Table 10)",
}

# The method's number → the builder of its table, or of its figure at a path.
_TABLES: dict[str, Callable[[MethodRun], Table | None]] = {
    "table1": table1, "table2": table2, "table3": table3, "table4": table4, "table5": table5,
    "table6": table6, "table7": table7, "table8": table8, "table9": table9,
    "table12": table12, "table13": table13, "table14": table14, "table15": table15,
    "table16": table16,
}
_FIGURES: dict[str, Callable[[MethodRun, Path], Path | None]] = {
    "fig1b": figure1b, "fig1c": figure1c, "fig2": figure2, "fig3": figure3, "fig4": figure4,
    "fig5": figure5, "fig6": figure6, "fig7": figure7, "fig9": figure9, "fig10": figure10,
}


def _tables(run: MethodRun, log: Callable[[str], None]) -> list[tuple[str, Table]]:
    """``(number, table)`` of every table the run has data for; notes for the others."""
    out = []
    for number, build in _TABLES.items():
        table = build(run)
        if table is None:
            log(f"note: skipped {OUTPUTS[number]} (the run has no data for the method's "
                f"{number})")
        else:
            out.append((number, table))
    return out


def method_tables(worlds: Sequence[WorldCells], tables: Sequence[Table],
                  log: Callable[[str], None] = print) -> list[Table]:
    """The method's tables the run can regenerate, in number order, each named by its file's
    stem (`OUTPUTS`); a table without data is noted as skipped. ``tables``: the run's
    cross-world tables (`cbcert.report.worlds.cross_world_tables`), read for Tables 2 and 12."""
    return [table for _, table in _tables(MethodRun(worlds, tables), log)]


def write_method_outputs(worlds: Sequence[WorldCells], tables: Sequence[Table], out: Path,
                         log: Callable[[str], None] = print) -> list[Path]:
    """Write the method's figures (PNG) and tables (CSV) by number into ``out`` (the run's
    report folder): the files of `OUTPUTS` the run has data for, figures first; the others are
    noted as skipped. Returns the written paths.

    ``worlds``: the run's `WorldCells` (`cbcert.report.worlds.world_cells`); ``tables``: its
    cross-world tables (`cbcert.report.worlds.cross_world_tables`), read for Tables 2 and 12.
    Raises `DamagedFileError` naming a certification cell whose records do not match its
    summary's subsets."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = MethodRun(worlds, tables)
    written = draw_plans([(OUTPUTS[number], lambda p, draw=draw: draw(run, p))
                          for number, draw in _FIGURES.items()], out, log,
                         "the run has no data for it")
    for number, table in _tables(run, log):
        path = out / OUTPUTS[number]
        path.write_text(table.to_csv())
        written.append(path)
    return written


__all__ = ["ABSENT", "OUTPUTS", "method_tables", "write_method_outputs"]
