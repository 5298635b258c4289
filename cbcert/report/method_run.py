"""The run as the method's tables and figures read it (`cbcert.report.method_outputs`).

`MethodRun` holds a run's worlds and cross-world tables by name and reads each certification
cell's records once, for the per-subset values the method's tests need. The constants are the
method's models, budgets and settings that its tables (`cbcert.report.method_tables`) and its
figures (`cbcert.report.method_figures`, `cbcert.report.method_setting_figures`) share; the
conventions are stated in `cbcert.report.method_outputs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cbcert.report.cells import CellResult, DamagedFileError
from cbcert.report.method_settings import world_of
from cbcert.report.tables import Table
from cbcert.robustness.certification import radius_of_correct_by_subset
from cbcert.runs.directory import RECORDS, RecordsError, read_records

if TYPE_CHECKING:
    from cbcert.report.worlds import WorldCells

# The method's models (cbcert's model names) and what the method calls f_std and f_cbm.
STD, CBM, PROTO = "std", "cbm", "proto"
F_NAMES = {STD: "f_std", CBM: "f_cbm"}
# The method's budgets: latent ε and concept flips τ, smoothing scales σ (latent) and ρ (concept).
EPS = (0.05, 0.1, 0.3, 0.5, 0.8)
TAU = (1.0, 2.0, 5.0, 10.0)
SIGMA = (0.01, 0.05, 0.1, 0.3)
RHO = (0.05, 0.1, 0.2)
ATTACK_EPS = (0.03, 0.01)  # Table 12 and Fig. 5 list ε = 0.03 first
# The method's settings (`cbcert.report.method_settings`): its two datasets, then the
# class-structure and the vocabulary variants.
CUB, RIVAL = "CUB", "RIVAL-10"
CLASS_SETTINGS = ("RIVAL-10 +5 dissimilar", "RIVAL-10 +5 similar", "RIVAL-10 +10 dissimilar",
                  "RIVAL-10 +10 similar")  # the method's column order (Tables 6, 7)
VOCABULARY_SETTINGS = ("RIVAL-10 K=18", "RIVAL-10 K=27", "RIVAL-10 K=36")


class MethodRun:
    """The run's worlds by name and its cross-world tables by name, with each certification
    cell's records read once (`per_subset`)."""

    def __init__(self, worlds: Sequence[WorldCells], tables: Sequence[Table]):
        self.cells = {name: cells for name, _, cells in worlds}
        self.tables = {t.name: t for t in tables}
        self._subsets: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    def present(self, settings: Sequence[str]) -> list[tuple[str, str]]:
        """``(setting, world)`` of the ``settings`` whose world is in the run, in order."""
        return [(s, world_of(s)) for s in settings if world_of(s) in self.cells]

    def absent_note(self, settings: Sequence[str]) -> str:
        """`` Not in this run: <setting> (world <w>), ….`` or ``""``."""
        gone = [f"{s} (world {world_of(s)})" for s in settings if world_of(s) not in self.cells]
        return f" Not in this run, left out: {', '.join(gone)}." if gone else ""

    def perturb(self, world: str) -> CellResult | None:
        """The perturb cell of ``world``, None if absent."""
        return next((c for c in self.cells.get(world, ()) if c.kind == "perturb"), None)

    def budget(self, world: str, kind: str, value: float) -> dict | None:
        """The perturb summary's budget ``kind`` = ``value`` of ``world``, None if absent."""
        cell = self.perturb(world)
        return next((b for b in cell.summary["budgets"] if b["kind"] == kind
                     and math.isclose(b["value"], value)), None) if cell else None

    def certify(self, world: str, noise: str, scale: float) -> CellResult | None:
        """The ``noise`` (gaussian, bernoulli, fixed) certification cell at ``scale``."""
        return next((c for c in self.cells.get(world, ()) if c.kind == "certify"
                     and c.summary.get("mode") == "certify" and c.summary["noise"] == noise
                     and math.isclose(c.summary["scale"], scale)), None)

    def per_subset(self, cell: CellResult, model: str) -> dict[str, np.ndarray]:
        """``model``'s per-subset values of a certification cell, from its records at the
        subsets its summary lists (``subsets.indices``): ``smoothed_accuracy`` [k] (abstain =
        wrong), ``radius`` [k] = R̄ over the correct inputs (NaN for a subset with none),
        ``ca_at_1`` [k] = the share of the subset correct and certified at radius ≥ 1."""
        key = (str(cell.path), cell.name)
        if key not in self._subsets:
            self._subsets[key] = self._read(cell)
        return {metric: values[model] for metric, values in self._subsets[key].items()}

    @staticmethod
    def _read(cell: CellResult) -> dict[str, dict[str, np.ndarray]]:
        indices = (cell.summary.get("subsets") or {}).get("indices")
        path = cell.path / RECORDS if cell.path is not None else None
        if indices is None or path is None:
            raise DamagedFileError(f"{cell.name}: no subset indices or records to read the "
                                   "method's per-subset values from; rerun the cell")
        try:
            records = read_records(path, key=lambda r: (r["index"], r["model"]), repair=False)
            out: dict[str, dict[str, np.ndarray]] = {"smoothed_accuracy": {}, "radius": {},
                                                     "ca_at_1": {}}
            for model in cell.summary["models"]:
                by_index = {r["index"]: r for r in records if r["model"] == model}
                rows = [[by_index[i] for i in subset] for subset in indices]
                correct = [[r["prediction"] == r["label"] for r in rs] for rs in rows]
                out["smoothed_accuracy"][model] = np.array([np.mean(c) for c in correct])
                out["ca_at_1"][model] = np.array(
                    [np.mean([ok and (r.get("radius") or 0.0) >= 1.0
                              for ok, r in zip(c, rs, strict=True)])
                     for c, rs in zip(correct, rows, strict=True)])
                out["radius"][model] = radius_of_correct_by_subset(records, model, indices)
        except (RecordsError, KeyError, TypeError, ValueError) as err:
            raise DamagedFileError(f"{path}: {err} (the records do not match the summary's "
                                   "subsets; rerun the cell)") from None
        return out


def setting_label(setting: str, world: str) -> str:
    """``<setting> [<world>]``: one of the method's settings and the world that stands for it."""
    return f"{setting} [{world}]"


__all__ = ["ATTACK_EPS", "CBM", "CLASS_SETTINGS", "CUB", "EPS", "F_NAMES", "PROTO", "RHO",
           "RIVAL", "SIGMA", "STD", "TAU", "VOCABULARY_SETTINGS", "MethodRun", "setting_label"]
