"""Weights & Biases as a log sink (``report_to: wandb``; the optional extra ``pip install 'ppojax[wandb]'``).

The same scalars as ``metrics.jsonl`` under the same names and steps, the config once per attempt (at
``wandb.init``), and sample completions as a ``wandb.Table`` under ``samples``.

Every step exactly once after any kill/resume sequence. wandb only appends: it refuses a step lower than
its current one and cannot take back a step it holds. And a kill loses what wandb had not yet made durable:
wandb-core buffers its transaction log (and uploads) in the background, so a SIGKILLed run can lose steps it
already handed to wandb (seen with wandb 0.31 offline: nothing of the killed attempt was on disk). Two rules
together make wandb exact:

1. **wandb only receives steps that a checkpoint covers.** A step is handed to wandb once a checkpoint at or
   after it is written (:meth:`WandbSink.checkpoint_saved`); until then it waits in memory. A resume starts
   from a checkpoint, so wandb never holds a step that a resume recomputes (which it could not replace).
   The cost: wandb's charts trail the run by up to ``save_steps`` updates; metrics.jsonl, TensorBoard and the
   console are live.
2. **A resume backfills what wandb lacks, from metrics.jsonl** (the source of truth). The resumed attempt
   continues the same wandb run id (``resume="allow"``) and first logs the JSONL rows between the last step
   wandb holds and the checkpoint step. The last step wandb holds: online, the server's (``run.step - 1``);
   offline, the largest step in the transaction logs of the earlier attempts of this run id under
   ``<wandb dir>/wandb/offline-run-*/run-<id>.wandb`` (read with :func:`read_wandb_history`).

Rejected alternative: resuming the wandb run and only logging steps above wandb's last step. The steps
between the checkpoint and the kill would keep the killed attempt's values (wrong after a resume with
changed settings), and the steps lost in wandb-core's buffer would stay missing.

If wandb holds steps past the checkpoint a resume starts from (only possible when the newest checkpoint was
unusable and an older one was taken), those steps cannot be removed; they are skipped with a one-line note.

Where: ``wandb.init(dir=...)`` gets ``$WANDB_DIR`` if set, else the run's ``output_dir`` (the run's wandb files
then live and move with the run). Project: ``$WANDB_PROJECT``, else "ppojax". ``WANDB_MODE=offline`` works
without an account; ``wandb sync <output_dir>/wandb/offline-run-*`` uploads the attempts in order.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ppojax.errors import ConfigError

__all__ = ["WandbSink", "read_wandb_history", "read_wandb_config", "wandb_records"]

TESTED_VERSION = "0.31.0"
SAMPLES_KEY = "samples"
SAMPLE_COLUMNS = ("prompt", "completion", "score")

# The transaction log (``run-<id>.wandb``): a 7-byte header (":W&B", magic 0xBEE1, version 0), then LevelDB
# log records (32 KiB blocks; per record crc32 of type+data, length, type) holding wandb_internal Records.
_HEADER = b":W&B"
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path) -> Iterable[Any]:
    """The ``wandb_internal_pb2.Record``s of one ``.wandb`` transaction log, stopping at a torn or corrupt
    record (a killed writer)."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 - optional (the wandb extra)

    data = Path(path).read_bytes()
    if data[:4] != _HEADER:
        return
    pos, pending = 7, None
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
            return
        pos += 7 + length
        if kind == _FULL:
            yield wandb_internal_pb2.Record.FromString(body)
        elif kind == _FIRST:
            pending = body
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += body
            if kind == _LAST:
                yield wandb_internal_pb2.Record.FromString(pending)
                pending = None


def _attempt_logs(wandb_dir, run_id: str) -> list[Path]:
    """The transaction logs of every offline attempt of ``run_id`` under ``wandb_dir``, oldest first.

    wandb names an attempt's directory ``offline-run-<YYYYMMDD_HHMMSS>-<id>``, adding ``-<n>`` when that name
    is taken (two attempts in one second): sorted by time, then n."""
    pattern = os.path.join(glob.escape(str(wandb_dir)), "wandb", "offline-run-*", f"run-{glob.escape(run_id)}.wandb")

    def order(path: Path):
        name = path.parent.name[len("offline-run-"):]
        stamp, rest = name[:15], name[16:]
        suffix = rest[len(run_id) + 1:] if rest.startswith(run_id + "-") else ""
        return stamp, int(suffix) if suffix.isdigit() else 0

    return sorted((Path(p) for p in glob.glob(pattern)), key=order)


def _item_value(item) -> tuple[list[str], Any]:
    keys = list(item.nested_key) or [item.key]
    return keys, json.loads(item.value_json)


def read_wandb_history(wandb_dir, run_id: str) -> list[dict]:
    """Every history row that the offline attempts of ``run_id`` hold on disk, in the order written:
    [{"_step": 3, "objective/kl": 0.1, "samples": {"_type": "table-file", "path": ...}, ...}, ...]."""
    rows = []
    for path in _attempt_logs(wandb_dir, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row: dict = {}
            for item in record.history.item:
                keys, value = _item_value(item)
                target = row
                for key in keys[:-1]:
                    target = target.setdefault(key, {})
                target[keys[-1]] = value
            row.setdefault("_step", int(record.history.step.num))
            row["_attempt"] = str(path.parent)
            rows.append(row)
    return rows


def read_wandb_config(wandb_dir, run_id: str) -> list[dict]:
    """The config each offline attempt of ``run_id`` recorded ({} for an attempt with none on disk)."""
    configs = []
    for path in _attempt_logs(wandb_dir, run_id):
        config: dict = {}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
            for item in updates:
                keys, value = _item_value(item)
                if keys[0] != "_wandb":
                    config[keys[0]] = value
        configs.append(config)
    return configs


def import_wandb():
    try:
        import wandb  # noqa: PLC0415 - optional (the wandb extra)
    except ImportError:
        raise ConfigError("report_to includes 'wandb', but wandb is not installed: pip install 'ppojax[wandb]' "
                          f"(tested with wandb=={TESTED_VERSION}), or drop 'wandb' from report_to.") from None
    return wandb


class WandbSink:
    """One wandb run per ppojax run (the wandb run id is the ppojax run id), fed as the module doc says.

    metric_rows / sample_rows: the JSONL rows (steps <= resume_step) a resumed run starts with;
    resume_step: the checkpoint step (None: a fresh run).
    """

    def __init__(self, *, run_id: str, output_dir, config: Optional[Mapping] = None, run_name: Optional[str] = None,
                 resume_step: Optional[int] = None, metric_rows: Sequence[Mapping] = (),
                 sample_rows: Sequence[Mapping] = (), say: Callable[[str], None] = print):
        wandb = import_wandb()
        self._wandb = wandb
        self.run_id = run_id
        self.wandb_dir = Path(os.environ.get("WANDB_DIR") or output_dir)
        self.wandb_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ppojax"), id=run_id,
                                  name=run_name or Path(output_dir).name, dir=str(self.wandb_dir),
                                  config=dict(config or {}), resume="allow")
        except Exception as e:  # not logged in, no network, a bad WANDB_* variable: the user's to fix
            raise ConfigError(f"report_to includes 'wandb', but wandb could not start a run: {e}. Log in with "
                              "`wandb login`, set WANDB_MODE=offline, or drop 'wandb' from report_to.") from None
        self._covered: Optional[int] = None  # the step of the last checkpoint: wandb may hold steps <= it
        self._queue: list[tuple[int, str, Any]] = []  # (step, "metrics" | "samples", payload), in log order
        self._skip_through = -1  # steps wandb already holds
        if resume_step is not None:
            held = self._last_step_held()
            if held > resume_step:
                say(f"ppojax: wandb run {run_id} already holds steps {resume_step + 1}..{held} from an attempt "
                    f"whose checkpoint was not used; they stay as they are and are not logged again.")
            self._skip_through = held
            self._covered = int(resume_step)
            for step, kind, payload in _rows_in_order(metric_rows, sample_rows):
                if held < step <= resume_step:
                    self._send(step, kind, payload)

    def _last_step_held(self) -> int:
        if not self.run.offline:
            return int(self.run.step) - 1 if self.run.resumed else -1
        steps = [row["_step"] for row in read_wandb_history(self.wandb_dir, self.run_id)]
        return max(steps, default=-1)

    def log_metrics(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        self._queue_or_send(int(step), "metrics", dict(values))

    def log_samples(self, step: int, rows: Sequence[Mapping]) -> None:
        self._queue_or_send(int(step), "samples", [dict(r) for r in rows])

    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint at ``step`` is on disk: hand wandb every waiting step <= it."""
        self._covered = int(step) if self._covered is None else max(self._covered, int(step))
        waiting, self._queue = self._queue, []
        for item in waiting:
            self._queue_or_send(*item)

    def _queue_or_send(self, step: int, kind: str, payload) -> None:
        if self._covered is not None and step <= self._covered and not self._queue:
            self._send(step, kind, payload)
        else:
            self._queue.append((step, kind, payload))

    def _send(self, step: int, kind: str, payload) -> None:
        if step <= self._skip_through:
            return
        if kind == "metrics":
            data = {k: v for k, v in payload.items() if v is not None}
        else:
            table = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                      data=[[r.get("prompt"), r.get("completion"), r.get("score")]
                                            for r in payload])
            data = {SAMPLES_KEY: table}
        self.run.log(data, step=step)

    def update_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self, exit_code: int = 0, timeout: float = 30.0) -> None:
        """Finish the wandb run. Steps no checkpoint covers are dropped: a resume logs them again.

        Offline, also wait (up to ``timeout`` s) until wandb-core has written the run's transaction log to its
        end: it does so after ``finish()`` returns, and a resume right after must see every step on disk."""
        if self.run is None:
            return
        log = Path(self.run.dir).parent / f"run-{self.run_id}.wandb" if self.run.offline else None
        self.run.finish(exit_code=exit_code)
        self.run = None
        deadline = time.monotonic() + timeout
        while log is not None and time.monotonic() < deadline:
            if log.exists() and any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log)):
                break
            time.sleep(0.05)


def _rows_in_order(metric_rows: Sequence[Mapping], sample_rows: Sequence[Mapping]):
    """(step, kind, payload) of the JSONL rows as a live run logs them: by step, an update's scalars first."""
    samples: dict[int, list] = {}
    for row in sample_rows:
        samples.setdefault(int(row["step"]), []).append({k: row.get(k) for k in SAMPLE_COLUMNS})
    metrics = {int(row["step"]): {k: v for k, v in row.items() if k != "step"} for row in metric_rows}
    for step in sorted(set(metrics) | set(samples)):
        if step in metrics:
            yield step, "metrics", metrics[step]
        if step in samples:
            yield step, "samples", samples[step]
