"""A TPU plugin installed on a host without TPU chips: keep JAX from starting it.

libtpu (the ``tpu`` extra; ``ppojax plan --target tpu:...`` compiles for TPU slices with it from any host) is a
plugin JAX tries at its first operation whenever ``JAX_PLATFORMS`` is unset. On a host without TPU chips that
try fails, quietly, but only after libtpu is mapped into the process (a few hundred MB more resident memory)
and has taken its machine-wide lock file (``/tmp/libtpu_lockfile``) for the life of the process. With no
accelerator's device files on the host, the CPU is the only platform JAX could start anyway, so naming it
changes nothing but that wasted start.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import MutableMapping

from ppojax.backends.cpu.capabilities import accelerator_host


def tpu_plugin_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def skip_absent_tpu(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``JAX_PLATFORMS=cpu`` where libtpu is installed, ``JAX_PLATFORMS`` is unset and the host has no
    accelerator (``capabilities.accelerator_host``). Call it before JAX starts its backend; a JAX already imported
    takes the setting too, as long as no backend has started. Returns whether it set it."""
    if environ.get("JAX_PLATFORMS", "").strip() or accelerator_host(environ) or not tpu_plugin_installed():
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules and environ is os.environ:  # jax read the variable when it was imported
        import jax  # noqa: PLC0415 - start-up module: JAX only where the program already imported it
        from jax._src import xla_bridge  # noqa: PLC0415 - as above

        if jax.config.jax_platforms is None and not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
    return True
