"""What orbax leaves behind when a checkpoint write or read fails (ppojax reports it as one CheckpointError).

orbax logs the error with its traceback (absl's logger) and stops waiting for the rest: the other items' writer
threads and the other arrays' tensorstore writes go on, and asyncio and Python report that abandoned work when it
is collected, maybe after the run ("Future exception was never retrieved", "Exception ignored in: <coroutine>",
"Event loop is closed"). :func:`wait_for_abandoned_writes` waits for that work, so that what the save wrote can be
removed for good. :func:`quiet_orbax` keeps the reports off the terminal: while a run keeps the libraries' output
in its file (:func:`ppojax.io.library_logs.library_output_to`) they go there, otherwise they are dropped.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import threading
import traceback

import tensorstore as ts  # orbax-checkpoint's storage layer (its dependency)

from ppojax.io.library_logs import collecting, collection

_ORBAX_DIR = f"{os.sep}orbax{os.sep}"
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # where orbax writes a save: named in tensorstore's errors of its writes


def wait_for_abandoned_writes(timeout: float = 300.0) -> None:
    """Wait (``timeout`` seconds at most each) for orbax's writer threads (their classes are orbax's) and every
    tensorstore operation in flight (orbax keeps no handle to those it abandoned: the garbage collector lists
    them). Call once orbax's CheckpointManager is closed."""
    for thread in threading.enumerate():
        if type(thread).__module__.startswith("orbax.") and thread is not threading.current_thread():
            thread.join(timeout)
    # type(), not isinstance: some objects compute __class__ (with a warning)
    for pending in [f for f in gc.get_objects() if issubclass(type(f), ts.Future) and not f.done()]:
        try:
            pending.exception(timeout=timeout)
        except Exception:  # a timeout, or the write's own failure (orbax reported the first)
            pass


def finalize_abandoned_work(error: BaseException) -> None:
    """Free what the frames of ``error``'s traceback (and those of the errors it was raised from or during) hold,
    and collect it now: orbax's abandoned coroutines and futures are reported while the run still keeps the
    libraries' output, not at interpreter exit, where Python's report of them would reach the terminal."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__
    gc.collect()


def _raised_in_orbax(error) -> bool:
    """Whether ``error`` (or an exception it was raised from or during) passed through orbax's code, or is
    tensorstore's failure of a write into a save of orbax's."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _ORBAX_TMP in str(error):
            return True
        tb = error.__traceback__
        while tb is not None:
            if _ORBAX_DIR in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return False


class _OrbaxFailureReports(logging.Filter):
    """While a run collects the libraries' output: everything, orbax's reports of its abandoned work once per kind
    (each abandoned array write reports the same failure); otherwise orbax's errors and asyncio's reports of its
    abandoned work are dropped."""

    def __init__(self, first_of_kind):
        super().__init__()
        self._first_of_kind = first_of_kind

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        from_orbax = _ORBAX_DIR in record.pathname or _raised_in_orbax(error)
        if not collecting():
            return not from_orbax
        return not from_orbax or self._first_of_kind((record.name, str(record.msg).split("\n", 1)[0], type(error)))


def _is_orbax_noise(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine being closed
    if code is not None and _ORBAX_DIR in code.co_filename:
        return True
    # tensorstore operations completing into the event loop orbax closed, at any time
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def quiet_orbax() -> None:
    """Install the filters (once per process: orbax's abandoned work may be collected after the run), on absl's
    and asyncio's loggers and as ``sys.unraisablehook``."""
    previous = sys.unraisablehook
    if getattr(previous, "ppojax_orbax_filter", False):
        return
    seen = set()

    def first_of_kind(kind) -> bool:  # in the file the libraries' output goes to now
        kind = (collection(), *kind)
        if kind in seen:
            return False
        seen.add(kind)
        return True

    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_OrbaxFailureReports(first_of_kind))
    unraisable_log = logging.getLogger("orbax.unraisable")

    def hook(unraisable):
        if not _is_orbax_noise(unraisable):
            previous(unraisable)
        elif collecting() and first_of_kind((unraisable.err_msg, unraisable.exc_type, str(unraisable.exc_value))):
            unraisable_log.error("%s: %r", unraisable.err_msg or "Exception ignored in", unraisable.object,
                                 exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))

    hook.ppojax_orbax_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
