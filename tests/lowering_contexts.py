"""The suite's processes lower their programs into a shared MLIR context (set up by ``tests/conftest.py``).

JAX builds a fresh MLIR context for every program it lowers (``jax._src.interpreters.mlir.make_ir_context``):
it loads and registers every dialect, and the context's types and attributes are made again in each. A user's run
lowers a handful of programs; a test process lowers thousands of small ones (many of them one eager operation of
a test's reference computation), and there building and tearing down a context is most of each lowering, and the
torn-down contexts leave the heap fragmented. So each thread of a test process lowers into one context, replaced
by a fresh one after :data:`PROGRAMS_PER_CONTEXT` programs (a context keeps every type and attribute made in it,
constants included, for its lifetime). The programs are the same: a context holds no state that one program's
lowering passes to the next (one that a lowering loosened, as Mosaic's serialisation of a TPU kernel does by
allowing unregistered dialects, is replaced at once). ``PPOJAX_TESTS_CONTEXT_PER_PROGRAM=1`` lowers as JAX does.
"""
from __future__ import annotations

import os
import threading

from tests.xla_test_flags import switched_on

PROGRAMS_PER_CONTEXT = 200
SWITCH = "PPOJAX_TESTS_CONTEXT_PER_PROGRAM"


def share_lowering_contexts(environ=os.environ) -> bool:
    """Make JAX lower into a per-thread context reused for :data:`PROGRAMS_PER_CONTEXT` programs. Returns whether
    it did (not when the switch is on, or when this JAX has no ``make_ir_context`` to replace)."""
    if switched_on(SWITCH, environ):
        return False
    from jax._src.interpreters import mlir  # noqa: PLC0415 - only the suite's processes, after their XLA flags

    make_context = getattr(mlir, "make_ir_context", None)
    if make_context is None or getattr(make_context, "shared_by_the_tests", False):
        return False
    local = threading.local()

    def shared_context():
        if getattr(local, "uses", PROGRAMS_PER_CONTEXT) >= PROGRAMS_PER_CONTEXT or \
                local.context.allow_unregistered_dialects:
            local.context, local.uses = make_context(), 0
        local.uses += 1
        return local.context

    shared_context.shared_by_the_tests = True
    shared_context.jax_default = make_context
    mlir.make_ir_context = shared_context
    return True
