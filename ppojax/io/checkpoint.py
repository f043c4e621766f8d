"""Atomic, verifiable, resumable checkpoints of a whole training run (orbax for the device state, JSON for the rest).

Layout of ``directory`` (e.g. ``output_dir/checkpoints``)::

    step_120/                 a checkpoint
        train_state/          orbax pytree of the TrainState (params, optimizer state, counters), any sharding
        host_state.json       KL coefficient, score moments, PRNG key data, data iterator position, counts ...
        config.json           the run's config (``PPOConfig.to_dict()``)
        MANIFEST.json         size and CRC32 checksums of every file above (``file_manifest.py``)
        COMPLETE              written last: {"step": 120, "time": ..., "manifest_crc32": <CRC32 of MANIFEST.json>}
    step_130.tmp/             a save in progress, or one killed mid-way: ignored, removed by the next save
    damaged/step_110/         a damaged checkpoint the next save moved aside (never deleted by ppojax)

Protocol of :func:`save_checkpoint` (all processes call it; process 0 does the file-system bookkeeping):

1. process 0 tidies ``directory`` (rules below) and creates ``step_N.tmp``; barrier;
2. orbax writes ``step_N.tmp/train_state`` (every process writes its shards; orbax finalises it atomically);
3. process 0 writes host_state.json and config.json, then MANIFEST.json (it reads the files back to checksum
   them), fsyncs the tree, writes COMPLETE, fsyncs it, then renames ``step_N.tmp`` -> ``step_N`` (one atomic
   rename) and fsyncs the directory;
4. only then, older checkpoints beyond ``save_total_limit`` are renamed to ``*.tmp`` (so a crash while
   deleting never leaves a half-deleted checkpoint looking whole) and deleted.

A process killed at any point therefore leaves either the new complete checkpoint or none, and the previous
ones intact. A save that fails (a full disk: ENOSPC, EDQUOT, or EFBIG under ``ulimit -f``) removes its
``.tmp`` directory and raises one :class:`CheckpointError` naming the checkpoint, the cause and the previous
intact checkpoint. Saves are synchronous: when the call returns the checkpoint is on disk. ``directory`` must
be a POSIX file system that every process sees (local disk for one host; a shared one for multi-host runs, as
orbax requires). Crash tests can stop a save at a chosen stage with ``PPOJAX_TEST_PAUSE_IN_SAVE`` (below).

Verification (:func:`verify_checkpoint`): a checkpoint is intact when its COMPLETE marker is present, its
MANIFEST.json matches the checksum in COMPLETE, every file the manifest lists exists with its size and
checksums, the manifest lists the model state, host_state.json and config.json, and both JSON files parse.
Checkpoints written before manifests existed (COMPLETE without ``manifest_crc32`` and no MANIFEST.json) pass on
their structure alone (marker, train_state/, both JSON files parse); damage inside them surfaces when they are
restored, as a CheckpointError. Resuming (:func:`latest_checkpoint`, :func:`resolve_checkpoint`,
:func:`restore_checkpoint`) reads every byte once to verify it, newest step first, skips each damaged
checkpoint with one line naming the file and what is wrong, and uses the newest intact one.

What the next save does with what it finds (the rules that keep ``save_total_limit`` true after crashes):

- ``step_N.<anything>`` (``.tmp``, ``.deleting.tmp``): debris of a crashed save or deletion, never a
  committed checkpoint: deleted.
- ``step_N`` that fails verification and holds no file besides COMPLETE / MANIFEST.json (nothing of value):
  deleted. (A save never re-reads older checkpoints: it checks their presence and sizes, and knows the
  checksum failures this process found, e.g. those resume skipped.)
- any other ``step_N`` that fails it (a truncated or missing file, a missing marker or config.json): moved
  aside into ``directory/damaged/`` with one line saying so, and never deleted by ppojax: it may hold
  something the user can repair, and it no longer counts towards the limit.
- ``save_total_limit`` counts the checkpoints that pass; after the new one is committed, the oldest beyond the
  limit are deleted. A checkpoint is thus deleted only once an intact newer one (the one just written) exists.

Host state is any JSON-able dict; numpy/jax arrays and scalars are stored with their dtype (restored as
numpy arrays, bit for bit), typed PRNG keys as their uint32 key data plus the implementation name (restored
as typed keys). Python floats round-trip exactly (JSON keeps float64's shortest repr), so a float32 value
stored as ``float(x)`` comes back as the same float32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import json
import logging
import operator
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax
import numpy as np

from ppojax.errors import CheckpointError
from ppojax.io import file_manifest
from ppojax.io.durable import fsync_path, fsync_tree

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "verify_checkpoint",
    "latest_checkpoint",
    "resolve_checkpoint",
    "list_checkpoints",
    "read_checkpoint_config",
    "restore_checkpoint",
    "encode_host_state",
    "decode_host_state",
]

COMPLETE = "COMPLETE"
MANIFEST_FILE = "MANIFEST.json"
STATE_DIR = "train_state"
HOST_STATE_FILE = "host_state.json"
CONFIG_FILE = "config.json"
DAMAGED_DIR = "damaged"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_OURS_RE = re.compile(r"^step_\d+(\..*)?$")  # every name a save may leave behind

Log = Callable[[str], None]


def _warn(message: str) -> None:
    """Default ``log`` of the functions that skip or move damaged checkpoints: one line on stderr."""
    print(f"ppojax: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------
# multi-process helpers


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"ppojax.io.checkpoint:{name}")


# ----------------------------------------------------------------------------------------------------------
# verification


def _step_of(path: Path) -> Optional[int]:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _is_complete(path: Path) -> bool:
    return _step_of(path) is not None and (path / COMPLETE).is_file() and (path / STATE_DIR).is_dir()


def _describe(name: str) -> str:
    """How a file of a checkpoint is named in messages."""
    if name.startswith(STATE_DIR + "/"):
        return f"model state file {name}"
    if name == HOST_STATE_FILE:
        return f"host state file {name}"
    if name == CONFIG_FILE:
        return f"config file {name}"
    return name


def _json_problem(path: Path, name: str) -> Optional[str]:
    try:
        json.loads((path / name).read_text())
    except FileNotFoundError:
        return f"{_describe(name)} is missing"
    except (OSError, UnicodeDecodeError) as err:
        return f"{_describe(name)} cannot be read ({err})"
    except ValueError as err:
        return f"{_describe(name)} is not valid JSON ({err})"
    return None


# Checksum verifications made in this process: resolved path -> (manifest_signature at the time, problem or
# None). While the files are not rewritten (same signature) the answer stands: restore_checkpoint trusts the
# check latest_checkpoint just made instead of reading a multi-GB checkpoint again, and the next save (which
# only stats older checkpoints) still knows which one resume found corrupted.
_verified: dict[Path, tuple[tuple, Optional[str]]] = {}


def verify_checkpoint(path, *, checksums: bool = True) -> tuple[bool, str]:
    """Whether ``path`` is an intact checkpoint: ``(True, what was checked)`` or ``(False, one-line reason)``.

    The reason names the file and what is wrong, e.g. "model state file train_state/d/ab12 is 1,234 bytes,
    the manifest says 5,678 (truncated)". ``checksums=False`` checks presence and sizes only (``stat``,
    no file is read but the small JSON ones) plus what an earlier check in this process found; True also reads
    every byte against the manifest's CRC32s (once per process while the files are unchanged).
    """
    path = Path(path)
    if not path.is_dir():
        return False, "does not exist" if not path.exists() else "is not a directory"
    if not (path / COMPLETE).is_file():
        return False, ("not a complete checkpoint: no COMPLETE marker (its save was interrupted, or the marker "
                       "was deleted)")
    try:
        marker = json.loads((path / COMPLETE).read_text())
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return False, f"its {COMPLETE} marker is damaged ({err})"
    if "manifest_crc32" not in marker and not (path / MANIFEST_FILE).exists():
        return _verify_structure(path)
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        return False, f"{MANIFEST_FILE} is missing"
    except OSError as err:
        return False, f"{MANIFEST_FILE} cannot be read ({err})"
    if file_manifest.crc32_hex(raw) != marker.get("manifest_crc32"):
        return False, f"{MANIFEST_FILE} does not match the checksum recorded in {COMPLETE}"
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return False, f"{MANIFEST_FILE} is malformed ({err})"
    for name in (HOST_STATE_FILE, CONFIG_FILE):
        if name not in files:
            return False, f"{_describe(name)} is not in {MANIFEST_FILE}"
    if not any(name.startswith(STATE_DIR + "/") for name in files):
        return False, f"{MANIFEST_FILE} lists no model state file ({STATE_DIR}/)"
    problem = file_manifest.check_manifest(path, manifest, checksums=False, describe=_describe)
    problem = problem or _json_problem(path, HOST_STATE_FILE) or _json_problem(path, CONFIG_FILE)
    if problem:
        return False, problem
    key, signature = path.resolve(), file_manifest.manifest_signature(path, manifest)
    known = _verified.get(key)
    if known is not None and known[0] == signature:
        problem = known[1]
    elif not checksums:
        return True, f"{len(files)} files present with their sizes"
    else:
        problem = file_manifest.check_manifest(path, manifest, checksums=True, describe=_describe)
        _verified[key] = (signature, problem)
    if problem:
        return False, problem
    return True, f"{len(files)} files match their sizes and checksums"


def _verify_structure(path: Path) -> tuple[bool, str]:
    """A checkpoint written before manifests existed: marker present (checked), state dir, both JSON files."""
    if not (path / STATE_DIR).is_dir() or not any(p.is_file() for p in (path / STATE_DIR).rglob("*")):
        return False, f"the model state {STATE_DIR}/ is missing"
    problem = _json_problem(path, HOST_STATE_FILE) or _json_problem(path, CONFIG_FILE)
    if problem:
        return False, problem
    return True, f"no {MANIFEST_FILE} (written by an older ppojax): structure checked, not sizes or checksums"


# ----------------------------------------------------------------------------------------------------------
# listing and choosing


def list_checkpoints(directory) -> list[Path]:
    """The complete checkpoints under ``directory`` (COMPLETE marker and train_state/ present; not verified),
    oldest step first; tmp / half-written ones excluded."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _is_complete(p)]
    return sorted(found, key=lambda p: _step_of(p))  # type: ignore[arg-type,return-value]


def _candidates(directory: Path) -> list[Path]:
    """Every ``step_N`` directory under ``directory``, newest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _step_of(p) is not None and p.is_dir()]
    return sorted(found, key=lambda p: _step_of(p), reverse=True)  # type: ignore[arg-type,return-value]


def _newest_intact(directory: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies or None, [(skipped newer checkpoint, reason)])."""
    skipped = []
    for path in _candidates(directory):
        ok, reason = verify_checkpoint(path)
        if ok:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def _report_skipped(skipped: list[tuple[Path, str]], chosen: Optional[Path], log: Log) -> None:
    then = f"using {chosen.name}" if chosen is not None else "no intact checkpoint is left"
    for path, reason in skipped:
        log(f"skipping {path}: {reason}; {then}")


def latest_checkpoint(directory, *, log: Log = _warn) -> Optional[Path]:
    """The newest checkpoint under ``directory`` that verifies (sizes and checksums), or None.

    Newer damaged ones are skipped, each with ONE line through ``log`` ("skipping <dir>/step_8: model state
    file train_state/... is 1,234 bytes, the manifest says 5,678 (truncated); using step_6").
    """
    chosen, skipped = _newest_intact(Path(directory))
    _report_skipped(skipped, chosen, log)
    return chosen


def resolve_checkpoint(where: Union[str, os.PathLike, bool], checkpoint_dir=None, *,
                       log: Log = _warn) -> Optional[Path]:
    """The intact checkpoint to resume from, or None when ``where`` is auto and nothing was saved yet.

    where: ``"auto"`` or ``True`` -> the newest intact checkpoint under ``checkpoint_dir`` (None if it holds
    no ``step_N`` at all; a CheckpointError if it holds some and none verifies). A path -> a ``step_N``
    checkpoint (it must verify), a checkpoints directory or a run's output_dir (``<dir>/checkpoints``): its
    newest intact checkpoint. Raises CheckpointError (one line per problem, no traceback) for a path that does
    not exist, a damaged checkpoint, or a directory without an intact one.
    """
    if where is True or where == "auto":
        if checkpoint_dir is None:
            raise CheckpointError("resume='auto' needs the checkpoints directory to look in.")
        return _newest_in(Path(checkpoint_dir), log, none_ok=True)
    path = Path(where)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; give a step_N checkpoint, a checkpoints "
                              "directory, or resume: auto.")
    if _step_of(path) is not None or (path / COMPLETE).exists():
        ok, reason = verify_checkpoint(path)
        if ok:
            return path
        alternative, _ = _newest_intact(path.parent)
        hint = f"; the newest intact checkpoint beside it is {alternative}" if alternative is not None else ""
        raise CheckpointError(f"cannot resume from {path}: {reason}{hint}.")
    if not _candidates(path) and (path / "checkpoints").is_dir():  # a run's output_dir
        path = path / "checkpoints"
    return _newest_in(path, log, none_ok=False)


def _newest_in(directory: Path, log: Log, none_ok: bool) -> Optional[Path]:
    chosen, skipped = _newest_intact(directory)
    _report_skipped(skipped, chosen, log)
    if chosen is not None:
        return chosen
    if skipped:
        raise CheckpointError(
            f"none of the {len(skipped)} checkpoint(s) under {directory} is intact (each is named above with "
            f"what is wrong): restore the missing files, or move them aside to start a fresh run.")
    if none_ok:
        return None
    raise CheckpointError(f"no checkpoint under {directory} (looked for step_<N>/{COMPLETE}).")


# ----------------------------------------------------------------------------------------------------------
# host state <-> JSON


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"host_state{where}: key {k!r} is not a string; JSON needs string keys.")
            out[k] = _encode(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = np.asarray(jax.random.key_data(value))
        return {"__prng_key__": str(jax.random.key_impl(value)), "shape": list(value.shape),
                "data": data.ravel().tolist()}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        if array.dtype == object:
            raise CheckpointError(f"host_state{where}: object arrays cannot be stored; use numbers.")
        return {"__ndarray__": str(array.dtype), "shape": list(array.shape), "data": array.ravel().tolist()}
    raise CheckpointError(
        f"host_state{where}: cannot store a {type(value).__name__} in a checkpoint's host state; use numbers, "
        "strings, lists, dicts, numpy/jax arrays or PRNG keys (put device pytrees in the train state).")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__prng_key__" in value:
        shape = tuple(value["shape"])
        data = np.asarray(value["data"], np.uint32).reshape(*shape, -1)
        return jax.random.wrap_key_data(data, impl=value["__prng_key__"])
    if "__ndarray__" in value:
        dtype = jax.numpy.dtype(value["__ndarray__"])  # knows bfloat16 & co. (ml_dtypes)
        return np.asarray(value["data"], dtype=dtype).reshape(value["shape"])
    return {k: _decode(v) for k, v in value.items()}


def encode_host_state(host_state: dict) -> dict:
    """The JSON-able form of ``host_state`` (arrays and PRNG keys tagged with dtype / implementation)."""
    if not isinstance(host_state, dict):
        raise CheckpointError(f"host_state must be a dict, got {type(host_state).__name__}.")
    return _encode(host_state, "")


def decode_host_state(data: dict) -> dict:
    """Inverse of :func:`encode_host_state`: arrays come back as numpy arrays, keys as typed PRNG keys."""
    return _decode(data)


# ----------------------------------------------------------------------------------------------------------
# durable file-system primitives




def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, indent=1, sort_keys=False, allow_nan=True).encode()


def _write_json(path: Path, payload: Any) -> None:
    _write_bytes(path, _json_bytes(payload))


def _remove(path: Path) -> None:
    """Delete a checkpoint entry so that no crash can leave it looking complete: rename first, then delete."""
    if not path.exists():
        return
    doomed = path
    if not path.name.endswith(".tmp"):
        doomed = path.with_name(f"{path.name}.deleting.tmp")
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        fsync_path(path.parent)
    if doomed.is_dir():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)


def _remove_failed_save(tmp: Path, quiet: float = 0.5, deadline: float = 10.0) -> None:
    """Remove a failed save's ``.tmp`` directory. orbax's writer threads (tensorstore's) may still be finishing
    files in it when the error surfaces, and a write re-creates the directories it needs: the removal is repeated
    until the directory has stayed gone for ``quiet`` seconds (at most ``deadline`` seconds in all)."""
    end = time.monotonic() + deadline
    gone_since = None
    while time.monotonic() < end:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= quiet:
            return
        time.sleep(0.05)


def _holds_data(path: Path) -> bool:
    """Whether ``path`` holds any file besides a checkpoint's marker and manifest (i.e. anything of value)."""
    if not path.is_dir():
        return False
    return any(p.is_file() and p.relative_to(path).as_posix() not in (COMPLETE, MANIFEST_FILE)
               for p in path.rglob("*"))


def _move_aside(path: Path) -> Path:
    """Move a damaged checkpoint into ``<its directory>/damaged/`` (``step_N``, or ``step_N.2`` ... if taken)."""
    damaged = path.parent / DAMAGED_DIR
    damaged.mkdir(exist_ok=True)
    destination, copy = damaged / path.name, 1
    while destination.exists():
        copy += 1
        destination = damaged / f"{path.name}.{copy}"
    os.replace(path, destination)
    fsync_path(path.parent)
    fsync_path(damaged)
    return destination


def _tidy(directory: Path, log: Log) -> None:
    """Apply the module doc's rules to what crashed saves and damage left under ``directory``."""
    for path in sorted(directory.iterdir()):
        if not _OURS_RE.match(path.name):
            continue
        if _step_of(path) is None:  # step_N.<suffix>: debris of a crashed save or deletion
            _remove(path)
            continue
        ok, reason = verify_checkpoint(path, checksums=False)
        if ok:
            continue
        if not _holds_data(path):
            _remove(path)
        else:
            log(f"moved damaged checkpoint {path} aside to {_move_aside(path)}: {reason}")


# ----------------------------------------------------------------------------------------------------------
# errors of the storage (a full disk) and of orbax


_FIXES = {
    errno.ENOSPC: "free space or set save_total_limit",
    errno.EDQUOT: "free space (or raise the quota) or set save_total_limit",
    errno.EFBIG: "raise the file size limit (`ulimit -f unlimited`) or use a file system that allows larger files",
}
_ERRNO_IN_TEXT = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports the errno of a failed write


def _errno_of(exc: Optional[BaseException]) -> Optional[int]:
    """The errno of an OSError anywhere in ``exc``'s chain (orbax/tensorstore report it in the message)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc.errno
        m = _ERRNO_IN_TEXT.search(str(exc))
        if m:
            return int(m.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _release_abandoned_work(err: BaseException) -> None:
    """Let go of what a failed orbax call left behind, quietly. Only on the failure path.

    When one array's read or write fails, orbax abandons the coroutines of the others and closes their event
    loop. Later, Python would print tracebacks through ``sys.unraisablehook``: "Exception ignored in:
    <coroutine ...>" whenever those coroutines are collected (the frames in ``err``'s tracebacks keep them
    alive: after the CheckpointError was printed, or at exit), and "RuntimeError: Event loop is closed" when
    tensorstore reads still in flight complete into the closed loop (from tensorstore's threads, at any time).
    The second kind can come before orbax's error reaches us, so :func:`_orbax_checkpointer` installs the
    filter that drops those two kinds of noise before any orbax call. Here: drop the tracebacks of ``err``'s
    chain (the exceptions and their messages stay chained) and collect now."""
    stack, seen = [err], set()
    while stack:
        exc = stack.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        exc.__traceback__ = None
        stack += [exc.__cause__, exc.__context__]
    gc.collect()


def _is_orbax_noise(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine being closed
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    return isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"


def _install_orbax_noise_filter() -> None:
    """Chain a filter in front of ``sys.unraisablehook`` that drops the noise orbax's abandoned work makes
    after a failed read or write (see :func:`_release_abandoned_work`); everything else reaches the previous
    hook. Installed once, at the first orbax call of this module."""
    previous = sys.unraisablehook
    if getattr(previous, "ppojax_orbax_noise_filter", False):
        return

    def hook(unraisable):
        if not _is_orbax_noise(unraisable):
            previous(unraisable)

    hook.ppojax_orbax_noise_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


@contextlib.contextmanager
def _orbax_logs_held():
    """Hold the ERROR records orbax logs through absl while it runs: replayed if the call succeeds, dropped if
    it fails. orbax logs an exception of its background writer threads (with its traceback) before re-raising
    it in the foreground, where this module turns it into ONE CheckpointError."""
    logger = logging.getLogger("absl")
    held: list[logging.LogRecord] = []

    class _Hold(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            if record.levelno >= logging.ERROR:
                held.append(record)
                return False
            return True

    hold = _Hold()
    logger.addFilter(hold)
    try:
        yield
    finally:
        logger.removeFilter(hold)
    for record in held:  # only reached when the body succeeded
        logger.handle(record)


# ----------------------------------------------------------------------------------------------------------
# save


def _orbax_checkpointer():
    import orbax.checkpoint as ocp

    _install_orbax_noise_filter()
    # Synchronous: save() returns once the data is written and finalised, on every process.
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def save_checkpoint(directory, step: int, train_state, host_state: dict, config_dict: dict, *,
                    save_total_limit: Optional[int] = None, log: Log = _warn) -> Path:
    """Write checkpoint ``directory/step_<step>`` atomically, with its manifest, and return its path.

    train_state: a pytree of (possibly sharded, multi-host) ``jax.Array``s, e.g. ``update.TrainState``;
    host_state: JSON-able dict (arrays, numpy scalars and typed PRNG keys allowed, see the module doc);
    config_dict: the run's config as a dict. Call on EVERY process (orbax writes each process's shards).
    save_total_limit: keep this many intact checkpoints (the newest steps, always including this one);
    None keeps all. Older ones are deleted only after this one is complete. log: where a damaged checkpoint
    moved aside is reported (one line).
    Raises CheckpointError when the storage fails (full disk, file size limit, permissions): the ``.tmp``
    directory is removed and the message names the checkpoint, the cause and the previous intact checkpoint.
    """
    try:
        step = operator.index(step)
    except TypeError:
        raise CheckpointError(f"step={step!r}: expected an integer >= 0.") from None
    if step < 0:
        raise CheckpointError(f"step={step}: expected an integer >= 0.")
    if save_total_limit is not None and save_total_limit < 1:
        raise CheckpointError(f"save_total_limit={save_total_limit}: expected None or an integer >= 1.")
    directory = Path(directory)
    final = directory / f"step_{step}"
    tmp = directory / f"step_{step}.tmp"
    # Encode first, so a host state that cannot be stored fails before anything is written.
    host_payload = {"format_version": FORMAT_VERSION, "step": step, "host_state": encode_host_state(host_state)}
    config_payload = json.loads(json.dumps(config_as_dict(config_dict), default=str))

    try:
        if _is_primary():
            directory.mkdir(parents=True, exist_ok=True)
            _tidy(directory, log)
            tmp.mkdir()
        _barrier(f"save_start_{step}")
        _pause_for_tests("started", step)
        with _orbax_logs_held(), _orbax_checkpointer() as checkpointer:
            # orbax's tensorstore backend refuses relative paths (e.g. the demo's output_dir "outputs/demo")
            checkpointer.save((tmp / STATE_DIR).absolute(), args=_standard_save(train_state))
        _pause_for_tests("state_written", step)
        if _is_primary():
            _write_json(tmp / HOST_STATE_FILE, host_payload)
            _write_json(tmp / CONFIG_FILE, config_payload)
            manifest = _json_bytes(file_manifest.build_manifest(tmp, skip=(COMPLETE, MANIFEST_FILE)))
            _write_bytes(tmp / MANIFEST_FILE, manifest)
            fsync_tree(tmp)
            _write_json(tmp / COMPLETE, {"step": step, "time": time.time(), "format_version": FORMAT_VERSION,
                                         "manifest_crc32": file_manifest.crc32_hex(manifest)})
            fsync_path(tmp)
            _pause_for_tests("marked", step)
    except BaseException as err:
        if _is_primary() and tmp.exists():
            _remove_failed_save(tmp)
        code = _errno_of(err)
        if code is None or not isinstance(err, Exception):
            raise
        _release_abandoned_work(err)
        intact = [p for p in list_checkpoints(directory) if verify_checkpoint(p, checksums=False)[0]]
        then = f"the previous checkpoint {intact[-1].name} is intact" if intact else "no earlier checkpoint exists"
        fix = _FIXES.get(code, "check the directory's file system")
        raise CheckpointError(f"{os.strerror(code).lower()} while writing {final}; {then}; {fix}.") from err

    if _is_primary():
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            _remove(final)
        os.replace(tmp, final)
        fsync_path(directory)
        _pause_for_tests("committed", step)
        if save_total_limit is not None:
            older = [p for p in list_checkpoints(directory)
                     if p != final and verify_checkpoint(p, checksums=False)[0]]
            for p in older[: max(0, len(older) + 1 - save_total_limit)]:
                _remove(p)
    _barrier(f"save_done_{step}")
    return final


PAUSE_ENV = "PPOJAX_TEST_PAUSE_IN_SAVE"


def _pause_for_tests(stage: str, step: int) -> None:
    """Crash tests: with ``PPOJAX_TEST_PAUSE_IN_SAVE=<stage>`` (or ``<stage>@<step>``) set, print
    ``PPOJAX_PAUSED <stage> <step>`` and block at that stage of a save until the process is killed.
    Stages, in order: started, state_written, marked (COMPLETE written, not yet renamed), committed."""
    want = os.environ.get(PAUSE_ENV)
    if not want:
        return
    name, _, at = want.partition("@")
    if name == stage and (not at or int(at) == step):
        print(f"PPOJAX_PAUSED {stage} {step}", flush=True)
        while True:
            time.sleep(3600)


def _standard_save(tree):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(tree)


def config_as_dict(config) -> dict:
    """A config as the dict a checkpoint stores: a dict, ``to_dict()`` of a PPOConfig, or a dataclass's fields."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    raise CheckpointError(f"config must be a dict or a dataclass, got {type(config).__name__}.")


# ----------------------------------------------------------------------------------------------------------
# restore


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _flat_target(tree) -> dict[tuple[str, ...], Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(_key_str(k) for k in path): leaf for path, leaf in leaves}


def _flat_metadata(tree, prefix=()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat_metadata(v, prefix + (str(k),)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flat_metadata(v, prefix + (str(i),)))
    elif tree is not None:
        out[prefix] = tree
    return out


def _abstract_leaf(leaf):
    shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
    if dtype is None:
        leaf = np.asarray(leaf)
        shape, dtype = leaf.shape, leaf.dtype
    return jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(leaf, "sharding", None))


def _delete_arrays(tree) -> None:
    """Free the memory of every jax array in ``tree`` now (not when its last reference goes)."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def _stored_shape_dtype(leaf: jax.ShapeDtypeStruct):
    """What orbax stores for a target leaf: typed PRNG keys are stored as their uint32 key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _check_structure(path: Path, target: dict, stored: dict) -> None:
    name = lambda p: ".".join(p) or "<root>"  # noqa: E731
    problems = []
    for p in sorted(set(target) - set(stored)):
        problems.append(f"  {name(p)}: in this run's state, not in the checkpoint")
    for p in sorted(set(stored) - set(target)):
        problems.append(f"  {name(p)}: in the checkpoint, not in this run's state")
    for p in sorted(set(target) & set(stored)):
        want_shape, want_dtype = _stored_shape_dtype(target[p])
        meta = stored[p]
        have_shape = tuple(getattr(meta, "shape", ()) or ())
        have_dtype = getattr(meta, "dtype", None)
        if have_shape != want_shape or (have_dtype is not None and np.dtype(have_dtype) != want_dtype):
            problems.append(f"  {name(p)}: checkpoint {np.dtype(have_dtype) if have_dtype is not None else '?'}"
                            f"{list(have_shape)} -> this run {want_dtype}{list(want_shape)}")
    if problems:
        shown = problems[:40] + ([f"  ... and {len(problems) - 40} more"] if len(problems) > 40 else [])
        raise CheckpointError(
            f"The training state in {path} does not match this run's ({len(problems)} tensor(s) differ):\n"
            + "\n".join(shown)
            + "\nThe model, value head, dtype or optimizer settings (e.g. max_grad_norm, weight_decay) differ "
              "from the run that wrote it; use the same config, or start a fresh run.")


def _read_json(path: Path, name: str) -> Any:
    problem = _json_problem(path, name)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}.")
    return json.loads((path / name).read_text())


def read_checkpoint_config(path) -> dict:
    """The config dict a checkpoint was written with (its config.json); CheckpointError naming the file if it
    is missing or not JSON. ``path``: a checkpoint, e.g. from :func:`resolve_checkpoint`."""
    config = _read_json(Path(path), CONFIG_FILE)
    if not isinstance(config, dict):
        raise CheckpointError(f"cannot resume from {path}: {_describe(CONFIG_FILE)} is not a JSON object.")
    return config


def restore_checkpoint(path, abstract_train_state, *, log: Log = _warn,
                       release_target: bool = False) -> tuple[Any, dict, dict]:
    """Restore ``(train_state, host_state, config_dict)`` from checkpoint ``path``.

    path: a ``step_<N>`` directory (it must verify), or a checkpoints directory / run output_dir (its newest
    intact checkpoint is used; damaged newer ones are skipped with one line each through ``log``), resolved
    by :func:`resolve_checkpoint`. abstract_train_state: the target pytree: concrete arrays or
    ``jax.ShapeDtypeStruct``s (e.g. from ``jax.eval_shape``), whose ``sharding`` decides where each restored
    array lives (so a sharded run gets sharded arrays; a leaf without sharding gets the one it was saved
    with). Call on every process.
    release_target: delete the target's arrays once the checkpoint is found to match it, before any is read,
    so a restore never holds the state twice (a run sized to its memory resumes in that memory); if reading
    then fails, the CheckpointError says that the target is gone.
    Raises CheckpointError: a damaged checkpoint (one line naming the file and what is wrong), an error of
    orbax / tensorstore while reading (chained, so the cause stays inspectable), or every tensor path whose
    presence, shape or dtype differs from the target.
    """
    import orbax.checkpoint as ocp

    path = resolve_checkpoint(path, log=log)
    assert path is not None  # an explicit path never resolves to None
    target = jax.tree.map(_abstract_leaf, abstract_train_state)
    state_dir = (path / STATE_DIR).absolute()  # orbax refuses relative paths
    with _orbax_logs_held(), _orbax_checkpointer() as checkpointer:
        try:
            metadata = checkpointer.metadata(state_dir).item_metadata
            stored_tree = getattr(metadata, "tree", metadata)
            if stored_tree is not None:
                _check_structure(path, _flat_target(target), _flat_metadata(stored_tree))
            if release_target:
                _delete_arrays(abstract_train_state)
            train_state = checkpointer.restore(state_dir, args=ocp.args.StandardRestore(target))
        except CheckpointError:
            raise
        except Exception as err:
            message = f"cannot read the model state in {path} ({STATE_DIR}/): {_one_line(err)}"
            if release_target:
                message += " (the run's own state was released to make room for it: build the run again)"
            _release_abandoned_work(err)
            raise CheckpointError(message) from err
    host_payload = _read_json(path, HOST_STATE_FILE)
    config_dict = read_checkpoint_config(path)
    try:
        host_state = decode_host_state(host_payload["host_state"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"cannot resume from {path}: {_describe(HOST_STATE_FILE)} is malformed "
                              f"({_one_line(err)}).") from err
    return train_state, host_state, config_dict
