"""Rollout-level metrics under TRL's names (SPEC: Metrics). Every diagnostic is masked."""
import jax.numpy as jnp


def rollout_metrics(scores, kl, non_score_reward, logprobs, padding_mask, num_stop_tokens):
    """objective/* metrics of one rollout batch.

    scores: f32[B] (after penalties/processing); kl, non_score_reward, logprobs: f32[B, R];
    padding_mask: bool[B, R] (True = padding); num_stop_tokens: i32 scalar, or None to leave out
    ``val/num_eos_tokens`` (the update does not see the stop token; the rollout reports it).
    Sums run over time, means over sequences. Entropy is the masked sum of -logprobs (TRL sums
    INVALID_LOGPROB slots too).
    """
    live = ~padding_mask
    mean_kl = jnp.mean(jnp.sum(kl, axis=1))
    mean_non_score = jnp.mean(jnp.sum(non_score_reward, axis=1))
    metrics = {
        "objective/kl": mean_kl,
        "objective/entropy": jnp.mean(jnp.sum(jnp.where(live, -logprobs, 0.0), axis=1)),
        "objective/non_score_reward": mean_non_score,
        "objective/rlhf_reward": mean_non_score + jnp.mean(scores),
        "objective/scores": jnp.mean(scores),
    }
    if num_stop_tokens is not None:
        metrics["val/num_eos_tokens"] = num_stop_tokens
    return metrics


# Short diagnostic names from losses.ppo_loss -> TRL's metric names.
UPDATE_METRIC_NAMES = {
    "approxkl": "policy/approxkl_avg",
    "pg_clipfrac": "policy/clipfrac_avg",
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "vf_clipfrac": "val/clipfrac_avg",
    "entropy": "policy/entropy_avg",
    "ratio": "val/ratio",
    "ratio_var": "val/ratio_var",
}
