"""One PPO iteration as ONE compiled program: ``train_step(state, prompts, key) -> (state, metrics)``.

    sample_key, update_key = iteration_keys(key)
    query_responses = sample(policy, prompts, sample_key)                 # KV-cache decode loop
    experience      = forwards(policy, reference, value) + reward scores  # rollout.experience
    state, metrics  = learn(state, experience, update_key)                # rewards, advantages, epochs x
                                                                          # mini-batches x micro-batches,
                                                                          # KL controller, score moments
The state (``ppojax.rl.types.TrainState``: parameters, optimizer state, frozen reference/reward parameters, KL
coefficient, score moments, counters) is donated. With a reward model nothing leaves the device; a Python
reward function is reached through a host callback inside the program (``ppojax.rl.rewards.FunctionScores``).

``train_steps(state, prompts[K, B, P], keys[K])`` runs K iterations as one ``lax.scan``; a whole tiny run can
be ``jax.vmap``-ed over seeds (``examples/vmap_seeds.py``), or over seeds and learning rates
(``examples/vmap_lr_sweep.py``: the state's traced ``Hyperparams`` stacked on a leading axis).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ppojax import core as ppo
from ppojax.rl import dynamic_sampling, pipeline, rollout
from ppojax.rl import in_flight_updates
from ppojax import parallel
from ppojax.rl.actor_critic import ActorCritic
from ppojax.rl.rewards import GivenScores, RewardSource
from ppojax.rl.sampler import occupancy
from ppojax.rl.types import Prompts, as_prompts
from ppojax.rl.settings import StepSettings
from ppojax.rl.update import learn


@dataclass(frozen=True, eq=False)
class PPOProgram:
    """Everything static that the PPO programs are traced from (hashable by identity: build it once).

    actor_critic: the model forwards; reward: a ``ppojax.rl.rewards.RewardSource``; settings: the static
    settings (``ppojax.rl.settings.StepSettings``); optimizer: an optax transformation (without the learning
    rate: the state's traced ``hyperparams.learning_rate`` scales it); mesh: the device mesh, or None for a
    single device; episodes: what multi-turn episodes are played against (``ppojax.rl.episodes.EpisodeSource``;
    with ``settings.sampling.episodes``), or None.
    """

    actor_critic: ActorCritic
    reward: RewardSource
    settings: StepSettings
    optimizer: Any
    mesh: Optional[Any] = None
    episodes: Optional[Any] = None

    @property
    def reward_weights(self) -> Optional[tuple]:
        """The weights of the experience's reward components, in order: the reward source's, then the
        environment's (1, as TRL weighs an environment's reward) where episodes give one; None without any."""
        weights = getattr(self.reward, "weights", None)
        if self.episodes is None or self.episodes.reward_name is None:
            return weights
        return tuple(weights or ()) + (1.0,)

    @property
    def kl_estimator(self) -> ppo.KLEstimator:
        return ppo.kl_estimator(self.settings.algorithm.kl_estimator)


# --------------------------------------------------------------------------------------------------
# The iteration, pure
# --------------------------------------------------------------------------------------------------
def iteration_keys(key):
    """An iteration's key -> (sample_key, update_key): the sampler's and the update's (epoch permutations)."""
    sample_key, update_key = jax.random.split(key)
    return sample_key, update_key


def ppo_iteration(program: PPOProgram, state, prompts, key):
    """One PPO iteration on left-padded ``prompts`` (``Prompts``, or token ids i32[B / G, P]; with dynamic
    sampling i32[T, Q, P], the rounds' prompts). Pure: trace it under jit/scan/vmap. An asynchronous program
    (``settings.asynchronous``) learns from the oldest batch in flight instead (:func:`pipelined_iteration`)."""
    if program.settings.asynchronous is not None:
        return pipelined_iteration(program, state, prompts, key)
    sample_key, update_key = iteration_keys(key)
    experience, failures, rollout_metrics = _collect(program, state, prompts, sample_key)
    state, metrics = learn_unless_reward_failed(program, state, experience, update_key, failures)
    return state, {**metrics, **rollout_metrics}


def pipelined_iteration(program: PPOProgram, state, prompts, key):
    """One iteration of an asynchronous run (``ppojax.rl.pipeline``): the current policy samples and the reward
    scores ``prompts``; the update learns from the oldest batch in flight (sampled ``max_staleness`` updates
    earlier; this one's own with nothing in flight). With in-flight weight updates (``ppojax.rl.in_flight_updates``) the
    current policy instead decodes a chunk of every batch in flight and the update learns from the one it
    completes. A reward failure on this iteration's samples applies no optimizer step, as in ``ppo_iteration``."""
    sample_key, update_key = iteration_keys(key)
    if program.settings.asynchronous.in_flight_weight_updates:
        oldest, failures, sampling_metrics, in_flight = in_flight_updates.advance(program, state, as_prompts(prompts),
                                                                                 sample_key)
    else:
        fresh, failures, sampling_metrics = pipeline.sampled_batch(program, state, as_prompts(prompts), sample_key)
        oldest, in_flight = pipeline.advance(state.in_flight, fresh)
    experience = pipeline.experience_of(program, state, oldest)
    state, metrics = learn_unless_reward_failed(program, state.replace(in_flight=in_flight), experience, update_key,
                                                failures)
    return state, {**metrics, **sampling_metrics}


def learn_unless_reward_failed(program: PPOProgram, state, experience, key, failures):
    """``learn``, except when the reward source failed on some rows (``failures`` > 0): then no optimizer step is
    applied, the state's counters and controllers stay as they were and the metrics are NaN (``learn``'s
    ``reward_failed``; the host then re-raises the failure, ``RewardSource.raise_pending``). A source that cannot
    fail passes nothing."""
    state, metrics = learn(program, state, experience, key,
                           reward_failed=failures > 0 if getattr(program.reward, "may_fail", False) else None)
    metrics["reward/failures"] = failures
    metrics["ppo/nonfinite_streak"] = state.nonfinite_streak  # for the host, which reads metrics an update late
    metrics.update(reward_component_metrics(experience.reward_components))
    return state, metrics


def reward_component_metrics(components) -> dict:
    """``rewards/<name>/mean`` and ``/std`` of each reward (TRL's GRPO metrics): over the rows it applies to
    (NaN entries skipped), std with Bessel's correction."""
    out = {}
    for name, values in (components or {}).items():
        applies = ~jnp.isnan(values)
        count = jnp.sum(applies)
        mean = jnp.sum(jnp.where(applies, values, 0.0)) / count
        variance = jnp.sum(jnp.where(applies, (values - mean) ** 2, 0.0)) / (count - 1)
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, jnp.sqrt(variance)
    return out


def legacy_iteration(program: PPOProgram, state, query_responses, prompt_length, scores, key):
    """The legacy ``step()``: forwards on caller-given tokens, the caller's scores, then the update."""
    experience, failures = rollout.experience(program, state, query_responses, prompt_length,
                                              reward=GivenScores(scores))
    state, metrics = learn(program, state, experience, key)
    metrics["reward/failures"] = failures
    return state, metrics


# --------------------------------------------------------------------------------------------------
# Compiled entry points
# --------------------------------------------------------------------------------------------------
def jit_donating_state(program: PPOProgram, fn, state_shardings):
    """jit with the state donated; on a mesh the state keeps ``state_shardings`` and metrics come back
    replicated (so ``jax.device_get`` works on every process)."""
    if program.mesh is None:
        return jax.jit(fn, donate_argnums=(0,))
    return jax.jit(fn, donate_argnums=(0,), out_shardings=(state_shardings, parallel.replicated(program.mesh)))


def make_train_step(program: PPOProgram, state_shardings=None):
    """``train_step(state, prompts, key) -> (state, metrics)``, one compiled program with the state donated.

    prompts: ``Prompts`` (token ids and prompt-table rows) or token ids i32[B, P] (placed with rows over the mesh's
    batch axes); key: a PRNG key. The state's ``hyperparams`` are traced: ``state.replace(hyperparams=...)`` between
    calls does not recompile. The returned function's ``.jitted`` is the jit object (for cache counts).
    """
    return _placed(program, jit_donating_state(
        program, lambda state, prompts, key: ppo_iteration(program, state, prompts, key), state_shardings))


def make_train_steps(program: PPOProgram, state_shardings=None):
    """``train_steps(state, prompts [K, B, P], keys[K]) -> (state, metrics with a leading [K] axis)``:
    K iterations as one ``lax.scan`` (no Python between them); prompts as ``make_train_step``'s, with a [K] axis
    (with dynamic sampling each iteration reads its own [T, Q, P] rounds: the metrics'
    ``dynamic_sampling/rounds`` say how many of them it used)."""
    def steps(state, prompts, keys):
        return jax.lax.scan(lambda s, xs: ppo_iteration(program, s, *xs), state, (prompts, keys))

    jitted = jit_donating_state(program, steps, state_shardings)

    def train_steps(state, prompts, keys):
        prompts = as_prompts(prompts)
        _check_prompt_rounds(program, prompts, leading=1)
        if program.mesh is not None:
            axis = 1 + _rounds_axes(program)
            prompts = jax.tree.map(lambda x: parallel.shard_batch_axis(x, program.mesh, axis=axis), prompts)
            keys = parallel.put_replicated(keys, program.mesh)
        return jitted(state, prompts, keys)

    train_steps.jitted = jitted
    return train_steps


def collect_experience(program: PPOProgram, state, prompts, sample_key):
    """The rollout half of :func:`ppo_iteration`: sample with ``sample_key`` (the first of
    :func:`iteration_keys`), forwards, scores. prompts: ``Prompts`` or token ids i32[B / G, P] (with dynamic
    sampling: i32[T, Q, P], ``ppojax.rl.dynamic_sampling``). -> (Experience, reward failures i32[])."""
    experience, failures, _ = _collect(program, state, prompts, sample_key)
    return experience, failures


def _collect(program: PPOProgram, state, prompts, sample_key):
    """:func:`collect_experience` and the rollout's own metrics (dynamic sampling's; {} without it)."""
    prompts = as_prompts(prompts)
    if program.settings.dynamic_sampling is not None:
        return dynamic_sampling.collect(program, state, prompts, sample_key)
    if program.settings.sampling.episodes is not None:
        experience, failures, metrics = rollout.episode_experience(program, state, prompts, sample_key)
        return experience, failures, metrics
    query_responses, sampler_logprobs, work = rollout.sample_measured(program, state, prompts.input_ids, sample_key)
    rows = jnp.repeat(prompts.rows, program.settings.sampling.num_generations, axis=0)  # as sample() repeats
    experience, failures = rollout.experience(program, state, query_responses, prompts.input_ids.shape[1],
                                              sampler_logprobs=sampler_logprobs, rows=rows)
    return experience, failures, {rollout.SLOT_OCCUPANCY: occupancy(*work)}


def make_rollout(program: PPOProgram):
    """``rollout(state, prompts, key) -> (Experience, failures)`` compiled: the experience ``train_step``
    would learn from with the same key (for notebooks, tests and the legacy API). Nothing is donated."""
    return _placed(program, jax.jit(
        lambda state, prompts, key: collect_experience(program, state, prompts, iteration_keys(key)[0])))


def _placed(program: PPOProgram, jitted):
    """``jitted(state, prompts, key)`` called with the prompts and key placed on the program's mesh; its
    ``.jitted`` is the jit object (for cache counts)."""
    def call(state, prompts, key):
        prompts, key = place_inputs(program, prompts, key)
        return jitted(state, prompts, key)

    call.jitted = jitted
    return call


def make_fill(program: PPOProgram, state_shardings=None):
    """``fill(state, prompts [k, B / G, P], keys [k]) -> (state, reward failures i32[])``: an asynchronous run's
    first k = ``max_staleness`` batches sampled by the state's policy into its ``in_flight`` queue
    (``ppojax.rl.in_flight_updates.fill_queue``), the state donated; keys: the iterations' keys, as ``train_step``
    takes them."""
    def fill(state, prompts, keys):
        sample_keys = jax.vmap(lambda key: iteration_keys(key)[0])(keys)
        return in_flight_updates.fill_queue(program, state, as_prompts(prompts), sample_keys)

    jitted = jit_donating_state(program, fill, state_shardings)

    def call(state, prompts, keys):
        prompts = as_prompts(prompts)
        if program.mesh is not None:
            prompts = jax.tree.map(lambda x: parallel.shard_batch_axis(x, program.mesh, axis=1), prompts)
            keys = parallel.put_replicated(keys, program.mesh)
        return jitted(state, prompts, keys)

    call.jitted = jitted
    return call


def make_update(program: PPOProgram, state_shardings=None):
    """``update(state, experience, key) -> (state, metrics)``: the update half of :func:`ppo_iteration`
    (``learn``) as its own jit object, the state donated (``ppojax.trainer.plan`` compiles it alone)."""
    return jit_donating_state(program, lambda state, experience, key: learn(program, state, experience, key),
                              state_shardings)


def make_legacy_step(program: PPOProgram, prompt_length: int, state_shardings=None):
    """``step(state, query_responses i32[B, P+R], scores f32[B], key) -> (state, metrics)``: the legacy API's
    update on caller-given tokens and scores, one compiled program."""
    jitted = jit_donating_state(
        program, lambda state, qr, scores, key: legacy_iteration(program, state, qr, prompt_length, scores, key),
        state_shardings)

    def step(state, query_responses, scores, key):
        if program.mesh is not None:
            query_responses, scores = parallel.shard_batch((jnp.asarray(query_responses, jnp.int32),
                                                            jnp.asarray(scores, jnp.float32)), program.mesh)
            key = parallel.put_replicated(key, program.mesh)
        return jitted(state, query_responses, scores, key)

    step.jitted = jitted
    return step


def place_inputs(program, prompts, key):
    prompts = as_prompts(prompts)
    _check_prompt_rounds(program, prompts)
    if program.mesh is not None:
        if _rounds_axes(program):  # [T, Q, P]: the rounds' rows over the batch axes
            prompts = jax.tree.map(lambda x: parallel.shard_batch_axis(x, program.mesh, axis=1), prompts)
        else:
            prompts = Prompts(*parallel.shard_batch(tuple(prompts), program.mesh))
        key = parallel.put_replicated(key, program.mesh)
    return prompts, key


def _rounds_axes(program) -> int:
    """1 when the prompts have a leading rounds axis (dynamic sampling), else 0."""
    return int(program.settings.dynamic_sampling is not None)


def _check_prompt_rounds(program, prompts: Prompts, leading: int = 0) -> None:
    """Before compute, with dynamic sampling: prompts shaped [T, Q, P] (T its rounds; ``leading``: axes before,
    e.g. ``train_steps``' [K])."""
    dynamic = program.settings.dynamic_sampling
    shape = tuple(prompts.input_ids.shape)
    if dynamic is None:
        return
    if len(shape) != 3 + leading or shape[leading] != dynamic.max_rounds:
        raise ValueError(
            f"prompts of shape {shape}: with dynamic sampling (filter_groups) a step takes the prompts of every "
            f"round it may sample, [max_num_gen_batches={dynamic.max_rounds}, gen_batch_size, P]"
            + (f" after {leading} leading axes" if leading else "") + "; it uses the first rounds in order and "
            "reports how many in dynamic_sampling/rounds.")
