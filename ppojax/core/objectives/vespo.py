"""VESPO (Variational Sequence-Level Soft Policy Optimization, 2026): a Gamma-shaped weight of the sequence's
importance ratio (``loss_type: vespo``)."""
import math

import jax
import jax.numpy as jnp

from ppojax.core.objectives.registry import (ObjectiveInputs, ObjectiveParams, ObjectiveTerms,
                                             register_policy_objective, sequence_advantages)

_LOG_MIN_WEIGHT = math.log(1e-8)


def gamma_weights(inputs: ObjectiveInputs, params: ObjectiveParams):
    """f32[B] phi(w) = exp(lambda + k log w - lambda w) (phi(1) = 1) of each row's importance ratio w = prod_t r_t
    (log-ratios clamped to [-20, 20], log w to [log 1e-8, 20]); k, lambda = vespo_k_pos, vespo_lambda_pos where
    the row's advantage is >= 0, else the _neg ones; non-finite phi is 0. No gradient (TRL's
    ``get_gamma_weights``). With off-policy behaviour weights (token level) w also carries them: log w adds each
    live token's log weight, clamped to [log 1e-8, 20] (a masked weight of 0 counts log 1e-8), so that it is
    pi_theta / pi_behav (TRL's vLLM importance sampling with VESPO)."""
    log_ratio = jnp.clip(inputs.logprobs - inputs.old_logprobs, -20.0, 20.0)
    log_w = jnp.sum(jnp.where(inputs.live, log_ratio, 0.0), axis=-1)
    if inputs.behaviour_weights is not None:
        log_behaviour = jnp.clip(jnp.log(inputs.behaviour_weights), _LOG_MIN_WEIGHT, 20.0)
        log_w = log_w + jnp.sum(jnp.where(inputs.live, log_behaviour, 0.0), axis=-1)
    log_w = jnp.clip(log_w, _LOG_MIN_WEIGHT, 20.0)
    non_negative = sequence_advantages(inputs) >= 0
    k = jnp.where(non_negative, params.vespo_k_pos, params.vespo_k_neg)
    lam = jnp.maximum(jnp.where(non_negative, params.vespo_lambda_pos, params.vespo_lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jnp.where(jnp.isfinite(phi), phi, 0.0)
    return jax.lax.stop_gradient(phi)


@register_policy_objective(
    "vespo", aggregation="token-mean", levels=("token",), sequence_advantages=True,
    options=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
    off_policy="folded",
    level_reason="VESPO weighs each sequence by its own sequence-level ratio (TRL: importance_sampling_level "
                 "should be 'token')")
def vespo(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """-phi(w) A log pi per token: a REINFORCE gradient weighted by the sequence's Gamma weight."""
    phi = gamma_weights(inputs, params)
    per_token = -phi[:, None] * inputs.advantages * inputs.logprobs
    return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), jnp.zeros_like(inputs.live),
                          jnp.exp(inputs.log_weights), {"vespo/phi_seq_mean": jnp.mean(phi)})
