"""The disaggregated run against the single program, in a process with 8 virtual CPU devices (run by
tests/test_pipeline.py): ``python tests/disaggregated_check.py ROLLOUT_DEVICES MAX_STALENESS...``.

The rollout on the first ROLLOUT_DEVICES devices, the update on the others (data-parallel); the reference is the
single asynchronous program (``pipelined_iteration``) on ONE device, from the same fill. The models are
tests/sharding_helpers.py's (a reward ScoreModel: the frozen reward model is moved to the rollout devices).
Prints one JSON line per MAX_STALENESS: the largest differences and the compile counts."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ppojax import parallel  # noqa: E402
from ppojax.rl import disaggregated, in_flight_updates, placement  # noqa: E402
from ppojax.rl.optimizer import make_optimizer  # noqa: E402
from ppojax.rl.program import PPOProgram, make_fill, make_train_step  # noqa: E402
from ppojax.rl.rewards import ModelScores  # noqa: E402
from ppojax.rl.settings import AsyncSettings, Hyperparams, StepSettings  # noqa: E402
from ppojax.rl.types import Prompts, init_train_state  # noqa: E402
from tests import sharding_helpers as H  # noqa: E402

UPDATES, ROWS = 3, 24


def program_on(mesh, K):
    """The asynchronous program (max_staleness K, decoupled objective) on ``mesh`` (None: one device), with
    sharding_helpers' models. -> (program, params, frozen, hyperparams)."""
    config = dataclasses.replace(H.CONFIG, batch_size=ROWS, behaviour_logprobs="sampler", use_decoupled_loss=True)
    settings = StepSettings.from_config(config, pad_token_id=H.PAD, stop_token_id=H.STOP, num_updates=4,
                                        data_parallel_size=1 if mesh is None else parallel.data_parallel_size(mesh))
    settings = dataclasses.replace(settings, asynchronous=AsyncSettings(K))
    ac, params, frozen, (_, value_def) = H.build_models()
    program = PPOProgram(ac, ModelScores(value_def, H.PAD), settings, make_optimizer(), mesh)
    return program, params, frozen, Hyperparams.from_config(config)


def prompt_batches(K):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, H.VOCAB, size=(K + UPDATES, ROWS, H.P)).astype(np.int32)
    return [Prompts(ids[i], np.full((ROWS,), -1, np.int32)) for i in range(K + UPDATES)]


def filled(program, params, frozen, hyperparams, prompts, K):
    """A fresh state on the program's mesh (None: the default device) with its first K batches in flight.
    -> (state, state shardings or None)."""
    in_flight = in_flight_updates.in_flight_shapes(program, params, frozen, H.P)
    if program.mesh is None:
        state = init_train_state(params, program.optimizer, hyperparams=hyperparams, frozen=frozen,
                                 in_flight=in_flight)
        shardings = None
    else:
        state, shardings = placement.init_sharded_train_state(params, program.optimizer, program.mesh,
                                                             hyperparams=hyperparams, frozen=frozen,
                                                             in_flight=in_flight)
    fill_prompts = Prompts(np.stack([p.input_ids for p in prompts[:K]]), np.stack([p.rows for p in prompts[:K]]))
    keys = jnp.stack([jax.random.key(1000 + i) for i in range(K)])
    state, failures = make_fill(program, shardings)(state, fill_prompts, keys)
    assert int(failures) == 0
    return state, shardings


def main(rollout_devices: int, K: int):
    devices = jax.devices()
    assert len(devices) == 8, devices
    prompts = prompt_batches(K)
    keys = [jax.random.key(i) for i in range(UPDATES)]

    single, params, frozen, hyperparams = program_on(None, K)
    state, _ = filled(single, params, frozen, hyperparams, prompts, K)
    step, expected = make_train_step(single), []
    for i in range(UPDATES):
        state, metrics = step(state, prompts[K + i], keys[i])
        expected.append({k: float(v) for k, v in jax.device_get(metrics).items()})
    expected_state = jax.device_get(state)

    train_mesh = parallel.make_mesh(devices=devices[rollout_devices:])
    rollout_mesh = parallel.make_mesh(devices=devices[:rollout_devices])
    program, params, frozen, hyperparams = program_on(train_mesh, K)
    state, shardings = filled(program, params, frozen, hyperparams, prompts, K)
    split = disaggregated.DisaggregatedProgram(program, rollout_mesh)
    step = disaggregated.DisaggregatedStep(split, shardings)
    state, history = disaggregated.run_disaggregated(split, state, prompts[K:], keys, step=step)
    got = [{k: float(v) for k, v in parallel.to_host(m).items()} for m in history]
    got_state = parallel.to_host(state)

    metric_diff = max(abs(g[name] - e[name]) / max(1.0, abs(e[name])) for g, e in zip(got, expected)
                      for name in e if not np.isnan(e[name]))
    param_diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                     for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(expected_state.params)))
    gaps = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                           for a, b in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(expected_state.params))])
    queue_equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                      zip(jax.tree.leaves(got_state.in_flight.query_responses),
                          jax.tree.leaves(expected_state.in_flight.query_responses)))
    print(json.dumps(dict(max_staleness=K, metric_diff=metric_diff, param_diff=param_diff,
                          param_far_share=float(np.mean(gaps > 1e-5)), queue_equal=queue_equal,
                          staleness=[g["offpolicy/staleness_max"] for g in got],
                          sample_compiles=step.sample.jitted._cache_size(),
                          update_compiles=step.update.jitted._cache_size(),
                          keys=sorted(set(expected[0]) ^ set(got[0])))))


if __name__ == "__main__":
    for staleness in sys.argv[2:]:
        main(int(sys.argv[1]), int(staleness))
