"""The objective section: the policy and value losses (clipping, coefficients, aggregation), the advantage
estimators, the KL penalties (in the reward and in the loss), score shaping, and legacy TRL's controls.

The KL estimators and advantage estimators are registries of ``ppojax.core``; their built-in names are spelled
here so that a config is checked without importing JAX (``registered``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, MUST_MATCH, above, at_least, between, one_of, registered, setting

BUILTIN_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "mse", "full")
BUILTIN_ADVANTAGE_ESTIMATORS = {  # name: (uses_critic, needs_groups)
    "gae": (True, False), "grpo": (False, True), "rloo": (False, True), "reinforce_pp": (False, False)}
SCORE_POSITIONS = ("trl", "legacy")
"""What ppojax.core defines, kept here so that a config is checked without importing JAX."""


KL_ESTIMATOR_NAME = registered("KL estimators", "kl", "kl_estimator_names", BUILTIN_KL_ESTIMATORS)
ADVANTAGE_ESTIMATOR_NAME = registered("advantage estimators", "advantages", "advantage_estimator_names",
                                      tuple(BUILTIN_ADVANTAGE_ESTIMATORS))


def _advantage_estimator_traits(name: str) -> tuple[bool, bool]:
    """(uses_critic, needs_groups) of a registered advantage estimator; JAX-free as ``registered`` is."""
    loaded = sys.modules.get("ppojax.core.advantages")
    if loaded is None:
        return BUILTIN_ADVANTAGE_ESTIMATORS[name]
    estimator = loaded.advantage_estimator(name)
    return estimator.uses_critic, estimator.needs_groups


@dataclass
class ObjectiveSettings:
    """What an update optimises: PPO's and GRPO's losses, advantages, KL and score shaping."""

    cliprange: float = setting(0.2, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """PPO's policy ratio clip range epsilon: the ratio is clipped to [1 - cliprange, 1 + cliprange]."""
    cliprange_value: float = setting(0.2, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Clip range of the value prediction around the rollout's values."""
    vf_coef: float = setting(0.1, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the value loss in the total loss."""
    entropy_coef: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the entropy bonus subtracted from the loss (0: off, as TRL). Its value is traced; turning the
    bonus on or off (0 <-> > 0) compiles anew."""
    gamma: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=between(0, 1))
    """Discount factor of the returns."""
    lam: float = setting(0.95, static=True, on_resume=MAY_CHANGE, rule=between(0, 1))
    """GAE's lambda: 0 uses one-step TD errors (low variance), 1 the full returns (no bias)."""
    whiten_rewards: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Whiten the KL-shaped rewards (over the batch's response tokens) before GAE."""
    kl_coef: float = setting(0.05, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the per-token KL penalty to the reference model (the adaptive controller's initial value)."""
    kl_estimator: str = setting("k1", static=True, on_resume=MAY_CHANGE,
                                rule=KL_ESTIMATOR_NAME)
    """Per-token KL estimator: 'k1', 'k3', or legacy 'abs', 'mse', 'full'."""
    advantage_estimator: str = setting("gae", static=True, on_resume=MUST_MATCH,
                                       rule=ADVANTAGE_ESTIMATOR_NAME)
    """How advantages are computed from the rewards: 'gae' (generalised advantage estimation with the value
    model: PPO); the critic-free ones, which build no value model: 'grpo' (group-relative: (R - group mean) /
    group std), 'rloo' (leave-one-out group baseline), 'reinforce_pp' (REINFORCE++: the token-level KL-shaped
    reward-to-go whitened over the batch). grpo and rloo need num_generations >= 2."""
    num_generations: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Samples per prompt (TRL's GRPO/RLOO name; legacy RLOO: rloo_k): each prompt is sampled this many
    times and its samples form one group of consecutive rows. batch_size counts samples, so an update takes
    batch_size / num_generations prompts."""
    scale_rewards: str = setting("group", static=True, on_resume=MAY_CHANGE, rule=one_of("group", "batch", "none"))
    """grpo only (TRL's name): divide the centred returns by the std of their group ('group'), of the whole
    batch ('batch'), or not at all ('none': Dr. GRPO)."""
    normalize_advantages: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """rloo only (TRL's name): whiten the leave-one-out advantages over the batch."""
    critic_warmup: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Updates at the start of the run that train only the value function (verl's critic_warmup): the
    policy's parameters stay as they are. Needs a critic (advantage_estimator: gae)."""
    kl_loss_coef: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of a KL-to-the-reference term IN THE LOSS (GRPO-style; TRL's GRPO beta, verl's kl_loss_coef);
    0: off. kl_coef is the KL in the REWARD (PPO-style): set it to 0 to keep the KL in the loss only. Its value is
    traced; turning the term on or off (0 <-> > 0) compiles anew."""
    kl_loss_type: str = setting("low_var_kl", static=True, on_resume=MAY_CHANGE,
                                rule=KL_ESTIMATOR_NAME)
    """The per-token KL estimator of the loss term: 'low_var_kl' (k3 clamped to [-10, 10], verl), 'k3'
    (TRL's GRPO), 'k2', 'k1', ... ('full' is for the reward only)."""
    cliprange_low: Optional[float] = setting(None, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Lower policy clip range: the ratio is clipped below at 1 - cliprange_low (None: cliprange; TRL's
    GRPO epsilon, verl's clip_ratio_low)."""
    cliprange_high: Optional[float] = setting(None, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Upper policy clip range ("clip-higher", DAPO recommends 0.28): clipped above at 1 + cliprange_high
    (None: cliprange_low where it is set, else cliprange, as TRL's epsilon_high defaults to its epsilon; TRL's
    epsilon_high, verl's clip_ratio_high)."""
    dual_clip_c: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(1))
    """Dual-clip PPO: for negative advantages the per-token loss is at most -A * dual_clip_c (> 1; verl's
    clip_ratio_c, TRL's GRPO delta). None: off."""
    loss_agg_mode: str = setting("token-mean", static=True, on_resume=MAY_CHANGE,
                                 rule=one_of("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    """How per-token policy (and KL) losses are averaged (verl's names): 'token-mean' over the batch's live
    tokens (PPO; TRL's GRPO 'bnpo'/'dapo'), 'seq-mean-token-mean' (each sequence's mean, then over sequences:
    TRL's 'grpo'), 'seq-mean-token-sum-norm' (sum / (sequences x response_length): TRL's 'dr_grpo')."""
    adaptive_kl: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy adaptive KL controller (Ziegler et al.); kl_coef is its initial value."""
    target_kl_for_adaptive: float = setting(6.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """The KL (nats per sequence) the adaptive controller steers towards (legacy TRL's `target`)."""
    horizon: int = setting(10000, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """The adaptive controller's horizon: how fast kl_coef moves (legacy TRL's `horizon`)."""
    score_position: str = setting("trl", static=True, on_resume=MAY_CHANGE,
                                  rule=one_of(*SCORE_POSITIONS))
    """'trl': the score goes on the slot after the last token; 'legacy': on the last token."""
    missing_eos_penalty: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Subtracted from the score of a response without the stop token (None: off; needs a stop token)."""
    use_score_scaling: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: divide scores by their running standard deviation."""
    use_score_norm: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: also subtract the running mean (needs use_score_scaling)."""
    score_clip: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy: clip the (scaled) scores to [-score_clip, score_clip] (None: off)."""
    ratio_threshold: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy: skip a mini-batch whose masked mean ratio exceeds this (None: off)."""
    early_stopping: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: stop an update's epochs once the policy KL exceeds 1.5 * target_kl."""
    target_kl: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy early stopping: stop the epochs once the policy KL exceeds 1.5 * target_kl."""
