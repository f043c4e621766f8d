"""The training loop never waits for an update before dispatching the next: update k's metrics reach the host
(and its hooks run) after update k+1 is dispatched; hooks still see every update once, in order, the last one's
at the end; a hook that reads the state runs before the next update replaces it; a stop request ends the loop
after the update in flight."""
from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from ppojax import parallel
from ppojax.trainer import loop


class Batches:
    def __next__(self):
        return SimpleNamespace(input_ids=np.zeros((2, 3), np.int32), indices=np.arange(2))


def fake_run(start=0):
    state = SimpleNamespace(update_count=jnp.int32(start))
    settings = SimpleNamespace(batch=SimpleNamespace(batch_size=2), dynamic_sampling=None, asynchronous=None)
    return SimpleNamespace(state=state, batches=Batches(), settings=settings, config=SimpleNamespace(seed=0),
                           agents=None)


@pytest.fixture
def events(monkeypatch):
    """The order of what happens: ("step", k) when update k is dispatched, ("read", k) when its metrics are
    brought to the host, ("hook", name, step, metric) when a hook runs."""
    log: list[tuple] = []
    real_to_host = parallel.to_host

    def to_host(tree):
        log.append(("read", int(tree["update"])))
        return real_to_host(tree)

    monkeypatch.setattr(parallel, "to_host", to_host)
    return log


def train_step_into(log):
    def train_step(state, prompts, key):
        k = int(state.update_count)
        log.append(("step", k))
        return SimpleNamespace(update_count=jnp.int32(k + 1)), {"update": jnp.int32(k), "loss": jnp.float32(k / 4)}
    return train_step


def hook(log, name, **kwargs):
    return loop.Hook(lambda end: log.append(("hook", name, end.step, end.metrics["loss"])), **kwargs)


def test_the_next_update_is_dispatched_before_the_metrics_are_read(events):
    history = loop.run_updates(fake_run(), train_step_into(events), 4, [hook(events, "log")])
    assert events == [("step", 0),
                      ("step", 1), ("read", 0), ("hook", "log", 1, 0.0),
                      ("step", 2), ("read", 1), ("hook", "log", 2, 0.25),
                      ("step", 3), ("read", 2), ("hook", "log", 3, 0.5),
                      ("read", 3), ("hook", "log", 4, 0.75)]  # the last update's, flushed at the end
    assert [h["loss"] for h in history] == [0.0, 0.25, 0.5, 0.75]
    assert all(h["time/step_s"] > 0 and h["eps"] == 2 / h["time/step_s"] for h in history)


def test_a_hook_that_reads_the_state_runs_before_the_next_update(events):
    """A checkpoint at update 2 needs update 2's state, which update 3 replaces: update 2's metrics are read and
    every hook of update 2 runs (in order) before update 3 is dispatched; the other updates stay overlapped."""
    run = fake_run()
    seen = []
    save = loop.Hook(lambda end: seen.append((end.step, int(run.state.update_count))), every=2, reads_state=True)
    loop.run_updates(run, train_step_into(events), 5, [hook(events, "log"), save])
    assert events == [("step", 0),
                      ("step", 1), ("read", 0), ("hook", "log", 1, 0.0),
                      ("read", 1), ("hook", "log", 2, 0.25),
                      ("step", 2),
                      ("step", 3), ("read", 2), ("hook", "log", 3, 0.5),
                      ("read", 3), ("hook", "log", 4, 0.5 + 0.25),
                      ("step", 4), ("read", 4), ("hook", "log", 5, 1.0)]
    assert seen == [(2, 2), (4, 4)]  # each save saw its own update's state


def test_a_stop_request_ends_after_the_update_in_flight(events):
    """A signal noticed after update 2's hooks: update 3 was already dispatched, so its hooks run too and the
    loop ends with the state of update 3 (the one the final checkpoint saves)."""
    run = fake_run()
    stop_after = {2}
    history = loop.run_updates(run, train_step_into(events), 10, [hook(events, "log")],
                               should_stop=lambda: len([e for e in events if e[0] == "hook"]) in stop_after)
    assert [e for e in events if e[0] != "hook"] == [("step", 0), ("step", 1), ("read", 0), ("step", 2),
                                                       ("read", 1), ("read", 2)]
    assert len(history) == 3 and int(run.state.update_count) == 3


def test_a_raising_hook_stops_the_loop_one_update_later(events):
    """A check that fails on update 2's metrics raises once update 3 is dispatched; nothing runs after it."""
    def check(end):
        if end.step == 2:
            raise FloatingPointError("update 2 went bad")

    with pytest.raises(FloatingPointError, match="update 2"):
        loop.run_updates(fake_run(), train_step_into(events), 6, [loop.Hook(check), hook(events, "log")])
    assert events == [("step", 0), ("step", 1), ("read", 0), ("hook", "log", 1, 0.0), ("step", 2), ("read", 1)]


def test_a_resumed_loop_starts_at_the_state_update_count(events):
    history = loop.run_updates(fake_run(start=3), train_step_into(events), 5, [hook(events, "log")])
    assert [e for e in events if e[0] == "hook"] == [("hook", "log", 4, 0.75), ("hook", "log", 5, 1.0)]
    assert len(history) == 2


def test_step_times_follow_the_updates_when_the_dispatch_itself_waits(events):
    """A step with a host callback (a Python reward function) returns from its dispatch only when it is done:
    each update's time/step_s is still its own duration (timed against the sleeps), a state-reading hook's
    update included, never the near-zero gap between two metric reads."""
    import time

    def blocking_step(state, prompts, key):
        k = int(state.update_count)
        time.sleep(0.2)
        return SimpleNamespace(update_count=jnp.int32(k + 1)), {"update": jnp.int32(k), "loss": jnp.float32(0)}

    history = loop.run_updates(fake_run(), blocking_step, 5, [loop.Hook(lambda end: None, every=2,
                                                                       reads_state=True)])
    seconds = [m["time/step_s"] for m in history]
    assert all(0.18 < s < 0.5 for s in seconds), seconds
    assert all(abs(m["eps"] - 2 / m["time/step_s"]) < 1e-9 for m in history)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_an_update_whose_first_ratio_is_not_1_is_reported_in_a_synchronous_run(asynchronous, capsys):
    """A synchronous update's first micro-batch is scored by the weights that sampled it: its mean ratio far from 1
    means the rollout's and the update's log-probs of the same tokens disagree (a faulty kernel gave 1e19). Each
    such update is named with its ratio; rounding's ratios are not, nor a NaN (the non-finite check's), nor any
    ratio of an asynchronous run (it learns from older policies' samples)."""
    ratios = [1.0000002, 2.0e19, 0.9993, float("nan"), 0.01, 1.6]

    def train_step(state, prompts, key):
        k = int(state.update_count)
        metrics = {"update": jnp.int32(k), "first_micro_batch/ratio": jnp.float32(ratios[k])}
        return SimpleNamespace(update_count=jnp.int32(k + 1)), metrics

    run = fake_run()
    run.settings.asynchronous = SimpleNamespace(max_staleness=1) if asynchronous else None
    loop.run_updates(run, train_step, len(ratios), [loop.Hook(loop.on_policy_check)])
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines() if "disagree" in line]
    reported = [(line.split(":")[0], line.split("first_micro_batch/ratio = ")[1].split(",")[0]) for line in lines]
    assert reported == ([] if asynchronous else [("update 2", "2e+19"), ("update 5", "0.01")])
    assert all("matmul_implementation: xla and attention_implementation: xla" in line for line in lines)
