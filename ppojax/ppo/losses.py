"""The clipped PPO losses and their diagnostics (SPEC: Loss).

Masks named ``padding_mask*`` are True on padding. The losses are TOKEN-weighted: a micro-batch's sums
are divided by the live-token counts of its whole MINI-batch (``policy_tokens``, ``value_tokens``), so
summing micro-batch gradients gives exactly the big-batch gradient. With one micro-batch per mini-batch
this is TRL's ``masked_mean``.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .masks import INVALID_LOGPROB
from .stats import masked_mean


def entropy_from_logits(logits):
    """Entropy of softmax(logits) = logsumexp(l) - sum(softmax(l) * l), float32. f[..., V] -> f32[...]."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


def mask_policy_and_value(new_logprobs, vpred, padding_mask, padding_mask_p1):
    """Mask a fresh forward as the rollout was masked: INVALID_LOGPROB and zero values on padding."""
    return (jnp.where(padding_mask, INVALID_LOGPROB, new_logprobs), jnp.where(padding_mask_p1, 0.0, vpred))


class LossTerms(NamedTuple):
    pg_loss: jnp.ndarray
    vf_loss: jnp.ndarray
    entropy_loss: jnp.ndarray


def policy_loss(new_logprobs, old_logprobs, advantages, padding_mask, cliprange, policy_tokens=None):
    """Clipped surrogate: sum(max(-A r, -A clip(r, 1-eps, 1+eps))) over live tokens / policy_tokens.

    All f32[B, R]. ``policy_tokens=None`` means this batch's own live-token count (a masked mean).
    Returns (loss scalar, ratio f32[B, R], clipped bool[B, R]).
    """
    live = ~padding_mask
    ratio = jnp.exp(new_logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = jnp.maximum(unclipped, clipped)
    denominator = jnp.sum(live) if policy_tokens is None else policy_tokens
    return jnp.sum(jnp.where(live, per_token, 0.0)) / denominator, ratio, clipped > unclipped


def value_loss(vpred, old_values, returns, padding_mask_p1, cliprange_value, value_tokens=None):
    """0.5 * sum(max((v - R)^2, (clip(v, V_old +- eps_v) - R)^2)) over live value slots / value_tokens.

    All f32[B, R]. Returns (loss scalar, clipped bool[B, R]).
    """
    live = ~padding_mask_p1
    vpred_clipped = jnp.clip(vpred, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = jnp.square(vpred - returns)
    clipped = jnp.square(vpred_clipped - returns)
    denominator = jnp.sum(live) if value_tokens is None else value_tokens
    loss = 0.5 * jnp.sum(jnp.where(live, jnp.maximum(unclipped, clipped), 0.0)) / denominator
    return loss, clipped > unclipped


def ppo_loss(new_logprobs, vpred, entropy, batch, *, cliprange, cliprange_value, vf_coef, entropy_coef=0.0,
             policy_tokens=None, value_tokens=None):
    """loss = pg_loss + vf_coef * vf_loss - entropy_coef * mean entropy, and the diagnostics.

    new_logprobs, vpred, entropy: f32[B, R] from the current parameters (unmasked; masked here).
    batch: the rollout's side (``ppojax.types.UpdateBatch`` or anything with these f32[B, R] / bool[B, R]
    fields): ``logprobs`` (behaviour), ``values`` (rollout values), ``advantages``, ``returns``,
    ``padding_mask``, ``padding_mask_p1``.
    Returns (loss, stats) with stats under TRL's short names.
    """
    padding_mask, padding_mask_p1 = batch.padding_mask, batch.padding_mask_p1
    new_logprobs, vpred = mask_policy_and_value(new_logprobs, vpred, padding_mask, padding_mask_p1)
    live = ~padding_mask
    pg_loss, ratio, pg_clipped = policy_loss(new_logprobs, batch.logprobs, batch.advantages, padding_mask,
                                             cliprange, policy_tokens)
    vf_loss, vf_clipped = value_loss(vpred, batch.values, batch.returns, padding_mask_p1, cliprange_value,
                                     value_tokens)
    denominator = jnp.sum(live) if policy_tokens is None else policy_tokens
    mean_entropy = jnp.sum(jnp.where(live, entropy, 0.0)) / denominator
    loss = pg_loss + vf_coef * vf_loss - entropy_coef * mean_entropy
    stats = diagnostics(new_logprobs, batch.logprobs, ratio, entropy, pg_clipped, vf_clipped,
                        padding_mask, padding_mask_p1)
    stats.update(pg_loss=pg_loss, vf_loss=vf_loss, loss=loss)
    return loss, stats


def diagnostics(new_logprobs, old_logprobs, ratio, entropy, pg_clipped, vf_clipped, padding_mask,
                padding_mask_p1):
    """Per-batch PPO diagnostics, each a masked mean over live tokens (TRL averages some over padding).

    approxkl = 0.5 (new - old)^2; ratio is the batch's mean ratio (TRL's ``val/ratio_var`` is the variance
    of these means across micro-batches, computed by the update); ratio_token_var is the (biased) masked
    variance of the ratio over this batch's tokens.
    """
    live, live_value = ~padding_mask, ~padding_mask_p1
    ratio_mean = masked_mean(ratio, live)
    return dict(
        approxkl=masked_mean(0.5 * jnp.square(new_logprobs - old_logprobs), live),
        pg_clipfrac=masked_mean(pg_clipped.astype(jnp.float32), live),
        vf_clipfrac=masked_mean(vf_clipped.astype(jnp.float32), live_value),
        entropy=masked_mean(entropy, live),
        ratio=ratio_mean,
        ratio_token_var=masked_mean(jnp.square(ratio - ratio_mean), live),
    )
