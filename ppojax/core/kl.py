"""Per-token KL estimators between the policy and the reference (docs/algorithm.md, "KL estimators"), by name.

Every estimator takes float32 log-probs of the CHOSEN tokens, shape [..., R]; with INVALID_LOGPROB written
into both on padding, every estimator is exactly 0 there. A new estimator is one function and one
registration::

    @register_kl_estimator("k2")
    def kl_k2(logprobs, ref_logprobs):
        return 0.5 * jnp.square(logprobs - ref_logprobs)

``full`` is registered with ``needs_full_distribution=True``: it is computed in the rollout from both
models' whole distributions (``ppojax.rl.forward.full_kl_from_hidden``), not from the chosen tokens.
"""
from typing import Callable, NamedTuple

import jax.numpy as jnp


class KLEstimator(NamedTuple):
    name: str
    fn: Callable | None           # (logprobs f32[..., R], ref_logprobs f32[..., R]) -> f32[..., R]
    needs_full_distribution: bool = False


_REGISTRY: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str, *, needs_full_distribution: bool = False):
    """Decorator: make ``fn(logprobs, ref_logprobs) -> kl`` available as ``kl_estimator: name``."""
    def register(fn):
        _REGISTRY[name] = KLEstimator(name, fn, needs_full_distribution)
        return fn
    return register


def kl_estimator(name: str) -> KLEstimator:
    if name not in _REGISTRY:
        raise ValueError(f"kl_estimator={name!r}: expected one of {kl_estimator_names()}.")
    return _REGISTRY[name]


def kl_estimator_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


@register_kl_estimator("k1")
def kl_k1(logprobs, ref_logprobs):
    """k1 = log pi - log pi_ref (unbiased, can be negative)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs, ref_logprobs):
    """k2 = (log r)^2 / 2 (Schulman's k2; verl's 'mse'/'k2'): non-negative, biased, low variance."""
    return 0.5 * jnp.square(logprobs - ref_logprobs)


@register_kl_estimator("k3")
def kl_k3(logprobs, ref_logprobs):
    """k3 = (r - 1) - log r with log r = ref - logprobs (non-negative, low variance)."""
    log_ratio = ref_logprobs - logprobs
    return jnp.expm1(log_ratio) - log_ratio


@register_kl_estimator("low_var_kl")
def kl_low_var(logprobs, ref_logprobs):
    """k3 clamped to [-10, 10] (verl's 'low_var_kl'): k3's low variance without its blow-up when the policy
    puts far less mass on a token than the reference (exp(ref - logprobs) overflows the loss)."""
    return jnp.clip(kl_k3(logprobs, ref_logprobs), -10.0, 10.0)


@register_kl_estimator("abs")
def kl_abs(logprobs, ref_logprobs):
    return jnp.abs(logprobs - ref_logprobs)


@register_kl_estimator("mse")
def kl_mse(logprobs, ref_logprobs):
    return 0.5 * jnp.square(logprobs - ref_logprobs)


def kl_full(policy_log_dist, ref_log_dist, padding_mask):
    """Exact KL over the vocabulary: sum_v pi(v) (log pi(v) - log pi_ref(v)).

    policy_log_dist, ref_log_dist: f32[..., R, V] log-softmax distributions; padding_mask: bool[..., R]
    (True = padding, where the result is 0). Returns f32[..., R].
    """
    kl = jnp.sum(jnp.exp(policy_log_dist) * (policy_log_dist - ref_log_dist), axis=-1)
    return jnp.where(padding_mask, 0.0, kl)


register_kl_estimator("full", needs_full_distribution=True)(None)

#: The registered names (kept for callers that list them).
KL_ESTIMATORS = kl_estimator_names()


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """The per-token estimate of a STATIC estimator name; 'full' needs :func:`kl_full` (the whole
    distributions), so it is refused here."""
    entry = kl_estimator(estimator)
    if entry.needs_full_distribution:
        raise ValueError(
            f"kl_estimator={estimator!r} is not a per-token estimator; it needs both full distributions "
            f"(ppojax.core.kl_full; the rollout uses ppojax.rl.forward.full_kl_from_hidden). Per-token ones: "
            f"{[n for n in kl_estimator_names() if not kl_estimator(n).needs_full_distribution]}.")
    return entry.fn(logprobs, ref_logprobs)
