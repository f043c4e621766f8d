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

A run writes through one :class:`RunCheckpoints`, which holds one orbax ``CheckpointManager`` from its first save
to :meth:`RunCheckpoints.close`. orbax writes a save into ``step_N.orbax-checkpoint-tmp`` on its background
thread; once the files are written, ppojax checksums them into MANIFEST.json, fsyncs them and writes COMPLETE
(orbax's post-finalisation callback); then orbax renames the directory to ``step_N`` and rotates the checkpoints
beyond the limit into ``.deleting/``. A process killed at any point leaves the new checkpoint complete or absent
and the older ones intact. A failed save (ENOSPC, EDQUOT, EFBIG) closes the manager, waits for the writes orbax
abandoned, removes what the save wrote and raises one CheckpointError naming the checkpoint, the cause and the
previous intact checkpoint; orbax's reports of it go to the run's libraries.log (:mod:`ppojax.io.orbax_failures`).
``directory`` must be a POSIX file system that every process sees.

A checkpoint is intact when COMPLETE vouches for MANIFEST.json (its CRC32), every file listed there has its size
and checksums, and both JSON files parse. Resuming takes the newest intact checkpoint, with one line for each
newer damaged one. Before each save, ``step_N.<anything>`` and a ``step_N`` holding no data are deleted and a
damaged ``step_N`` is moved into ``damaged/`` (it does not count towards the limit); older checkpoints are only
``stat``-ed then, plus the checksum failures the run's earlier checks found.
"""
from __future__ import annotations

import errno
import json
import operator
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional, Union

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from ppojax.errors import CheckpointError
from ppojax.io import file_manifest
from ppojax.io.durable import fsync_path, fsync_tree
from ppojax.io.host_state_json import config_as_dict, decode_host_state, encode_host_state
from ppojax.io.orbax_failures import finalize_abandoned_work, quiet_orbax, wait_for_abandoned_writes

__all__ = ["CheckpointError", "RunCheckpoints", "save_checkpoint", "verify_checkpoint", "latest_checkpoint",
           "resolve_checkpoint", "list_checkpoints", "read_checkpoint_config", "restore_checkpoint",
           "encode_host_state", "decode_host_state", "config_as_dict"]

COMPLETE = "COMPLETE"
MANIFEST_FILE = "MANIFEST.json"
STATE_DIR = "train_state"
HOST_STATE_FILE = "host_state/host_state.json"
CONFIG_FILE = "config/config.json"
ORBAX_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")  # orbax rewrites these as it commits: not in the manifest
UNFINISHED = ".orbax-checkpoint-tmp"  # orbax writes step_N into step_N + this, then renames it
DAMAGED_DIR = "damaged"
DELETING_DIR = ".deleting"
FORMAT_VERSION = 2
_STEP_RE = re.compile(r"^step_\d+$")
_OURS_RE = re.compile(r"^step_\d+(\..*)?$")  # every name a save may leave behind
_ERRNO_IN_TEXT = re.compile(r"os_error_code='?(\d+)")  # how tensorstore reports the errno of a failed write
_FIXES = {
    errno.ENOSPC: "free space or set save_total_limit",
    errno.EDQUOT: "free space (or raise the quota) or set save_total_limit",
    errno.EFBIG: "raise the file size limit (`ulimit -f unlimited`) or use a file system that allows larger files",
}

Log = Callable[[str], None]
#: a run's checksum checks, by resolved path: (manifest signature, problem or None), trusted while the files are
#: unchanged: a restore does not read again what resume verified, a save (which only stats) knows what it found
Checked = dict[Path, tuple[tuple, Optional[str]]]


def _warn(message: str) -> None:
    print(f"ppojax: {message}", file=sys.stderr, flush=True)


def _is_primary() -> bool:
    return jax.process_index() == 0


def _cannot_resume(path, problem: str) -> CheckpointError:
    return CheckpointError(f"cannot resume from {path}: {problem}.")


# --- verification ----------------------------------------------------------------------------------------


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


def verify_checkpoint(path, *, checksums: bool = True) -> tuple[bool, str]:
    """``(True, what was checked)`` if ``path`` is an intact checkpoint, else ``(False, one line naming the file
    and what is wrong)``. ``checksums=False``: presence and sizes only."""
    return _verify(Path(path), checksums, {})


def _verify(path: Path, checksums: bool, checked: Checked) -> tuple[bool, str]:
    if not path.is_dir():
        return False, "does not exist" if not path.exists() else "is not a directory"
    manifest, problem = _read_manifest(path)
    problem = problem or (file_manifest.check_manifest(path, manifest, checksums=False, describe=_describe)
                          or _json_problem(path, HOST_STATE_FILE) or _json_problem(path, CONFIG_FILE))
    if problem:
        return False, problem
    count, signature = len(manifest["files"]), file_manifest.manifest_signature(path, manifest)
    known = checked.get(path.resolve())
    if known is not None and known[0] == signature:
        problem = known[1]
    elif not checksums:
        return True, f"{count} files present with their sizes"
    else:
        problem = file_manifest.check_manifest(path, manifest, checksums=True, describe=_describe)
        checked[path.resolve()] = (signature, problem)
    return (False, problem) if problem else (True, f"{count} files match their sizes and checksums")


def _read_manifest(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(the manifest, None) when COMPLETE vouches for it (its CRC32), else (None, why)."""
    if not (path / COMPLETE).is_file():
        return None, ("not a complete checkpoint: no COMPLETE marker (its save was interrupted, or the marker "
                      "was deleted)")
    try:
        expected_crc = json.loads((path / COMPLETE).read_text()).get("manifest_crc32")
    except (OSError, ValueError, AttributeError) as err:  # AttributeError: not a JSON object
        return None, f"its {COMPLETE} marker is damaged ({err})"
    try:
        raw = (path / MANIFEST_FILE).read_bytes()
    except FileNotFoundError:
        return None, f"{MANIFEST_FILE} is missing"
    except OSError as err:
        return None, f"{MANIFEST_FILE} cannot be read ({err})"
    if file_manifest.crc32_hex(raw) != expected_crc:
        return None, f"{MANIFEST_FILE} does not match the checksum recorded in {COMPLETE}"
    return json.loads(raw), None  # what ppojax wrote: it lists every file of the three items


# --- listing and choosing --------------------------------------------------------------------------------


def _candidates(directory: Path) -> list[Path]:
    """Every ``step_N`` directory under ``directory``, newest step first."""
    found = [p for p in directory.glob("step_*") if _STEP_RE.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[len("step_"):]), reverse=True)


def list_checkpoints(directory) -> list[Path]:
    """The complete checkpoints under ``directory`` (not verified), oldest first."""
    return [p for p in reversed(_candidates(Path(directory))) if (p / COMPLETE).is_file() and (p / STATE_DIR).is_dir()]


def _newest_intact(directory: Path, checked: Checked) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """(the newest checkpoint that verifies or None, [(skipped newer checkpoint, reason)])."""
    skipped = []
    for path in _candidates(directory):
        ok, reason = _verify(path, True, checked)
        if ok:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def _newest_in(directory: Path, log: Log, none_ok: bool, checked: Checked) -> Optional[Path]:
    chosen, skipped = _newest_intact(directory, checked)
    for path, reason in skipped:
        log(f"skipping {path}: {reason}; " + (f"using {chosen.name}" if chosen else "no intact checkpoint is left"))
    if chosen is not None or (none_ok and not skipped):
        return chosen
    if skipped:
        raise CheckpointError(
            f"none of the {len(skipped)} checkpoint(s) under {directory} is intact (each is named above with "
            f"what is wrong): restore the missing files, or move them aside to start a fresh run.")
    raise CheckpointError(f"no checkpoint under {directory} (looked for step_<N>/{COMPLETE}).")


def latest_checkpoint(directory, *, log: Log = _warn) -> Optional[Path]:
    """The newest checkpoint under ``directory`` that verifies, or None; each newer damaged one is skipped with
    ONE line through ``log`` ("skipping <dir>/step_8: model state file ... (truncated); using step_6")."""
    try:
        return resolve_checkpoint("auto", directory, log=log)
    except CheckpointError:
        return None


def resolve_checkpoint(where: Union[str, os.PathLike, bool], checkpoint_dir=None, *,
                       log: Log = _warn) -> Optional[Path]:
    """The intact checkpoint to resume from. where: ``"auto"`` or ``True``: the newest under ``checkpoint_dir``
    (None if it holds no ``step_N``); a ``step_N`` path (it must verify); a checkpoints directory or a run's
    output_dir: its newest. Raises CheckpointError (one line per problem) for a path that does not exist, a
    damaged checkpoint, or checkpoints none of which is intact."""
    return _resolve(where, checkpoint_dir, log, {})


def _resolve(where, checkpoint_dir, log: Log, checked: Checked) -> Optional[Path]:
    if where is True or where == "auto":
        if checkpoint_dir is None:
            raise CheckpointError("resume='auto' needs the checkpoints directory to look in.")
        return _newest_in(Path(checkpoint_dir), log, True, checked)
    path = Path(where)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist; give a step_N checkpoint, a checkpoints "
                              "directory, or resume: auto.")
    if _STEP_RE.match(path.name) or (path / COMPLETE).exists():
        ok, reason = _verify(path, True, checked)
        if not ok:
            alternative, _ = _newest_intact(path.parent, checked)
            hint = f"; the newest intact checkpoint beside it is {alternative}" if alternative is not None else ""
            raise _cannot_resume(path, reason + hint)
        return path
    if not _candidates(path) and (path / "checkpoints").is_dir():  # a run's output_dir
        path = path / "checkpoints"
    return _newest_in(path, log, False, checked)


# --- save: one orbax CheckpointManager per run, ppojax's seal written before orbax's commit ----------------


class RunCheckpoints:
    """The checkpoints a run writes under ``directory``: one orbax ``CheckpointManager`` from the first save to
    :meth:`close` (the run's end, error or signal), and the run's checksum checks. Every process makes one and
    saves at the same steps. save_total_limit: keep this many (the newest steps, always the one just saved), None:
    all. log: where damaged checkpoints skipped or moved aside are reported. on_saved(step): once it is on disk."""

    def __init__(self, directory, *, save_total_limit: Optional[int] = None, log: Log = _warn,
                 on_saved: Optional[Callable[[int], None]] = None):
        if save_total_limit is not None and save_total_limit < 1:
            raise CheckpointError(f"save_total_limit={save_total_limit}: expected None or >= 1.")
        self.directory = Path(directory).absolute()  # orbax's tensorstore refuses relative paths
        self.save_total_limit, self._log, self._on_saved = save_total_limit, log, on_saved
        self._checked: Checked = {}
        self._manager = None  # orbax's CheckpointManager, from the first save to close()
        self._saving: Optional[int] = None  # the step orbax is writing, until wait() sees it on disk

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def save(self, step: int, train_state, host_state: dict, config_dict: dict, *, wait: bool = True) -> Path:
        """Save ``directory/step_<step>`` (atomically, with its manifest); returns its path. train_state: a pytree
        of jax arrays (each process writes its shards); host_state: JSON-able (:mod:`ppojax.io.host_state_json`).
        wait=False returns once the state is in host memory (the caller may donate it). Raises CheckpointError when
        the storage fails, for this save or the unfinished one before it."""
        step = operator.index(step)  # a jax or numpy integer too
        if step < 0:
            raise CheckpointError(f"step={step}: expected step >= 0.")
        # encoded first, so a host state that cannot be stored fails before anything is written
        host_payload = {"format_version": FORMAT_VERSION, "step": step, "host_state": encode_host_state(host_state)}
        config_payload = json.loads(json.dumps(config_as_dict(config_dict), default=str))
        self.wait()
        if _is_primary():
            self.directory.mkdir(parents=True, exist_ok=True)
            _tidy(self.directory, self._log, self._checked)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"ppojax.io.checkpoint:save_start_{step}")
        try:
            manager = self._open()
            manager.reload()  # the tidy (or another run) changed the directory behind orbax's back
            if step in manager.all_steps():  # the same step saved again (e.g. after a resume): replace it
                manager.delete(step)
            self._saving = step
            manager.save(step, force=True, args=ocp.args.Composite(
                train_state=ocp.args.StandardSave(train_state), host_state=ocp.args.JsonSave(host_payload),
                config=ocp.args.JsonSave(config_payload)))
        except BaseException as err:
            self._fail(step, err)
        if wait:
            self.wait()
        return self.directory / f"step_{step}"

    def _open(self):
        if self._manager is None:
            quiet_orbax()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.save_total_limit, step_prefix="step", enable_async_checkpointing=True,
                todelete_subdir=DELETING_DIR,  # rotation renames (atomic), so no crash leaves half a checkpoint
                # directories made before save() returns: no writer thread waits on a signal a failure never sends
                async_options=ocp.AsyncOptions(post_finalization_callback=self._seal_written,
                                               create_directories_asynchronously=False))
            handlers = {STATE_DIR: ocp.StandardCheckpointHandler(),
                        "host_state": ocp.JsonCheckpointHandler(filename=Path(HOST_STATE_FILE).name),
                        "config": ocp.JsonCheckpointHandler(filename=Path(CONFIG_FILE).name)}
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        return self._manager

    def _seal_written(self) -> None:  # orbax's post-finalisation callback, on its thread: written, not renamed
        if _is_primary():  # self._saving: orbax runs one save at a time, and save() waits for the last
            _seal(self.directory / f"step_{self._saving}{UNFINISHED}", self._saving)

    def wait(self) -> None:
        """Block until the save in flight is on disk (then on_saved); CheckpointError if it failed."""
        step = self._saving
        if step is None:
            return
        try:
            self._manager.wait_until_finished()
        except BaseException as err:
            self._fail(step, err)
        self._saving = None
        if _is_primary():
            shutil.rmtree(self.directory / DELETING_DIR, ignore_errors=True)
            fsync_path(self.directory)
        if self._on_saved is not None:
            self._on_saved(step)

    def close(self) -> None:
        """Wait for the save in flight (raising its failure) and close orbax's manager."""
        try:
            self.wait()
        finally:
            manager, self._manager = self._manager, None
            if manager is not None:
                manager.close()

    def _fail(self, step: int, err: BaseException) -> NoReturn:
        """Close orbax's manager, wait for the writes it abandoned, remove what the failed save wrote and raise
        one CheckpointError (``err`` itself when the storage did not fail)."""
        manager, self._manager = self._manager, None
        if manager is not None:
            try:
                manager.close()
            except Exception:  # the save's own error again
                pass
        wait_for_abandoned_writes()
        finalize_abandoned_work(err)
        self._saving = None
        if _is_primary():
            for debris in self.directory.glob(f"step_{step}.*"):
                shutil.rmtree(debris, ignore_errors=True)
        code = _errno_of(err)
        if code is None or not isinstance(err, Exception):
            raise err
        intact = next((p for p in _candidates(self.directory) if _verify(p, False, self._checked)[0]), None)
        then = f"the previous checkpoint {intact.name} is intact" if intact else "no earlier checkpoint exists"
        fix = _FIXES.get(code, "check the directory's file system")
        raise CheckpointError(f"{os.strerror(code).lower()} while writing {self.directory / f'step_{step}'}; "
                              f"{then}; {fix}.") from err

    # The readers wait for the save in flight and share the run's checks.
    def verify(self, path, *, checksums: bool = True) -> tuple[bool, str]:
        """As :func:`verify_checkpoint`; ``checksums=False`` also knows what the run's checksum checks found."""
        self.wait()
        return _verify(Path(path), checksums, self._checked)

    def resolve(self, where: Union[str, os.PathLike, bool] = "auto") -> Optional[Path]:
        """As :func:`resolve_checkpoint`, looking in ``directory`` for ``"auto"``."""
        self.wait()
        return _resolve(where, self.directory, self._log, self._checked)

    def latest(self) -> Optional[Path]:
        """As :func:`latest_checkpoint` of ``directory``."""
        self.wait()  # a failed save is reported, not taken for "no checkpoint"
        try:
            return self.resolve("auto")
        except CheckpointError:
            return None

    def restore(self, path, abstract_train_state, *, release_target: bool = False) -> tuple[Any, dict, dict]:
        """As :func:`restore_checkpoint` (a checkpoint :meth:`resolve` verified is not checksummed again)."""
        self.wait()
        return _restore(path, abstract_train_state, self._log, release_target, self._checked)


def save_checkpoint(directory, step: int, train_state, host_state: dict, config_dict: dict, *,
                    save_total_limit: Optional[int] = None, log: Log = _warn) -> Path:
    """One save, waited for, by a RunCheckpoints of its own (on every process)."""
    with RunCheckpoints(directory, save_total_limit=save_total_limit, log=log) as checkpoints:
        return checkpoints.save(step, train_state, host_state, config_dict)


def _seal(path: Path, step: int) -> None:
    """Write MANIFEST.json (checksums of the items' files, read back), fsync everything, then COMPLETE."""
    manifest = file_manifest.build_manifest(path, skip=(COMPLETE, MANIFEST_FILE, *ORBAX_FILES))
    _write_bytes(path / MANIFEST_FILE, manifest_bytes := json.dumps(manifest, indent=1).encode())
    fsync_tree(path)
    _write_bytes(path / COMPLETE, json.dumps({"step": step, "time": time.time(), "format_version": FORMAT_VERSION,
                                              "manifest_crc32": file_manifest.crc32_hex(manifest_bytes)}).encode())
    fsync_path(path)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# --- what failed saves, crashes and damage leave behind --------------------------------------------------


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


def _tidy(directory: Path, log: Log, checked: Checked) -> None:
    """Apply the module doc's rules to what crashed saves and damage left under ``directory``."""
    shutil.rmtree(directory / DELETING_DIR, ignore_errors=True)
    for path in sorted(p for p in directory.iterdir() if _OURS_RE.match(p.name)):
        is_step = _STEP_RE.match(path.name)
        ok, reason = _verify(path, False, checked) if is_step else (False, "")
        if ok:
            continue
        if not is_step or not _holds_data(path):  # an unfinished save, or nothing of value
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        else:
            log(f"moved damaged checkpoint {path} aside to {_move_aside(path)}: {reason}")


def _holds_data(path: Path) -> bool:
    """Whether ``path`` holds any file besides a checkpoint's marker and manifest (anything of value)."""
    return any(p.is_file() and p.relative_to(path).as_posix() not in (COMPLETE, MANIFEST_FILE)
               for p in path.rglob("*"))


def _move_aside(path: Path) -> Path:
    """Move a damaged checkpoint into ``damaged/`` (as ``step_N``, or ``step_N.2`` ... if taken)."""
    (path.parent / DAMAGED_DIR).mkdir(exist_ok=True)
    destination, copy = path.parent / DAMAGED_DIR / path.name, 1
    while destination.exists():
        copy += 1
        destination = destination.with_name(f"{path.name}.{copy}")
    os.replace(path, destination)
    fsync_path(path.parent)
    return destination


# --- restore ---------------------------------------------------------------------------------------------


def _flat(tree) -> dict[tuple[str, ...], Any]:
    """{path of names: leaf} of a pytree (a target of arrays, or orbax's nested dicts/lists of metadata)."""
    name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))  # noqa: E731
    return {tuple(map(name, path)): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _stored_shape_dtype(leaf: jax.ShapeDtypeStruct) -> tuple[tuple, np.dtype]:
    """What orbax stores for a target leaf: typed PRNG keys are stored as their uint32 key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return tuple(leaf.shape), np.dtype(leaf.dtype)


def _check_structure(path: Path, target: dict, stored: dict) -> None:
    name = lambda p: ".".join(p) or "<root>"  # noqa: E731
    problems = [f"  {name(p)}: in this run's state, not in the checkpoint" for p in sorted(target.keys() - stored)]
    problems += [f"  {name(p)}: in the checkpoint, not in this run's state" for p in sorted(stored.keys() - target)]
    for p in sorted(target.keys() & stored.keys()):
        want_shape, want_dtype = _stored_shape_dtype(target[p])
        have_shape, have_dtype = tuple(stored[p].shape), np.dtype(stored[p].dtype)
        if (have_shape, have_dtype) != (want_shape, want_dtype):
            problems.append(f"  {name(p)}: checkpoint {have_dtype}{list(have_shape)} -> this run "
                            f"{want_dtype}{list(want_shape)}")
    if problems:
        more = [f"  ... and {len(problems) - 40} more"] if len(problems) > 40 else []
        raise CheckpointError(
            f"The training state in {path} does not match this run's ({len(problems)} tensor(s) differ):\n"
            + "\n".join(problems[:40] + more)
            + "\nThe model, value head, dtype or optimizer settings (e.g. max_grad_norm, weight_decay) differ "
              "from the run that wrote it; use the same config, or start a fresh run.")


def read_checkpoint_config(path) -> dict:
    """The config dict a checkpoint (e.g. from :func:`resolve_checkpoint`) was written with; CheckpointError
    naming the file if it is missing or not a JSON object."""
    problem = _json_problem(Path(path), CONFIG_FILE)
    config = None if problem else json.loads((Path(path) / CONFIG_FILE).read_text())
    if not isinstance(config, dict):
        raise _cannot_resume(path, problem or f"{_describe(CONFIG_FILE)} is not a JSON object")
    return config


def restore_checkpoint(path, abstract_train_state, *, log: Log = _warn,
                       release_target: bool = False) -> tuple[Any, dict, dict]:
    """``(train_state, host_state, config_dict)`` of the checkpoint :func:`resolve_checkpoint` finds at ``path``.

    abstract_train_state: the target pytree, of arrays or ``jax.ShapeDtypeStruct``s whose ``sharding`` decides
    where each array is restored (without one: where it was saved). Call on every process. release_target:
    delete the target's arrays once the checkpoint is found to match it, before any is read, so the state is
    never held twice. Raises CheckpointError: a damaged checkpoint, an error of orbax while reading (chained),
    or every tensor whose presence, shape or dtype differs from the target.
    """
    return _restore(path, abstract_train_state, log, release_target, {})


def _restore(path, abstract_train_state, log: Log, release_target: bool, checked: Checked) -> tuple[Any, dict, dict]:
    path = _resolve(path, None, log, checked)  # verified: its JSON files parse
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                          abstract_train_state)
    quiet_orbax()
    host_state = decode_host_state(json.loads((path / HOST_STATE_FILE).read_text())["host_state"])
    config_dict = read_checkpoint_config(path)
    state_dir = path.absolute() / STATE_DIR  # orbax refuses relative paths
    handler = ocp.StandardCheckpointHandler()
    with ocp.Checkpointer(handler) as checkpointer:
        try:
            _check_structure(path, _flat(target), _flat(handler.metadata(state_dir).tree))
            if release_target:
                for leaf in jax.tree.leaves(abstract_train_state):
                    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                        leaf.delete()
            train_state = checkpointer.restore(state_dir, args=ocp.args.StandardRestore(target))
        except CheckpointError:
            raise
        except Exception as err:
            cause = " ".join(str(err).split())[:300] or type(err).__name__  # orbax's may span many lines
            message = f"cannot read the model state in {path} ({STATE_DIR}/): {cause}"
            if release_target:
                message += " (the run's own state was released to make room for it: build the run again)"
            raise CheckpointError(message) from err
    return train_state, host_state, config_dict
