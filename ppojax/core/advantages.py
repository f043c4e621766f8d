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
    """

    rewards: jax.Array
    scores: jax.Array
    values: jax.Array | None
    padding_mask: jax.Array
    padding_mask_p1: jax.Array


class AdvantageEstimator(NamedTuple):
    name: str
    fn: Callable  # (AdvantageInputs, settings) -> Advantages
    uses_critic: bool
    needs_groups: bool = False  # compares the num_generations samples of each prompt (needs >= 2)


_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, uses_critic: bool, needs_groups: bool = False):
    """Decorator: make ``fn(inputs: AdvantageInputs, settings) -> Advantages`` available by ``name``."""
    def register(fn):
        _REGISTRY[name] = AdvantageEstimator(name, fn, uses_critic, needs_groups)
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
    return advantages_and_returns(batch.rewards, batch.values, batch.padding_mask, settings.gamma, settings.lam)


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


@register_advantage_estimator("grpo", uses_critic=False, needs_groups=True)
def grpo_advantages(batch: AdvantageInputs, settings) -> Advantages:
    """GRPO (Shao et al. 2024; TRL's GRPOTrainer): A = (R - mean of the group) / (std + 1e-4).

    ``scale_rewards``: 'group' divides by the group's std, 'batch' by the whole batch's, 'none' not at all
    (Dr. GRPO). Standard deviations are unbiased (torch.std's, as TRL).
    """
    returns = sequence_returns(batch.rewards)
    groups = grouped(returns, settings.num_generations)
    centred = groups - jnp.mean(groups, axis=1, keepdims=True)
    if settings.scale_rewards == "group":
        centred = centred / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + STD_EPS)
    elif settings.scale_rewards == "batch":
        centred = centred / (jnp.std(returns, ddof=1) + STD_EPS)
    return _per_token(centred.reshape(-1), batch.padding_mask)


@register_advantage_estimator("rloo", uses_critic=False, needs_groups=True)
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
    to_go = gae(batch.rewards, jnp.zeros_like(batch.rewards), settings.gamma, 1.0)
    advantages = masked_whiten(to_go, ~batch.padding_mask, shift_mean=True)
    return Advantages(advantages=jnp.where(batch.padding_mask, 0.0, advantages), returns=to_go)
