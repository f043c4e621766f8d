"""Run logging: metrics.jsonl, TensorBoard scalars, samples, resume truncation, plot, stages, silence off
process 0."""
from __future__ import annotations

import json
import os
import re
import stat
import threading

import numpy as np
import pytest

from ppojax.io import run_logging
from ppojax.io.run_dir import RunDirError
from ppojax.io.run_logging import RunLogger, format_postfix, read_jsonl, read_tensorboard_scalars
from ppojax.io.strict_json import write_text_atomic


def metrics_at(step: int) -> dict:
    return {"objective/kl": 0.1 * step, "objective/scores": np.float32(step) / 4,
            "objective/entropy": np.array(2.5 + step), "lr": 3e-6, "episode": 16 * step}


def run(logger: RunLogger, steps):
    for step in steps:
        logger.log_metrics(step, metrics_at(step))
        if step % 2 == 0:
            logger.log_samples(step, [f"prompt {step}", "a | pipe"], [f"completion {step}", "x"], [step, -1.5])


def test_metrics_jsonl_tensorboard_and_samples(tmp_path, capsys):
    with RunLogger(tmp_path, {"learning_rate": 3e-6}, enabled=True) as logger:
        run(logger, [1, 2, 3])
        logger.log_metrics(4, {"objective/kl": float("nan"), "objective/scores": 1.0})
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[1] == {"step": 2, "objective/kl": 0.2, "objective/scores": 0.5, "objective/entropy": 4.5,
                       "lr": 3e-6, "episode": 32.0}
    assert rows[3]["objective/kl"] is None  # non-finite -> null: the file stays strict JSON
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[3])

    scalars = read_tensorboard_scalars(tmp_path / "tensorboard")
    assert {"objective/kl", "objective/scores", "objective/entropy", "lr", "episode"} <= set(scalars)
    assert [s for s, _ in scalars["objective/kl"]] == [1, 2, 3]  # the NaN is not sent to TensorBoard
    assert scalars["objective/scores"][-1] == (4, 1.0)
    events = b"".join(p.read_bytes() for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert b"samples" in events and b"completion 2" in events and b"config" in events

    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert samples[0] == {"step": 2, "prompt": "prompt 2", "completion": "completion 2", "score": 2.0}
    assert len(samples) == 2
    console = capsys.readouterr().out
    assert "samples at update 2" in console and "| completion 2" in console and "-1.5000" in console


def test_resume_truncation_reproduces_an_uninterrupted_run(tmp_path):
    with RunLogger(tmp_path / "straight", enabled=True) as logger:
        run(logger, range(1, 7))
    crashed = tmp_path / "crashed"
    with RunLogger(crashed, enabled=True) as logger:
        run(logger, range(1, 6))  # the checkpoint is at step 3; steps 4, 5 are lost with the crash ...
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "objective/k')  # ... and the kill tore the last line
    with RunLogger(crashed, enabled=True, resume_step=3) as logger:
        assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [1, 2, 3]
        run(logger, range(4, 7))
    for name in ("metrics.jsonl", "samples.jsonl"):
        assert (crashed / name).read_bytes() == (tmp_path / "straight" / name).read_bytes(), name
    # a fresh logger in the same directory refuses instead of truncating the run's logs (it used to start
    # them empty: the data loss of issue 17), and leaves every byte as it was
    before = {name: (crashed / name).read_bytes() for name in ("metrics.jsonl", "samples.jsonl")}
    with pytest.raises(RunDirError, match="already holds the logs of a run.*resume=auto.*overwrite_output_dir"):
        RunLogger(crashed, enabled=True)
    assert {name: (crashed / name).read_bytes() for name in before} == before


def test_plot_writes_a_real_png(tmp_path):
    with RunLogger(tmp_path, enabled=True, report_to="none") as logger:
        for step in range(1, 21):
            logger.log_metrics(step, {"objective/scores": np.sin(step / 3), "objective/kl": step ** 0.5})
        path = logger.plot(tmp_path / "curves.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from matplotlib.image import imread

    image = imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 500
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20  # lines, text: not a blank canvas
    assert not (tmp_path / "tensorboard").exists()  # report_to="none": JSONL only


def test_non_main_process_writes_and_prints_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    logger = RunLogger(out, {"a": 1}, enabled=False)
    run(logger, range(1, 5))
    logger.stage("compiling rollout…")
    with logger.stage("fetching…"):
        pass
    bar = logger.progress(10, initial=2)
    bar.set_postfix(format_postfix(metrics_at(3), 12.5))
    bar.update(1)
    bar.close()
    assert logger.plot() is None
    logger.close()
    assert not out.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_stage_messages_and_progress(tmp_path, capsys):
    logger = RunLogger(tmp_path, enabled=True, report_to="none")
    logger.stage("fetching SmolLM2…")
    with logger.stage("compiling rollout…"):
        pass
    with pytest.raises(RuntimeError):
        with run_logging.stage("loading reward model…", enabled=True):
            raise RuntimeError("boom")
    out = capsys.readouterr().out.splitlines()
    pattern = r"^\[ppojax \d\d:\d\d:\d\d \+\d+\.\ds\] "
    assert re.match(pattern + "fetching SmolLM2…$", out[0])
    assert re.match(pattern + "compiling rollout…$", out[1])
    assert re.match(pattern + r"compiling rollout done \(\d+\.\d s\)$", out[2])
    assert re.match(pattern + r"loading reward model failed \(\d+\.\d s\)$", out[4])
    assert format_postfix(metrics_at(2), 31.25) == {"score": "0.500", "kl": "0.200", "eps": "31.2"}
    bar = logger.progress(5, initial=1)
    assert (bar.n, bar.total) == (1, 5)
    bar.close()
    logger.close()


# ---------------------------------------------------------------------------------------------------------
# every sink holds every step exactly once after kill/resume sequences (subprocesses that are SIGKILLed)

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from ppojax.io.tensorboard_sink import read_tensorboard_texts, samples_markdown  # noqa: E402
from tests.tiny_setup import run_environment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ATTEMPT = """
import json, os, signal, sys, time
from ppojax.io.run_logging import RunLogger
a = json.loads(sys.argv[1])
logger = RunLogger(a["out"], {"learning_rate": 3e-6, "run_name": "kill-test"}, enabled=True,
                   report_to=a["report_to"], resume_step=a["resume_step"], run_id="killtest")
if a["resume_step"] is None:
    logger.log_samples(0, ["before"], ["untrained completion"], [0.25])
for step in range(a["first"], a["last"] + 1):
    logger.log_metrics(step, {"objective/kl": 0.1 * step + 1000 * a["attempt"], "objective/scores": step / 4,
                              "attempt": a["attempt"], "lr": float("nan") if step == 3 else 1e-5})
    if step % 2 == 0:
        logger.log_samples(step, [f"prompt {step}"], [f"completion {step} of attempt {a['attempt']}"], [step + 0.5])
    if step in a["checkpoints"]:
        logger.checkpoint_saved(step)
if a["kill"]:
    time.sleep(a.get("pause_before_kill", 0))
    os.kill(os.getpid(), signal.SIGKILL)
logger.close()
"""
# (resume_step, first, last, checkpoints, killed): three attempts, two of them SIGKILLed past their checkpoint
SEQUENCE = [(None, 1, 7, [4], True), (4, 5, 9, [8], True), (8, 9, 10, [10], False)]


def expected_metrics() -> dict[int, dict]:
    """The metrics.jsonl rows that must survive: each step from the last attempt that logged it before a
    checkpoint covering it (attempt 1: steps 1-4, attempt 2: 5-8, attempt 3: 9-10)."""
    rows = {}
    for attempt, (_, first, last, checkpoints, killed) in enumerate(SEQUENCE, start=1):
        keep_through = max(checkpoints) if killed else last
        for step in range(first, keep_through + 1):
            rows[step] = {"step": step, "objective/kl": 0.1 * step + 1000 * attempt, "objective/scores": step / 4,
                          "attempt": float(attempt), "lr": None if step == 3 else 1e-5}
    return rows


def run_attempts(out: Path, report_to, env: dict, pause_before_kill: float = 0.0) -> None:
    for attempt, (resume_step, first, last, checkpoints, kill) in enumerate(SEQUENCE, start=1):
        args = {"out": str(out), "report_to": report_to, "resume_step": resume_step, "first": first, "last": last,
                "checkpoints": checkpoints, "kill": kill, "attempt": attempt, "pause_before_kill": pause_before_kill}
        result = subprocess.run([sys.executable, "-c", ATTEMPT, json.dumps(args)], capture_output=True, text=True,
                                env={**run_environment(), **env}, timeout=120)
        assert result.returncode == (-signal.SIGKILL if kill else 0), result.stdout + result.stderr


def test_tensorboard_equals_metrics_jsonl_after_kills_and_resumes(tmp_path):
    out = tmp_path / "run"
    run_attempts(out, ["tensorboard"], {})
    expected = expected_metrics()
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows == [expected[s] for s in sorted(expected)]  # the source of truth itself

    scalars = read_tensorboard_scalars(out / "tensorboard")
    for tag in ("objective/kl", "objective/scores", "attempt", "lr"):
        from_jsonl = [(r["step"], float(np.float32(r[tag]))) for r in rows if r[tag] is not None]
        assert scalars[tag] == from_jsonl, tag  # step by step: none missing, none twice, purged steps gone
    assert set(scalars) == {"objective/kl", "objective/scores", "attempt", "lr"}

    samples = read_jsonl(out / "samples.jsonl")
    assert [s["step"] for s in samples] == [0, 2, 4, 6, 8, 10]
    assert samples[3]["completion"] == "completion 6 of attempt 2"  # attempt 1's step 6 was purged
    texts = read_tensorboard_texts(out / "tensorboard")
    assert texts["samples"] == [(s["step"], samples_markdown([s])) for s in samples]
    assert [step for step, _ in texts["config"]] == [0] and "learning_rate" in texts["config"][0][1]

    event_files = list((out / "tensorboard").iterdir())
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0  # rebuilt: one file, no empty ones
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "samples.jsonl", "tensorboard"]  # no .tmp


def test_tensorboard_is_on_disk_at_every_step(tmp_path):
    """A kill right after log_metrics loses nothing TensorBoard was given (the old writer lost its queue)."""
    args = {"out": str(tmp_path), "report_to": "tensorboard", "resume_step": None, "first": 1, "last": 5,
            "checkpoints": [], "kill": True, "attempt": 1}
    result = subprocess.run([sys.executable, "-c", ATTEMPT, json.dumps(args)], capture_output=True, text=True,
                            env=run_environment(), timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert [s for s, _ in read_tensorboard_scalars(tmp_path / "tensorboard")["objective/kl"]] == [1, 2, 3, 4, 5]
    assert [s for s, _ in read_tensorboard_texts(tmp_path / "tensorboard")["samples"]] == [0, 2, 4]


@pytest.mark.parametrize("flush", ["default", "fast"])
def test_wandb_offline_holds_every_step_once_after_kills_and_resumes(tmp_path, flush):
    """default: wandb-core flushes its log every 15 s, so the killed attempts leave nothing on disk and the
    resumes backfill everything from metrics.jsonl. fast: it flushes every millisecond and the killed attempts
    pause before dying, so they leave some steps on disk, which the resumes must not log again."""
    pytest.importorskip("wandb")
    from ppojax.io.wandb_sink import read_wandb_config, read_wandb_history

    out, wandb_dir = tmp_path / "run", tmp_path / "wandb-dir"
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    if flush == "fast":
        env["WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"] = "0.001"
    run_attempts(out, ["tensorboard", "wandb"], env, pause_before_kill=1.0 if flush == "fast" else 0.0)
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows == [expected_metrics()[s] for s in sorted(expected_metrics())]

    history = read_wandb_history(wandb_dir, "killtest")
    attempts = sorted({row["_attempt"] for row in history})
    assert len(attempts) == (3 if flush == "fast" else 1)  # where the steps that reached the disk came from
    metric_rows = [row for row in history if "objective/kl" in row]
    assert [row["_step"] for row in metric_rows] == [r["step"] for r in rows]  # each step once, in order
    for row, jsonl in zip(metric_rows, rows):
        logged = {k: v for k, v in row.items() if not k.startswith("_") and k != "samples"}
        assert logged == {k: v for k, v in jsonl.items() if k != "step" and v is not None}, jsonl["step"]

    samples = read_jsonl(out / "samples.jsonl")
    table_rows = [row for row in history if "samples" in row]
    assert [row["_step"] for row in table_rows] == [s["step"] for s in samples]
    for row, sample in zip(table_rows, samples):
        table = json.loads((Path(row["_attempt"]) / "files" / row["samples"]["path"]).read_text())
        assert table["columns"] == ["prompt", "completion", "score"]
        assert table["data"] == [[sample["prompt"], sample["completion"], sample["score"]]]
    configs = read_wandb_config(wandb_dir, "killtest")  # one per attempt ({} where a kill lost it)
    assert len(configs) == 3 and configs[-1] == {"learning_rate": 3e-6, "run_name": "kill-test"}
    assert all(config in ({}, configs[-1]) for config in configs)


def test_wandb_steps_past_the_resume_checkpoint_are_kept_once(tmp_path, monkeypatch):
    """A resume from an older checkpoint than wandb has seen (the newest was unusable): wandb cannot take the
    later steps back, so they are not logged a second time, and the user is told."""
    pytest.importorskip("wandb")
    from ppojax.io.wandb_sink import read_wandb_history

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "w"), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    with RunLogger(out, {"a": 1}, enabled=True, report_to="wandb", run_id="older") as logger:
        for step in range(1, 7):
            logger.log_metrics(step, {"objective/kl": float(step)})
        logger.checkpoint_saved(6)
    notes = []
    with RunLogger(out, {"a": 1}, enabled=True, report_to="wandb", run_id="older", resume_step=4,
                   say=notes.append) as logger:
        for step in range(5, 9):
            logger.log_metrics(step, {"objective/kl": 10.0 + step})
        logger.checkpoint_saved(8)
    assert len(notes) == 1 and "already holds steps 5..6" in notes[0]
    history = [(row["_step"], row["objective/kl"]) for row in read_wandb_history(tmp_path / "w", "older")]
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.0), (7, 17.0), (8, 18.0)]


def test_wandb_waits_for_a_checkpoint(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from ppojax.io.wandb_sink import read_wandb_history

    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "w"), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(name, value)
    with RunLogger(tmp_path / "run", None, enabled=True, report_to="wandb", run_id="waits") as logger:
        for step in range(1, 6):
            logger.log_metrics(step, {"x": float(step)})
            if step == 3:
                logger.checkpoint_saved(3)
    # closed without a checkpoint after step 3: steps 4, 5 were never handed to wandb (a resume logs them)
    assert [row["_step"] for row in read_wandb_history(tmp_path / "w", "waits")] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------------------
# report_to, strict JSON, console, plot


def test_report_to_values(tmp_path, monkeypatch):
    from ppojax.trainer.config import ConfigError
    from ppojax.io.run_logging import normalise_report_to

    assert normalise_report_to("tensorboard") == ("tensorboard",)
    assert normalise_report_to(["TensorBoard", "wandb", "wandb"]) == ("tensorboard", "wandb")
    assert normalise_report_to("tensorboard, wandb") == ("tensorboard", "wandb")
    assert normalise_report_to("none") == normalise_report_to(None) == normalise_report_to([]) == ()
    with pytest.raises(ConfigError, match="'mlflow' is not a log sink.*'tensorboard', 'wandb'"):
        RunLogger(tmp_path / "a", enabled=True, report_to=["tensorboard", "mlflow"])
    with pytest.raises(ConfigError, match="'none' is not a log sink"):
        normalise_report_to(["none", "wandb"])
    assert not (tmp_path / "a").exists()  # refused before anything was written
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ConfigError, match=r"wandb is not installed: pip install 'ppojax\[wandb\]'"):
        RunLogger(tmp_path / "b", enabled=True, report_to="wandb")
    assert not (tmp_path / "b").exists()


def test_summary_and_logs_are_strict_json(tmp_path):
    from ppojax.io.strict_json import to_strict, write_json

    def strict(text):
        def refuse(constant):
            raise ValueError(f"non-standard JSON constant {constant}")
        return json.loads(text, parse_constant=refuse)

    with RunLogger(tmp_path, enabled=True, report_to="none") as logger:
        logger.log_samples(1, ["p"], ["c"], [float("nan")])
        path = logger.write_summary({"final_kl": float("nan"), "score": np.float32(0.5), "inf": float("-inf"),
                                     "steps": np.int64(3), "curve": np.array([1.0, np.inf]), "plot": tmp_path / "x.png",
                                     "nested": {"a": [float("nan"), 1]}})
    summary = strict(path.read_text())
    assert summary == {"final_kl": None, "score": 0.5, "inf": None, "steps": 3, "curve": [1.0, None],
                       "plot": str(tmp_path / "x.png"), "nested": {"a": [None, 1]}}
    assert strict((tmp_path / "samples.jsonl").read_text())["score"] is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(TypeError, match=r"\$\.reward: a function"):
        write_json(tmp_path / "bad.json", {"reward": lambda: 0})
    assert not (tmp_path / "bad.json").exists()
    assert to_strict({"f": print}, default=str) == {"f": str(print)}


def test_files_written_whole_by_concurrent_writers_are_one_writer_s_text(tmp_path):
    """Two threads replacing one file many times: every write lands whole (one writer's text, never a mix or a
    missing temporary file), nothing temporary is left, and the file has the umask's permissions like any other."""
    path = tmp_path / "report.json"
    texts = {name: name * 20_000 + "\n" for name in ("a", "b")}
    failures = []

    def write(name):
        try:
            for _ in range(100):
                write_text_atomic(path, texts[name])
        except Exception as err:  # noqa: BLE001 - collected for the assertion below
            failures.append(err)

    threads = [threading.Thread(target=write, args=(name,)) for name in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert path.read_text() in texts.values()
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_non_tty_prints_one_line_per_update(tmp_path, capsys):
    logger = RunLogger(tmp_path, enabled=True, report_to="none")
    bar = logger.progress(3, initial=0)  # pytest's captured stdout is not a terminal
    for step in range(1, 4):
        bar.update(1)
        bar.set_postfix(format_postfix(metrics_at(step), 10.0 + step))
    bar.close()
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert "\r" not in out.out + out.err and len(lines) == 3
    for step, line in enumerate(lines, start=1):
        assert re.fullmatch(rf"\[ppojax \d\d:\d\d:\d\d \+\d+\.\ds\] update {step}/3: score {step / 4:.3f}, "
                            rf"kl {0.1 * step:.3f}, eps {10.0 + step:.1f}", line), line


def test_a_terminal_keeps_the_progress_bar(tmp_path):
    """Under a pseudo-terminal the same code draws tqdm's bar (carriage-return redraws)."""
    import pty

    code = ("from ppojax.io.run_logging import RunLogger\n"
            f"bar = RunLogger({str(tmp_path)!r}, enabled=True, report_to='none').progress(3)\n"
            "for _ in range(3):\n    bar.update(1); bar.set_postfix(score='0.5')\nbar.close()\n")
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=follower, stderr=follower,
                            env=run_environment())
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=60)
    os.close(leader)
    text = b"".join(chunks).decode()
    assert "\r" in text and "3/3" in text and "update 3/3:" not in text


def test_plot_labels_ticks_rolling_means_and_the_held_out_curve(tmp_path):
    from ppojax.io.run_logging import curves_figure, rolling_mean

    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 3) == [1.0, 2.0, 3.0, 5.0]  # trailing, fewer at the start
    scores = [0.0, 0.4, -0.2, 0.5, 0.1, 0.7, 0.3, 0.9, 0.2, 1.0, 0.6, 1.1, 0.8, 1.3]
    rows = [{"step": s, "objective/scores": scores[s - 1], "objective/kl": 0.3 * s} for s in range(1, 15)]
    held_out = [(0, -0.02), (5, 0.21), (10, 0.38), (14, 0.47)]
    fig = curves_figure(rows, held_out=held_out)
    score_ax, kl_ax = fig.axes
    assert score_ax.get_ylabel() == "mean score (training batch)"
    assert kl_ax.get_ylabel() == "KL to the initial model (nats)"
    assert score_ax.get_xlabel() == kl_ax.get_xlabel() == "update"
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    legend = [t.get_text() for t in score_ax.get_legend().get_texts()]
    assert legend == ["training batch", "training batch, mean of the last 3", "held-out mean: -0.02 -> 0.47"]
    raw, trend, curve = score_ax.get_lines()
    np.testing.assert_allclose(raw.get_ydata(), scores)
    np.testing.assert_allclose(trend.get_ydata(), [np.mean(scores[max(0, i - 2):i + 1]) for i in range(14)])
    assert list(zip(curve.get_xdata(), curve.get_ydata())) == held_out  # before, during and after training
    assert [t.get_text() for t in kl_ax.get_legend().get_texts()] == ["training batch",
                                                                      "training batch, mean of the last 3"]
    with RunLogger(tmp_path, enabled=True, report_to="none") as logger:
        for row in rows:
            logger.log_metrics(row["step"], row)
        path = logger.plot(held_out=held_out)
    assert path == tmp_path / "training_curves.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_shows_the_adaptive_kl_coefficient_only_when_it_moves():
    from ppojax.io.run_logging import curves_figure

    rows = [{"step": s, "objective/scores": 0.1 * s, "objective/kl": 0.3 * s, "objective/kl_coef": 0.05}
            for s in range(1, 8)]
    assert len(curves_figure(rows).axes) == 2  # a fixed coefficient: no extra axis
    rows = [{**r, "objective/kl_coef": 0.05 * 1.1 ** r["step"]} for r in rows]
    fig = curves_figure(rows)
    score_ax, kl_ax, coef_ax = fig.axes
    assert coef_ax.get_ylabel() == "KL coefficient (adaptive controller)"
    np.testing.assert_allclose(coef_ax.get_lines()[0].get_ydata(), [r["objective/kl_coef"] for r in rows])
    assert [t.get_text() for t in kl_ax.get_legend().get_texts()] == [
        "training batch", "training batch, mean of the last 3", "KL coefficient (adaptive)"]
    fig.canvas.draw()
    ticks = [t for t in kl_ax.get_xticks() if kl_ax.get_xlim()[0] <= t <= kl_ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_the_whole_flow_and_a_rerun_of_a_finished_run(tmp_path, capsys):
    """claim -> RunLogger -> checkpoints -> summary/plot -> mark_finished, as the CLI wires it; the same
    command again finds the run finished and leaves every byte of every file as it was."""
    import hashlib

    from ppojax.io.run_dir import claim_output_dir

    def train(config) -> str:
        claim = claim_output_dir(tmp_path / "run", config, resume=config["resume"])
        try:
            if claim.outcome == "finished":
                return claim.results_message()
            with RunLogger(claim.output_dir, config, enabled=True, report_to="tensorboard", run_id=claim.run_id,
                           resume_step=None if claim.outcome == "fresh" else 0) as logger:
                for step in range(1, 5):
                    logger.log_metrics(step, metrics_at(step))
                    if step % 2 == 0:
                        logger.checkpoint_saved(step)
                logger.log_samples(4, ["p"], ["c"], [0.5])
                logger.plot(held_out=[(0, 0.1), (4, 0.4)])
                logger.write_summary({"final_kl": float("nan"), "held_out_after": 0.4})
            claim.mark_finished()
            return "trained"
        finally:
            claim.release()

    config = {"learning_rate": 3e-6, "resume": "auto", "output_dir": str(tmp_path / "run")}
    assert train(config) == "trained"
    files = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert {p.name for p in files} >= {"run.json", "metrics.jsonl", "samples.jsonl", "summary.json",
                                      "training_curves.png"}
    message = train(config)
    assert "nothing to do" in message and str(tmp_path / "run" / "summary.json") in message
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (tmp_path / "run").rglob("*") if p.is_file()} == files
