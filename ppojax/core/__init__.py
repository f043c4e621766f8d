"""PPO's math as pure JAX functions (docs/algorithm.md), no model code. Every function works under jit/vmap/grad."""
from ppojax.core.advantages import (AdvantageEstimator, AdvantageInputs, advantage_estimator,
                                    advantage_estimator_names, register_advantage_estimator)
from ppojax.core.controllers import (RunningMoments, adaptive_kl_update, fixed_kl_update, process_scores,
                                     update_running_moments)
from ppojax.core.gae import Advantages, advantages_and_returns, gae
from ppojax.core.kl import (KL_ESTIMATORS, KLEstimator, kl_abs, kl_estimator, kl_estimator_names, kl_full, kl_k1,
                            kl_k2, kl_k3, kl_low_var, kl_mse, kl_per_token, register_kl_estimator)
from ppojax.core.losses import (LOSS_AGG_MODES, aggregate, clipped_surrogate, diagnostics, entropy_from_logits,
                                mask_policy_and_value, policy_loss, ppo_loss, value_loss)
from ppojax.core.masks import (INVALID_LOGPROB, ResponseMasks, contains_stop_token, first_true_indices,
                               response_masks, truncate_response)
from ppojax.core.objectives import (IMPORTANCE_SAMPLING_LEVELS, ObjectiveInputs, ObjectiveParams, ObjectiveTerms,
                                    PolicyObjective, PolicyTerm, policy_objective, policy_objective_names,
                                    policy_term, register_policy_objective)
from ppojax.core.offpolicy import (IMPORTANCE_SAMPLING_MODES, ImportanceWeights, behaviour_log_ratio,
                                   decoupled_weights, importance_weight_metrics, importance_weights,
                                   off_policy_sequence_mask, sequence_log_ratio, staleness_metrics)
from ppojax.core.overlong import soft_overlong_punishment
from ppojax.core.metrics import LOSS_METRIC_NAMES, UPDATE_METRIC_NAMES, rollout_metrics
from ppojax.core.shaping import (SCORE_POSITIONS, ShapedRewards, apply_missing_eos_penalty, penalise_missing_stop,
                                 score_index, shaped_rewards)
from ppojax.core.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    # advantages
    "AdvantageEstimator", "AdvantageInputs", "advantage_estimator", "advantage_estimator_names",
    "register_advantage_estimator",
    # controllers
    "RunningMoments", "adaptive_kl_update", "fixed_kl_update", "process_scores", "update_running_moments",
    # gae
    "Advantages", "advantages_and_returns", "gae",
    # kl
    "KL_ESTIMATORS", "KLEstimator", "kl_abs", "kl_estimator", "kl_estimator_names", "kl_full", "kl_k1", "kl_k2",
    "kl_k3", "kl_low_var", "kl_mse", "kl_per_token", "register_kl_estimator",
    # losses
    "LOSS_AGG_MODES", "aggregate", "clipped_surrogate", "diagnostics", "entropy_from_logits",
    "mask_policy_and_value", "policy_loss", "ppo_loss", "value_loss",
    # masks
    "INVALID_LOGPROB", "ResponseMasks", "contains_stop_token", "first_true_indices", "response_masks",
    "truncate_response",
    # policy objectives, the overlong penalty
    "IMPORTANCE_SAMPLING_LEVELS", "ObjectiveInputs", "ObjectiveParams", "ObjectiveTerms", "PolicyObjective",
    "PolicyTerm", "policy_objective", "policy_objective_names", "policy_term", "register_policy_objective",
    "soft_overlong_punishment",
    # off-policy corrections
    "IMPORTANCE_SAMPLING_MODES", "ImportanceWeights", "behaviour_log_ratio", "decoupled_weights",
    "importance_weight_metrics", "importance_weights", "off_policy_sequence_mask", "sequence_log_ratio",
    "staleness_metrics",
    # metrics
    "LOSS_METRIC_NAMES", "UPDATE_METRIC_NAMES", "rollout_metrics",
    # shaping
    "SCORE_POSITIONS", "ShapedRewards", "apply_missing_eos_penalty", "penalise_missing_stop", "score_index",
    "shaped_rewards",
    # stats
    "masked_mean", "masked_sum", "masked_var", "masked_whiten",
]
