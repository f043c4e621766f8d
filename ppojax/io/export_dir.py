"""Export directories (a Hugging Face checkpoint, a PEFT adapter) are written whole or not at all, and never into a
directory that holds something else.

`write_export_dir(target, build, kind)`: `build(tmp)` fills a temp sibling `.NAME.tmp-*`, which then takes the
place of `target`. `target` may be absent, an empty directory, or an earlier ppojax export (it holds the marker
file `ppojax_export.json`): the earlier one is moved aside, the new one renamed in, the old one removed. Any other
directory is refused (`ExportDirError`, naming it and the fix) before anything is written, so an export aimed by
mistake at a model directory, a run's checkpoints or a project folder never deletes, overwrites or mixes into its
files; and an export killed half-way leaves the earlier one as it was (between the two renames a crash leaves
both, the old as `.NAME.old-*`, the new as `.NAME.tmp-*`: nothing is lost).

One directory of other files is accepted: a ppojax run's own `output_dir` (its `run.json`), as TRL's
`trainer.save_model(args.output_dir)` writes the model beside the run's files. There the export's files
(config, weights, tokenizer: none of them a name the run writes) are built in a temp folder inside it and each
renamed into place; the marker lists them, so a later export replaces exactly those and never a run file. Only
that group of renames is not one atomic step: a kill inside it leaves some files of each export.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from ppojax.errors import ExportDirError
from ppojax.io.durable import fsync_path, fsync_tree
from ppojax.io.run_dir import IDENTITY_FILE
from ppojax.io.strict_json import write_text_atomic

#: The file that marks a directory as an export ppojax wrote (and may therefore replace).
MARKER = "ppojax_export.json"


def check_export_target(target: str | os.PathLike) -> None:
    """Raise `ExportDirError` unless `target` is absent, an empty directory or an earlier ppojax export."""
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportDirError(f"{target} is a file, not a directory; choose a directory to export into.")
    if (target / MARKER).is_file() or _is_run_dir(target):
        return
    names = sorted(p.name for p in target.iterdir())
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ExportDirError(
            f"{target} already holds files that ppojax did not export ({shown}). An export replaces its whole "
            "directory, so it is not written there; choose a new or empty directory (or move those files away).")


def write_export_dir(target: str | os.PathLike, build: Callable[[Path], None], kind: str) -> Path:
    """`build(tmp)` writes the export into a fresh temp directory, which then replaces `target` (see the module
    docstring). kind: what the export is ("model", "peft_adapter"), recorded in the marker. Returns `target`."""
    target = Path(target)
    check_export_target(target)
    if _is_run_dir(target):
        return _write_into_run_dir(target, build, kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        _write_marker(tmp, kind, sorted(p.name for p in tmp.iterdir()))
        fsync_tree(tmp)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
            target.rename(old)
        tmp.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_run_dir(directory: Path) -> bool:
    return (directory / IDENTITY_FILE).is_file()


def _write_marker(directory: Path, kind: str, files: list[str]) -> None:
    """The marker of an export of `files` in `directory` (replacing any earlier one atomically)."""
    write_text_atomic(directory / MARKER,
                      json.dumps({"kind": kind, "written_unix": round(time.time(), 3), "files": files}) + "\n")


def _write_into_run_dir(target: Path, build: Callable[[Path], None], kind: str) -> Path:
    """The export's files beside a run's own files in its `output_dir` (see the module docstring)."""
    earlier = []
    if (target / MARKER).is_file():
        earlier = json.loads((target / MARKER).read_text()).get("files", [])
    tmp = Path(tempfile.mkdtemp(prefix=".export.tmp-", dir=target))
    try:
        build(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        taken = [n for n in names if (target / n).exists() and n not in earlier]
        if taken:
            raise ExportDirError(f"{target} is a ppojax run's directory and already holds {', '.join(taken)}, "
                                 "which no earlier export wrote; export into a new directory instead (e.g. "
                                 f"{target / 'policy'}).")
        fsync_tree(tmp)
        (target / MARKER).unlink(missing_ok=True)  # the earlier export is no longer whole from here on
        weights_first = sorted(names, key=lambda n: (not n.endswith(".safetensors"), n))
        for name in weights_first:
            os.replace(tmp / name, target / name)
        for name in set(earlier) - set(names):  # the earlier export's files the new one does not have
            (target / name).unlink(missing_ok=True)
        _write_marker(target, kind, names)
        fsync_path(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
