"""`cbcert.engine.compiler`: the XLA options of cbcert's programs, and the lazy ``jit``."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cbcert.engine import compiler

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_options_unless_xla_flags_names_them(monkeypatch):
    """On CPU the options are `CPU_OPTIONS`; a user who names the flag in XLA_FLAGS decides."""
    assert jax.default_backend() == "cpu"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    assert compiler.compiler_options.__wrapped__() == compiler.CPU_OPTIONS
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=true")
    assert compiler.compiler_options.__wrapped__() is None


def test_an_option_this_jaxlib_refuses_is_not_passed(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setattr(compiler, "CPU_OPTIONS", {"xla_cpu_no_such_option_exists": False})
    assert compiler.compiler_options.__wrapped__() is None


def test_jit_resolves_the_options_at_first_use_and_passes_them(monkeypatch):
    """Building a ``jit`` starts nothing (jax.distributed must be able to start the backend
    later); the first call builds ``jax.jit(fun, compiler_options=compiler_options(), ...)``."""
    calls, made = [], []
    monkeypatch.setattr(compiler, "compiler_options",
                        lambda: calls.append(1) or {"xla_cpu_use_fusion_emitters": False})
    real_jit = jax.jit

    def spy(fun, **kwargs):
        made.append(kwargs)
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(compiler.jax, "jit", spy)

    def scaled(x, *, k):
        """doc of scaled"""
        return x * k

    f = compiler.jit(scaled, static_argnames=("k",))
    assert calls == [] and made == []
    assert f.__name__ == "scaled" and f.__doc__ == "doc of scaled"
    np.testing.assert_array_equal(f(jnp.arange(3.0), k=2), [0.0, 2.0, 4.0])
    assert f(jnp.arange(3.0), k=2).shape == (3,)
    assert calls == [1]
    assert made == [{"compiler_options": {"xla_cpu_use_fusion_emitters": False},
                     "static_argnames": ("k",)}]
    assert f._cache_size() == 1  # the jitted function's attributes pass through
    assert f.lower(jnp.arange(3.0), k=3).compile()(jnp.arange(3.0)).tolist() == [0.0, 3.0, 6.0]


def test_inside_another_program_it_is_a_plain_nested_jit():
    """XLA compiles top-level programs only (jax refuses options on a nested jit): called on
    traced arguments, the function joins the outer program, which carries the options."""
    inner = compiler.jit(lambda x: jnp.sin(x) * 2)
    outer = compiler.jit(lambda x: inner(x) + 1)
    x = jnp.linspace(0.0, 1.0, 5)
    np.testing.assert_allclose(outer(x), jnp.sin(x) * 2 + 1, rtol=1e-6)
    assert jax.grad(lambda x: jnp.sum(inner(x)))(x).shape == (5,)
    assert jax.vmap(inner)(x).shape == (5,)


def test_decorator_forms():
    @compiler.jit
    def double(x):
        return 2 * x

    @compiler.jit(static_argnames=("n",))
    def power(x, n):
        return x**n

    assert double(jnp.float32(3)).item() == 6.0
    assert power(jnp.float32(3), n=2).item() == 9.0


def test_cbcert_jits_only_through_the_compiler_module():
    """Every program cbcert compiles gets the same options: no module but
    `cbcert.engine.compiler` calls ``jax.jit`` (or ``nnx.jit``) itself."""
    offenders = []
    for path in sorted((ROOT / "cbcert").rglob("*.py")):
        if path == ROOT / "cbcert" / "engine" / "compiler.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "jit"
                    and isinstance(node.value, ast.Name) and node.value.id in ("jax", "nnx")):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_options_change_float_bits_not_decisions():
    """The same program under both compilers: equal within float32 rounding of its inputs'
    scale (|Δ| ≤ 64 ulp of the largest value here: the sums have 32 terms) and the same argmax."""
    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 10))

    def f(x, w):
        return jax.nn.log_softmax(jnp.tanh(x @ w) * 3.0 + jnp.sin(x[:, :10]))

    lowered = jax.jit(f).lower(x, w)
    a = np.asarray(lowered.compile(compiler_options=compiler.XLA_DEFAULTS)(x, w))
    b = np.asarray(lowered.compile(compiler_options=compiler.CPU_OPTIONS)(x, w))
    bound = 64 * np.spacing(np.float32(np.abs(a).max()))
    assert np.abs(a - b).max() <= bound
    np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
