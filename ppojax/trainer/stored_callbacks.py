"""Programs that call back into Python, stored in JAX's persistent compilation cache on CPU.

JAX writes no cache entry for a program with host callbacks (a Python reward function, an agent's environment), so
a run with one would compile its iteration again at every start, a resume after preemption included. On CPU the
compiled program does not hold the Python functions: it calls each through an FFI custom call that names it by its
place in a list the executable is given when it is loaded (``deserialize_executable(..., host_callbacks=)``).
So such a program can be stored like any other and loaded with the callbacks of the program being compiled now: two
programs with the same text and different Python functions share the entry, each calling its own.

:func:`store_programs_with_callbacks` teaches JAX's cache that by wrapping three private functions of
``jax._src.compiler`` (the versions ppojax's accelerator extras pin): the entry of such a program is written and read
under its own key (JAX's key + :data:`KEY_SUFFIX`), so a process without this never loads one without its callbacks.
Where those functions are not the ones written for, nothing is wrapped and JAX's behaviour stands. GPUs call their
callbacks the same way (an FFI call by index) but no GPU run has loaded one yet, so they are left as JAX has them,
as are TPU's (send/recv channels, bound when the program is compiled): compiled at every start.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Sequence

from jax._src import compiler

#: appended to JAX's cache key for a program with host callbacks
KEY_SUFFIX = "-host-callbacks"
#: the platforms whose programs with Python callbacks are stored: their callbacks are FFI calls that name the callback
#: by index (jax._src.callback), and a stored one has been loaded and run there (tests/test_compile_cache.py)
_STORED_ON = ("cpu",)
#: the parameters of the private functions wrapped here, as written for (a JAX that changes them is left alone)
_EXPECTED = {
    "compile_or_get_cached": ("backend", "computation", "devices", "compile_options", "host_callbacks"),
    "_cache_read": ("module_name", "cache_key", "compile_options", "backend", "executable_devices"),
    "_cache_write": ("cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"),
}

_compiling = threading.local()  # .callbacks: the storable callbacks of the program this thread compiles, or None
_installed = False


def store_programs_with_callbacks() -> bool:
    """Wrap JAX's compile-or-load path once per process (see the module's docstring); True when it is wrapped."""
    global _installed
    if _installed:
        return True
    if not _written_for_this_jax():
        return False
    compile_or_get_cached, cache_read, cache_write = (compiler.compile_or_get_cached, compiler._cache_read,
                                                      compiler._cache_write)

    def compile_or_get_cached_noting_callbacks(backend, computation, devices, compile_options, host_callbacks,
                                                *args, **kwargs):
        outer = getattr(_compiling, "callbacks", None)
        _compiling.callbacks = tuple(host_callbacks) if _storable(backend, host_callbacks) else None
        try:
            return compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                                         *args, **kwargs)
        finally:
            _compiling.callbacks = outer

    def cache_read_with_callbacks(module_name, cache_key, compile_options, backend, executable_devices):
        callbacks = getattr(_compiling, "callbacks", None)
        if callbacks is None:
            return cache_read(module_name, cache_key, compile_options, backend, executable_devices)
        return cache_read(module_name, cache_key + KEY_SUFFIX, compile_options,
                          _LoadingWithCallbacks(backend, callbacks), executable_devices)

    def cache_write_with_callbacks(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if _storable(backend, host_callbacks):  # JAX writes only programs without callbacks: hand it none
            return cache_write(cache_key + KEY_SUFFIX, compile_time_secs, module_name, backend, executable, ())
        return cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)

    compiler.compile_or_get_cached = compile_or_get_cached_noting_callbacks
    compiler._cache_read = cache_read_with_callbacks
    compiler._cache_write = cache_write_with_callbacks
    _installed = True
    return True


def _written_for_this_jax() -> bool:
    """The wrapped functions take the parameters this module passes on, and XLA's client loads an executable with
    its host callbacks."""
    for name, params in _EXPECTED.items():
        function = getattr(compiler, name, None)
        if function is None or tuple(inspect.signature(function).parameters)[:len(params)] != params:
            return False
    client = getattr(compiler.xc, "Client", None)
    return "host_callbacks" in (getattr(getattr(client, "deserialize_executable", None), "__doc__", None) or "")


def _storable(backend: Any, host_callbacks: Sequence[Any]) -> bool:
    """A program whose callbacks are all plain Python functions called by index (not TPU's channel capsules)."""
    return (bool(host_callbacks) and getattr(backend, "platform", None) in _STORED_ON
            and all(callable(callback) for callback in host_callbacks))


class _LoadingWithCallbacks:
    """A backend whose ``deserialize_executable`` hands the executable these host callbacks; all else is the
    backend's (JAX's cache reader calls it as ``deserialize_executable(serialized, devices, options)``)."""

    def __init__(self, backend: Any, callbacks: Sequence[Any]):
        self._backend = backend
        self._callbacks = list(callbacks)

    def deserialize_executable(self, serialized, executable_devices, compile_options=None):
        return self._backend.deserialize_executable(serialized, executable_devices, compile_options,
                                                    host_callbacks=self._callbacks)

    def __getattr__(self, name):
        return getattr(self._backend, name)
