"""DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's ``get_soft_overlong_punishment``)."""
import jax.numpy as jnp


def soft_overlong_punishment(lengths, max_completion_len: int, soft_punish_cache: int):
    """A length penalty in [-1, 0]: 0 up to L_max - L_cache tokens, then falling linearly to -1 at L_max, -1
    beyond. lengths: i32[B] response tokens (the stop token counted, as TRL's completion ids hold it);
    max_completion_len = L_max, soft_punish_cache = L_cache > 0. -> f32[B]."""
    lengths = jnp.asarray(lengths).astype(jnp.float32)
    start = float(max_completion_len - soft_punish_cache)
    ramp = (start - lengths) / float(soft_punish_cache)
    return jnp.where(lengths <= start, 0.0, jnp.where(lengths <= max_completion_len, ramp, -1.0))
