"""The objective section: the policy and value losses (clipping, coefficients, aggregation), the advantage
estimators, the KL penalties (in the reward and in the loss), score shaping, and legacy TRL's controls.

The KL estimators and advantage estimators are registries of ``ppojax.core``; their built-in names are spelled
here so that a config is checked without importing JAX (``registered``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import (MAY_CHANGE, MUST_MATCH, NON_EMPTY, above, at_least, between, one_of,
                                         registered, setting)

BUILTIN_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "mse", "full")
BUILTIN_ADVANTAGE_ESTIMATORS = {  # name: (uses_critic, needs_groups)
    "gae": (True, False), "grpo": (False, True), "rloo": (False, True), "reinforce_pp": (False, False),
    "reinforce_pp_baseline": (False, False)}
PER_SEQUENCE_ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")
"""The built-in estimators that put one advantage on every live token of a sequence."""
_CLIPPED_OPTIONS = ("dual_clip_c",)
BUILTIN_POLICY_OBJECTIVES = {  # name: (aggregation (None: loss_agg_mode), importance-sampling levels,
    #                                     reads one advantage per sequence, the options only it reads)
    "ppo": (None, ("token", "sequence"), False, ("loss_agg_mode", "dual_clip_c")),
    "grpo": ("seq-mean-token-mean", ("token", "sequence"), False, _CLIPPED_OPTIONS),
    "dr_grpo": ("seq-mean-token-sum-norm", ("token", "sequence"), False, _CLIPPED_OPTIONS),
    "dapo": ("token-mean", ("token", "sequence"), False, _CLIPPED_OPTIONS),
    "bnpo": ("token-mean", ("token", "sequence"), False, _CLIPPED_OPTIONS),
    "luspo": ("seq-mean-token-sum", ("sequence",), False, _CLIPPED_OPTIONS),
    "cispo": ("token-mean", ("token", "sequence"), False, ()),
    "sapo": ("seq-mean-token-mean", ("token", "sequence"), False, ("sapo_temperature_pos", "sapo_temperature_neg")),
    "vespo": ("token-mean", ("token",), True, ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    "gmpo": ("seq-mean-token-mean", ("token",), True, ()),
}
POLICY_OBJECTIVE_LEVEL_REASONS = {  # why an objective takes only some importance-sampling levels
    "luspo": "LUSPO is GSPO's sequence-level objective scaled by each sequence's length (TRL: it requires "
             "importance_sampling_level='sequence')",
    "vespo": "VESPO weighs each sequence by its own sequence-level ratio (TRL: importance_sampling_level should be "
             "'token')",
    "gmpo": "GMPO's ratio is already the geometric mean of a sequence's token ratios",
}
SCORE_POSITIONS = ("trl", "legacy")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "seq-mean-token-sum")
"""What ppojax.core defines, kept here so that a config is checked without importing JAX."""


KL_ESTIMATOR_NAME = registered("KL estimators", "kl", "kl_estimator_names", BUILTIN_KL_ESTIMATORS)
ADVANTAGE_ESTIMATOR_NAME = registered("advantage estimators", "advantages", "advantage_estimator_names",
                                      tuple(BUILTIN_ADVANTAGE_ESTIMATORS))
POLICY_OBJECTIVE_NAME = registered("policy objectives", "objectives", "policy_objective_names",
                                   tuple(BUILTIN_POLICY_OBJECTIVES))


def advantage_estimator_traits(name: str) -> tuple[bool, bool]:
    """(uses_critic, needs_groups) of a registered advantage estimator; JAX-free as ``registered`` is."""
    loaded = sys.modules.get("ppojax.core.advantages")
    if loaded is None:
        return BUILTIN_ADVANTAGE_ESTIMATORS[name]
    estimator = loaded.advantage_estimator(name)
    return estimator.uses_critic, estimator.needs_groups


def per_sequence_advantages(name: str) -> bool:
    """Whether a registered advantage estimator gives one advantage per sequence."""
    loaded = sys.modules.get("ppojax.core.advantages")
    if loaded is None:
        return name in PER_SEQUENCE_ADVANTAGE_ESTIMATORS
    return loaded.advantage_estimator(name).per_sequence


def policy_objective_level_reason(name: str) -> str:
    """Why a registered policy objective takes only some importance-sampling levels ('' when it takes both)."""
    loaded = sys.modules.get("ppojax.core.objectives")
    if loaded is None:
        return POLICY_OBJECTIVE_LEVEL_REASONS.get(name, "")
    return loaded.policy_objective(name).level_reason


def policy_objective_traits(name: str) -> tuple:
    """(aggregation, levels, sequence_advantages, options) of a registered policy objective; JAX-free."""
    loaded = sys.modules.get("ppojax.core.objectives")
    if loaded is None:
        return BUILTIN_POLICY_OBJECTIVES[name]
    objective = loaded.policy_objective(name)
    return objective.aggregation, objective.levels, objective.sequence_advantages, objective.options


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
    reward-to-go whitened over the batch), 'reinforce_pp_baseline' (REINFORCE++-baseline: the return minus its
    group's mean, whitened over the batch; verl's reinforce_plus_plus_baseline). grpo and rloo need
    num_generations >= 2."""
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
    epsilon_high, verl's clip_ratio_high). loss_type cispo: the importance weight's cap itself; gmpo: the upper
    bound of the log-ratio."""
    dual_clip_c: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(1))
    """Dual-clip PPO: for negative advantages the per-token loss is at most -A * dual_clip_c (> 1; verl's
    clip_ratio_c, TRL's GRPO delta). With TRL's clipped loss types (grpo, dr_grpo, dapo, bnpo, luspo) it is TRL's
    delta: the unclipped term's ratio is capped at it (the same for delta >= 1 + cliprange_high). None: off."""
    loss_agg_mode: str = setting("token-mean", static=True, on_resume=MAY_CHANGE, rule=one_of(*LOSS_AGG_MODES))
    """How per-token policy (and KL) losses are averaged with loss_type 'ppo' (verl's names): 'token-mean' over the
    batch's live tokens (PPO; TRL's GRPO 'bnpo'/'dapo'), 'seq-mean-token-mean' (each sequence's mean, then over
    sequences: TRL's 'grpo'), 'seq-mean-token-sum-norm' (sum / (sequences x response_length): TRL's 'dr_grpo'),
    'seq-mean-token-sum' (each sequence's sum, then over sequences: TRL's 'luspo'). The other loss types average
    their own way."""
    loss_type: str = setting("ppo", static=True, on_resume=MAY_CHANGE, rule=POLICY_OBJECTIVE_NAME)
    """The policy objective (TRL GRPOConfig's name; docs/algorithm.md, "Policy objectives"): 'ppo' (ppojax's
    clipped surrogate with clip-higher and dual-clip, averaged by loss_agg_mode); TRL's 'grpo', 'dr_grpo', 'dapo',
    'bnpo' (the clipped surrogate, two-sided with delta, averaged per sequence, by sequences x length, over the
    tokens), 'luspo' (GSPO scaled by length; importance_sampling_level: sequence), 'cispo' (clipped importance
    weight times log-prob: cliprange_high is the weight's cap, 5.0 recommended), 'sapo' (a soft gate), 'vespo'
    (a Gamma weight of the sequence ratio); 'gmpo' (geometric mean of the token ratios, clipped in log space:
    cliprange / cliprange_high are log-ratio bounds, 0.4 recommended). A config file that sets one of TRL's
    loss types is read as a TRL GRPOTrainer config (docs/configuration.md, "Other libraries' names")."""
    importance_sampling_level: str = setting("token", static=True, on_resume=MAY_CHANGE,
                                             rule=one_of("token", "sequence"))
    """'token': one importance ratio per token; 'sequence' (GSPO): each sequence's geometric-mean ratio
    exp(mean_t log r_t) on all its tokens (TRL's name)."""
    top_entropy_quantile: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=between(0, 1))
    """Train only the tokens whose entropy is in the top quantile of a micro-batch's (TRL's name; "Beyond the
    80/20 rule" recommends 0.2): 1.0 trains all, 0.0 only the highest-entropy token."""
    mask_truncated_completions: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Leave responses without the stop token (cut off at response_length) out of the loss; their rewards still
    count in their group's statistics (TRL's name; DAPO). Needs a stop token."""
    use_bias_correction_kl: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Multiply the KL-in-the-loss term by the importance ratio (TRL GRPO's name; its default is true, ppojax's
    false; DeepSeek-V3.2). Needs kl_loss_coef > 0."""
    sapo_temperature_pos: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """loss_type sapo: the gate's temperature for tokens with a positive advantage (TRL's name)."""
    sapo_temperature_neg: float = setting(1.05, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """loss_type sapo: the gate's temperature for tokens with a non-positive advantage (TRL's name)."""
    vespo_k_pos: float = setting(2.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """loss_type vespo: the Gamma weight's power k for non-negative advantages (TRL's name)."""
    vespo_lambda_pos: float = setting(3.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """loss_type vespo: the Gamma weight's decay lambda for non-negative advantages (TRL's name)."""
    vespo_k_neg: float = setting(3.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """loss_type vespo: the Gamma weight's power k for negative advantages (TRL's name)."""
    vespo_lambda_neg: float = setting(2.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """loss_type vespo: the Gamma weight's decay lambda for negative advantages (TRL's name)."""
    multi_objective_aggregation: str = setting("sum_then_normalize", static=True, on_resume=MAY_CHANGE,
                                               rule=one_of("sum_then_normalize", "normalize_then_sum"))
    """advantage_estimator grpo with several rewards (TRL's name): 'sum_then_normalize' normalises the weighted
    sum of the rewards by scale_rewards; 'normalize_then_sum' (GDPO) normalises each reward within its group, sums
    them with reward_weights, then normalises the sum over the batch."""
    soft_punish_cache: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """DAPO's soft overlong punishment, added to the score (TRL's reward get_soft_overlong_punishment with
    max_completion_len = response_length): 0 up to response_length - soft_punish_cache tokens, then falling
    linearly to -1 at response_length. 0: off."""
    filter_groups: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """DAPO's dynamic sampling (verl's algorithm.filter_groups.enable): the groups whose num_generations samples all
    got the same score (after missing_eos_penalty and soft_punish_cache; with mask_truncated_completions also those
    whose every response was truncated) train nothing and are dropped, and the batch is refilled with the groups
    of further prompts, sampled in rounds of gen_batch_size prompts, at most max_num_gen_batches rounds an update,
    all inside the one compiled step. Needs num_generations >= 2 and an advantage estimator that compares a
    prompt's samples (grpo, rloo, reinforce_pp_baseline). Logged under dynamic_sampling/ (docs/algorithm.md,
    "Dynamic sampling")."""
    max_num_gen_batches: int = setting(3, static=True, on_resume=MAY_CHANGE, rule=at_least(1, fix=(
        "Fix: set max_num_gen_batches to the most generation rounds one update may sample, e.g. 3 (verl's 0 or "
        "less, no bound, cannot be: every round is part of one compiled program of fixed shapes); 1 drops the "
        "groups without refilling.")))
    """filter_groups: the most generation rounds one update samples (verl's name), >= 1; 1 leaves the dropped groups
    out of the loss without refilling. An update the bound stops before its batch is full trains the groups it
    kept, the rest of its rows (dropped groups) left out of the loss (dynamic_sampling/batch_full 0), where verl
    raises."""
    gen_batch_size: Optional[int] = setting(None, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """filter_groups: prompts per generation round (verl's data.gen_batch_size: prompts, each sampled
    num_generations times). None: the update's own, batch_size / num_generations. A larger one oversamples, so
    that most updates fill in one round. The data advance by the rounds an update used."""
    filter_groups_metric: Optional[str] = setting(None, static=True, on_resume=MAY_CHANGE, rule=NON_EMPTY)
    """filter_groups: the reward (its name among reward_funcs, or the reward model's folder name) whose values judge
    a group, as verl's filter_groups.metric (DAPO's recipe: 'acc', its accuracy reward, so that the overlong
    penalty and other rewards do not make a group count); a group is dropped when that reward's values are all
    equal where it applies. None: the score the advantages are computed from."""
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
