"""Keep orbax's own reports of a failed read or write off the terminal: ppojax reports each such failure as one
CheckpointError, while orbax logs it (with a traceback, through absl) and abandons the work of the other arrays,
which Python would report as "Exception ignored in: <coroutine ...>" whenever it is collected, and asyncio as
"_GatheringFuture exception was never retrieved" (its logger, at the collection of orbax's gathered writes,
which may come after the run has returned)."""
from __future__ import annotations

import logging
import os
import sys

_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


class _OrbaxErrorLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or _ORBAX_DIR not in record.pathname


def _raised_in_orbax(error) -> bool:
    """Whether ``error`` (or an exception it was raised from or during) passed through orbax's code."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            if _ORBAX_DIR in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    return False


class _OrbaxAsyncioErrors(logging.Filter):
    """asyncio's reports of an orbax future's exception that nobody retrieved (ppojax reported the failure)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return record.levelno < logging.ERROR or not _raised_in_orbax(error)


def _is_orbax_noise(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine being closed
    if code is not None and _ORBAX_DIR in code.co_filename:
        return True
    # tensorstore reads completing into the event loop orbax closed, at any time
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def quiet_orbax() -> None:
    """Drop orbax's ERROR logs and its abandoned work's unraisable exceptions (installed once)."""
    previous = sys.unraisablehook
    if getattr(previous, "ppojax_orbax_noise_filter", False):
        return
    logging.getLogger("absl").addFilter(_OrbaxErrorLogs())
    logging.getLogger("asyncio").addFilter(_OrbaxAsyncioErrors())

    def hook(unraisable):
        if not _is_orbax_noise(unraisable):
            previous(unraisable)

    hook.ppojax_orbax_noise_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook

