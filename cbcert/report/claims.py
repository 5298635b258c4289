"""The method's claims beside what the run shows: one row per claim, agreeing or not.

The claims are transcribed by hand from the method's text into ``data/method_claims.yaml``
(package data): one entry per comparison and budget, with the method's printed numbers and the
direction its numbers show (``std``: the standard model is the more robust; ``other``: the
interpretable model is; ``none``: no difference). Each claim is matched to the run's hypothesis
of the same setting (through `cbcert.report.method_settings.SETTINGS`), measure, budget and
model pair (`cbcert.report.family`), and judged by one rule:

* **agrees** — the run shows what the method claims at the run-wide level: the direction
  (Holm across the run, ``std``/``other``) or equivalence within the margin (TOST with Holm,
  ``none``);
* **partly** — it would agree without the run-wide correction: the pooled estimate points the
  claimed way with raw ``p < level`` (``std``/``other``), or the raw TOST ``p < level``
  (``none``), but the correction across the run does not pass;
* **no** — the run shows the opposite: the other direction (Holm), or equivalence within a
  margin smaller than the difference the method claims (or prints no number for), or a
  difference where it claims none; equivalence within a margin larger than the method's own
  difference is consistent with it and counts as **partly** (the run cannot confirm the
  direction of so small a gap);
* **inconclusive** — none of these: the data allow either answer (see the interval);
* **absent** — the run has no such hypothesis (its setting's world, budget, model or backbone
  is not in the run; the reason is given).

A headline claim (the file's ``summary``) aggregates its per-budget claims: ``absent`` if all
are, ``no`` if any is, ``agrees`` if all present ones agree, ``partly`` if any agrees or partly
agrees, ``inconclusive`` otherwise.
"""

from __future__ import annotations

import importlib.resources
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from cbcert.report.family import MEASURES, Family
from cbcert.report.method_settings import SETTINGS
from cbcert.report.tables import Table

AGREEMENTS = ("agrees", "partly", "no", "inconclusive", "absent")
# The measures a claim may name: the run's (`MEASURES`, larger value more robust or not) and
# certified accuracy at a radius, transcribed but not in the run's family, so such claims are
# absent, with the reason.
_LARGER_IS_ROBUST = {**{m: larger for m, (_, larger) in MEASURES.items()},
                     "certified_accuracy": True}
_UNITS = {"percent": 0.01, "fraction": 1.0, "radius": 1.0}
_BACKBONES = ("ResNet-50",)  # the architectures the built-in worlds stand in for


@dataclass(frozen=True)
class Claim:
    """One claim of the method (``data/method_claims.yaml``'s fields; ``note`` says where the
    method's words and its numbers disagree, the ``direction`` being its numbers';
    ``same_as`` names the claim it restates, e.g. a figure drawing a table's numbers)."""

    id: str
    where: dict[str, str]
    setting: str
    backbone: str
    measure: str
    noise: str | None
    budget: str
    models: tuple[str, str]
    values: dict[str, float | None] | None
    unit: str
    direction: str
    statement: str
    note: str | None = None
    same_as: str | None = None

    def method_delta(self) -> float | None:
        """The method's std advantage (``value_std − value_b``, flip rates ``b − std``) in the
        measure's unit (fractions for rates), or None without both numbers."""
        values = self.values or {}
        a, b = values.get(self.models[0]), values.get(self.models[1])
        if a is not None and b is not None:
            delta = (a - b) * _UNITS[self.unit]
        elif values.get("delta") is not None:  # tables that print only std − other
            delta = values["delta"] * _UNITS[self.unit]
        else:
            return None
        return delta if _LARGER_IS_ROBUST[self.measure] else -delta

    def source(self) -> str:
        """``Table 1, §4.1`` / ``Fig. 1b, §1`` / ``Table 1 and Fig. 2, §4.1``."""
        parts = [f"{label} {self.where[key]}" for key, label in (("table", "Table"),
                                                                  ("figure", "Fig."))
                 if key in self.where]
        section = self.where.get("section")
        return " and ".join(parts) + (f", §{section}" if section else "")


def _claim(entry: dict[str, Any]) -> Claim:
    try:
        models = tuple(entry["models"])
        if len(models) != 2:
            raise ValueError(f"models: expected two, got {models}")
        if entry["measure"] not in _LARGER_IS_ROBUST:
            raise ValueError(f"measure: {entry['measure']!r} not one of {list(_LARGER_IS_ROBUST)}")
        if entry["direction"] not in ("std", "other", "none"):
            raise ValueError(f"direction: {entry['direction']!r} not std, other or none")
        if entry.get("unit", "fraction") not in _UNITS:
            raise ValueError(f"unit: {entry.get('unit')!r} not one of {list(_UNITS)}")
        return Claim(str(entry["id"]), dict(entry["where"]), str(entry["setting"]),
                     str(entry.get("backbone", "ResNet-50")), entry["measure"],
                     entry.get("noise"), str(entry["budget"]), models, entry.get("values"),
                     entry.get("unit", "fraction"), entry["direction"],
                     str(entry["statement"]), entry.get("note"), entry.get("same_as"))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"method claim {entry.get('id', '?')!r}: {err}") from None


def load_claims(text: str | None = None) -> tuple[tuple[Claim, ...], tuple[dict, ...]]:
    """The claims and headline summaries of ``data/method_claims.yaml`` (or of ``text``, the
    same YAML layout). Raises ValueError naming a malformed claim or a repeated id."""
    if text is None:
        text = (importlib.resources.files("cbcert.report") / "data" / "method_claims.yaml"
                ).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    claims = tuple(_claim(entry) for entry in data["claims"])
    ids = [c.id for c in claims]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        raise ValueError(f"method claims: repeated ids {repeated}")
    dangling = [c.id for c in claims if c.same_as is not None and c.same_as not in ids]
    if dangling:
        raise ValueError(f"method claims {dangling}: same_as names no claim")
    summary = tuple(data.get("summary") or ())
    for entry in summary:
        unknown = [i for i in entry.get("claims", ()) if i not in ids]
        if unknown:
            raise ValueError(f"summary claim {entry.get('id')!r}: unknown claim ids {unknown}")
    return claims, summary


def _budget_key(budget: str) -> tuple[str, float] | None:
    kind, _, value = budget.partition("=")
    try:
        return kind.strip(), float(value)
    except ValueError:
        return None


def _cell_matches(claim: Claim, cell: str) -> bool:
    """A robust-accuracy claim names its attack (``attack-latent``, ``attack-concept-smoothed``
    …); the run's cell names add the smoothing scale (``attack-latent-smoothed-sigma0.1``)."""
    if claim.measure != "robust_accuracy" or not claim.noise:
        return True
    if claim.noise.endswith("-smoothed"):
        return cell.startswith(claim.noise)
    return cell == claim.noise


def find_hypothesis(claim: Claim, family: Family) -> tuple[int | None, str]:
    """The index of the run's hypothesis a claim speaks of, or None with the reason."""
    if claim.backbone not in _BACKBONES:
        return None, f"no {claim.backbone} analogue in the run's worlds"
    world = SETTINGS.get(claim.setting)
    if world is None:
        return None, f"no world stands for the method's setting {claim.setting!r}"
    worlds = {h.world for h in family.hypotheses}
    if world not in worlds:
        return None, f"world {world!r} ({claim.setting}) is not in this run"
    key = _budget_key(claim.budget)
    for i, h in enumerate(family.hypotheses):
        if (h.world == world and h.measure == claim.measure and h.model_b == claim.models[1]
                and h.model_a == claim.models[0] and _budget_key(h.budget) == key
                and _cell_matches(claim, h.cell)):
            return i, ""
    return None, (f"no {claim.measure} test of {claim.models[0]} against {claim.models[1]} at "
                  f"{claim.budget} in world {world!r}")


def agreement(direction: str, verdict: str, delta: float, p: float | None,
              tost_p: float | None, level: float, *, method_gap: float | None = None,
              margin: float | None = None) -> str:
    """The rule of the module docstring for one claim: the method's ``direction``, the run's
    ``verdict`` (`cbcert.report.family.verdict`), std's pooled advantage ``delta`` and the raw
    ``p`` and ``tost_p``; ``method_gap`` (the method's |Δ|) and ``margin`` (the run's
    equivalence margin, same unit) decide a claimed difference the run finds equivalent."""
    if verdict == "untested":
        return "inconclusive"
    shown = {"std more robust": "std", "other more robust": "other"}.get(verdict)
    if direction == "none":
        if verdict == "equivalent":
            return "agrees"
        if shown is not None:
            return "no"
        return "partly" if tost_p is not None and tost_p < level else "inconclusive"
    if shown == direction:
        return "agrees"
    if verdict == "equivalent" and None not in (method_gap, margin) and method_gap < margin:
        return "partly"  # the method's own gap lies inside the run's margin: consistent
    if shown is not None or verdict == "equivalent":
        return "no"
    points = delta > 0 if direction == "std" else delta < 0
    return "partly" if points and p is not None and p < level else "inconclusive"


def _number(value: Any) -> Any:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def comparison_table(claims: Sequence[Claim], family: Family) -> Table:
    """``method_comparison``: each claim, the method's numbers, the run's pooled numbers with
    the 95 % interval, and the agreement by the module's rule."""
    rows = []
    level = family.settings.level
    restated = [c for c in claims if c.same_as is not None]
    for c in claims:
        if c.same_as is not None:  # a restatement is judged once, under the claim it restates
            continue
        i, why = find_hypothesis(c, family)
        values = c.values or {}
        head = (c.id, c.source(), c.setting, SETTINGS.get(c.setting), c.measure, c.budget,
                c.models[1], c.statement, c.direction, _number(values.get(c.models[0])),
                _number(values.get(c.models[1])), c.unit, c.method_delta())
        if i is None:
            rows.append((*head, None, None, None, None, None, None, None, "absent", why))
            continue
        h = family.hypotheses[i]
        delta, low, high = h.advantage()
        verdict = family.verdicts[i]
        method_gap = c.method_delta()
        margin = h.result.margin
        if method_gap is not None and c.measure == "radius":  # the margin is relative to R̄_std
            std_value = values.get(c.models[0])
            margin = (None if std_value is None
                      else family.settings.radius_margin * std_value * _UNITS[c.unit])
        judged = agreement(c.direction, verdict, delta, h.result.p, h.result.tost_p, level,
                           method_gap=None if method_gap is None else abs(method_gap),
                           margin=margin)
        rows.append((*head, h.result.value_a, h.result.value_b, delta, _number(low),
                     _number(high), family.p_holm[i], verdict.replace("other", h.model_b),
                     judged, ""))
    counts = {a: sum(r[-2] == a for r in rows) for a in AGREEMENTS}
    return Table("method_comparison",
                 f"The method's claims against this run ({len(rows)} claims: "
                 + ", ".join(f"{counts[a]} {a}" for a in AGREEMENTS)
                 + (f"; {len(restated)} restatements of them counted once" if restated else "")
                 + "); deltas are std's robustness advantage (> 0: std more robust; rates as "
                 "fractions), the run's pooled over every input with its 95 % interval",
                 ("claim", "source", "setting", "world", "measure", "budget", "model_b",
                  "statement", "method_direction", "method_value_std", "method_value_b",
                  "method_unit", "method_delta", "run_value_std", "run_value_b", "run_delta",
                  "ci_low", "ci_high", "p_holm", "run_verdict", "agreement", "why_absent"),
                 tuple(rows))


def headline(parts: Sequence[str]) -> str:
    """A headline claim's agreement from its per-budget claims' (module docstring)."""
    present = [p for p in parts if p != "absent"]
    if not present:
        return "absent"
    if "no" in present:
        return "no"
    if all(p == "agrees" for p in present):
        return "agrees"
    if any(p in ("agrees", "partly") for p in present):
        return "partly"
    return "inconclusive"


def headline_table(summary: Sequence[dict], comparison: Table,
                   claims: Sequence[Claim]) -> Table:
    """``method_comparison_headlines``: each headline claim, how many of its per-budget claims
    fall in each agreement, and its own agreement (`headline`); a restatement (``same_as``)
    counts as the claim it restates, once."""
    by_id = {row[0]: row[comparison.columns.index("agreement")] for row in comparison.rows}
    original = {c.id: c.same_as or c.id for c in claims}
    rows = []
    for entry in summary:
        parts = [by_id[i] for i in dict.fromkeys(original[i] for i in entry.get("claims", ()))]
        where = entry.get("where") or {}
        source = ", ".join(f"{k} {v}" for k, v in where.items())
        rows.append((entry["id"], source, entry["statement"], len(parts),
                     *(parts.count(a) for a in AGREEMENTS), headline(parts)))
    return Table("method_comparison_headlines",
                 "The method's headline claims against this run (each from its per-budget "
                 "claims in method_comparison)",
                 ("claim", "source", "statement", "claims", *AGREEMENTS, "agreement"),
                 tuple(rows))


__all__ = ["AGREEMENTS", "Claim", "agreement", "comparison_table", "find_hypothesis",
           "headline", "headline_table", "load_claims"]
