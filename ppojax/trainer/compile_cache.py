"""JAX's persistent compilation cache, switched on for ppojax runs.

Compiling the sampler, the rollout forwards and the update is most of the time to the first update (12 s for
the tiny benchmark model, ~45 s for SmolLM2-135M on 2 CPU cores). With the cache, a resumed or repeated run
with the same shapes loads the compiled programs from disk instead. Entries are keyed by JAX on the program,
its shapes, the devices and the versions, so a stale entry is never used. JAX compresses each entry with zstd
(ppojax depends on zstandard for it; without it JAX falls back to zlib, several times slower to write).

JAX itself stores no program that calls back into Python (host callbacks: a Python reward function, an agent's
environment, a blocking hook). On CPU ppojax stores those too (:mod:`ppojax.trainer.stored_callbacks`), so a resumed
run with a Python reward loads its iteration as well; on GPU and TPU such a run compiles its iteration again at every
start (its other programs are stored; rewards written in JAX, ``ppojax.rl.rewards.TracedScores``, keep the
iteration storable there).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import jax
from jax.experimental.compilation_cache import compilation_cache

from ppojax.trainer.stored_callbacks import store_programs_with_callbacks


def resolve_cache_dir(setting: Optional[str]) -> Optional[Path]:
    """The directory a ``compilation_cache_dir`` setting means (None = off).

    'auto' (or None): ``$JAX_COMPILATION_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ppojax/xla``
    (``~/.cache/ppojax/xla``); 'none' or '': off; anything else: that path.
    """
    if setting is None or setting == "auto":
        env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
        if env:
            return Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base).expanduser() / "ppojax" / "xla"
    if setting.lower() in ("none", ""):
        return None
    return Path(setting).expanduser()


def enable_compilation_cache(setting: Optional[str]) -> Optional[Path]:
    """Point JAX's persistent compilation cache at :func:`resolve_cache_dir` ``(setting)``; returns the
    directory, or None when off. Programs that compile in under a second are not stored (JAX's default); programs
    with host callbacks are, on CPU.
    A directory that cannot be created turns the cache off with a warning instead of failing the run."""
    path = resolve_cache_dir(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"ppojax: compilation cache off: cannot create {path} ({err}); set compilation_cache_dir")
        return None
    store_programs_with_callbacks()
    if jax.config.jax_compilation_cache_dir != str(path):
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # JAX opens its cache directory once: reopen it at the new path
    return path
