"""The rollout's forwards on packed rows (``padding_free``): behaviour and reference log-probs, values, the full
KL and a reward model's scores, each equal to the padded forwards' on every position the rollout keeps.

The rollout's sequences are packed as the update's are (``ppojax.rl.packing``): each span, from the first real
prompt token to the last real response token, keeps its padded ids, mask and positions and gets a segment id,
so each sequence's forward is its padded one. Packed micro-batches of ``rows_per_micro`` rows run in a
``lax.while_loop`` until the last row in use: the work follows the real tokens, the shapes stay fixed.

What a padded forward computes past a sequence's last real token (where the rollout writes ``INVALID_LOGPROB``
and zero values) is 0 here; the rollout masks it the same way.
"""
from __future__ import annotations

import jax.numpy as jnp

from ppojax.rl.packed_update import packed_micro_batch_shape
from ppojax.rl.packing import packed_layout, packed_map, packed_rows_for, span_ends, unpack_responses


def rollout_packed_shape(batch_settings, row_length: int, packed_length=None):
    """(rows per packed rollout micro-batch over the mesh, logits chunk) for padded rows of ``row_length`` slots
    packed into rows of ``packed_length`` (None: the same): ``max_tokens_per_micro_batch`` slots per device, else
    as many as ``local_rollout_forward_batch_size`` padded rows, else a padded update micro-batch's."""
    return packed_micro_batch_shape(batch_settings, row_length, packed_length=packed_length,
                                    rows_without_budget=batch_settings.local_rollout_forward_batch_size,
                                    at_most=batch_settings.batch_size)


def packed_rollout_forwards(actor_critic, params, frozen, query_responses, prompt_length: int, live_tokens, *,
                            rows_per_micro: int, logits_chunk_size=None, with_full_kl=False,
                            behaviour_logprobs=None, row_length=None):
    """``ActorCritic.rollout_forwards`` on packed rows.

    query_responses: i32[B, P+R]; live_tokens: i32[B] real response tokens of each (truncated) response;
    behaviour_logprobs: f32[B, R] or None, as ``rollout_forwards``; row_length: slots per packed row (None: a
    padded row's). Returns (logprobs, ref_logprobs, values,
    full_kl or None), f32[B, R] each, 0 past a sequence's last real token + 1.
    """
    response_length = query_responses.shape[1] - prompt_length
    plan, rows = packed_rows_for(query_responses, live_tokens, prompt_length, actor_critic.pad_token_id,
                                 rows_per_micro, row_length)

    def outputs(part):
        named = zip(("logprobs", "ref_logprobs", "values", "full_kl"), actor_critic.rollout_outputs(
            params, frozen, packed_layout(part), logits_chunk_size=logits_chunk_size, with_full_kl=with_full_kl,
            with_logprobs=behaviour_logprobs is None))
        return {name: x for name, x in named if x is not None}

    packed = packed_map(outputs, rows, plan.num_rows, rows_per_micro)
    out = {name: unpack_responses(x, plan, 0, prompt_length, response_length)[0] for name, x in packed.items()}
    logprobs = behaviour_logprobs.astype(jnp.float32) if behaviour_logprobs is not None else out["logprobs"]
    return logprobs, out["ref_logprobs"], out["values"], out.get("full_kl")


def packed_sequence_scores(score_model_of, tokens, prompt_length: int, pad_id: int, *, rows_per_micro: int):
    """``forward.sequence_scores`` with ``prompt_length`` (TRL's ``get_reward``) on packed rows.

    score_model_of: () -> a merged ``ScoreModel`` (merged inside each micro-batch); tokens: i32[B, P+R], prompts
    and TRUNCATED responses. The score is read one before the response's first pad, the last slot of its span.
    Returns f32[B].
    """
    response = tokens[:, prompt_length:]
    positions = jnp.arange(response.shape[1], dtype=jnp.int32)
    live = jnp.min(jnp.where(response == pad_id, positions, response.shape[1]), axis=-1)
    plan, rows = packed_rows_for(tokens, live, prompt_length, pad_id, rows_per_micro)
    scores = packed_map(lambda part: packed_layout(part).scores(score_model_of()), rows, plan.num_rows,
                        rows_per_micro)
    row, column = span_ends(plan)
    return scores[row, column]
