"""Flushing files and directories to disk before a rename publishes them (checkpoints, exports, run files): a
rename that reaches the disk before the data would publish a directory of empty or partial files after a power
loss."""
from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync one file or directory; a path that cannot be opened, or a file system that refuses fsync on
    directories, is passed over."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, `root` included."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))
