"""The suite's shared MLIR contexts (tests/lowering_contexts.py) lower every program as JAX's own fresh contexts do."""
import jax
import jax.numpy as jnp
import pytest
from jax._src.interpreters import mlir

from tests import lowering_contexts


def programs():
    x = jnp.ones((4, 8), jnp.float32)

    def attention_like(x):
        return jax.nn.softmax(x @ x.T / 3.0, axis=-1) @ x

    def scanned(x):
        return jax.lax.scan(lambda c, row: (c + jnp.tanh(row), c.sum()), jnp.zeros(8), x)

    def gradient(x):
        return jax.grad(lambda w: jnp.sum(jnp.exp(w * x).astype(jnp.bfloat16)).astype(jnp.float32))(x)

    return [(f, x) for f in (attention_like, scanned, gradient)]


def lowered_texts():
    return [jax.jit(f).lower(x).as_text() for f, x in programs()]


def test_the_suite_lowers_into_shared_contexts():
    assert getattr(mlir.make_ir_context, "shared_by_the_tests", False)  # tests/conftest.py turned it on
    assert mlir.make_ir_context() is mlir.make_ir_context()


def test_programs_lowered_in_a_shared_context_equal_those_lowered_in_fresh_ones(monkeypatch):
    shared = lowered_texts()
    monkeypatch.setattr(mlir, "make_ir_context", mlir.make_ir_context.jax_default)
    fresh = lowered_texts()
    assert shared == fresh and all("stablehlo" in text for text in shared)


@pytest.fixture
def own_sharing(monkeypatch):
    """Sharing set up afresh (a new per-thread context) over JAX's own ``make_ir_context``."""
    monkeypatch.setattr(mlir, "make_ir_context", mlir.make_ir_context.jax_default)
    assert lowering_contexts.share_lowering_contexts(environ={})
    return mlir.make_ir_context


def test_a_context_is_replaced_after_its_programs_or_once_a_lowering_loosened_it(own_sharing, monkeypatch):
    monkeypatch.setattr(lowering_contexts, "PROGRAMS_PER_CONTEXT", 3)
    first = own_sharing()
    assert own_sharing() is first and own_sharing() is first
    second = own_sharing()  # the fourth program
    assert second is not first
    second.allow_unregistered_dialects = True  # as Mosaic's serialisation of a TPU kernel does
    assert own_sharing() is not second


def test_the_switch_keeps_jax_default(monkeypatch):
    default = mlir.make_ir_context.jax_default
    monkeypatch.setattr(mlir, "make_ir_context", default)
    assert not lowering_contexts.share_lowering_contexts(environ={lowering_contexts.SWITCH: "1"})
    assert mlir.make_ir_context is default and mlir.make_ir_context() is not mlir.make_ir_context()
