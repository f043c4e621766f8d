"""SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025): a smooth gate instead of the hard clip
(``loss_type: sapo``)."""
import jax
import jax.numpy as jnp

from ppojax.core.objectives.registry import ObjectiveInputs, ObjectiveParams, ObjectiveTerms, register_policy_objective


@register_policy_objective("sapo", aggregation="seq-mean-token-mean",
                           options=("sapo_temperature_pos", "sapo_temperature_neg"))
def sapo(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """-sigmoid(tau (r - 1)) 4 / tau * A per token, tau = sapo_temperature_pos where A > 0, else
    sapo_temperature_neg: the gradient is r's times a bell that is 1 at r = 1 and fades away from it."""
    ratio = jnp.exp(inputs.log_weights)
    tau = jnp.where(inputs.advantages > 0, params.sapo_temperature_pos, params.sapo_temperature_neg)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    per_token = -gate * inputs.advantages
    return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), jnp.zeros_like(inputs.live), ratio, {})
