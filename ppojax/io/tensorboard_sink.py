"""TensorBoard event files that always equal ``metrics.jsonl``: written synchronously and flushed at every
logged step, and rebuilt from the JSONL files when a run resumes.

Why not tensorboardX's ``SummaryWriter``: it hands events to a background thread through a queue, and its
``flush()`` does not wait for that queue, so a kill loses the last steps even after a flush (and an
unflushed writer leaves a zero-byte event file). Here an event is written and flushed (tensorboardX's
``RecordWriter.flush`` also fsyncs) before ``add_*`` returns; tensorboardX still provides the record framing,
the protos and the summary helpers.

Resume at step N (:meth:`TensorBoardSink.rebuild`): a fresh event file with the config text, every scalar of
``metrics.jsonl`` (steps <= N) and every sample table of ``samples.jsonl`` (steps <= N) is written into
``tensorboard.rebuild.tmp/``, which then replaces ``tensorboard/`` (the old one is renamed to
``tensorboard.replaced.tmp/`` and removed). A kill in between leaves only ``*.tmp`` directories, which the
next rebuild removes. So after any kill/resume sequence TensorBoard holds every step of metrics.jsonl once,
and steps after N are physically gone.
"""
from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

__all__ = ["TensorBoardSink", "read_tensorboard_scalars", "read_tensorboard_texts", "samples_markdown"]

EVENT_GLOB = "events.out.tfevents.*"


def samples_markdown(rows: Sequence[Mapping]) -> str:
    """A markdown table of sample rows {"prompt", "completion", "score"} (TensorBoard's text plugin)."""
    def cell(text) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")

    lines = ["| prompt | completion | score |", "|---|---|---|"]
    for row in rows:
        score = row.get("score")
        lines.append(f"| {cell(row.get('prompt', ''))} | {cell(row.get('completion', ''))} | "
                     f"{'' if score is None else f'{score:.4f}'} |")
    return "\n".join(lines)


class TensorBoardSink:
    """Scalars and text into one event file under ``logdir``; every ``add_*`` is on disk when it returns."""

    def __init__(self, logdir, _writer_dir: Optional[Path] = None):
        from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415 - tensorboardX's package imports torch (where installed)

        self.logdir = Path(logdir)
        target = _writer_dir or self.logdir
        target.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(os.path.join(str(target), "events"))
        self._writer.flush()  # the file-version record: never a zero-byte event file

    @classmethod
    def rebuild(cls, logdir, metric_rows: Iterable[Mapping], sample_rows: Iterable[Mapping],
                config_text: Optional[str] = None) -> "TensorBoardSink":
        """A sink whose event file holds exactly ``metric_rows`` and ``sample_rows`` (the JSONL rows, each with
        a "step"), replacing whatever ``logdir`` held. Later ``add_*`` calls append to the same file."""
        logdir = Path(logdir)
        building = logdir.with_name(logdir.name + ".rebuild.tmp")
        replaced = logdir.with_name(logdir.name + ".replaced.tmp")
        for leftover in (building, replaced):
            shutil.rmtree(leftover, ignore_errors=True)
        sink = cls(logdir, _writer_dir=building)
        if config_text is not None:
            sink._write_text("config", config_text, 0, flush=False)
        samples_by_step: dict[int, list] = {}
        for row in sample_rows:
            samples_by_step.setdefault(int(row["step"]), []).append(row)
        metrics_by_step = {int(row["step"]): row for row in metric_rows}
        for step in sorted(set(samples_by_step) | set(metrics_by_step)):
            if step in metrics_by_step:  # a live run logs an update's scalars before its samples
                values = {k: v for k, v in metrics_by_step[step].items() if k != "step"}
                sink._write_scalars(step, values, flush=False)
            if step in samples_by_step:
                sink._write_text("samples", samples_markdown(samples_by_step[step]), step, flush=False)
        sink._writer.flush()
        if logdir.exists():
            os.rename(logdir, replaced)
        os.rename(building, logdir)
        shutil.rmtree(replaced, ignore_errors=True)
        return sink

    def add_scalars(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        """One update's scalars as one event (None values are skipped: TensorBoard has no null)."""
        self._write_scalars(step, values, flush=True)

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._write_text(tag, text, step, flush=True)

    def _write_scalars(self, step: int, values: Mapping[str, Optional[float]], flush: bool) -> None:
        from tensorboardX.proto.summary_pb2 import Summary  # noqa: PLC0415 - tensorboardX's package imports torch (where installed)

        summary = Summary(value=[Summary.Value(tag=name, simple_value=float(value))
                                 for name, value in values.items() if value is not None])
        self._write(summary, step, flush)

    def _write_text(self, tag: str, text: str, step: int, flush: bool) -> None:
        from tensorboardX.summary import text as text_summary  # noqa: PLC0415 - tensorboardX's package imports torch (where installed)

        self._write(text_summary(tag, text), step, flush)

    def _write(self, summary, step: int, flush: bool) -> None:
        from tensorboardX.proto import event_pb2  # noqa: PLC0415 - tensorboardX's package imports torch (where installed)

        if self._writer is None:
            raise RuntimeError(f"the TensorBoard sink of {self.logdir} is closed")
        self._writer.write_event(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))
        if flush:
            self._writer.flush()

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _events(logdir):
    """Every event in the event files under ``logdir``, file by file (TFRecord framing read directly; a torn
    record at the end of a crashed run's file ends that file)."""
    from tensorboardX.proto import event_pb2  # noqa: PLC0415 - tensorboardX's package imports torch (where installed)

    for path in sorted(Path(logdir).rglob(EVENT_GLOB)):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[offset:offset + 8])
            start = offset + 12
            if start + length + 4 > len(data):
                break
            yield event_pb2.Event.FromString(data[start:start + length])
            offset = start + length + 4


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar in the event files under ``logdir``, in file order (no
    TensorBoard needed; protos from tensorboardX). Nothing is filtered: what is on disk is what you get."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for event in _events(logdir):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return scalars


def read_tensorboard_texts(logdir) -> dict[str, list[tuple[int, str]]]:
    """{tag: [(step, text), ...]} of every text summary (tags without tensorboardX's '/text_summary')."""
    texts: dict[str, list[tuple[int, str]]] = {}
    for event in _events(logdir):
        for value in event.summary.value:
            if value.HasField("tensor") and value.tensor.string_val:
                tag = value.tag.removesuffix("/text_summary")
                texts.setdefault(tag, []).append((int(event.step), value.tensor.string_val[0].decode("utf-8")))
    return texts
