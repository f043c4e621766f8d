"""Where other libraries' logging and warnings go while a run is in progress: the run's own file, not the terminal.

ppojax tells its user what happens in its own words (stage lines, one-line errors). The libraries underneath log
for their own developers: orbax's writer threads log every exception they meet (with its traceback) before ppojax
reports the failure in one line, transformers prints a load report for keys it ignores, JAX and absl warn. During
a run (:func:`library_output_to`) all of that is kept, in ``output_dir/libraries.log``, and none of it reaches
the terminal:

- every handler that writes to a stream (the terminal) is detached from its logger for the run, and its logger
  propagates to the root instead; the root's only handler is the run's router;
- the router writes ppojax's own records (loggers named ``ppojax...``) to stderr as ``ppojax: <message>``, and
  every other library's to the file (opened on the first record; a write that fails, e.g. on a full disk, is
  dropped: the run reports that failure itself);
- Python warnings are captured into logging (``logging.captureWarnings``), so they go the same way;
- the Hugging Face libraries' progress bars (transformers' "Loading weights", datasets', the hub's) are off.

Everything is restored when the run ends (a library first imported during the run keeps its bars off). Libraries
that set their handlers up at import (absl, transformers) are imported first, so that their handlers exist to be
detached; what they print while being imported (transformers' advice, without torch, that its models need it) goes
to the file too.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Iterator

LOG_FILE = "libraries.log"

#: libraries whose logging is configured when they are imported (a handler of their own); imported before the
#: handlers are detached. Missing ones are skipped.
_CONFIGURED_AT_IMPORT = ("absl.logging", "transformers.utils.logging")
#: the logger under which what those libraries printed while being imported is kept in the run's file
_IMPORT_LOGGER = "library_imports"

#: progress bars drawn on the terminal by libraries: (module, whether on, turn off, turn on, the variable that turns
#: them off when the module is imported). A library not imported when a run starts is not imported to switch its
#: bars off (datasets takes a second): its variable is set for the run instead.
_PROGRESS_BARS = (
    ("transformers.utils.logging", "is_progress_bar_enabled", "disable_progress_bar", "enable_progress_bar", None),
    ("datasets", "is_progress_bar_enabled", "disable_progress_bars", "enable_progress_bars",
     "HF_DATASETS_DISABLE_PROGRESS_BARS"),
)


@contextlib.contextmanager
def _progress_bars_off() -> Iterator[None]:
    """The libraries' bars off while the block runs. Those imported before it are switched off and back on after;
    one first imported during it starts with its bars off (its variable) and keeps them off."""
    restore, unset = [], []
    for name, is_on, off, on, variable_off in _PROGRESS_BARS:
        module = sys.modules.get(name)
        if module is None:
            if variable_off is not None and variable_off not in os.environ:
                os.environ[variable_off] = "1"
                unset.append(variable_off)
            continue
        if getattr(module, is_on)():
            getattr(module, off)()
            restore.append(getattr(module, on))
    try:
        yield
    finally:
        for turn_on in restore:
            turn_on()
        for variable in unset:
            os.environ.pop(variable, None)


class _QuietFileHandler(logging.FileHandler):
    """A FileHandler whose failed writes are dropped silently (logging would print a traceback to stderr)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


class _Router(logging.Handler):
    """ppojax's records to stderr, every other library's to the run's file."""

    def __init__(self, path: Path):
        super().__init__(logging.NOTSET)
        self.file = _QuietFileHandler(path, mode="a", encoding="utf-8", delay=True)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.terminal = logging.StreamHandler(sys.stderr)
        self.terminal.setFormatter(logging.Formatter("ppojax: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        ours = record.name == "ppojax" or record.name.startswith("ppojax.")
        (self.terminal if ours else self.file).handle(record)

    def close(self) -> None:
        self.file.close()
        super().close()


def collecting() -> bool:
    """Whether a run is keeping the libraries' output in its file now (:func:`library_output_to`)."""
    return collection() is not None


def collection() -> Optional[int]:
    """An id of the file the libraries' output goes to now (one per :func:`library_output_to`), None when none."""
    return next((id(handler) for handler in logging.getLogger().handlers if isinstance(handler, _Router)), None)


def import_libraries_quietly() -> str:
    """Import :data:`_CONFIGURED_AT_IMPORT` (their handlers must exist to be detached) and return what they printed
    while importing ("" when already imported), for the run's file: transformers advises at import, on stderr, that
    its models need torch, which a ppojax install does not have. A stream handler a library made during the import
    writes to stderr again afterwards. A run calls this before it imports the user's modules (which may import
    transformers)."""
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed), contextlib.redirect_stdout(printed):
        for name in _CONFIGURED_AT_IMPORT:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            if name.startswith("transformers"):
                module.get_logger()  # transformers adds its handler at its first logger
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is printed:
                handler.setStream(sys.stderr)
                if "flush" in vars(handler):  # transformers binds its handler's flush to the stream it was made on
                    handler.flush = sys.stderr.flush
    return printed.getvalue()


def _writes_to_a_stream(handler: logging.Handler) -> bool:
    """Whether ``handler`` reaches the terminal: a stream handler that is not a file of its own, or absl's
    (which wraps one)."""
    if isinstance(handler, logging.FileHandler):
        return False
    return isinstance(handler, logging.StreamHandler) or type(handler).__module__.startswith("absl")


@contextlib.contextmanager
def library_output_to(path: Path, printed_at_import: str = "") -> Iterator[Path]:
    """Route other libraries' logging and warnings to ``path`` (created on the first record) while the block runs
    (see the module doc). Yields ``path``.

    printed_at_import: what :func:`import_libraries_quietly` returned when the run called it earlier, kept in the
    file too."""
    printed_at_import += import_libraries_quietly()
    router = _Router(Path(path))
    root = logging.getLogger()
    saved_root = root.handlers[:]
    detached: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):  # a placeholder (a parent name no logger was asked for)
            continue
        terminal = [h for h in logger.handlers if _writes_to_a_stream(h)]
        if terminal:
            detached.append((logger, terminal, logger.propagate))
            for handler in terminal:
                logger.removeHandler(handler)
            logger.propagate = True
    root.handlers = [router]
    if printed_at_import:
        logging.getLogger(_IMPORT_LOGGER).warning(printed_at_import.rstrip("\n"))
    was_capturing = _capturing_warnings()
    logging.captureWarnings(True)
    try:
        with _progress_bars_off():
            yield Path(path)
    finally:
        logging.captureWarnings(was_capturing)
        root.handlers = saved_root
        for logger, handlers, propagate in detached:
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate = propagate
        router.close()


def _capturing_warnings() -> bool:
    return getattr(warnings.showwarning, "__module__", "") == "logging"
