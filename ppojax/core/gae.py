"""Generalised advantage estimation (docs/algorithm.md, "Advantages")."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.core.stats import masked_whiten


def gae(rewards, values, gamma, lam, environment_mask=None):
    """Reverse scan over time: delta_t = r_t + gamma V_{t+1} - V_t (V_R = 0), A_t = delta_t + gamma lam A_{t+1}.

    rewards, values: f32[B, R] (values already 0 on padding_mask_p1) -> advantages f32[B, R].
    environment_mask: bool[B, R] or None; True on tokens a multi-turn episode's environment wrote (tool results,
    observations), not the policy. The scan passes through them: their TD error is not added, and the next policy
    token's value and advantage are carried past them unchanged to the policy token before (verl's rule for
    multi-turn GAE), so the environment's tokens are neither actions nor states of the return. Their own
    advantage is the carried one; the loss masks them.
    """
    if environment_mask is None:
        environment_mask = jnp.zeros(rewards.shape, bool)

    def step(carry, inputs):
        next_value, next_advantage = carry
        reward_t, value_t, environment_t = inputs
        advantage_t = reward_t + gamma * next_value - value_t + gamma * lam * next_advantage
        carry = (jnp.where(environment_t, next_value, value_t), jnp.where(environment_t, next_advantage, advantage_t))
        return carry, carry[1]

    # Scan over time, newest first: time-major [R, B].
    zeros = jnp.zeros_like(rewards[:, 0])
    _, advantages = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, environment_mask.T), reverse=True)
    return advantages.T


class Advantages(NamedTuple):
    """advantages: whitened, 0 on padding_mask; returns = raw advantages + values. Both f32[B, R]."""

    advantages: jnp.ndarray
    returns: jnp.ndarray


def advantages_and_returns(rewards, values, padding_mask, gamma, lam, whiten=True,
                           environment_mask=None) -> Advantages:
    """GAE, returns, then advantage whitening over live tokens (mean shifted) and zeroing on padding
    (``environment_mask``: :func:`gae`'s; those tokens belong in ``padding_mask`` too)."""
    raw = gae(rewards, values, gamma, lam, environment_mask)
    returns = raw + values
    advantages = masked_whiten(raw, ~padding_mask, shift_mean=True) if whiten else raw
    return Advantages(advantages=jnp.where(padding_mask, 0.0, advantages), returns=returns)
