"""What a run tells its user: TensorBoard scalars, a JSONL file per update, sample tables, a progress bar,
timestamped stage messages and a plot. (Named ``run_logging`` so it can never shadow the standard library's
``logging``, e.g. when a script inside the package directory is run directly.)

Files under ``output_dir`` (process 0 only; every other process logs nothing and writes nothing):

    metrics.jsonl       one line per update: {"step": 12, "objective/kl": ..., ...}; non-finite values as null
    samples.jsonl       one line per sample: {"step": 12, "prompt": ..., "completion": ..., "score": ...}
    tensorboard/        tensorboardX event files: the metrics as scalars under their TRL names, samples as text

Resume: ``RunLogger(..., resume_step=N)`` first drops every line with step > N from both JSONL files (and
tells TensorBoard to hide events after N), so a resumed run's files equal an uninterrupted run's. A fresh
run (``resume_step=None``) starts both files empty.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["RunLogger", "stage", "read_jsonl", "read_tensorboard_scalars", "format_postfix"]

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_KEYS = ("objective/scores", "objective/kl")

_T0 = time.time()


def _main_process() -> bool:
    try:
        import jax

        return jax.process_index() == 0
    except Exception:  # pragma: no cover - no jax backend
        return True


def _write_console(text: str, file=None) -> None:
    """Print without breaking an active tqdm bar."""
    from tqdm import tqdm

    tqdm.write(text, file=file or sys.stdout)
    (file or sys.stdout).flush()


class _Stage:
    """Printed on creation; as a context manager it also prints '... done (x.x s)' when the block ends."""

    def __init__(self, message: str, enabled: bool):
        self.message, self.enabled, self.start = message, enabled, time.time()
        self._say(message)

    def _say(self, text: str) -> None:
        if self.enabled:
            clock = time.strftime("%H:%M:%S")
            _write_console(f"[ppojax {clock} +{time.time() - _T0:.1f}s] {text}")

    def __enter__(self) -> "_Stage":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        elapsed = time.time() - self.start
        self._say(f"{self.message.rstrip('.… ')} {'failed' if exc_type else 'done'} ({elapsed:.1f} s)")


def stage(message: str, *, enabled: Optional[bool] = None) -> _Stage:
    """Print a timestamped stage message ("fetching SmolLM2…", "compiling rollout…"), on process 0 only.

    ``with stage("compiling the update…"):`` also prints when (and how long after) the stage ends.
    """
    return _Stage(message, _main_process() if enabled is None else enabled)


def _to_float(value) -> Optional[float]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, Optional[float]]:
    out = {}
    for name, value in metrics.items():
        if hasattr(value, "shape") and getattr(value, "shape", ()) not in ((), None):
            if int(getattr(value, "size", 1)) != 1:
                raise ValueError(f"metric {name!r} has shape {value.shape}; log scalars only.")
        out[str(name)] = _to_float(value)
    return out


def read_jsonl(path) -> list[dict]:
    """The complete JSON lines of a file ([] if it does not exist); a torn last line (crash) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _truncate_jsonl(path: Path, keep_through_step: float) -> int:
    """Keep the lines with step <= keep_through_step (rewritten atomically); returns how many were dropped."""
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] <= keep_through_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _shorten(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_postfix(metrics: Mapping[str, Any], episodes_per_second: Optional[float] = None) -> dict[str, str]:
    """The progress bar's postfix: mean score, KL and episodes/s."""
    post = {}
    for label, key in (("score", "objective/scores"), ("kl", "objective/kl")):
        value = _to_float(metrics.get(key))
        if value is not None:
            post[label] = f"{value:.3f}"
    eps = episodes_per_second if episodes_per_second is not None else _to_float(metrics.get("eps"))
    if eps is not None:
        post["eps"] = f"{eps:.1f}"
    return post


class RunLogger:
    """Metrics to TensorBoard + ``metrics.jsonl``, samples to console + TensorBoard + ``samples.jsonl``.

    output_dir: the run's directory; config: a PPOConfig or dict (logged once as TensorBoard text);
    enabled: default True on process 0 only; report_to: "tensorboard" or "none" (the JSONL files are always
    written); resume_step: the update count of the checkpoint a resumed run starts from (see module doc).
    """

    def __init__(self, output_dir, config: Any = None, *, enabled: Optional[bool] = None,
                 report_to: Optional[str] = "tensorboard", resume_step: Optional[int] = None):
        self.enabled = _main_process() if enabled is None else bool(enabled)
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.samples_path = self.output_dir / SAMPLES_FILE
        self.tensorboard_dir = self.output_dir / TENSORBOARD_DIR
        self.report_to = (report_to or "none").lower()
        if self.report_to not in ("tensorboard", "none"):
            raise ValueError(f"report_to={report_to!r}: expected 'tensorboard' or 'none'.")
        self._writer = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        keep = -math.inf if resume_step is None else int(resume_step)  # fresh run: start empty
        for path in (self.metrics_path, self.samples_path):
            _truncate_jsonl(path, keep)
        if self.report_to == "tensorboard":
            from tensorboardX import SummaryWriter

            had_events = self.tensorboard_dir.is_dir() and any(self.tensorboard_dir.iterdir())
            # purge_step hides events >= it that an interrupted (or earlier) run left in the same directory
            purge = (0 if resume_step is None else int(resume_step) + 1) if had_events else None
            self._writer = SummaryWriter(logdir=str(self.tensorboard_dir), purge_step=purge, flush_secs=10)
            if config is not None and resume_step is None:
                self._writer.add_text("config", _config_markdown(config), 0)

    # ---- metrics ----
    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One update's scalars (TRL names, e.g. ``objective/kl``): TensorBoard + one line of metrics.jsonl."""
        if not self.enabled:
            return
        values = _clean_metrics(metrics)
        if self._writer is not None:
            for name, value in values.items():
                if value is not None:
                    self._writer.add_scalar(name, value, int(step))
        _append_line(self.metrics_path, {"step": int(step), **values})

    # ---- samples ----
    def log_samples(self, step: int, prompts: Sequence[str], completions: Sequence[str],
                    scores: Optional[Iterable[Any]] = None, *, width: int = 60) -> None:
        """A table of sample completions: console, TensorBoard text ``samples``, and samples.jsonl."""
        if not self.enabled:
            return
        prompts, completions = list(prompts), list(completions)
        scores = [None] * len(prompts) if scores is None else [_to_float(s) for s in scores]
        if not len(prompts) == len(completions) == len(scores):
            raise ValueError(f"log_samples: {len(prompts)} prompts, {len(completions)} completions and "
                             f"{len(scores)} scores; expected the same number of each.")
        rows = [(_shorten(p, width), _shorten(c, width), "" if s is None else f"{s:.4f}")
                for p, c, s in zip(prompts, completions, scores)]
        _write_console(_text_table(f"samples at update {step}", ("prompt", "completion", "score"), rows))
        if self._writer is not None:
            md = ["| prompt | completion | score |", "|---|---|---|"]
            md += ["| " + " | ".join(_md_cell(x) for x in (p, c, "" if s is None else f"{s:.4f}")) + " |"
                   for p, c, s in zip(prompts, completions, scores)]
            self._writer.add_text("samples", "\n".join(md), int(step))
        with open(self.samples_path, "a") as f:
            for p, c, s in zip(prompts, completions, scores):
                f.write(json.dumps({"step": int(step), "prompt": p, "completion": c, "score": s}) + "\n")
            f.flush()

    # ---- console ----
    def stage(self, message: str) -> _Stage:
        """Timestamped stage message (see :func:`stage`); silent on other processes."""
        return _Stage(message, self.enabled)

    def progress(self, total_updates: int, initial: int = 0):
        """A tqdm bar over updates (disabled off process 0); set its postfix with :func:`format_postfix`."""
        from tqdm.auto import tqdm

        return tqdm(total=total_updates, initial=initial, unit="update", desc="ppo", dynamic_ncols=True,
                    disable=not self.enabled)

    # ---- plot ----
    def plot(self, path=None, keys: Sequence[str] = PLOT_KEYS) -> Optional[Path]:
        """A PNG of ``objective/scores`` and ``objective/kl`` over updates, from metrics.jsonl."""
        if not self.enabled:
            return None
        path = Path(path) if path is not None else self.output_dir / "training_curves.png"
        return plot_metrics(self.metrics_path, path, keys)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _append_line(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()


def _md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _text_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([title, line, fmt(header), line, *(fmt(r) for r in rows), line])


def _config_markdown(config: Any) -> str:
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        return f"`{config!r}`"
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {k} | {_md_cell(repr(v))} |" for k, v in config.items()]
    return "\n".join(lines)


def plot_metrics(metrics_path, png_path, keys: Sequence[str] = PLOT_KEYS) -> Path:
    """Plot ``keys`` of a metrics.jsonl over its steps into ``png_path`` (matplotlib, no display needed)."""
    try:
        from matplotlib.figure import Figure  # the object API draws with Agg; no pyplot, no global backend
    except ImportError as e:  # pragma: no cover
        raise ImportError("plotting needs matplotlib: pip install 'ppojax[demo]' (or matplotlib)") from e
    rows = read_jsonl(metrics_path)
    fig = Figure(figsize=(5.0 * len(keys), 3.6), dpi=100)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, key in zip(axes, keys):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="." if len(points) < 50 else None, linewidth=1.4)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(key)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png")
    return png_path


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under ``logdir`` (no TensorBoard needed;
    TFRecord framing read directly, protos from tensorboardX). Purged steps are not filtered out."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            start = offset + 12
            if start + length + 4 > len(data):
                break  # torn record at the end of a crashed run's file
            event = event_pb2.Event.FromString(data[start:start + length])
            offset = start + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return scalars
