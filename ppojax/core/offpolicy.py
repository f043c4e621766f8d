"""Off-policy corrections, as pure functions (docs/algorithm.md, "Off-policy corrections").

Three policies take part in an update on samples that a policy other than the one being trained produced:

    behaviour   pi_behav  the policy that sampled the tokens (the sampler's own log-probs; a stale policy version
                          in an asynchronous run)
    proximal    pi_prox   the training policy at the start of the update (its forward over the sampled tokens):
                          the trust region's centre, PPO's pi_old
    current     pi_theta  the parameters being trained (gradients flow here)

The clipped ratio is r = pi_theta / pi_prox; the behaviour weight w = sg(pi_prox / pi_behav) multiplies the
per-token loss (the decoupled PPO objective of AReaL, Fu et al. 2025, arXiv:2505.24298; TRL's vLLM importance
sampling correction is the same weight with its truncation or masking). Every log-prob array here is f32[B, R]
with ``live`` bool[B, R] the tokens in the loss; slots outside ``live`` never count.

- :func:`importance_weights`: the behaviour weight by TRL 1.12's ``vllm_importance_sampling_mode``: per token or
  per sequence (the product of the token ratios, TRL's), or per sequence as the geometric mean of the token
  ratios (ppojax's ``geometric_*`` modes, verl's "geometric" level), truncated to [clip_min, clip_max] or masked
  (set to 0) outside it;
- :func:`decoupled_weights`: AReaL's behaviour weight, masked above ``behav_imp_weight_cap``;
- :func:`off_policy_sequence_mask`: DeepSeek-V3.2's off-policy sequence masking (TRL's ``off_policy_mask_threshold``);
- :func:`importance_weight_metrics`, :func:`staleness_metrics`: what the update logs of them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

#: TRL 1.12's four ``vllm_importance_sampling_mode``s, then ppojax's geometric-mean sequence ratio
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                             "geometric_truncate", "geometric_mask")


class ImportanceWeights(NamedTuple):
    """Behaviour weights of one batch.

    weights: f32[B, R] the weight of each token's loss (a sequence-level weight on every slot of its row; 1 on
             the slots of a token-level weight outside ``live``); 0 where masked. No gradient.
    masked:  bool[B, R] the live tokens whose weight the mode's mask set to 0.
    rows:    f32[B] each row's weight for a sequence-level mode, else None.
    """

    weights: jax.Array
    masked: jax.Array
    rows: Optional[jax.Array]


def behaviour_log_ratio(proximal_logprobs, behaviour_logprobs, live):
    """log(pi_prox / pi_behav) per token, f32[B, R]: 0 outside ``live``, and 0 where the behaviour log-prob is
    NaN (a token the sampler could not score carries no correction: TRL's ``nan_to_num``)."""
    diff = jnp.where(live, proximal_logprobs - behaviour_logprobs, 0.0)
    return jnp.nan_to_num(diff, nan=0.0)


def sequence_log_ratio(log_ratio, live, reduce: str = "sum"):
    """Each row's log-ratio f32[B] from per-token ones (0 outside ``live``): 'sum', the log of the product of the
    token ratios (TRL's sequence modes), or 'mean', the log of their geometric mean (over the row's live tokens;
    0 for a row without any)."""
    summed = jnp.sum(jnp.where(live, log_ratio, 0.0), axis=-1)
    if reduce == "sum":
        return summed
    if reduce == "mean":
        return summed / jnp.maximum(jnp.sum(live, axis=-1), 1).astype(summed.dtype)
    raise ValueError(f"reduce={reduce!r}: expected 'sum' or 'mean'")


def _bounded(ratio, constraint: str, clip_min, clip_max):
    """(weights, masked) of ratios under 'truncate' (clamped to [clip_min, clip_max]) or 'mask' (0 outside it);
    None: no bound on that side."""
    if constraint == "truncate":
        low = -jnp.inf if clip_min is None else clip_min
        high = jnp.inf if clip_max is None else clip_max
        return jnp.clip(ratio, low, high), jnp.zeros(ratio.shape, bool)
    outside = jnp.zeros(ratio.shape, bool)
    if clip_min is not None:
        outside = outside | (ratio < clip_min)
    if clip_max is not None:
        outside = outside | (ratio > clip_max)
    return jnp.where(outside, 0.0, ratio), outside


def importance_weights(proximal_logprobs, behaviour_logprobs, live, mode: str, clip_max: Optional[float] = 3.0,
                       clip_min: Optional[float] = None) -> ImportanceWeights:
    """The behaviour weights sg(pi_prox / pi_behav) of TRL 1.12's ``vllm_importance_sampling_mode`` ``mode``.

    'token_*': per token, exp(log pi_prox - log pi_behav); 'sequence_*': per row, the product of its live
    tokens' ratios, exp(sum of their log-ratios) (TRL); 'geometric_*': per row, their geometric mean,
    exp(mean of their log-ratios) (ppojax's; verl's "geometric" level). '*_truncate' clamps the weight to
    [clip_min, clip_max]; '*_mask' sets it to 0 outside (TRL's names ``vllm_importance_sampling_clip_min`` /
    ``_clip_max``; None: unbounded on that side). proximal_logprobs, behaviour_logprobs f32[B, R]; live
    bool[B, R].
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: expected one of {IMPORTANCE_SAMPLING_MODES}")
    level, constraint = mode.split("_")
    log_ratio = jax.lax.stop_gradient(behaviour_log_ratio(proximal_logprobs, behaviour_logprobs, live))
    if level == "token":
        weights, masked = _bounded(jnp.exp(log_ratio), constraint, clip_min, clip_max)
        return ImportanceWeights(weights, masked & live, None)
    rows = jnp.exp(sequence_log_ratio(log_ratio, live, "sum" if level == "sequence" else "mean"))
    rows, masked = _bounded(rows, constraint, clip_min, clip_max)
    return ImportanceWeights(jnp.broadcast_to(rows[:, None], live.shape), masked[:, None] & live, rows)


def decoupled_weights(proximal_logprobs, behaviour_logprobs, live,
                      behav_imp_weight_cap: Optional[float] = None) -> ImportanceWeights:
    """AReaL's behaviour weight of the decoupled PPO objective: sg(pi_prox / pi_behav) per token, set to 0 (the
    token filtered out of the loss, its count kept in the denominator) where it exceeds ``behav_imp_weight_cap``
    (None: no cap). It is ``importance_weights`` in 'token_mask' mode with clip_max = the cap (uncapped:
    'token_truncate' without bounds)."""
    if behav_imp_weight_cap is None:
        return importance_weights(proximal_logprobs, behaviour_logprobs, live, "token_truncate", None, None)
    return importance_weights(proximal_logprobs, behaviour_logprobs, live, "token_mask", behav_imp_weight_cap)


def off_policy_sequence_mask(advantages, logprobs, behaviour_logprobs, live, threshold: float):
    """DeepSeek-V3.2's off-policy sequence masking (arXiv:2512.02556, eq. 9; TRL's ``get_off_policy_mask``):
    bool[B, R], False on the tokens of a row whose mean KL estimate log pi_behav - log pi_theta over its live
    tokens (pi_theta without gradient; NaN behaviour log-probs count 0) exceeds ``threshold`` where the advantage
    is negative. advantages f32[B, R] (one value per row with the group estimators: then the mask is TRL's per
    sequence; a per-token advantage decides per token)."""
    kl = jnp.nan_to_num(behaviour_logprobs - jax.lax.stop_gradient(logprobs), nan=0.0)
    mean_kl = sequence_log_ratio(kl, live, "mean")
    return (advantages >= 0) | (mean_kl[:, None] <= threshold)


def importance_weight_metrics(weights: ImportanceWeights, proximal_logprobs, behaviour_logprobs, live) -> dict:
    """TRL 1.12's metrics of the behaviour weights, and the share they masked:

    ``sampling/importance_sampling_ratio/{min,mean,max}``: over the live tokens (token level) or over every row
    (sequence level), as TRL (0 when there is none); ``sampling/sampling_logp_difference/{mean,max}``: of
    |log pi_prox - log pi_behav| over the live tokens whose behaviour log-prob is not NaN;
    ``offpolicy/importance_sampling_masked_fraction`` (ppojax's): the share of live tokens whose weight a mask
    set to 0."""
    if weights.rows is not None:
        values, counted = weights.rows, jnp.ones(weights.rows.shape, bool)
    else:
        values, counted = weights.weights, live
    count = jnp.sum(counted)
    some = count > 0
    delta = jnp.abs(proximal_logprobs - behaviour_logprobs)
    scored = live & ~jnp.isnan(delta)
    scored_count = jnp.sum(scored)
    live_count = jnp.maximum(jnp.sum(live), 1).astype(jnp.float32)
    return {
        "sampling/importance_sampling_ratio/min": jnp.where(some, jnp.min(jnp.where(counted, values, jnp.inf)), 0.0),
        "sampling/importance_sampling_ratio/mean": jnp.where(
            some, jnp.sum(jnp.where(counted, values, 0.0)) / jnp.maximum(count, 1), 0.0),
        "sampling/importance_sampling_ratio/max": jnp.where(some, jnp.max(jnp.where(counted, values, -jnp.inf)), 0.0),
        "sampling/sampling_logp_difference/mean": jnp.where(
            scored_count > 0, jnp.sum(jnp.where(scored, delta, 0.0)) / jnp.maximum(scored_count, 1), 0.0),
        "sampling/sampling_logp_difference/max": jnp.where(
            scored_count > 0, jnp.max(jnp.where(scored, delta, -jnp.inf)), 0.0),
        "offpolicy/importance_sampling_masked_fraction": jnp.sum(weights.masked) / live_count,
    }


def staleness_metrics(policy_versions, current_version, live) -> dict:
    """How many policy versions behind the current one the batch's live tokens were sampled:
    ``offpolicy/staleness_mean`` (f32) and ``offpolicy/staleness_max`` (i32), 0 without live tokens.
    policy_versions i32[B, R]; current_version i32[] (``TrainState.update_count``)."""
    lag = (jnp.asarray(current_version, jnp.int32) - policy_versions).astype(jnp.int32)
    count = jnp.sum(live)
    return {"offpolicy/staleness_mean": jnp.sum(jnp.where(live, lag, 0)).astype(jnp.float32)
            / jnp.maximum(count, 1).astype(jnp.float32),
            "offpolicy/staleness_max": jnp.max(jnp.where(live, lag, 0))}
