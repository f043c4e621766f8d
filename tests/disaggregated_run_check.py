"""Disaggregated trainer runs (``rollout_devices``) in a process with 8 virtual CPU devices (run by
tests/test_pipeline.py): ``python tests/disaggregated_run_check.py OUT_DIR``.

tests/test_trainer.py's tiny run (a Python reward: its host callback runs in the rollout program), max_staleness 2,
4 updates, the rollout on 4 devices and the update on the other 4:
- ``straight``: the 4 updates in one call;
- ``resumed``: 2 updates (their checkpoint holds the whole queue: the state's batch and the one in transit), then
  a new trainer resumes from it and runs updates 3 and 4;
- ``single``: the same run as one program on all 8 devices (``rollout_devices: 0``);
- ``raising``: its reward raises while scoring the batch sampled in update 2 (each batch is scored in 4 calls, one
  per rollout device's rows: call 13, after the fill's 8 and update 1's 4): the run stops with the function's
  error, and no update learns from that batch.
Prints one JSON line: the largest differences of metrics and weights between them, and the update counts."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ppojax.errors import RewardFunctionError  # noqa: E402
from tests.test_trainer import good_fraction, make_trainer  # noqa: E402

NAMES = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "offpolicy/staleness_mean",
         "sampling/sampling_logp_difference/mean")


def trainer(path, **overrides):
    values = dict(total_episodes=16 * 4, behaviour_logprobs="sampler", max_staleness=2, use_decoupled_loss=True,
                  rollout_devices=4, save_steps=2)
    values.update(overrides)
    return make_trainer(path, **values)


def metric_gap(a, b):
    return max(abs(x[name] - y[name]) for x, y in zip(a, b) for name in NAMES)


def weight_gap(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))))


UTILISATION = ("time/rollout_s", "time/update_s", "time/trainer_idle_fraction", "time/sampler_idle_fraction")


def utilisation(rows, single_rows, wall):
    """The host-measured utilisation metrics of a disaggregated run's rows (none in the single program's)."""
    return dict(
        every_row=all(all(name in row for name in UTILISATION) for row in rows),
        none_in_single=not any(name in row for row in single_rows for name in UTILISATION),
        positive=all(row["time/rollout_s"] > 0 and row["time/update_s"] > 0 for row in rows),
        fractions=all(0 <= row[name] <= 1 for row in rows for name in UTILISATION[2:]),
        # the programs' times are parts of the run's wall time (each update's iterations run one after another)
        within_wall=max(sum(row["time/rollout_s"] for row in rows), sum(row["time/update_s"] for row in rows)) < wall,
        rows=[{name: round(row[name], 4) for name in UTILISATION if name in row} for row in rows])


def main(out: Path):
    assert jax.device_count() == 8
    straight = trainer(out / "straight")
    started = time.perf_counter()
    expected = straight.train(progress=False)
    wall = time.perf_counter() - started

    first = trainer(out / "resumed")
    first.train(num_updates=2, progress=False)
    resumed = trainer(out / "resumed", resume="auto")
    got = resumed.train(progress=False)

    single = trainer(out / "single", rollout_devices=0)
    one_program = single.train(progress=False)

    raising = trainer(out / "raising", save_steps=1)
    counter = itertools.count(1)  # the rollout devices' calls may come from several threads
    calls = []

    def fails_at_call_13(prompts, completions):
        calls.append(next(counter))
        if calls[-1] == 13:
            raise RuntimeError("reward server unreachable")
        return good_fraction(prompts, completions)

    raising.reward_fn = fails_at_call_13
    try:
        raising.train(progress=False)
        raised = ""
    except RewardFunctionError as err:
        raised = str(err)
    raised_rows = [json.loads(line) for line in (out / "raising" / "run" / "metrics.jsonl").read_text().splitlines()]

    # the held-out scoring's reward (a Python function: its callback bound to the rollout devices)
    queries = np.asarray(straight.train_queries[:16])
    _, completions = straight.sample_completions(queries)
    responses = np.asarray(straight.tokenizer(completions, add_special_tokens=False, padding="max_length",
                                              max_length=8, truncation=True)["input_ids"])
    scored, scored_single = straight.score_samples(queries, responses), single.score_samples(queries, responses)

    print(json.dumps(dict(
        scores_equal=scored == scored_single and len(scored[0]) == 16,
        updates=[int(straight.state.update_count), int(resumed.state.update_count), len(got)],
        staleness=[m["offpolicy/staleness_max"] for m in expected],
        resumed_metric_gap=metric_gap(expected[2:], got),
        resumed_weight_gap=weight_gap(straight.state.params, resumed.state.params),
        resumed_queue_equal=all(np.array_equal(x, y) for x, y in zip(
            jax.tree.leaves(jax.device_get(straight.state.in_flight)),
            jax.tree.leaves(jax.device_get(resumed.state.in_flight)))),
        single_metric_gap=metric_gap(expected, one_program),
        single_weight_gap=weight_gap(straight.state.params, single.state.params),
        utilisation=utilisation(expected, one_program, wall),
        raising=dict(message=raised, calls=len(calls), update_count=int(raising.state.update_count),
                     optimizer_steps=int(raising.state.optimizer_steps), rows=[row["step"] for row in raised_rows],
                     # the rows before the failure are the straight run's (the same reward until then)
                     metric_gap=metric_gap(expected[:len(raised_rows)], raised_rows)),
        update_compiles=straight.train_step.update.jitted._cache_size(),
        sample_compiles=straight.train_step.sample.jitted._cache_size())))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
