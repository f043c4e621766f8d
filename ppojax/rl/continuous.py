"""Continuous batching inside the compiled decode loop: ``S`` slots decode the ``B`` sequences of a batch.

:func:`ppojax.rl.sampler.generate` decodes every row until the LAST row is done: its decode work is
``B x (longest response)``. :func:`generate_continuous` keeps ``S < B`` slots, each holding one sequence at a
time: when a slot's sequence ends (its stop token, or ``response_length`` tokens), the next waiting prompt of
the batch (in order) is prefilled into that slot. The decode work follows the SUM of the response lengths
(about ``sum(lengths) / S`` steps of ``S`` rows) instead of ``B x max(lengths)``: it pays when the lengths are
long-tailed (a few long responses, many short ones).

One jitted program with static shapes: an outer ``lax.while_loop`` whose body decodes one token in every slot,
then an inner ``lax.while_loop`` that prefills waiting prompts into the freed slots, one ``[1, P]`` forward
each (zero iterations when no slot is free). The loop ends when every sequence is done.

The cache. The slots share one ``KVCache`` of ``S`` rows whose ``index`` is i32[S], one write position per
row (``ppojax.models.kv_cache.write_slots``): a slot's sequence starts at slot position 0 whatever the
others are doing, so each row of the cache is laid out exactly as the padded sampler lays out that sequence's
row (the prompt in ``[0, P)``, token ``t`` at ``P + t - 1``), the cache needs ``P + R`` positions like the
padded sampler's, and sliding windows (counted in cache positions) see what they see there. A refill prefills
the prompt on a fresh one-row cache and copies that row over the slot's (keys, values, key mask: nothing of
the previous sequence survives) and sets the slot's index to ``P``. A shared index would need every new
sequence to start at the current wall step: a cache as long as the whole schedule.

Same tokens as the padded sampler. Row ``b``'s token ``t`` draws with ``fold_in(fold_in(key, t), b)``
(``ppojax.rl.sampler.row_keys``) in both samplers, and every other input of a sequence's step (its tokens,
positions, cache row) is the same, so each sequence gets the padded sampler's tokens, up to the float
rounding of computing a row in a batch of another shape (one-row prefills, ``S``-row decode steps).

Output: the padded sampler's layout, responses i32[B, R] in the prompts' order (pad after the stop token) and
with ``return_logprobs`` the f32[B, R] log-probs, so everything downstream is unchanged.

Sharding. On a mesh, :func:`generate_continuous_per_shard` runs the loop on each data-parallel shard apart: the
shard's rows, its own slots, its own refills (no prompt or cache row crosses shards, and a shard whose responses
are short stops early instead of waiting for the others' refills). Each row keeps its index in the whole batch for
its keys, so the tokens do not depend on the mesh.
"""
from __future__ import annotations

import functools
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from ppojax.parallel import batch_partition_spec

from ppojax.rl.sampler import (cache_dtype_for, copy_into_rows, decode_step, init_model_cache, model_kernels,
                               prefill_one_row, row_keys, sample_rows, token_logprobs)


@flax.struct.dataclass
class Slots:
    """The decode loop's carry. S slots, B sequences, R response tokens.

    cache: KVCache of S rows, index i32[S]; row: i32[S] the sequence each slot holds (B: none left);
    t: i32[S] the index of the token the slot samples next; token: i32[S] its last sampled token (fed next);
    position: i32[S] that token's position (real tokens before it); live: bool[S] the slot holds an unfinished
    sequence; next_row: i32[] the first prompt not started; responses: i32[B, R]; logprobs: f32[B, R] (f32[B, 0]
    when not asked for); steps: i32[] decode steps run; versions: i32[B, R] the policy version that sampled each
    token (i32[B, 0] when not tracked)."""

    cache: object
    row: jax.Array
    t: jax.Array
    token: jax.Array
    position: jax.Array
    live: jax.Array
    next_row: jax.Array
    responses: jax.Array
    logprobs: jax.Array
    steps: jax.Array
    versions: jax.Array

    @property
    def finished_rows(self) -> jax.Array:
        """i32[]: the sequences started and done."""
        return self.next_row - jnp.sum(self.live, dtype=jnp.int32)


class SlotLoop:
    """The continuous sampler's pieces for one policy and one batch of prompts: :meth:`fresh` (the slots filled with
    the first prompts) and :meth:`run` (decode steps until a number of sequences are done). Options as
    :func:`generate_continuous`'s; version: the policy version recorded for each token sampled (None: not tracked)."""

    def __init__(self, graphdef, params, prompt_ids, key, *, response_length, pad_token_id, temperature=1.0, top_k=0,
                 top_p=1.0, greedy=False, stop_token_id=None, cache_dtype=None, return_logprobs=False, first_row=0,
                 version=None):
        if response_length < 1:
            raise ValueError(f"response_length={response_length}; expected >= 1")
        self.graphdef, self.params, self.prompt_ids, self.key = graphdef, params, prompt_ids, key
        self.batch, prompt_length = prompt_ids.shape
        self.response_length, self.pad_token_id, self.stop_token_id = response_length, pad_token_id, stop_token_id
        self.temperature, self.return_logprobs, self.first_row, self.version = (temperature, return_logprobs,
                                                                                 first_row, version)
        self.model = nnx.merge(graphdef, params)
        self.sample = functools.partial(sample_rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                        greedy=greedy, argmax=model_kernels(self.model).argmax)
        self.pad = jnp.asarray(pad_token_id, jnp.int32)
        self.dtype = cache_dtype_for(self.model, params, cache_dtype)
        self.max_length = prompt_length + response_length

    def fresh(self, slots, init_cache_fn=None) -> Slots:
        """``slots`` slots (at most B), each holding one of the first prompts, its token 0 sampled."""
        num_slots, batch = min(slots, self.batch), self.batch
        cache = (init_cache_fn or init_model_cache)(self.model, num_slots, self.max_length, self.dtype)
        empty = jnp.zeros((num_slots,), jnp.int32)
        return self.refill(Slots(
            cache=cache.replace(index=empty), row=empty + batch, t=empty, token=empty + self.pad, position=empty,
            live=jnp.zeros((num_slots,), bool), next_row=jnp.int32(0),
            responses=jnp.full((batch, self.response_length), self.pad, jnp.int32),
            logprobs=jnp.zeros((batch, self.response_length if self.return_logprobs else 0), jnp.float32),
            steps=jnp.int32(0),
            versions=jnp.zeros((batch, self.response_length if self.version is not None else 0), jnp.int32)))

    def run(self, state: Slots, until_finished) -> Slots:
        """Decode steps (each followed by refills) until ``until_finished`` (i32[] or int) sequences are done, or
        all of them."""
        return jax.lax.while_loop(lambda s: jnp.any(s.live) & (s.finished_rows < until_finished), self.decode, state)

    def finished(self, token, t):
        """bool[S]: the sequence is done after sampling `token` as its token `t - 1`."""
        done = t >= self.response_length
        return done if self.stop_token_id is None else done | (token == self.stop_token_id)

    def record(self, state, rows, t, token, logits):
        """Write each slot's token t into its sequence's row (rows == B: dropped)."""
        responses = state.responses.at[rows, t].set(token, mode="drop")
        logprobs, versions = state.logprobs, state.versions
        if self.return_logprobs:
            logprobs = logprobs.at[rows, t].set(token_logprobs(logits, token, self.temperature), mode="drop")
        if self.version is not None:
            versions = versions.at[rows, t].set(self.version, mode="drop")
        return state.replace(responses=responses, logprobs=logprobs, versions=versions)

    def refill_one(self, state):
        """Prefill the next waiting prompt into the first free slot and sample its token 0."""
        slot = jnp.argmax(~state.live).astype(jnp.int32)
        b = state.next_row
        prompt = jax.lax.dynamic_slice_in_dim(self.prompt_ids, b, 1, axis=0)  # [1, P]
        logits, one, real_tokens = prefill_one_row(self.model, prompt, self.pad_token_id, self.max_length,
                                                   self.dtype)  # [1, V]
        token = self.sample(logits, row_keys(self.key, 0, self.first_row + b[None]))  # [1]
        state = self.record(state, b[None], jnp.zeros((1,), jnp.int32), token, logits)
        one_t = jnp.ones((1,), jnp.int32)
        return state.replace(
            cache=copy_into_rows(state.cache, one, slot), row=state.row.at[slot].set(b), t=state.t.at[slot].set(1),
            token=state.token.at[slot].set(token[0]), position=state.position.at[slot].set(real_tokens),
            live=state.live.at[slot].set(~self.finished(token, one_t)[0]), next_row=b + 1)

    def refill(self, state):
        """Fill the free slots with waiting prompts (a sequence done at its token 0 frees its slot again)."""
        return jax.lax.while_loop(lambda s: jnp.any(~s.live) & (s.next_row < self.batch), self.refill_one, state)

    def decode(self, state):
        """One token in every slot (a free slot's row is computed and thrown away), then refill."""
        fed = jnp.where(state.live, state.token, self.pad)
        logits, cache, fed_live = decode_step(self.graphdef, self.params, state.cache, fed, state.position,
                                              self.pad_token_id)
        token = jnp.where(state.live, self.sample(logits, row_keys(self.key, state.t, self.first_row + state.row)),
                          self.pad)
        state = self.record(state, jnp.where(state.live, state.row, self.batch), state.t, token, logits)
        t = state.t + 1
        state = state.replace(cache=cache, t=t, token=token, position=state.position + fed_live.astype(jnp.int32),
                              live=state.live & ~self.finished(token, t), steps=state.steps + 1)
        return self.refill(state)


def generate_continuous(graphdef, params, prompt_ids, key, *, slots, response_length, pad_token_id,
                        temperature=1.0, top_k=0, top_p=1.0, greedy=False, stop_token_id=None, cache_dtype=None,
                        init_cache_fn=None, return_logprobs=False, return_steps=False, first_row=0):
    """:func:`ppojax.rl.sampler.generate` with ``slots`` sequences decoded at a time. Pure; call it under jit.

    prompt_ids: i32[B, P] left padded; key, temperature and the static options as ``generate``'s (row b's token
    t draws with ``fold_in(fold_in(key, t), b)``). slots: S, static; more slots than rows are not needed (S is
    capped at B). init_cache_fn builds the S-row slot cache (its index is replaced by one per row); refills use
    a plain one-row cache. Returns what ``generate`` returns (responses i32[B, R] in the prompts' order, and
    f32[B, R] log-probs with ``return_logprobs``); with ``return_steps`` also the decode steps the loop ran
    (i32[], the prefills not counted): ``(out, steps)``. first_row: the index row 0 has in the whole batch
    (may be traced; a shard's rows, :func:`generate_continuous_per_shard`): row b draws as row first_row + b.
    """
    if slots < 1:
        raise ValueError(f"slots={slots}; expected >= 1 (or use ppojax.rl.sampler.generate)")
    loop = SlotLoop(graphdef, params, prompt_ids, key, response_length=response_length, pad_token_id=pad_token_id,
                    temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, stop_token_id=stop_token_id,
                    cache_dtype=cache_dtype, return_logprobs=return_logprobs, first_row=first_row)
    state = loop.run(loop.fresh(slots, init_cache_fn), prompt_ids.shape[0])
    out = (state.responses, state.logprobs) if return_logprobs else state.responses
    return (out, state.steps) if return_steps else out


def generate_continuous_per_shard(graphdef, params, prompt_ids, key, *, mesh, slots, return_logprobs=False,
                                  **options):
    """:func:`generate_continuous` on each data-parallel shard of ``mesh`` apart: shard i decodes its own rows (its
    block of ``prompt_ids`` over the batch axes, ``ppojax.parallel.batch_partition_spec``) in ceil(S / n) slots of
    its own, refilled from its own waiting rows, with no communication between shards (``jax.shard_map`` over the
    batch axes; the other mesh axes stay with the compiler). Each row draws with its index in the whole batch, so
    the tokens are :func:`generate_continuous`'s on one device (up to float rounding).

    params: replicated over the batch axes (the sampler reads them gathered, ``GENERATE_RULES``); prompt_ids
    i32[B, P] with B a multiple of the n shards; options: :func:`generate_continuous`'s (``init_cache_fn`` is not
    taken: each shard's cache is its own). -> (what ``generate_continuous`` returns, the decode steps of each
    shard i32[n], the slots of each shard)."""
    spec = batch_partition_spec(mesh)
    axes = tuple(spec[0]) if len(spec) else ()
    shards = math.prod(mesh.shape[a] for a in axes)
    rows, local_slots = prompt_ids.shape[0] // shards, -(-slots // shards)
    rows_spec, replicated = PartitionSpec(axes), PartitionSpec()

    def local(params, prompt_ids, key):
        first_row = jax.lax.axis_index(axes) * rows
        out, steps = generate_continuous(graphdef, params, prompt_ids, key, slots=local_slots, first_row=first_row,
                                         return_logprobs=return_logprobs, return_steps=True, **options)
        return out, steps[None]

    out_spec = (rows_spec, rows_spec) if return_logprobs else rows_spec
    per_shard = jax.shard_map(local, mesh=mesh, in_specs=(replicated, rows_spec, replicated),
                              out_specs=(out_spec, rows_spec), axis_names=frozenset(axes), check_vma=False)
    out, steps = per_shard(params, prompt_ids, key)
    return out, steps, min(local_slots, rows)


CONTINUOUS_STATIC = ("graphdef", "slots", "response_length", "pad_token_id", "top_k", "top_p", "greedy",
                     "stop_token_id", "cache_dtype", "init_cache_fn", "return_logprobs", "return_steps")

#: ``generate_continuous`` compiled: one program per (graphdef, prompt shape, static options).
generate_continuous_jit = jax.jit(generate_continuous, static_argnames=CONTINUOUS_STATIC)
