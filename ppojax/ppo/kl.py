"""Per-token KL estimators between the policy and the reference (SPEC: KL and shaped rewards).

All take float32 log-probs of the CHOSEN tokens, shape [..., R]; with INVALID_LOGPROB written into both
on padding, every estimator is exactly 0 there.
"""
import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k3", "abs", "mse", "full")


def kl_k1(logprobs, ref_logprobs):
    """k1 = log pi - log pi_ref (unbiased, can be negative)."""
    return logprobs - ref_logprobs


def kl_k3(logprobs, ref_logprobs):
    """k3 = (r - 1) - log r with log r = ref - logprobs (non-negative, low variance)."""
    log_ratio = ref_logprobs - logprobs
    return jnp.expm1(log_ratio) - log_ratio


def kl_abs(logprobs, ref_logprobs):
    return jnp.abs(logprobs - ref_logprobs)


def kl_mse(logprobs, ref_logprobs):
    return 0.5 * jnp.square(logprobs - ref_logprobs)


def kl_full(policy_log_dist, ref_log_dist, padding_mask):
    """Exact KL over the vocabulary: sum_v pi(v) (log pi(v) - log pi_ref(v)).

    policy_log_dist, ref_log_dist: f32[..., R, V] log-softmax distributions; padding_mask: bool[..., R]
    (True = padding, where the result is 0). Returns f32[..., R].
    """
    kl = jnp.sum(jnp.exp(policy_log_dist) * (policy_log_dist - ref_log_dist), axis=-1)
    return jnp.where(padding_mask, 0.0, kl)


_PER_TOKEN = {"k1": kl_k1, "k3": kl_k3, "abs": kl_abs, "mse": kl_mse}


def kl_per_token(logprobs, ref_logprobs, estimator="k1"):
    """Dispatch on a STATIC estimator name ('k1', 'k3', 'abs', 'mse'); 'full' needs :func:`kl_full`."""
    if estimator not in _PER_TOKEN:
        raise ValueError(
            f"kl_estimator={estimator!r} is not a per-token estimator; use one of {sorted(_PER_TOKEN)}"
            " (for 'full', compute kl_full from the two full log-distributions)."
        )
    return _PER_TOKEN[estimator](logprobs, ref_logprobs)
