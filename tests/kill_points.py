"""Kill points of the kill-and-resume tests, both sides of them.

In the run (a reward function or an environment step of a ``ppojax train`` subprocess): :func:`block_once_saved`
waits until a checkpoint is in place, prints a marker and blocks until the test kills the process. In the test:
:func:`wait_for_marker` waits for that marker in the run's log, failing with the log's tail if the run ends or
takes too long.
"""
from __future__ import annotations

import time
from pathlib import Path


def block_once_saved(checkpoint: Path, marker: str, timeout: float = 60) -> None:
    """Wait for the directory ``checkpoint`` (orbax renames a checkpoint into place once it is written; after
    ``timeout`` seconds, go on without it), print ``marker`` and block forever."""
    deadline = time.time() + timeout
    while not checkpoint.is_dir() and time.time() < deadline:
        time.sleep(0.01)
    print(marker, flush=True)
    while True:
        time.sleep(3600)


def wait_for_marker(proc, log: Path, markers=("PPOJAX_BLOCKED",), timeout: float = 300) -> None:
    """Return once one of ``markers`` is in the file ``log``, written by the subprocess ``proc``."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log.read_text() if log.exists() else ""
        if any(marker in text for marker in markers):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before its kill point:\n{text[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"no kill point within {timeout} s:\n{(log.read_text() if log.exists() else '')[-3000:]}")
