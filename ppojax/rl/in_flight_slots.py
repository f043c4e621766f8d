"""In-flight weight updates on the continuous sampler (``rollout_slots``; ``ppojax.rl.in_flight_updates`` for the
pipeline): a batch's S slots keep decoding across the k + 1 updates before it is learned, each update's policy
swapped into the running slots, their KV cache kept.

The continuous sampler has no fixed step at which every row is equally far, so its chunks are cut by work done
instead of steps: chunk j runs decode steps (and refills) until ceil(B (j + 1) / (k + 1)) of the batch's sequences
are done, the last chunk until all are. The sequences in the slots at a chunk's end go on with the next update's
policy; each token records the version that sampled it.

On a mesh with n data-parallel shards each shard runs its own slots on its own rows (as
``ppojax.rl.continuous.generate_continuous_per_shard``): ceil(S / n) slots, its own chunk targets, no
communication between shards. The parked carry (``ppojax.rl.parked``) is rows-first, slot leaves [n x S / n, ...]
and row leaves [B, ...], so a shard's block of each is its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ppojax import parallel
from ppojax.rl import pipeline, rollout
from ppojax.rl.continuous import SlotLoop
from ppojax.rl.parked import Parked, park, unpark
from ppojax.rl.sampler import decode_work, empty_cache, occupancy
from ppojax.rl.types import Prompts, TrainState


#: the continuous sampler's carry's scalar fields (``ppojax.rl.continuous.Slots``), repeated per slot when parked
SLOTS_SCALARS = ("next_row", "steps")


class SlotsDecoder:
    """``ppojax.rl.in_flight_updates.Decoder``'s interface (start, run_chunk, finish) on the continuous sampler."""

    def __init__(self, program, state: TrainState):
        self.sampling = sampling = program.settings.sampling
        self.version = state.update_count
        self.chunks = program.settings.asynchronous.max_staleness + 1
        self.graphdef, weights = program.actor_critic.sampling_policy(state.params, state.frozen)
        self.weights, _ = rollout.decode_placement(self.graphdef, weights, program.mesh)
        mesh = program.mesh
        self.shards = parallel.data_parallel_size(mesh) if mesh is not None else 1
        self.mesh = mesh if self.shards > 1 else None
        self.local_slots = -(-sampling.rollout_slots // self.shards)
        self.options = dict(response_length=sampling.response_length, pad_token_id=sampling.pad_token_id,
                            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            stop_token_id=sampling.stop_token_id, cache_dtype=sampling.kv_cache_dtype,
                            return_logprobs=True)

    def _per_shard(self, local, *args):
        """``local(weights, first_row, *args)`` on each data-parallel shard's block of ``args`` (rows-first), or
        once on everything without a mesh."""
        if self.mesh is None:
            return local(self.weights, 0, *args)
        axes = tuple(parallel.batch_partition_spec(self.mesh)[0])
        rows_spec = PartitionSpec(axes)
        batch = jax.tree.leaves(args)[0].shape[0]

        def on_shard(weights, *args):
            return local(weights, jax.lax.axis_index(axes) * (batch // self.shards), *args)

        specs = tuple(rows_spec for _ in args)  # every leaf rows-first
        return jax.shard_map(on_shard, mesh=self.mesh, in_specs=(PartitionSpec(), *specs), out_specs=rows_spec,
                             axis_names=frozenset(axes), check_vma=False)(self.weights, *args)

    def _target(self, rows: int, chunk: int) -> int:
        return -(-rows * (chunk + 1) // self.chunks)

    def _loop(self, weights, queries, key, first_row):
        return SlotLoop(self.graphdef, weights, queries, key, first_row=first_row, version=self.version,
                        **self.options)

    def start(self, prompts: Prompts, key) -> Parked:
        """prompts (``Prompts`` of B / G rows, each sampled G times) into the slots, then chunk 0."""
        group = self.sampling.num_generations
        queries = jnp.repeat(prompts.input_ids, group, axis=0)
        rows = jnp.repeat(prompts.rows, group, axis=0)
        key_data = jnp.broadcast_to(jax.random.key_data(key), (queries.shape[0],) + jax.random.key_data(key).shape)

        def local(weights, first_row, queries, rows, key_data):
            key = jax.random.wrap_key_data(key_data[0])
            loop = self._loop(weights, queries, key, first_row)
            state = loop.run(loop.fresh(self.local_slots), self._target(queries.shape[0], 0))
            return park(state, SLOTS_SCALARS, queries, rows, key)

        return self._per_shard(local, queries, rows, key_data)

    def run_chunk(self, part: Parked, chunk: int) -> Parked:
        """``part``'s slots decoded by this policy until chunk ``chunk``'s share of the sequences is done."""
        def local(weights, first_row, part):
            slots, batch = part.state.row.shape[0], part.queries.shape[0]
            empty = empty_cache(self.graphdef, weights, slots, part.queries.shape[1] + self.sampling.response_length,
                                self.sampling.kv_cache_dtype)  # one write index per slot, as the loop keeps it
            state, key = unpark(part, SLOTS_SCALARS, empty.replace(index=jnp.zeros((slots,), jnp.int32)))
            state = self._loop(weights, part.queries, key, first_row).run(state, self._target(batch, chunk))
            return park(state, SLOTS_SCALARS, part.queries, part.rows, key)

        return self._per_shard(local, part)

    def finish(self, program, state: TrainState, part: Parked) -> tuple[pipeline.SampledBatch, jax.Array, dict]:
        """A fully decoded batch scored -> (SampledBatch, reward failures i32[], ``sampling/slot_occupancy``): the
        decode work of every shard's steps times its slots (each slot holds its shard's step count)."""
        slots = part.state
        query_responses = jnp.concatenate([part.queries, slots.responses], axis=1)
        batch, failures = pipeline.scored_batch(program, state, query_responses, slots.logprobs, part.rows,
                                                slots.versions)
        work = decode_work(slots.responses, self.sampling.stop_token_id, 1, jnp.sum(slots.steps))
        return batch, failures, {rollout.SLOT_OCCUPANCY: occupancy(*work)}

