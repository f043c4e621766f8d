"""Crash tests' way into a checkpoint save: stop a save at a chosen stage (print ``PPOJAX_PAUSED <stage> <step>``
and block until the process is killed) by patching the save's steps, so the library carries no test hook.

Stages, in order: ``started`` (older checkpoints tidied, nothing of this step written), ``state_written``
(orbax wrote every file, no manifest yet), ``marked`` (MANIFEST.json and COMPLETE written, orbax has not renamed
the directory), ``committed`` (renamed, the checkpoints beyond save_total_limit not yet rotated out).

In a test script: ``pause_at("marked", 4)``. Around the CLI: ``python -m tests.save_faults marked@4 train ...``.
"""
from __future__ import annotations

import functools
import sys
import time

from ppojax.io import checkpoint as ckpt

STAGES = ("started", "state_written", "marked", "committed")


def _block(stage: str, step: int) -> None:
    print(f"PPOJAX_PAUSED {stage} {step}", flush=True)
    while True:
        time.sleep(3600)


def pause_at(stage: str, step: int) -> None:
    """Block the save of ``step`` at ``stage`` (patches this process's checkpoint module)."""
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r}: expected one of {STAGES}")
    real_save, real_tidy, real_seal = ckpt.RunCheckpoints.save, ckpt._tidy, ckpt._seal
    saving = [None]

    @functools.wraps(real_save)
    def save(checkpoints, at, *args, **kwargs):
        saving[0] = at
        if at == step:  # the caller waits on this save too, so what a kill leaves does not depend on timing
            kwargs["wait"] = True
        return real_save(checkpoints, at, *args, **kwargs)

    def tidy(*args):
        real_tidy(*args)
        if stage == "started" and saving[0] == step:
            _block(stage, step)

    def seal(path, at):
        if stage == "state_written" and at == step:
            _block(stage, at)
        real_seal(path, at)
        if stage == "marked" and at == step:
            _block(stage, at)

    ckpt.RunCheckpoints.save, ckpt._tidy, ckpt._seal = save, tidy, seal
    if stage == "committed":
        _pause_before_rotation(step)


def _pause_before_rotation(step: int) -> None:
    """orbax renames the new checkpoint, then moves the old ones out (its deleter, an orbax internal): block
    in between."""
    from orbax.checkpoint._src.path import deleter

    real = deleter.StandardCheckpointDeleter.delete_steps

    def delete_steps(self, steps):
        if steps and (self._directory / f"step_{step}").is_dir():
            _block("committed", step)
        return real(self, steps)

    deleter.StandardCheckpointDeleter.delete_steps = delete_steps


if __name__ == "__main__":  # python -m tests.save_faults <stage>@<step> <ppojax arguments>
    stage, _, at = sys.argv[1].partition("@")
    pause_at(stage, int(at))
    from ppojax.trainer import cli

    sys.argv = ["ppojax", *sys.argv[2:]]
    sys.exit(cli.main())
