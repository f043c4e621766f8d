"""TRL GRPOTrainer's clipped objective and the five ``loss_type``s that differ only in how they average it:
grpo, dr_grpo, dapo, bnpo, luspo (docs/algorithm.md, "Policy objectives")."""
import jax.numpy as jnp

from ppojax.core.objectives.registry import (ObjectiveInputs, ObjectiveParams, ObjectiveTerms, logged_mean,
                                             register_policy_objective, row_means)


def clip_metrics(ratio, inputs: ObjectiveInputs, low, high) -> tuple:
    """(region-clipped bool[B, R], TRL's ``clip_ratio/*`` metrics) for ratios clipped to [low, high]: below
    ``low`` with A < 0, above ``high`` with A > 0."""
    advantages = inputs.advantages
    low_clipped = (ratio < low) & (advantages < 0)
    high_clipped = (ratio > high) & (advantages > 0)
    region = low_clipped | high_clipped
    return region, {
        "clip_ratio/low_mean": logged_mean(low_clipped, inputs),
        "clip_ratio/high_mean": logged_mean(high_clipped, inputs),
        "clip_ratio/region_mean": logged_mean(region, inputs),
        "clip_ratio/low_min": jnp.nanmin(row_means(low_clipped, inputs)),
        "clip_ratio/high_max": jnp.nanmax(row_means(high_clipped, inputs)),
    }


def grpo_clipped(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """-min(min(r, delta) A, clip(r, 1 - epsilon, 1 + epsilon_high) A) per token, r the importance weight at the
    configured level (GRPO, Shao et al. 2024; two-sided with ``delta``, INTELLECT-2). ``delta`` is
    ``dual_clip_c``: for delta >= 1 + epsilon_high it is the dual clip of ``loss_type: ppo``."""
    ratio = jnp.exp(inputs.log_weights)
    clipped_ratio = jnp.clip(ratio, 1.0 - params.cliprange_low, 1.0 + params.cliprange_high)
    bounded = ratio if params.dual_clip_c is None else jnp.minimum(ratio, params.dual_clip_c)
    advantages = inputs.advantages
    per_token = -jnp.minimum(bounded * advantages, clipped_ratio * advantages)
    region, metrics = clip_metrics(bounded, inputs, 1.0 - params.cliprange_low, 1.0 + params.cliprange_high)
    return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), region, ratio, metrics)


#: loss_type -> how it averages (TRL 1.12's GRPOTrainer._compute_loss)
CLIPPED_LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",      # each sequence's token mean, then over sequences (Shao et al. 2024)
    "dr_grpo": "seq-mean-token-sum-norm",  # sum / (sequences x max length) (Liu et al. 2025)
    "dapo": "token-mean",               # over the optimizer step's live tokens (Yu et al. 2025)
    "bnpo": "token-mean",               # TRL: over a micro-batch's live tokens; ppojax: the mini-batch's
}
for _name, _mode in CLIPPED_LOSS_TYPES.items():
    register_policy_objective(_name, aggregation=_mode, options=("dual_clip_c",))(grpo_clipped)

register_policy_objective(
    "luspo", aggregation="seq-mean-token-sum", levels=("sequence",), options=("dual_clip_c",),
    level_reason="LUSPO is GSPO's sequence-level objective scaled by each sequence's length (TRL: it requires "
                 "importance_sampling_level='sequence')")(grpo_clipped)
