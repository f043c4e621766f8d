"""ppojax's own PPO surrogate (``loss_type: ppo``, the default): docs/algorithm.md, "Loss"."""
import jax.numpy as jnp

from ppojax.core.losses import clipped_surrogate
from ppojax.core.objectives.registry import ObjectiveInputs, ObjectiveParams, ObjectiveTerms, register_policy_objective


@register_policy_objective("ppo", aggregation=None, options=("loss_agg_mode", "dual_clip_c"))
def ppo_objective(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
    """max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high)), at most -A c for A < 0 with dual_clip_c = c
    (dual-clip PPO, Ye et al. 2020), averaged by the config's ``loss_agg_mode``."""
    ratio = jnp.exp(inputs.log_weights)
    per_token, clipped = clipped_surrogate(ratio, inputs.advantages, params.cliprange_low, params.cliprange_high,
                                           params.dual_clip_c)
    return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), clipped, ratio, {})
