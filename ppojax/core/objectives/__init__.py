"""Policy objectives by name (``loss_type`` in the config): ppojax's PPO surrogate (``ppo``, the default), the
eight of TRL 1.12's GRPOTrainer (grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo) and GMPO.

An objective maps one micro-batch's log-probs and advantages to per-token policy losses; ``policy_term`` does
what they all share around it (importance weights per token or per sequence, the high-entropy token selection,
the aggregation). A new objective is one module here and one registration::

    @register_policy_objective("my_loss", aggregation="token-mean")
    def my_loss(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms:
        ratio = jnp.exp(inputs.log_weights)
        per_token = -jnp.minimum(ratio, 2.0) * inputs.advantages
        return ObjectiveTerms(jnp.where(inputs.selected, per_token, 0.0), ratio > 2.0, ratio, {})

and, for a config to name it without importing JAX, its traits in
``ppojax.trainer.config.sections.objective.BUILTIN_POLICY_OBJECTIVES`` (a notebook's own registration is seen
once this package is imported).
"""
# registered in this order (ppojax's own first, then TRL's loss types, then GMPO)
from ppojax.core.objectives import ppo, clipped, cispo, sapo, vespo, gmpo  # noqa: F401, I001
from ppojax.core.objectives.registry import (IMPORTANCE_SAMPLING_LEVELS, ObjectiveInputs, ObjectiveParams,
                                             ObjectiveTerms, PolicyObjective, policy_objective,
                                             policy_objective_names, register_policy_objective)
from ppojax.core.objectives.term import PolicyTerm, policy_term
from ppojax.core.objectives.tokens import high_entropy_tokens, importance_log_weights, quantile

__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "ObjectiveInputs", "ObjectiveParams", "ObjectiveTerms", "PolicyObjective",
           "PolicyTerm", "high_entropy_tokens", "importance_log_weights", "policy_objective",
           "policy_objective_names", "policy_term", "quantile", "register_policy_objective"]
