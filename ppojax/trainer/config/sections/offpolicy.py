"""The off-policy section: corrections for tokens that a policy other than the one being trained sampled
(docs/algorithm.md, "Off-policy corrections"; ``ppojax.core.offpolicy``).

TRL 1.12 GRPOConfig's names for its vLLM importance sampling correction and off-policy sequence masking, AReaL's for
its decoupled PPO objective. In a synchronous run with ``behaviour_logprobs: sampler`` the behaviour policy is the
sampler's log-probs and the proximal one the training policy's forward over the same tokens: the two differ by
the decode loop's numerics (bfloat16 KV cache, another kernel), which is what TRL corrects vLLM's samples for.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, above, at_least, one_of, setting

IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask",
                             "geometric_truncate", "geometric_mask")
"""What ppojax.core.offpolicy defines, kept here so that a config is checked without importing JAX."""
POLICY_OBJECTIVE_OFF_POLICY = {"vespo": "folded", "gmpo": "unsupported"}
"""How the built-in policy objectives that do not simply weigh their per-token loss take the corrections
(``PolicyObjective.off_policy``; the others: 'weighted')."""
POLICY_OBJECTIVE_OFF_POLICY_REASONS = {
    "vespo": "VESPO folds the token weights into its sequence's Gamma weight (TRL: vllm_importance_sampling_mode "
             "must be 'token_truncate' or 'token_mask')",
    "gmpo": "GMPO's loss is one number per sequence from its own geometric mean, and TRL's GMPOTrainer applies "
            "none of the off-policy corrections",
}


@dataclass
class OffPolicySettings:
    """Off-policy corrections: importance weights of the behaviour policy, off-policy sequence masking."""

    vllm_importance_sampling_correction: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Weigh each token's policy loss by sg(pi_prox / pi_behav): the training policy's forward over the sampled
    tokens against the sampler's own log-probs (TRL GRPOConfig's name; its default true applies only with vLLM).
    The clipped ratio is then pi_theta / pi_prox. Needs behaviour_logprobs: sampler (with 'forward' the two are
    the same numbers); the rollout then also runs the policy forward. The weights by
    vllm_importance_sampling_mode."""
    vllm_importance_sampling_mode: str = setting("sequence_mask", static=True, on_resume=MAY_CHANGE,
                                                 rule=one_of(*IMPORTANCE_SAMPLING_MODES))
    """With vllm_importance_sampling_correction (TRL's name and default): 'token_truncate' / 'token_mask', one weight
    per token clamped to [clip_min, clip_max] / set to 0 outside; 'sequence_truncate' / 'sequence_mask', one per
    sequence, the product of its token ratios (TRL's); 'geometric_truncate' / 'geometric_mask' (ppojax's; verl's
    geometric level), one per sequence, the geometric mean of its token ratios."""
    vllm_importance_sampling_clip_max: Optional[float] = setting(3.0, static=True, on_resume=MAY_CHANGE,
                                                                 rule=above(0))
    """With vllm_importance_sampling_correction: the weights' upper bound C_max (TRL's name and default; its
    deprecated vllm_importance_sampling_cap is read as this). None: no upper bound."""
    vllm_importance_sampling_clip_min: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE,
                                                                 rule=at_least(0))
    """With vllm_importance_sampling_correction: the weights' lower bound C_min, below clip_max (TRL's name).
    None: no lower bound."""
    off_policy_mask_threshold: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Off-policy sequence masking (DeepSeek-V3.2; TRL's name): the sequences with a negative advantage whose mean
    KL estimate log pi_behav - log pi_theta over their tokens exceeds this leave the loss, recomputed at every
    micro-batch. pi_behav: the sampler's log-probs, or the rollout's forward with behaviour_logprobs: forward.
    DeepSeek's example: 0.5. None: off."""
    use_decoupled_loss: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """AReaL's decoupled PPO objective: the clipped ratio is pi_theta / pi_prox and each token's loss is weighed by
    sg(pi_prox / pi_behav) (AReaL's name). Needs behaviour_logprobs: sampler; not with
    vllm_importance_sampling_correction (the same weight, truncated or masked TRL's way)."""
    behav_imp_weight_cap: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(1))
    """With use_decoupled_loss: the tokens whose behaviour weight exceeds this (> 1) leave the loss, their count kept
    in its denominator (AReaL's name). None: no cap."""


def policy_objective_off_policy(name: str) -> tuple[str, str]:
    """(how a registered policy objective takes the off-policy corrections, why when not 'weighted'); JAX-free as
    ``fields.registered`` is."""
    loaded = sys.modules.get("ppojax.core.objectives")
    kind = (POLICY_OBJECTIVE_OFF_POLICY.get(name, "weighted") if loaded is None
            else loaded.policy_objective(name).off_policy)
    return kind, POLICY_OBJECTIVE_OFF_POLICY_REASONS.get(name, "")
