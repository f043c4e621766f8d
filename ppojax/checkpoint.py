"""Atomic, resumable checkpoints of a whole training run (orbax for the device state, JSON for the rest).

Layout of ``directory`` (e.g. ``output_dir/checkpoints``)::

    step_120/                 a COMPLETE checkpoint (only names ``step_<int>`` holding COMPLETE count)
        train_state/          orbax pytree of the TrainState (params, optimizer state, counters), any sharding
        host_state.json       KL coefficient, score moments, PRNG key data, data iterator position, counts ...
        config.json           the run's config (``PPOConfig.to_dict()``)
        COMPLETE              written last: {"step": 120, "time": ...}
    step_130.tmp/             a save in progress, or one killed mid-way: ignored, removed by the next save

Protocol of :func:`save_checkpoint` (all processes call it; process 0 does the file-system bookkeeping):

1. process 0 removes leftovers of crashed saves (``step_*.tmp``, ``step_*`` without COMPLETE) and creates
   ``step_N.tmp``; barrier;
2. orbax writes ``step_N.tmp/train_state`` (every process writes its shards; orbax finalises it atomically);
3. process 0 writes host_state.json and config.json, fsyncs the tree, writes COMPLETE, fsyncs it, then
   renames ``step_N.tmp`` -> ``step_N`` (one atomic rename) and fsyncs the directory;
4. only then, older checkpoints beyond ``save_total_limit`` are renamed to ``*.tmp`` (so a crash while
   deleting never leaves a half-deleted "complete" checkpoint) and deleted.

A process killed at any point therefore leaves either the new complete checkpoint or none, and the previous
ones intact. Saves are synchronous: when the call returns the checkpoint is on disk. ``directory`` must be a
POSIX file system that every process sees (local disk for one host; a shared one for multi-host runs, as
orbax requires). Crash tests can stop a save at a chosen stage with ``PPOJAX_TEST_PAUSE_IN_SAVE`` (below).

Host state is any JSON-able dict; numpy/jax arrays and scalars are stored with their dtype (restored as
numpy arrays, bit for bit), typed PRNG keys as their uint32 key data plus the implementation name (restored
as typed keys). Python floats round-trip exactly (JSON keeps float64's shortest repr), so a float32 value
stored as ``float(x)`` comes back as the same float32.
"""
from __future__ import annotations

import dataclasses
import json
import operator
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import jax
import numpy as np

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "restore_checkpoint",
    "check_compatible",
    "encode_host_state",
    "decode_host_state",
    "STRICT_FIELDS",
    "HARMLESS_FIELDS",
    "TUNABLE_FIELDS",
]

COMPLETE = "COMPLETE"
STATE_DIR = "train_state"
HOST_STATE_FILE = "host_state.json"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_OURS_RE = re.compile(r"^step_\d+(\..*)?$")  # every name a save may leave behind


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here; the message says why and what to do."""


# ----------------------------------------------------------------------------------------------------------
# multi-process helpers


def _is_primary() -> bool:
    return jax.process_index() == 0


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"ppojax.checkpoint:{name}")


# ----------------------------------------------------------------------------------------------------------
# listing


def _step_of(path: Path) -> Optional[int]:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def _is_complete(path: Path) -> bool:
    return _step_of(path) is not None and (path / COMPLETE).is_file() and (path / STATE_DIR).is_dir()


def list_checkpoints(directory) -> list[Path]:
    """The complete checkpoints under ``directory``, oldest step first (tmp / half-written ones excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _is_complete(p)]
    return sorted(found, key=lambda p: _step_of(p))  # type: ignore[arg-type,return-value]


def latest_checkpoint(directory) -> Optional[Path]:
    """The complete checkpoint with the highest step under ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


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


def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def _write_json(path: Path, payload: Any) -> None:
    text = json.dumps(payload, indent=1, sort_keys=False, allow_nan=True)
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


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
        _fsync_path(path.parent)
    if doomed.is_dir():
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        doomed.unlink(missing_ok=True)


def _clean_leftovers(directory: Path, keep: Iterable[Path] = ()) -> list[Path]:
    """Remove entries of crashed saves/deletions: ``step_*.<anything>`` and ``step_N`` without COMPLETE."""
    keep = {p.resolve() for p in keep}
    removed = []
    for p in directory.iterdir():
        if p.resolve() in keep or not _OURS_RE.match(p.name):
            continue
        if _STEP_RE.match(p.name) and _is_complete(p):
            continue
        _remove(p)
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------------------------------------
# save


def _orbax_checkpointer():
    import orbax.checkpoint as ocp

    # Synchronous: save() returns once the data is written and finalised, on every process.
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def save_checkpoint(directory, step: int, train_state, host_state: dict, config_dict: dict, *,
                    save_total_limit: Optional[int] = None) -> Path:
    """Write checkpoint ``directory/step_<step>`` atomically and return its path.

    train_state: a pytree of (possibly sharded, multi-host) ``jax.Array``s, e.g. ``update.TrainState``;
    host_state: JSON-able dict (arrays, numpy scalars and typed PRNG keys allowed, see the module doc);
    config_dict: the run's config as a dict. Call on EVERY process (orbax writes each process's shards).
    save_total_limit: keep this many complete checkpoints (the newest steps, always including this one);
    None keeps all. Older ones are deleted only after this one is complete.
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
    config_payload = json.loads(json.dumps(_as_dict(config_dict), default=str))

    if _is_primary():
        directory.mkdir(parents=True, exist_ok=True)
        _clean_leftovers(directory)
        tmp.mkdir()
    _barrier(f"save_start_{step}")
    _pause_for_tests("started", step)

    with _orbax_checkpointer() as checkpointer:
        # orbax's tensorstore backend refuses relative paths (e.g. the demo's output_dir "outputs/demo")
        checkpointer.save((tmp / STATE_DIR).absolute(), args=_standard_save(train_state))
    _pause_for_tests("state_written", step)

    if _is_primary():
        _write_json(tmp / HOST_STATE_FILE, host_payload)
        _write_json(tmp / CONFIG_FILE, config_payload)
        _fsync_tree(tmp)
        _write_json(tmp / COMPLETE, {"step": step, "time": time.time(), "format_version": FORMAT_VERSION})
        _fsync_path(tmp)
        _pause_for_tests("marked", step)
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            _remove(final)
        os.replace(tmp, final)
        _fsync_path(directory)
        _pause_for_tests("committed", step)
        if save_total_limit is not None:
            complete = list_checkpoints(directory)
            older = [p for p in complete if p != final]
            for p in older[: max(0, len(complete) - save_total_limit)]:
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


def _as_dict(config) -> dict:
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    raise CheckpointError(f"config must be a dict or a dataclass, got {type(config).__name__}.")


# ----------------------------------------------------------------------------------------------------------
# restore


def _resolve(path) -> Path:
    path = Path(path)
    if _is_complete(path):
        return path
    if path.is_dir() and _step_of(path) is None:
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        raise CheckpointError(f"No complete checkpoint under {path} (looked for step_<N>/{COMPLETE}).")
    if not path.exists():
        raise CheckpointError(f"Checkpoint {path} does not exist.")
    raise CheckpointError(
        f"{path} is not a complete checkpoint (no {COMPLETE} marker or no {STATE_DIR}/): it was probably "
        "interrupted while being written. Resume from `latest_checkpoint(<checkpoints dir>)` instead.")


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


def restore_checkpoint(path, abstract_train_state) -> tuple[Any, dict, dict]:
    """Restore ``(train_state, host_state, config_dict)`` from checkpoint ``path``.

    path: a ``step_<N>`` directory, or a checkpoints directory (its latest complete checkpoint is used).
    abstract_train_state: the target pytree: concrete arrays or ``jax.ShapeDtypeStruct``s (e.g. from
    ``jax.eval_shape``), whose ``sharding`` decides where each restored array lives (so a sharded run gets
    sharded arrays; a leaf without sharding gets the one it was saved with). Call on every process.
    Raises CheckpointError naming every tensor path whose presence, shape or dtype differs.
    """
    import orbax.checkpoint as ocp

    path = _resolve(path)
    target = jax.tree.map(_abstract_leaf, abstract_train_state)
    with _orbax_checkpointer() as checkpointer:
        state_dir = (path / STATE_DIR).absolute()  # orbax refuses relative paths
        metadata = checkpointer.metadata(state_dir).item_metadata
        stored_tree = getattr(metadata, "tree", metadata)
        if stored_tree is not None:
            _check_structure(path, _flat_target(target), _flat_metadata(stored_tree))
        train_state = checkpointer.restore(state_dir, args=ocp.args.StandardRestore(target))
    host_payload = json.loads((path / HOST_STATE_FILE).read_text())
    config_dict = json.loads((path / CONFIG_FILE).read_text())
    return train_state, decode_host_state(host_payload["host_state"]), config_dict


# ----------------------------------------------------------------------------------------------------------
# config compatibility: derived in config.py from each field's `on_resume` metadata (re-exported here)

from .config import ConfigError as _ConfigError  # noqa: E402  (config imports nothing heavy)
from .config import IGNORED_ON_RESUME_FIELDS as HARMLESS_FIELDS  # noqa: E402
from .config import MAY_CHANGE_FIELDS as TUNABLE_FIELDS  # noqa: E402
from .config import MUST_MATCH_FIELDS as STRICT_FIELDS  # noqa: E402
from .config import resume_compatibility  # noqa: E402


def check_compatible(saved_config, config) -> list[str]:
    """:func:`ppojax.config.resume_compatibility` on dicts or PPOConfigs, raising CheckpointError (as
    before) where a field that must match differs."""
    try:
        return resume_compatibility(_as_dict(saved_config), _as_dict(config))
    except _ConfigError as err:
        raise CheckpointError(str(err)) from None
