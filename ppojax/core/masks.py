"""Response truncation and the policy/value masks of docs/algorithm.md's "Rollout" section.

Convention: every mask named ``padding_mask*`` is True on PADDING (dead) positions, as in TRL.
"""
from typing import NamedTuple

import jax.numpy as jnp

# Written into log-prob slots that are padding, so every KL estimator is exactly 0 there
# (docs/algorithm.md, "KL estimators").
INVALID_LOGPROB = 1.0


def first_true_indices(bools, dtype=jnp.int32):
    """Index of the first True along the last axis, or the axis length where there is none.

    bools: bool[..., N] -> dtype[...]
    """
    n = bools.shape[-1]
    positions = jnp.arange(n, dtype=dtype)
    return jnp.min(jnp.where(bools, positions, jnp.asarray(n, dtype)), axis=-1)


def truncate_response(responses, stop_token_id, pad_token_id):
    """Keep tokens up to and including the first stop token; fill the rest with pad.

    responses: i32[B, R] -> i32[B, R]. ``stop_token_id=None`` returns the responses unchanged.
    """
    if stop_token_id is None:
        return responses
    stop_index = first_true_indices(responses == stop_token_id)
    after_stop = jnp.arange(responses.shape[-1]) > stop_index[..., None]
    return jnp.where(after_stop, jnp.asarray(pad_token_id, responses.dtype), responses)


class ResponseMasks(NamedTuple):
    """Masks derived from a truncated response (True = padding).

    last_index:      i32[B]     index of the last real token (-1 if the response starts with pad)
    padding_mask:    bool[B, R] policy side, ``t > last_index``
    padding_mask_p1: bool[B, R] value side, ``t > last_index + 1`` (one terminal slot stays live)
    """

    last_index: jnp.ndarray
    padding_mask: jnp.ndarray
    padding_mask_p1: jnp.ndarray


def response_masks(truncated_responses, pad_token_id) -> ResponseMasks:
    """docs/algorithm.md, "Rollout", steps 3-4. truncated_responses: i32[B, R]."""
    last_index = first_true_indices(truncated_responses == pad_token_id) - 1
    positions = jnp.arange(truncated_responses.shape[-1])[None, :]
    return ResponseMasks(
        last_index=last_index,
        padding_mask=positions > last_index[:, None],
        padding_mask_p1=positions > last_index[:, None] + 1,
    )


def contains_stop_token(truncated_responses, stop_token_id):
    """bool[B]: whether each response emitted the stop token (always False when there is none)."""
    if stop_token_id is None:
        return jnp.zeros(truncated_responses.shape[:-1], bool)
    return jnp.any(truncated_responses == stop_token_id, axis=-1)
