"""Asynchronous RL with bounded staleness, as pure functions: each update learns from the batch that the policy of
``max_staleness`` updates earlier sampled (AReaL's and TRL's ``max_staleness``; docs/async.md).

    fresh, failures, _ = sampled_batch(program, state, prompts, sample_key) # the current policy samples; the
                                                                           # reward scores (version update_count)
    oldest, in_flight = advance(state.in_flight, fresh)                    # k = max_staleness batches wait
    experience        = experience_of(program, state, oldest)              # forwards with the CURRENT parameters
    state, metrics    = learn(state.replace(in_flight=in_flight), experience)

A batch splits where the parameters come in. What does not depend on the parameters being trained is fixed when
it is sampled and travels with it (:class:`SampledBatch`): the tokens, the sampler's log-probs (the behaviour
policy's), the scores and the version of the policy that sampled it. What does is computed by the update that
learns from it (:func:`experience_of`): the training policy's log-probs (pi_prox of the decoupled objective, or
nothing: the ratio is then against the sampler's), the values, the reference's log-probs.

The sampling of the next batch and the update on the oldest one have no data dependence inside the program. The
queue is part of the ``TrainState`` (``in_flight``), so it is donated, scanned, vmapped and checkpointed with the
rest of the state. :func:`fill` samples the first ``k`` batches with the initial policy before update 1; the
last ``k`` batches a run samples are never learned from.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from ppojax.core.masks import contains_stop_token, response_masks, truncate_response
from ppojax.rl import rollout
from ppojax.rl.sampler import occupancy
from ppojax.rl.types import Experience, Prompts, TrainState


@struct.dataclass
class SampledBatch:
    """A sampled, scored batch of B rows waiting to be learned from (P prompt, R response tokens).

    query_responses:    i32[B, P+R]  prompts + untruncated responses, as sampled.
    behaviour_logprobs: f32[B, R]    the sampler's log-probs of its tokens (the behaviour policy's).
    scores:             f32[B]       the reward source's scores, ``missing_eos_penalty`` / overlong penalty applied.
    reward_components:  {name: f32[B]} each reward's own values (``Experience.reward_components``).
    policy_versions:    i32[B, R]    the ``update_count`` of the policy that sampled each token.
    """

    query_responses: jax.Array
    behaviour_logprobs: jax.Array
    scores: jax.Array
    reward_components: dict
    policy_versions: jax.Array


def sampled_batch(program, state: TrainState, prompts: Prompts, key) -> tuple[SampledBatch, jax.Array, dict]:
    """The current policy samples ``prompts`` (``Prompts`` of B / G rows; each sampled G = ``num_generations``
    times) with ``key`` and the program's reward source scores the truncated responses.
    -> (SampledBatch of B rows, reward failures i32[], the sampling's own metrics: ``sampling/slot_occupancy``)."""
    query_responses, sampler_logprobs, work = rollout.sample_measured(program, state, prompts.input_ids, key)
    rows = jnp.repeat(prompts.rows, program.settings.sampling.num_generations, axis=0)  # as sample() repeats them
    versions = jnp.full(sampler_logprobs.shape, state.update_count, jnp.int32)
    batch, failures = scored_batch(program, state, query_responses, sampler_logprobs, rows, versions)
    return batch, failures, {rollout.SLOT_OCCUPANCY: occupancy(*work)}


def scored_batch(program, state: TrainState, query_responses, behaviour_logprobs, rows, policy_versions
                 ) -> tuple[SampledBatch, jax.Array]:
    """Sampled rows scored by the program's reward source: query_responses i32[B, P+R] (untruncated responses),
    behaviour_logprobs f32[B, R], rows i32[B] (each row's dataset row), policy_versions i32[B, R].
    -> (SampledBatch, reward failures i32[])."""
    sampling = program.settings.sampling
    P = query_responses.shape[1] - behaviour_logprobs.shape[1]
    responses = truncate_response(query_responses[:, P:], sampling.stop_token_id, sampling.pad_token_id)
    masks = response_masks(responses, sampling.pad_token_id)
    rewarded = rollout.reward_scores(program, state, query_responses[:, :P], responses, rows)
    scores = rollout.penalised_scores(rewarded.scores, contains_stop_token(responses, sampling.stop_token_id),
                                      masks.last_index, program.settings)
    return SampledBatch(query_responses=query_responses, behaviour_logprobs=behaviour_logprobs, scores=scores,
                        reward_components=dict(rewarded.components or {}),
                        policy_versions=policy_versions), rewarded.failures


def experience_of(program, state: TrainState, batch: SampledBatch) -> Experience:
    """The ``Experience`` the update learns ``batch`` from: the forwards with ``state``'s parameters (values,
    reference log-probs, and pi_prox where a correction weighs it against the behaviour policy); the behaviour
    log-probs, scores and policy versions the batch's own."""
    prompt_length = batch.query_responses.shape[1] - batch.behaviour_logprobs.shape[1]
    experience = rollout.experience_forwards(program, state, batch.query_responses, prompt_length,
                                             batch.behaviour_logprobs)
    return experience.replace(scores=batch.scores, reward_components=batch.reward_components or None,
                              policy_versions=batch.policy_versions)


def advance(in_flight: Optional[SampledBatch], fresh: SampledBatch) -> tuple[SampledBatch, Optional[SampledBatch]]:
    """The queue moves one place: ``fresh`` joins at the back, the oldest leaves. in_flight: ``SampledBatch`` with
    a leading [k] axis (oldest first), or None (k = 0: ``fresh`` itself leaves). -> (oldest, the new queue)."""
    if in_flight is None:
        return fresh, None
    oldest = jax.tree.map(lambda queue: queue[0], in_flight)
    queue = jax.tree.map(lambda queue, new: jnp.concatenate([queue[1:], new[None]]), in_flight, fresh)
    return oldest, queue


def fill(program, state: TrainState, prompts: Prompts, keys) -> tuple[TrainState, jax.Array]:
    """The pipeline's first ``k`` batches, sampled and scored by ``state``'s policy: prompts ``Prompts`` with a
    leading [k] axis (i32[k, B / G, P]); keys: [k] sample keys. -> (state with ``in_flight`` of k batches, reward
    failures i32[] summed over them)."""
    def one(_, xs):
        batch_prompts, key = xs
        batch, failures, _ = sampled_batch(program, state, batch_prompts, key)
        return None, (batch, failures)

    _, (queue, failures) = jax.lax.scan(one, None, (prompts, keys))
    return state.replace(in_flight=queue), jnp.sum(failures)
