"""``train_step``: the whole PPO iteration as one compiled program.

- equals a two-program path written here (rollout program, reward on the host, update program: the layout
  before the single program) on the same seed, for (a) a reward model + separate value model, (b) a Python reward
  function (host callback inside the program vs. a host call between programs), (c) the legacy value head;
- K calls of ``train_step`` equal one ``train_steps`` scan of K;
- a vmapped batch of whole tiny runs (one per seed) equals the same seeds run one by one;
- no recompilation after the first step (compilations counted).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax import parallel
from ppojax.rl.actor_critic import ActorCritic
from ppojax.trainer.config import PPOConfig
from ppojax.models import CausalLM, ScoreModel
from ppojax.rl.rewards import TracedScores
from ppojax.rl import rollout, sampler
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.update import learn
from ppojax.trainer.loop import step_key
from ppojax.rl.program import (PPOProgram, iteration_keys, make_train_step, make_train_steps, ppo_iteration,
                               reward_component_metrics)
from ppojax.trainer.ppo_trainer import PPOTrainer
from ppojax.rl.types import init_train_state
from ppojax.rl.optimizer import make_optimizer
from tests.test_trainer import good_fraction
from tests.tiny_setup import PROMPTS, tiny_config, tiny_policy, tiny_tokenizer

NUM_STEPS = 3
TIGHT = dict(rtol=1e-6, atol=1e-6)


def trainer_for(tmp_path, case, split):
    # XLA's dots: the two layouts then agree to the last bits. With oneDNN's GEMM (matmul_implementation 'auto'
    # here) they agree to float32 rounding only: parameters within 1.3e-5 after the updates, where Adam at this
    # learning rate magnifies sign flips of near-zero gradients (tests/test_stacked_matmul.py compares the GEMM
    # with XLA's dots)
    config = dict(output_dir=str(tmp_path / f"{case}-{split}"), report_to="none", batch_size=16, response_length=8,
                  max_prompt_length=6, learning_rate=1e-2, temperature=1.0, kl_coef=0.05, seed=0,
                  total_episodes=16 * NUM_STEPS, num_sample_generations=0, stop_token="eos",
                  missing_eos_penalty=0.5, num_ppo_epochs=2, num_mini_batches=2, adaptive_kl=True,
                  matmul_implementation="xla")
    reward = good_fraction
    if case == "reward_model":
        reward = ScoreModel(tiny_config(), rngs=nnx.Rngs(7))
    if case == "value_head":
        config["value_head"] = "policy"
    trainer = PPOTrainer(PPOConfig.from_dict(config), processing_class=tiny_tokenizer(),
                         model=tiny_policy(value_head=case == "value_head"), reward_model=reward,
                         train_dataset=PROMPTS)
    if split:
        trainer.train_step = two_program_step(trainer.run.program)
    return trainer


def two_program_step(program):
    """``train_step`` as two compiled programs, a Python reward function called on the host between them (any
    other reward source is evaluated at the end of the rollout program): the reference the single program
    (host callback inside it) must equal."""
    reward = program.reward
    on_host = hasattr(reward, "host_components")

    def rollout_program(state, prompts, key):
        sample_key, update_key = iteration_keys(key)
        query_responses, sampler_logprobs, work = rollout.sample_measured(program, state, prompts, sample_key)
        if on_host:
            return rollout.experience_forwards(program, state, query_responses, prompts.shape[1],
                                               sampler_logprobs), update_key, sampler.occupancy(*work)
        return rollout.experience(program, state, query_responses, prompts.shape[1],
                                  sampler_logprobs=sampler_logprobs)[0], update_key, sampler.occupancy(*work)

    def update_program(state, experience, components, update_key, occupancy):
        if on_host:  # one function: its values are the scores
            experience = rollout.with_scores(experience, components[0], program.settings).replace(
                reward_components=dict(zip(reward.names, components)))
        state, metrics = learn(program, state, experience, update_key)
        metrics["reward/failures"] = jnp.zeros((), jnp.int32)
        metrics["ppo/nonfinite_streak"] = state.nonfinite_streak
        metrics.update(reward_component_metrics(experience.reward_components))
        metrics[rollout.SLOT_OCCUPANCY] = occupancy
        return state, metrics

    rollout_jit, update_jit = jax.jit(rollout_program), jax.jit(update_program, donate_argnums=(0,))

    def train_step(state, prompts, key):
        experience, update_key, occupancy = rollout_jit(state, jnp.asarray(prompts.input_ids, jnp.int32), key)
        components = None
        if on_host:
            rows = np.repeat(np.asarray(prompts.rows), program.settings.sampling.num_generations)
            components = jnp.asarray(reward.host_components(
                *parallel.to_host((experience.queries, experience.responses)), rows))
        return update_jit(state, experience, components, update_key, occupancy)

    return train_step


@pytest.mark.parametrize("case", [pytest.param("reward_model", marks=pytest.mark.slow), "reward_function",
                                  pytest.param("value_head", marks=pytest.mark.slow)])
def test_one_program_equals_rollout_then_update(tmp_path, case):
    histories, states = [], []
    for split in (False, True):
        trainer = trainer_for(tmp_path, case, split)
        histories.append(trainer.train(progress=False))
        states.append(trainer.state)
    fused, two = histories
    assert len(fused) == len(two) == NUM_STEPS
    for step, (a, b) in enumerate(zip(fused, two)):
        assert a.keys() == b.keys()
        for name in a:
            if name == "eps" or name.startswith("time/"):
                continue
            np.testing.assert_allclose(a[name], b[name], **TIGHT, err_msg=f"update {step + 1}: {name}")
    # the parameters after 12 Adam steps: a near-zero gradient's float rounding (the two programs fuse differently)
    # can flip its sign, which Adam turns into a step of ~lr; seen: 2 of 1,024 weights 3.5e-6 apart (value_head)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-5), states[0].params,
                 states[1].params)
    np.testing.assert_allclose(states[0].kl_coef, states[1].kl_coef, **TIGHT)
    assert int(states[0].optimizer_steps) == NUM_STEPS * 4  # 2 epochs x 2 mini-batches per update
    moved = max(float(jnp.abs(a - b).max()) for a, b in
                zip(jax.tree.leaves(states[0].params["policy"]), jax.tree.leaves(nnx.state(tiny_policy()))))
    assert moved > 1e-4  # training happened


# ------------------------------------------------------------------------------------------------------------
# A tiny program with a reward written in JAX (nothing leaves the device): scan and vmap
# ------------------------------------------------------------------------------------------------------------
GOOD = 2  # the token id of "good" in the tiny tokenizer


def good_token_fraction(queries, responses):
    """f32[B]: the fraction of response tokens that are 'good' (the JAX twin of good_fraction)."""
    live = responses != 0
    return jnp.sum((responses == GOOD) & live, axis=1) / jnp.maximum(jnp.sum(live, axis=1), 1)


def tiny_config_ppo():
    return PPOConfig(batch_size=16, response_length=6, max_prompt_length=6, learning_rate=1e-2,
                     temperature=1.0, num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.05)


def tiny_program(num_updates=NUM_STEPS):
    settings = StepSettings.from_config(tiny_config_ppo(), pad_token_id=0, stop_token_id=1, eos_token_id=1,
                                        num_updates=num_updates)
    policy_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(tiny_config(), rngs=nnx.Rngs(0))))
    value_def = nnx.graphdef(nnx.eval_shape(lambda: ScoreModel(tiny_config(), rngs=nnx.Rngs(0))))
    actor_critic = ActorCritic(policy_def, value_def, 0, 1.0)
    return PPOProgram(actor_critic, TracedScores(good_token_fraction), settings, make_optimizer())


def init_state(program, seed, hyperparams=None):
    """A fresh state for a (possibly traced) integer seed: policy, value model and reference from it; the
    hyperparameters of ``tiny_config_ppo`` unless given."""
    key = jax.random.key(seed)
    policy = nnx.state(CausalLM(tiny_config(), rngs=nnx.Rngs(params=key)))
    value = nnx.state(ScoreModel(tiny_config(), rngs=nnx.Rngs(params=jax.random.fold_in(key, 1))))
    hyperparams = Hyperparams.from_config(tiny_config_ppo()) if hyperparams is None else hyperparams
    return init_train_state({"policy": policy, "value": value}, program.optimizer, hyperparams=hyperparams,
                            frozen={"ref": jax.tree.map(jnp.copy, policy), "reward": None}, kl_coef=0.05)


def prompt_blocks(num_steps=NUM_STEPS):
    tok = tiny_tokenizer()
    from ppojax.trainer.data import left_pad
    ids = left_pad([tok(p)["input_ids"] for p in PROMPTS[:16 * num_steps]], 6, 0)
    return jnp.asarray(ids.reshape(num_steps, 16, 6))


def test_train_steps_scan_equals_k_train_steps():
    program = tiny_program()
    prompts = prompt_blocks()
    keys = jnp.stack([step_key(0, i) for i in range(NUM_STEPS)])
    step = make_train_step(program)
    state = init_state(program, 0)
    one_by_one = []
    for i in range(NUM_STEPS):
        state, metrics = step(state, prompts[i], keys[i])
        one_by_one.append(metrics)
    scanned_state, scanned = make_train_steps(program)(init_state(program, 0), prompts, keys)
    for i, metrics in enumerate(one_by_one):
        for name, value in metrics.items():
            np.testing.assert_allclose(value, scanned[name][i], rtol=1e-5, atol=1e-6,
                                       err_msg=f"iteration {i}: {name}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), state.params,
                 scanned_state.params)
    assert float(scanned["objective/scores"][-1]) != float(scanned["objective/scores"][0])


@pytest.mark.slow
def test_vmapped_seeds_equal_seeds_run_one_by_one():
    """A whole tiny PPO run (init from the seed, NUM_STEPS iterations) vmapped over 3 seeds in ONE program."""
    program = tiny_program()
    prompts = prompt_blocks()

    def run(seed):
        state = init_state(program, seed)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(NUM_STEPS))
        state, metrics = jax.lax.scan(lambda s, xs: ppo_iteration(program, s, *xs), state, (prompts, keys))
        return state.params, metrics

    seeds = jnp.arange(3)
    # compiled with XLA's cheap backend passes (the sharding tests' flags): the test is about values, and the
    # default passes took 3x longer to compile these two whole-run programs than they take to run
    fast = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
    params, metrics = jax.jit(jax.vmap(run)).lower(seeds).compile(compiler_options=fast)(seeds)
    single = jax.jit(run).lower(seeds[0]).compile(compiler_options=fast)
    for i in range(3):
        params_i, metrics_i = single(seeds[i])
        for name, value in metrics_i.items():
            # last-bit differences of batched matmuls grow a little over the iterations (see below)
            np.testing.assert_allclose(value, metrics[name][i], rtol=1e-3, atol=1e-4, err_msg=f"seed {i}: {name}")
        # Batched matmuls round differently in the last bits; Adam's first steps are ~lr * sign(grad), so an
        # element whose gradient is ~0 may step the other way. Nearly all elements agree to 1e-5 (over 99 % on
        # the CPU, 97.9 % on an H200, whose batched products round differently again); none is off by more
        # than a few steps of lr (1e-2 x 12 optimizer steps bounds it at 0.12). Mixed-up seeds fail both.
        diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b[i])).ravel()
                                for a, b in zip(jax.tree.leaves(params_i), jax.tree.leaves(params))])
        assert np.mean(diffs <= 1e-5) > 0.95 and diffs.max() < 1e-3, (np.mean(diffs <= 1e-5), diffs.max())
    # different seeds really are different runs
    assert not np.allclose(metrics["objective/scores"][0], metrics["objective/scores"][1])


def test_no_recompilation_after_the_first_step(tmp_path):
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    trainer = trainer_for(tmp_path, "reward_function", split=False)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = []
        for n in range(1, NUM_STEPS + 1):
            trainer.train(num_updates=n, progress=False)
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[0] > 0 and counts[-1] == counts[0], f"compilations after each update: {counts}"
    assert trainer.train_step.jitted._cache_size() == 1


def test_the_vmap_seeds_example_runs_and_every_seed_learns():
    """examples/vmap_seeds.py (4 whole runs in one program) as a user runs it."""
    import re

    proc = _run_example("vmap_seeds")
    runs = re.findall(r"seed \d: mean score ([\d.]+) \(first 3 iterations\) -> ([\d.]+)", proc.stdout)
    assert len(runs) == 4 and all(float(last) > float(first) + 0.15 for first, last in runs), proc.stdout


def _run_example(name):
    """examples/{name}.py run as a user runs it, in the suite's run environment (its compile flags and cache);
    asserts it exited 0 and returns the finished process."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.tiny_setup import run_environment

    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(repo / "examples" / f"{name}.py")], cwd=repo, capture_output=True,
                          text=True, timeout=300, env=run_environment())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _load_example(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_vmapped_learning_rate_by_seed_grid_equals_the_runs_one_by_one():
    """examples/vmap_lr_sweep.py: a 2 x 2 learning-rate x seed grid, its states stacked on a leading axis and
    advanced by ONE vmapped train step (compiled once for all iterations), equals each run stepped alone, to the
    tolerances of test_vmapped_seeds_equal_seeds_run_one_by_one; the learning rates really differ."""
    sweep = _load_example("vmap_lr_sweep")
    iterations = NUM_STEPS
    program = sweep.make_program(iterations)
    learning_rates, seeds = sweep.grid((1e-3, 3e-3), (0, 1))
    prompts = sweep.prompt_blocks(iterations)
    fast = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}  # as the seed test

    states = jax.jit(jax.vmap(lambda s, lr: sweep.init_state(program, s, lr)))(seeds, learning_rates)
    np.testing.assert_allclose(states.hyperparams.learning_rate, [1e-3, 1e-3, 3e-3, 3e-3])
    initial = jax.tree.map(jnp.copy, states)
    all_keys = [jax.vmap(lambda s: sweep.iteration_key(s, i))(seeds) for i in range(iterations)]
    step = jax.jit(sweep.sweep_step(program)).lower(states, prompts[0], all_keys[0]).compile(compiler_options=fast)
    grid_metrics = []
    for i in range(iterations):
        states, metrics = step(states, prompts[i], all_keys[i])
        grid_metrics.append(metrics)

    state0 = sweep.init_state(program, seeds[0], learning_rates[0])
    single = jax.jit(lambda s, p, k: ppo_iteration(program, s, p, k)).lower(
        state0, prompts[0], all_keys[0][0]).compile(compiler_options=fast)
    for run in range(len(seeds)):
        state = sweep.init_state(program, seeds[run], learning_rates[run])
        for i in range(iterations):
            state, metrics = single(state, prompts[i], all_keys[i][run])
            for name, value in metrics.items():
                np.testing.assert_allclose(value, grid_metrics[i][name][run], rtol=1e-3, atol=1e-4,
                                           err_msg=f"run {run}, iteration {i}: {name}")
        diffs = np.concatenate([np.abs(np.asarray(a) - np.asarray(b[run])).ravel()
                                for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(states.params))])
        assert np.mean(diffs <= 1e-5) > 0.95 and diffs.max() < 1e-3, (run, np.mean(diffs <= 1e-5), diffs.max())
    np.testing.assert_allclose(grid_metrics[-1]["lr"], [1e-3, 1e-3, 3e-3, 3e-3], rtol=1e-6)  # constant schedule
    # the same seed at the two learning rates: different runs, the larger rate moving the weights further
    moved = [np.mean([float(jnp.mean(jnp.abs(a[run] - b[run]))) for a, b in
                      zip(jax.tree.leaves(states.params["policy"]), jax.tree.leaves(initial.params["policy"]))])
             for run in range(4)]
    assert moved[2] > 2 * moved[0] and moved[3] > 2 * moved[1], moved


def test_the_vmap_lr_sweep_example_runs_and_learns():
    """examples/vmap_lr_sweep.py as a user runs it: every learning rate's line is printed, and the largest one
    raises the score."""
    import re

    proc = _run_example("vmap_lr_sweep")
    runs = re.findall(r"learning rate ([\d.e-]+): mean score ([\d.]+) \(first 3 iterations\) -> ([\d.]+)", proc.stdout)
    assert len(runs) == 3, proc.stdout
    assert float(runs[-1][2]) > float(runs[-1][1]) + 0.1, proc.stdout
