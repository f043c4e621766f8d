"""Forward passes shared by the rollout and the PPO loss: log-probs, entropy, values, scores.

All functions are pure and differentiable; they take a merged NNX module (call them inside ``jit`` after
``nnx.merge(graphdef, params)``). docs/algorithm.md, "Conventions":

- ``attention_mask = tokens != pad``; ``position_ids`` = exclusive cumulative sum of the mask (the first
  real token is at 0, left padding aware); pad ids become 0 before the embedding.
- response logits are the logits at positions ``P-1 ... P+R-2`` divided by ``temperature + 1e-7``;
  ``logprob = logit[token] - logsumexp(logits)`` and ``entropy = logsumexp(l) - sum(softmax(l) * l)``,
  both in float32.

Large vocabularies: the float32 ``[B, R, V]`` logits are never held at once. :func:`logprobs_from_hidden`
projects the response hidden states to logits ``chunk_size`` time steps at a time inside a ``lax.map``
whose body is rematerialised (``jax.checkpoint``), so the backward pass recomputes one chunk's logits
instead of storing all of them: peak logits memory is ``B * chunk_size * V`` floats.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

TEMPERATURE_EPS = 1e-7  # logits / (temperature + TEMPERATURE_EPS): the forwards' and the sampler's
LOGITS_MEMORY_BUDGET = 256 * 2**20  # bytes of float32 logits per device that auto chunking allows


def auto_chunk_size(rows, length, vocab, budget_bytes=LOGITS_MEMORY_BUDGET):
    """Time steps per logits chunk so that ``rows x chunk x vocab`` float32 logits fit ``budget_bytes``.

    None (no chunking) when all ``length`` steps fit: chunking then only costs time (a ``lax.map`` and the
    recomputation of the chunk's logits in the backward pass; ~20 % of the tiny benchmark's update).
    """
    fit = max(1, budget_bytes // (4 * max(rows, 1) * vocab))
    return None if fit >= length else int(fit)


def sequence_inputs(tokens, pad_id):
    """Model inputs for a (left-)padded token batch.

    tokens: i32[B, S] -> (input_ids i32[B, S] with pad -> 0, attention_mask bool[B, S] (True = real token),
    position_ids i32[B, S] = exclusive cumsum of attention_mask).
    """
    attention_mask = tokens != pad_id
    live = attention_mask.astype(jnp.int32)
    position_ids = jnp.cumsum(live, axis=-1, dtype=jnp.int32) - live
    input_ids = jnp.where(attention_mask, tokens, 0).astype(jnp.int32)
    return input_ids, attention_mask, position_ids


def split_shared_prefix(input_ids, attention_mask, position_ids, prefix_length: int):
    """Rows whose first ``prefix_length`` q real tokens are the same in every row (a system message every prompt
    starts with), as :func:`sequence_inputs` gives them for LEFT-padded rows [N, S] -> (the prefix's inputs
    ([1, q] each: row 0's first q real tokens, positions 0 ... q-1), the rest's inputs ([N, S - q] each)).

    The rest keeps each row's tokens after the prefix in the columns they end at and their positions (q on), so a
    forward of the prefix and then of the rest after it (a cache, or ``prefix=`` its keys and values) is the
    rows' forward: its last column is the rows' last, and padding between the prefix and the rest is masked. The
    caller vouches that the rows share the prefix (``ppojax.trainer.run_prompts.shared_prefix_length``)."""
    rows, length = input_ids.shape
    q = prefix_length
    if not 0 < q < length:
        raise ValueError(f"prefix_length={q}; expected 0 < prefix_length < the rows' length {length}")
    first_real = jnp.argmax(attention_mask, axis=-1)  # [N]
    prefix = (jax.lax.dynamic_slice_in_dim(input_ids[0], first_real[0], q)[None], jnp.ones((1, q), bool),
              jnp.arange(q, dtype=jnp.int32)[None])
    # column j of the rest is column j + q of the row: real where that token is, from the row's first real column
    # on (then j + q is past the prefix); elsewhere a masked key
    columns = jnp.arange(length - q)
    rest_mask = (columns[None, :] >= first_real[:, None]) & attention_mask[:, q:]
    rest = (jnp.where(rest_mask, input_ids[:, q:], 0), rest_mask, jnp.where(rest_mask, position_ids[:, q:], 0))
    return prefix, rest


class Layout(NamedTuple):
    """A forward's inputs and the positions whose outputs are read: padded rows, read at the positions that predict
    the response (:func:`padded_layout`), or packed rows, read everywhere (``ppojax.rl.packing.packed_layout``).

    input_ids, attention_mask, position_ids: [b, S]; segment_ids: i32[b, S] or None (one sequence per row);
    tokens: i32[b, T], the token each read position predicts; first, stop: the read positions ``[first, stop)``
    (``stop`` None: to the end), T of them.
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    position_ids: jax.Array
    segment_ids: Optional[jax.Array]
    tokens: jax.Array
    first: int = 0
    stop: Optional[int] = None

    @property
    def _inputs(self):
        return self.input_ids, self.attention_mask, self.position_ids

    @property
    def _segments(self) -> dict:
        # only packed rows pass segment ids: a padded forward calls the model as any (lm, ids, mask, positions) model
        return {} if self.segment_ids is None else {"segment_ids": self.segment_ids}

    def hidden(self, lm):
        """A ``CausalLM``'s final hidden states at the read positions: f[b, T, D]."""
        hidden, _ = lm(*self._inputs, **self._segments)
        return hidden[:, self.first:self.stop]

    def scores(self, score_model):
        """A ``ScoreModel``'s head at the read positions: f32[b, T] (values, or a reward read at one of them)."""
        scores = score_model(*self._inputs, **self._segments)
        return scores[:, self.first:self.stop].astype(jnp.float32)


def padded_layout(query_responses, prompt_length, pad_id) -> Layout:
    """The padded rows i32[B, P+R], read at positions ``P-1 ... P+R-2`` (those that predict the R response tokens)."""
    input_ids, attention_mask, position_ids = sequence_inputs(query_responses, pad_id)
    return Layout(input_ids, attention_mask, position_ids, None, query_responses[:, prompt_length:],
                  prompt_length - 1, -1)


class SharedPromptLayout(NamedTuple):
    """Padded rows whose consecutive groups of ``group`` rows hold the same prompt (GRPO's samples of a prompt),
    read at the positions that predict the response, as :func:`padded_layout` reads them; the policy's forward
    runs each group's prompt ONCE: the prompts' forward gives their keys and values, which the group's responses
    attend to in a forward of the response slots only (``shared_prompt_forward``). With ``prefix_length`` q > 0
    every prompt's first q real tokens are the same (``shared_prompt_prefix``: a system message): they run once
    for the whole batch and the prompts' rest after them (:func:`split_shared_prefix`). Outputs equal the padded
    forward's to float rounding; the prompt's matmuls are done once per group (the prefix's once) instead of once
    per row.

    padded: the rows' ``padded_layout`` (its ``tokens``, and the value and reward models' forwards, which keep it);
    prompt_length: P; group: G (the batch's rows are a multiple of it; 1: each row its own prompt); prefix_length: q.
    """

    padded: Layout
    prompt_length: int
    group: int
    prefix_length: int = 0

    @property
    def tokens(self):
        return self.padded.tokens

    def _prompts(self, lm, ids, mask, positions):
        """The prompts' forward -> (hidden f[n, P or P - q, D] whose last column is the prompts' last, every
        token's keys and values as a ``PromptKV`` of n rows)."""
        if not self.prefix_length:
            return lm(ids, mask, positions, return_kv=True)
        prefix, rest = split_shared_prefix(ids, mask, positions, self.prefix_length)
        _, prefix_kv = lm(*prefix, return_kv=True)
        prefix_kv = prefix_kv.repeat_rows(ids.shape[0])
        hidden, rest_kv = lm(*rest, prefix=prefix_kv, return_kv=True)
        return hidden, prefix_kv.followed_by(rest_kv)

    def hidden(self, lm):
        """The padded layout's hidden states f[b, R, D]: each group's prompt through ``lm`` once (its keys and
        values kept), then every row's response slots after its group's prompt."""
        p, g = self.prompt_length, self.group
        ids, mask, positions = self.padded._inputs
        prompt_hidden, prompt_kv = self._prompts(lm, ids[::g, :p], mask[::g, :p], positions[::g, :p])
        response_hidden, _ = lm(ids[:, p:], mask[:, p:], positions[:, p:], prefix=prompt_kv.repeat_rows(g))
        last_prompt = jnp.repeat(prompt_hidden[:, -1:], g, axis=0)  # predicts each row's first response token
        return jnp.concatenate([last_prompt, response_hidden[:, :-1]], axis=1)

    def scores(self, score_model):
        """A ``ScoreModel``'s head at the read positions, from the padded forward (its prompt not shared)."""
        return self.padded.scores(score_model)


def row_layout(query_responses, prompt_length, pad_id, prompt_group: int = 1, prompt_prefix: int = 0):
    """The layout the update's and the rollout's forwards read padded rows i32[B, P+R] with:
    :func:`padded_layout`, or with ``prompt_group`` G > 1 (rows ``[kG, (k+1)G)`` share a prompt) or
    ``prompt_prefix`` q > 0 (every prompt starts with the same q real tokens) the :class:`SharedPromptLayout` that
    runs each prompt once and the shared prefix once."""
    layout = padded_layout(query_responses, prompt_length, pad_id)
    if prompt_group == 1 and not prompt_prefix:
        return layout
    return SharedPromptLayout(layout, prompt_length, prompt_group, prompt_prefix)


def response_hidden(lm, query_responses, prompt_length, pad_id):
    """Final hidden states that predict the response tokens.

    query_responses: i32[B, P+R] -> f[B, R, D] (positions ``P-1 ... P+R-2``). Also the hook for a value
    head on the policy backbone: one backbone pass gives both the log-probs and the values.
    """
    return padded_layout(query_responses, prompt_length, pad_id).hidden(lm)


def _chunked_over_time(fn, chunk_size, *arrays):
    """Apply ``fn`` to [B, c, ...] time chunks of each [B, R, ...] array; outputs are [B, R] each.

    ``fn`` is rematerialised so its intermediates (the float32 logits) are never all stored for the
    backward pass.
    """
    length = arrays[0].shape[1]
    if chunk_size is None or chunk_size >= length:
        return fn(*arrays)
    num_chunks = -(-length // chunk_size)
    padded = num_chunks * chunk_size

    def split(x):  # [B, R, ...] -> [n, B, c, ...]
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(x.shape[0], num_chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    def merge(y):  # [n, B, c] -> [B, R]
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], padded)[:, :length]

    outputs = jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), tuple(split(x) for x in arrays))
    return jax.tree.map(merge, outputs)


def logprobs_from_hidden(lm, hidden, tokens, temperature, *, chunk_size=None, with_entropy=False):
    """Log-probs (and entropy) of ``tokens`` under ``lm.logits(hidden) / (temperature + 1e-7)``.

    hidden: f[B, R, D]; tokens: i32[B, R] (the token each position predicts; out-of-vocabulary ids, e.g. a
    pad id past the vocabulary, are clipped: mask such positions).
    chunk_size: time steps per logits chunk (None = all at once).
    Returns (logprobs f32[B, R], entropy f32[B, R] or None).
    """
    scale = 1.0 / (temperature + TEMPERATURE_EPS)

    def chunk(h, t):
        logits = lm.logits(h).astype(jnp.float32) * scale  # f32[B, c, V]
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, t[..., None].astype(jnp.int32), axis=-1, mode="clip")[..., 0]
        logprobs = chosen - lse
        if not with_entropy:
            return (logprobs,)
        entropy = lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return logprobs, entropy

    out = _chunked_over_time(chunk, chunk_size, hidden, tokens)
    return (out[0], out[1] if with_entropy else None)


def full_kl_from_hidden(lm, hidden, ref_lm, ref_hidden, temperature, *, chunk_size=None):
    """Per-position KL over the whole vocabulary, ``sum_v pi(v) (log pi(v) - log pi_ref(v))``.

    Both distributions are the temperature-scaled ones the log-probs use (the ``full`` estimator of
    docs/algorithm.md, "KL estimators").
    hidden, ref_hidden: f[B, R, D] from :func:`response_hidden` of the policy ``lm`` and the reference
    ``ref_lm``. Chunked over time like :func:`logprobs_from_hidden`. Returns f32[B, R] (unmasked).
    """
    scale = 1.0 / (temperature + TEMPERATURE_EPS)

    def chunk(h, ref_h):
        log_p = jax.nn.log_softmax(lm.logits(h).astype(jnp.float32) * scale, axis=-1)
        log_q = jax.nn.log_softmax(ref_lm.logits(ref_h).astype(jnp.float32) * scale, axis=-1)
        return (jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1),)

    return _chunked_over_time(chunk, chunk_size, hidden, ref_hidden)[0]


def response_logprobs(lm, query_responses, prompt_length, pad_id, temperature, *, chunk_size=None,
                      with_entropy=False):
    """Log-probs of the response tokens of ``query_responses`` (docs/algorithm.md, "Rollout" step 5, and "Loss").

    lm: a merged ``CausalLM``; query_responses: i32[B, P+R] (left-padded prompts + UNtruncated responses);
    prompt_length: P (static). Returns (logprobs f32[B, R], entropy f32[B, R] or None), unmasked: the
    caller writes ``INVALID_LOGPROB`` on padding.
    """
    hidden = response_hidden(lm, query_responses, prompt_length, pad_id)
    tokens = query_responses[:, prompt_length:]
    return logprobs_from_hidden(lm, hidden, tokens, temperature, chunk_size=chunk_size,
                                with_entropy=with_entropy)


def response_values(score_model, query_responses, prompt_length, pad_id):
    """Value of state ``query + response[:t]``: the score head at positions ``P-1 ... P+R-2``.

    score_model: a merged ``ScoreModel`` (``(ids, mask, positions) -> f32[B, S]``);
    query_responses: i32[B, P+R] -> f32[B, R] (unmasked: the caller zeroes ``padding_mask_p1``).
    """
    return padded_layout(query_responses, prompt_length, pad_id).scores(score_model)


def sequence_score_index(tokens, pad_id, prompt_length=None):
    """i32[B]: where a sequence's scalar score is read.

    With ``prompt_length`` (TRL's ``get_reward``): one before the first pad after the prompt, i.e.
    ``first_true_indices(tokens[:, P:] == pad) - 1 + P`` (``P+R-1`` if the response has no pad).
    Without: the last non-pad token of the whole row.
    """
    length = tokens.shape[1]
    if prompt_length is not None:
        response = tokens[:, prompt_length:]
        positions = jnp.arange(response.shape[1], dtype=jnp.int32)
        first_pad = jnp.min(jnp.where(response == pad_id, positions, response.shape[1]), axis=-1)
        return (first_pad - 1 + prompt_length).astype(jnp.int32)
    positions = jnp.arange(length, dtype=jnp.int32)
    return jnp.max(jnp.where(tokens != pad_id, positions, -1), axis=-1).clip(0).astype(jnp.int32)


def sequence_scores(score_model, tokens, pad_id, prompt_length=None):
    """Scalar score per sequence: the score head at :func:`sequence_score_index`.

    score_model: a merged ``ScoreModel``; tokens: i32[B, S] (for rewards: prompts + TRUNCATED responses)
    -> f32[B]. Pass ``prompt_length`` for TRL's exact semantics (docs/algorithm.md, "Rollout", step 7).
    """
    input_ids, attention_mask, position_ids = sequence_inputs(tokens, pad_id)
    scores = score_model(input_ids, attention_mask, position_ids).astype(jnp.float32)
    index = sequence_score_index(tokens, pad_id, prompt_length)
    return jnp.take_along_axis(scores, index[:, None], axis=-1)[:, 0]


def map_batch(fn, batch_size, *arrays):
    """Run ``fn`` over batch slices of ``batch_size`` rows with ``lax.map`` (bounded activation memory).

    arrays: [B, ...] each, B divisible by batch_size (None or >= B = one call). fn returns a pytree of
    [b, ...] arrays; the result is the same pytree with [B, ...] leaves.
    """
    total = arrays[0].shape[0]
    if batch_size is None or batch_size >= total:
        return fn(*arrays)
    if total % batch_size:
        raise ValueError(f"batch size {total} is not divisible by the forward batch size {batch_size}; "
                         "pick a divisor (e.g. local_rollout_forward_batch_size).")
    n = total // batch_size
    split = [x.reshape(n, batch_size, *x.shape[1:]) for x in arrays]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return jax.tree.map(lambda y: y.reshape(total, *y.shape[2:]), out)
