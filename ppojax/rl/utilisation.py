"""How busy the two device sets of a disaggregated run are (docs/async.md, "Reading the utilisation"), measured
on the host without stalling it.

Iteration t's rollout and update are dispatched together; both start when the update of iteration t - 1 has
finished (its weights are what the rollout samples with) and the update also needs the rollout of t - 1 (the
batch in transit). Two threads per iteration wait for each program's outputs and note when they became ready,
so the dispatching thread never blocks. With s_t = max(dispatch_t, rollout_end_t-1, update_end_t-1) the start
and span_t = max(rollout_end_t, update_end_t) - s_t:

    time/rollout_s              = rollout_end_t - s_t
    time/update_s               = update_end_t - s_t
    time/trainer_idle_fraction  = (span_t - time/update_s) / span_t   # the training devices wait for the sampler
    time/sampler_idle_fraction  = (span_t - time/rollout_s) / span_t  # the rollout devices wait for the trainer

They are wall-clock figures (``time/*``, as ``time/step_s``): a resumed run's rows equal the uninterrupted run's
in everything else.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import jax


class _Ready:
    """The moment ``outputs`` (device arrays of one execution) became ready, noted by a waiting thread."""

    def __init__(self, outputs: Any):
        self.at: Optional[float] = None
        self._thread = threading.Thread(target=self._wait, args=(outputs,), daemon=True)
        self._thread.start()

    def _wait(self, outputs):
        try:
            jax.block_until_ready(outputs)
        except Exception:  # noqa: BLE001 - a failed execution is reported by whoever reads its outputs
            pass
        self.at = time.perf_counter()

    def time(self) -> float:
        self._thread.join()
        return self.at


class IterationClock:
    """Watches each iteration's two programs; :meth:`report` gives an iteration's utilisation metrics once its
    update's metrics are on the host (it may wait for its rollout, which the next update needs anyway)."""

    def __init__(self):
        # id of the metrics dict -> (the dict, kept alive, dispatch time, rollout, update), in dispatch order
        self._watched: dict[int, tuple[dict, float, _Ready, _Ready]] = {}
        self._last_ends: Optional[tuple[float, float]] = None  # (rollout end, update end) of the last reported

    def watch(self, dispatched: float, rollout_outputs: Any, update_metrics: dict) -> None:
        """Called right after iteration t's two dispatches; ``update_metrics`` is the dict the step returns (its
        identity names the iteration in :meth:`report`)."""
        self._watched[id(update_metrics)] = (update_metrics, dispatched, _Ready(rollout_outputs),
                                             _Ready(update_metrics))

    def report(self, update_metrics: dict) -> dict[str, float]:
        """The ``time/*`` utilisation metrics of the iteration that returned ``update_metrics`` ({} if it was not
        watched). Iterations are reported in the order they were dispatched; one not reported is skipped."""
        key = id(update_metrics)
        if key not in self._watched:
            return {}
        while next(iter(self._watched)) != key:  # an iteration whose metrics were never read
            del self._watched[next(iter(self._watched))]
            self._last_ends = None
        _, dispatched, rollout, update = self._watched.pop(key)
        ends = (rollout.time(), update.time())
        metrics = utilisation_metrics(dispatched, *ends, previous_ends=self._last_ends)
        self._last_ends = ends
        return metrics

    def reset(self) -> None:
        """Forget what was watched (the step starts afresh from a settled state)."""
        self._watched.clear()
        self._last_ends = None


def utilisation_metrics(dispatched: float, rollout_end: float, update_end: float,
                        previous_ends: Optional[tuple[float, float]] = None) -> dict[str, float]:
    """The ``time/*`` metrics of one iteration from its dispatch time, the moments its rollout and update ended
    and the previous iteration's (rollout end, update end), None for the first (module docstring)."""
    start = dispatched if previous_ends is None else max(dispatched, *previous_ends)
    rollout_s, update_s = max(rollout_end - start, 0.0), max(update_end - start, 0.0)
    span = max(rollout_s, update_s, 1e-9)
    return {"time/rollout_s": rollout_s, "time/update_s": update_s,
            "time/trainer_idle_fraction": (span - update_s) / span,
            "time/sampler_idle_fraction": (span - rollout_s) / span}
