"""`certify explain`: concept-model explanations on clean and perturbed inputs, their certified
stability and their known-answer quality (where the world knows its class rule).

Size: one runner for the whole explanation study (views, certificates, known answer,
counterfactuals, prototype membership, logit decomposition, figure arrays, export) over ~575
lines; its kernels live in `cbcert.robustness.explain`, the explaining heads and record fields
in `cbcert.runs.explanations` and the judge bundle in `cbcert.runs.bundle`.

For the first ``num_inputs`` inputs of the std/cbm agreement set and every concept model m
(``cbm``, ``cbmh``; and ``proto``, the prototype network, whose "concepts" are its prototypes —
below):

* the clean explanation (top-k contributions ``r_i · W[y, i]``, `cbcert.robustness.explain`),
  and the explanations after a latent shift ``z + ε u`` (u on the unit sphere, the perturb run's
  geometric noise and key stream) and after τ concept flips of ``c = E(g1(z))`` (its semantic
  noise), each with its top-k overlap (Jaccard) and Kendall τ-b against the clean one;
* **certified concept stability**: the sign of every concept score ``r_i(g(z + δ))``,
  ``δ ~ N(0, σ² I)``, selected from ``n0`` samples (key stream SELECT) and tested on ``n``
  (ESTIMATE) — the streams of ``certify latent --sigma σ`` — for the concepts the clean
  explanation cites, with Holm over them: which cited concepts keep their sign within radius R
  (family-wise α), each one's certified radius (Bonferroni α/m), and whether all are certified;
* **known-answer quality**: precision, recall and F1 of the cited concepts against the
  class-defining concepts present in the image (concept i on in the image, among the concepts
  the class rule reads, and on in the true class's pattern);
* **explanation-driven counterfactuals**: in the generator's concept space, flip each concept
  the (autoencoded) clean explanation cites, one at a time, and all of them together; verify
  each edit with the generator's concept read-out of the edited latent, ``C(E(D(c')))`` (the
  targets flipped, every other concept unchanged; otherwise the edit is discarded and
  counted), re-classify ``g2(D(c'))`` and score **consistency** (the prediction changes iff the
  world's class rule gives the edited concepts another class than the clean ones) and
  **faithfulness** (the new explanation cites none of the concepts the edit switched off as
  present, ``r_i > 0`` — citing their absence is fine; undefined for edits that switch none
  off).

The prototype network (``proto``) explains its prediction by prototype contributions ``s_j ·
W[y, j]`` (similarity times its readout weight, `World.prototype_head`); its records cite
prototypes (``{"prototype": j, "name": "p<j> (<class it was made for>)", "share"}``). It gets
the ε/τ stability and, instead of concept signs, **certified top-k membership**: for each cited
prototype, the smoothed indicator "cited by the explanation of the noisy image's own
prediction" (`cbcert.robustness.explain.top_k_members` on device), selected and tested exactly
as a concept sign (Holm over the cited prototypes), claimed stable only where the selected
value is "cited". Known-answer scores and concept counterfactuals do not apply to prototypes
(they name no concept of the world) and are left out of its records and summary. Known-answer
scores are left out for every model on worlds without a known class rule (world directories:
``World.class_rule`` is None); counterfactuals edit the cited concepts the generator names
(`cbcert.runs.explanations.edit_mapping`: all of them on built-in worlds, the CB-AE's concepts
of the same name on world directories), with consistency undefined without a class rule.

Concept models' records decompose the predicted logit (``logit``: ``value = concepts + bias``
and, for PCBM-h, ``+ residual``, with the residual's share of the evidence ``|ρ_y| / (Σ_i
|r_i W[y, i]| + |ρ_y|)``): cbmh is explained from its own head, the PCBM's W and b plus its
residual on the embedding, so cbm and cbmh cite alike where they predict alike and differ by
the residual's part.

The inputs of the judge bundle (`cbcert.runs.bundle`) are drawn from the seed and written to
``judge_subset.json`` right after the pool, before any explanation (pre-registration).

Writes ``explanations.jsonl`` (one record per input and model) and ``summary.json`` (per model:
means with percentile bootstrap 95 % intervals over inputs, seed-fixed), and returns the arrays
of ``explain.png`` (the first inputs: image and bars, clean and perturbed), which the CLI draws
(`cbcert.report.explain.draw_explanations`; runs never import the report). A rerun recomputes
everything (the run is small); ``run.json`` pins the settings as every run directory does. With
``rho`` the cited concepts' signs are also certified under Bernoulli concept flips of c
(Hamming radius, Lee et al.; streams SELECT/ESTIMATE of ``certify concept --rho ρ``): fields
``certified_flips``, ``all_certified_flips``.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.certify.smoothing import smoothing
from cbcert.concepts import concept_state
from cbcert.engine.keys import Stream, stream_key
from cbcert.engine.noise import BernoulliFlips, FixedFlips, Gaussian, SphereShift
from cbcert.engine.sampler import map_inputs, map_samples
from cbcert.robustness import explain as ex
from cbcert.runs import bundle, explanations
from cbcert.runs.budgets import observer
from cbcert.runs.certify import check_models
from cbcert.runs.directory import EXPLANATIONS, RunSummary, json_line, write_json
from cbcert.runs.pool import agreement_pool, encode_inputs
from cbcert.runs.session import session
from cbcert.schema import ConfigError, validate

RECORDS = EXPLANATIONS
STEPS = 5  # progress: pool, shifts and flips, selection, estimation, explanations
FIGURE = "explain.png"
PROTO = explanations.PROTO
EXPLAINED = explanations.EXPLAINED


@dataclass(frozen=True)
class ExplainJob:
    """Settings of `certify explain` (module docstring).

    Attributes:
      models: models explained (``cbm``, ``cbmh``, ``proto``), at least one, each once.
      num_inputs: agreement inputs explained.
      eps: latent shift norm ε > 0; tau: concepts flipped, 1..K.
      sigma: latent noise σ of the concept certificate; radius: R ≥ 0 at which stability is
        claimed (default σ / 4); n0, n: selection and estimation samples; alpha: family-wise α.
      top_k: explanation length; seed: root seed (pool, noise, bootstrap); figure_inputs: inputs
        drawn in ``explain.png`` (0: no figure).
      rho: also certify the cited concepts' signs under Bernoulli concept flips of c with
        probability ρ (Hamming radius ``flip_radius``, 1..K), or None.
      judge_inputs: inputs of the judge bundle, 1..num_inputs (default min(20, num_inputs)),
        pre-registered from the key before any explanation (`cbcert.runs.bundle`).
    """

    models: tuple[str, ...] = ("cbm", "cbmh", "proto")
    num_inputs: int = 100
    eps: float = 0.3
    tau: int = 1
    sigma: float = 0.1
    radius: float | None = None
    n0: int = 100
    n: int = 1000
    alpha: float = 0.001
    top_k: int = ex.DEFAULT_TOP_K
    seed: int = 0
    figure_inputs: int = 4
    rho: float | None = None
    flip_radius: int = 1
    judge_inputs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "models", tuple(self.models))
        if self.radius is None:
            object.__setattr__(self, "radius", self.sigma / 4)
        if self.judge_inputs is None and isinstance(self.num_inputs, int):
            object.__setattr__(self, "judge_inputs", min(bundle.DEFAULT_INPUTS, self.num_inputs))
        validate("count", self.num_inputs, key="num_inputs")
        validate("eps", self.eps, key="eps")
        validate("count", self.tau, key="tau")
        validate("sigma", self.sigma, key="sigma")
        validate("samples", self.n0, key="n0")
        validate("samples", self.n, key="n")
        validate("alpha", self.alpha, key="alpha")
        validate("count", self.top_k, key="top_k")
        validate("seed", self.seed, key="seed")
        if self.rho is not None:
            validate("rho", self.rho, key="rho")
        validate("count", self.flip_radius, key="flip_radius")
        validate("count", self.judge_inputs, key="judge_inputs")
        if self.judge_inputs > self.num_inputs:
            allowed = f"[1, num_inputs={self.num_inputs}]"
            raise ConfigError(f"judge_inputs={self.judge_inputs}: allowed range {allowed}",
                              key="judge_inputs", value=self.judge_inputs, allowed=allowed)
        if not (np.isfinite(self.radius) and self.radius >= 0):
            raise ConfigError(f"radius={self.radius!r}: allowed range [0, inf)", key="radius",
                              value=self.radius, allowed="[0, inf)")
        if not (isinstance(self.figure_inputs, int) and 0 <= self.figure_inputs):
            raise ConfigError(f"figure_inputs={self.figure_inputs!r}: allowed range [0, inf)",
                              key="figure_inputs", value=self.figure_inputs, allowed="[0, inf)")
        check_models(self.models)
        unknown = [m for m in self.models if m not in EXPLAINED]
        if unknown:
            detail = (f"got {list(self.models)}; explained models: "
                      f"{', '.join(EXPLAINED)}")
            raise ConfigError(f"models: {detail}", key="models", value=self.models,
                              detail=detail)


def _observations(world, job: ExplainJob, pool, memory: dict, progress) -> dict[str, dict]:
    """Observer outputs (``pred``, ``state``, ``scores``, ``prototypes`` with proto) of the
    clean, ε-shifted and τ-flipped images (``clean_concept`` also ``readout``, the world's
    concept classifier on the clean image, where it has one), and the certificates' counts:
    ``counts[phase]`` =
    ``{"signs": [N, K] (r_i > 0), "members": [N, P] (prototype cited, with proto)}`` for the
    phases ``select``, ``estimate`` (and ``flips_*`` with ρ); ``progress(step, STEPS)``."""
    params, root = world.params, jax.random.key(job.seed)
    k = world.generator.num_concepts
    proto = PROTO in job.models
    latent = observer(world, "latent", job.models, True, prototypes=proto)
    clean = observer(world, "latent", job.models, True, prototypes=proto, logits=True)
    concept = observer(world, "concept", job.models, True, prototypes=proto)
    concepts = encode_inputs(world, pool.latents, **memory)
    common = dict(indices=pool.indices, **memory)

    def on_noisy(f):
        return lambda p, x_clean, x_noisy: f(p, x_noisy)

    def first(out):
        return jax.tree.map(lambda a: a[:, 0], out)

    progress(1, STEPS)
    shifted = map_samples(on_noisy(latent), params, pool.latents,
                          world.noise(SphereShift(), "latent"),
                          stream_key(root, Stream.GEOMETRIC), 1, scale=job.eps, **common)
    flipped = map_samples(on_noisy(concept), params, concepts, FixedFlips(k),
                          stream_key(root, Stream.SEMANTIC), 1, scale=job.tau, **common)

    def events(p, image):
        out = {"signs": world.concept_scores(p["clf"], image) > 0}  # [B, K]
        if proto:  # proto logits are s Wᵀ (World.prototype_head)
            w, _ = world.prototype_head(p["clf"])  # [C, P]
            s = world.prototypes(p["clf"], image)  # [B, P]
            y = jnp.argmax(s @ w.T, axis=-1)
            out["members"] = ex.top_k_members(s * w[y], job.top_k)  # [B, P]
        return out

    def positive(p, x_clean, x_noisy):
        return events(p, world.latent_images(p, x_noisy))

    def total(out):
        return jax.tree.map(lambda a: np.asarray(a).sum(axis=1), out)

    progress(2, STEPS)
    noise = world.noise(Gaussian(), "latent")
    counts = {}
    for step, (name, stream, size) in enumerate((("select", Stream.SELECT, job.n0),
                                                 ("estimate", Stream.ESTIMATE, job.n)), 3):
        counts[name] = total(map_samples(positive, params, pool.latents, noise,
                                         stream_key(root, stream), size, scale=job.sigma,
                                         **common))
        progress(step, STEPS)
    if job.rho is not None:
        def positive_c(p, x_clean, x_noisy):
            return events(p, world.generator.image_from_concepts(p["gen"], x_noisy))

        for name, stream, size in (("flips_select", Stream.SELECT, job.n0),
                                   ("flips_estimate", Stream.ESTIMATE, job.n)):
            counts[name] = total(map_samples(positive_c, params, concepts, BernoulliFlips(k),
                                             stream_key(root, stream), size, scale=job.rho,
                                             **common))
    clean_concept = map_inputs(concept, params, concepts, **memory)
    if world.concept_readout is not None:  # what verifies edits reads the clean image too
        clean_concept["readout"] = map_inputs(
            lambda p, c: world.concept_readout(p["clf"], world.generator.image_from_concepts(
                p["gen"], c)), params, concepts, **memory)
    return {"clean": map_inputs(clean, params, pool.latents, **memory),
            "clean_concept": clean_concept,
            "eps": first(shifted), "tau": first(flipped), "counts": counts,
            "concepts": concepts}


def _counterfactuals(world, job: ExplainJob, h: int, cited: np.ndarray, clean: dict,
                     concepts: np.ndarray, weights: np.ndarray, memory: dict,
                     indices: np.ndarray, mapping: np.ndarray) -> dict:
    """Counterfactual edits of model ``h``'s cited concepts (module docstring), made by the
    world's editor (`World.edit`; keys `cbcert.runs.explanations.edit_keys`) and verified by
    the world's concept classifier on the edited image against its reading of the clean one
    (`World.concept_readout`, world directories that name one), else by the generator's
    read-out ``C(E(D(c')))`` against ``C(c)``.

    Args:
      cited: ``[N, k]`` the clean (autoencoded) explanation's concepts, ``-1`` padding.
      clean: concept-space observer outputs on the clean ``c`` (``pred``, ``state``, and
        ``readout``, the concept classifier's reading, where the world has one).
      concepts: ``[N, 2K + U]`` the clean concept representations.
      indices: ``[N]`` the inputs' global pool indices (the edits' keys).
      mapping: ``[units]`` the generator concept of each cited unit, ``-1`` where none
        (`cbcert.runs.explanations.edit_mapping`): unmapped concepts are not edited.

    Returns:
      ``{"single": fields [N, k], "all": fields [N]}``, fields ``valid``, ``should_change``,
      ``consistent``, ``faithful`` (verified edits only) and ``consistent_unverified``,
      ``faithful_unverified`` (every edit, as a study without verification would count it:
      ``should_change`` from the asked targets); NaN where undefined (consistency without a
      class rule) or the slot edits nothing.
    """
    gen, k, rule = world.generator, world.generator.num_concepts, world.class_rule
    n, top = cited.shape
    targets = np.zeros((n, top + 1, k), bool)  # slot j < top: concept j alone; top: all
    rows, slots = np.nonzero(cited >= 0)
    edited_concept = mapping[cited[rows, slots]]
    ok = edited_concept >= 0
    targets[rows[ok], slots[ok], edited_concept[ok]] = True
    targets[:, top] = targets[:, :top].any(axis=1)
    used = targets.any(axis=2)  # [N, top + 1]
    flat_targets = targets.reshape(-1, k)
    edited = np.asarray(world.edit(explanations.edit_keys(job.seed, indices, top + 1),
                                   np.repeat(concepts, top + 1, axis=0), flat_targets))
    model = (job.models[h],)

    def read(p, c, image):  # the concept classifier on the image, or the generator's C(E(D(c)))
        if world.concept_readout is not None:
            return world.concept_readout(p["clf"], image)
        return concept_state(gen.encode(p["gen"], gen.decode(p["gen"], c)), k)

    def observe(p, c):
        image = gen.image_from_concepts(p["gen"], c)
        return {"pred": jnp.argmax(world.classify(p["clf"], image, model)[:, 0], axis=-1),
                "readout": read(p, c, image), "scores": world.concept_scores(p["clf"], image)}

    out = map_inputs(observe, world.params, edited, **memory)
    # C(c), or the concept classifier's reading of the clean image (`_observations`)
    before = np.repeat(np.asarray(clean.get("readout", clean["state"])), top + 1, axis=0)
    valid = ex.verify_edit(before, out["readout"], flat_targets)
    pred_before = np.repeat(clean["pred"][:, h], top + 1)
    if rule is None:  # no class rule: whether the class should change is unknown
        should = consistent = np.full(len(flat_targets), np.nan)
    else:
        should = (np.asarray(rule.label(jnp.asarray(flat_targets ^ before)))
                  != np.asarray(rule.label(jnp.asarray(before))))
        consistent = ex.counterfactual_consistency(pred_before, out["pred"], should)
    e_after = ex.explain(ex.contributions(out["scores"], weights, out["pred"]), job.top_k)
    removed = flat_targets & before
    after = e_after.concepts
    present = np.take_along_axis(out["scores"] > 0, np.maximum(after, 0), axis=1)
    as_edited = np.where(after >= 0, mapping[np.maximum(after, 0)], -1)  # generator concepts
    faithful = ex.faithfulness(np.where(present & (after >= 0), as_edited, -1), removed)
    keep = used.reshape(-1)

    def field(values, defined=None, verified=True):
        mask = keep & (valid if verified else True)
        mask = mask if defined is None else mask & defined
        return np.where(mask, values.astype(np.float64), np.nan).reshape(n, top + 1)

    fields = {"valid": np.where(keep, valid, np.nan).reshape(n, top + 1),
              "should_change": field(should), "consistent": field(consistent),
              "faithful": field(faithful, removed.any(axis=1)),
              "consistent_unverified": field(consistent, verified=False),
              "faithful_unverified": field(faithful, removed.any(axis=1), verified=False)}
    return {"single": {f: v[:, :top] for f, v in fields.items()},
            "all": {f: v[:, top] for f, v in fields.items()}}


def _relevant(world, pool, state: np.ndarray) -> np.ndarray:
    """``[N, K]`` class-defining concepts present: on in the image (``state``), read by the
    class rule and on in the true class's pattern (`World.class_rule`'s ``defining``)."""
    return state.astype(bool) & world.class_rule.defining[pool.true_labels]


def _cited(e: ex.Explanation, row: int, names, unit: str = "concept",
           contrib: np.ndarray | None = None) -> list[dict]:
    """The cited units of explanation ``row`` (with their contributions, given
    ``contrib[N, units]``)."""
    return [{unit: int(i), "name": names[i], "share": float(s)}
            | ({} if contrib is None else {"contribution": float(contrib[row, i])})
            for i, s in zip(e.concepts[row], e.shares[row], strict=True) if i >= 0]


def _logit(clean: dict, h: int, contrib: np.ndarray, head: explanations.Head
           ) -> dict[str, np.ndarray] | None:
    """Decomposition of concept model ``h``'s predicted logit on the clean images (None for
    prototypes): ``value = concepts + bias (+ residual)``, ``concepts = Σ_i r_i W[y, i]``,
    ``bias = b_y``; for PCBM-h (``head.residual``) ``residual = value − concepts − bias`` is
    its residual's logit ``ρ_y(e)`` and ``residual_share = |ρ_y| / (Σ_i |r_i W[y, i]| +
    |ρ_y|)``, the residual's part of the evidence (bias left out: it does not depend on the
    input). Each ``[N]``."""
    if head.bias is None:
        return None
    y = clean["pred"][:, h]
    value = np.take_along_axis(np.asarray(clean["logits"][:, h], np.float64), y[:, None],
                               axis=1)[:, 0]
    out = {"value": value, "concepts": contrib.sum(axis=1), "bias": head.bias[y]}
    if head.residual:
        out["residual"] = value - out["concepts"] - out["bias"]
        out["residual_share"] = np.abs(out["residual"]) / (
            np.abs(contrib).sum(axis=1) + np.abs(out["residual"]))
    return out


def _cited_only(cert: ex.ConceptCertificate) -> ex.ConceptCertificate:
    """A membership certificate claims stability only where the selected value is "cited"."""
    cited = cert.sign > 0
    certified = cert.certified & cited
    return replace(cert, certified=certified, radius=np.where(cited, cert.radius, 0.0),
                   all_certified=np.all(certified | (cert.sign == 0), axis=1))


def check(world, job: ExplainJob) -> None:
    """`ConfigError` for a world without concept head (concept models) or prototype head
    (``proto``), τ > K, or (with ρ) a flip radius > K: no two states of K concepts are
    further apart."""
    explanations.check(world, job.models)
    k = world.generator.num_concepts
    if job.tau > k:
        raise ConfigError(f"tau={job.tau}: allowed range [1, K={k}]", key="tau", value=job.tau,
                          allowed=f"[1, {k}]")
    if job.rho is not None and job.flip_radius > k:
        detail = f"got {job.flip_radius}, allowed range [1, K={k}] (concepts of the world)"
        raise ConfigError(f"flip_radius={job.flip_radius}: {detail}", key="flip_radius",
                          value=job.flip_radius, allowed=f"[1, {k}]", detail=detail)


@dataclass(frozen=True)
class ExplanationFigure:
    """What ``explain.png`` shows, as arrays, for the caller to draw
    (`cbcert.report.explain.draw_explanations`): the first ``figure_inputs`` inputs explained
    by the first model.

    Attributes:
      rows: one per input, ``{view: {"image": [H, W, 3] float in [0, 1], "prediction": class
        name, "cited": [{"concept", "name", "share"}, ...]}}`` for the views ``clean``, ``eps``
        (the ε-shifted latent) and ``tau`` (τ concepts flipped).
      titles: ``{view: panel title}`` (``clean``, ``ε = …``, ``τ = …``).
      model: the model explained.
    """

    rows: tuple[dict[str, dict], ...]
    titles: dict[str, str]
    model: str


def run(world, job: ExplainJob, out: str | Path, *, progress=None, chunk_size: int | None = None,
        max_memory: int | None = None, judge_bundle: bool = False) -> RunSummary:
    """Explain, perturb, certify and score (module docstring); returns the `RunSummary` with
    the figure's arrays as ``extras["figure"]`` (an `ExplanationFigure` to draw as `FIGURE`,
    None with ``figure_inputs=0``) and, with ``judge_bundle``, the judge bundle of the
    pre-registered inputs as ``extras["bundle"]`` (a `cbcert.runs.bundle.JudgeBundle`, None
    without): the caller draws and writes them (the runner draws nothing). The
    pre-registered inputs are written to ``judge_subset.json`` before any explanation.

    ``progress(done, total)`` is called after each of the `STEPS` phases.

    Raises `ConfigError` for a world without concept head or ground-truth patterns, τ > K or
    (with ρ) a flip radius > K.
    """
    world.check_models(job.models)
    world.check_models(("std", "cbm"))
    check(world, job)
    memory = dict(chunk_size=chunk_size, max_memory=max_memory)
    # judge_inputs chooses the bundle's inputs, not any record: recorded, left free on a rerun.
    with session(out, "explain", {"explain": asdict(job) | {"models": list(job.models)},
                                  "world": world.name}, world,
                 free=("explain.judge_inputs",)) as directory:
        pool = agreement_pool(world, job.seed, job.num_inputs, **memory)
        judged = bundle.draw_subset(job.seed, job.num_inputs, job.judge_inputs)
        write_json(directory.path(bundle.SUBSET), bundle.subset_record(
            job.seed, job.num_inputs, judged, pool.indices[judged]))
        report = progress or (lambda done, total: None)
        obs = _observations(world, job, pool, memory, report)
        heads = explanations.heads(world, job.models)
        known = world.class_rule is not None
        mapping = explanations.edit_mapping(world)
        relevant = _relevant(world, pool, obs["clean"]["state"]) if known else None
        records, per_model, shown = [], {}, {}
        for h, m in enumerate(job.models):
            head, contrib, expl = heads[m], {}, {}
            for view, o in (("clean", obs["clean"]), ("clean_concept", obs["clean_concept"]),
                            ("eps", obs["eps"]), ("tau", obs["tau"])):
                contrib[view] = ex.contributions(o[head.activations], head.weights,
                                                 o["pred"][:, h])
                expl[view] = ex.explain(contrib[view], job.top_k)
            stability = {}
            for view, reference in (("eps", "clean"), ("tau", "clean_concept")):
                stability[view] = (
                    ex.top_k_overlap(expl[reference].concepts, expl[view].concepts),
                    ex.rank_correlation(contrib[reference], contrib[view],
                                        expl[reference].concepts, expl[view].concepts))
            cited = expl["clean"].cited(len(head.names))
            counts = {name: c[head.counts] for name, c in obs["counts"].items()}
            certs = {"": ex.certify_concept_signs(counts["select"], job.n0, counts["estimate"],
                                                  job.n, job.sigma, job.alpha,
                                                  radius=job.radius, family=cited)}
            if job.rho is not None:
                certs["_flips"] = ex.certify_concept_signs(
                    counts["flips_select"], job.n0, counts["flips_estimate"], job.n, None,
                    job.alpha, radius=job.flip_radius, family=cited,
                    rule=smoothing("bernoulli").radius_rule(job.rho, world.generator.num_concepts))
            if m == PROTO:
                certs = {suffix: _cited_only(cert) for suffix, cert in certs.items()}
            quality = edits = None
            if m != PROTO and known:
                precision, recall = ex.cited_precision_recall(expl["clean"].concepts, relevant)
                quality = (precision, recall,
                           ex.known_answer_score(expl["clean"].concepts, relevant))
            if m != PROTO and mapping is not None:
                edits = _counterfactuals(world, job, h, expl["clean_concept"].concepts,
                                         obs["clean_concept"], obs["concepts"], head.weights,
                                         memory, pool.indices, mapping)
            logit = _logit(obs["clean"], h, contrib["clean"], head)
            for row in range(job.num_inputs):
                records.append(_record(pool, row, m, obs, h, expl, contrib, stability, certs,
                                       head, quality, edits, logit))
            per_model[m] = _model_summary(stability, certs, quality, edits, job.seed)
            if head.residual:
                per_model[m]["residual_share"] = _interval(logit["residual_share"], job.seed)
            shown[m] = expl
        report(STEPS, STEPS)
        summary = {"settings": asdict(job) | {"models": list(job.models)}, "world": world.name,
                   "inputs": job.num_inputs, "models": per_model}
        # Written whole (the run is small and never resumes half-way), before summary.json,
        # which marks the run finished.
        directory.writing()
        directory.path(RECORDS).write_text("".join(json_line(r) for r in records))
        figure = _figure(world, job, pool, obs, shown) if job.figure_inputs else None
        judges = (bundle.build(world, job, pool, obs["concepts"], records, judged,
                               explanations.concept_names(world)) if judge_bundle else None)
        return directory.finish(summary, figure=figure, bundle=judges)


def _float(value) -> float | None:  # NaN (undefined) as JSON null
    return None if np.isnan(value) else float(value)


def _edit_fields(fields: dict, index) -> dict:
    return {name: None if np.isnan(v[index]) else bool(v[index]) for name, v in fields.items()}


def _record(pool, row, model, obs, h, expl, contrib, stability, certs,
            head: explanations.Head, quality, edits, logit) -> dict:
    """One input's record for one model; prototype records (``quality``/``edits``/``logit``
    None) cite prototypes, and their certificates say ``cited_under_noise`` instead of
    ``sign``."""
    cited_clean = [int(i) for i in expl["clean"].concepts[row] if i >= 0]
    unit, names = head.unit, head.names

    def certified(cert, i):
        value = ({"sign": int(cert.sign[row, i])} if unit == "concept"
                 else {"cited_under_noise": bool(cert.sign[row, i] > 0)})
        return {unit: i, **value, "stable_at_radius": bool(cert.certified[row, i]),
                "radius": float(cert.radius[row, i]), "p_holm": float(cert.p_value[row, i])}

    out = {
        "index": int(pool.indices[row]), "model": model, "label": int(pool.labels[row]),
        "true_label": None if pool.true_labels is None else int(pool.true_labels[row]),
        "prediction": int(obs["clean"]["pred"][row, h]),
        "cited": _cited(expl["clean"], row, names, unit, contrib["clean"]),
        **{view: {"prediction": int(obs[view]["pred"][row, h]),
                  "cited": _cited(expl[view], row, names, unit, contrib[view]),
                  "overlap": float(stability[view][0][row]),
                  "kendall": _float(stability[view][1][row])} for view in ("eps", "tau")},
        **{f"certified{suffix}": [certified(cert, i) for i in cited_clean]
           for suffix, cert in certs.items()},
        **{f"all_certified{suffix}": bool(cert.all_certified[row])
           for suffix, cert in certs.items()},
    }
    if logit is not None:
        out["logit"] = {name: float(v[row]) for name, v in logit.items()}
    if quality is not None:
        out |= {"precision": _float(quality[0][row]), "recall": _float(quality[1][row]),
                "f1": float(quality[2][row])}
    if edits is not None:  # the cited concepts the generator can edit (edit_mapping)
        cited_concept = expl["clean_concept"].concepts[row]
        out["counterfactuals"] = {
            "single": [{"concept": int(i), **_edit_fields(edits["single"], (row, j))}
                       for j, i in enumerate(cited_concept)
                       if i >= 0 and not np.isnan(edits["single"]["valid"][row, j])],
            "all": _edit_fields(edits["all"], row)}
    return out


def _interval(values: np.ndarray, seed: int) -> dict[str, float] | None:
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return None
    mean, low, high = ex.bootstrap_ci(values, seed=seed, resamples=2000)
    return {"mean": mean, "low": low, "high": high, "inputs": int(len(values))}


def _model_summary(stability, certs, quality, edits, seed) -> dict[str, Any]:
    """Per model: means with bootstrap 95 % intervals over inputs (NaNs left out, counted);
    known-answer and counterfactual measures only where ``quality``/``edits`` are given."""
    out = {f"{view}_{name}": _interval(np.asarray(values, np.float64), seed)
           for view, pair in stability.items()
           for name, values in zip(("overlap", "kendall"), pair, strict=True)}
    for suffix, cert in certs.items():
        out[f"all_cited_certified{suffix}"] = _interval(cert.all_certified.astype(float), seed)
        with warnings.catch_warnings():  # an input citing nothing has no mean radius (NaN)
            warnings.simplefilter("ignore", RuntimeWarning)
            radius = np.nanmean(np.where(cert.sign != 0, cert.radius, np.nan), axis=1)
        out[f"mean_certified_radius{suffix}"] = _interval(radius, seed)
    if quality is not None:
        for name, values in zip(("precision", "recall", "f1"), quality, strict=True):
            out[name] = _interval(np.asarray(values, np.float64), seed)
    for kind, fields in (edits or {}).items():
        valid = fields["valid"][~np.isnan(fields["valid"])]
        out[f"{kind}_edits"] = {"attempted": int(valid.size), "discarded": int((valid == 0).sum())}
        for name in ("consistent", "faithful", "consistent_unverified", "faithful_unverified"):
            out[f"{kind}_{name}"] = _interval(np.asarray(fields[name], np.float64).ravel(), seed)
    return out


def _figure(world, job, pool, obs, shown) -> ExplanationFigure:
    """The first inputs: clean, ε-shifted and τ-flipped images with the first model's bars."""
    count = min(job.figure_inputs, job.num_inputs)
    images = bundle.view_images(world, job, pool, obs["concepts"], np.arange(count))
    model, h, rows = job.models[0], 0, []
    names = explanations.heads(world, (model,))[model].names
    for r in range(count):
        rows.append({view: {"image": images[view][r],
                            "prediction": world.class_names[int(obs[view]["pred"][r, h])],
                            "cited": _cited(shown[model][view], r, names)}
                     for view in ("clean", "eps", "tau")})
    titles = {"clean": "clean", "eps": f"ε = {job.eps:g}", "tau": f"τ = {job.tau}"}
    return ExplanationFigure(tuple(rows), titles, model)


EXPORT_FORMAT = "cbcert-explanations"


def export(out: str | Path, world, path: str | Path) -> int:
    """Write the clean explanations of a finished run as JSON an external judge can read.

    Format (version 1)::

        {"format": "cbcert-explanations", "version": 1, "world": NAME,
         "class_names": [...], "concept_names": [...],
         "explanations": [{"id": "<index>-<model>", "index": i, "model": m,
                           "prediction": CLASS NAME, "label": CLASS NAME,
                           "concepts": [{"name": CONCEPT, "share": s}, ...]}, ...]}

    ``share`` is the concept's signed share of the top-k contributions (positive: evidence
    for the prediction), ranked. A prototype network's explanations (model ``proto``) carry
    ``"prototypes": [{"name": "p<j> (<class it was made for>)", "share": s}, ...]`` instead of
    ``"concepts"``. Returns the number of explanations written.
    """
    import json

    records = [json.loads(line) for line in (Path(out) / RECORDS).read_text().splitlines()]
    classes = world.class_names
    items = [{"id": f"{r['index']}-{r['model']}", "index": r["index"], "model": r["model"],
              "prediction": classes[r["prediction"]], "label": classes[r["label"]],
              "prototypes" if r["model"] == PROTO else "concepts":
                  [{"name": c["name"], "share": c["share"]} for c in r["cited"]]}
             for r in records]
    write_json(Path(path), {"format": EXPORT_FORMAT, "version": 1, "world": world.name,
                            "class_names": list(classes),
                            "concept_names": list(explanations.concept_names(world)),
                            "explanations": items})
    return len(items)


__all__ = ["EXPORT_FORMAT", "ExplainJob", "ExplanationFigure", "FIGURE", "RECORDS",
           "check", "export", "run"]
