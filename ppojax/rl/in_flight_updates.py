"""In-flight weight updates (PipelineRL): each batch's decode is spread over k + 1 = ``max_staleness`` + 1 updates,
one chunk of its decode steps per update, each chunk sampled by that update's policy; the KV cache the earlier
chunks wrote is kept across the swap, not recomputed (docs/async.md).

    at update u, with k batches part-decoded in the state's ``in_flight`` (oldest first; batch i has run chunks
    0 .. k - 1 - i, each with the policy of its time):
    fresh            = start(prompts_u) + chunk 0                  # all with the policy of update u
    in_flight[i]    += chunk k - i          for i = 0 .. k - 1
    oldest           = in_flight[0], now fully decoded: scored, then learned by update u
    in_flight        = in_flight[1:] + [fresh]

A batch learned at update u holds tokens of versions u - k .. u (``SampledBatch.policy_versions``, per token): its
first chunk is k versions behind, its last on-policy. The decode work per update is the synchronous run's (k + 1
chunks of about (R - 1) / (k + 1) steps), and every chunk but the oldest batch's last has no data dependence on
the update, so the program is free to overlap them with it. Compared with plain ``max_staleness`` (the whole batch
k versions behind), the tokens are fresher on average; the price is k KV caches kept in the train state.

A batch in flight is the sampler's carry parked rows-first (``ppojax.rl.parked``; stacked: [k, B, ...]), the layout
every other batch in flight has, so the state's shardings, checkpoints and ``vmap`` treat it as they treat those.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ppojax.rl import pipeline, rollout
from ppojax.rl.in_flight_slots import SlotsDecoder
from ppojax.rl.parked import Parked, park, unpark
from ppojax.rl.sampler import (Draw, chunk_ends, continue_decoding, decode_work, empty_cache, occupancy, prefill_slots,
                               slot_alignment_of, start_decoding)
from ppojax.rl.settings import Hyperparams
from ppojax.rl.types import Prompts, TrainState, init_train_state


#: the padded sampler's carry's scalar fields (``ppojax.rl.sampler.Decoding``), repeated per row when parked
DECODING_SCALARS = ("step",)


class Decoder:
    """The policy of ``state`` decoding for ``program`` in chunks: its weights in the compute dtype (placed for the
    decode on a mesh), the draw options, the k + 1 chunks' end steps, the slot alignment its kernels read in."""

    def __init__(self, program, state: TrainState):
        self.sampling = sampling = program.settings.sampling
        self.version = state.update_count
        self.graphdef, weights = program.actor_critic.sampling_policy(state.params, state.frozen)
        self.weights, self.init_cache_fn = rollout.decode_placement(self.graphdef, weights, program.mesh)
        self.slot_alignment = slot_alignment_of(nnx.merge(self.graphdef, self.weights))
        self.draw = Draw(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                         pad_token_id=sampling.pad_token_id, stop_token_id=sampling.stop_token_id,
                         return_logprobs=True)
        self.ends = chunk_ends(sampling.response_length, program.settings.asynchronous.max_staleness + 1)

    def start(self, prompts: Prompts, key) -> Parked:
        """prompts (``Prompts`` of B / G rows, each sampled G = ``num_generations`` times) prefilled and each row's
        token 0 sampled, then chunk 0 decoded."""
        group = self.sampling.num_generations
        decoding = start_decoding(self.graphdef, self.weights, prompts.input_ids, key, self.draw,
                                  response_length=self.sampling.response_length,
                                  cache_dtype=self.sampling.kv_cache_dtype, init_cache_fn=self.init_cache_fn,
                                  group_size=group, version=self.version)
        return self.run_chunk(park(decoding, DECODING_SCALARS, jnp.repeat(prompts.input_ids, group, axis=0),
                                   jnp.repeat(prompts.rows, group, axis=0), key), 0)

    def run_chunk(self, part: Parked, chunk: int) -> Parked:
        """``part`` decoded through chunk ``chunk`` by this policy (its steps up to ``ends[chunk]``)."""
        batch, prompt_length = part.queries.shape
        max_length = prompt_length + self.sampling.response_length
        empty = empty_cache(self.graphdef, self.weights, batch, max_length, self.sampling.kv_cache_dtype,
                            self.init_cache_fn)
        decoding, key = unpark(part, DECODING_SCALARS, empty)
        end = self.ends[chunk]
        # the loop reads only the slots filled by its end, as the unchunked sampler's decode segments do
        decoding = continue_decoding(self.graphdef, self.weights, decoding, key, self.draw, end=end,
                                     slots_read=prefill_slots(prompt_length + end - 1, max_length,
                                                              self.slot_alignment),
                                     version=self.version)
        return park(decoding, DECODING_SCALARS, part.queries, part.rows, key)

    def finish(self, program, state: TrainState, part: Parked) -> tuple[pipeline.SampledBatch, jax.Array, dict]:
        """A fully decoded batch scored -> (SampledBatch, reward failures i32[], ``sampling/slot_occupancy``)."""
        responses = part.state.responses
        batch, failures = pipeline.scored_batch(program, state, jnp.concatenate([part.queries, responses], axis=1),
                                                part.state.logprobs, part.rows, part.state.versions)
        work = decode_work(responses, self.sampling.stop_token_id, responses.shape[0])
        return batch, failures, {rollout.SLOT_OCCUPANCY: occupancy(*work)}


def make_decoder(program, state: TrainState):
    """The chunked decode of ``state``'s policy: on the padded sampler (:class:`Decoder`), or on the continuous one
    with ``rollout_slots`` (``ppojax.rl.in_flight_slots.SlotsDecoder``, chunks cut by sequences done)."""
    if program.settings.sampling.rollout_slots:
        return SlotsDecoder(program, state)
    return Decoder(program, state)


def stacked(parts: list) -> Parked:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)


def unstacked(queue: Parked) -> list:
    k = queue.queries.shape[0]
    return [jax.tree.map(lambda x: x[i], queue) for i in range(k)]


def advance(program, state: TrainState, prompts: Prompts, key
            ) -> tuple[pipeline.SampledBatch, jax.Array, dict, Parked]:
    """One update's sampling: ``state``'s policy starts ``prompts`` and decodes a chunk of each batch in flight; the
    oldest, now whole, is scored. -> (SampledBatch to learn, reward failures i32[], sampling metrics, the new
    queue [k, B, ...])."""
    decoder = make_decoder(program, state)
    queue = unstacked(state.in_flight)
    k = len(queue)
    fresh = decoder.start(prompts, key)
    advanced = [decoder.run_chunk(part, k - i) for i, part in enumerate(queue)]
    batch, failures, metrics = decoder.finish(program, state, advanced[0])
    return batch, failures, metrics, stacked(advanced[1:] + [fresh])


def fill(program, state: TrainState, prompts: Prompts, keys) -> tuple[TrainState, jax.Array]:
    """The first k batches started by ``state``'s policy, as the k updates before update 1 would have left them
    (batch i decoded through chunk k - 1 - i): prompts ``Prompts`` with a leading [k] axis; keys: [k] sample keys.
    -> (state with ``in_flight`` of k part-decoded batches, reward failures i32[]: 0, nothing is scored yet)."""
    decoder = make_decoder(program, state)
    k = program.settings.asynchronous.max_staleness
    parts = []
    for i in range(k):
        part = decoder.start(jax.tree.map(lambda x: x[i], prompts), keys[i])
        for chunk in range(1, k - i):
            part = decoder.run_chunk(part, chunk)
        parts.append(part)
    return state.replace(in_flight=stacked(parts)), jnp.int32(0)


# --------------------------------------------------------------------------------------------------
# Either kind of queue (ppojax.rl.pipeline's sampled batches, or part-decoded ones)
# --------------------------------------------------------------------------------------------------
def fill_queue(program, state: TrainState, prompts: Prompts, keys) -> tuple[TrainState, jax.Array]:
    """An asynchronous run's first k batches into ``state.in_flight``: sampled and scored
    (``ppojax.rl.pipeline.fill``), or part-decoded with in-flight weight updates (:func:`fill`)."""
    if program.settings.asynchronous.in_flight_weight_updates:
        return fill(program, state, prompts, keys)
    return pipeline.fill(program, state, prompts, keys)


def in_flight_shapes(program, params, frozen, prompt_length: int):
    """The ``in_flight`` queue's shapes and dtypes (``jax.ShapeDtypeStruct``s) of an asynchronous program (None for
    a synchronous one), for the state of ``params`` / ``frozen`` (arrays or ``jax.ShapeDtypeStruct``s) and prompts
    of ``prompt_length`` tokens: what ``init_train_state`` gives a fresh state (zeros, until :func:`fill`), what a
    checkpoint is restored into and what the state's shardings are built for."""
    if program.settings.asynchronous is None:
        return None
    k = program.settings.asynchronous.max_staleness
    rows = program.settings.batch.batch_size // program.settings.sampling.num_generations
    prompts = Prompts(jax.ShapeDtypeStruct((k, rows, prompt_length), jnp.int32),
                      jax.ShapeDtypeStruct((k, rows), jnp.int32))
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), k))

    def queue(params, frozen, prompts, keys):
        state = init_train_state(params, program.optimizer, hyperparams=Hyperparams.create(), frozen=frozen)
        return fill_queue(program, state, prompts, keys)[0].in_flight

    return jax.eval_shape(queue, params, frozen, prompts, keys)
