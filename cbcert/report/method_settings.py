"""Which world of a run stands for which of the method's experimental settings.

The method (`../shared/method/`, "Interpretable but Fragile?") runs its tables on CUB-200-2011
and on RIVAL-10 with class-count and vocabulary variants. cbcert's built-in worlds stand in for
them; this table says which world plays which setting, so that the method's tables and figures
by number (`cbcert.report.method_outputs`) and the comparison with the method's claims
(`cbcert.report.claims`) read the right world's cells. A setting whose world is absent from a
run is reported as absent, never filled from another world.

The class-structure and vocabulary variants of today's worlds are built on the fragile
``default`` world, where the method builds them on RIVAL-10: the base of those two studies is
therefore ``default`` (``CLASS_BASE``), and docs/paper.md says so.
"""

from __future__ import annotations

# The method's setting → the world (the sweep's world entry name) that stands for it.
SETTINGS: dict[str, str] = {
    "CUB": "default",
    "RIVAL-10": "saturated",
    "RIVAL-10 10 classes": "default",
    "RIVAL-10 +5 similar": "similar5",
    "RIVAL-10 +5 dissimilar": "dissimilar5",
    "RIVAL-10 +10 similar": "similar10",
    "RIVAL-10 +10 dissimilar": "dissimilar10",
    "RIVAL-10 K=18": "k8",
    "RIVAL-10 K=27": "vocab12",
    "RIVAL-10 K=36": "vocab16",
}
# Settings the method uses that no built-in world stands for (its claims there are absent).
UNMAPPED = ("RIVAL-10 +10 dissimilar K=27",)
# The base column of the class-structure study (the method's Table 6 "10 class").
CLASS_BASE = "RIVAL-10 10 classes"


def world_of(setting: str) -> str:
    """The world that stands for the method's ``setting``; KeyError naming the known ones."""
    try:
        return SETTINGS[setting]
    except KeyError:
        raise KeyError(f"unknown method setting {setting!r}; known: {sorted(SETTINGS)}") from None


__all__ = ["CLASS_BASE", "SETTINGS", "UNMAPPED", "world_of"]
