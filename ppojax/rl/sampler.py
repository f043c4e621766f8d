"""KV-cache sampler: a jitted prefill over left-padded prompts, then a ``lax.while_loop`` decode.

Everything here is a pure function of ``(graphdef, params, prompt_ids, key)`` with static shapes, so it
can be traced inside a bigger jitted rollout; :func:`generate_jit` is the stand-alone compiled entry
point (one compilation per prompt shape and option set).

Conventions (docs/algorithm.md, "Conventions" and "Rollout" step 1):

- prompts are LEFT padded with ``pad_token_id``; ``attention_mask = token != pad``; ``position_ids`` is
  the exclusive cumulative sum of the mask (first real token at position 0); pad ids become 0 before
  the embedding.
- Generated tokens continue the same convention: a generated token gets the position "number of real
  tokens before it", and a generated token equal to ``pad_token_id`` is a masked key, exactly as the
  forward pass that later recomputes the log-probs sees it (so the sampling distribution and the
  recomputed behaviour log-probs agree even in that corner case).
- sampling distribution: ``softmax(logits / (temperature + 1e-7))`` in float32, then top-k (0 = off),
  then top-p (1.0 = off); ``greedy`` takes the argmax.
- with a stop token, a sequence is done after it emits it; later positions hold ``pad_token_id``. The
  decode loop exits as soon as every sequence is done (the output keeps its static shape ``[B, R]``).
- row ``b``'s token ``t`` (0 = the token sampled from the prefill) draws with the key
  ``fold_in(fold_in(key, t), b)`` (:func:`row_keys`): its noise depends on the sequence and the token's place
  only, never on the batch shape, so a sampler that decodes the rows in another schedule
  (``ppojax.rl.continuous``) draws the same tokens.
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from ppojax.core.masks import first_true_indices
from ppojax.models import XLA, Kernels, init_cache
from ppojax.rl.forward import TEMPERATURE_EPS, sequence_inputs, split_shared_prefix


# --------------------------------------------------------------------------------------------------
# Sampling from one step's logits
# --------------------------------------------------------------------------------------------------
def process_logits(logits, *, temperature=1.0, top_k=0, top_p=1.0):
    """The sampler's log-weights: temperature-scaled logits with the top-k / top-p cut set to -inf.

    logits: f[B, V] -> f32[B, V]. ``softmax`` of the result is the distribution :func:`sample_logits`
    draws from. ``top_k=0`` and ``top_p=1.0`` are off. Ties at the top-k / top-p boundary are kept.
    top-p keeps the smallest set of most likely tokens whose probability mass reaches ``top_p``
    (computed after temperature and top-k, as in transformers).
    """
    logits = logits.astype(jnp.float32) / (temperature + TEMPERATURE_EPS)
    vocab = logits.shape[-1]
    if top_k and top_k < vocab:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumsum
        # A token is kept while the mass of the more likely tokens has not reached top_p yet; the most
        # likely token always is (mass_before == 0 < top_p).
        num_kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


def token_logprobs(logits, tokens, temperature):
    """logits f[B, V], tokens i32[B] -> f32[B]: each row's token's log-prob under ``logits / (temperature +
    1e-7)``, unfiltered, computed as the forward computes it (``ppojax.rl.forward.logprobs_from_hidden``)."""
    scaled = logits.astype(jnp.float32) * (1.0 / (temperature + TEMPERATURE_EPS))
    chosen = jnp.take_along_axis(scaled, tokens[:, None].astype(jnp.int32), axis=-1, mode="clip")[:, 0]
    return chosen - jax.nn.logsumexp(scaled, axis=-1)


def plain_argmax(x):
    """x: f[..., V] -> i32[...]: ``jnp.argmax`` along the last axis (ties to the lowest index; a NaN counts as the
    largest); the default of the draws below (a model's kernels may have a faster form, ``Kernels.argmax``)."""
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def sample_logits(logits, key, *, temperature=1.0, top_k=0, top_p=1.0, greedy=False, argmax=plain_argmax):
    """Draw one token per row. logits: f[B, V], key: a PRNG key -> i32[B].

    The draw is ``jax.random.categorical``'s (Gumbel-max with the same noise, so the same token for the same
    key), its argmax taken by ``argmax`` (the model's ``kernels.argmax``, or :func:`plain_argmax`)."""
    if greedy:
        return argmax(logits)
    weights = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return argmax(jax.random.gumbel(key, weights.shape, weights.dtype) + weights)


def sample_rows(logits, keys, *, temperature=1.0, top_k=0, top_p=1.0, greedy=False, argmax=plain_argmax):
    """Draw one token per row, each row with its own key. logits: f[B, V], keys: PRNG keys [B] -> i32[B].

    Row b's token is ``jax.random.categorical(keys[b], weights[b])`` (weights: :func:`process_logits`), so it
    does not depend on the other rows. Only the noise is drawn row by row (vmapped); the argmax stays one
    ``argmax`` over [B, V] (as :func:`sample_logits`; a kernel's argmax need not vmap well)."""
    if greedy:
        return argmax(logits)
    weights = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, weights.shape[-1:], weights.dtype))(keys)
    return argmax(noise + weights)


def row_keys(key, step, rows):
    """key: a PRNG key, step: i32[] or i32[B], rows: i32[B] -> keys [B]: ``fold_in(fold_in(key, t), b)`` for
    each row's token index t and sequence index b (the samplers' key of a sequence's t-th token)."""
    step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), jnp.shape(rows))
    return jax.vmap(lambda t, b: jax.random.fold_in(jax.random.fold_in(key, t), b))(step, rows)


# --------------------------------------------------------------------------------------------------
# The model's KV cache
# --------------------------------------------------------------------------------------------------
def _model_config(model):
    for name in ("cfg", "config"):
        cfg = getattr(model, name, None)
        if cfg is not None:
            return cfg
    raise TypeError(f"{type(model).__name__} has no `cfg` attribute; generate() needs the model config to "
                    "build its KV cache (ppojax.models.CausalLM keeps it as `model.cfg`).")


def cache_dtype_for(model, params, cache_dtype):
    """The KV cache dtype: as given, else the model's compute dtype, else the params' float dtype."""
    if cache_dtype is not None:
        return cache_dtype
    if getattr(model, "dtype", None) is not None:
        return model.dtype
    floats = [x.dtype for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return floats[0] if floats else jnp.float32


def model_kernels(model) -> Kernels:
    """The backend operations a model runs (``CausalLM.kernels``; XLA's for a stand-in without them)."""
    return getattr(model, "kernels", XLA)


def init_model_cache(model, batch_size, max_length, dtype):
    return init_cache(_model_config(model), batch_size, max_length, dtype, model_kernels(model))


def empty_cache(graphdef, params, batch_size, max_length, cache_dtype=None, init_cache_fn=None):
    """An empty KV cache of ``batch_size`` rows and ``max_length`` slots as :func:`generate` makes it for the model
    ``nnx.merge(graphdef, params)``: ``cache_dtype`` (default: the model's compute dtype) in the kernels' storage
    form, placed by ``init_cache_fn`` where given."""
    model = nnx.merge(graphdef, params)
    dtype = cache_dtype_for(model, params, cache_dtype)
    return (init_cache_fn or init_model_cache)(model, batch_size, max_length, dtype)


def prefill_one_row(model, prompt, pad_token_id, max_length, dtype):
    """One prompt i32[1, P] (left padded) through the model on a fresh one-row cache of ``max_length`` slots ->
    (its next-token logits f32[1, V], the cache, the prompt's real tokens i32[]): what a slot takes in when a
    sampler refills it (:func:`copy_into_rows`)."""
    one = init_model_cache(model, 1, max_length, dtype).replace(
        read_length=prefill_slots(prompt.shape[1], max_length, slot_alignment_of(model)))
    last, one, real = prefill(model, prompt, pad_token_id, one)
    return model.logits(last)[:, 0], one, real[0]


def prefill(model, prompt_ids, pad_token_id, cache, prefix_length: int = 0):
    """Left-padded prompts i32[N, P] through the model into the empty N-row ``cache`` -> (the hidden state of each
    row's last token f[N, 1, D], the cache, each row's real tokens i32[N]).

    prefix_length q > 0: every row's first q real tokens are the same (a system message, a tool's schema): they go
    through the model ONCE, on one row, and their keys and values are copied into every row's first q slots; each
    row's rest follows at slots q on (``ppojax.rl.forward.split_shared_prefix``; the padding between is masked and
    positions count real tokens only), so every token sees what a plain prefill shows it, to float rounding."""
    cache, rest, real = prefill_shared_prefix(model, prompt_ids, pad_token_id, cache, prefix_length)
    hidden, cache = model(*rest, cache=cache)
    return hidden[:, -1:], cache, real


def prefill_shared_prefix(model, prompt_ids, pad_token_id, cache, prefix_length: int = 0):
    """The first half of :func:`prefill`: the shared prefix (q = ``prefix_length`` > 0) through the model once and
    copied into every row of ``cache`` -> (the cache, what is left to feed: (input_ids, attention_mask,
    position_ids), each [N, P - q] (q = 0: the whole prompts, [N, P]), each row's real tokens i32[N]). Feeding the
    rest, in one call or in row blocks, completes the prefill."""
    input_ids, attention_mask, position_ids = sequence_inputs(prompt_ids, pad_token_id)
    real = jnp.sum(attention_mask, axis=-1, dtype=jnp.int32)
    if not prefix_length:
        return cache, (input_ids, attention_mask, position_ids), real
    prefix, rest = split_shared_prefix(input_ids, attention_mask, position_ids, prefix_length)
    one = cache_rows(cache, jnp.zeros((1,), jnp.int32)).replace(read_length=cache.read_length)
    _, one = model(*prefix, cache=one)
    cache = copy_into_rows(cache, cache_rows(one, jnp.zeros((prompt_ids.shape[0],), jnp.int32)))
    return cache, rest, real


def cache_rows(cache, rows, cache_length: int | None = None):
    """Rows ``rows`` (i32[n]) of ``cache`` as a cache of n rows: their keys, values, key mask and write index; with
    ``cache_length``, that many slots, those past ``cache``'s own empty (as a fresh cache's), else ``cache``'s slots.
    E.g. a bank of prefilled prompts: the rows that start from them (:func:`copy_into_rows` writes them in)."""
    extra = 0 if cache_length is None else cache_length - cache.max_length

    def take(x, batch_axis):  # the slot axis follows the batch axis in keys, values and the key mask
        widths = [(0, 0)] * x.ndim
        widths[batch_axis + 1] = (0, extra)
        return jnp.pad(jnp.take(x, rows, axis=batch_axis), widths)

    index = cache.index if jnp.ndim(cache.index) == 0 else cache.index[rows]
    return cache.replace(keys=take(cache.keys, 1), values=take(cache.values, 1), key_mask=take(cache.key_mask, 0),
                         index=index, read_length=None)


def copy_into_rows(cache, part, start=0):
    """``cache`` (B rows) with rows ``[start, start + n)`` replaced by the n-row cache ``part``: its keys, values
    and key mask from the first slot (a part of fewer slots leaves the rest of those rows as they were) and its
    write index. ``cache``'s index is one per row (i32[B]), or i32[] when ``part`` is the whole batch (then the
    result takes ``part``'s index, one per row or one for all). The writes are in place: ``cache`` is the buffer
    (and the placement on a mesh) the result lives in."""
    rows = part.key_mask.shape[0]

    def put(into, new, batch_axis):
        starts = [0] * into.ndim
        starts[batch_axis] = start
        return jax.lax.dynamic_update_slice(into, new.astype(into.dtype), starts)

    if cache.index.ndim == 0:
        if rows != cache.key_mask.shape[0]:
            raise ValueError(f"a cache with one write index takes a whole batch of {cache.key_mask.shape[0]} rows, "
                             f"not {rows}")
        index = part.index
    else:
        index = jax.lax.dynamic_update_slice(cache.index, jnp.broadcast_to(part.index, (rows,)).astype(jnp.int32),
                                             (start,))
    return cache.replace(keys=put(cache.keys, part.keys, 1), values=put(cache.values, part.values, 1),
                         key_mask=put(cache.key_mask, part.key_mask, 0), index=index)


# --------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------
#: slots read are rounded up to a multiple of this where no model says otherwise: the slot axis is the minor one of
#: a TPU's cache layout, whose tiles hold 128 lanes, and a loop body of its own is worth its compile only where it
#: reads that many fewer slots. A sampler takes its model's kernels' ``slot_alignment`` (:func:`slot_alignment_of`).
SLOT_ALIGNMENT = XLA.slot_alignment


def slot_alignment_of(model, alignment: int | None = None) -> int:
    """``alignment``, or where None the one the model's kernels read the cache in (``Kernels.slot_alignment``)."""
    return alignment or model_kernels(model).slot_alignment


def aligned_slots(slots: int, max_length: int, alignment: int) -> int:
    return min(max_length, -(-slots // alignment) * alignment)


def prefill_slots(prompt_length: int, max_length: int, alignment: int = SLOT_ALIGNMENT) -> int:
    """The cache slots a prefill of ``prompt_length`` tokens reads: its own (aligned), not the empty rest."""
    return aligned_slots(prompt_length, max_length, alignment)


def decode_segments(prompt_length: int, response_length: int, segments: int,
                    alignment: int = SLOT_ALIGNMENT) -> list[tuple[int, int]]:
    """The decode loop cut into ``segments`` loops of about equal steps: ``[(end step, slots read)]``.

    Decode step t (1 <= t < R) writes its token's keys and values at slot P + t - 1, so the loop over the steps
    before ``end`` needs only the first P + end - 1 slots of the cache (rounded up to ``alignment``; at
    most P + R): each loop's attention reads no more (the cache's ``read_length``). The last loop reads all.
    Neighbours that would read as many slots are one loop (a short cache has fewer segments than asked)."""
    if segments < 1:
        raise ValueError(f"decode_segments={segments}; expected >= 1")
    steps, slots = response_length - 1, prompt_length + response_length
    ends = sorted({1 + -(-steps * (k + 1) // segments) for k in range(segments)} - {1})
    plan = [(end, aligned_slots(prompt_length + end - 1, slots, alignment)) for end in ends]
    return [(end, read) for i, (end, read) in enumerate(plan) if i + 1 == len(plan) or plan[i + 1][1] != read]


@flax.struct.dataclass
class Decoding:
    """A padded decode in progress (:func:`start_decoding`, :func:`continue_decoding`): B rows, R response tokens.

    cache: the KVCache of B rows (its ``read_length`` as the last loop left it); step: i32[] the index of the next
    token to sample (1 after the prefill); responses: i32[B, R] (pad where not sampled yet or after the stop token);
    logprobs: f32[B, R] the sampled tokens' log-probs (f32[B, 0] when not kept); token: i32[B] the last sampled
    token (fed next); done: bool[B]; next_position: i32[B] the real tokens seen so far (the fed token's position);
    versions: i32[B, R] the policy version that sampled each token (i32[B, 0] when not tracked).
    """

    cache: object
    step: jax.Array
    responses: jax.Array
    logprobs: jax.Array
    token: jax.Array
    done: jax.Array
    next_position: jax.Array
    versions: jax.Array


@flax.struct.dataclass
class Draw:
    """How a decode draws its tokens (``generate``'s options of the same names): temperature (float or traced
    f32[]), top_k (0 = off), top_p (1.0 = off), greedy, pad_token_id, stop_token_id (None = never stop),
    return_logprobs (keep each sampled token's log-prob). All static but ``temperature``."""

    temperature: object
    top_k: int = flax.struct.field(pytree_node=False, default=0)
    top_p: float = flax.struct.field(pytree_node=False, default=1.0)
    greedy: bool = flax.struct.field(pytree_node=False, default=False)
    pad_token_id: int = flax.struct.field(pytree_node=False, default=0)
    stop_token_id: object = flax.struct.field(pytree_node=False, default=None)
    return_logprobs: bool = flax.struct.field(pytree_node=False, default=False)

    def sampler(self, model):
        return functools.partial(sample_rows, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                 greedy=self.greedy, argmax=model_kernels(model).argmax)


def start_decoding(graphdef, params, prompt_ids, key, draw: Draw, *, response_length, cache_dtype=None,
                   init_cache_fn=None, slot_alignment=None, group_size=1, version=None,
                   prefix_length=0) -> Decoding:
    """The prefill and each row's token 0 -> the ``Decoding`` at step 1. prompt_ids: i32[B / G, P] left padded;
    each prompt is prefilled ONCE and its keys and values serve its G = ``group_size`` rows (consecutive). The
    cache holds P + R positions. Options as :func:`generate`'s; version: the policy version recorded for each token
    sampled (i32[] or int; None: versions not tracked); prefix_length: the prompts' shared first tokens, prefilled
    once (:func:`prefill`)."""
    prompts, prompt_length = prompt_ids.shape
    batch = prompts * group_size
    if response_length < 1:
        raise ValueError(f"response_length={response_length}; expected >= 1")
    model = nnx.merge(graphdef, params)
    init_cache_fn = init_cache_fn or init_model_cache
    pad = jnp.asarray(draw.pad_token_id, jnp.int32)
    dtype = cache_dtype_for(model, params, cache_dtype)
    cache = init_cache_fn(model, prompts, prompt_length + response_length, dtype)
    # the prefill reads (and attends over) the prompt's own slots only
    prefill_reads = prefill_slots(prompt_length, cache.max_length, slot_alignment_of(model, slot_alignment))
    last, cache, real = prefill(model, prompt_ids, draw.pad_token_id, cache.replace(read_length=prefill_reads),
                                prefix_length)
    logits = model.logits(last)[:, 0]
    if group_size > 1:
        # each prompt's row taken G times (its G rows consecutive), written into an empty cache of B rows: its
        # placement on a mesh
        repeated = cache_rows(cache, jnp.arange(batch, dtype=jnp.int32) // group_size)
        cache = copy_into_rows(init_cache_fn(model, batch, cache.max_length, dtype), repeated)
        logits, real = (jnp.repeat(x, group_size, axis=0) for x in (logits, real))
    token = draw.sampler(model)(logits, row_keys(key, 0, jnp.arange(batch, dtype=jnp.int32)))
    done = jnp.zeros((batch,), bool) if draw.stop_token_id is None else token == draw.stop_token_id
    # the sampled tokens' log-probs f32[B, R]; f32[B, 0] (free to carry) when not asked for
    logprobs = jnp.zeros((batch, response_length if draw.return_logprobs else 0), jnp.float32)
    if draw.return_logprobs:
        logprobs = logprobs.at[:, 0].set(token_logprobs(logits, token, draw.temperature))
    versions = jnp.zeros((batch, response_length if version is not None else 0), jnp.int32)
    if version is not None:
        versions = versions.at[:, 0].set(version)
    return Decoding(cache=cache, step=jnp.int32(1), responses=jnp.full((batch, response_length), pad, jnp.int32)
                    .at[:, 0].set(token), logprobs=logprobs, token=token, done=done,
                    next_position=real, versions=versions)


def continue_decoding(graphdef, params, decoding: Decoding, key, draw: Draw, *, end: int,
                      slots_read: int | None = None, version=None) -> Decoding:
    """``decoding`` advanced with ``params`` to step ``end`` (exclusive; at most R), or until every row is done.

    The cache is kept as it is: ``params`` may differ from those that wrote it (a policy swapped between decode
    chunks, ``ppojax.rl.pipeline``); each new token's keys and values are then ``params``'. key: the key the
    decode started with (row b's token t draws with ``fold_in(fold_in(key, t), b)``). slots_read: the cache slots
    attention reads in this loop (every slot written before ``end`` must lie below it; None: all). version: recorded
    for each token sampled (where ``decoding`` tracks versions)."""
    rows = jnp.arange(decoding.token.shape[0], dtype=jnp.int32)
    pad = jnp.asarray(draw.pad_token_id, jnp.int32)
    sample = draw.sampler(nnx.merge(graphdef, params))

    def cond(d):
        return (d.step < end) & ~jnp.all(d.done)

    def body(d):
        # Feed the token sampled at step-1, get the distribution of step `step`.
        logits, cache, live = decode_step(graphdef, params, d.cache, d.token, d.next_position, draw.pad_token_id)
        new = jnp.where(d.done, pad, sample(logits, row_keys(key, d.step, rows)))
        done = d.done if draw.stop_token_id is None else d.done | (new == draw.stop_token_id)
        at = (jnp.int32(0), d.step)
        logprobs, versions = d.logprobs, d.versions
        if draw.return_logprobs:
            logprobs = jax.lax.dynamic_update_slice(logprobs, token_logprobs(logits, new, draw.temperature)[:, None],
                                                    at)
        if version is not None and versions.shape[1]:
            versions = jax.lax.dynamic_update_slice(versions, jnp.full((versions.shape[0], 1), version, jnp.int32),
                                                    at)
        return Decoding(cache=cache, step=d.step + 1, logprobs=logprobs, token=new, done=done,
                        responses=jax.lax.dynamic_update_slice(d.responses, new[:, None], at),
                        next_position=d.next_position + live.astype(jnp.int32), versions=versions)

    return jax.lax.while_loop(cond, body, decoding.replace(cache=decoding.cache.replace(read_length=slots_read)))


def chunk_ends(response_length: int, chunks: int) -> list[int]:
    """The decode of R tokens cut into ``chunks`` pieces of about equal decode steps: each piece's end step
    (exclusive; the last is R). Piece 0 starts at step 1, after the prefill's token 0; a piece may be empty."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks}; expected >= 1")
    steps = response_length - 1
    return [1 + -(-steps * (j + 1) // chunks) for j in range(chunks)]


def generate(graphdef, params, prompt_ids, key, *, response_length, pad_token_id, temperature=1.0,
             top_k=0, top_p=1.0, greedy=False, stop_token_id=None, cache_dtype=None, init_cache_fn=None,
             return_logprobs=False, segments=1, slot_alignment=None, group_size=1, prefix_length=0):
    """Sample ``response_length`` tokens after each left-padded prompt. Pure; call it under jit.

    graphdef, params: ``nnx.split(causal_lm)``; the model is merged inside, so ``params`` may be traced.
    prompt_ids:  i32[B, P] left padded with ``pad_token_id``.
    key:         PRNG key; row b's token t draws with ``fold_in(fold_in(key, t), b)`` (unused when ``greedy``).
    temperature: float or f32 scalar (may be traced).
    Static options: response_length R, pad_token_id, top_k (0 = off), top_p (1.0 = off), greedy,
    stop_token_id (None = never stop), cache_dtype (default: the model's compute dtype),
    init_cache_fn (``(model, batch, length, dtype) -> cache``; default ``ppojax.models.init_cache``),
    return_logprobs (also return each sampled token's log-prob, :func:`token_logprobs` of the step's logits),
    segments (the decode loop as that many loops, each reading only the cache slots filled by its end:
    :func:`decode_segments`; each is its own compiled loop body), slot_alignment (what the slots read are rounded
    up to; None: the model's kernels', :func:`slot_alignment_of`), group_size G (each prompt sampled G times, its
    samples on consecutive rows: ``prompt_ids`` is i32[B / G, P] and the result has B rows, as
    ``jnp.repeat(prompt_ids, G, axis=0)`` would give; each prompt is prefilled ONCE and its keys and values serve
    its G rows), prefix_length q (every prompt's first q real tokens are the same: prefilled once for all,
    :func:`prefill`; 0: off).
    Returns responses: i32[B, R]; after a stop token every position holds ``pad_token_id``. With
    ``return_logprobs``: (responses, logprobs f32[B, R]); logprobs after a row's stop token are meaningless.

    It is :func:`start_decoding`, then :func:`continue_decoding` once per segment; the decode stops as soon as
    every row is done (the output keeps its static shape).
    """
    draw = Draw(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy, pad_token_id=pad_token_id,
                stop_token_id=stop_token_id, return_logprobs=return_logprobs)
    decoding = start_decoding(graphdef, params, prompt_ids, key, draw, response_length=response_length,
                              cache_dtype=cache_dtype, init_cache_fn=init_cache_fn, slot_alignment=slot_alignment,
                              group_size=group_size, prefix_length=prefix_length)
    alignment = slot_alignment_of(nnx.merge(graphdef, params), slot_alignment)
    for end, slots_read in decode_segments(prompt_ids.shape[1], response_length, segments, alignment):
        decoding = continue_decoding(graphdef, params, decoding, key, draw, end=end, slots_read=slots_read)
    return (decoding.responses, decoding.logprobs) if return_logprobs else decoding.responses


def decode_step(graphdef, params, cache, token, position, pad_token_id):
    """One step of the decode loop: each row's last token through the model against its KV cache.

    token: i32[B], the token sampled last (a pad id is a masked key, as the later forward sees it);
    position: i32[B], its position (real tokens before it). Returns (logits f32[B, V] of the next token, the
    cache with the token's keys and values written, live bool[B]: token != pad).
    """
    live = token != jnp.asarray(pad_token_id, jnp.int32)
    model = nnx.merge(graphdef, params)
    hidden, cache = model(jnp.where(live, token, 0)[:, None], live[:, None], position[:, None], cache=cache)
    return model.logits(hidden)[:, 0], cache, live


def decode_work(responses, stop_token_id, rows_per_step, steps=None):
    """How much of the decode loop's work sampled tokens -> (busy f32[]: the row-steps that sampled a token of an
    unfinished sequence, computed f32[]: every row-step the loop computed). Their ratio is the loop's occupancy
    (:func:`occupancy`); sums over several loops (dynamic sampling's rounds) give theirs.

    responses: i32[B, R] as a sampler returns them (pad after the stop token); each row's first token comes from
    its prefill, the others from decode steps. rows_per_step: the rows each step computes (B for
    :func:`generate`, the slots for ``ppojax.rl.continuous.generate_continuous``). steps: i32[] the decode steps
    run (``generate_continuous``'s ``return_steps``); None: :func:`generate`'s, which stops when its longest row
    is done."""
    batch, response_length = responses.shape
    lengths = jnp.full((batch,), response_length, jnp.int32)  # tokens sampled per row, its stop token included
    if stop_token_id is not None:
        lengths = jnp.minimum(first_true_indices(responses == stop_token_id) + 1, response_length)
    steps = jnp.max(lengths) - 1 if steps is None else steps
    return jnp.sum(lengths - 1).astype(jnp.float32), (steps * rows_per_step).astype(jnp.float32)


def occupancy(busy, computed):
    """f32[]: the share of the computed row-steps that were busy (:func:`decode_work`); 1 when the loop computed
    nothing (every row stopped at its first token)."""
    return jnp.where(computed > 0, busy / jnp.maximum(computed, 1.0), 1.0)


GENERATE_STATIC = ("graphdef", "response_length", "pad_token_id", "top_k", "top_p", "greedy", "stop_token_id",
                   "cache_dtype", "init_cache_fn", "return_logprobs", "segments", "slot_alignment", "group_size")

#: ``generate`` compiled: one program per (graphdef, prompt shape, static options); params, prompts, key and
#: ``temperature`` are traced (sampling at another temperature does not recompile).
generate_jit = jax.jit(generate, static_argnames=GENERATE_STATIC)
