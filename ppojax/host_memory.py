"""Transparent huge pages for glibc's malloc: XLA:CPU's per-step buffers fault in 2 MiB at a time.

XLA:CPU allocates a step's temporaries as ONE block (every activation, gradient and logits chunk of the
program: gigabytes at SmolLM2) with ``malloc`` and frees it when the step ends. glibc serves a block that
large with a fresh ``mmap`` and returns it with ``munmap``, so every step faults the block in again, 4 KiB
page by page (millions of faults per update). glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc >= 2.35)
marks those mappings for transparent huge pages (``madvise(MADV_HUGEPAGE)``): 512x fewer faults, and the
memory still goes back to the kernel after each step.

glibc reads tunables only when a process starts, so the entry points (the ``ppojax`` command, the benchmarks)
call :func:`reexec_with_huge_pages` first: it re-executes the process once with ``GLIBC_TUNABLES`` extended.
From a notebook, start Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment.
``PPOJAX_HUGE_PAGES=0`` turns it off. It does nothing off glibc Linux or where the kernel's transparent huge
pages are ``never``.

Why not keep freed memory in the heap instead (``mallopt``: no ``mmap``, never trim; ppojax did that before):
after a step frees its block, a later small request splits the free block, the next step's block no longer
fits anywhere and the heap grows by a whole block. A SmolLM2 run grew by 3.6 GB every few updates
(``benchmarks/RESULTS.md``).
"""
from __future__ import annotations

import os
import platform
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OFF_SWITCH = "PPOJAX_HUGE_PAGES"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_has_hugetlb_tunable() -> bool:
    name, version = platform.libc_ver()
    if name != "glibc":
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 35)


def transparent_huge_pages_usable() -> bool:
    """True when glibc can ask for huge pages here: glibc >= 2.35 on Linux, and the kernel's transparent huge
    pages are ``always`` or ``madvise`` (the bracketed word of /sys/kernel/mm/transparent_hugepage/enabled)."""
    if not sys.platform.startswith("linux") or not _glibc_has_hugetlb_tunable():
        return False
    try:
        with open(_THP_MODE) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def switched_off(name: str, environ=os.environ) -> bool:
    """Whether the environment variable ``name`` turns a start-up behaviour off: 0, false, off or no (any
    case). Shared by the switches of the ``ppojax`` command's start-up (``program_start``)."""
    return environ.get(name, "").strip().lower() in ("0", "false", "off", "no")


def huge_pages_requested(environ=os.environ) -> bool:
    """Whether this process was started with glibc's huge-page tunable."""
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_huge_pages() -> None:
    """Re-execute this Python process (same interpreter, same arguments) with ``glibc.malloc.hugetlb=1`` added
    to ``GLIBC_TUNABLES``. Returns without doing anything when the tunable is already set, when
    ``PPOJAX_HUGE_PAGES=0``, or when huge pages are not usable here. Call it first thing, before any output,
    threads or files are opened: nothing of this process survives the exec."""
    if switched_off(OFF_SWITCH) or huge_pages_requested() or not transparent_huge_pages_usable():
        return
    tunables = ":".join(part for part in (os.environ.get("GLIBC_TUNABLES"), TUNABLE) if part)
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, {**os.environ, "GLIBC_TUNABLES": tunables})
    except OSError:  # e.g. the interpreter cannot be executed again: run on without huge pages
        return
