"""The policy term of the loss from a registered objective: the importance weights at the configured level, the
high-entropy token selection, the objective, the off-policy corrections and its aggregation (docs/algorithm.md,
"Policy objectives", "Off-policy corrections")."""
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ppojax.core.losses import aggregate
from ppojax.core.offpolicy import off_policy_sequence_mask
from ppojax.core.objectives.registry import ObjectiveInputs, ObjectiveParams, policy_objective
from ppojax.core.objectives.tokens import high_entropy_tokens, importance_log_weights


class PolicyTerm(NamedTuple):
    """loss: f32[] the aggregated policy loss; clipped: bool[B, R] (``pg_clipfrac``); kl_weight: f32[B, R] the
    KL term's importance weight (None: the plain KL); aggregation: the ``loss_agg_mode`` the KL term takes too;
    selected: bool[B, R] the tokens that train (None: every live token); metrics: the objective's own."""

    loss: jax.Array
    clipped: jax.Array
    kl_weight: Optional[jax.Array]
    aggregation: str
    selected: Optional[jax.Array]
    metrics: dict


def policy_term(name: str, params: ObjectiveParams, new_logprobs, old_logprobs, advantages, padding_mask, entropy, *,
                importance_sampling_level: str = "token", top_entropy_quantile: float = 1.0,
                use_bias_correction_kl: bool = False, loss_agg_mode: str = "token-mean", policy_tokens=None,
                rows=None, behaviour_weights=None, behaviour_logprobs=None,
                off_policy_mask_threshold: Optional[float] = None) -> PolicyTerm:
    """The policy term of objective ``name`` (``loss_type``) on one micro-batch.

    new_logprobs / old_logprobs / advantages / entropy: f32[B, R], the first two INVALID_LOGPROB on padding;
    padding_mask: bool[B, R] (True = not in the loss). policy_tokens / rows: the mini-batch's live tokens and rows
    (None: this batch's own), so that micro-batch terms sum to the mini-batch's.
    use_bias_correction_kl: the KL term is to be multiplied by the importance weight (TRL GRPO's option).

    The off-policy corrections (``ppojax.core.offpolicy``; docs/algorithm.md, "Off-policy corrections"), applied
    to the objective's per-token loss in TRL GRPOTrainer's order: off_policy_mask_threshold (not None), the tokens
    of the rows ``off_policy_sequence_mask`` drops leave the loss (their counts stay in the denominators), with
    ``behaviour_logprobs`` f32[B, R] the behaviour policy's log-probs (None: ``old_logprobs``); behaviour_weights
    f32[B, R] (not None), the per-token loss is multiplied by them (an objective registered with
    ``off_policy='folded'`` reads them instead). The KL term is not weighted (TRL).
    """
    objective = policy_objective(name)
    live = ~padding_mask
    selected = high_entropy_tokens(jax.lax.stop_gradient(entropy), live, top_entropy_quantile)
    log_weights = importance_log_weights(new_logprobs - old_logprobs, live, importance_sampling_level)
    folded = behaviour_weights is not None and objective.off_policy == "folded"
    inputs = ObjectiveInputs(new_logprobs, old_logprobs, advantages, live, selected, log_weights,
                             importance_sampling_level == "sequence", behaviour_weights if folded else None)
    terms = objective.fn(inputs, params)
    per_token, metrics = terms.per_token, dict(terms.metrics)
    if off_policy_mask_threshold is not None:
        behaviour = old_logprobs if behaviour_logprobs is None else behaviour_logprobs
        kept = off_policy_sequence_mask(advantages, new_logprobs, behaviour, live, off_policy_mask_threshold)
        per_token = jnp.where(kept, per_token, 0.0)
        metrics["offpolicy/off_policy_masked_fraction"] = (jnp.sum(live & ~kept).astype(jnp.float32)
                                                           / jnp.maximum(jnp.sum(live), 1))
    if behaviour_weights is not None and not folded:
        per_token = per_token * behaviour_weights
    mode = objective.aggregation or loss_agg_mode
    loss = aggregate(per_token, padding_mask, mode, tokens=policy_tokens, rows=rows)
    return PolicyTerm(loss, terms.clipped, terms.kl_weight if use_bias_correction_kl else None, mode,
                      None if top_entropy_quantile >= 1.0 else selected, metrics)

