"""Advantage estimators by name (``advantage_estimator`` in the config).

An estimator maps one rollout batch's rewards (and values, if it uses a critic) to per-token advantages
and value targets. A new one is one function and one registration::

    @register_advantage_estimator("my_estimator", uses_critic=False)
    def my_estimator(batch: AdvantageInputs, settings) -> Advantages:
        ...

``settings`` is the run's static settings (``gamma``, ``lam``, ...). Estimators with ``uses_critic=False``
build no value model: the rollout computes no values and the loss has no value term.
"""
from typing import Callable, NamedTuple

import jax

from .gae import Advantages, advantages_and_returns


class AdvantageInputs(NamedTuple):
    """What an estimator may read, for B rollout rows of R response tokens (masks: True = padding).

    rewards:  f32[B, R]  KL-shaped per-token rewards with the score at the end slot (SPEC).
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


_REGISTRY: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(name: str, *, uses_critic: bool):
    """Decorator: make ``fn(inputs: AdvantageInputs, settings) -> Advantages`` available by ``name``."""
    def register(fn):
        _REGISTRY[name] = AdvantageEstimator(name, fn, uses_critic)
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
