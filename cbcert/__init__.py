"""cbcert: certify and stress-test classifiers under perturbations made through a generator.

The Python API (``cbcert.api``; imported on first use, so ``import cbcert`` stays light):

* ``smooth(apply_fn, params, noise)`` → a smoothed classifier with ``predict`` and ``certify``
  (Cohen et al.'s PREDICT/CERTIFY on a batch, explicit keys, ``ABSTAIN`` = −1);
* noises ``gaussian(σ)``, ``bernoulli(ρ, K)``, ``fixed_flips(m, K)``;
* ``load_world(name)``: a built-in preset, a world directory or ``pixels:IMAGES`` (with
  ``classifier=``), ``load_converted(dir)``: ``(apply_fn, params, manifest)`` of a converted
  model; ``apgd(logits_fn, x0, y, eps=…, norm=…, key=…)``: APGD-CE/DLR (Croce & Hein).
"""

__version__ = "0.1.0"

_API = {
    "ABSTAIN": "cbcert.api", "Noise": "cbcert.api", "Smoothed": "cbcert.api",
    "bernoulli": "cbcert.api", "fixed_flips": "cbcert.api", "gaussian": "cbcert.api",
    "smooth": "cbcert.api", "load_world": "cbcert.worlds.load",
    "load_converted": "cbcert.io.registry", "apgd": "cbcert.attacks.apgd",
}

__all__ = ["__version__", *sorted(_API)]


def __getattr__(name: str):
    """Import the API's names on first use (``cbcert.smooth`` imports jax then, not before)."""
    if name not in _API:
        raise AttributeError(f"module 'cbcert' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
