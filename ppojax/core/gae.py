"""Generalised advantage estimation (docs/algorithm.md, "Advantages")."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ppojax.core.stats import masked_whiten


def gae(rewards, values, gamma, lam):
    """Reverse scan over time: delta_t = r_t + gamma V_{t+1} - V_t (V_R = 0), A_t = delta_t + gamma lam A_{t+1}.

    rewards, values: f32[B, R] (values already 0 on padding_mask_p1) -> advantages f32[B, R].
    """
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def step(next_advantage, delta_t):
        advantage_t = delta_t + gamma * lam * next_advantage
        return advantage_t, advantage_t

    # Scan over time, newest first: time-major [R, B].
    _, advantages = jax.lax.scan(step, jnp.zeros_like(deltas[:, 0]), deltas.T, reverse=True)
    return advantages.T


class Advantages(NamedTuple):
    """advantages: whitened, 0 on padding_mask; returns = raw advantages + values. Both f32[B, R]."""

    advantages: jnp.ndarray
    returns: jnp.ndarray


def advantages_and_returns(rewards, values, padding_mask, gamma, lam, whiten=True) -> Advantages:
    """GAE, returns, then advantage whitening over live tokens (mean shifted) and zeroing on padding."""
    raw = gae(rewards, values, gamma, lam)
    returns = raw + values
    advantages = masked_whiten(raw, ~padding_mask, shift_mean=True) if whiten else raw
    return Advantages(advantages=jnp.where(padding_mask, 0.0, advantages), returns=returns)
