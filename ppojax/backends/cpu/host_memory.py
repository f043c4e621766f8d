"""The process's memory allocator: XLA:CPU's per-step buffers reused (mimalloc) or faulted in 2 MiB at a time.

XLA:CPU allocates a step's temporaries as ONE block (every activation, gradient and logits chunk of the
program: gigabytes at SmolLM2) with ``malloc`` and frees it when the step ends. glibc serves a block that
large with a fresh ``mmap`` and returns it with ``munmap``, so every step faults the block in again, 4 KiB
page by page (millions of faults per update). glibc's tunable ``glibc.malloc.hugetlb=1`` (glibc >= 2.35)
marks those mappings for transparent huge pages (``madvise(MADV_HUGEPAGE)``): 512x fewer faults, and the
memory still goes back to the kernel after each step.

glibc reads tunables only when a process starts, so the entry points (the ``ppojax`` command, ``program_start``)
call :func:`reexec_with_huge_pages` first: it re-executes the process once with ``GLIBC_TUNABLES`` extended.
From a notebook, start Python with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` in the environment.
``PPOJAX_HUGE_PAGES=0`` turns it off. It does nothing off glibc Linux or where the kernel's transparent huge
pages are ``never``.

Why not keep freed memory in glibc's heap instead (``mallopt``: no ``mmap``, never trim; ppojax did that
before): after a step frees its block, a later small request splits the free block, the next step's block no
longer fits anywhere and the heap grows by a whole block. A SmolLM2 run grew by 3.6 GB every few updates.

mimalloc (the ``cmeel-mimalloc`` wheel, a Linux dependency) does keep it: a freed block stays mapped for
``MIMALLOC_PURGE_DELAY`` milliseconds and the next step's block of the same size takes its place, so a step
no longer spends its system time faulting in and zeroing gigabytes. The same re-execution preloads it
(``LD_PRELOAD``) when the wheel is installed, the platform is Linux and ``LD_PRELOAD`` is not already set (a
preload of the user's own, another allocator or a sanitizer, is left alone). ``PPOJAX_MIMALLOC=0`` turns it off.
The purge delay is 1 s unless the environment sets one: long enough to carry a block from one step to the
next, short enough that memory freed while the models load is returned before training needs it (a 10 s delay
raised the SmolLM2 benchmark's peak RSS by half a gigabyte). Nor is it lengthened once training runs (tried:
two steps' time after the first update): a step does not always take the block the previous one freed, and a
held block then sits beside the new one, 1.5 GB more peak RSS at SmolLM2 for a speed gain inside the run-to-run
spread.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.capabilities import switched_off

TUNABLE = "glibc.malloc.hugetlb=1"
OFF_SWITCH = "PPOJAX_HUGE_PAGES"
MIMALLOC_OFF_SWITCH = "PPOJAX_MIMALLOC"
MIMALLOC_DISTRIBUTION = "cmeel-mimalloc"
MIMALLOC_PURGE_DELAY_MS = "1000"
START_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", "MIMALLOC_PURGE_DELAY")  # what start_environment may set
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


def huge_pages_requested(environ=os.environ) -> bool:
    """Whether this process was started with glibc's huge-page tunable."""
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def mimalloc_library() -> str | None:
    """The path of the installed ``cmeel-mimalloc`` wheel's ``libmimalloc.so`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.distribution(MIMALLOC_DISTRIBUTION).files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "libmimalloc.so":
            path = file.locate()
            if os.path.isfile(path):
                return str(path)
    return None


def mimalloc_preloaded(environ=os.environ) -> bool:
    """Whether this process runs with mimalloc preloaded (as :func:`start_environment` arranges)."""
    return "libmimalloc" in environ.get("LD_PRELOAD", "")


def start_environment(environ=os.environ) -> dict:
    """The variables the re-executed process gets on top of ``environ`` (empty: nothing to re-execute for):
    ``GLIBC_TUNABLES`` with the huge-page tunable added, ``LD_PRELOAD`` with mimalloc and its purge delay.
    Each is left out when its off switch is set, when it cannot work here, or when ``environ`` already has it
    (so the re-executed process asks for nothing more); both on a GPU or TPU host (`capabilities.accelerator_host`)
    and with ``PPOJAX_CPU_BACKEND=0``."""
    if capabilities.accelerator_host(environ) or capabilities.backend_off(environ):
        return {}  # a CPU-only speed-up: never on a GPU or TPU host, nor with ppojax's CPU backend off
    extra = {}
    if not switched_off(OFF_SWITCH, environ) and not huge_pages_requested(environ) \
            and transparent_huge_pages_usable():
        extra["GLIBC_TUNABLES"] = ":".join(part for part in (environ.get("GLIBC_TUNABLES"), TUNABLE) if part)
    library = None if switched_off(MIMALLOC_OFF_SWITCH, environ) or environ.get("LD_PRELOAD") else mimalloc_library()
    if library:
        extra["LD_PRELOAD"] = library
        extra["MIMALLOC_PURGE_DELAY"] = _purge_delay(environ)
    return extra


def _purge_delay(environ) -> str:
    """The user's ``MIMALLOC_PURGE_DELAY`` if it is a whole number, else ppojax's default when unset. mimalloc
    itself ignores a malformed value without a word, so a typo stops the start-up here instead."""
    value = environ.get("MIMALLOC_PURGE_DELAY")
    if value is None:
        return MIMALLOC_PURGE_DELAY_MS
    try:
        int(value)
    except ValueError:
        raise SystemExit(f"MIMALLOC_PURGE_DELAY={value!r} is not a whole number of milliseconds: set it to one "
                         f"(ppojax's default {MIMALLOC_PURGE_DELAY_MS}; -1 never returns freed memory, 0 at once), "
                         f"unset it, or run without mimalloc ({MIMALLOC_OFF_SWITCH}=0).") from None
    return value


def reexec_with_huge_pages() -> None:
    """Re-execute this Python process (same interpreter, same arguments) with :func:`start_environment`'s
    variables: glibc's huge-page tunable and mimalloc preloaded. Returns without doing anything when there is
    nothing to add (already done, switched off, not possible here). Call it first thing, before any output,
    threads or files are opened: nothing of this process survives the exec."""
    extra = start_environment()
    if not extra:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, {**os.environ, **extra})
    except OSError:  # e.g. the interpreter cannot be executed again: run on as it is
        return
