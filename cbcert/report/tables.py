"""Report tables: certification, empirical flip rates with paired tests, attacks, class
distances, explanations, who wrote each cell (CSV + Markdown).

CSV cells hold the summary's numbers at full precision (``repr`` of the float); Markdown rounds
to 4 significant digits and shows ``mean ± sd`` pairs in one column.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cbcert.certify.smoothing import smoothing
from cbcert.report.cells import CellResult, DamagedFileError
from cbcert.robustness.attacks import FIELDS as ATTACK_TEST_FIELDS
from cbcert.robustness.attacks import paired_attack_tests
from cbcert.robustness.certification import radius_of_correct_by_subset, radius_tests
from cbcert.runs.directory import RECORDS, RecordsError, read_records
from cbcert.runs.provenance import cell_provenance
from cbcert.schema import value_name

# Certified-accuracy columns: multiples of σ for L2 radii, absolute Hamming radii.
L2_MARKS = (0.5, 1.0, 2.0)
HAMMING_MARKS = (1, 2, 3)


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
        settings = _certify_settings(cell.run.get("job", {}), s["mode"])
        for model, m in s["models"].items():
            head = (cell.name, s["mode"])
            radii = (m.get("acr"), m.get("radius_of_correct"))
            tail = (m.get("abstain_rate"), m.get("seconds_per_input"), *settings)
            if not smoothing(s["noise"]).hamming:
                marks = tuple(_ca_at(m, f * s["scale"]) for f in L2_MARKS)
                latent.append((*head, s["scale"], model, m["num_inputs"],
                               m["smoothed_accuracy"], *radii, *marks, *tail))
            else:
                marks = tuple(_ca_at(m, r) for r in HAMMING_MARKS)
                concept.append((*head, s["noise"], s["scale"], model, m["num_inputs"],
                                m["smoothed_accuracy"], *radii, *marks, *tail))
    tables = []
    if latent:
        tables.append(Table(
            "certification_latent", "Certified L2 radii in latent space (Gaussian smoothing); "
            "acr over all inputs, radius_of_correct over correctly predicted ones",
            ("cell", "mode", "sigma", "model", "inputs", "smoothed_accuracy", "acr",
             "radius_of_correct", "ca_at_half_sigma", "ca_at_sigma", "ca_at_2sigma",
             "abstain_rate", "seconds_per_input", *SETTINGS_COLUMNS), tuple(latent)))
    if concept:
        tables.append(Table(
            "certification_concept",
            "Certified Hamming radii in concept space (bernoulli: scale ρ; fixed: m flips); "
            "acr_h over all inputs, radius_of_correct over correctly predicted ones",
            ("cell", "mode", "noise", "scale", "model", "inputs", "smoothed_accuracy", "acr_h",
             "radius_of_correct", *(f"ca_at_{r}" for r in HAMMING_MARKS), "abstain_rate",
             "seconds_per_input", *SETTINGS_COLUMNS), tuple(concept)))
    return tables + subset_tables(cells) + radius_test_tables(cells)


def subset_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Certification metrics over random subsets (mean ± sd) and the paired model tests of the
    cells that asked for them (``subsets`` in the summary)."""
    rows, tests = [], []
    for cell in cells:
        subsets = cell.summary.get("subsets") if cell.kind == "certify" else None
        if not subsets:
            continue
        for model, m in subsets["models"].items():
            rows.append((cell.name, model, subsets["num_subsets"], subsets["subset_size"],
                         *(m[k][s] for k in ("smoothed_accuracy", "acr", "radius_of_correct")
                           for s in ("mean", "sd"))))
        tests += [(cell.name, c["metric"], c["model_a"], c["model_b"], c["delta"]["mean"],
                   c["delta"]["sd"], c["inputs"], c["p"], c["p_holm"])
                  for c in subsets["comparisons"]]
    if not rows:
        return []
    return [Table("certification_subsets", "Certification over random subsets of the certified "
                  "inputs, mean ± sd", ("cell", "model", "subsets", "subset_size",
                                        "smoothed_accuracy_mean", "smoothed_accuracy_sd",
                                        "acr_mean", "acr_sd", "radius_of_correct_mean",
                                        "radius_of_correct_sd"), tuple(rows)),
            Table("certification_tests", "Δ = metric_a − metric_b, mean ± sd over subsets; p: "
                  "paired sign-flip permutation test over the subsets' inputs, p_holm: Holm "
                  "over the cell's tests", ("cell", "metric", "model_a", "model_b",
                                            "delta_mean", "delta_sd", "inputs", "p", "p_holm"),
                  tuple(tests))]


def radius_test_tables(cells: Sequence[CellResult]) -> list[Table]:
    """The method's certification test (`cbcert.robustness.certification.radius_tests`):
    ΔR̄ (mean radius over correctly predicted inputs) of the first model against each other
    per subset, paired t-test over the subsets, Holm across the cells of one family — the σ
    cells of the latent space, the ρ cells of concept space, the fixed-count cells — per pair.
    Read from each cell's records at the subsets its summary lists (``subsets.indices``)."""
    families: dict[str, list[tuple[CellResult, dict]]] = {}
    for cell in cells:
        s = cell.summary
        subsets = s.get("subsets") if cell.kind == "certify" else None
        if not subsets or s.get("mode") != "certify" or cell.path is None \
                or "indices" not in subsets:
            continue
        path = cell.path / RECORDS
        try:
            records = read_records(path, key=lambda r: (r["index"], r["model"]), repair=False)
            per_model = {m: radius_of_correct_by_subset(records, m, subsets["indices"])
                         for m in s["models"]}
        except (RecordsError, KeyError, TypeError, ValueError) as err:
            raise DamagedFileError(f"{path}: {err} (the records do not match the summary's "
                                   "subsets; rerun the cell)") from None
        families.setdefault(s["noise"], []).append((cell, per_model))
    rows = []
    for noise, family in families.items():
        models = list(family[0][1])
        tests = radius_tests([(c.name, pm) for c, pm in family],
                             [(models[0], m) for m in models[1:]])
        scale = {c.name: c.summary["scale"] for c, _ in family}
        rows += [(t["cell"], noise, scale[t["cell"]], t["model_a"], t["model_b"], t["subsets"],
                  t["delta"]["mean"], t["delta"]["sd"], t["t"], t["df"], t["p"], t["p_holm"])
                 for t in tests]
    if not rows:
        return []
    return [Table("certification_radius_tests",
                  "The method's certification test: Δ = R̄_a − R̄_b (mean radius over correctly "
                  "predicted inputs) per subset, mean ± sd; paired two-sided t-test over the "
                  "subsets; p_holm: Holm across the cells of one noise (every σ, every ρ, every "
                  "m) for each pair",
                  ("cell", "noise", "scale", "model_a", "model_b", "subsets", "delta_mean",
                   "delta_sd", "t", "df", "p", "p_holm"), tuple(rows))]


SETTINGS_COLUMNS = ("alpha", "n0", "n", "bound", "schedule")


def _certify_settings(job: dict[str, Any], mode: str) -> tuple:
    """α, n0, n, the bound and the schedule of a certification cell (its ``run.json``)."""
    if mode == "predict":
        bound = "binomial test (PREDICT)"
    else:
        bound = "two-class CP" if job.get("two_class") else "one-class CP"
    return (job.get("alpha"), job.get("n0") if mode == "certify" else None, job.get("n"),
            bound, job.get("schedule", "fixed"))


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
                       c["delta"]["sd"], c["t"], c["df"], c.get("p_t"), c.get("inputs"),
                       c["p"], c["p_holm"])
                      for c in b["comparisons"]]
        suffix = "" if _count(cells, "perturb") == 1 else f"_{cell.name}"
        tables.append(Table(f"perturb{suffix}",
                            f"Empirical flip rates, mean ± sd over subsets ({cell.name})",
                            tuple(columns), tuple(rows)))
        tables.append(Table(f"perturb_tests{suffix}",
                            f"Δ = PFR_a − PFR_b, mean ± sd over subsets; t, p_t: paired t-test "
                            f"over the subsets (undefined for constant Δ); p: paired sign-flip "
                            f"permutation test over the subsets' inputs, p_holm: its Holm "
                            f"correction over the table ({cell.name})",
                            ("cell", "budget", "model_a", "model_b", "delta_mean", "delta_sd",
                             "t", "df", "p_t", "inputs", "p", "p_holm"), tuple(tests)))
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


def classes_tables(cells: Sequence[CellResult]) -> list[Table]:
    """The class-distance matrix of a ``classes`` cell (one row per class)."""
    cell = next((c for c in cells if c.kind == "classes"), None)
    if cell is None:
        return []
    s = cell.summary
    rows = tuple((name, count, s["nearest"][name]["class"], s["nearest"][name]["distance"],
                  *row) for name, count, row in zip(s["class_names"], s["counts"],
                                                    s["distances"], strict=True))
    return [Table("classes", f"Class-centroid distances in f_std's feature space ({s['samples']} "
                  f"samples, {s['labels']} labels; mean off-diagonal "
                  f"{_num(s['mean_off_diagonal'])})",
                  ("class", "count", "nearest", "nearest_distance", *s["class_names"]), rows)]


# `certify explain` measures in report order (summary key, label).
EXPLAIN_MEASURES = (
    ("eps_overlap", "top-k overlap after an ε shift"),
    ("eps_kendall", "Kendall τ after an ε shift"),
    ("tau_overlap", "top-k overlap after τ flips"), ("tau_kendall", "Kendall τ after τ flips"),
    ("all_cited_certified", "all cited concepts/prototypes certified at R"),
    ("mean_certified_radius", "mean certified radius of cited concepts/prototypes"),
    ("all_cited_certified_flips",
     "all cited concepts/prototypes certified under concept flips"),
    ("mean_certified_radius_flips",
     "mean certified Hamming radius of cited concepts/prototypes"),
    ("precision", "known-answer precision"), ("recall", "known-answer recall"),
    ("f1", "known-answer F1"),
    ("single_consistent", "consistency, one cited concept flipped"),
    ("all_consistent", "consistency, all cited concepts flipped"),
    ("single_faithful", "faithfulness, one cited concept flipped"),
    ("all_faithful", "faithfulness, all cited concepts flipped"),
    ("single_consistent_unverified", "consistency without verification, one flipped"),
    ("all_consistent_unverified", "consistency without verification, all flipped"),
    ("single_faithful_unverified", "faithfulness without verification, one flipped"),
    ("all_faithful_unverified", "faithfulness without verification, all flipped"),
    ("residual_share", "PCBM-h residual's share of the evidence"))


def explain_tables(cells: Sequence[CellResult]) -> list[Table]:
    """`certify explain` cells (mean and 95 % bootstrap interval per model and measure) and the
    explanation stability of perturb cells run with ``explain``."""
    tables = []
    for cell in cells:
        if cell.kind == "explain":
            s = cell.summary
            rows = tuple((cell.name, model, key, label, *((e["mean"], e["low"], e["high"],
                                                            e["inputs"]) if e else (None,) * 4))
                         for model, measures in s["models"].items()
                         for key, label in EXPLAIN_MEASURES if key in measures
                         for e in (measures[key],))
            settings = s["settings"]
            suffix = "" if _count(cells, "explain") == 1 else f"_{cell.name}"
            tables.append(Table(
                f"explanations{suffix}",
                f"Explanations of {s['inputs']} inputs (top {settings['top_k']}; ε = "
                f"{settings['eps']:g}, τ = {settings['tau']}, σ = {settings['sigma']:g}, R = "
                f"{settings['radius']:g}, α = {settings['alpha']:g}): mean [95 % bootstrap "
                "interval over inputs]",
                ("cell", "model", "measure", "label", "mean", "low", "high", "inputs"), rows))
        elif cell.kind == "perturb" and "explanations" in cell.summary:
            rows = []
            for b in cell.summary["explanations"]:
                tests = {c["model_b"]: c for c in b["comparisons"]}
                for m in b["overlap"]:
                    test = tests.get(m, {})
                    rows.append((cell.name, _budget_label(b["kind"], b["value"]), m,
                                 b["overlap"][m]["mean"], b["overlap"][m]["sd"],
                                 b["kendall"][m]["mean"], b["kendall"][m]["sd"],
                                 test.get("delta"), test.get("pvalue"), test.get("pvalue_holm")))
            suffix = "" if _count(cells, "perturb") == 1 else f"_{cell.name}"
            tables.append(Table(
                f"perturb_explanations{suffix}",
                f"Explanation stability, mean ± sd over subsets; Δ overlap vs the first concept "
                f"model, paired permutation test, Holm over budgets ({cell.name})",
                ("cell", "budget", "model", "overlap_mean", "overlap_sd", "kendall_mean",
                 "kendall_sd", "delta_overlap", "p", "p_holm"), tuple(rows)))
    return tables


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def attack_test_tables(cells: Sequence[CellResult]) -> list[Table]:
    """Paired tests of robust accuracy (`cbcert.robustness.attacks.paired_attack_tests`): in
    every attack cell, the first model against each other at each ε over the inputs both were
    attacked on, then over the inputs both classify correctly unattacked (``*_clean``), each
    family Holm-corrected over the cell. Read from each cell's records (robust: ``robust``;
    clean: ``clean_prediction = label``)."""
    rows = []
    for cell in cells:
        if cell.kind != "attack" or cell.path is None:
            continue
        models = list(cell.summary["models"])
        path = cell.path / RECORDS
        try:
            records = read_records(path, key=lambda r: (r["index"], r["model"], r["eps"]),
                                   repair=False)
            by_key = {(r["model"], r["eps"], r["index"]): r for r in records}
            budgets = []
            for b in cell.summary["models"][models[0]]["budgets"]:
                inputs = sorted(i for (m, e, i) in by_key if m == models[0] and e == b["eps"])
                got = {m: [by_key[m, b["eps"], i] for i in inputs] for m in models}
                budgets.append((b["eps"], {m: [bool(r["robust"]) for r in got[m]] for m in models},
                                {m: [r["clean_prediction"] == r["label"] for r in got[m]]
                                 for m in models}))
            tests = paired_attack_tests(budgets, models)
        except (RecordsError, KeyError, TypeError, ValueError) as err:
            raise DamagedFileError(f"{path}: {err} (the records do not match the summary's "
                                   "models and budgets; rerun the cell)") from None
        rows += [(cell.name, *(t[k] for k in ATTACK_TEST_FIELDS)) for t in tests]
    if not rows:
        return []
    return [Table("attack_tests",
                  "Paired tests of robust accuracy: robust_a, robust_b: RobAcc of each model, Δ = "
                  "RobAcc_a − RobAcc_b over the inputs both models were attacked on, sd of the "
                  "per-input differences; a_only, b_only: inputs robust for that model only; p: "
                  "exact McNemar test, p_holm: Holm over the cell's tests. *_clean: the same over "
                  "the clean_both inputs both models classify correctly unattacked (robust: the "
                  "prediction survived the attack), Holm over the cell's conditional tests",
                  ("cell", *ATTACK_TEST_FIELDS), tuple(rows))]


def _count(cells: Sequence[CellResult], kind: str) -> int:
    return sum(c.kind == kind for c in cells)


def provenance_table(cells: Sequence[CellResult]) -> list[Table]:
    """Who wrote each cell (`cbcert.runs.provenance.cell_provenance`): its sessions, their
    revisions and machines, whether more than one of either did."""
    rows = [(cell.name, p.sessions,
             ", ".join((r or "no git")[:7] for r in p.revisions) or "unknown",
             "; ".join(p.machines) or "unknown", p.mixed, p.source, p.note or None)
            for cell in cells for p in (cell_provenance(cell.path, cell.run),)]
    title = ("Who wrote each cell: sessions, git revisions, machines (CPU, ISA flags); mixed: "
             "more than one revision or machine (unknown: not every writer known, see note); "
             "source: run.json, or sessions.jsonl where derived from the sweep's log")
    return [Table("provenance", title, ("cell", "sessions", "revisions", "machines", "mixed",
                                        "source", "note"), tuple(rows))] if rows else []


def tables(cells: Sequence[CellResult]) -> list[Table]:
    """All tables of a run, in report order."""
    return [*certification_tables(cells), *perturb_tables(cells), *attack_tables(cells),
            *attack_test_tables(cells), *classes_tables(cells), *explain_tables(cells),
            *provenance_table(cells)]
