"""Train post-hoc concept bottleneck models (Yuksekgonul et al., ICLR 2023) on a backbone's
embeddings, by the recipe of the authors' post-hoc-cbm (``learn_concepts_dataset.py``,
``train_pcbm.py``, ``train_pcbm_h.py``), in JAX.

Every stage reads embeddings ``e = backbone.embed(normalise(x))`` (``[N, D]``) of the training
images; nothing here touches pixels.

1. **Concept bank** (`concept_samples`, `fit_linear_svms`). For each annotated concept k,
   ``2n`` images with the concept and ``2n`` without are drawn from the training split
   (without replacement; with replacement where a side has fewer than ``2n``, as the reference
   falls back to). The first ``n`` of each side train a linear SVM, the other ``n`` measure its
   held-out accuracy. The SVM is scikit-learn's ``SVC(kernel="linear", C)``: with targets
   ``t = ±1`` (``+1``: concept present)

       min_{w, b}  ½‖w‖² + C Σ_i max(0, 1 − t_i (w·e_i + b)),

   solved in its dual ``min_α ½ αᵀQα − Σα``, ``Q_ij = t_i t_j e_i·e_j``, ``0 ≤ α ≤ C``,
   ``Σ t_i α_i = 0`` by SMO as libsvm solves it: the working pair chosen with second-order
   information (Fan, Chen & Lin 2005, WSS 2), stopped when the maximal KKT violation
   ``max_{I_up} −t G − min_{I_low} −t G`` falls below ``tol`` (libsvm's and scikit-learn's
   default 10⁻³), the intercept ``b = −ρ`` by libsvm's rule (the mean of ``t_i G_i`` over free
   vectors, else the midpoint of its bounds). The CAV is ``w = Σ α_i t_i e_i``; the PCBM's
   margins are ``r = (V e + b) / ‖V‖``.
2. **PCBM head** (`fit_elastic_net_logistic`). The reference fits scikit-learn's
   ``SGDClassifier(loss="log_loss", penalty="elasticnet", alpha=λ, l1_ratio=ρ)`` on the margins:
   one-vs-rest, each class c minimising

       F(w, b) = (1/N) Σ_i log(1 + exp(−t_i (w·r_i + b))) + λ (ρ ‖w‖₁ + (1 − ρ)/2 ‖w‖²),

   ``t_i = +1`` for class c and ``−1`` otherwise (a two-class task keeps one problem, class 1
   positive, and one logit). SGD only approximates the minimiser of F; here F is minimised by
   accelerated proximal gradient (FISTA with gradient-based restart, step ``1/L``,
   ``L = σ_max([r, 1])² / (4N) + λ(1 − ρ)``, soft-thresholding for the ℓ₁ term) until the
   gradient mapping is below ``tol`` in every coordinate, so the head is the objective's
   minimiser, not one run of SGD.
3. **PCBM-h residual** (`make_hybrid_step`). The concept part frozen, a residual
   ``W_res e + b_res`` (``torch.nn.Linear(D, C)``'s initialisation, ``U(±1/√D)``) is trained
   with Adam (PyTorch's defaults: β = (0.9, 0.999), ε = 10⁻⁸) on
   ``L = CE(h(r) + W_res e + b_res, y) + λ₂ mean(W_res²)`` over mini-batches of the embeddings,
   as ``train_pcbm_h.py`` does; one step equals ``torch.optim.Adam``'s step (tested).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbcert.engine import compiler
from cbcert.schema import ConfigError

# Second word of the seeds of the concept samples and of PCBM-h's data order: streams of
# their own, apart from the classifier trainer's ORDER_STREAM (11).
CONCEPT_STREAM = 12
HYBRID_STREAM = 13
_TAU = 1e-12  # libsvm's TAU: the curvature used where a pair's is not positive


@dataclass(frozen=True)
class PCBMTrainConfig:
    """Settings of ``certify train pcbm`` (defaults: the reference's).

    Attributes:
      n_samples: n, images per side that train each concept's SVM (``--n-samples``, 50).
      svm_c: the SVMs' C (0.1 in the reference's examples; > 0).
      svm_tol: SMO's stopping tolerance on the maximal KKT violation (10⁻³).
      lam: λ of the head's elastic net (10⁻⁵); l1_ratio: ρ (0.99).
      head_tol: the head's stopping tolerance on the gradient mapping (10⁻⁶ · … see
        `fit_elastic_net_logistic`); head_max_iter: its iteration cap.
      hybrid_epochs, hybrid_lr, hybrid_batch_size, l2_penalty: PCBM-h's Adam run (20, 0.01,
        64, 10⁻³ in the reference).
      seed: concept samples, the residual's initialisation and PCBM-h's data order.
    """

    n_samples: int = 50
    svm_c: float = 0.1
    svm_tol: float = 1e-3
    lam: float = 1e-5
    l1_ratio: float = 0.99
    head_tol: float = 1e-5
    head_max_iter: int = 20_000
    hybrid_epochs: int = 20
    hybrid_lr: float = 0.01
    hybrid_batch_size: int = 64
    l2_penalty: float = 1e-3
    seed: int = 42

    def __post_init__(self):
        checks = (("n_samples", self.n_samples >= 1, "an integer ≥ 1"),
                  ("svm_c", self.svm_c > 0, "> 0"),
                  ("svm_tol", self.svm_tol > 0, "> 0"),
                  ("lam", self.lam >= 0, "≥ 0"),
                  ("l1_ratio", 0 <= self.l1_ratio <= 1, "in [0, 1]"),
                  ("head_tol", self.head_tol > 0, "> 0"),
                  ("head_max_iter", self.head_max_iter >= 1, "an integer ≥ 1"),
                  ("hybrid_epochs", self.hybrid_epochs >= 0, "an integer ≥ 0"),
                  ("hybrid_lr", self.hybrid_lr > 0, "> 0"),
                  ("hybrid_batch_size", self.hybrid_batch_size >= 1, "an integer ≥ 1"),
                  ("l2_penalty", self.l2_penalty >= 0, "≥ 0"))
        for key, ok, allowed in checks:
            if not ok:
                value = getattr(self, key)
                raise ConfigError(f"{key}={value!r}: must be {allowed}", key=key, value=value,
                                  allowed=allowed)


def select_concepts(labels: np.ndarray, names: tuple[str, ...], choice: str | int | list[str]
                    ) -> tuple[np.ndarray, tuple[str, ...]]:
    """The concepts a PCBM is built on (``--concepts``).

    Args:
      labels: ``{0,1}[N, A]`` the training images' attribute labels; names: their A names.
      choice: ``"all"`` (every attribute present in some but not every training image: the
        others cannot train an SVM), an integer k (the k such attributes whose training
        positive rate is closest to 1/2, ties by index: cbcert's choice where the method only
        gives the count, e.g. 18/27/36), or a list of attribute names (each must be usable).
    Returns:
      ``(indices int[K] into the A attributes, their names)`` in the attributes' order.
    Raises:
      ConfigError: (key ``concepts``) an unknown or unusable name, k outside
        ``[1, usable]``, or no usable attribute.
    """
    rate = (np.asarray(labels) > 0).mean(axis=0)
    usable = (rate > 0) & (rate < 1)
    if isinstance(choice, str) and choice == "all":
        picked = np.flatnonzero(usable)
    elif isinstance(choice, int | np.integer):
        if not 1 <= choice <= usable.sum():
            raise ConfigError(f"concepts={choice}: must be in [1, {int(usable.sum())}] (the "
                              "attributes present in some but not every training image)",
                              key="concepts", value=int(choice),
                              allowed=f"[1, {int(usable.sum())}]")
        distance = np.where(usable, np.abs(rate - 0.5), np.inf)
        picked = np.sort(np.argsort(distance, kind="stable")[:choice])
    else:
        index = {name: i for i, name in enumerate(names)}
        picked = []
        for name in choice:
            if name not in index:
                raise ConfigError(f"concepts: {name!r} is not an attribute of the dataset "
                                  f"(e.g. {names[0]!r})", key="concepts", value=name)
            if not usable[index[name]]:
                which = "no" if rate[index[name]] == 0 else "every"
                raise ConfigError(f"concepts: {name!r} is present in {which} training image, "
                                  "so no SVM can separate it", key="concepts", value=name)
            picked.append(index[name])
        picked = np.asarray(picked, np.int64)
    if not len(picked):
        raise ConfigError("concepts: no attribute is present in some but not every training "
                          "image", key="concepts", value=str(choice))
    return picked, tuple(names[i] for i in picked)


def concept_samples(attributes: np.ndarray, n_samples: int, seed: int,
                    names: tuple[str, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row indices of the images that learn each concept.

    Args:
      attributes: ``{0,1}[N, K]``, concept k present in image i iff ``attributes[i, k]``.
      n_samples: n; ``2n`` positives and ``2n`` negatives are drawn per concept from
        ``numpy.random.default_rng([seed, CONCEPT_STREAM, k])`` (the same on every machine),
        without replacement where a side has at least ``2n`` images, else with replacement.
      names: concept names for the error message.
    Returns:
      ``(positives int[K, 2n], negatives int[K, 2n])``; the first n columns train the SVM,
      the last n measure it.
    Raises:
      ConfigError: (key ``concepts``) a concept present in every image or in none.
    """
    attributes = np.asarray(attributes) > 0
    pos, neg = [], []
    for k in range(attributes.shape[1]):
        sides = np.flatnonzero(attributes[:, k]), np.flatnonzero(~attributes[:, k])
        if not len(sides[0]) or not len(sides[1]):
            name = names[k] if names else f"concept {k}"
            which = "no" if not len(sides[0]) else "every"
            raise ConfigError(f"concepts: {name!r} is present in {which} training image, so "
                              "no SVM can separate it; leave it out of --concepts",
                              key="concepts", value=name)
        rng = np.random.default_rng([seed, CONCEPT_STREAM, k])
        pos.append(rng.choice(sides[0], 2 * n_samples, replace=len(sides[0]) < 2 * n_samples))
        neg.append(rng.choice(sides[1], 2 * n_samples, replace=len(sides[1]) < 2 * n_samples))
    return np.stack(pos), np.stack(neg)


def _smo(x: jax.Array, t: jax.Array, c: float, tol: float, max_iter: int):
    """One SVM by SMO (module docstring): ``x[n, D], t ±1[n] -> (w[D], b, iterations, gap)``."""
    kernel = jnp.matmul(x, x.T, precision=jax.lax.Precision.HIGHEST)  # [n, n]
    diag = jnp.diagonal(kernel)

    def violation(alpha, grad):
        score = -t * grad
        up = jnp.where(t > 0, alpha < c, alpha > 0)
        low = jnp.where(t > 0, alpha > 0, alpha < c)
        i = jnp.argmax(jnp.where(up, score, -jnp.inf))
        gap = score[i] - jnp.min(jnp.where(low, score, jnp.inf))
        return score, low, i, gap

    def cond(carry):
        alpha, grad, it = carry
        return (violation(alpha, grad)[3] > tol) & (it < max_iter)

    def body(carry):
        alpha, grad, it = carry
        score, low, i, _ = violation(alpha, grad)
        gain = score[i] - score  # b_ij > 0 for a violating pair
        curve = diag[i] + diag - 2 * kernel[i]
        curve = jnp.where(curve > 0, curve, _TAU)
        j = jnp.argmin(jnp.where(low & (gain > 0), -gain ** 2 / curve, jnp.inf))
        cap_i = jnp.where(t[i] > 0, c - alpha[i], alpha[i])
        cap_j = jnp.where(t[j] > 0, alpha[j], c - alpha[j])
        step = jnp.minimum(gain[j] / curve[j], jnp.minimum(cap_i, cap_j))
        new_i = jnp.where(step >= cap_i, jnp.where(t[i] > 0, c, 0.0), alpha[i] + t[i] * step)
        new_j = jnp.where(step >= cap_j, jnp.where(t[j] > 0, 0.0, c), alpha[j] - t[j] * step)
        grad = grad + t * (kernel[:, i] - kernel[:, j]) * step
        return alpha.at[i].set(new_i).at[j].set(new_j), grad, it + 1

    n = x.shape[0]
    alpha0 = jnp.zeros((n,), x.dtype)
    alpha, _, iterations = jax.lax.while_loop(cond, body, (alpha0, -jnp.ones_like(alpha0), 0))
    coef = alpha * t
    grad = t * (kernel @ coef) - 1.0  # recomputed: no drift from the updates
    _, _, _, gap = violation(alpha, grad)
    y_grad = t * grad
    free = (alpha > 0) & (alpha < c)
    upper = jnp.where(alpha >= c, t < 0, t > 0)  # libsvm: bounds of rho from bounded vectors
    ub = jnp.min(jnp.where(~free & upper, y_grad, jnp.inf))
    lb = jnp.max(jnp.where(~free & ~upper, y_grad, -jnp.inf))
    rho = jnp.where(free.any(), jnp.sum(jnp.where(free, y_grad, 0.0)) / jnp.maximum(free.sum(), 1),
                    (ub + lb) / 2)
    w = jnp.matmul(coef, x, precision=jax.lax.Precision.HIGHEST)
    return w, -rho, iterations, gap


@compiler.jit
def _smo_batch(x, t, c, tol, max_iter):
    return jax.vmap(lambda xi, ti: _smo(xi, ti, c, tol, max_iter))(x, t)


def fit_linear_svms(x: np.ndarray, labels: np.ndarray, c: float, *, tol: float = 1e-3,
                    max_iter: int = 200_000) -> dict[str, np.ndarray]:
    """Linear SVMs (``SVC(kernel="linear", C=c)``, module docstring), one per concept.

    Args:
      x: ``float32[K, n, D]`` the training embeddings of each concept's SVM.
      labels: ``{0,1}[K, n]`` (1: concept present, the SVM's positive side).
      c: C > 0; tol: the stopping tolerance on the maximal KKT violation; max_iter: SMO's cap.
    Returns:
      ``{"cavs": float32[K, D], "intercepts": float32[K], "iterations": int[K],
      "violation": float32[K]}`` (the final maximal KKT violation; ``≤ tol`` unless the cap
      was reached). The decision value of e is ``cavs_k·e + intercepts_k``.
    """
    x = jnp.asarray(x, jnp.float32)
    t = jnp.where(jnp.asarray(labels) > 0, 1.0, -1.0).astype(jnp.float32)
    w, b, iterations, gap = _smo_batch(x, t, jnp.float32(c), jnp.float32(tol),
                                       jnp.int32(max_iter))
    return {"cavs": np.asarray(w), "intercepts": np.asarray(b),
            "iterations": np.asarray(iterations), "violation": np.asarray(gap)}


def margins(embeddings: np.ndarray, cavs: np.ndarray, intercepts: np.ndarray) -> np.ndarray:
    """The PCBM's concept margins ``r = (e Vᵀ + b) / ‖V‖``: ``[N, D] -> float32[N, K]``, with
    the row norms of the float32 CAVs (as `cbcert.models.pcbm.PCBM.margins`)."""
    cavs = np.asarray(cavs, np.float32)
    norms = np.linalg.norm(cavs, axis=1)
    return ((np.asarray(embeddings, np.float32) @ cavs.T + intercepts) / norms).astype(np.float32)


def _soft(x, threshold):
    return jnp.sign(x) * jnp.maximum(jnp.abs(x) - threshold, 0.0)


@compiler.jit
def _fista(features, targets, lam, l1_ratio, tol, max_iter):
    """FISTA on every row of ``targets`` (``±1[P, N]``): ``-> (w[P, K], b[P], it[P], g[P])``."""
    n, k = features.shape
    design = jnp.concatenate([features, jnp.ones((n, 1), features.dtype)], axis=1)  # [N, K+1]
    lipschitz = jnp.linalg.norm(design, 2) ** 2 / (4 * n) + lam * (1 - l1_ratio)
    step = 1.0 / lipschitz
    penalty = jnp.concatenate([jnp.full((k,), lam * l1_ratio * step), jnp.zeros((1,))])
    ridge = jnp.concatenate([jnp.full((k,), lam * (1 - l1_ratio)), jnp.zeros((1,))])

    def solve(t):
        def grad(theta):
            z = jnp.matmul(design, theta, precision=jax.lax.Precision.HIGHEST)
            return -jnp.matmul(design.T, t * jax.nn.sigmoid(-t * z),
                               precision=jax.lax.Precision.HIGHEST) / n + ridge * theta

        def prox_step(y):
            return _soft(y - step * grad(y), penalty)

        def cond(carry):
            _, _, _, it, mapping = carry
            return (mapping > tol) & (it < max_iter)

        def body(carry):
            theta, y, momentum, it, _ = carry
            new = prox_step(y)
            mapping = jnp.max(jnp.abs(y - new)) / step
            restart = jnp.vdot(y - new, new - theta) > 0
            next_m = jnp.where(restart, 1.0, (1 + jnp.sqrt(1 + 4 * momentum ** 2)) / 2)
            y = jnp.where(restart, new, new + (momentum - 1) / next_m * (new - theta))
            return new, y, next_m, it + 1, mapping

        theta0 = jnp.zeros((k + 1,), features.dtype)
        theta, _, _, it, _ = jax.lax.while_loop(
            cond, body, (theta0, theta0, jnp.float32(1.0), 0, jnp.float32(jnp.inf)))
        mapping = jnp.max(jnp.abs(theta - prox_step(theta))) / step  # at the returned point
        return theta[:k], theta[k], it, mapping

    return jax.vmap(solve)(targets)


def fit_elastic_net_logistic(features: np.ndarray, labels: np.ndarray, num_classes: int, *,
                             lam: float, l1_ratio: float, tol: float = 1e-5,
                             max_iter: int = 20_000) -> dict[str, np.ndarray]:
    """The PCBM head: one-vs-rest elastic-net logistic regression minimising F (module
    docstring) for each class.

    Args:
      features: ``float32[N, K]`` concept margins; labels: ``int[N]`` in ``[0, num_classes)``.
      lam, l1_ratio: λ ≥ 0 and ρ ∈ [0, 1]; tol: the stop on the gradient mapping
        ``max |θ − prox(θ − ∇f(θ)/L)| · L``; max_iter: the cap.
    Returns:
      ``{"kernel": float32[K, P], "bias": float32[P], "iterations": int[P],
      "mapping": float32[P]}`` with ``P = 1`` for two classes (class 1 positive, the
      reference's single logit) and ``P = num_classes`` otherwise; logits ``r @ kernel + bias``.
    """
    labels = np.asarray(labels)
    if num_classes == 2:
        targets = np.where(labels == 1, 1.0, -1.0)[None]
    else:
        targets = np.where(labels[None] == np.arange(num_classes)[:, None], 1.0, -1.0)
    w, b, it, mapping = _fista(jnp.asarray(features, jnp.float32),
                               jnp.asarray(targets, jnp.float32), jnp.float32(lam),
                               jnp.float32(l1_ratio), jnp.float32(tol), jnp.int32(max_iter))
    return {"kernel": np.asarray(w).T, "bias": np.asarray(b), "iterations": np.asarray(it),
            "mapping": np.asarray(mapping)}


def init_residual(dim: int, num_classes: int, seed: int) -> dict[str, jax.Array]:
    """PCBM-h's residual ``{"kernel": [D, C], "bias": [C]}`` drawn as ``torch.nn.Linear(D, C)``
    initialises (weight and bias ``U(−1/√D, 1/√D)``) from ``fold_in(key(seed), 2)``."""
    bound = 1.0 / dim ** 0.5
    k_w, k_b = jax.random.split(jax.random.fold_in(jax.random.key(seed), 2))
    return {"kernel": jax.random.uniform(k_w, (dim, num_classes), minval=-bound, maxval=bound),
            "bias": jax.random.uniform(k_b, (num_classes,), minval=-bound, maxval=bound)}


def hybrid_logits(residual: dict, concept_logits: jax.Array, embeddings: jax.Array
                  ) -> jax.Array:
    """PCBM-h's logits ``h(r) + e W_res + b_res`` (``h(r)``: ``[B, P]``, a single logit
    broadcast over the classes): ``-> [B, C]``."""
    return concept_logits + embeddings @ residual["kernel"] + residual["bias"]


def make_hybrid_step(config: PCBMTrainConfig) -> tuple[optax.GradientTransformation, Callable]:
    """``(optimizer, step)``: the jitted Adam step ``(residual, opt_state, concept_logits[B, P],
    e[B, D], y int[B]) -> (residual, opt_state, loss)`` on
    ``CE(hybrid_logits) + l2_penalty · mean(W_res²)`` (the concept head is frozen: its logits
    are inputs)."""
    opt = optax.adam(config.hybrid_lr, b1=0.9, b2=0.999, eps=1e-8)

    def loss_fn(residual, concept_logits, e, y):
        logits = hybrid_logits(residual, concept_logits, e)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + config.l2_penalty * jnp.mean(residual["kernel"] ** 2)

    @compiler.jit
    def step(residual, opt_state, concept_logits, e, y):
        loss, grads = jax.value_and_grad(loss_fn)(residual, concept_logits, e, y)
        updates, opt_state = opt.update(grads, opt_state, residual)
        return optax.apply_updates(residual, updates), opt_state, loss

    return opt, step


def hybrid_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """PCBM-h's shuffled order of epoch ``epoch``: ``default_rng([seed, HYBRID_STREAM, epoch])
    .permutation(n)``; batches are consecutive slices, the last one partial (PyTorch's
    ``DataLoader(shuffle=True)`` without ``drop_last``)."""
    return np.random.default_rng([seed, HYBRID_STREAM, epoch]).permutation(n)


__all__ = ["CONCEPT_STREAM", "HYBRID_STREAM", "PCBMTrainConfig", "concept_samples",
           "fit_elastic_net_logistic", "fit_linear_svms", "hybrid_logits", "hybrid_order",
           "init_residual", "make_hybrid_step", "margins", "select_concepts"]
