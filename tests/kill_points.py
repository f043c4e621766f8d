"""Kill points of the kill-and-resume tests, both sides of them.

In the run (a reward function or an environment step of a ``ppojax train`` subprocess): :func:`block_once_saved`
waits until a checkpoint is in place, prints a marker and blocks until the test kills the process. In the test:
:func:`wait_for_marker` waits for that marker in the run's log, failing with the log's tail if the run ends or
takes too long; :func:`commands_in_one_process` then runs the commands that need no kill (the resumes, the runs never
stopped) one after the other in one ``python`` process, which imports, traces and loads the programs once.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

_BETWEEN_COMMANDS = "PPOJAX_NEXT_COMMAND"
_COMMANDS = textwrap.dedent(f"""
    import json, sys
    from ppojax.trainer.cli import main
    for args in json.loads(sys.argv[1]):
        print({_BETWEEN_COMMANDS!r}, flush=True)
        code = main(args)
        sys.stdout.flush()
        if code != 0:
            sys.exit(f"ppojax {{' '.join(args)}} exited with {{code}}")
""")


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


def commands_in_one_process(commands: list[list[str]], env: dict, cwd: Path, timeout: float = 300) -> list[str]:
    """Run the ``ppojax`` commands (argument lists, e.g. ``["train", config, "resume=auto"]``) one after the other
    in one subprocess; returns each command's standard output. Fails with the output's tail if one exits non-zero."""
    proc = subprocess.run([sys.executable, "-c", _COMMANDS, json.dumps(commands)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = proc.stdout.split(_BETWEEN_COMMANDS + "\n")[1:]
    assert len(outputs) == len(commands), proc.stdout[-3000:]
    return outputs
