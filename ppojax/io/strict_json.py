"""Strict JSON files, written atomically: every JSON file a run writes (``run.json``, ``summary.json``,
``eval_before.json``, the JSONL logs) goes through here.

Strict: no bare ``NaN``/``Infinity`` (other tools' JSON parsers reject them): a non-finite float becomes
``null``. numpy/jax scalars and arrays become plain numbers and lists, paths become strings.
Atomic: written to a temporary file in the same directory, fsynced, then renamed over the target, so a crash
leaves either the old file or the new one, never half of one.
"""
from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path, PurePath
from typing import Any, Callable, Optional

from ppojax.io.durable import fsync_path

__all__ = ["to_strict", "dumps", "write_json", "write_text_atomic"]


def to_strict(value: Any, default: Optional[Callable[[Any], Any]] = None, _where: str = "$") -> Any:
    """``value`` with non-finite floats as None, numpy/jax values as Python numbers/lists, paths as strings.

    Anything else that JSON cannot hold goes through ``default`` (e.g. ``str``), or raises TypeError naming
    where it sits (``$.summary.plot``).
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): to_strict(v, default, f"{_where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_strict(v, default, f"{_where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, PurePath):
        return str(value)
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy / jax scalars and arrays
        return to_strict(value.tolist(), default, _where)
    if default is not None:
        return to_strict(default(value), None, _where)
    raise TypeError(f"{_where}: a {type(value).__name__} cannot be written as JSON ({value!r}).")


def dumps(value: Any, *, default: Optional[Callable[[Any], Any]] = None, **kwargs) -> str:
    """``json.dumps`` of :func:`to_strict` (``allow_nan=False``: strict JSON, checked)."""
    return json.dumps(to_strict(value, default), allow_nan=False, **kwargs)


def write_text_atomic(path, text: str) -> Path:
    """Replace ``path`` with ``text`` atomically (temporary file in the same directory, fsync, rename)."""
    path = Path(path)
    # a name of its own per call (created exclusively, with the umask's permissions, unlike mkstemp's 0600): two
    # writers of one path, threads or processes, never share a temporary file
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def write_json(path, value: Any, *, indent: Optional[int] = 2,
               default: Optional[Callable[[Any], Any]] = None) -> Path:
    """Write ``value`` to ``path`` as strict JSON (non-finite floats as null), atomically."""
    return write_text_atomic(path, dumps(value, default=default, indent=indent) + "\n")
