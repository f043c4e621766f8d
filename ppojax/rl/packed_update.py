"""A mini-batch's gradient over packed micro-batches (``padding_free``): the padded update's numbers, less work.

The padded update runs ``G = gradient_accumulation_steps`` micro-batches of ``M / G`` rows of ``P + R`` slots, padding
included. Here the mini-batch's M sequences are packed (``ppojax.rl.packing``) into rows of ``P + R`` slots, and
packed micro-batches of ``rows_per_micro`` rows run in a ``lax.while_loop`` that stops after the last row in use:
the number of forwards and backwards follows the real tokens (dynamic batch size) while every compiled shape
stays fixed (one program).

Why the results are the padded update's. Every sequence's forward sees the same tokens, positions and keys as in
its padded row. The loss of a mini-batch is a sum over its rows (each micro-batch share is normalised by the
MINI-batch's counts, ``ppojax.core.losses``), so it can be summed over any partition of the rows: each packed
micro-batch contributes the loss of the sequences it holds. The diagnostics are means over the padded update's
micro-batches (its ``G`` groups of rows); each packed micro-batch adds, per group, the sums behind those means,
and the means are taken once all have run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ppojax.core.masks import INVALID_LOGPROB
from ppojax.rl import forward
from ppojax.rl.packing import packed_layout, packed_rows_for, unpack_responses

#: the diagnostics that are masked means over a group's live policy tokens
_POLICY_MEANS = ("approxkl", "pg_clipfrac", "entropy", "ratio", "policykl")
#: shares of the mini-batch loss: summed as they are
_SHARES = ("pg_loss", "vf_loss", "kl_loss", "loss")


def packed_row_length(batch_settings, row_length: int) -> int:
    """Slots per packed row for padded rows of ``row_length``: ``packed_row_length`` where set, else the same."""
    return batch_settings.packed_row_length or row_length


def packed_micro_batch_shape(batch_settings, row_length: int, *, packed_length=None, rows_without_budget=None,
                             at_most=None):
    """(rows per packed micro-batch over the mesh, logits chunk over its positions) for padded rows of
    ``row_length`` slots packed into rows of ``packed_length`` (None: ``row_length``): ``max_tokens_per_micro_batch``
    slots per device; without a budget as many slots as ``rows_without_budget`` padded rows (None: a padded
    micro-batch's). At most ``at_most`` rows (None: a mini-batch's)."""
    width = packed_length or row_length
    budget, data_parallel = batch_settings.max_tokens_per_micro_batch, batch_settings.data_parallel_size
    if budget is None:
        rows = rows_without_budget or batch_settings.micro_batch_size
        if width > row_length:  # the padded rows' slots per device, in longer rows
            rows = max(1, -(-rows // data_parallel) * row_length // width) * data_parallel
    else:
        if budget < width:
            raise ValueError(f"max_tokens_per_micro_batch={budget} is below one packed row of {width} slots; "
                             f"set it to at least {width}")
        rows = (budget // width) * data_parallel
    rows = min(rows, at_most or batch_settings.mini_batch_size)
    chunk = batch_settings.logits_chunk_size
    if chunk is None and batch_settings.vocab_size is not None:
        per_device = -(-rows // data_parallel)
        chunk = forward.auto_chunk_size(per_device, width, batch_settings.vocab_size)
    elif chunk is None:
        chunk = batch_settings.update_logits_chunk
    return rows, chunk


def rows_only(batch, selected):
    """``batch`` (an UpdateBatch [M, ...]) with every row outside ``selected`` bool[M] turned into padding."""
    off = ~selected[:, None]
    logprobs = jnp.where(off, INVALID_LOGPROB, batch.logprobs)
    ref = None if batch.ref_logprobs is None else jnp.where(off, INVALID_LOGPROB, batch.ref_logprobs)
    behaviour = (None if batch.behaviour_logprobs is None
                 else jnp.where(off, INVALID_LOGPROB, batch.behaviour_logprobs))
    return batch._replace(logprobs=logprobs, ref_logprobs=ref, behaviour_logprobs=behaviour,
                          advantages=jnp.where(off, 0.0, batch.advantages),
                          padding_mask=batch.padding_mask | off, padding_mask_p1=batch.padding_mask_p1 | off)


def _sums(stats, part):
    """The sums behind one group's diagnostics on ``part``'s rows (means times their counts; 0 for no rows)."""
    policy_count = jnp.sum(~part.padding_mask).astype(jnp.float32)
    value_count = jnp.sum(~part.padding_mask_p1).astype(jnp.float32)

    def total(mean, count):
        return jnp.where(count > 0, mean * count, 0.0)

    out = {name: total(stats[name], policy_count) for name in _POLICY_MEANS}
    out.update({name: stats[name] for name in _SHARES if name in stats})
    # ratio_token_var is taken about the group's mean ratio: keep sum (r - 1)^2, combined with the mean at the end
    deviation = stats["ratio"] - 1.0
    out["ratio_square_deviation"] = total(stats["ratio_token_var"] + jnp.square(deviation), policy_count)
    out["policy_count"] = policy_count
    if "vf_clipfrac" in stats:
        out["vf_clipfrac"] = total(stats["vf_clipfrac"], value_count)
        out["value_count"] = value_count
    return out


def _means(sums):
    """The diagnostics (each f32[G]) from the summed ``_sums`` of every packed micro-batch."""
    count = sums["policy_count"]
    stats = {name: sums[name] / count for name in _POLICY_MEANS}
    stats.update({name: sums[name] for name in _SHARES if name in sums})
    stats["ratio_token_var"] = sums["ratio_square_deviation"] / count - jnp.square(stats["ratio"] - 1.0)
    if "vf_clipfrac" in sums:
        stats["vf_clipfrac"] = sums["vf_clipfrac"] / sums["value_count"]
    return stats


def response_extent(padding_mask):
    """bool[M, R] -> i32[M]: one past each row's last token in the loss, the response tokens a packed row keeps.
    The count of live tokens where they are contiguous; past a multi-turn episode's environment tokens (padding
    for the loss, in the middle of the row) too, because the policy's later tokens read them."""
    positions = jnp.arange(1, padding_mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(padding_mask, 0, positions[None, :]), axis=1)


def packed_gradients(loss_of_outputs, actor_critic, params, frozen, mini, *, groups: int, rows_per_micro: int,
                     logits_chunk_size=None, row_length=None):
    """The gradient of a mini-batch's loss, and its diagnostics per padded micro-batch, from packed forwards.

    loss_of_outputs: ``(part, logprobs, entropy, values) -> (loss, stats)`` on UpdateBatch rows (f32[M, R]
    outputs; ``ppojax.rl.update.loss_of_outputs`` with the mini-batch's counts bound). mini: the UpdateBatch
    [M, ...]; groups: the padded update's micro-batches per mini-batch (its diagnostics' groups of M / groups
    rows); row_length: slots per packed row (None: a padded row's). Returns (grads like params, stats
    {name: f32[groups]} plus ``packed_micro_batches``).
    """
    m, width = mini.query_responses.shape
    response_length = mini.logprobs.shape[1]
    prompt_length = width - response_length
    pad = actor_critic.pad_token_id
    plan, packed = packed_rows_for(mini.query_responses, response_extent(mini.padding_mask), prompt_length, pad,
                                   rows_per_micro, row_length)
    micro_batches = -(-plan.num_rows // rows_per_micro)
    group = jnp.arange(m) // (m // groups)

    def loss(params, j):
        first = j * rows_per_micro
        layout = packed_layout(packed.slice_rows(first, rows_per_micro))
        outputs = actor_critic.evaluate_layout(params, layout, frozen=frozen, logits_chunk_size=logits_chunk_size)
        logprobs, entropy, values = (unpack_responses(x, plan, first, prompt_length, response_length)[0]
                                     for x in outputs)
        here = plan.row // rows_per_micro == j
        total, sums = 0.0, []
        for k in range(groups):
            part = rows_only(mini, here & (group == k))
            share, stats = loss_of_outputs(part, logprobs, entropy, values)
            total = total + share
            sums.append(_sums(stats, part))
        return total, jax.tree.map(lambda *x: jnp.stack(x), *sums)

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    zero_sums = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                             jax.eval_shape(lambda: loss(params, jnp.int32(0))[1]))

    def body(carry):
        j, grads, sums = carry
        (_, new_sums), new_grads = grad_fn(params, j)
        return j + 1, jax.tree.map(jnp.add, grads, new_grads), jax.tree.map(jnp.add, sums, new_sums)

    carry = (jnp.int32(0), jax.tree.map(jnp.zeros_like, params), zero_sums)
    _, grads, sums = jax.lax.while_loop(lambda c: c[0] < micro_batches, body, carry)
    stats = _means(sums)
    stats["packed_micro_batches"] = jnp.broadcast_to(micro_batches.astype(jnp.float32), (groups,))
    return grads, stats
