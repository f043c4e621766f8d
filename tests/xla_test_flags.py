"""The XLA flags the suite compiles with (set by ``tests/conftest.py`` before jax starts; subprocesses inherit them).

The suite is compile-bound: hundreds of small programs, each compiled in about a second and run in milliseconds. LLVM's
optimisation of XLA:CPU's kernels and XLA:CPU's fusion emitters (which build each fusion through MLIR) are most of that
compile time and change no semantics, so the tests compile with both off (``--xla_backend_optimization_level=0
--xla_cpu_use_fusion_emitters=false``; XLA then emits fusions as plain loops), and LLVM's remaining expensive passes are
skipped (``--xla_llvm_disable_expensive_passes``). Each program's machine code is generated as one LLVM module
(``--xla_cpu_parallel_codegen_split_count=1``): XLA otherwise splits it into parts to generate them on several threads,
and the splitting (cloning and serialising each part) costs more CPU time than it saves where both cores already run a
worker each (what the kernels compute is unchanged). XLA's HLO verifier, which checks the module's invariants after
every pass of its pipelines, is off (``--xla_disable_hlo_passes=hlo-verifier``): it checks XLA's own work (XLA's tests
do that), and the optimised program is the same with it off. So is the hoisting of loop-invariant operations out of
while loops (``while-loop-invariant-code-motion``): each hoisted value becomes one more element of the loop's state,
which the later passes and the code generator then handle in every loop of every scan; for the tests' programs, which
run a few iterations on tiny arrays, the hoisting costs more to compile than it saves to run, and it computes the same
values. The programs also run their operations on one thread (``--xla_cpu_multi_thread_eigen=false``): `make test` runs
a worker per core, and Eigen's threads in one worker would wait on the core the other worker uses (the suite's torch
keeps to one thread too). XLA:CPU then runs 16-bit products as float32 ones (its bf16 kernels are the multi-threaded
ones): a test about which kernels a program runs compiles it with ``compiler_options={"xla_cpu_multi_thread_eigen":
True}``, as a user's process does. Subprocesses inherit the flags; a test that sets its own ``XLA_FLAGS`` for one adds
:data:`CHEAP_COMPILES` to them. A test whose two programs agree bit for bit only under XLA's full optimisation asks
:func:`cheap_compiles`. Set ``PPOJAX_TESTS_FULL_OPTIMIZATION=1`` to run the suite as users' programs compile (XLA's
defaults).
"""
from __future__ import annotations

import os

CHEAP_COMPILES = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                  "--xla_llvm_disable_expensive_passes=true --xla_cpu_multi_thread_eigen=false "
                  "--xla_cpu_parallel_codegen_split_count=1 "
                  "--xla_disable_hlo_passes=hlo-verifier,while-loop-invariant-code-motion")
FULL_OPTIMIZATION_SWITCH = "PPOJAX_TESTS_FULL_OPTIMIZATION"


def switched_on(name: str, environ=os.environ) -> bool:
    """Whether the suite's environment switch ``name`` is on ("1", "true", "yes" or "on", any case)."""
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def use_cheap_compiles(environ=os.environ) -> None:
    """Add :data:`CHEAP_COMPILES` to ``XLA_FLAGS`` unless the switch is on or the flags already choose a level."""
    flags = environ.get("XLA_FLAGS", "")
    if switched_on(FULL_OPTIMIZATION_SWITCH, environ) or \
            "--xla_backend_optimization_level" in flags:
        return
    environ["XLA_FLAGS"] = f"{flags} {CHEAP_COMPILES}".strip()


def cheap_compiles() -> bool:
    """Whether this process compiles cheaply (LLVM's optimisation off): two programs that share a computation need
    not then give it bit for bit alike (XLA's fusions still differ between them; only their rounding shows it)."""
    return "--xla_backend_optimization_level=0" in os.environ.get("XLA_FLAGS", "")
