"""GMPO (Geometric-Mean Policy Optimization, Zhao et al. 2025): the geometric mean of the clipped token ratios
(``loss_type: gmpo``; TRL's experimental GMPOTrainer)."""
import jax.numpy as jnp

from ppojax.core.objectives.clipped import clip_metrics
from ppojax.core.objectives.registry import (ObjectiveInputs, ObjectiveParams, ObjectiveTerms,
                                             register_policy_objective, sequence_advantages)


@register_policy_objective(
    "gmpo", aggregation="seq-mean-token-mean", levels=("token",), sequence_advantages=True,
    level_reason="GMPO's ratio is already the geometric mean of a sequence's token ratios", off_policy="unsupported")
def gmpo(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """-A exp(mean_t sgn-clip(log r_t)) per sequence: each token's log-ratio clipped (in LOG space, to
    [-cliprange_low, cliprange_high]) on the side its advantage's sign makes pessimistic, averaged over the
    selected tokens, exponentiated. The sequence's loss is put on each of its live tokens, so the per-sequence
    mean of 'seq-mean-token-mean' is the paper's mean over sequences. No importance weight on the KL term."""
    log_ratio = inputs.logprobs - inputs.old_logprobs
    advantage = sequence_advantages(inputs)
    bounded = jnp.clip(log_ratio, -params.cliprange_low, params.cliprange_high)
    pessimistic = jnp.where(advantage[:, None] > 0, jnp.minimum(log_ratio, bounded), jnp.maximum(log_ratio, bounded))
    selected = inputs.selected
    log_mean = (jnp.sum(jnp.where(selected, pessimistic, 0.0), axis=-1)
                / jnp.maximum(jnp.sum(selected, axis=-1), 1).astype(log_ratio.dtype))
    per_sequence = -jnp.exp(log_mean) * advantage
    region, metrics = clip_metrics(log_ratio, inputs, -params.cliprange_low, params.cliprange_high)
    per_token = jnp.broadcast_to(per_sequence[:, None], log_ratio.shape)
    return ObjectiveTerms(per_token, region, None, metrics)
