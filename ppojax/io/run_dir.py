"""A run owns its output directory: one claim decides, before anything is written, whether this process may
use ``output_dir``, and holds it for the run's life.

Two files in ``output_dir`` carry the ownership:

    run.json   what the directory holds: {"run_id", "status": "running" | "finished", "created", "config",
               "attempts": [{"started", "host", "pid", "resume", "changed"}, ...]}; written atomically
    run.lock   present only while a process holds the directory: {"pid", "host", "started", "token"};
               removed on release, so it is never part of a run's outputs

:func:`claim_output_dir` takes the lock, reads ``run.json`` and returns a :class:`RunClaim` whose ``outcome``
says what the caller does next:

    "fresh"     the directory was missing or empty: a new run (run.json written, status running)
    "resume"    the directory holds this run (same configuration, or changes the caller allowed): continue it
    "finished"  the directory holds this run, finished, with the same configuration: print where the results
                are and exit 0. NOTHING in the directory was modified (the lock file comes and goes).

Every other case is refused with a :class:`RunDirError` (a ``ConfigError``: the CLI prints it, exit 2) that
names the choices: a fresh run into a directory holding another run; a resume whose configuration differs
in fields that may change (unless ``resume_with_changes``); a directory in use by a live process.
``overwrite_output_dir=True`` moves an existing run aside to ``<output_dir>.replaced-<UTC time>`` (never
deletes) and starts fresh. Nothing in the directory is truncated or created before the claim succeeds.

The lock. ``run.lock`` is created atomically by ``link(2)`` of a fully written temporary file (the classic
NFS-safe exclusive create: the name appears with its content or not at all; ``O_CREAT|O_EXCL`` is only the
fallback for file systems without hard links), and the holder keeps an ``fcntl.flock`` on it for the run's
life. The flock answers "is the holder alive" on this host without trusting pids (they are reused), and it
serialises the takeover of a stale lock (the taker holds the flock of the inode it removes, and checks the
name still points at it). ``flock`` alone is not enough: over NFS it is either emulated with byte-range locks
(needs a lock manager) or, on ``nolock`` mounts, local to one client, so a lock from another host is never
taken over automatically: the message names the host and pid and says which file to delete if that process
is gone.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from ppojax.errors import RunDirError
from ppojax.io.durable import fsync_path
from ppojax.io.strict_json import dumps, write_json

__all__ = ["RunDirError", "RunClaim", "DirectoryLock", "claim_output_dir", "read_identity", "IDENTITY_FILE",
           "LOCK_FILE", "CONTROL_FIELDS"]

IDENTITY_FILE = "run.json"
LOCK_FILE = "run.lock"
FORMAT = "ppojax-run/1"
CONTROL_FIELDS = frozenset({"resume", "overwrite_output_dir", "resume_with_changes", "output_dir"})
"""Config fields that say how to claim the directory, not what the run is: ignored when comparing configs."""

Compatible = Callable[[dict, dict], Iterable[str]]


def _utc(seconds: Optional[float] = None, compact: bool = False) -> str:
    fmt = "%Y%m%dT%H%M%SZ" if compact else "%Y-%m-%dT%H:%M:%SZ"
    return time.strftime(fmt, time.gmtime(time.time() if seconds is None else seconds))


def _normalise(config: Any) -> dict:
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict or have to_dict(); got {type(config).__name__}")
    return json.loads(dumps(config, default=str))


def _without_control(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in CONTROL_FIELDS}


# ----------------------------------------------------------------------------------------------------------
# the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _try_flock(fd: int) -> Optional[bool]:
    """True: we hold the flock now; False: someone else holds it; None: the file system has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            return None
        raise


def _read_lock_info(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 65536).decode("utf-8"))
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _describe_holder(info: dict) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{_utc(info['started']) if isinstance(info.get('started'), (int, float)) else '?'}")


class DirectoryLock:
    """``run.lock`` inside a directory, held (file + flock) until :meth:`release`. See the module doc."""

    def __init__(self, path: Path, fd: int, info: dict):
        self.path, self._fd, self.info = path, fd, info

    @classmethod
    def acquire(cls, directory, say: Callable[[str], None] = print, name: str = LOCK_FILE) -> "DirectoryLock":
        """Take the lock of ``directory`` (which must exist). Raises RunDirError if a live process holds it;
        takes over (with a one-line message through ``say``) a lock whose holder on this host has died."""
        directory = Path(directory)
        path = directory / name
        host = socket.gethostname()
        for _ in range(50):
            info = {"pid": os.getpid(), "host": host, "started": time.time(), "token": secrets.token_hex(8)}
            fd = _create_exclusive(path, info)
            if fd is not None:
                return cls(path, fd, info)
            # the name exists: is its holder alive?
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # released meanwhile: try again
            try:
                holder = _read_lock_info(fd)
                flocked = _try_flock(fd)
                if flocked is False:
                    time.sleep(0.02)  # a takeover may be under way: look again before calling it live
                    if _same_inode(path, fd):
                        raise RunDirError(
                            f"output_dir {directory} is in use by another ppojax run ({_describe_holder(holder)}; "
                            f"lock file {path}). Wait for that run to end or stop it, or use another output_dir.")
                    continue
                if holder.get("host") != host:
                    raise RunDirError(
                        f"output_dir {directory} is locked by a ppojax run on another machine "
                        f"({_describe_holder(holder)}; lock file {path}); ppojax cannot tell from here whether it "
                        f"is still running. If it is not, delete {path}; otherwise use another output_dir.")
                pid = holder.get("pid")
                if flocked is None and isinstance(pid, int) and _pid_alive(pid):
                    raise RunDirError(
                        f"output_dir {directory} is in use by another ppojax run ({_describe_holder(holder)}; "
                        f"lock file {path}). Wait for that run to end or stop it, or use another output_dir.")
                if not _same_inode(path, fd):
                    continue  # replaced while we looked: decide again
                # stale: its holder is gone (no flock on it). We hold its flock, so no one else takes it over.
                os.unlink(path)
                fsync_path(directory)
                say(f"ppojax: took over the lock of a run that is no longer running ({_describe_holder(holder)}): "
                    f"{path}")
            finally:
                os.close(fd)
        raise RunDirError(f"could not take the lock {path}: it keeps changing hands; is another process "
                          "starting runs into the same output_dir in a loop?")

    @property
    def held(self) -> bool:
        return self._fd is not None

    def moved_to(self, path: Path) -> None:
        """The directory holding the lock was renamed: the lock file is now ``path``."""
        self.path = Path(path)

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the flock. Idempotent."""
        if self._fd is None:
            return
        try:
            if _same_inode(self.path, self._fd):
                os.unlink(self.path)
                fsync_path(self.path.parent)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _same_inode(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _create_exclusive(path: Path, info: dict) -> Optional[int]:
    """Create ``path`` holding ``info`` atomically, flocked; returns its fd, or None if it already exists."""
    data = json.dumps(info).encode()
    tmp = path.with_name(f".{path.name}.{info['pid']}.{info['token']}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        _try_flock(fd)  # before the name appears, so no one can ever see it unlocked
        try:
            os.link(tmp, path)
        except FileExistsError:
            if os.fstat(fd).st_nlink != 2:  # (NFS: a retried link may report EEXIST although it worked)
                os.close(fd)
                fd = None
                return None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            os.close(fd)  # no hard links here: exclusive create, then write (a tiny unwritten window)
            fd = None
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            _try_flock(fd)
            os.write(fd, data)
            os.fsync(fd)
        fsync_path(path.parent)
        return fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------------------
# the identity file


def read_identity(output_dir) -> Optional[dict]:
    """``run.json`` of ``output_dir`` (None if absent). Raises RunDirError if it is not a ppojax run file."""
    path = Path(output_dir) / IDENTITY_FILE
    if not path.is_file():
        return None
    try:
        identity = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise RunDirError(f"{path} is not valid JSON ({e}); it should be ppojax's record of the run in "
                          f"{path.parent}. Restore it, or move the directory aside with "
                          "overwrite_output_dir=true.") from None
    if not isinstance(identity, dict) or "run_id" not in identity or "config" not in identity:
        raise RunDirError(f"{path} is not a ppojax run file (no run_id/config). Restore it, or move the "
                          "directory aside with overwrite_output_dir=true.")
    return identity


def _contents(directory: Path) -> list[str]:
    """The entries of ``directory`` that belong to a run (everything but the lock and temporary files)."""
    names = []
    for entry in directory.iterdir():
        if entry.name == LOCK_FILE or (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        names.append(entry.name + ("/" if entry.is_dir() else ""))
    return sorted(names)


def _describe_run(identity: Optional[dict], contents: list[str]) -> str:
    shown = ", ".join(contents[:6]) + (", …" if len(contents) > 6 else "")
    if identity is None:
        return f"files that are not a ppojax run of this version ({shown})"
    return (f"run {identity.get('run_id')}, {identity.get('status', '?')}, created "
            f"{identity.get('created', '?')} ({shown})")


def _checkpoint_config(directory: Path) -> Optional[dict]:
    """The config.json of the newest checkpoints/step_N (runs written before run.json existed)."""
    best = None
    for path in (directory / "checkpoints").glob("step_*/config.json"):
        try:
            step = int(path.parent.name[len("step_"):])
        except ValueError:
            continue
        if best is None or step > best[0]:
            best = (step, path)
    if best is None:
        return None
    try:
        config = json.loads(best[1].read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# ----------------------------------------------------------------------------------------------------------
# the claim


@dataclass
class RunClaim:
    """The outcome of :func:`claim_output_dir`; holds the directory's lock until :meth:`release`.

    outcome: "fresh" | "resume" | "finished" (module doc). changes: the tunable fields that differ from the
    saved run ("name: old -> new"), resumed under ``resume_with_changes``. moved_to: where
    ``overwrite_output_dir`` moved the old run. was_finished: a resume of a run that had finished (its
    configuration changed, e.g. more total_episodes).
    """

    output_dir: Path
    outcome: str
    identity: dict
    lock: DirectoryLock
    changes: list = field(default_factory=list)
    moved_to: Optional[Path] = None
    was_finished: bool = False

    @property
    def run_id(self) -> str:
        return self.identity["run_id"]

    @property
    def identity_path(self) -> Path:
        return self.output_dir / IDENTITY_FILE

    def mark_finished(self) -> None:
        """Record in run.json that the run completed (call after the last output is written)."""
        if self.outcome == "finished":
            return
        self._require_lock()
        self.identity = {**self.identity, "status": "finished", "finished": _utc()}
        write_json(self.identity_path, self.identity)

    def update_config(self, config: Any) -> None:
        """Record a configuration the run settled on after the claim (e.g. derived fields)."""
        self._require_lock()
        self.identity = {**self.identity, "config": _normalise(config)}
        write_json(self.identity_path, self.identity)

    def results_message(self) -> str:
        """What to print for a 'finished' claim: where the results are and how to train again."""
        present = [name for name in ("summary.json", "training_curves.png", "policy/", "metrics.jsonl",
                                     "checkpoints/") if (self.output_dir / name.rstrip("/")).exists()]
        return (f"ppojax: {self.output_dir} already holds this run, finished {self.identity.get('finished', '')} "
                f"(run {self.run_id}); nothing to do. Results: "
                + ", ".join(str(self.output_dir / p) for p in present)
                + ". To train again: overwrite_output_dir=true (moves this run aside) or another output_dir.")

    def release(self) -> None:
        """Give the directory up (removes run.lock). Idempotent."""
        self.lock.release()

    def _require_lock(self) -> None:
        if not self.lock.held:
            raise RuntimeError(f"the claim on {self.output_dir} was released; claim it again to write.")

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _choices(out: Path) -> str:
    return (f"Choose one: continue it with resume=auto; start the new run elsewhere with output_dir=<another "
            f"directory>; or start over here with overwrite_output_dir=true, which moves the old run to "
            f"{out}.replaced-<UTC time> (nothing is deleted).")


def _new_identity(config: dict, attempt: dict) -> dict:
    created = _utc()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    return {"format": FORMAT, "run_id": run_id, "status": "running", "created": created, "config": config,
            "attempts": [attempt]}


def _attempt(resume, changes: list) -> dict:
    return {"started": _utc(), "host": socket.gethostname(), "pid": os.getpid(),
            "resume": None if resume is None else str(resume), "changed": list(changes)}


def _usable_directory(out: Path) -> None:
    """Refuse before touching anything: output_dir is a file, or under a file, or not writable."""
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output_dir {out} is a file, not a directory; pick another output_dir.")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise RunDirError(f"output_dir {out} cannot be created: {existing} is a file; pick another output_dir.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir {out} is not writable ({existing}: permission denied); pick a "
                          "directory you can write to.")


def _move_aside(out: Path) -> Path:
    stamp = _utc(compact=True)
    target = out.with_name(f"{out.name}.replaced-{stamp}")
    n = 2
    while target.exists():
        target = out.with_name(f"{out.name}.replaced-{stamp}-{n}")
        n += 1
    os.rename(out, target)
    fsync_path(out.parent)
    return target


def claim_output_dir(output_dir, config: Any, *, resume: Union[None, bool, str, Path] = None,
                     overwrite: bool = False, resume_with_changes: bool = False,
                     compatible: Optional[Compatible] = None,
                     say: Callable[[str], None] = print) -> RunClaim:
    """Claim ``output_dir`` for a run with ``config`` (a dict or PPOConfig); see the module doc.

    resume: None (a fresh run), 'auto' (or True: continue the run in output_dir, fresh if there is none), or a
    checkpoint path (which must exist). overwrite: the ``overwrite_output_dir`` field. compatible:
    ``compatible(saved_config, config) -> changed fields``: raises on fields that must match (the config
    module's checker); any returned change is refused unless ``resume_with_changes``. Without it every
    differing field (other than CONTROL_FIELDS) counts as a change. say: where one-line notes go (a stale
    lock taken over, a run moved aside, a resume with changes).
    """
    out = Path(output_dir).expanduser().absolute()
    if resume is True or (isinstance(resume, str) and resume.lower() in ("auto", "true")):
        resume = "auto"
    elif resume is False or resume == "":
        resume = None
    if resume is not None and resume != "auto":
        if not Path(resume).exists():
            raise RunDirError(f"resume={str(resume)!r}: no such checkpoint. Pass an existing step_N directory, "
                              "resume=auto (the latest checkpoint in output_dir), or leave resume unset.")
        if overwrite:
            raise RunDirError(f"resume={str(resume)!r} and overwrite_output_dir=true contradict each other: "
                              "overwrite starts a new run. Drop one of them.")
    now = _normalise(config)
    _usable_directory(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = DirectoryLock.acquire(out, say)
    except OSError as e:
        raise RunDirError(f"output_dir {out} cannot be used: {e.strerror or e} ({e.filename or out}); pick a "
                          "directory you can write to.") from None
    try:
        return _decide(out, now, lock, resume, overwrite, resume_with_changes, compatible, say)
    except OSError as e:
        lock.release()
        raise RunDirError(f"output_dir {out} cannot be used: {e.strerror or e} ({e.filename or out}); pick a "
                          "directory you can write to.") from None
    except BaseException:
        lock.release()
        raise


def _decide(out: Path, now: dict, lock: DirectoryLock, resume, overwrite: bool, resume_with_changes: bool,
            compatible: Optional[Compatible], say) -> RunClaim:
    contents = _contents(out)
    if contents == [IDENTITY_FILE] and (read_identity(out) or {}).get("status") == "running":
        contents = []  # a run that stopped before writing anything (e.g. a bad login): nothing to keep
    if not contents:
        identity = _new_identity(now, _attempt(resume, []))
        write_json(out / IDENTITY_FILE, identity)
        return RunClaim(out, "fresh", identity, lock)

    if overwrite:
        moved_to = _move_aside(out)
        lock.moved_to(moved_to / LOCK_FILE)
        lock.release()
        say(f"ppojax: overwrite_output_dir: moved the run that was in {out} to {moved_to}")
        out.mkdir(parents=True, exist_ok=True)
        new_lock = DirectoryLock.acquire(out, say)
        try:
            if _contents(out):
                raise RunDirError(f"output_dir {out} was claimed by another process while the old run was being "
                                  f"moved to {moved_to}; use another output_dir.")
            identity = _new_identity(now, _attempt(resume, []))
            write_json(out / IDENTITY_FILE, identity)
        except BaseException:
            new_lock.release()
            raise
        return RunClaim(out, "fresh", identity, new_lock, moved_to=moved_to)

    identity = read_identity(out)
    if resume is None:
        raise RunDirError(f"output_dir {out} already holds {_describe_run(identity, contents)}. {_choices(out)}")

    if identity is None:  # a run written before run.json existed: adopt it if it has checkpoints
        saved = _checkpoint_config(out)
        if saved is None:
            raise RunDirError(f"output_dir {out} holds {_describe_run(None, contents)} and no checkpoint to resume "
                              f"from. Start the new run elsewhere with output_dir=<another directory>, or move "
                              f"these files aside with overwrite_output_dir=true (nothing is deleted).")
        changes = _changes(saved, now, compatible)
        _refuse_unapproved(out, changes, resume_with_changes)
        identity = _new_identity(now, _attempt(resume, changes))
        identity["adopted"] = True
        write_json(out / IDENTITY_FILE, identity)
        say(f"ppojax: {out} has no {IDENTITY_FILE} (written by an older ppojax); resuming it as run "
            f"{identity['run_id']}")
        return RunClaim(out, "resume", identity, lock, changes=changes)

    saved = identity.get("config") or {}
    finished = identity.get("status") == "finished"
    if finished and _without_control(saved) == _without_control(now):
        return RunClaim(out, "finished", identity, lock)  # nothing written: outputs stay byte-identical
    changes = _changes(saved, now, compatible)
    _refuse_unapproved(out, changes, resume_with_changes)
    if changes:
        say(f"ppojax: resuming run {identity['run_id']} in {out} with changed settings: {'; '.join(changes)}")
    identity = {**identity, "status": "running", "config": now,
                "attempts": list(identity.get("attempts", [])) + [_attempt(resume, changes)]}
    identity.pop("finished", None)
    write_json(out / IDENTITY_FILE, identity)
    return RunClaim(out, "resume", identity, lock, changes=changes, was_finished=finished)


def _changes(saved: dict, now: dict, compatible: Optional[Compatible]) -> list:
    if compatible is not None:
        return [str(c) for c in (compatible(saved, now) or [])]
    a, b = _without_control(saved), _without_control(now)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, _MISSING) != b.get(k, _MISSING)]


_MISSING = object()


def _refuse_unapproved(out: Path, changes: list, resume_with_changes: bool) -> None:
    if changes and not resume_with_changes:
        raise RunDirError(
            f"output_dir {out} holds a run with a different configuration ({len(changes)} field(s); saved -> "
            f"now: {'; '.join(changes)}). resume=auto does not continue an old run under new settings "
            f"silently. Choose one: continue it with these changes with resume_with_changes=true; use the saved "
            f"values ({out / IDENTITY_FILE}); start the new run elsewhere with output_dir=<another directory>; "
            f"or start over here with overwrite_output_dir=true (moves the old run aside; nothing is deleted).")
