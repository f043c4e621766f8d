"""What every objective shares: the importance weights at a level (per token, or GSPO's per sequence) and the
high-entropy token selection (``top_entropy_quantile``)."""
import jax.numpy as jnp


def importance_log_weights(log_ratio, live, level: str):
    """log importance weights f32[B, R] from the per-token ``log_ratio`` = logprobs - old_logprobs (0 on padding).

    'token': the log-ratio itself. 'sequence' (GSPO, Zheng et al. 2025): each row's mean log-ratio over its live
    tokens, i.e. the log of the geometric mean of its token ratios, on every slot of the row (TRL's
    ``(log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)``).
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        summed = jnp.sum(jnp.where(live, log_ratio, 0.0), axis=-1)
        per_row = summed / jnp.maximum(jnp.sum(live, axis=-1), 1).astype(log_ratio.dtype)
        return jnp.broadcast_to(per_row[:, None], log_ratio.shape)
    raise ValueError(f"importance_sampling_level={level!r}: expected 'token' or 'sequence'")


def quantile(values, mask, q: float):
    """The ``q``-quantile of ``values`` where ``mask`` (linear interpolation between order statistics, as
    ``torch.quantile``, in float32); NaN when nothing is masked in. values f32[...], mask bool[...]."""
    flat = jnp.where(mask, values, jnp.inf).reshape(-1).astype(jnp.float32)
    ordered = jnp.sort(flat)
    count = jnp.sum(mask)
    rank = jnp.float32(q) * (count - 1).astype(jnp.float32)
    below, above = jnp.floor(rank), jnp.ceil(rank)
    last = flat.shape[0] - 1
    low = ordered[jnp.clip(below.astype(jnp.int32), 0, last)]
    high = ordered[jnp.clip(above.astype(jnp.int32), 0, last)]
    weight = rank - below
    # torch's lerp, whose two forms round differently
    value = jnp.where(weight < 0.5, low + weight * (high - low), high - (high - low) * (1.0 - weight))
    return jnp.where(count > 0, value, jnp.nan)


def high_entropy_tokens(entropy, live, top_entropy_quantile: float):
    """bool[B, R]: the live tokens whose entropy is at least the (1 - ``top_entropy_quantile``)-quantile of the
    live tokens' entropies ("Beyond the 80/20 rule", Wang et al. 2025; TRL's ``get_high_entropy_mask``): the top
    ``top_entropy_quantile`` share of them by entropy (0: only the highest). The population is this batch's live
    tokens (a micro-batch's, over every device, as TRL gathers its processes')."""
    if top_entropy_quantile >= 1.0:
        return live
    threshold = quantile(entropy, live, 1.0 - top_entropy_quantile)
    return live & (entropy >= threshold)
