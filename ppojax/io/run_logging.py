"""What a run tells its user: a JSONL file per update, TensorBoard and wandb, sample tables, a progress bar
(or one line per update when stdout is not a terminal), timestamped stage messages and a plot. (Named
``run_logging`` so it can never shadow the standard library's ``logging``.)

Files under ``output_dir`` (process 0 only; every other process logs nothing and writes nothing):

    metrics.jsonl       one line per update: {"step": 12, "objective/kl": ..., ...}; non-finite values as null.
                        THE SOURCE OF TRUTH: every other sink is rebuilt or backfilled from it.
    samples.jsonl       one line per sample: {"step": 12, "prompt": ..., "completion": ..., "score": ...}
    tensorboard/        the metrics as scalars under their TRL names, samples and the config as text
                        (ppojax/io/tensorboard_sink.py)
    wandb/              wandb's own files, when report_to includes 'wandb' and $WANDB_DIR is unset
                        (ppojax/io/wandb_sink.py)

Every sink holds every step exactly once after any kill/resume sequence:
- the JSONL files are appended and flushed per call; ``RunLogger(..., resume_step=N)`` first drops their
  lines with step > N (and a torn last line), rewriting them atomically;
- TensorBoard is written synchronously and flushed at every step; on resume its event files are rebuilt from
  the two JSONL files (steps <= N), so steps after N are physically gone and none is missing;
- wandb receives a step only once a checkpoint covers it (:meth:`RunLogger.checkpoint_saved`) and a resume
  backfills what it lacks (wandb_sink.py says why).
A fresh logger (``resume_step=None``) never truncates: it refuses a directory that already holds logs (claim
the directory first, ``ppojax.io.run_dir.claim_output_dir``).
"""
from __future__ import annotations

import json
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import jax
from tqdm import tqdm
from tqdm.auto import tqdm as auto_tqdm

from ppojax.errors import ConfigError, RunDirError
from ppojax.io.run_dir import read_identity
from ppojax.io.strict_json import dumps, to_strict, write_json, write_text_atomic
from ppojax.io.tensorboard_sink import (TensorBoardSink, read_tensorboard_scalars, read_tensorboard_texts,
                                        samples_markdown)
from ppojax.io.wandb_sink import WandbSink, import_wandb

__all__ = ["RunLogger", "stage", "read_jsonl", "read_tensorboard_scalars", "read_tensorboard_texts",
           "format_postfix", "normalise_report_to", "plot_metrics", "curves_figure", "LineProgress",
           "REPORT_TO_CHOICES"]

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
TENSORBOARD_DIR = "tensorboard"
SUMMARY_FILE = "summary.json"
PLOT_KEYS = ("objective/scores", "objective/kl")
REPORT_TO_CHOICES = ("tensorboard", "wandb")
AXIS_LABELS = {
    "objective/scores": "mean score (training batch)",
    "objective/kl": "KL to the initial model (nats)",
    "objective/rlhf_reward": "score - KL penalty",
    "objective/entropy": "entropy (nats)",
    "objective/kl_coef": "KL coefficient (adaptive controller)",
}

_T0 = time.time()


def _main_process() -> bool:
    try:
        return jax.process_index() == 0
    except Exception:  # pragma: no cover - no jax backend
        return True


def _prefix() -> str:
    return f"[ppojax {time.strftime('%H:%M:%S')} +{time.time() - _T0:.1f}s]"


def _write_console(text: str, file=None) -> None:
    """Print without breaking an active tqdm bar."""
    tqdm.write(text, file=file or sys.stdout)
    (file or sys.stdout).flush()


class _Stage:
    """Printed on creation; as a context manager it also prints '... done (x.x s)' when the block ends."""

    def __init__(self, message: str, enabled: bool):
        self.message, self.enabled, self.start = message, enabled, time.time()
        self._say(message)

    def _say(self, text: str) -> None:
        if self.enabled:
            _write_console(f"{_prefix()} {text}")

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


def normalise_report_to(report_to: Union[None, str, Sequence[str]]) -> tuple[str, ...]:
    """``report_to`` as a tuple of sink names: 'tensorboard', 'wandb', a list of them, or a comma-separated
    string; None, 'none' or [] mean the JSONL files only. Raises ConfigError naming an unknown value."""
    if report_to is None:
        return ()
    items = report_to.split(",") if isinstance(report_to, str) else report_to
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"report_to={report_to!r}: expected 'tensorboard', 'wandb', a list of them, or 'none'.")
    names = []
    for item in items:
        name = str(item).strip().lower()
        if name and name not in names:
            names.append(name)
    if names == ["none"] or not names:
        return ()
    unknown = [n for n in names if n not in REPORT_TO_CHOICES]
    if unknown:
        raise ConfigError(f"report_to={report_to!r}: {', '.join(map(repr, unknown))} is not a log sink; expected "
                          f"'tensorboard', 'wandb', a list of them (e.g. [tensorboard, wandb]), or 'none' (only "
                          f"metrics.jsonl and samples.jsonl).")
    return tuple(names)


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
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _truncate_jsonl(path: Path, keep_through_step: int) -> list[dict]:
    """Keep the rows with step <= keep_through_step (rewritten atomically, torn lines dropped); returns them."""
    if not path.exists():
        return []
    kept = [row for row in read_jsonl(path)
            if isinstance(row.get("step"), (int, float)) and row["step"] <= keep_through_step]
    write_text_atomic(path, "".join(dumps(row) + "\n" for row in kept))
    return kept


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


class LineProgress:
    """tqdm's ``update`` / ``set_postfix`` / ``close`` as one printed line per update, for a stdout that is not
    a terminal (a log file, CI): ``[ppojax 12:00:03 +41.2s] update 3/30: score 0.123, kl 0.450, eps 1.6``.

    The line of an update is printed at its ``set_postfix`` (or at the next ``update``/``close`` if none)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, file=None):
        self.total, self.n, self.enabled, self.file = total, initial, enabled, file
        self.postfix: dict[str, str] = {}
        self._pending = False

    def update(self, n: int = 1) -> None:
        self._emit()
        self.n += n
        self._pending = True

    def set_postfix(self, ordered_dict: Optional[Mapping] = None, refresh: bool = True, **kwargs) -> None:
        self.postfix = {str(k): str(v) for k, v in {**(ordered_dict or {}), **kwargs}.items()}
        self._emit()

    def _emit(self) -> None:
        if not self._pending:
            return
        self._pending = False
        if self.enabled:
            values = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
            _write_console(f"{_prefix()} update {self.n}/{self.total}" + (f": {values}" if values else ""),
                           self.file)

    def close(self) -> None:
        self._emit()

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunLogger:
    """Metrics to ``metrics.jsonl`` + the ``report_to`` sinks; samples to the console, ``samples.jsonl`` and the
    sinks (see the module doc).

    output_dir: the run's directory (claimed: ``ppojax.io.run_dir.claim_output_dir``). config: a PPOConfig or dict
    (TensorBoard text, wandb config). enabled: default True on process 0 only. report_to: see
    :func:`normalise_report_to`. resume_step: the update count of the checkpoint a resumed run starts from
    (0 when a resumed run found no checkpoint); None: a fresh run, whose directory must hold no logs yet.
    run_id: the wandb run id (``RunClaim.run_id``; default: output_dir's run.json, else a new id).
    """

    def __init__(self, output_dir, config: Any = None, *, enabled: Optional[bool] = None,
                 report_to: Union[None, str, Sequence[str]] = "tensorboard", resume_step: Optional[int] = None,
                 run_id: Optional[str] = None, run_name: Optional[str] = None, say=print):
        self.report_to = normalise_report_to(report_to)
        self.enabled = _main_process() if enabled is None else bool(enabled)
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / METRICS_FILE
        self.samples_path = self.output_dir / SAMPLES_FILE
        self.tensorboard_dir = self.output_dir / TENSORBOARD_DIR
        self._tensorboard: Optional[TensorBoardSink] = None
        self._wandb = None
        if not self.enabled:
            return
        if "wandb" in self.report_to:
            import_wandb()  # a missing package is an error before anything is written
        self.output_dir.mkdir(parents=True, exist_ok=True)
        config_dict = _config_dict(config)
        if resume_step is None:
            self._refuse_existing_logs()
            metric_rows, sample_rows = [], []
        else:
            metric_rows = _truncate_jsonl(self.metrics_path, int(resume_step))
            sample_rows = _truncate_jsonl(self.samples_path, int(resume_step))
        if "wandb" in self.report_to:  # first: a wandb that cannot start leaves no other sink's files behind
            if run_name is None and isinstance(config_dict, dict):
                run_name = config_dict.get("run_name")
            self._wandb = WandbSink(run_id=run_id or _run_id_of(self.output_dir), output_dir=self.output_dir,
                                    config=config_dict, run_name=run_name, resume_step=resume_step,
                                    metric_rows=metric_rows, sample_rows=sample_rows, say=say)
        if "tensorboard" in self.report_to:
            markdown = None if config is None else _config_markdown(config_dict)
            try:
                if resume_step is None:
                    self._tensorboard = TensorBoardSink(self.tensorboard_dir)
                    if markdown is not None:
                        self._tensorboard.add_text("config", markdown, 0)
                else:
                    self._tensorboard = TensorBoardSink.rebuild(self.tensorboard_dir, metric_rows, sample_rows,
                                                                markdown)
            except BaseException:
                self.close(exit_code=1)
                raise

    def _refuse_existing_logs(self) -> None:
        found = [p.name for p in (self.metrics_path, self.samples_path) if p.is_file() and p.stat().st_size]
        if self.tensorboard_dir.is_dir() and any(self.tensorboard_dir.iterdir()):
            found.append(TENSORBOARD_DIR + "/")
        if found:
            raise RunDirError(
                f"{self.output_dir} already holds the logs of a run ({', '.join(found)}); a new run never truncates "
                f"them. Continue that run (resume=auto; RunLogger(resume_step=<checkpoint step>)), use another "
                f"output_dir, or move it aside with overwrite_output_dir=true (ppojax.io.run_dir.claim_output_dir).")

    # ---- metrics ----
    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """One update's scalars (TRL names, e.g. ``objective/kl``): metrics.jsonl, TensorBoard, wandb."""
        if not self.enabled:
            return
        values = _clean_metrics(metrics)
        _append_lines(self.metrics_path, [{"step": int(step), **values}])
        if self._tensorboard is not None:
            self._tensorboard.add_scalars(int(step), values)
        if self._wandb is not None:
            self._wandb.log_metrics(int(step), values)

    # ---- samples ----
    def log_samples(self, step: int, prompts: Sequence[str], completions: Sequence[str],
                    scores: Optional[Iterable[Any]] = None, *, width: int = 60) -> None:
        """A table of sample completions: console, samples.jsonl, TensorBoard text ``samples``, wandb Table."""
        if not self.enabled:
            return
        prompts, completions = list(prompts), list(completions)
        scores = [None] * len(prompts) if scores is None else [_to_float(s) for s in scores]
        if not len(prompts) == len(completions) == len(scores):
            raise ValueError(f"log_samples: {len(prompts)} prompts, {len(completions)} completions and "
                             f"{len(scores)} scores; expected the same number of each.")
        rows = [{"step": int(step), "prompt": p, "completion": c, "score": s}
                for p, c, s in zip(prompts, completions, scores)]
        shown = [(_shorten(r["prompt"], width), _shorten(r["completion"], width),
                  "" if r["score"] is None else f"{r['score']:.4f}") for r in rows]
        _write_console(_text_table(f"samples at update {step}", ("prompt", "completion", "score"), shown))
        _append_lines(self.samples_path, rows)
        if self._tensorboard is not None:
            self._tensorboard.add_text("samples", samples_markdown(rows), int(step))
        if self._wandb is not None:
            self._wandb.log_samples(int(step), rows)

    # ---- checkpoints and the end ----
    def checkpoint_saved(self, step: int) -> None:
        """Tell the sinks that a checkpoint at ``step`` is on disk (wandb then receives the steps <= it)."""
        if self._wandb is not None:
            self._wandb.checkpoint_saved(int(step))

    def write_summary(self, summary: Mapping[str, Any], path=None) -> Optional[Path]:
        """``summary.json`` as strict JSON (non-finite floats as null), atomically; also wandb's run summary."""
        if not self.enabled:
            return None
        path = Path(path) if path is not None else self.output_dir / SUMMARY_FILE
        write_json(path, dict(summary))
        if self._wandb is not None:
            self._wandb.update_summary(to_strict(dict(summary), default=str))
        return path

    # ---- console ----
    def stage(self, message: str) -> _Stage:
        """Timestamped stage message (see :func:`stage`); silent on other processes."""
        return _Stage(message, self.enabled)

    def progress(self, total_updates: int, initial: int = 0, *, lines: Optional[bool] = None):
        """Progress over updates; set its postfix with :func:`format_postfix` after each ``update(1)``.

        A tqdm bar when stdout is a terminal; otherwise (``lines`` default) a :class:`LineProgress` that prints
        one line per update instead of carriage-return redraws. Silent off process 0."""
        if lines is None:
            lines = not _is_terminal(sys.stdout)
        if lines or not self.enabled:
            return LineProgress(total_updates, initial, enabled=self.enabled)
        return auto_tqdm(total=total_updates, initial=initial, unit="update", desc="ppo", dynamic_ncols=True)

    # ---- plot ----
    def plot(self, path=None, keys: Sequence[str] = PLOT_KEYS, *,
             held_out: Sequence[tuple[int, float]] = ()) -> Optional[Path]:
        """A PNG of ``keys`` over updates from metrics.jsonl (:func:`curves_figure`), with the held-out mean score
        at each (update, score) of ``held_out`` on the score panel."""
        if not self.enabled:
            return None
        path = Path(path) if path is not None else self.output_dir / "training_curves.png"
        return plot_metrics(self.metrics_path, path, keys, held_out=held_out)

    def flush(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.flush()

    def close(self, exit_code: int = 0) -> None:
        """Close the sinks (wandb: steps no checkpoint covers are dropped; a resume logs them again)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.close(exit_code)
            self._wandb = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(exit_code=1 if exc_type is not None else 0)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _run_id_of(output_dir: Path) -> str:
    """The run id of output_dir's run.json, or a new one (a RunLogger used without a claim)."""
    try:
        identity = read_identity(output_dir)
    except Exception:
        identity = None
    if identity is not None:
        return str(identity["run_id"])
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


def _append_lines(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(dumps(row) + "\n" for row in rows))
        f.flush()


def _md_cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _text_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([title, line, fmt(header), line, *(fmt(r) for r in rows), line])


def _config_dict(config: Any) -> Any:
    if config is None:
        return None
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    return to_strict(dict(config), default=str) if isinstance(config, Mapping) else config


def _config_markdown(config: Any) -> str:
    if not isinstance(config, Mapping):
        return f"`{config!r}`"
    lines = ["| field | value |", "|---|---|"]
    lines += [f"| {k} | {_md_cell(repr(v))} |" for k, v in config.items()]
    return "\n".join(lines)


def plot_metrics(metrics_path, png_path, keys: Sequence[str] = PLOT_KEYS, *,
                 held_out: Sequence[tuple[int, float]] = ()) -> Path:
    """Plot ``keys`` of a metrics.jsonl over its steps into ``png_path`` (see :func:`curves_figure`)."""
    fig = curves_figure(read_jsonl(metrics_path), keys, held_out=held_out)
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, format="png")
    return png_path


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it (fewer at the start): a trailing rolling mean."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1):i + 1]
        out.append(sum(part) / len(part))
    return out


def curves_figure(rows: Sequence[Mapping], keys: Sequence[str] = PLOT_KEYS, *,
                  held_out: Sequence[tuple[int, float]] = ()):
    """A matplotlib Figure (no pyplot, no display) with one panel per key over the updates of ``rows``
    (metrics.jsonl rows): each update's value as a faint point, their rolling mean as a line (the trend through
    one noisy batch after another), y-axis labels and integer update ticks; on the score panel the held-out mean
    score at each update it was measured (``held_out``: (update, score) pairs, e.g. before training at 0, during
    training and after it), joined by a line."""
    try:
        # the object API draws with Agg; no global backend
        from matplotlib.figure import Figure  # noqa: PLC0415 - optional (the demo extra)
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - optional (the demo extra)
    except ImportError as e:  # pragma: no cover
        raise ImportError("plotting needs matplotlib: pip install 'ppojax[demo]' (or matplotlib)") from e
    fig = Figure(figsize=(5.6 * len(keys), 4.0), dpi=100)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    score_axis = list(keys).index("objective/scores") if "objective/scores" in keys else 0
    held_out = [(int(x), float(y)) for x, y in held_out if _to_float(y) is not None]
    for index, (ax, key) in enumerate(zip(axes, keys)):
        points = [(r["step"], r[key]) for r in rows if _to_float(r.get(key)) is not None and "step" in r]
        if points:
            xs, ys = zip(*points)
            window = max(3, len(points) // 6)
            ax.plot(xs, ys, linestyle="none", marker=".", markersize=5, color="C0", alpha=0.35,
                    label="training batch")
            ax.plot(xs, rolling_mean(ys, window), color="C0", linewidth=2.0,
                    label=f"training batch, mean of the last {window}")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        if index == score_axis and held_out:
            hx, hy = zip(*held_out)
            ax.plot(hx, hy, color="C2", marker="o", markersize=6, linewidth=1.8,
                    label=f"held-out mean: {hy[0]:.2f} -> {hy[-1]:.2f}")
        if points or (index == score_axis and held_out):
            ax.legend(loc="best", fontsize=8)
        ax.set_title(key)
        ax.set_xlabel("update")
        ax.set_ylabel(AXIS_LABELS.get(key, key))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if key == "objective/kl":
            _kl_coef_on_twin_axis(ax, rows)
    fig.tight_layout()
    return fig


def _kl_coef_on_twin_axis(kl_ax, rows: Sequence[Mapping]) -> None:
    """The KL coefficient over the updates on a right-hand axis of the KL panel, when it moved (the adaptive
    controller); a fixed coefficient adds nothing."""
    points = [(r["step"], _to_float(r.get("objective/kl_coef"))) for r in rows if "step" in r]
    points = [(x, y) for x, y in points if y is not None]
    if len({y for _, y in points}) < 2:
        return
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415 - optional (the demo extra)

    xs, ys = zip(*points)
    twin = kl_ax.twinx()
    twin.plot(xs, ys, color="C3", linestyle="--", linewidth=1.2, label="KL coefficient (adaptive)")
    twin.set_ylabel(AXIS_LABELS["objective/kl_coef"], color="C3")
    twin.tick_params(axis="y", colors="C3")
    twin.xaxis.set_major_locator(MaxNLocator(integer=True))
    lines = kl_ax.get_lines() + twin.get_lines()
    kl_ax.legend(lines, [line.get_label() for line in lines], loc="best", fontsize=8)
