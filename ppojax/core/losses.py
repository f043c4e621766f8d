"""The clipped PPO losses and their diagnostics (docs/algorithm.md, "Loss").

Masks named ``padding_mask*`` are True on padding. A micro-batch's sums are divided by the counts of its
whole MINI-batch (live tokens ``policy_tokens`` / ``value_tokens``, or ``rows`` for the sequence-mean
aggregation modes), so summing micro-batch gradients gives exactly the big-batch gradient. With one
micro-batch per mini-batch and ``loss_agg_mode='token-mean'`` this is TRL's ``masked_mean``.
"""

import jax
import jax.numpy as jnp

from ppojax.core.masks import INVALID_LOGPROB
from ppojax.core.stats import masked_mean


def entropy_from_logits(logits):
    """Entropy of softmax(logits) = logsumexp(l) - sum(softmax(l) * l), float32. f[..., V] -> f32[...]."""
    logits = logits.astype(jnp.float32)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


def mask_policy_and_value(new_logprobs, vpred, padding_mask, padding_mask_p1):
    """Mask a fresh forward as the rollout was masked: INVALID_LOGPROB and zero values on padding."""
    return (jnp.where(padding_mask, INVALID_LOGPROB, new_logprobs), jnp.where(padding_mask_p1, 0.0, vpred))


#: How per-token losses become one number (verl's ``loss_agg_mode``; TRL's GRPO ``loss_type`` in brackets):
#: 'token-mean'             sum over live tokens / live tokens of the batch (PPO, TRL's PPO; GRPO 'bnpo'/'dapo')
#: 'seq-mean-token-mean'    each sequence's token mean, then the mean over sequences (GRPO 'grpo')
#: 'seq-mean-token-sum-norm' sum over live tokens / (sequences x response_length): a fixed-length sum with no
#:                          length bias (GRPO 'dr_grpo')
#: 'seq-mean-token-sum'     each sequence's token sum, then the mean over sequences (GRPO 'luspo')
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum")


def aggregate(per_token, padding_mask, mode="token-mean", *, tokens=None, rows=None):
    """A scalar from per-token losses f32[B, R] over live tokens (padding_mask True = padding), by ``mode``.

    tokens / rows: the live-token count and the row count of the whole MINI-batch when this is one of its
    micro-batches (None: this batch's own), so that micro-batch results SUM to the mini-batch's value.
    """
    live = ~padding_mask
    summed_rows = jnp.sum(jnp.where(live, per_token, 0.0), axis=-1)
    rows = per_token.shape[0] if rows is None else rows
    if mode == "token-mean":  # (no live token, e.g. every row masked as truncated: 0, not 0 / 0)
        return jnp.sum(summed_rows) / jnp.maximum(jnp.sum(live) if tokens is None else tokens, 1)
    if mode == "seq-mean-token-mean":
        return jnp.sum(summed_rows / jnp.maximum(jnp.sum(live, axis=-1), 1)) / rows
    if mode == "seq-mean-token-sum-norm":
        return jnp.sum(summed_rows) / (rows * per_token.shape[-1])
    if mode == "seq-mean-token-sum":
        return jnp.sum(summed_rows) / rows
    raise ValueError(f"loss_agg_mode={mode!r}; expected one of {LOSS_AGG_MODES}")


def policy_loss(new_logprobs, old_logprobs, advantages, padding_mask, cliprange, policy_tokens=None, *,
                cliprange_high=None, dual_clip_c=None, loss_agg_mode="token-mean", rows=None):
    """Clipped surrogate max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange_high)) over live tokens.

    All f32[B, R]. cliprange_high: the upper clip range ("clip-higher", DAPO; None = cliprange).
    dual_clip_c: for A < 0, the loss is at most -A c (dual-clip PPO, Ye et al. 2020; TRL's GRPO ``delta``;
    None = off). Aggregated by ``loss_agg_mode`` (:func:`aggregate`; ``policy_tokens`` / ``rows`` are the
    mini-batch's counts). Returns (loss scalar, ratio f32[B, R], clipped bool[B, R]).
    """
    ratio = jnp.exp(new_logprobs - old_logprobs)
    per_token, pg_clipped = clipped_surrogate(ratio, advantages, cliprange, cliprange_high, dual_clip_c)
    loss = aggregate(per_token, padding_mask, loss_agg_mode, tokens=policy_tokens, rows=rows)
    return loss, ratio, pg_clipped


def clipped_surrogate(ratio, advantages, cliprange, cliprange_high=None, dual_clip_c=None):
    """Per token max(-A r, -A clip(r, 1 - cliprange, 1 + cliprange_high)), at most -A c for A < 0 with
    ``dual_clip_c`` = c. f32[B, R] -> (loss f32[B, R], clipped bool[B, R]: where the clipped term won)."""
    upper = cliprange if cliprange_high is None else cliprange_high
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + upper)
    per_token = jnp.maximum(unclipped, clipped)
    if dual_clip_c is not None:
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, -advantages * dual_clip_c), per_token)
    return per_token, clipped > unclipped


def value_loss(vpred, old_values, returns, padding_mask_p1, cliprange_value, value_tokens=None):
    """0.5 * sum(max((v - R)^2, (clip(v, V_old +- eps_v) - R)^2)) over live value slots / value_tokens.

    All f32[B, R]. Returns (loss scalar, clipped bool[B, R]).
    """
    live = ~padding_mask_p1
    vpred_clipped = jnp.clip(vpred, old_values - cliprange_value, old_values + cliprange_value)
    unclipped = jnp.square(vpred - returns)
    clipped = jnp.square(vpred_clipped - returns)
    denominator = jnp.maximum(jnp.sum(live) if value_tokens is None else value_tokens, 1)
    loss = 0.5 * jnp.sum(jnp.where(live, jnp.maximum(unclipped, clipped), 0.0)) / denominator
    return loss, clipped > unclipped


def ppo_loss(new_logprobs, vpred, entropy, batch, *, cliprange, cliprange_value, vf_coef, entropy_coef=0.0,
             policy_tokens=None, value_tokens=None, rows=None, cliprange_high=None, dual_clip_c=None,
             loss_agg_mode="token-mean", kl_loss_coef=0.0, kl_loss_fn=None, with_value=True, policy_term=None):
    """loss = pg_loss + vf_coef * vf_loss + kl_loss_coef * kl_loss - entropy_coef * mean entropy, and the
    diagnostics.

    new_logprobs, vpred, entropy: f32[B, R] from the current parameters (unmasked; masked here). With a static
    ``entropy_coef`` of 0 the entropy is only a statistic: no gradient flows through it.
    batch: the rollout's side (``ppojax.rl.types.UpdateBatch`` or anything with these f32[B, R] / bool[B, R]
    fields): ``logprobs`` (behaviour), ``values`` (rollout values), ``advantages``, ``returns``,
    ``padding_mask``, ``padding_mask_p1``, and ``ref_logprobs`` when ``kl_loss_coef`` > 0.
    kl_loss_fn: a per-token KL estimator (logprobs, ref_logprobs) -> f32[B, R] for the KL-in-the-loss term
    (GRPO-style), aggregated like the policy loss. with_value=False: no critic, no value term.
    policy_term: None for the clipped surrogate above, or ``(new_logprobs masked, batch, entropy) ->
    ppojax.core.objectives.PolicyTerm``, a registered objective's (then the clip and aggregation arguments are
    its business): its KL term takes the objective's aggregation and importance weight, its entropy bonus is the
    mean over the tokens it trains, and its own metrics are ``stats["objective"]``.
    Returns (loss, stats) with stats under TRL's short names.
    """
    padding_mask, padding_mask_p1 = batch.padding_mask, batch.padding_mask_p1
    new_logprobs, vpred = mask_policy_and_value(new_logprobs, vpred, padding_mask, padding_mask_p1)
    live = ~padding_mask
    term = None if policy_term is None else policy_term(new_logprobs, batch, entropy)
    if term is None:
        pg_loss, ratio, pg_clipped = policy_loss(new_logprobs, batch.logprobs, batch.advantages, padding_mask,
                                                 cliprange, policy_tokens, cliprange_high=cliprange_high,
                                                 dual_clip_c=dual_clip_c, loss_agg_mode=loss_agg_mode, rows=rows)
    else:
        pg_loss, ratio, pg_clipped = term.loss, jnp.exp(new_logprobs - batch.logprobs), term.clipped
        loss_agg_mode = term.aggregation
    denominator = jnp.maximum(jnp.sum(live) if policy_tokens is None else policy_tokens, 1)
    if isinstance(entropy_coef, (int, float)) and entropy_coef == 0:
        # Without an entropy bonus the entropy is a statistic (TRL computes it under no_grad): no backward
        # through the vocabulary-sized softmax, and a non-finite entropy cannot reach the gradients as 0 * nan.
        entropy = jax.lax.stop_gradient(entropy)
    if term is not None and term.selected is not None:  # the bonus acts on the tokens that train (TRL)
        mean_entropy = _selected_mean(entropy, term.selected, rows)
    else:
        mean_entropy = jnp.sum(jnp.where(live, entropy, 0.0)) / denominator
    loss = pg_loss - entropy_coef * mean_entropy
    stats = diagnostics(new_logprobs, batch.logprobs, ratio, entropy, pg_clipped, padding_mask)
    stats.update(pg_loss=pg_loss)
    if term is not None:
        stats["objective"] = dict(term.metrics)
    if with_value:
        vf_loss, vf_clipped = value_loss(vpred, batch.values, batch.returns, padding_mask_p1, cliprange_value,
                                         value_tokens)
        loss = loss + vf_coef * vf_loss
        stats.update(vf_loss=vf_loss, vf_clipfrac=masked_mean(vf_clipped.astype(jnp.float32), ~padding_mask_p1))
    if kl_loss_fn is not None and not (isinstance(kl_loss_coef, (int, float)) and kl_loss_coef == 0):
        per_token_kl = kl_loss_fn(new_logprobs, batch.ref_logprobs)
        if term is not None and term.kl_weight is not None:  # TRL GRPO's use_bias_correction_kl
            per_token_kl = per_token_kl * term.kl_weight
        kl_loss = aggregate(per_token_kl, padding_mask, loss_agg_mode, tokens=policy_tokens, rows=rows)
        loss = loss + kl_loss_coef * kl_loss
        stats.update(kl_loss=kl_loss)
        if term is not None:
            stats["objective"]["kl"] = masked_mean(per_token_kl, live)
    stats.update(loss=loss)
    return loss, stats


def _selected_mean(values, selected, rows=None):
    """The mean of f32[B, R] over the ``selected`` tokens of this batch, scaled by its share B / ``rows`` of the
    mini-batch's rows (TRL's per-micro-batch mean divided by the accumulation steps)."""
    mean = jnp.sum(jnp.where(selected, values, 0.0)) / jnp.maximum(jnp.sum(selected), 1)
    return mean if rows is None else mean * (values.shape[0] / rows)


def diagnostics(new_logprobs, old_logprobs, ratio, entropy, pg_clipped, padding_mask):
    """Per-batch PPO diagnostics, each a masked mean over live tokens (TRL averages some over padding).

    approxkl = 0.5 (new - old)^2; ratio is the batch's mean ratio (TRL's ``val/ratio_var`` is the variance
    of these means across micro-batches, computed by the update); ratio_token_var is the (biased) masked
    variance of the ratio over this batch's tokens.
    """
    live = ~padding_mask
    ratio_mean = masked_mean(ratio, live)
    return dict(
        approxkl=masked_mean(0.5 * jnp.square(new_logprobs - old_logprobs), live),
        pg_clipfrac=masked_mean(pg_clipped.astype(jnp.float32), live),
        entropy=masked_mean(entropy, live),
        ratio=ratio_mean,
        ratio_token_var=masked_mean(jnp.square(ratio - ratio_mean), live),
    )
