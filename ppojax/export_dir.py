"""Export directories (a Hugging Face checkpoint, a PEFT adapter) are written whole or not at all, and never into a
directory that holds something else.

`write_export_dir(target, build, kind)`: `build(tmp)` fills a temp sibling `.NAME.tmp-*`, which then takes the
place of `target`. `target` may be absent, an empty directory, or an earlier ppojax export (it holds the marker
file `ppojax_export.json`): the earlier one is moved aside, the new one renamed in, the old one removed. Any other
directory is refused (`ExportDirError`, naming it and the fix) before anything is written, so an export aimed by
mistake at a model directory, a run's output_dir or a project folder never deletes, overwrites or mixes into its
files; and an export killed half-way leaves the earlier one as it was (between the two renames a crash leaves
both, the old as `.NAME.old-*`, the new as `.NAME.tmp-*`: nothing is lost).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from .durable import fsync_tree

#: The file that marks a directory as an export ppojax wrote (and may therefore replace).
MARKER = "ppojax_export.json"


class ExportDirError(ValueError):
    """An export's target directory holds something that is not a ppojax export."""


def check_export_target(target: str | os.PathLike) -> None:
    """Raise `ExportDirError` unless `target` is absent, an empty directory or an earlier ppojax export."""
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ExportDirError(f"{target} is a file, not a directory; choose a directory to export into.")
    if (target / MARKER).is_file():
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
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"kind": kind, "written_unix": round(time.time(), 3)}) + "\n")
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
