"""Building ppojax's C++ FFI handlers with the system's compiler, once per source and jaxlib.

A handler source (`ppojax/backends/cpu/ffi/stacked_gemm.cc`, `ppojax/backends/cpu/ffi/adam_in_place.cc`) is
compiled against `jax.ffi.include_dir()` and this folder's headers, linked against a library file where it calls
one (oneDNN's, MKL's), into `$XDG_CACHE_HOME/ppojax/ffi` under a name that hashes the source, the headers, the
library, the compiler flags and jaxlib's version (the FFI's ABI follows jaxlib). A file is written under a
temporary name, then renamed: never half-written. A file already there (built before, or prebuilt for a machine
without a compiler) is taken as it is.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import jax

HEADERS = Path(__file__).parent  # parallel.h: the work split over XLA's intra-op threads


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "ppojax" / "ffi"


def library_path(source: Path, jaxlib_version: str, library: Path | None = None, flags: tuple = (),
                 cache: Path | None = None) -> Path:
    """Where `source` built with compiler `flags` (linked against `library`, if any) for jaxlib `jaxlib_version`
    is kept."""
    headers = b"".join(path.read_bytes() for path in sorted(HEADERS.glob("*.h")))
    key = hashlib.sha256(source.read_bytes() + headers + str(library or "").encode() + " ".join(flags).encode()
                         + jaxlib_version.encode()).hexdigest()[:16]
    return (cache or cache_dir()) / f"lib{source.stem}-{key}.so"


def compile_source(compiler: str, source: Path, out: Path, library: Path | None = None, flags: tuple = (),
                   include_dir: str | None = None) -> str:
    """Build `source` with `compiler` and extra `flags` (defines, optimisation), linked against `library` if given,
    into `out` (a temporary name, then renamed); "" when done, else why not."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create {out.parent} for ppojax's FFI handlers ({err})"
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    linked = [str(library), f"-Wl,-rpath,{library.parent}"] if library is not None else []
    cmd = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", *flags, f"-I{include_dir or jax.ffi.include_dir()}",
           f"-I{HEADERS}", str(source), "-o", str(partial), *linked]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        return f"building {source.name} failed: {err}"
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return f"building {source.name} failed: {done.stderr.strip()[-400:]}"
    partial.replace(out)
    return ""


def build_cached(source: Path, what: str, library: Path | None = None, flags: tuple = (),
                 cache: Path | None = None) -> tuple[Path | None, str]:
    """(the built file, "") once `source` is built (a file already there is taken as it is), or (None, why not);
    `what` names the handlers in the message when no compiler is found."""
    out = library_path(source, jax.lib.__version__, library, flags, cache)
    if out.exists():
        return out, ""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None, f"no C++ compiler (g++) on PATH to build {what}"
    why = compile_source(compiler, source, out, library, flags)
    return (None, why) if why else (out, "")
