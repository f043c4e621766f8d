"""The loop: ``train_step`` on each prompt batch, then the hooks that are due.

    for update in range(start, total):
        state, metrics = train_step(state, update_prompts(run), key(seed, update))
        for hook in hooks: if hook is due at update + 1: hook(StepEnd)

The host never waits for an update before dispatching the next: an update's metrics are read (and its hooks
run) once the following update is queued on the device, so hooks see each step's metrics one update late, in
order, the last step's at the end. (With dynamic sampling the next update's prompts start after the rounds this
one used: the host reads that count when the update ends, then dispatches the next.) A hook that reads the run's
state (``Hook(reads_state=True)``: checkpoints, samples) needs its own step's state, which the next update
replaces (the state is donated): at the steps it is due, the loop reads that step's metrics and runs its hooks
before dispatching the next update. A hook that raises stops the run; nothing after the failing step is saved
(the last checkpoint stays the newest).
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import numpy as np

from ppojax import parallel
from ppojax.errors import RewardFunctionError
from ppojax.io.run_logging import stage
from ppojax.rl.types import Prompts


@dataclass
class StepEnd:
    """What a hook sees after update ``step`` (1-based): the run, its host metrics (floats), wall times."""

    step: int
    total: int
    run: Any
    metrics: dict
    seconds: float


@dataclass
class Hook:
    """``fn(StepEnd)`` every ``every`` updates (and at the last one when ``at_end``). ``reads_state``: ``fn``
    reads ``run.state`` (or what derives from it), so it runs before the next update is dispatched."""

    fn: Callable[[StepEnd], None]
    every: int = 1
    at_end: bool = False
    reads_state: bool = False

    def due(self, step: int, total: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == total)


def step_key(seed: int, update_index: int):
    """The PRNG key of update ``update_index``: derived from (seed, index) alone, so a resumed run draws the
    same keys as an uninterrupted one without storing any."""
    return jax.random.fold_in(jax.random.key(seed), update_index)


FILL_STREAM = 2 ** 31 - 1
"""The index under which the seed's key derives the keys of an asynchronous run's first batches (no update has it)."""


def fill_key(seed: int, batch_index: int):
    """The key of an asynchronous run's ``batch_index``-th batch sampled before update 1 (``ppojax.rl.pipeline``)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), FILL_STREAM), batch_index)


def fill_in_flight(run, fill) -> None:
    """An asynchronous run before its first update: its first ``max_staleness`` prompt batches sampled by the
    initial policy into the state's ``in_flight`` queue. fill: ``ppojax.rl.program.make_fill``'s. A reward function
    that fails on them stops the run here (``RewardFunctionError``), before any update."""
    k = run.settings.asynchronous.max_staleness
    batches = [update_prompts(run) for _ in range(k)]
    prompts = Prompts(np.stack([b.input_ids for b in batches]), np.stack([b.rows for b in batches]))
    keys = jax.numpy.stack([fill_key(run.config.seed, i) for i in range(k)])
    with stage(f"max_staleness={k}: sampling the first {k} batches with the initial policy"):
        run.state, failures = fill(run.state, prompts, keys)
        if int(parallel.to_host(failures)):
            run.reward.raise_pending()
            raise RewardFunctionError("the reward function failed on another process while the first batches of "
                                      "an asynchronous run were sampled (see that process's log).")


def run_updates(run, train_step, total: int, hooks: list[Hook], *, should_stop: Callable[[], bool] = lambda: False,
                host_timings: Optional[Callable[[dict], dict]] = None) -> list[dict]:
    """Run updates ``state.update_count .. total-1``; returns this call's host metrics, one dict per update.

    ``should_stop()`` is asked after every update's hooks: True ends the loop early (a signal). ``host_timings``
    (a disaggregated step's): the update's device metrics -> host-measured ``time/*`` metrics added to its row.
    Each update's ``time/step_s`` runs from when the device could start it (its dispatch, or the previous
    update's end, whichever is later) to its end: its metrics arriving, or, where they were ready by the time the
    next update's dispatch returned (a step with a host callback dispatches synchronously), that dispatch's start.
    """
    history: list[dict] = []
    ready = time.perf_counter()  # when the previous update ended
    late = None  # (update index, device metrics, dispatch time) of an update whose hooks have not run yet

    def finish(update_index, device_metrics, dispatched, ended=None) -> bool:
        nonlocal ready
        metrics = {name: float(value) for name, value in parallel.to_host(device_metrics).items()}
        end = time.perf_counter() if ended is None else ended
        seconds, ready = end - max(dispatched, ready), end
        metrics["eps"] = run.settings.batch.batch_size / seconds
        metrics["time/step_s"] = seconds
        if host_timings is not None:  # a disaggregated run: how busy each device set was
            metrics.update(host_timings(device_metrics))
        if "perf/real_tokens" in metrics:  # prompt and response tokens, padding left out
            metrics["time/real_tokens_per_s"] = metrics["perf/real_tokens"] / seconds
        history.append(metrics)
        end = StepEnd(step=update_index + 1, total=total, run=run, metrics=metrics, seconds=seconds)
        for hook in hooks:
            if hook.due(end.step, total):
                hook.fn(end)
        return should_stop()

    for update_index in range(int(run.state.update_count), total):
        if run.agents is not None and late is not None:  # an agent run: the last update ends, and its hooks read
            stop, late = finish(*late), None  # its batch's tool counters, before this batch's environments reset
            if stop:
                break
        dispatched = time.perf_counter()
        prompts = update_prompts(run)
        if run.agents is not None:  # the episodes' environments reset; a reset's text goes into its prompt
            group = run.settings.sampling.num_generations
            prompts = prompts._replace(input_ids=run.agents.begin(np.repeat(np.asarray(prompts.rows), group),
                                                                  prompts.input_ids, group))
        run.state, metrics = train_step(run.state, prompts, step_key(run.config.seed, update_index))
        # the previous update ended before this dispatch started where its metrics are ready now
        stop = late is not None and finish(*late, dispatched if _ready(late[1]) else None)
        late = (update_index, metrics, dispatched)
        take_used_rounds(run, metrics)
        if stop:
            break
        if any(hook.reads_state and hook.due(update_index + 1, total) for hook in hooks):
            late = None
            if finish(update_index, metrics, dispatched):
                break
    if late is not None:
        finish(*late)
    return history


def update_prompts(run) -> Prompts:
    """The next update's prompts, with their rows (the dataset columns of Python rewards): the next batch; with
    dynamic sampling the next ``max_rounds`` batches, one per generation round, left in the iterator until
    :func:`take_used_rounds` takes those the update used."""
    dynamic = run.settings.dynamic_sampling
    batch = next(run.batches) if dynamic is None else run.batches.peek(dynamic.max_rounds)
    return Prompts(batch.input_ids, batch.indices)


def take_used_rounds(run, device_metrics) -> None:
    """With dynamic sampling: move the prompt batches past the rounds the update used
    (``dynamic_sampling/rounds``), so the next update starts at the first prompt not sampled and a checkpoint of
    this update resumes there. It waits for the update to end: the next update's prompts depend on it."""
    if run.settings.dynamic_sampling is not None:
        run.batches.take(int(parallel.to_host(device_metrics["dynamic_sampling/rounds"])))


def _ready(device_metrics) -> bool:
    """Whether every metric array is computed (never blocks)."""
    return all(getattr(x, "is_ready", lambda: True)() for x in jax.tree.leaves(device_metrics))


# --------------------------------------------------------------------------------------------------
# The checks every run has
# --------------------------------------------------------------------------------------------------
def reward_failure_check(end: StepEnd) -> None:
    """A reward function failed inside the step (its rows got NaN, so no optimizer step was applied):
    re-raise its own error (``RewardFunctionError`` naming the function and the cause)."""
    if end.metrics.get("reward/failures", 0) > 0:
        end.run.reward.raise_pending()
        raise RewardFunctionError(f"the reward function failed on another process at update {end.step} "
                                  "(see that process's log); no optimizer step was applied.")


def environment_check(end: StepEnd) -> None:
    """An agent run: re-raise what an environment raised during the update (``EnvironmentCallError`` naming the
    environment, the method and the row), and add the run's tool counters to the metrics."""
    if end.run.agents is not None:
        end.run.agents.raise_pending()
        end.metrics.update(end.run.agents.metrics())


def nonfinite_check(last_checkpoint: Callable[[], Any] = lambda: None):
    """Stop after ``max_nonfinite_steps`` optimizer steps in a row were skipped for a non-finite loss or
    gradient; print each update that skipped steps. last_checkpoint(): the run's newest intact checkpoint (or
    None), named in the message."""
    def check(end: StepEnd) -> None:
        run = end.run
        skipped = int(end.metrics.get("ppo/nonfinite_steps", 0))
        streak = int(end.metrics.get("ppo/nonfinite_streak", 0))  # the state is a step ahead (see the module doc)
        if skipped:
            stage(f"update {end.step}: {skipped} of {run.settings.optim.steps_per_update} optimizer steps skipped "
                  f"for a non-finite loss or gradient (mean score {end.metrics['objective/scores']}); {streak} "
                  f"in a row, the run stops at max_nonfinite_steps={run.config.max_nonfinite_steps}.")
        if streak >= run.config.max_nonfinite_steps:
            last = last_checkpoint()
            raise FloatingPointError(
                f"{streak} optimizer steps in a row were skipped for a non-finite loss or gradient "
                f"(max_nonfinite_steps={run.config.max_nonfinite_steps}); stopping. Last good checkpoint: "
                f"{last or 'none yet'} (continue from it with resume=auto). Lower learning_rate, check the "
                "reward for NaN/inf, or set max_grad_norm.")
    return check


#: the band the first micro-batch's mean ratio stays in when a synchronous update scores its own samples: the
#: rollout's log-probs and the update's first ones come from the same weights, so only rounding moves it (least in
#: float32, more in bfloat16 or with an 8-bit KV cache), while a fault in a kernel or a library moves it by orders of
#: magnitude
ON_POLICY_RATIO_BAND = (0.5, 2.0)


def on_policy_check(end: StepEnd) -> None:
    """In a synchronous run, say so when the update's first micro-batch ratio (``first_micro_batch/ratio``, before
    any optimizer step) leaves ``ON_POLICY_RATIO_BAND``: the rollout and the update computed different log-probs of
    the same tokens under the same weights, so the update's gradients are wrong. (A NaN is the non-finite check's.)
    Asynchronous runs learn from older policies' samples: their ratio is not 1."""
    ratio = end.metrics.get("first_micro_batch/ratio")
    low, high = ON_POLICY_RATIO_BAND
    if end.run.settings.asynchronous is not None or ratio is None or np.isnan(ratio) or low <= ratio <= high:
        return
    stage(f"update {end.step}: the update's first log-probs disagree with the rollout's under the same weights "
          f"(first_micro_batch/ratio = {ratio:.3g}, 1 up to rounding): the programs computed inconsistent values "
          "and this update's gradients are wrong. matmul_implementation: xla and attention_implementation: xla "
          "take XLA's own kernels; if the ratio is then 1, the kernel replaced was at fault (please report it).")


# --------------------------------------------------------------------------------------------------
# Graceful stop
# --------------------------------------------------------------------------------------------------
class StopSignals:
    """Within ``with``: the first SIGINT / SIGTERM (what preemption sends) is recorded, so the loop finishes
    the update in flight and stops; a second one interrupts at once (KeyboardInterrupt). A no-op outside the
    main thread, where Python cannot install handlers."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signal = None
        self._previous = {}

    def requested(self) -> bool:
        return self.signal is not None

    def _handle(self, signum, frame):
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum
        stage(f"{signal.Signals(signum).name} received: finishing this update, then writing a checkpoint "
              "(send it again to stop at once).")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
