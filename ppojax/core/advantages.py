"""Advantage estimators by name (``advantage_estimator`` in the config).

An estimator maps one rollout batch's rewards (and values, if it uses a critic) to per-token advantages
and value targets. A new one is one function and one registration::

    @register_advantage_estimator("my_estimator", uses_critic=False)   # needs_groups=True: uses groups
    def my_estimator(batch: AdvantageInputs, settings) -> Advantages:
        ...

``settings`` is the run's ``ppojax.rl.settings.AlgorithmSettings`` (``gamma``, ``lam``, ``num_generations``,
``scale_rewards``, ``normalize_advantages``, ...). Estimators with ``uses_critic=False`` build no value model: the
rollout computes no values and the loss has no value term.

Group estimators (``grpo``, ``rloo``) read the rollout rows as ``B / G`` groups of ``G = num_generations``
CONSECUTIVE rows, each group the samples of one prompt (``ppojax.rl.rollout.sample`` repeats each prompt ``G``
times). A sequence's return is the sum of its KL-shaped rewards: the score when the KL is in the loss
(``kl_coef: 0``), score - kl_coef * sum(kl) when it is in the reward (TRL's RLOO, verl's use_kl_in_reward).
"""
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from ppojax.core.gae import Advantages, advantages_and_returns, gae
from ppojax.core.stats import masked_whiten

#: Added to a standard deviation before dividing by it (TRL's GRPO and RLOO use 1e-4).
STD_EPS = 1e-4


class AdvantageInputs(NamedTuple):
    """What an estimator may read, for B rollout rows of R response tokens (masks: True = padding).

    rewards:  f32[B, R]  KL-shaped per-token rewards with the score at the end slot
                         (docs/algorithm.md, "Shaped rewards").
    scores:   f32[B]     the sequence scores in those rewards.
    values:   f32[B, R]  the critic's values (0 on padding_mask_p1), or None without a critic.
    padding_mask, padding_mask_p1: bool[B, R].
    components: f32[F, B] each reward's own values before weighting (NaN where it does not apply), or None
                (the scores are one reward); component_weights: f32[F] their weights (``reward_weights``).
    environment_mask: bool[B, R] True on a multi-turn episode's environment tokens (already in both padding
                masks), or None: the token-level estimators' scans pass through them (``gae``).
    """

    rewards: jax.Array
    scores: jax.Array
    values: jax.Array | None
    padding_mask: jax.Array
    padding_mask_p1: jax.Array
    components: jax.Array | None = None
    component_weights: jax.Array | None = None
    environment_mask: jax.Array | None = None


class AdvantageEstimator(NamedTuple):
    name: str
    fn: Callable  # (AdvantageInputs, settings) -> Advantages
    uses_critic: bool
    needs_groups: bool = False  # compares the num_generations samples of each prompt (needs >= 2)
    per_sequence: bool = False  # one advantage per sequence, on each of its live tokens


_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, uses_critic: bool, needs_groups: bool = False,
                                 per_sequence: bool = False):
    """Decorator: make ``fn(inputs: AdvantageInputs, settings) -> Advantages`` available by ``name``."""
    def register(fn):
        _REGISTRY[name] = AdvantageEstimator(name, fn, uses_critic, needs_groups, per_sequence)
        return fn
    return register


def advantage_estimator(name: str) -> AdvantageEstimator:
    if name not in _REGISTRY:
        raise ValueError(f"advantage_estimator={name!r}: expected one of {advantage_estimator_names()}.")
    return _REGISTRY[name]


def advantage_estimator_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


@register_advantage_estimator("gae", uses_critic=True)
def gae_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """GAE over the shaped rewards and the critic's values; returns = A + V; A whitened over live tokens."""
    return advantages_and_returns(batch.rewards, batch.values, batch.padding_mask, settings.gamma, settings.lam,
                                  environment_mask=batch.environment_mask)


# --------------------------------------------------------------------------------------------------
# Critic-free estimators
# --------------------------------------------------------------------------------------------------
def sequence_returns(rewards):
    """f32[B, R] KL-shaped rewards -> f32[B]: each sequence's undiscounted return (the rewards are 0 past
    the score slot)."""
    return jnp.sum(rewards, axis=-1)


def grouped(values, group_size: int):
    """f32[B] -> f32[B / G, G]: consecutive rows form a group."""
    if values.shape[0] % group_size:
        raise ValueError(f"{values.shape[0]} rows do not split into groups of num_generations={group_size}")
    return values.reshape(-1, group_size)


def _per_token(sequence_advantages, padding_mask) -> Advantages:
    """One advantage per sequence f32[B] -> the same on each of its live tokens, 0 on padding; the returns
    (a value target no critic reads) are the same array."""
    tokens = jnp.where(padding_mask, 0.0, sequence_advantages[:, None])
    return Advantages(advantages=tokens, returns=tokens)


@register_advantage_estimator("grpo", uses_critic=False, needs_groups=True, per_sequence=True)
def grpo_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """GRPO (Shao et al. 2024; TRL's GRPOTrainer): A = (R - mean of the group) / (std + 1e-4).

    ``scale_rewards``: 'group' divides by the group's std, 'batch' by the whole batch's, 'none' not at all
    (Dr. GRPO). Standard deviations are unbiased (torch.std's, as TRL). ``multi_objective_aggregation``:
    'sum_then_normalize' (default) is this on the weighted sum of the rewards; 'normalize_then_sum' is
    :func:`normalize_then_sum_advantages`.
    """
    if getattr(settings, "multi_objective_aggregation", "sum_then_normalize") == "normalize_then_sum":
        return normalize_then_sum_advantages(batch, settings)
    returns = sequence_returns(batch.rewards)
    groups = grouped(returns, settings.num_generations)
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if settings.scale_rewards == "group":
        centred = centred / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif settings.scale_rewards == "batch":
        centred = centred / (jnp.std(returns, ddof=1) + STD_EPS)
    return _per_token(centred.reshape(-1), batch.padding_mask)


@register_advantage_estimator("rloo", uses_critic=False, needs_groups=True, per_sequence=True)
def rloo_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """RLOO (Ahmadian et al. 2024; TRL's RLOOTrainer): A_i = R_i - mean of the OTHER G - 1 returns of its
    group. ``normalize_advantages``: then whitened over the batch, (A - mean) / (std + 1e-4), as TRL."""
    returns = sequence_returns(batch.rewards)
    groups = grouped(returns, settings.num_generations)
    size = settings.num_generations
    baseline = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (size - 1)
    advantages = (groups - baseline).reshape(-1)
    if settings.normalize_advantages:
        advantages = (advantages - jnp.mean(advantages)) / (jnp.std(advantages, ddof=1) + STD_EPS)
    return _per_token(advantages, batch.padding_mask)


@register_advantage_estimator("reinforce_pp", uses_critic=False)
def reinforce_pp_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """REINFORCE++ (Hu 2025; verl's 'reinforce_plus_plus'): the discounted reward-to-go of the token-level
    KL-shaped rewards, whitened over the live tokens of the whole (global) batch; 0 on padding.

    The reward-to-go is GAE with no values and lambda = 1; returns are the raw reward-to-go."""
    to_go = gae(batch.rewards, jnp.zeros_like(batch.rewards), settings.gamma, 1.0, batch.environment_mask)
    advantages = masked_whiten(to_go, ~batch.padding_mask, shift_mean=True)
    return Advantages(advantages=jnp.where(batch.padding_mask, 0.0, advantages), returns=to_go)


def _nan_mean(values, axis=None, keepdims=False):
    """torch.nanmean: the mean of the non-NaN values (NaN when there are none)."""
    present = ~jnp.isnan(values)
    total = jnp.sum(jnp.where(present, values, 0.0), axis=axis, keepdims=keepdims)
    return total / jnp.sum(present, axis=axis, keepdims=keepdims).astype(values.dtype)


def _nan_std(values, axis=None, keepdims=False):
    """TRL's ``nanstd``: the unbiased standard deviation of the non-NaN values (NaN for fewer than 2)."""
    mean = _nan_mean(values, axis=axis, keepdims=True)
    variance = _nan_mean(jnp.square(values - mean), axis=axis, keepdims=keepdims)
    count = jnp.sum(~jnp.isnan(values), axis=axis, keepdims=keepdims).astype(values.dtype)
    return jnp.sqrt(jnp.where(count > 1, variance * count / (count - 1), jnp.nan))


def normalize_then_sum_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """GDPO's reward-decoupled normalisation (Liu et al. 2026; TRL's ``multi_objective_aggregation:
    normalize_then_sum``): each reward is normalised within its group, (r_k - mean_group) / (std_group + 1e-4),
    NaN (does not apply) left out; R = sum_k w_k r~_k (NaN where no reward applies), plus the KL part of the
    shaped rewards when the KL is in the reward; then A = (R - mean_batch R) / (std_batch R + 1e-4), 0 where R is
    NaN. ``scale_rewards`` plays no part (TRL). Without components (caller-given scores) the scores are the one
    reward."""
    size = settings.num_generations
    if batch.components is None:
        components, weights = batch.scores[None], jnp.ones((1,), jnp.float32)
    else:
        components, weights = batch.components, batch.component_weights
    groups = components.reshape(components.shape[0], -1, size)
    normalised = ((groups - _nan_mean(groups, axis=2, keepdims=True))
                  / (_nan_std(groups, axis=2, keepdims=True) + STD_EPS)).reshape(components.shape)
    applies = ~jnp.isnan(normalised)
    total = jnp.sum(jnp.where(applies, weights[:, None] * normalised, 0.0), axis=0)
    total = jnp.where(jnp.any(~jnp.isnan(components), axis=0), total, jnp.nan)
    total = total + (sequence_returns(batch.rewards) - batch.scores)  # the KL in the reward (0 without it)
    advantages = (total - _nan_mean(total)) / (_nan_std(total) + STD_EPS)
    return _per_token(jnp.where(jnp.isnan(advantages), 0.0, advantages), batch.padding_mask)


@register_advantage_estimator("reinforce_pp_baseline", uses_critic=False, per_sequence=True)
def reinforce_pp_baseline_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """REINFORCE++-baseline (Hu et al. 2025; verl's 'reinforce_plus_plus_baseline', transcribed from
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``): each sequence's return minus the mean return of
    its group (0 for a group of one sample), put on each live token, then whitened over the live tokens of the
    whole batch, (x - mean) / sqrt(var + 1e-8) with the unbiased variance; 0 on padding. Returns are the same
    array."""
    returns = sequence_returns(batch.rewards)
    groups = grouped(returns, settings.num_generations)
    baseline = jnp.mean(groups, axis=1, keepdims=True) if settings.num_generations > 1 else 0.0
    centred = (groups - baseline).reshape(-1)
    live = ~batch.padding_mask
    tokens = jnp.where(live, centred[:, None], 0.0)
    whitened = jnp.where(live, masked_whiten(tokens, live, shift_mean=True), 0.0)
    return Advantages(advantages=whitened, returns=whitened)
