"""Rollout-level metrics under TRL's names (docs/algorithm.md, "Metrics"). Every diagnostic is masked."""
import jax.numpy as jnp


def rollout_metrics(scores, kl, non_score_reward, logprobs, padding_mask, num_eos_tokens=None):
    """objective/* metrics of one rollout batch.

    scores: f32[B] (as the reward returned them, missing_eos_penalty applied: TRL's objective/scores);
    kl, non_score_reward, logprobs: f32[B, R]; padding_mask: bool[B, R] (True = padding);
    num_eos_tokens: i32 scalar (eos tokens in the untruncated responses), or None to leave out
    ``val/num_eos_tokens``. Sums run over time, means over sequences. Entropy is the masked sum of
    -logprobs (TRL sums INVALID_LOGPROB slots too).
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
    if num_eos_tokens is not None:
        metrics["val/num_eos_tokens"] = num_eos_tokens
    return metrics


#: Names absent from a run's loss (no critic: no value terms; no KL in the loss) are left out of its metrics.
#: Short diagnostic names from losses.ppo_loss, averaged over micro-batches, mini-batches and epochs
#: -> TRL's metric names.
UPDATE_METRIC_NAMES = {
    "approxkl": "policy/approxkl_avg",
    "pg_clipfrac": "policy/clipfrac_avg",
    "vf_clipfrac": "val/clipfrac_avg",
    "entropy": "policy/entropy_avg",
    "ratio": "val/ratio",
    "ratio_token_var": "val/ratio_token_var",
}
#: Losses: the micro-batch shares SUM to the mini-batch loss as optimised (token-weighted accumulation),
#: then that is averaged over mini-batches and epochs (docs/algorithm.md, "Metrics").
LOSS_METRIC_NAMES = {
    "pg_loss": "loss/policy_avg",
    "vf_loss": "loss/value_avg",
    "kl_loss": "loss/kl_avg",
    "loss": "loss/total_avg",
}
