"""A run owns its output_dir (ppojax/io/run_dir.py): every outcome of the claim on real files, the lock against
real processes (SIGKILLed holders, racing claimers, a holder on another host), and byte-identical outputs
where nothing may change."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ppojax.io.run_dir import LOCK_FILE, RunDirError, claim_output_dir, read_identity

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"model_name_or_path": "tiny", "learning_rate": 1e-5, "seed": 0, "output_dir": "x", "resume": None}


def snapshot(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every file (and every directory, as 'dir') under ``directory``."""
    out = {}
    for path in sorted(directory.rglob("*")):
        rel = str(path.relative_to(directory))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def finished_run(tmp_path: Path, config=CONFIG) -> Path:
    """A directory holding a finished run with outputs, made through the claim as a real run would."""
    out = tmp_path / "run"
    with claim_output_dir(out, config) as claim:
        assert claim.outcome == "fresh"
        (out / "metrics.jsonl").write_text('{"step": 1, "objective/kl": 0.5}\n')
        (out / "summary.json").write_text('{"final_kl": 0.5}\n')
        (out / "checkpoints" / "step_1").mkdir(parents=True)
        (out / "checkpoints" / "step_1" / "config.json").write_text(json.dumps(config))
        claim.mark_finished()
    return out


def tunable_checker(saved: dict, now: dict) -> list[str]:
    """A stand-in for the config module's checker: seed must match, learning_rate may change."""
    if saved.get("seed") != now.get("seed"):
        raise ValueError(f"seed: {saved.get('seed')} -> {now.get('seed')} must match")
    return [f"learning_rate: {saved['learning_rate']} -> {now['learning_rate']}"] \
        if saved.get("learning_rate") != now.get("learning_rate") else []


# ---------------------------------------------------------------------------------------------------------
# outcomes


def test_fresh_claim_into_missing_and_empty_directories(tmp_path):
    out = tmp_path / "a" / "b"
    claim = claim_output_dir(out, CONFIG)
    assert claim.outcome == "fresh" and claim.output_dir == out.absolute()
    assert (out / LOCK_FILE).is_file()
    lock = json.loads((out / LOCK_FILE).read_text())
    assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname()
    identity = read_identity(out)
    assert identity["status"] == "running" and identity["config"] == CONFIG and identity["run_id"] == claim.run_id
    claim.release()
    claim.release()  # idempotent
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]  # the lock is gone, nothing else was made

    empty = tmp_path / "empty"
    empty.mkdir()
    with claim_output_dir(empty, CONFIG, resume="auto") as claim:  # auto with nothing to resume: fresh
        assert claim.outcome == "fresh"


def test_fresh_run_into_another_run_is_refused_and_changes_nothing(tmp_path):
    out = finished_run(tmp_path)
    before = snapshot(out)
    with pytest.raises(RunDirError) as err:
        claim_output_dir(out, CONFIG)
    message = str(err.value)
    assert str(out) in message and "finished" in message
    assert "resume=auto" in message and "output_dir=<another directory>" in message
    assert "overwrite_output_dir=true" in message and "nothing is deleted" in message
    assert snapshot(out) == before  # nothing truncated, no lock left behind


def test_overwrite_moves_the_old_run_aside(tmp_path):
    out = finished_run(tmp_path)
    before = snapshot(out)
    notes = []
    with claim_output_dir(out, {**CONFIG, "learning_rate": 3e-5}, overwrite=True, resume="auto",
                          say=notes.append) as claim:
        assert claim.outcome == "fresh"
        moved = claim.moved_to
        assert moved.parent == out.parent.absolute() and moved.name.startswith("run.replaced-")
        assert snapshot(moved) == before  # the old run, intact, lock gone
        assert sorted(p.name for p in out.iterdir()) == ["run.json", LOCK_FILE]
        assert read_identity(out)["config"]["learning_rate"] == 3e-5
    assert len(notes) == 1 and str(moved) in notes[0]
    with pytest.raises(RunDirError, match="contradict"):
        claim_output_dir(out, CONFIG, overwrite=True, resume=str(moved / "checkpoints"))


def test_finished_run_with_the_same_config_is_left_byte_identical(tmp_path):
    out = finished_run(tmp_path)
    before = snapshot(out)
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    claim = claim_output_dir(out, {**CONFIG, "resume": "auto", "output_dir": "elsewhere"}, resume="auto",
                             compatible=tunable_checker)
    assert claim.outcome == "finished"
    message = claim.results_message()
    assert str(out / "summary.json") in message and "nothing to do" in message
    claim.release()
    assert snapshot(out) == before
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == mtimes


def test_resume_same_config_appends_an_attempt(tmp_path):
    out = tmp_path / "run"
    with claim_output_dir(out, CONFIG):
        (out / "metrics.jsonl").write_text("")  # a run that crashed after it began: status stays "running"
    with claim_output_dir(out, CONFIG, resume=True, compatible=tunable_checker) as claim:
        assert claim.outcome == "resume" and claim.changes == [] and not claim.was_finished
        identity = read_identity(out)
        assert identity["status"] == "running" and len(identity["attempts"]) == 2
        assert identity["attempts"][1]["resume"] == "auto"
        claim.mark_finished()
    assert read_identity(out)["status"] == "finished"


def test_resume_with_changed_settings_needs_consent(tmp_path):
    out = finished_run(tmp_path)
    before = snapshot(out)
    changed = {**CONFIG, "learning_rate": 2e-5}
    with pytest.raises(RunDirError) as err:
        claim_output_dir(out, changed, resume="auto", compatible=tunable_checker)
    message = str(err.value)
    assert "learning_rate: 1e-05 -> 2e-05" in message and "resume_with_changes=true" in message
    assert "overwrite_output_dir=true" in message and "output_dir=<another directory>" in message
    assert snapshot(out) == before
    # a field that must match: the checker's own error, and still nothing changed
    with pytest.raises(ValueError, match="seed"):
        claim_output_dir(out, {**CONFIG, "seed": 1}, resume="auto", compatible=tunable_checker)
    assert snapshot(out) == before
    # with consent: resumed, the changes recorded, the finished run reopened
    notes = []
    with claim_output_dir(out, changed, resume="auto", resume_with_changes=True, compatible=tunable_checker,
                          say=notes.append) as claim:
        assert claim.outcome == "resume" and claim.was_finished
        assert claim.changes == ["learning_rate: 1e-05 -> 2e-05"]
    identity = read_identity(out)
    assert identity["status"] == "running" and identity["config"]["learning_rate"] == 2e-5
    assert identity["attempts"][-1]["changed"] == ["learning_rate: 1e-05 -> 2e-05"]
    assert "learning_rate" in notes[0]
    # without a checker, every differing field counts
    with pytest.raises(RunDirError, match="seed: 0 -> 5"):
        claim_output_dir(out, {**changed, "seed": 5}, resume="auto")


def test_run_without_identity_file(tmp_path):
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints" / "step_2").mkdir(parents=True)
    (legacy / "checkpoints" / "step_2" / "config.json").write_text(json.dumps(CONFIG))
    (legacy / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="resume=auto"):
        claim_output_dir(legacy, CONFIG)
    notes = []
    with claim_output_dir(legacy, CONFIG, resume="auto", compatible=tunable_checker, say=notes.append) as claim:
        assert claim.outcome == "resume" and read_identity(legacy)["adopted"] is True
    assert "older ppojax" in notes[0]

    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a ppojax run.*notes.txt"):
        claim_output_dir(stranger, CONFIG, resume="auto")
    assert (stranger / "notes.txt").read_text() == "mine" and not (stranger / LOCK_FILE).exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "run.json").write_text("{not json")
    with pytest.raises(RunDirError, match="not valid JSON"):
        claim_output_dir(broken, CONFIG, resume="auto")


def test_unusable_output_dirs(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        claim_output_dir(a_file, CONFIG)
    with pytest.raises(RunDirError, match="cannot be created: .*file is a file"):
        claim_output_dir(a_file / "sub", CONFIG)
    with pytest.raises(RunDirError, match="no such checkpoint"):
        claim_output_dir(tmp_path / "new", CONFIG, resume=str(tmp_path / "missing" / "step_3"))
    assert not (tmp_path / "new").exists()


def test_unwritable_output_dir(tmp_path, monkeypatch):
    """A read-only parent directory. Root ignores permission bits, so there the read-only file system that
    root would meet (EROFS from mkdir) is simulated."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    if os.geteuid() != 0:
        os.chmod(readonly, 0o555)
        with pytest.raises(RunDirError, match=f"not writable .*{readonly}"):
            claim_output_dir(readonly / "out", CONFIG)
        os.chmod(readonly, 0o755)
    else:
        import errno

        def read_only_mkdir(path, *args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        monkeypatch.setattr(os, "mkdir", read_only_mkdir)
        with pytest.raises(RunDirError) as err:
            claim_output_dir(readonly / "out", CONFIG)
        monkeypatch.undo()
        assert "Read-only file system" in str(err.value) and str(readonly / "out") in str(err.value)
        assert "pick a directory you can write to" in str(err.value)
    assert list(readonly.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------
# the lock against real processes

HOLDER = textwrap.dedent("""
    import sys, time
    from ppojax.io.run_dir import claim_output_dir, RunDirError
    out, hold, start_at = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    while time.time() < start_at:
        pass
    try:
        claim = claim_output_dir(out, {"lr": 1}, resume=None)
    except RunDirError as e:
        print("REFUSED", e, flush=True)
        sys.exit(3)
    (claim.output_dir / "metrics.jsonl").write_text('{"step": 1}\\n')  # the run has begun writing
    print("CLAIMED", claim.outcome, flush=True)
    time.sleep(hold)
    claim.release()
""")


def start_holder(out: Path, hold: float, start_at: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(hold), str(start_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def wait_for_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, proc.stdout.read()
    return line


def test_live_lock_refuses_and_stale_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    holder = start_holder(out, hold=120)
    try:
        assert wait_for_line(holder).startswith("CLAIMED fresh")
        with pytest.raises(RunDirError) as err:
            claim_output_dir(out, {"lr": 1}, resume="auto")
        message = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message and "in use" in message
        assert read_identity(out)["status"] == "running"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (out / LOCK_FILE).exists()  # the killed holder left its lock behind
    before = snapshot(out)
    notes = []
    with pytest.raises(RunDirError, match="already holds run"):  # a fresh run: refused after the takeover
        claim_output_dir(out, {"lr": 1}, say=notes.append)
    assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "no longer running" in notes[0]
    assert snapshot(out) == {k: v for k, v in before.items() if k != LOCK_FILE}  # stale lock gone, rest intact
    with claim_output_dir(out, {"lr": 1}, resume="auto", say=notes.append) as claim:
        assert claim.outcome == "resume"
    assert len(notes) == 1  # no stale lock the second time


def test_two_processes_claiming_one_directory_exactly_one_wins(tmp_path):
    out = tmp_path / "contested"
    start_at = time.time() + 3.0  # both start importing now, then claim at the same instant
    procs = [start_holder(out, hold=2.0, start_at=start_at) for _ in range(2)]
    outputs = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=60)
        outputs.append((proc.returncode, stdout))
    claimed = [o for rc, o in outputs if rc == 0]
    refused = [o for rc, o in outputs if rc == 3]
    assert len(claimed) == 1 and len(refused) == 1, outputs
    assert claimed[0].startswith("CLAIMED fresh")
    assert "in use by another ppojax run" in refused[0] or "already holds run" in refused[0]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json"]


def test_a_run_that_wrote_nothing_is_not_kept(tmp_path):
    """A claim whose run stopped before writing any output (e.g. wandb could not log in) leaves only run.json:
    a fresh run may take the directory without a choice to make."""
    out = tmp_path / "run"
    first = claim_output_dir(out, CONFIG)
    first.release()
    with claim_output_dir(out, CONFIG) as second:
        assert second.outcome == "fresh" and second.run_id != first.run_id


def test_lock_from_another_host_is_never_taken_over(tmp_path):
    out = finished_run(tmp_path)
    (out / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "other-node", "started": 0.0}))
    with pytest.raises(RunDirError) as err:
        claim_output_dir(out, CONFIG, resume="auto")
    message = str(err.value)
    assert "pid 999999 on host other-node" in message and f"delete {out / LOCK_FILE}" in message
    assert (out / LOCK_FILE).exists()
