"""What the counting samplers refuse: non-finite inputs and logits, non-floating sample dtypes.

``argmax`` counts an all-NaN row of logits as class 0, so a classifier returning NaN or inf would
be certified as class 0 at the largest radius. The sampler's step labels such a sample `NO_VOTE`;
the counting samplers (`cbcert.engine.sampler.count_classes`,
`cbcert.engine.continuous.count_classes_sequential`) refuse it, and non-finite inputs, with
`NonFiniteError`.
"""

import jax.numpy as jnp
import numpy as np

# Label of a sample whose logits (of that head) are not all finite: no class, no vote.
NO_VOTE = -1


class NonFiniteError(ValueError):
    """Inputs, or logits of noisy samples, that are NaN or infinite: nothing to count.

    A non-finite logit is no vote for any class, and a smoothed classifier built on the
    remaining votes would not be the one certified, so the counting samplers refuse instead
    (records already written stay; the CLI exits with status 2).

    Attributes:
      inputs: global indices of the inputs concerned, sorted.
      samples: noisy samples with a non-finite logit in the chunk read (0: the inputs
        themselves are non-finite).
      chunk: valid samples of that chunk.
      heads: heads with a non-finite logit.
      names: what the heads are called in the message (``models std, cbm``); None: ``heads``.
    """

    def __init__(self, inputs, *, samples: int = 0, chunk: int = 0, heads=(), names=None,
                 note: str = ""):
        self.inputs = tuple(int(i) for i in inputs)
        self.samples, self.chunk, self.heads = int(samples), int(chunk), tuple(heads)
        self.names, self.note = names, note
        shown = ", ".join(map(str, self.inputs[:10])) + (", …" if len(self.inputs) > 10 else "")
        if self.samples:
            who = (f"heads {list(self.heads)}" if names is None
                   else f"models {', '.join(names[h] for h in self.heads)}")
            message = (f"apply_fn returned NaN or inf logits on {self.samples} of {self.chunk} "
                       f"noisy samples of a chunk (inputs [{shown}], {who}): a non-finite "
                       "logit is no vote, so these inputs can be neither predicted nor "
                       "certified; check the model, its parameters, the inputs and the dtype")
        else:
            count = len(self.inputs)
            message = (f"{count} input{'s' if count > 1 else ''} (indices [{shown}]) "
                       f"hold{'' if count > 1 else 's'} NaN or inf: their noisy samples are no "
                       "evidence, so they can be neither predicted nor certified")
        super().__init__(message + (f"; {note}" if note else ""))

    def renamed(self, names, note: str = "") -> "NonFiniteError":
        """The same error with the heads called ``names[h]`` and ``note`` appended."""
        return NonFiniteError(self.inputs, samples=self.samples, chunk=self.chunk,
                              heads=self.heads, names=tuple(names), note=note)


def check_votes(labels: np.ndarray, inputs: np.ndarray) -> None:
    """Raise `NonFiniteError` if any of the read-back ``labels[v, H]`` is `NO_VOTE`.

    ``inputs[v]``: the global input index of each labelled sample.
    """
    bad = labels == NO_VOTE  # [v, H]
    if bad.any():
        rows = bad.any(axis=1)
        raise NonFiniteError(np.unique(inputs[rows]), samples=int(rows.sum()),
                             chunk=len(labels), heads=np.flatnonzero(bad.any(axis=0)).tolist())


def check_finite_inputs(inputs: np.ndarray, indices: np.ndarray) -> None:
    """Raise `NonFiniteError` naming ``indices[n]`` of every input ``inputs[n]`` holding a NaN
    or inf (before any sampling: the model might map them to finite logits)."""
    if not jnp.issubdtype(inputs.dtype, jnp.inexact):
        return
    finite = np.isfinite(inputs.reshape(len(inputs), -1)).all(axis=1)  # [N]
    if not finite.all():
        raise NonFiniteError(indices[~finite])


def check_dtype(dtype) -> None:
    """Raise TypeError unless ``dtype`` (a compute dtype of noisy samples) is None or floating.

    An integer or boolean dtype would round the noise away (σ ε of a Gaussian mostly to 0)
    while the certificate still assumed it.
    """
    if dtype is None:
        return
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = None
    if not floating:
        what = "is not a dtype" if floating is None else "is not floating"
        raise TypeError(f"dtype={dtype!r} {what}; allowed: a floating dtype such as "
                        "'float32', 'bfloat16' or 'float16' (or None: the inputs' dtype)")
