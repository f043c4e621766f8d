"""Checkpoints of a whole training run: orbax's ``CheckpointManager`` writes them (asynchronously, atomically,
keeping ``save_total_limit``); ppojax adds an integrity manifest, verification on resume and the fallback to
the newest intact checkpoint.

Layout of ``directory`` (e.g. ``output_dir/checkpoints``)::

    step_120/                         a checkpoint (orbax's step directory)
        train_state/                  orbax pytree of the TrainState (params, optimizer state, counters), any sharding
        host_state/host_state.json    KL coefficient, score moments, PRNG key data, data position, counts ...
        config/config.json            the run's config (``PPOConfig.to_dict()``)
        _CHECKPOINT_METADATA, commit_success.txt    orbax's own records
        MANIFEST.json                 ppojax: size and CRC32 checksums of every file of the three items above
        COMPLETE                      ppojax, written last: {"step": 120, "time": ..., "manifest_crc32": ...}
    step_130.orbax-checkpoint-tmp/    a save in progress, or one killed mid-way: ignored, removed by the next save
    .deleting/                        checkpoints rotated out (one rename each), emptied once the save is done
    damaged/step_110/                 a damaged checkpoint the next save moved aside (never deleted by ppojax)

A save (:func:`save_checkpoint`, on every process): orbax copies the state to host memory and returns; its
background thread writes the files into ``step_N.orbax-checkpoint-tmp``. Once they are written, process 0
checksums them into MANIFEST.json, fsyncs them and writes COMPLETE (orbax's post-finalisation callback); then
orbax renames the directory to ``step_N`` (atomic) and moves the checkpoints beyond ``save_total_limit`` into
``.deleting/``. A process killed at any point leaves the new checkpoint complete or absent, and the previous ones
intact. ``wait=False`` returns during the write: the next save, :func:`wait_for_saves` and every function here
that reads checkpoints first wait for it (and raise its failure). A failed save (ENOSPC, EDQUOT, or EFBIG under
``ulimit -f``) removes what it wrote and raises one :class:`CheckpointError` naming the checkpoint, the cause and
the previous intact checkpoint. ``directory`` must be a POSIX file system that every process sees.

Verification (:func:`verify_checkpoint`): intact when COMPLETE is present, MANIFEST.json matches the checksum in
COMPLETE, every file the manifest lists exists with its size and checksums, the manifest lists the model state
and both JSON files, and those parse. Resuming (:func:`latest_checkpoint`, :func:`resolve_checkpoint`,
:func:`restore_checkpoint`) verifies newest step first, skips each damaged checkpoint with one line naming the
file and what is wrong, and uses the newest intact one.

Before each save, what crashes and damage left is tidied: ``step_N.<anything>`` (an unfinished save) is
deleted; a ``step_N`` that fails verification is deleted when it holds nothing besides COMPLETE / MANIFEST.json,
else moved into ``damaged/`` with one line (it no longer counts towards the limit). A save never re-reads older
checkpoints: it checks their presence and sizes, plus the checksum failures this process found.

Host state is any JSON-able dict; numpy/jax arrays and scalars are stored with their dtype (restored as numpy
arrays, bit for bit), typed PRNG keys as their uint32 key data plus the implementation name. Python floats
round-trip exactly, so a float32 stored as ``float(x)`` comes back as the same float32.
"""
from __future__ import annotations

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
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax
import numpy as np

from ppojax.errors import CheckpointError
from ppojax.io import file_manifest
from ppojax.io.durable import fsync_path, fsync_tree

__all__ = ["CheckpointError", "save_checkpoint", "wait_for_saves", "verify_checkpoint", "latest_checkpoint",
           "resolve_checkpoint", "list_checkpoints", "read_checkpoint_config", "restore_checkpoint",
           "encode_host_state", "decode_host_state"]

COMPLETE = "COMPLETE"
MANIFEST_FILE = "MANIFEST.json"
STATE_DIR = "train_state"
HOST_STATE_FILE = "host_state/host_state.json"
CONFIG_FILE = "config/config.json"
ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")  # orbax rewrites these as it commits: not in the manifest
DAMAGED_DIR = "damaged"
DELETING_DIR = ".deleting"
FORMAT_VERSION = 2
_STEP_RE = re.compile(r"^step_(\d+)$")
_OURS_RE = re.compile(r"^step_\d+(\..*)?$")  # every name a save may leave behind

Log = Callable[[str], None]


def _warn(message: str) -> None:
    """Default ``log``: one line on stderr."""
    print(f"ppojax: {message}", file=sys.stderr, flush=True)


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


def _describe(name: str) -> str:
    """How a file of a checkpoint is named in messages."""
    if name.startswith(STATE_DIR + "/"):
        return f"model state file {name}"
    return {HOST_STATE_FILE: f"host state file {name}", CONFIG_FILE: f"config file {name}"}.get(name, name)


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


# Checksum verifications made in this process: resolved path -> (manifest_signature then, problem or None). While
# the files are unchanged the answer stands: a restore trusts the check resume just made instead of reading a
# multi-GB checkpoint again, and the next save (which only stats older checkpoints) knows what resume found.
_verified: dict[Path, tuple[tuple, Optional[str]]] = {}


def verify_checkpoint(path, *, checksums: bool = True) -> tuple[bool, str]:
    """Whether ``path`` is an intact checkpoint: ``(True, what was checked)`` or ``(False, one-line reason)``.

    The reason names the file and what is wrong, e.g. "model state file train_state/d/ab12 is 1,234 bytes,
    the manifest says 5,678 (truncated)". ``checksums=False`` checks presence and sizes only (``stat``; only the
    small JSON files are read) plus what an earlier check in this process found; True also reads every byte
    against the manifest's CRC32s (once per process while the files are unchanged).
    """
    wait_for_saves()
    return _verify(Path(path), checksums)


def _verify(path: Path, checksums: bool = True) -> tuple[bool, str]:
    if not path.is_dir():
        return False, "does not exist" if not path.exists() else "is not a directory"
    manifest, problem = _read_manifest(path)
    if problem:
        return False, problem
    files = manifest["files"]
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


def _read_manifest(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the manifest, None) when COMPLETE vouches for it and it lists what a checkpoint needs; else (None, why)."""
    if not (path / COMPLETE).is_file():
        return None, ("not a complete checkpoint: no COMPLETE marker (its save was interrupted, or the marker "
                      "was deleted)")
    try:
        marker = json.loads((path / COMPLETE).read_text())
        if not isinstance(marker, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        return None, f"its {COMPLETE} marker is damaged ({err})"
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        return None, f"{MANIFEST_FILE} is missing"
    except OSError as err:
        return None, f"{MANIFEST_FILE} cannot be read ({err})"
    if file_manifest.crc32_hex(raw) != marker.get("manifest_crc32"):
        return None, f"{MANIFEST_FILE} does not match the checksum recorded in {COMPLETE}"
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return None, f"{MANIFEST_FILE} is malformed ({err})"
    for name in (HOST_STATE_FILE, CONFIG_FILE):
        if name not in files:
            return None, f"{_describe(name)} is not in {MANIFEST_FILE}"
    if not any(name.startswith(STATE_DIR + "/") for name in files):
        return None, f"{MANIFEST_FILE} lists no model state file ({STATE_DIR}/)"
    return manifest, None


# ----------------------------------------------------------------------------------------------------------
# listing and choosing


def list_checkpoints(directory) -> list[Path]:
    """The complete checkpoints under ``directory`` (COMPLETE marker and train_state/ present; not verified),
    oldest step first; unfinished saves excluded."""
    wait_for_saves()
    return _list(Path(directory))


def _list(directory: Path) -> list[Path]:
    return [p for p in reversed(_candidates(directory)) if (p / COMPLETE).is_file() and (p / STATE_DIR).is_dir()]


def _candidates(directory: Path) -> list[Path]:
    """Every ``step_N`` directory under ``directory``, newest step first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _step_of(p) is not None and p.is_dir()]
    return sorted(found, key=_step_of, reverse=True)  # type: ignore[arg-type]


def _newest_intact(directory: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies or None, [(skipped newer checkpoint, reason)])."""
    skipped = []
    for path in _candidates(directory):
        ok, reason = _verify(path)
        if ok:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def _newest_in(directory: Path, log: Log, none_ok: bool) -> Optional[Path]:
    chosen, skipped = _newest_intact(directory)
    then = f"using {chosen.name}" if chosen is not None else "no intact checkpoint is left"
    for path, reason in skipped:
        log(f"skipping {path}: {reason}; {then}")
    if chosen is not None:
        return chosen
    if skipped:
        raise CheckpointError(
            f"none of the {len(skipped)} checkpoint(s) under {directory} is intact (each is named above with "
            f"what is wrong): restore the missing files, or move them aside to start a fresh run.")
    if none_ok:
        return None
    raise CheckpointError(f"no checkpoint under {directory} (looked for step_<N>/{COMPLETE}).")


def latest_checkpoint(directory, *, log: Log = _warn) -> Optional[Path]:
    """The newest checkpoint under ``directory`` that verifies (sizes and checksums), or None.

    Newer damaged ones are skipped, each with ONE line through ``log`` ("skipping <dir>/step_8: model state
    file train_state/... is 1,234 bytes, the manifest says 5,678 (truncated); using step_6").
    """
    wait_for_saves()
    try:
        return _newest_in(Path(directory), log, none_ok=True)
    except CheckpointError:
        return None


def resolve_checkpoint(where: Union[str, os.PathLike, bool], checkpoint_dir=None, *,
                       log: Log = _warn) -> Optional[Path]:
    """The intact checkpoint to resume from, or None when ``where`` is auto and nothing was saved yet.

    where: ``"auto"`` or ``True`` -> the newest intact checkpoint under ``checkpoint_dir`` (None if it holds
    no ``step_N`` at all; a CheckpointError if it holds some and none verifies). A path -> a ``step_N``
    checkpoint (it must verify), a checkpoints directory or a run's output_dir (``<dir>/checkpoints``): its
    newest intact checkpoint. Raises CheckpointError (one line per problem, no traceback) for a path that does
    not exist, a damaged checkpoint, or a directory without an intact one.
    """
    wait_for_saves()
    if where is True or where == "auto":
        if checkpoint_dir is None:
            raise CheckpointError("resume='auto' needs the checkpoints directory to look in.")
        return _newest_in(Path(checkpoint_dir), log, none_ok=True)
    path = Path(where)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; give a step_N checkpoint, a checkpoints "
                              "directory, or resume: auto.")
    if _step_of(path) is not None or (path / COMPLETE).exists():
        ok, reason = _verify(path)
        if ok:
            return path
        alternative, _ = _newest_intact(path.parent)
        hint = f"; the newest intact checkpoint beside it is {alternative}" if alternative is not None else ""
        raise CheckpointError(f"cannot resume from {path}: {reason}{hint}.")
    if not _candidates(path) and (path / "checkpoints").is_dir():  # a run's output_dir
        path = path / "checkpoints"
    return _newest_in(path, log, none_ok=False)


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
        data = np.asarray(value["data"], np.uint32).reshape(*value["shape"], -1)
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
# save: orbax's CheckpointManager, one per directory, with ppojax's seal written before orbax's commit


@dataclasses.dataclass
class _Pending:
    step: int
    final: Path
    on_saved: Optional[Callable[[int], None]]


class _Saver:
    """orbax's manager of one checkpoints directory, and the save it may be writing."""

    def __init__(self, directory: Path, limit: Optional[int]):
        import orbax.checkpoint as ocp

        _quiet_orbax()
        self.directory, self.limit, self.pending = directory, limit, None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=limit, step_prefix="step", enable_async_checkpointing=True, create=True,
            todelete_subdir=DELETING_DIR,  # rotation renames (atomic), so no crash leaves half a checkpoint
            cleanup_tmp_directories=False,  # _tidy does it, with the rest of what crashes leave
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal_pending))
        self.manager = ocp.CheckpointManager(directory, options=options, item_handlers=_item_handlers())

    def _seal_pending(self) -> None:
        """orbax's post-finalisation callback (process 0, orbax's thread): the files are written, not renamed."""
        step = self.pending.step
        written = list(self.directory.glob(f"step_{step}.orbax-checkpoint-tmp*"))
        if len(written) != 1:
            raise CheckpointError(f"cannot find the directory orbax is writing step {step} into: {written}")
        _seal(written[0], step)


def _item_handlers() -> dict:
    """orbax's handlers of a checkpoint's three items (their directory names are the keys)."""
    import orbax.checkpoint as ocp

    return {STATE_DIR: ocp.StandardCheckpointHandler(),
            "host_state": ocp.JsonCheckpointHandler(filename=Path(HOST_STATE_FILE).name),
            "config": ocp.JsonCheckpointHandler(filename=Path(CONFIG_FILE).name)}


_savers: dict[Path, _Saver] = {}
_savers_lock = threading.Lock()


def _seal(path: Path, step: int) -> None:
    """Write MANIFEST.json (checksums of the items' files, read back), fsync everything, then COMPLETE."""
    skip = (COMPLETE, MANIFEST_FILE, *ORBAX_FILES)
    manifest = _json_bytes(file_manifest.build_manifest(path, skip=skip))
    _write_bytes(path / MANIFEST_FILE, manifest)
    fsync_tree(path)
    _write_bytes(path / COMPLETE, _json_bytes({"step": step, "time": time.time(), "format_version": FORMAT_VERSION,
                                                "manifest_crc32": file_manifest.crc32_hex(manifest)}))
    fsync_path(path)


def _check_save_args(step, save_total_limit) -> int:
    try:
        step = operator.index(step)
    except TypeError:
        raise CheckpointError(f"step={step!r}: expected an integer >= 0.") from None
    if step < 0:
        raise CheckpointError(f"step={step}: expected an integer >= 0.")
    if save_total_limit is not None and save_total_limit < 1:
        raise CheckpointError(f"save_total_limit={save_total_limit}: expected None or an integer >= 1.")
    return step


def save_checkpoint(directory, step: int, train_state, host_state: dict, config_dict: dict, *,
                    save_total_limit: Optional[int] = None, log: Log = _warn, wait: bool = True,
                    on_saved: Optional[Callable[[int], None]] = None) -> Path:
    """Save checkpoint ``directory/step_<step>`` (atomically, with its manifest) and return its path.

    train_state: a pytree of (possibly sharded, multi-host) ``jax.Array``s, e.g. ``update.TrainState``;
    host_state: JSON-able dict (arrays, numpy scalars and typed PRNG keys allowed, see the module doc);
    config_dict: the run's config as a dict. Call on EVERY process (orbax writes each process's shards).
    save_total_limit: keep this many checkpoints (the newest steps, always including this one); None keeps
    all. Older ones go only once this one is complete. log: where a damaged checkpoint moved aside is reported.
    wait: False returns once the state is copied to host memory, while the files are written (the caller may
    donate or change ``train_state``); see :func:`wait_for_saves`. on_saved(step): called once it is on disk.
    Raises CheckpointError when the storage fails (full disk, file size limit, permissions), for this save or
    an unfinished earlier one: what it wrote is removed and the message names the checkpoint, the cause and
    the previous intact checkpoint.
    """
    step = _check_save_args(step, save_total_limit)
    directory = Path(directory).absolute()  # orbax's tensorstore refuses relative paths
    # Encode first, so a host state that cannot be stored fails before anything is written.
    host_payload = {"format_version": FORMAT_VERSION, "step": step, "host_state": encode_host_state(host_state)}
    config_payload = json.loads(json.dumps(config_as_dict(config_dict), default=str))
    wait_for_saves(directory)
    final = directory / f"step_{step}"
    if _is_primary():
        directory.mkdir(parents=True, exist_ok=True)
        _tidy(directory, log)
    _barrier(f"save_start_{step}")
    saver = _saver_for(directory, save_total_limit)
    saver.pending = _Pending(step, final, on_saved)
    try:
        import orbax.checkpoint as ocp

        if step in saver.manager.all_steps():  # the same step saved again (e.g. after a resume): replace it
            saver.manager.delete(step)
        saver.manager.save(step, force=True, args=ocp.args.Composite(
            train_state=ocp.args.StandardSave(train_state), host_state=ocp.args.JsonSave(host_payload),
            config=ocp.args.JsonSave(config_payload)))
    except BaseException as err:
        _fail(saver, err)
    if wait:
        wait_for_saves(directory)
    return final


def _saver_for(directory: Path, limit: Optional[int]) -> _Saver:
    with _savers_lock:
        saver = _savers.get(directory)
        if saver is not None and saver.limit != limit:
            _close(saver)
            saver = None
        if saver is None:
            saver = _savers[directory] = _Saver(directory, limit)
        else:  # what _tidy (or anyone) changed since: orbax counts the checkpoints it lists towards the limit
            saver.manager.reload()
    return saver


def wait_for_saves(directory=None) -> None:
    """Block until the saves this process started (under ``directory``, or all) are on disk.

    Raises CheckpointError for one that failed (its files are removed first). The training loop calls it before
    the run ends and when it stops on an error; the functions of this module that read checkpoints call it.
    """
    with _savers_lock:
        savers = [s for d, s in _savers.items() if directory is None or d == Path(directory).absolute()]
    for saver in savers:
        if saver.pending is None:
            continue
        try:
            saver.manager.wait_until_finished()
        except BaseException as err:
            _fail(saver, err)
        done, saver.pending = saver.pending, None
        if _is_primary():
            _purge(saver.directory / DELETING_DIR)
            fsync_path(saver.directory)
        if done.on_saved is not None:
            done.on_saved(done.step)


def _fail(saver: _Saver, err: BaseException):
    """A save failed: remove what it wrote, drop its manager, raise one CheckpointError (or ``err`` itself when
    it is not a failure of the storage)."""
    pending, saver.pending = saver.pending, None
    with _savers_lock:
        _savers.pop(saver.directory, None)
    _close(saver)
    if _is_primary():
        for debris in saver.directory.glob(f"step_{pending.step}.*"):
            _remove_failed_save(debris)
    code = _errno_of(err)
    if code is None or not isinstance(err, Exception):
        raise err
    _release_abandoned_work(err)
    intact = [p for p in _list(saver.directory) if _verify(p, checksums=False)[0]]
    then = f"the previous checkpoint {intact[-1].name} is intact" if intact else "no earlier checkpoint exists"
    fix = _FIXES.get(code, "check the directory's file system")
    raise CheckpointError(f"{os.strerror(code).lower()} while writing {pending.final}; {then}; {fix}.") from err


def _close(saver: _Saver) -> None:
    try:
        saver.manager.close()
    except Exception:  # a failed save's error, already reported
        pass


def _purge(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, indent=1, allow_nan=True).encode()


def _remove_failed_save(path: Path, quiet: float = 0.5, deadline: float = 10.0) -> None:
    """Remove a failed save's directory. orbax's writer threads (tensorstore's) may still be finishing files in
    it when the error surfaces, and a write re-creates the directories it needs: the removal is repeated until
    the directory has stayed gone for ``quiet`` seconds (at most ``deadline`` seconds in all)."""
    end, gone_since = time.monotonic() + deadline, None
    while time.monotonic() < end:
        if path.exists():
            shutil.rmtree(path, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= quiet:
            return
        time.sleep(0.05)


def _holds_data(path: Path) -> bool:
    """Whether ``path`` holds any file besides a checkpoint's marker and manifest (i.e. anything of value)."""
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
    return destination


def _tidy(directory: Path, log: Log) -> None:
    """Apply the module doc's rules to what crashed saves and damage left under ``directory``."""
    _purge(directory / DELETING_DIR)
    for path in sorted(directory.iterdir()):
        if not _OURS_RE.match(path.name) or (_step_of(path) is not None and _verify(path, checksums=False)[0]):
            continue
        if _step_of(path) is None or not _holds_data(path):  # an unfinished save, or nothing of value
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        else:
            reason = _verify(path, checksums=False)[1]
            log(f"moved damaged checkpoint {path} aside to {_move_aside(path)}: {reason}")


# ----------------------------------------------------------------------------------------------------------
# errors of the storage (a full disk) and orbax's noise about them


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
    """Drop the tracebacks of ``err``'s chain and collect now, on the failure path only.

    When one array's read or write fails, orbax abandons the coroutines of the others and closes their event
    loop; while ``err``'s tracebacks keep them alive, Python would print "Exception ignored in: <coroutine ...>"
    whenever they are collected (after the CheckpointError was printed, or at exit)."""
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


class _OrbaxErrorLogs(logging.Filter):
    """Drops the ERROR records orbax logs (through absl) for a failed read or write: each of those failures
    reaches this module as an exception too, which it reports as ONE CheckpointError."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or f"{os.sep}orbax{os.sep}" not in record.pathname


def _quiet_orbax() -> None:
    """Installed once, before the first orbax call: the filter above, and one in front of
    ``sys.unraisablehook`` for orbax's abandoned work ("Exception ignored in: <coroutine>", "Event loop is
    closed" from tensorstore reads completing into a closed loop, at any time)."""
    previous = sys.unraisablehook
    if getattr(previous, "ppojax_orbax_noise_filter", False):
        return
    logging.getLogger("absl").addFilter(_OrbaxErrorLogs())

    def hook(unraisable):
        if not _is_orbax_noise(unraisable):
            previous(unraisable)

    hook.ppojax_orbax_noise_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


# ----------------------------------------------------------------------------------------------------------
# restore


def _flat(tree) -> dict[tuple[str, ...], Any]:
    """{path of names: leaf} of a pytree (a target of arrays, or orbax's nested dicts/lists of metadata)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)) for k in path): leaf
            for path, leaf in leaves}


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
    """The config dict a checkpoint was written with; CheckpointError naming the file if it is missing or not
    JSON. ``path``: a checkpoint, e.g. from :func:`resolve_checkpoint`."""
    wait_for_saves()
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
    array lives (a leaf without sharding gets the one it was saved with). Call on every process.
    release_target: delete the target's arrays once the checkpoint is found to match it, before any is read,
    so a restore never holds the state twice; if reading then fails, the CheckpointError says the target is gone.
    Raises CheckpointError: a damaged checkpoint (one line naming the file and what is wrong), an error of
    orbax / tensorstore while reading (chained, so the cause stays inspectable), or every tensor path whose
    presence, shape or dtype differs from the target.
    """
    import orbax.checkpoint as ocp

    path = resolve_checkpoint(path, log=log)
    assert path is not None  # an explicit path never resolves to None
    target = jax.tree.map(_abstract_leaf, abstract_train_state)
    _quiet_orbax()
    host_payload = _read_json(path, HOST_STATE_FILE)  # verified: any problem here is a clear message
    config_dict = read_checkpoint_config(path)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_item_handlers())) as checkpointer:
        try:
            step_dir = path.absolute()  # orbax refuses relative paths
            metadata = checkpointer.metadata(step_dir).item_metadata[STATE_DIR]
            stored_tree = getattr(metadata, "tree", metadata)
            if stored_tree is not None:
                _check_structure(path, _flat(target), _flat(stored_tree))
            if release_target:
                _delete_arrays(abstract_train_state)
            restore = ocp.args.Composite(**{STATE_DIR: ocp.args.StandardRestore(target)},
                                         host_state=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
            train_state = checkpointer.restore(step_dir, args=restore)[STATE_DIR]
        except CheckpointError:
            raise
        except Exception as err:
            message = f"cannot read the model state in {path} ({STATE_DIR}/): {_one_line(err)}"
            if release_target:
                message += " (the run's own state was released to make room for it: build the run again)"
            _release_abandoned_work(err)
            raise CheckpointError(message) from err
    try:
        host_state = decode_host_state(host_payload["host_state"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"cannot resume from {path}: {_describe(HOST_STATE_FILE)} is malformed "
                              f"({_one_line(err)}).") from err
    return train_state, host_state, config_dict
