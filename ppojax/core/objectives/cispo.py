"""CISPO (MiniMax-M1, 2025): clip the importance weight, not the update (``loss_type: cispo``)."""
import jax
import jax.numpy as jnp

from ppojax.core.objectives.registry import (ObjectiveInputs, ObjectiveParams, ObjectiveTerms, logged_mean,
                                             register_policy_objective)


@register_policy_objective("cispo", aggregation="token-mean")
def cispo(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """-sg(min(r, epsilon_high)) A log pi per token: every token keeps a gradient, weighted by its importance
    weight capped at ``cliprange_high`` ITSELF (TRL's epsilon_high, ScaleRL's epsilon_max: 5.0 recommended; unset
    it is cliprange, as in TRL), with no gradient through the weight."""
    ratio = jnp.exp(inputs.log_weights)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, params.cliprange_high))
    per_token = -weight * inputs.advantages * inputs.logprobs
    capped = (ratio > params.cliprange_high) & (inputs.advantages > 0)
    return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), capped, ratio,
                          {"cispo_clip_ratio": logged_mean(capped, inputs)})
