"""What a ppojax program (the ``ppojax`` command, a script driving ppojax) does first, before JAX starts its backend.

0. On a host without accelerators, name the CPU as JAX's platform where libtpu is installed (``absent_tpu``):
   JAX would otherwise load libtpu and try to start a TPU backend in every process.
1. Re-execute once with mimalloc preloaded and glibc's huge-page tunable (``host_memory``): XLA:CPU's
   per-step buffers are reused from one step to the next instead of faulted in afresh.
2. Add the XLA:CPU options recorded as fastest for this CPU and the run's kind of matmul, if any
   (``xla_cpu_options``): XLA reads ``XLA_FLAGS`` once, when the backend starts. The ``ppojax`` command does this
   step once it has read the config (its precision), still before JAX starts.

From Python (a notebook, ``cli.main([...])``) neither happens by itself: call :func:`start_program` before the
first JAX operation, or start Python with the environment it would set.
"""
from __future__ import annotations

from ppojax.backends.cpu import xla_options as xla_cpu_options
from ppojax.backends.cpu.absent_tpu import skip_absent_tpu
from ppojax.backends.cpu.host_memory import reexec_with_huge_pages


def start_program(precision: str = "float32") -> None:
    """The steps in order; ``precision``: the run's (``float32``, ``mixed`` or ``bfloat16``), which picks the
    record."""
    skip_absent_tpu()  # first: the re-executed process inherits it
    reexec_with_huge_pages()
    xla_cpu_options.apply(precision=precision)
