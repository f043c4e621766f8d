"""Scores -> per-token shaped rewards (docs/algorithm.md: "Shaped rewards"; "Rollout", step 8)."""
from typing import NamedTuple

import jax.numpy as jnp

from ppojax.core.masks import contains_stop_token
from ppojax.core.stats import masked_whiten

SCORE_POSITIONS = ("trl", "legacy")


def apply_missing_eos_penalty(scores, truncated_responses, stop_token_id, penalty):
    """Subtract ``penalty`` from the score of every response without the stop token.

    scores: f32[B]; truncated_responses: i32[B, R]. ``penalty=None`` is off. ppojax checks the STOP
    token (TRL checks eos_token_id even when the stop token differs).
    """
    if penalty is None:
        return scores
    return penalise_missing_stop(scores, contains_stop_token(truncated_responses, stop_token_id), penalty)


def penalise_missing_stop(scores, contains_stop, penalty):
    """Subtract ``penalty`` from the score of every response that did not end with the stop token.

    scores: f32[B]; contains_stop: bool[B] (the Experience's: a single response's stop token, or a multi-turn
    episode that ended on its own rather than truncated). ``penalty=None`` is off.
    """
    if penalty is None:
        return scores
    return scores - penalty * (~contains_stop).astype(scores.dtype)


def score_index(last_index, response_length, score_position="trl"):
    """Where the score is added. i32[B] -> i32[B].

    'trl': the slot after the last real token (``last+1`` if it fits, else ``last``), whose value is
    still trained; 'legacy' (TRL <= 0.11): on the last real token itself.
    """
    if score_position == "trl":
        return jnp.where(last_index + 1 < response_length, last_index + 1, last_index)
    if score_position == "legacy":
        return last_index
    raise ValueError(f"score_position={score_position!r}; expected one of {SCORE_POSITIONS}")


class ShapedRewards(NamedTuple):
    """rewards, kl, non_score_reward: f32[B, R]."""

    rewards: jnp.ndarray
    kl: jnp.ndarray
    non_score_reward: jnp.ndarray


def shaped_rewards(scores, kl, last_index, kl_coef, padding_mask_p1, *, score_position="trl",
                   whiten_rewards=False) -> ShapedRewards:
    """rewards = -kl_coef * kl, plus the score at :func:`score_index`.

    scores: f32[B]; kl: f32[B, R] per-token estimate (0 on padding); last_index: i32[B];
    kl_coef: f32 scalar (traced, so an adaptive coefficient does not recompile);
    padding_mask_p1: bool[B, R] (True = padding), used only by ``whiten_rewards``.
    """
    response_length = kl.shape[-1]
    non_score_reward = -kl_coef * kl
    end = score_index(last_index, response_length, score_position)
    at_end = jnp.arange(response_length)[None, :] == end[:, None]
    rewards = non_score_reward + jnp.where(at_end, scores[:, None], 0.0)
    if whiten_rewards:
        rewards = masked_whiten(rewards, ~padding_mask_p1, shift_mean=False)
        rewards = jnp.where(padding_mask_p1, 0.0, rewards)
    return ShapedRewards(rewards=rewards, kl=kl, non_score_reward=non_score_reward)
