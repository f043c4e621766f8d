"""Keep freed host memory for reuse: a measured speed-up of XLA:CPU on glibc Linux.

XLA:CPU allocates every temporary buffer of a step with ``malloc`` and frees it at the end. glibc serves
large requests (the stacked weight gradients, activations: tens to hundreds of MB) with a fresh ``mmap``
and returns them with ``munmap``, so each step faults every page back in (SmolLM2-135M, one forward +
backward on 8 x 48 tokens: ~300,000 page faults, 0.8 CPU-s in the kernel, ~15 % of the step; one PPO
update of the SmolLM2 benchmark: 880,000 faults, 25.6 s -> 20.6 s without them). Telling
glibc to serve everything from one heap that it never trims removes the faults; the process keeps its
peak memory instead of returning it between steps (a training run reaches the same peak every step).

:func:`keep_freed_memory` does that with ``mallopt``. Call it before JAX starts its threads (before the
first computation) so that they share the main heap; the CLI and the benchmarks call it first thing.
``PPOJAX_KEEP_FREED_MEMORY=0`` turns it off. Elsewhere than glibc (macOS, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER = -1  # as size_t: the largest value, i.e. never trim (mallopt takes an int)

_applied = False


def keep_freed_memory() -> bool:
    """Make glibc reuse freed memory instead of unmapping it. Returns True if it was applied (or already was).

    Sets one malloc arena for all threads (large buffers then come from the main heap), no ``mmap`` for
    large requests, and no trimming (freed memory stays in the process). A 2 GiB trim threshold was not
    enough: a SmolLM2 PPO update still re-faulted 3.4 GB (880,000 faults, 20 % of its time).
    """
    global _applied
    if _applied:
        return True
    if os.environ.get("PPOJAX_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = all(mallopt(param, value) == 1 for param, value in
             ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))
    _applied = ok
    return ok
