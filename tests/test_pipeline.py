"""Asynchronous RL with bounded staleness (``ppojax.rl.pipeline``): the update learns from the batch sampled
``max_staleness`` updates earlier.

- with nothing in flight the pipeline's program equals the synchronous ``train_step`` (metrics and weights);
- with k = 2 it equals a plain loop written here over the synchronous program's pieces: a Python list of
  experiences sampled by older states, each re-scored by the forwards of the state that learns from it, with
  plain PPO and with AReaL's decoupled objective; the staleness metrics count the lag;
- a config that cannot run asynchronously is refused before compute.
"""
import dataclasses

import jax
import numpy as np
import pytest

from ppojax.errors import ConfigError
from ppojax.rl import rollout
from ppojax.rl.program import (collect_experience, iteration_keys, make_fill, make_train_step, make_update)
from ppojax.rl.settings import AsyncSettings, StepSettings
from ppojax.trainer.config import PPOConfig
from ppojax.trainer.loop import step_key
from tests.test_train_step import init_state, prompt_blocks, tiny_program

NUM_UPDATES = 4
TIGHT = dict(rtol=1e-6, atol=1e-6)


def program_with(max_staleness, **config):
    """tests.test_train_step's tiny program (a JAX reward; nothing leaves the device) with the sampler's
    log-probs as the behaviour policy's, asynchronous with ``max_staleness`` (None: synchronous)."""
    base = tiny_program(NUM_UPDATES)
    values = {**dict(batch_size=16, response_length=6, max_prompt_length=6, learning_rate=1e-2, temperature=1.0,
                     num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.05, behaviour_logprobs="sampler"), **config}
    settings = StepSettings.from_config(PPOConfig(**values), pad_token_id=0, stop_token_id=1, eos_token_id=1,
                                        num_updates=NUM_UPDATES)
    asynchronous = None if max_staleness is None else AsyncSettings(max_staleness)
    return dataclasses.replace(base, settings=dataclasses.replace(settings, asynchronous=asynchronous))


def fill_keys(k):
    return [jax.random.fold_in(jax.random.key(0), 1000 + i) for i in range(k)]


def test_nothing_in_flight_equals_the_synchronous_step():
    sync, pipelined = program_with(None), program_with(0)
    prompts = prompt_blocks(NUM_UPDATES)
    runs = []
    for program in (sync, pipelined):
        step, state, history = make_train_step(program), init_state(program, 0), []
        for i in range(NUM_UPDATES):
            state, metrics = step(state, prompts[i], step_key(0, i))
            history.append(jax.device_get(metrics))
        runs.append((state, history))
    (a_state, a), (b_state, b) = runs
    assert b_state.in_flight is None
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_allclose(x[name], y[name], **TIGHT, err_msg=f"update {step + 1}: {name}")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TIGHT), a_state.params, b_state.params)


def plain_loop(program, state, prompts, keys, k):
    """The reference: experiences sampled by the state of their time (the synchronous program's rollout), kept in a
    Python list; each update re-runs the forwards of the batch it learns from with its own state, keeping the
    batch's sampler log-probs, scores and policy versions, then the synchronous program's update."""
    collect = jax.jit(lambda s, p, key: collect_experience(program, s, p, key)[0])
    forwards = jax.jit(lambda s, qr, behaviour: rollout.experience_forwards(program, s, qr, 6, behaviour))
    update = make_update(program)
    queue = [collect(state, prompts[i], iteration_keys(key)[0]) for i, key in enumerate(fill_keys(k))]
    history = []
    for i, key in enumerate(keys):
        sample_key, update_key = iteration_keys(key)
        queue.append(collect(state, prompts[k + i], sample_key))
        old = queue.pop(0)
        experience = forwards(state, old.query_responses, old.logprobs).replace(
            scores=old.scores, reward_components=old.reward_components, policy_versions=old.policy_versions)
        state, metrics = update(state, experience, update_key)
        history.append(jax.device_get(metrics))
    return state, history


@pytest.mark.parametrize("objective", ["plain", "decoupled"])
def test_staleness_two_equals_a_plain_loop(objective):
    k = 2
    config = dict(use_decoupled_loss=True) if objective == "decoupled" else {}
    pipelined, sync = program_with(k, **config), program_with(None, **config)
    blocks = prompt_blocks(NUM_UPDATES)  # the tiny prompts make 4 batches: the fill samples 2 of them again
    prompts = jax.numpy.concatenate([blocks[2:], blocks])
    keys = [step_key(0, i) for i in range(NUM_UPDATES)]

    state, failures = make_fill(pipelined)(init_state(pipelined, 0), prompts[:k], jax.numpy.stack(fill_keys(k)))
    assert int(failures) == 0 and state.in_flight.query_responses.shape == (k, 16, 12)
    step, history = make_train_step(pipelined), []
    for i, key in enumerate(keys):
        state, metrics = step(state, prompts[k + i], key)
        history.append(jax.device_get(metrics))
    ref_state, reference = plain_loop(sync, init_state(sync, 0), prompts, keys, k)

    for update, (got, want) in enumerate(zip(history, reference)):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, **TIGHT, err_msg=f"update {update + 1}: {name}")
        # update u (0-based) learns the batch of version max(u - k, 0): the fill's batches are version 0
        assert got["offpolicy/staleness_max"] == min(update, k)
        np.testing.assert_allclose(got["offpolicy/staleness_mean"], min(update, k))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TIGHT), state.params, ref_state.params)
    # the queue holds the last k batches sampled, by the policies of the last k updates
    np.testing.assert_array_equal(state.in_flight.policy_versions[:, 0, 0], [NUM_UPDATES - 2, NUM_UPDATES - 1])
    if objective == "decoupled":  # stale batches: the behaviour weights pi_prox / pi_behav move away from 1
        assert history[-1]["sampling/sampling_logp_difference/mean"] > 1e-3
        assert history[0]["sampling/sampling_logp_difference/mean"] < 1e-5  # version 0 learned at version 0


@pytest.mark.parametrize("values, message", [
    (dict(max_staleness=2), "Set behaviour_logprobs: sampler"),
    (dict(max_staleness=2, behaviour_logprobs="sampler", filter_groups=True, num_generations=2,
          max_num_gen_batches=2), "with filter_groups: true is not supported"),
    (dict(max_staleness=-1), "max_staleness"),
    (dict(rollout_devices=2), "needs max_staleness >= 1"),
    (dict(in_flight_weight_updates=True), "in_flight_weight_updates: true spreads each batch's decode"),
    (dict(max_staleness=1, behaviour_logprobs="sampler", in_flight_weight_updates=True, rollout_devices=1),
     "Remove one of the two"),
])
def test_configs_that_cannot_run_asynchronously_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        PPOConfig(batch_size=16, **values)


@pytest.mark.parametrize("rollout_devices, processes, message", [
    (1, 1, "leaves none of the 1 devices to train on; set it below 1"),
    (1, 2, "runs in one process \\(2 were started\\)"),
])
def test_rollout_devices_that_cannot_be_laid_out_are_refused_before_compute(monkeypatch, rollout_devices, processes,
                                                                             message):
    """The suite's process has one device: rollout_devices=1 leaves none to train; several processes (faked) are
    refused whatever the count."""
    from ppojax.trainer.build import meshes_of

    assert jax.device_count() == 1
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    config = PPOConfig(batch_size=16, behaviour_logprobs="sampler", max_staleness=1, rollout_devices=rollout_devices)
    with pytest.raises(ConfigError, match=message):
        meshes_of(config)


def test_utilisation_metrics_follow_the_iterations_dependencies():
    """Iteration 2 is dispatched at 1.0 while iteration 1's rollout runs to 3.0 (its update ended at 2.0): both
    programs of iteration 2 start at 3.0 (the rollout needs the weights of update 1, the update its transit batch);
    the rollout ends at 4.0 and the update at 7.0, so the sampler idles 3 of the 4 seconds."""
    from ppojax.rl.utilisation import utilisation_metrics

    first = utilisation_metrics(0.0, rollout_end=3.0, update_end=2.0)
    assert first == {"time/rollout_s": 3.0, "time/update_s": 2.0, "time/trainer_idle_fraction": 1 / 3,
                     "time/sampler_idle_fraction": 0.0}
    second = utilisation_metrics(1.0, rollout_end=4.0, update_end=7.0, previous_ends=(3.0, 2.0))
    assert second == {"time/rollout_s": 1.0, "time/update_s": 4.0, "time/trainer_idle_fraction": 0.0,
                      "time/sampler_idle_fraction": 0.75}
    # dispatched late (the host was busy): the programs start at their dispatch
    late = utilisation_metrics(9.0, rollout_end=10.0, update_end=10.5, previous_ends=(4.0, 7.0))
    assert late["time/rollout_s"] == 1.0 and late["time/update_s"] == 1.5


# ------------------------------------------------------------------------------------------------------------
# The trainer: the fill before update 1, the queue in checkpoints
# ------------------------------------------------------------------------------------------------------------
def async_trainer(path, **overrides):
    from tests.test_trainer import make_trainer
    return make_trainer(path, total_episodes=16 * 4, behaviour_logprobs="sampler", max_staleness=2,
                        use_decoupled_loss=True, **overrides)


def test_an_asynchronous_run_resumed_equals_the_run_never_stopped(tmp_path):
    """A Python reward (a host callback in the program) on stale batches; the queue of 2 batches in flight is saved
    with update 2's checkpoint and learned from by updates 3 and 4 of the resumed run."""
    straight = async_trainer(tmp_path / "a")
    expected = straight.train(progress=False)
    assert [m["offpolicy/staleness_max"] for m in expected] == [0, 1, 2, 2]
    first = async_trainer(tmp_path / "b", save_steps=2)
    first.train(num_updates=2, progress=False)
    resumed = async_trainer(tmp_path / "b", resume="auto")
    got = resumed.train(progress=False)
    assert int(resumed.state.update_count) == 4 and len(got) == 2
    for a, b in zip(expected[2:], got):
        for name in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg",
                     "sampling/sampling_logp_difference/mean", "offpolicy/staleness_mean"):
            assert a[name] == b[name], name
    jax.tree.map(np.testing.assert_array_equal, straight.state.params, resumed.state.params)
    jax.tree.map(np.testing.assert_array_equal, straight.state.in_flight, resumed.state.in_flight)


# ------------------------------------------------------------------------------------------------------------
# Disaggregated: rollout and update on disjoint devices (a subprocess with 8 virtual devices)
# ------------------------------------------------------------------------------------------------------------
def test_disaggregated_rollout_and_update_equal_the_single_program():
    """2 rollout + 6 training devices (data-parallel), max_staleness 1 (the batch in transit only; the trainer's test
    below has one more in the state's queue), a reward model moved to the rollout devices: every metric of 3 updates
    and the queue left in flight equal the single asynchronous program on one device; each phase compiles once."""
    import json
    import os
    import subprocess
    import sys

    from tests.xla_test_flags import CHEAP_COMPILES
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {CHEAP_COMPILES}")
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "disaggregated_check.py"), "2", "1"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["max_staleness"] for r in reports] == [1]
    for report in reports:
        k = report["max_staleness"]
        assert report["metric_diff"] < 1e-5 and report["keys"] == [], report
        # Adam turns float rounding (6 devices' reductions against one) into steps of up to lr (1e-3) on
        # near-zero gradients: a few weights of 12 optimizer steps apart, the rest within 1e-5
        assert report["param_diff"] < 12 * 1e-3 and report["param_far_share"] < 1e-2, report
        assert report["queue_equal"], report
        assert report["staleness"] == [min(u, k) for u in range(3)], report
        assert report["sample_compiles"] == 1 and report["update_compiles"] == 1, report


def test_disaggregated_trainer_runs_resume_exactly_and_equal_one_program(tmp_path):
    """tests/disaggregated_run_check.py in 8 virtual devices (rollout_devices: 4 of them): a run stopped after
    update 2 and resumed equals the run never stopped (metrics, weights, the queue left in flight); the same run
    as one program on all 8 devices agrees to float rounding; each phase compiles once; the utilisation metrics; a
    reward that raises mid-run stops it with one error and no update on the failed batch."""
    import json
    import os
    import subprocess
    import sys

    from tests.xla_test_flags import CHEAP_COMPILES
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {CHEAP_COMPILES}")
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "disaggregated_run_check.py"), str(tmp_path)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert report["updates"] == [4, 4, 2] and report["staleness"] == [0, 1, 2, 2], report
    assert report["resumed_metric_gap"] == 0 and report["resumed_weight_gap"] == 0, report
    assert report["resumed_queue_equal"], report
    assert report["single_metric_gap"] < 1e-5 and report["single_weight_gap"] < 1e-4, report
    assert report["update_compiles"] == 1 and report["sample_compiles"] == 1, report
    assert report["scores_equal"], report  # the held-out scoring with the reward on the rollout devices
    # the reward raising on update 2's batch (scored on the rollout devices while update 2 trains): the run stops
    # naming the function; updates 1 and 2 stand as in the straight run (2 x 2 x 2 optimizer steps), no more
    raising = report["raising"]
    assert "fails_at_call_13 raised RuntimeError: reward server unreachable" in raising["message"], raising
    assert raising["rows"] == [1, 2] and raising["update_count"] == 2 and raising["optimizer_steps"] == 8, raising
    assert raising["metric_gap"] == 0, raising
    # how busy each device set was: in every row of the disaggregated run (none in the single program's), the two
    # programs' times positive and within the run's wall time, the idle fractions in [0, 1]
    assert all(report["utilisation"].values()), report["utilisation"]  # (its rows: the figures, for the reader)


# ------------------------------------------------------------------------------------------------------------
# Killed in the middle of an asynchronous run
# ------------------------------------------------------------------------------------------------------------
ASYNC_BLOCK_ENV = "PPOJAX_TEST_ASYNC_BLOCK"  # "<reward call>:<checkpoint step to wait for>"
_async_reward_calls = [0]


def blocking_good_fraction_async(prompts, completions):
    """tests.test_trainer's good_fraction; with PPOJAX_TEST_ASYNC_BLOCK="n:s" its n-th call (the fill makes the first
    max_staleness of them) waits for checkpoint step_s, prints a marker and blocks until the process is killed."""
    from pathlib import Path
    import os
    import sys
    from tests.kill_points import block_once_saved
    from tests.test_trainer import good_fraction

    _async_reward_calls[0] += 1
    call, _, step = os.environ.get(ASYNC_BLOCK_ENV, "0:0").partition(":")
    if int(call) == _async_reward_calls[0]:
        output_dir = next(Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("output_dir="))
        block_once_saved(output_dir / "checkpoints" / f"step_{step}", "PPOJAX_BLOCKED")
    return good_fraction(prompts, completions)


@pytest.mark.parametrize("rollout_devices", [0, pytest.param(1, id="disaggregated")])
def test_an_asynchronous_run_killed_mid_rollout_resumes_to_the_uninterrupted_run(tmp_path, rollout_devices):
    """`ppojax train configs/tiny.yaml` with max_staleness 2 (a checkpoint after every update) SIGKILLed while its
    reward scores the batch sampled in update 3, then resumed: the metrics rows and the final train state (the
    queue in flight included) equal a run never interrupted. Also disaggregated (2 devices: the rollout on one,
    the update on the other), where the killed rollout runs beside update 3 and the batch in transit is saved in
    the checkpoint's queue."""
    import json
    import signal
    import subprocess
    import sys

    import orbax.checkpoint as ocp

    from tests.kill_points import commands_in_one_process, wait_for_marker
    from tests.test_reliability import REPO, TINY_YAML, assert_trees_equal, host_copy, metric_rows
    from tests.tiny_setup import run_environment, write_tiny_run_inputs

    dirs = write_tiny_run_inputs(tmp_path / "inputs")
    env = run_environment()
    layout = []
    if rollout_devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
        layout = [f"rollout_devices={rollout_devices}"]

    def args(out):
        return ["train", TINY_YAML, f"model_name_or_path={dirs / 'model'}", f"dataset={dirs / 'prompts.jsonl'}",
                f"output_dir={out}", "num_eval_prompts=0", "num_sample_generations=0", "save_steps=1",
                "max_staleness=2", "behaviour_logprobs=sampler", "use_decoupled_loss=true",
                "reward_function=tests.test_pipeline:blocking_good_fraction_async", *layout]

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    log = tmp_path / "killed.log"
    with open(log, "w") as f:  # calls 1-2: the fill; call 5: update 3's samples, once update 2 is saved
        proc = subprocess.Popen([sys.executable, "-m", "ppojax.trainer.cli", *args(killed)], cwd=REPO,
                                env={**env, ASYNC_BLOCK_ENV: "5:2"}, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for_marker(proc, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if p.name.startswith("step_"))[-1] == "step_2"
    # the run never stopped, then the resume: one process (one Python start and one trace fewer than two)
    done, resumed = commands_in_one_process([args(straight), args(killed) + ["resume=auto"]], env, REPO)
    assert "sampling the first 2 batches" in done
    assert "sampling the first 2 batches" not in resumed  # the queue came from the checkpoint

    assert metric_rows(killed / "metrics.jsonl") == metric_rows(straight / "metrics.jsonl")
    rows = [json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert all(("time/rollout_s" in row) == bool(rollout_devices) for row in rows)  # disaggregated where asked
    def on_host(path):  # into NumPy arrays: the runs' device layout need not exist in this process
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
            shapes = checkpointer.metadata(path)
            shapes = getattr(shapes, "item_metadata", shapes)
            shapes = getattr(shapes, "tree", shapes)
            target = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), shapes)
            return host_copy(checkpointer.restore(path, args=ocp.args.StandardRestore(target)))

    want = on_host(straight / "checkpoints" / "step_4" / "train_state")
    got = on_host(killed / "checkpoints" / "step_4" / "train_state")
    assert np.asarray(want["in_flight"]["query_responses"]).shape[0] == 2  # the queue is in the checkpoint
    assert_trees_equal(got, want)
