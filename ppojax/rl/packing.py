"""Packing sequences into rows without padding, for the update's forwards and backward (``padding_free``).

A padded mini-batch row is ``P + R`` slots: left padding, the prompt, the response, then padding after its last
real token. The loss reads, per response position ``t``, the hidden state at padded position ``P - 1 + t`` for
``t <= last + 1`` (the log-prob of response token ``t`` for ``t <= last``, the value one slot further), so a
sequence's useful SPAN is the padded positions ``[start, P + last + 1)``: from its first real prompt token to its
last real response token. Packing copies each span, unchanged, into packed rows of ``W`` slots (a padded row's
``P + R``, or longer with ``packed_row_length``, where spans longer than half a padded row can share a row),
several spans per row side by side (first-fit over the spans sorted by length), with a segment id per span:
attention never crosses a segment, and every token keeps the input id, mask and position the padded row gave it, so each
sequence's forward is the padded one's.

    plan = plan_packing(query_responses, live_tokens, P, pad)         # where each sequence goes
    rows = pack_rows(query_responses, plan, num_rows, pad)             # PackedRows [num_rows, W]
    out  = per-position outputs of rows[j*n:(j+1)*n]                   # f32[n, W]
    x    = unpack_responses(out, plan, j*n, P, R)                      # f32[M, R], 0 outside the micro-batch

Shapes stay static (``num_rows`` packed rows, the worst case of one span per row); what the real lengths change
is how many of those rows are used (``plan.num_rows``), and so how many packed micro-batches run.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.rl.forward import Layout, sequence_inputs

NO_SEGMENT = -1  # a packed slot no sequence uses


class PackingPlan(NamedTuple):
    """Where each of M sequences lies in the padded rows and in the packed ones.

    start:    i32[M]  first padded position of its span (its first real prompt token; at most ``P - 1``).
    length:   i32[M]  span length, ``P + live - start`` (``live`` real response tokens).
    row:      i32[M]  the packed row holding the span.
    offset:   i32[M]  the span's first slot in that row.
    num_rows: i32[]   packed rows in use (rows ``[0, num_rows)``).
    """

    start: jax.Array
    length: jax.Array
    row: jax.Array
    offset: jax.Array
    num_rows: jax.Array


class PackedRows(NamedTuple):
    """Packed model inputs, all [N, W]: the raw tokens (log-prob targets), the model's ``input_ids``,
    ``attention_mask`` and ``position_ids`` exactly as the padded rows gave them, and ``segment_ids`` (the
    sequence's index in the mini-batch; ``NO_SEGMENT`` on unused slots)."""

    tokens: jax.Array
    input_ids: jax.Array
    attention_mask: jax.Array
    position_ids: jax.Array
    segment_ids: jax.Array

    def slice_rows(self, first, count: int) -> "PackedRows":
        """Rows ``[first, first + count)`` (``first`` may be traced; ``count`` static)."""
        return PackedRows(*(jax.lax.dynamic_slice_in_dim(x, first, count, axis=0) for x in self))


def sequence_spans(query_responses, live_tokens, prompt_length: int, pad_id: int):
    """(start i32[M], length i32[M]) of each row's span.

    query_responses: i32[M, P+R]; live_tokens: i32[M], real response tokens (``last + 1``, 0 for an empty
    response). The span always holds position ``P - 1``, whose hidden state predicts the first response token.
    """
    real = query_responses[:, :prompt_length] != pad_id
    positions = jnp.arange(prompt_length, dtype=jnp.int32)
    first_real = jnp.min(jnp.where(real, positions, prompt_length - 1), axis=-1)
    start = first_real.astype(jnp.int32)
    return start, (prompt_length + live_tokens.astype(jnp.int32) - start)


def first_fit(lengths, capacity: int):
    """First-fit decreasing: spans of ``lengths`` i32[M] (each <= ``capacity``) into rows of ``capacity`` slots.

    Returns (row i32[M], offset i32[M], num_rows i32[]). Longest span first; each goes into the lowest-numbered
    row it fits in (M rows always suffice). Ties keep the mini-batch order, so the plan is deterministic.
    """
    m = lengths.shape[0]
    order = jnp.argsort(-lengths, stable=True)

    def place(fill, index):
        length = lengths[index]
        row = jnp.argmax(fill + length <= capacity).astype(jnp.int32)  # the first row with room
        return fill.at[row].add(length), (row, fill[row])

    fill, (rows, offsets) = jax.lax.scan(place, jnp.zeros((m,), jnp.int32), order)
    row = jnp.zeros((m,), jnp.int32).at[order].set(rows)
    offset = jnp.zeros((m,), jnp.int32).at[order].set(offsets)
    return row, offset, jnp.sum(fill > 0).astype(jnp.int32)


def plan_packing(query_responses, live_tokens, prompt_length: int, pad_id: int,
                 row_length: int | None = None) -> PackingPlan:
    """The packing of M padded rows i32[M, P+R] with ``live_tokens`` i32[M] real response tokens each into rows of
    ``row_length`` slots (None: P+R; at least P+R)."""
    start, length = sequence_spans(query_responses, live_tokens, prompt_length, pad_id)
    row, offset, num_rows = first_fit(length, _row_length(query_responses, row_length))
    return PackingPlan(start, length, row, offset, num_rows)


def _span_slots(plan: PackingPlan, width: int):
    """For every padded slot [M, S]: its packed (row, column), and whether it lies in its row's span."""
    columns = jnp.arange(width, dtype=jnp.int32)[None, :]
    inside = (columns >= plan.start[:, None]) & (columns < (plan.start + plan.length)[:, None])
    packed_column = plan.offset[:, None] + columns - plan.start[:, None]
    packed_row = jnp.broadcast_to(plan.row[:, None], inside.shape)
    return packed_row, packed_column, inside


def _row_length(query_responses, row_length: int | None) -> int:
    width = query_responses.shape[1]
    if row_length is not None and row_length < width:
        raise ValueError(f"packed rows of {row_length} slots cannot hold a padded row of {width}")
    return row_length or width


def pack_rows(query_responses, plan: PackingPlan, num_rows: int, pad_id: int,
              row_length: int | None = None) -> PackedRows:
    """The packed inputs [num_rows, W] of padded rows i32[M, S] under ``plan`` (``num_rows`` static, >= the
    plan's rows in use; W = ``row_length``, the plan's, None: S)."""
    m, width = query_responses.shape
    packed_width = _row_length(query_responses, row_length)
    input_ids, attention_mask, position_ids = sequence_inputs(query_responses, pad_id)
    packed_row, packed_column, inside = _span_slots(plan, width)
    target_row = jnp.where(inside, packed_row, num_rows)  # out of bounds: dropped

    def scatter(values, fill):
        empty = jnp.full((num_rows, packed_width), fill, values.dtype)
        return empty.at[target_row, packed_column].set(values, mode="drop", unique_indices=True)

    segments = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32)[:, None], (m, width))
    return PackedRows(tokens=scatter(query_responses.astype(jnp.int32), pad_id),
                      input_ids=scatter(input_ids, 0), attention_mask=scatter(attention_mask, False),
                      position_ids=scatter(position_ids, 0), segment_ids=scatter(segments, NO_SEGMENT))


def next_tokens(rows: PackedRows):
    """i32[N, W]: the token each packed position predicts (the next slot's; what follows a span is never read)."""
    return jnp.concatenate([rows.tokens[:, 1:], rows.tokens[:, -1:]], axis=1)


def packed_layout(rows: PackedRows) -> Layout:
    """The forwards' view of packed rows [N, W]: every position read, predicting the next slot's token."""
    return Layout(rows.input_ids, rows.attention_mask, rows.position_ids, rows.segment_ids, next_tokens(rows))


def unpack_responses(values, plan: PackingPlan, first_row, prompt_length: int, response_length: int):
    """Per-position outputs of packed rows ``[first_row, first_row + n)`` -> the padded response layout.

    values: f32[n, W] (position c's output: what it predicts, i.e. the log-prob of the next token, or the value
    of the sequence so far). Returns (f32[M, R], bool[M, R]): response position t of sequence i reads packed
    position ``P - 1 + t`` of its span; 0 and False where the span holds no such position (t > last + 1) or
    the sequence lies in another micro-batch.
    """
    n = values.shape[0]
    t = jnp.arange(response_length, dtype=jnp.int32)[None, :]
    padded_position = prompt_length - 1 + t
    local_row = plan.row - first_row
    in_rows = (local_row >= 0) & (local_row < n)
    valid = in_rows[:, None] & (padded_position < (plan.start + plan.length)[:, None])
    column = plan.offset[:, None] + padded_position - plan.start[:, None]
    row = jnp.broadcast_to(jnp.clip(local_row, 0, n - 1)[:, None], valid.shape)
    gathered = values[row, jnp.clip(column, 0, values.shape[1] - 1)]
    return jnp.where(valid, gathered, jnp.zeros((), values.dtype)), valid


def span_ends(plan: PackingPlan):
    """(row i32[M], column i32[M]): the packed slot of each span's last token (where a sequence's score is read)."""
    return plan.row, plan.offset + plan.length - 1


def packed_map(fn, rows: PackedRows, rows_in_use, rows_per_micro: int):
    """``fn`` over packed micro-batches of ``rows_per_micro`` rows, only as many as ``rows_in_use`` (traced) needs.

    fn: PackedRows [n, W] -> a pytree of f32[n, W] per-position outputs. rows: [N, W] with N a multiple of
    ``rows_per_micro``. Returns the pytree with [N, W] leaves, 0 on rows past the last micro-batch run. One
    compiled program: a ``lax.while_loop`` whose trip count follows the real tokens.
    """
    total = rows.tokens.shape[0]
    if total % rows_per_micro:
        raise ValueError(f"{total} packed rows are not a whole number of micro-batches of {rows_per_micro}")
    shapes = jax.eval_shape(fn, rows.slice_rows(0, rows_per_micro))
    out = jax.tree.map(lambda s: jnp.zeros((total,) + s.shape[1:], s.dtype), shapes)
    micro_batches = -(-rows_in_use // rows_per_micro)

    def body(carry):
        j, out = carry
        first = j * rows_per_micro
        part = fn(rows.slice_rows(first, rows_per_micro))
        return j + 1, jax.tree.map(lambda o, p: jax.lax.dynamic_update_slice_in_dim(o, p, first, axis=0), out, part)

    _, out = jax.lax.while_loop(lambda c: c[0] < micro_batches, body, (jnp.int32(0), out))
    return out


def packed_rows_for(query_responses, live_tokens, prompt_length: int, pad_id: int, rows_per_micro: int,
                    row_length: int | None = None):
    """(plan, rows): the packing of M padded rows into ``ceil(M / rows_per_micro)`` micro-batches' worth of packed
    rows of ``row_length`` slots (None: a padded row's; enough rows for one span per row)."""
    plan = plan_packing(query_responses, live_tokens, prompt_length, pad_id, row_length)
    m = query_responses.shape[0]
    return plan, pack_rows(query_responses, plan, -(-m // rows_per_micro) * rows_per_micro, pad_id, row_length)
