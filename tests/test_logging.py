"""Run logging: metrics.jsonl, TensorBoard scalars, samples, resume truncation, plot, stages, silence off
process 0."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ppojax import run_logging
from ppojax.run_logging import RunLogger, format_postfix, read_jsonl, read_tensorboard_scalars


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
    # a fresh run in the same directory starts empty files
    with RunLogger(crashed, enabled=True) as logger:
        run(logger, [1])
    assert [r["step"] for r in read_jsonl(crashed / "metrics.jsonl")] == [1]
    assert read_jsonl(crashed / "samples.jsonl") == []


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
