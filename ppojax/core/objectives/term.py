"""The policy term of the loss from a registered objective: the importance weights at the configured level, the
high-entropy token selection, the objective, and its aggregation (docs/algorithm.md, "Policy objectives")."""
from typing import NamedTuple, Optional

import jax

from ppojax.core.losses import aggregate
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
                rows=None) -> PolicyTerm:
    """The policy term of objective ``name`` (``loss_type``) on one micro-batch.

    new_logprobs / old_logprobs / advantages / entropy: f32[B, R], the first two INVALID_LOGPROB on padding;
    padding_mask: bool[B, R] (True = not in the loss). policy_tokens / rows: the mini-batch's live tokens and rows
    (None: this batch's own), so that micro-batch terms sum to the mini-batch's.
    use_bias_correction_kl: the KL term is to be multiplied by the importance weight (TRL GRPO's option).
    """
    objective = policy_objective(name)
    live = ~padding_mask
    selected = high_entropy_tokens(jax.lax.stop_gradient(entropy), live, top_entropy_quantile)
    log_weights = importance_log_weights(new_logprobs - old_logprobs, live, importance_sampling_level)
    inputs = ObjectiveInputs(new_logprobs, old_logprobs, advantages, live, selected, log_weights,
                             importance_sampling_level == "sequence")
    terms = objective.fn(inputs, params)
    mode = objective.aggregation or loss_agg_mode
    loss = aggregate(terms.per_token, padding_mask, mode, tokens=policy_tokens, rows=rows)
    return PolicyTerm(loss, terms.clipped, terms.kl_weight if use_bias_correction_kl else None, mode,
                      None if top_entropy_quantile >= 1.0 else selected, terms.metrics)

