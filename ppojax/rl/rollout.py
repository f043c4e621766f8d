"""The rollout: prompts -> the ``Experience`` PPO learns from (docs/algorithm.md, "Rollout", steps 1-8),
as pure functions.

    query_responses, _ = sample(program, state, prompts, key)        # 1. generate R tokens per prompt
    experience      = experience(program, state, query_responses)    # 2-8. truncate, masks, forwards, scores

Step 2-6 (truncation, masks, behaviour/reference log-probs, values) are :func:`experience_forwards`, the
model forwards being :class:`~ppojax.rl.actor_critic.ActorCritic`'s (on packed rows with ``padding_free``:
``ppojax.rl.packed_rollout``); steps 7-8 (the reward source's scores,
``missing_eos_penalty``) are :func:`with_scores`. ``INVALID_LOGPROB`` is written on ``padding_mask``, values 0
on ``padding_mask_p1``. Every function traces inside ``ppojax.rl.program``'s single program; nothing here
leaves the device except a Python reward function's host callback.

:func:`sample_jit` is the stand-alone compiled sampler (sample completions, evaluation, legacy
``generate()``): its temperature is traced, so near-greedy samples reuse the program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from ppojax import parallel
from ppojax.rl import placement
from ppojax.rl.continuous import generate_continuous, generate_continuous_per_shard
from ppojax.rl.episodes import Episodes, generate_episodes, tail_rows_for
from ppojax.rl.packed_rollout import packed_rollout_forwards, rollout_packed_shape
from ppojax.rl.packed_update import packed_row_length
from ppojax.rl.sampler import decode_work, generate, occupancy
from ppojax.core.masks import INVALID_LOGPROB, contains_stop_token, response_masks, truncate_response
from ppojax.core.overlong import soft_overlong_punishment
from ppojax.core.shaping import penalise_missing_stop
from ppojax.rl.rewards import weighted_total
from ppojax.rl.types import Experience, Prompts


# --------------------------------------------------------------------------------------------------
# Step 1: sampling
# --------------------------------------------------------------------------------------------------
def sample(program, state, prompts, key):
    """Step 1 inside the PPO program: the current policy samples at the configured temperature.

    prompts: i32[B / G, P] (token ids) -> (query_responses i32[B, P+R] (untruncated responses; pad after the stop
    token), the sampler's log-probs f32[B, R] when ``behaviour_logprobs: sampler`` takes them from the decode loop, else
    None). Each prompt is sampled ``G = num_generations`` times, its samples on consecutive rows (the groups of
    ``ppojax.core.advantages``); each prompt is prefilled once for its G samples (``generate``'s ``group_size``;
    with continuous batching, ``rollout_slots``, once per row). On a mesh the rows stay split over the batch axes
    in order, so a group never straddles two data-parallel shards when each shard's prompt count is whole
    (``PPOConfig.derived`` checks it).
    """
    query_responses, sampler_logprobs, _ = sample_measured(program, state, prompts, key)
    return query_responses, sampler_logprobs


#: the metric of how busy the decode loop was (``ppojax.rl.sampler.occupancy`` of :func:`sample_measured`'s work)
SLOT_OCCUPANCY = "sampling/slot_occupancy"


def sample_measured(program, state, prompts, key):
    """:func:`sample`, and how much of its decode loop's work sampled tokens: -> (query_responses, sampler
    log-probs or None, (busy, computed) f32[] row-steps: ``ppojax.rl.sampler.decode_work`` of the padded sampler's
    B rows or the continuous sampler's ``rollout_slots``; ``ppojax.rl.sampler.occupancy`` of them is
    ``sampling/slot_occupancy``)."""
    sampling = program.settings.sampling
    group_size = sampling.num_generations
    if group_size > 1 and sampling.rollout_slots:
        prompts, group_size = jnp.repeat(prompts, group_size, axis=0), 1
    graphdef, weights = program.actor_critic.sampling_policy(state.params, state.frozen)
    keep_logprobs = sampling.behaviour_logprobs == "sampler"
    out, steps, rows_per_step = _sample_policy(graphdef, weights, prompts, key, sampling, sampling.temperature,
                                               mesh=program.mesh, return_logprobs=keep_logprobs,
                                               group_size=group_size, return_steps=True)
    query_responses, sampler_logprobs = out if keep_logprobs else (out, None)
    work = decode_work(query_responses[:, prompts.shape[1]:], sampling.stop_token_id, rows_per_step, steps)
    return query_responses, sampler_logprobs, work


def sample_episodes(program, params, frozen, prompts, key, temperature=None, group_size=None,
                    episodes=None, slots=None) -> Episodes:
    """Step 1 of a multi-turn run: each prompt's ``G`` episodes (rows consecutive; default ``num_generations``; the
    prompt prefilled once for its G) played against ``program.episodes`` on one KV cache (``ppojax.rl.episodes``;
    ``rollout_slots`` rows of it, each refilled with the next waiting episode when its episode ends, where set; its
    loop cut as ``decode_segments`` says, the batch's tail on a quarter of the rows off a mesh: ``tail_rows_for``).
    params, frozen: the state's; prompts: i32[B / G, P]; temperature: default the run's (evaluation passes a
    near-greedy one); episodes: i32[] or None, the episodes to play (the rest left empty: a batch filled up to its
    compiled size; ``generate_episodes``); slots: the cache's rows (default ``rollout_slots``; 0: one per
    episode). -> ``Episodes`` of B rows."""
    sampling = program.settings.sampling
    group_size = sampling.num_generations if group_size is None else group_size
    graphdef, weights = program.actor_critic.sampling_policy(params, frozen)
    weights, init_cache_fn = decode_placement(graphdef, weights, program.mesh)
    batch = prompts.shape[0] * group_size
    slots = sampling.rollout_slots if slots is None else slots
    rows = min(slots, batch) if slots else batch
    return generate_episodes(graphdef, weights, prompts, key, shape=sampling.episodes,
                             host_turn=program.episodes.host_turn, pad_token_id=sampling.pad_token_id,
                             stop_token_id=sampling.stop_token_id,
                             temperature=sampling.temperature if temperature is None else temperature,
                             top_k=sampling.top_k, top_p=sampling.top_p, init_cache_fn=init_cache_fn,
                             slots=slots, cache_dtype=sampling.kv_cache_dtype,
                             group_size=group_size, tail_rows=tail_rows_for(rows, program.mesh),
                             segments=sampling.decode_segments, prefix_length=sampling.prompt_prefix,
                             episodes=episodes)


def decode_placement(graphdef, params, mesh):
    """The weights in the compute dtype and, on a mesh, read under ``GENERATE_RULES`` (gathered over fsdp once for
    the whole decode loop), with the cache sharded by rows -> (params, init_cache_fn or None)."""
    params = _in_compute_dtype(graphdef, params)
    if mesh is None:
        return params, None
    params = jax.lax.with_sharding_constraint(params, parallel.param_shardings(params, mesh, parallel.GENERATE_RULES))
    return params, placement.make_init_cache_fn(mesh)


def _sample_policy(policy_graphdef, policy_params, queries, key, sampling, temperature, *, greedy=False, mesh=None,
                   return_logprobs=False, group_size=1, return_steps=False):
    """queries i32[B / G, P] -> query_responses i32[B, P+R] (and the sampled tokens' log-probs f32[B, R] with
    ``return_logprobs``): each query sampled G = ``group_size`` times (its rows consecutive; continuous batching
    takes G = 1). ``sampling.rollout_slots`` > 0 decodes with continuous batching (the same tokens). On a
    mesh, the weights are read under ``GENERATE_RULES`` (gathered over fsdp once for the whole decode loop) and
    the KV cache is sharded by rows; continuous batching runs on each data-parallel shard apart (its own rows, its
    own ``ceil(rollout_slots / shards)`` slots). With ``return_steps``: (that, the decode steps i32[] (summed over
    the shards) or None for the padded sampler's, the rows each step computes)."""
    policy_params, init_cache_fn = decode_placement(policy_graphdef, policy_params, mesh)
    options = dict(response_length=sampling.response_length, pad_token_id=sampling.pad_token_id,
                   temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p, greedy=greedy,
                   stop_token_id=sampling.stop_token_id, return_logprobs=return_logprobs,
                   cache_dtype=sampling.kv_cache_dtype)
    steps, rows_per_step = None, queries.shape[0] * group_size
    if sampling.rollout_slots and mesh is not None and parallel.data_parallel_size(mesh) > 1:
        responses, steps, rows_per_step = generate_continuous_per_shard(
            policy_graphdef, policy_params, queries, key, mesh=mesh, slots=sampling.rollout_slots, **options)
        steps = jnp.sum(steps)
    elif sampling.rollout_slots:  # continuous batching: S slots refilled from the waiting rows
        responses, steps = generate_continuous(policy_graphdef, policy_params, queries, key,
                                               slots=sampling.rollout_slots, init_cache_fn=init_cache_fn,
                                               return_steps=True, **options)
        rows_per_step = min(sampling.rollout_slots, queries.shape[0])
    else:
        responses = generate(policy_graphdef, policy_params, queries, key, segments=sampling.decode_segments,
                             group_size=group_size, init_cache_fn=init_cache_fn,
                             prefix_length=sampling.prompt_prefix, **options)
    queries = jnp.repeat(queries, group_size, axis=0) if group_size > 1 else queries
    logprobs = None
    if return_logprobs:
        responses, logprobs = responses
    query_responses = jnp.concatenate([queries.astype(jnp.int32), responses], axis=1)
    out = (query_responses, logprobs) if return_logprobs else query_responses
    return (out, steps, rows_per_step) if return_steps else out


def _in_compute_dtype(graphdef, params):
    """The weights cast ONCE to the model's compute dtype before the decode loop (under ``precision: mixed``
    the loop would otherwise read float32 weights and convert them at every generated token)."""
    compute = getattr(nnx.merge(graphdef, params), "dtype", None)
    if compute is None:
        return params
    return jax.tree.map(lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating)
                        and jnp.finfo(x.dtype).bits > jnp.finfo(compute).bits else x, params)


@functools.partial(jax.jit, static_argnames=("program", "slots"))
def episodes_jit(program, params, frozen, prompts, key, temperature, episodes, slots=None) -> Episodes:
    """Episodes outside the PPO program (sample tables, evaluation): one per prompt, at ``temperature`` (traced),
    the first ``episodes`` (i32[], traced) of them played: the rest fill the batch up to its compiled size; on
    ``slots`` rows of the cache (static; default the run's ``rollout_slots``), each refilled when its episode ends."""
    return sample_episodes(program, params, frozen, prompts, key, temperature, group_size=1, episodes=episodes,
                           slots=slots)


@functools.partial(jax.jit, static_argnames=("policy_graphdef", "sampling", "greedy", "mesh"))
def sample_jit(policy_graphdef, policy_params, queries, key, temperature, *, sampling, greedy=False, mesh=None):
    """The policy's completions outside the PPO program (sample tables, evaluation, the legacy ``generate()``):
    queries i32[B, P] -> query_responses i32[B, P+R], one prompt one sample. One compiled program per graph and
    ``sampling`` (``SamplingSettings``); the temperature is traced (near-greedy samples reuse the program)."""
    return _sample_policy(policy_graphdef, policy_params, queries, key, sampling, temperature, greedy=greedy, mesh=mesh)


# --------------------------------------------------------------------------------------------------
# Steps 2-6: the forwards
# --------------------------------------------------------------------------------------------------
def experience_forwards(program, state, query_responses, prompt_length, sampler_logprobs=None,
                        episodes=None) -> Experience:
    """Truncate, masks, behaviour/reference log-probs, values (and the full KL when the estimator needs it).

    query_responses: i32[B, P+R]. sampler_logprobs: f32[B, R] from :func:`sample`, used as the
    behaviour log-probs (None: the policy forward computes them). When the loss weighs the behaviour policy
    against the proximal one (``AlgorithmSettings.weighs_behaviour``), the policy forward runs anyway and its
    log-probs are the experience's ``proximal_logprobs`` (with no sampler's log-probs, the same numbers as
    ``logprobs``). Every token's policy version is the state's ``update_count``. The returned Experience's
    ``scores`` are zeros: :func:`with_scores` sets them. episodes: a multi-turn rollout's ``Episodes`` (its streams
    are the responses): nothing is cut at a stop token (every turn ends with one), the environment's tokens are
    masked (``environment_mask``) and ``contains_stop`` is the episodes' ``completed``.
    """
    sampling, batch, P = program.settings.sampling, program.settings.batch, prompt_length
    pad = sampling.pad_token_id
    queries, raw_responses = query_responses[:, :P], query_responses[:, P:]
    responses = raw_responses if episodes is not None else truncate_response(raw_responses, sampling.stop_token_id, pad)
    masks = response_masks(responses, pad)
    with_full_kl = program.kl_estimator.needs_full_distribution
    proximal_wanted = program.settings.algorithm.weighs_behaviour
    behaviour = sampler_logprobs
    if proximal_wanted:  # the policy forward runs: its log-probs are pi_prox
        sampler_logprobs = None
    if batch.padding_free:  # the same numbers where the rollout keeps them, on packed rows
        packed_length = packed_row_length(batch, query_responses.shape[1])
        rows_per_micro, chunk = rollout_packed_shape(batch, query_responses.shape[1], packed_length)
        logprobs, ref_logprobs, values, full_kl = packed_rollout_forwards(
            program.actor_critic, state.params, state.frozen, query_responses, P, masks.last_index + 1,
            rows_per_micro=rows_per_micro, logits_chunk_size=chunk, with_full_kl=with_full_kl,
            behaviour_logprobs=sampler_logprobs, row_length=packed_length)
    else:
        logprobs, ref_logprobs, values, full_kl = program.actor_critic.rollout_forwards(
            state.params, state.frozen, query_responses, P,
            logits_chunk_size=batch.rollout_logits_chunk,
            forward_batch_size=batch.local_rollout_forward_batch_size,
            with_full_kl=with_full_kl, behaviour_logprobs=sampler_logprobs, prompt_group=batch.prompt_group,
            prompt_prefix=batch.prompt_prefix)
    num_eos = (jnp.sum(raw_responses == sampling.eos_token_id).astype(jnp.int32)
               if sampling.eos_token_id is not None else jnp.zeros((), jnp.int32))
    proximal = None
    if proximal_wanted:  # pi_prox: the forward's; pi_behav: the sampler's when it gave them
        proximal = jnp.where(masks.padding_mask, INVALID_LOGPROB, logprobs)
        logprobs = logprobs if behaviour is None else behaviour.astype(jnp.float32)
    return Experience(
        queries=queries,
        query_responses=query_responses,
        responses=responses,
        logprobs=jnp.where(masks.padding_mask, INVALID_LOGPROB, logprobs),
        ref_logprobs=jnp.where(masks.padding_mask, INVALID_LOGPROB, ref_logprobs),
        values=jnp.where(masks.padding_mask_p1, 0.0, values),
        scores=jnp.zeros((query_responses.shape[0],), jnp.float32),
        last_index=masks.last_index,
        padding_mask=masks.padding_mask,
        padding_mask_p1=masks.padding_mask_p1,
        contains_stop=(contains_stop_token(responses, sampling.stop_token_id) if episodes is None
                       else episodes.completed),
        num_eos_tokens=num_eos,
        full_kl=None if full_kl is None else jnp.where(masks.padding_mask, 0.0, full_kl),
        proximal_logprobs=proximal,
        policy_versions=jnp.full(responses.shape, state.update_count, jnp.int32),
        environment_mask=None if episodes is None else episodes.environment_mask,
    )


# --------------------------------------------------------------------------------------------------
# Steps 7-8: scores
# --------------------------------------------------------------------------------------------------
def penalised_scores(scores, contains_stop, last_index, settings):
    """``scores`` f32[B] with ``missing_eos_penalty`` and DAPO's soft overlong punishment (``soft_punish_cache`` > 0,
    over ``response_length``) applied (docs/algorithm.md, "Rollout", step 8). contains_stop: bool[B] the
    Experience's (a multi-turn episode's every answered turn ends with the stop token: only the episode's own end
    counts); last_index: i32[B] (``response_masks``); settings: the program's ``StepSettings``."""
    scores = penalise_missing_stop(jnp.asarray(scores, jnp.float32), contains_stop,
                                   settings.algorithm.missing_eos_penalty)
    if settings.algorithm.soft_punish_cache:
        scores = scores + soft_overlong_punishment(last_index + 1, settings.sampling.response_length,
                                                   settings.algorithm.soft_punish_cache)
    return scores


def with_scores(experience: Experience, scores, settings) -> Experience:
    """Set ``scores`` f32[B], penalised (:func:`penalised_scores`). settings: the program's ``StepSettings``."""
    return experience.replace(scores=penalised_scores(scores, experience.contains_stop, experience.last_index,
                                                      settings))


def reward_scores(program, state, queries, responses, rows=None, reward=None):
    """The reward source's ``RewardOutput`` (default: the program's) for queries i32[n, P] and TRUNCATED responses
    i32[n, R]; with ``padding_free`` a reward model packs its forward (in rows of a padded row's slots)."""
    batch = program.settings.batch
    packed_rows = None
    if batch.padding_free:
        packed_rows = min(rollout_packed_shape(batch, queries.shape[1] + responses.shape[1])[0], queries.shape[0])
    return (reward or program.reward).scores(state.frozen, queries, responses, rows, packed_rows=packed_rows)


def experience(program, state, query_responses, prompt_length, reward=None, sampler_logprobs=None, rows=None):
    """Steps 2-8: the forwards, then the reward source's scores (default: the program's).

    rows: i32[B] each row's place in the run's prompt table (a Python reward's dataset columns), or None.
    Returns (Experience, reward failures i32[]) (see ``ppojax.rl.rewards.FunctionScores``).
    """
    exp = experience_forwards(program, state, query_responses, prompt_length, sampler_logprobs)
    rewarded = reward_scores(program, state, exp.queries, exp.responses, rows, reward)
    exp = with_scores(exp, rewarded.scores, program.settings).replace(reward_components=rewarded.components)
    return exp, rewarded.failures


def episode_experience(program, state, prompts: Prompts, key):
    """Steps 1-8 of a multi-turn run: episodes (:func:`sample_episodes`), the forwards over ``[prompt | stream]``,
    the reward source's scores on the streams plus the environment's reward (``program.reward_weights``).
    -> (Experience, reward failures i32[], episode metrics)."""
    sampling = program.settings.sampling
    group = sampling.num_generations
    episodes = sample_episodes(program, state.params, state.frozen, prompts.input_ids, key)
    queries = jnp.repeat(prompts.input_ids, group, axis=0) if group > 1 else prompts.input_ids
    query_responses = jnp.concatenate([queries.astype(jnp.int32), episodes.stream], axis=1)
    keep = sampling.behaviour_logprobs == "sampler"
    exp = experience_forwards(program, state, query_responses, queries.shape[1],
                              episodes.logprobs if keep else None, episodes=episodes)
    components, failures = {}, jnp.zeros((), jnp.int32)
    if program.reward is not None:
        rewarded = reward_scores(program, state, exp.queries, exp.responses, jnp.repeat(prompts.rows, group, axis=0))
        components, failures = dict(rewarded.components), rewarded.failures
    if program.episodes.reward_name is not None:
        components[program.episodes.reward_name] = episodes.environment_reward
    scores = weighted_total(jnp.stack(list(components.values())), jnp.asarray(program.reward_weights, jnp.float32))
    exp = with_scores(exp, scores, program.settings).replace(reward_components=components)
    environment_tokens = jnp.sum(episodes.environment_mask, axis=1)
    lengths = exp.last_index + 1
    metrics = {"episodes/turns": jnp.mean(episodes.turns.astype(jnp.float32)),
               "episodes/completed": jnp.mean(episodes.completed.astype(jnp.float32)),
               "episodes/environment_tokens": jnp.mean(environment_tokens.astype(jnp.float32)),
               "episodes/model_tokens": jnp.mean((lengths - environment_tokens).astype(jnp.float32)),
               SLOT_OCCUPANCY: occupancy(episodes.busy_row_steps, episodes.computed_row_steps)}
    return exp, failures, metrics
