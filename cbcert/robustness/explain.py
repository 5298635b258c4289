"""Explanations of concept models and what a perturbation does to them (SPEC §8).

Pure numpy/scipy in float64, on host, like `cbcert.robustness.stats` (one exception:
`top_k_members`, the cited set inside a jitted sampler). A concept model explains its prediction
``y`` by its contributions ``c_i = a_i · W[y, i]`` (activation times the head weight of the
predicted class; for a PCBM ``a = r``, the concept scores; for a prototype network ``a = s``,
the prototype similarities, and the "concepts" below are its prototypes). This module turns
them into ranked top-k explanations, compares clean and perturbed explanations, certifies the
sign of smoothed concept scores, checks explanation-driven counterfactual edits, and scores
explanations against a known answer or with external judges.

Array conventions: ``N`` explanations (inputs, or inputs × samples flattened), ``K`` concepts,
``C`` classes, ``k`` the explanation length. Cited concepts are concept indices with ``-1``
padding where fewer than k are cited.

Size: ~430 lines, the explanation kernels of SPEC §8 in one place (explanations, stability,
certificates, counterfactual checks, known answer, judges), each a few short functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
import scipy.stats
from scipy import special

from cbcert.certify.bounds import check_alpha, check_counts, clopper_pearson_lower

DEFAULT_TOP_K = 5
DEFAULT_FLOOR = 0.01  # shares below this (after L1 normalisation over the top k) are dropped
JUDGE_RANGE = (1.0, 9.0)


def contributions(activations: np.ndarray, weights: np.ndarray,
                  predicted: np.ndarray) -> np.ndarray:
    """Concept contributions to the predicted class: ``c[n, i] = a[n, i] · W[y_n, i]``.

    Args:
      activations: ``[N, K]`` concept activations (a PCBM's concept scores r).
      weights: ``[C, K]`` the linear head on the concepts.
      predicted: ``[N]`` predicted classes in ``[0, C)``.

    Returns:
      ``[N, K]`` float64; ``c[n].sum() + bias[y_n]`` is the predicted logit of a linear head.
    """
    a = np.asarray(activations, np.float64)
    w = np.asarray(weights, np.float64)
    y = np.asarray(predicted)
    if a.ndim != 2 or w.ndim != 2 or w.shape[1] != a.shape[1] or y.shape != a.shape[:1]:
        raise ValueError(f"expected activations [N, K], weights [C, K], predicted [N]; got "
                         f"{a.shape}, {w.shape}, {y.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.min(initial=0) < 0 or y.max(
            initial=0) >= w.shape[0]:
        raise ValueError(f"predicted must hold integer classes in [0, {w.shape[0]})")
    return a * w[y]


@dataclass(frozen=True)
class Explanation:
    """Top-k explanations: ``concepts[n, j]`` is the j-th cited concept of explanation n (``-1``
    where fewer are cited), ``shares[n, j]`` its signed share ``c_i / Σ_top-k |c|`` (0 there)."""

    concepts: np.ndarray  # [N, k] int64
    shares: np.ndarray  # [N, k] float64

    def cited(self, num_concepts: int) -> np.ndarray:
        """``[N, K]`` bool: concept i is cited by explanation n."""
        out = np.zeros((len(self.concepts), num_concepts), bool)
        rows, slots = np.nonzero(self.concepts >= 0)
        out[rows, self.concepts[rows, slots]] = True
        return out


def explain(contrib: np.ndarray, k: int = DEFAULT_TOP_K,
            floor: float = DEFAULT_FLOOR) -> Explanation:
    """Top-k explanation of every row of contributions ``contrib[N, K]``.

    Concepts are ranked by ``|c_i|`` (ties: lower index first); the top ``min(k, K)`` are
    L1-normalised, ``share_i = c_i / Σ_top-k |c_j|``, and those with ``|share_i| < floor`` are
    dropped (so an all-zero row cites nothing). Kept concepts stay in rank order, first.
    """
    c = np.asarray(contrib, np.float64)
    if c.ndim != 2 or c.shape[1] < 1:
        raise ValueError(f"contrib: expected [N, K >= 1], got {c.shape}")
    if not (isinstance(k, int | np.integer) and k >= 1):
        raise ValueError(f"k={k!r} must be an integer >= 1")
    if not 0.0 <= floor < 1.0:
        raise ValueError(f"floor={floor!r} must be in [0, 1)")
    top = min(int(k), c.shape[1])
    order = np.argsort(-np.abs(c), axis=1, kind="stable")[:, :top]  # [N, top]
    values = np.take_along_axis(c, order, axis=1)
    total = np.abs(values).sum(axis=1, keepdims=True)
    shares = np.divide(values, total, out=np.zeros_like(values), where=total > 0)
    keep = np.abs(shares) >= floor
    keep &= total > 0
    # Dropped shares are the smallest in magnitude, so kept ones stay a prefix of the ranking.
    concepts = np.where(keep, order, -1).astype(np.int64)
    shares = np.where(keep, shares, 0.0)
    pad = int(k) - top
    if pad:
        concepts = np.pad(concepts, ((0, 0), (0, pad)), constant_values=-1)
        shares = np.pad(shares, ((0, 0), (0, pad)))
    return Explanation(concepts, shares)


def top_k_members(contrib, k: int = DEFAULT_TOP_K, floor: float = DEFAULT_FLOOR):
    """On device (jax, traceable): ``[B, K]`` bool, concept i is cited by `explain` of row b.

    The same rule as `explain` in the input's dtype: ``rank_i = #{j : |c_j| > |c_i|} + #{j < i :
    |c_j| = |c_i|}``, cited iff ``rank_i < min(k, K)``, ``Σ_top-k |c| > 0`` and ``|c_i| ≥ floor ·
    Σ_top-k |c|``. O(B K²) memory: meant for heads of tens to hundreds of units.
    """
    a = jnp.abs(contrib)  # [B, K]
    index = jnp.arange(a.shape[1])
    before = (a[:, None, :] > a[:, :, None]) | ((a[:, None, :] == a[:, :, None])
                                                  & (index[None, :] < index[:, None]))
    top = before.sum(axis=2) < min(int(k), a.shape[1])  # [B, K]
    total = jnp.sum(jnp.where(top, a, 0), axis=1, keepdims=True)
    return top & (total > 0) & (a >= floor * total)


def top_k_overlap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Jaccard overlap ``|A ∩ B| / |A ∪ B|`` of the cited sets of ``a[N, k]`` and ``b[N, k]``
    (``-1`` padding ignored); two empty explanations overlap fully (1.0)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"expected two [N, k] arrays of cited concepts, got {a.shape}, {b.shape}")
    out = np.empty(len(a))
    for n, (row_a, row_b) in enumerate(zip(a, b, strict=True)):
        set_a, set_b = set(row_a[row_a >= 0].tolist()), set(row_b[row_b >= 0].tolist())
        union = set_a | set_b
        out[n] = len(set_a & set_b) / len(union) if union else 1.0
    return out


def rank_correlation(contrib_a: np.ndarray, contrib_b: np.ndarray, cited_a: np.ndarray,
                     cited_b: np.ndarray) -> np.ndarray:
    """Kendall τ-b between two explanations of each input, over the concepts either cites.

    ``τ_n = kendalltau(c_a[n, U], c_b[n, U])`` with ``U`` the union of the cited concepts
    (``cited_*[N, k]``, ``-1`` padding), comparing the signed contributions ``contrib_*[N, K]``;
    τ-b corrects for ties. NaN where U holds fewer than two concepts or one side is constant
    (the order is undefined there): average with ``np.nanmean`` and report the count.
    """
    ca, cb = np.asarray(contrib_a, np.float64), np.asarray(contrib_b, np.float64)
    if ca.shape != cb.shape or ca.ndim != 2:
        raise ValueError(f"expected two [N, K] contribution arrays, got {ca.shape}, {cb.shape}")
    out = np.full(len(ca), np.nan)
    for n in range(len(ca)):
        union = sorted({int(i) for i in (*cited_a[n], *cited_b[n]) if i >= 0})
        if len(union) < 2:
            continue
        x, y = ca[n, union], cb[n, union]
        if np.ptp(x) == 0 or np.ptp(y) == 0:
            continue
        out[n] = scipy.stats.kendalltau(x, y).statistic
    return out


@dataclass(frozen=True)
class ConceptCertificate:
    """Certified signs of smoothed concept scores (see `certify_concept_signs`).

    Attributes:
      sign: ``[N, K]`` int8, +1/-1 the selected sign of the smoothed score ``r_i``, 0 where the
        concept is outside the family.
      p_value: ``[N, K]`` Holm-adjusted (over each input's family) p-values of
        ``H0: P[sign(r_i(g(z + δ))) = sign] ≤ Φ(R/σ)``; NaN outside the family.
      certified: ``[N, K]`` bool, the sign is provably stable within radius R (FWER ≤ α per input).
      radius: ``[N, K]`` certified L2 radius of each concept's sign at level α/m (Bonferroni over
        the m concepts of the family, so all radii hold together with probability ≥ 1 − α);
        0 where it certifies nothing.
      all_certified: ``[N]`` every concept of the family certified at R (an input with an empty
        family is vacuously certified).
    """

    sign: np.ndarray
    p_value: np.ndarray
    certified: np.ndarray
    radius: np.ndarray
    all_certified: np.ndarray


def certify_concept_signs(select_positive: np.ndarray, n0: int, positive: np.ndarray, n: int,
                          sigma: float | None, alpha: float, radius: float = 0.0,
                          family: np.ndarray | None = None, *,
                          rule: Any = None) -> ConceptCertificate:
    """Certify the sign of each smoothed concept score under latent Gaussian noise.

    The smoothed sign of concept i is ``s_i(z) = argmax_{±} P_δ[sign r_i(g(z + δ)) = ±]``. As in
    Cohen et al.'s CERTIFY, ``n0`` selection samples choose the sign (``+`` iff
    ``select_positive > n0 / 2``; a tie selects ``-``), and ``n`` independent estimation samples
    count ``k_i`` agreements with it. By Cohen et al. (2019, Thm. 1) the sign is constant within
    L2 radius R of z when ``p_i > Φ(R/σ)``. Per input, the family is the concepts in ``family``
    (e.g. the cited ones): each tests ``H0_i: p_i ≤ Φ(R/σ)`` by the exact one-sided binomial
    test, and Holm's step-down over the family keeps the probability of any false "stable at R"
    claim ≤ α. Per-concept radii ``σ Φ⁻¹(p_lower)`` use Clopper–Pearson bounds at α/m.

    Under concept flips (Bernoulli ρ on the concepts of ``c``) pass ``rule`` =
    `cbcert.certify.hamming.BernoulliHammingRadius` (and ``sigma=None``): radii are Lee et
    al.'s Hamming radii of the two-sided sign (``p_B = 1 − p_lower``) and ``H0_i`` is
    ``p_i ≤ p*(R)``, the smallest agreement probability whose radius reaches R (`threshold`).

    Args:
      select_positive: ``[N, K]`` counts of ``r_i > 0`` among the n0 selection samples.
      n0: selection samples per input (>= 1).
      positive: ``[N, K]`` counts of ``r_i > 0`` among the n estimation samples.
      n: estimation samples per input (>= 1).
      sigma: the latent noise σ > 0 (None with ``rule``).
      alpha: family-wise error level in (0, 1).
      radius: R >= 0 at which stability is claimed.
      family: ``[N, K]`` bool, the concepts of each input tested together (default: all K).
      rule: a radius rule ``rule.radius(p_lower, p_upper)`` replacing the Gaussian one.
    """
    alpha = check_alpha(alpha)
    check_counts(select_positive, n0)
    check_counts(positive, n)
    sel, pos = np.asarray(select_positive), np.asarray(positive)
    if sel.shape != pos.shape or pos.ndim != 2:
        raise ValueError(f"expected selection and estimation counts [N, K] of one shape, got "
                         f"{sel.shape}, {pos.shape}")
    if (rule is None) == (sigma is None):
        raise ValueError("give either sigma (Gaussian noise) or rule (another noise), not both")
    if sigma is not None and not (np.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r} must be > 0")
    if not (np.isfinite(radius) and radius >= 0):
        raise ValueError(f"radius={radius!r} must be >= 0")
    family = np.ones(pos.shape, bool) if family is None else np.asarray(family, bool)
    if family.shape != pos.shape:
        raise ValueError(f"family: expected shape {pos.shape}, got {family.shape}")
    sign = np.where(2 * sel > n0, 1, -1).astype(np.int8)
    agree = np.where(sign > 0, pos, n - pos)  # [N, K]
    p0 = scipy.stats.norm.cdf(radius / sigma) if rule is None else threshold(rule, radius)
    raw = scipy.stats.binom.sf(agree - 1, n, p0)  # P[X >= k | p0]
    adjusted = holm_rows(raw, family)
    certified = family & (adjusted <= alpha)
    m = family.sum(axis=1)
    p_lower = np.zeros(pos.shape)
    for size in np.unique(m[m > 0]):  # one Clopper–Pearson level α/m per family size
        rows = m == size
        p_lower[rows] = clopper_pearson_lower(agree[rows], n, alpha / size)
    if rule is None:
        reach = sigma * special.ndtri(p_lower)
    else:
        reach = np.nan_to_num(rule.radius(p_lower, 1.0 - p_lower), nan=0.0)
    radii = np.where(family & (p_lower > 0.5), reach, 0.0)
    return ConceptCertificate(sign=np.where(family, sign, 0).astype(np.int8), p_value=adjusted,
                              certified=certified, radius=radii,
                              all_certified=np.all(certified | ~family, axis=1))


def threshold(rule: Any, radius: float) -> float:
    """``p*(R)``: the smallest agreement probability p whose two-sided radius
    ``rule.radius(p, 1 − p)`` reaches R (bisection to 1e-12; 1.0 where none does; ½ at R = 0)."""
    def reaches(p: float) -> bool:
        value = float(np.asarray(rule.radius(np.float64(p), np.float64(1.0 - p))))
        return not np.isnan(value) and value >= radius

    low, high = 0.5, 1.0 - 1e-15
    if radius <= 0:
        return 0.5
    if not reaches(high):
        return 1.0
    while high - low > 1e-12:
        mid = (low + high) / 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return high


def holm_rows(pvalues: np.ndarray, family: np.ndarray) -> np.ndarray:
    """Holm-adjusted p-values within each row's family: ``[N, K]``, NaN outside the family.

    Row n with members' sorted ``p_(1) ≤ … ≤ p_(m)``: ``p̃_(i) = min(1, max_{j ≤ i} (m − j + 1)
    p_(j))`` — `cbcert.robustness.stats.holm` applied to every row at once.
    """
    p = np.where(family, np.asarray(pvalues, np.float64), np.inf)
    order = np.argsort(p, axis=1, kind="stable")  # members first, by p-value
    m = family.sum(axis=1, keepdims=True)
    factor = np.maximum(m - np.arange(p.shape[1])[None, :], 1)
    steps = np.minimum(1.0, np.maximum.accumulate(np.take_along_axis(p, order, 1) * factor, 1))
    out = np.empty_like(steps)
    np.put_along_axis(out, order, steps, axis=1)
    return np.where(family, out, np.nan)


def verify_edit(before: np.ndarray, after: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Whether each counterfactual edit did exactly what was asked: ``[N]`` bool.

    ``before``/``after``: ``[N, K]`` bool concept states read out of the clean and the edited
    image; ``targets``: ``[N, K]`` bool, the concepts the edit flips. Valid iff every target
    flipped and no other concept changed; invalid edits are discarded and counted.
    """
    before, after, targets = (np.asarray(a, bool) for a in (before, after, targets))
    if not before.shape == after.shape == targets.shape or before.ndim != 2:
        raise ValueError(f"expected three [N, K] bool arrays, got {before.shape}, "
                         f"{after.shape}, {targets.shape}")
    return np.all(after == (before ^ targets), axis=1)


def counterfactual_consistency(pred_before: np.ndarray, pred_after: np.ndarray,
                               should_change: np.ndarray) -> np.ndarray:
    """``[N]`` bool: the prediction changed iff the class rule says the edit removes the
    support of the class (``should_change``), for the edits `verify_edit` accepted."""
    before, after = np.asarray(pred_before), np.asarray(pred_after)
    should = np.asarray(should_change, bool)
    if not before.shape == after.shape == should.shape or before.ndim != 1:
        raise ValueError(f"expected three [N] arrays, got {before.shape}, {after.shape}, "
                         f"{should.shape}")
    return (before != after) == should


def faithfulness(cited_after: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """``[N]`` bool: the explanation of the edited image cites none of the ``removed[N, K]``
    concepts (``cited_after[N, k]`` with ``-1`` padding)."""
    cited = np.asarray(cited_after)
    removed = np.asarray(removed, bool)
    if cited.ndim != 2 or removed.ndim != 2 or len(cited) != len(removed):
        raise ValueError(f"expected cited [N, k] and removed [N, K], got {cited.shape}, "
                         f"{removed.shape}")
    hit = np.take_along_axis(removed, np.maximum(cited, 0), axis=1) & (cited >= 0)
    return ~hit.any(axis=1)


def bootstrap_ci(values: np.ndarray, *, seed: int, resamples: int = 9999,
                 level: float = 0.95) -> tuple[float, float, float]:
    """Mean of ``values[N]`` and its percentile bootstrap interval over inputs:
    ``(mean, low, high)``, resampling with numpy's generator from ``seed``."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or len(v) < 1:
        raise ValueError(f"values: expected [N >= 1], got {v.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), (int(resamples), len(v)))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(v.mean()), float(low), float(high)


def cited_precision_recall(cited: np.ndarray, relevant: np.ndarray) -> tuple[np.ndarray,
                                                                              np.ndarray]:
    """Known-answer quality of explanations ``cited[N, k]`` against ``relevant[N, K]`` (the
    class-defining concepts present in the image): ``precision = |cited ∩ relevant| / |cited|``,
    ``recall = |cited ∩ relevant| / |relevant|``, each ``[N]``; NaN where the denominator is 0."""
    relevant = np.asarray(relevant, bool)
    cited = np.asarray(cited)
    hit = np.take_along_axis(relevant, np.maximum(cited, 0), axis=1) & (cited >= 0)
    hits = hit.sum(axis=1).astype(np.float64)
    n_cited, n_relevant = (cited >= 0).sum(axis=1), relevant.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        precision = np.where(n_cited > 0, hits / n_cited, np.nan)
        recall = np.where(n_relevant > 0, hits / n_relevant, np.nan)
    return precision, recall


def known_answer_score(cited: np.ndarray, relevant: np.ndarray) -> np.ndarray:
    """``[N]`` F1 of precision and recall (`cited_precision_recall`) in [0, 1]: 1.0 exactly for
    an explanation citing the relevant concepts and nothing else; 1.0 for an empty explanation
    of an input with nothing relevant, 0.0 when only one of the two is empty."""
    precision, recall = cited_precision_recall(cited, relevant)
    both_empty = np.isnan(precision) & np.isnan(recall)
    p, r = np.nan_to_num(precision), np.nan_to_num(recall)
    with np.errstate(invalid="ignore", divide="ignore"):
        f1 = np.where(p + r > 0, 2 * p * r / (p + r), 0.0)
    return np.where(both_empty, 1.0, f1)


# A judge scores one explanation record (a dict: prediction, cited concept names and shares,
# and whatever the caller adds) from 1 (worst) to 9 (best).
Judge = Callable[[dict], float]


def judge_scores(judges: Sequence[Judge], explanations: Sequence[dict]) -> np.ndarray:
    """``[J, N]`` scores of every judge on every explanation; ValueError naming the judge and
    explanation of a score outside [1, 9] or not a finite number."""
    low, high = JUDGE_RANGE
    out = np.empty((len(judges), len(explanations)))
    for j, judge in enumerate(judges):
        for n, record in enumerate(explanations):
            score = judge(record)
            ok = isinstance(score, int | float | np.number) and not isinstance(score, bool)
            if not ok or not low <= float(score) <= high:
                raise ValueError(f"judge {j} scored explanation {n} {score!r}; allowed: a "
                                 f"number in [{low:g}, {high:g}]")
            out[j, n] = float(score)
    return out


def as_judge(cited_of: Callable[[dict], np.ndarray], relevant_of: Callable[[dict], np.ndarray]
             ) -> Judge:
    """The known-answer scorer as a judge: ``1 + 8 · F1`` (`known_answer_score`) of the record's
    cited concepts against its relevant ones, so the oracle explanation scores 9."""
    def judge(record: dict) -> float:
        cited = np.asarray(cited_of(record), np.int64).reshape(1, -1)
        relevant = np.asarray(relevant_of(record), bool).reshape(1, -1)
        return float(1 + 8 * known_answer_score(cited, relevant)[0])

    return judge


def score_sum(scores: np.ndarray) -> np.ndarray:
    """Council aggregate: ``[N]`` the sum of every judge's score (``scores[J, N]``)."""
    scores = np.asarray(scores, np.float64)
    if scores.ndim != 2:
        raise ValueError(f"scores: expected [J, N], got {scores.shape}")
    return scores.sum(axis=0)


def pairwise_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """How often two judges order a pair of explanations alike, over all pairs ``i < j``.

    Per pair: 1 when ``sign(a_i − a_j) == sign(b_i − b_j)`` (ties by both included), 0.5 when
    exactly one judge ties, 0 when they order it oppositely. 1.0 for identical rankings, 0.0
    for reversed ones without ties; NaN with fewer than two explanations.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"expected two [N] score arrays, got {a.shape}, {b.shape}")
    if len(a) < 2:
        return float("nan")
    i, j = np.triu_indices(len(a), k=1)
    sa, sb = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
    value = np.where(sa == sb, 1.0, np.where((sa == 0) ^ (sb == 0), 0.5, 0.0))
    return float(value.mean())


__all__ = ["ConceptCertificate", "Explanation", "Judge", "as_judge", "bootstrap_ci",
           "certify_concept_signs", "cited_precision_recall", "contributions",
           "counterfactual_consistency", "explain", "faithfulness", "holm_rows", "judge_scores",
           "known_answer_score", "pairwise_agreement", "rank_correlation", "score_sum",
           "threshold", "top_k_overlap", "verify_edit"]
