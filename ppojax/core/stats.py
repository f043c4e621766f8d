"""Masked statistics. ``mask`` is True where a value COUNTS (live), the opposite of ``padding_mask``.

Reductions run over all axes of the arrays given, so under a sharded ``jax.jit`` they are global-batch
statistics without any extra collective code.
"""
import jax
import jax.numpy as jnp

WHITEN_EPS = 1e-8


def masked_sum(values, mask):
    return jnp.sum(jnp.where(mask, values, 0.0))


def masked_mean(values, mask, axis=None):
    """sum(values * mask) / sum(mask) over ``axis`` (all axes by default)."""
    total = jnp.sum(jnp.where(mask, values, 0.0), axis=axis)
    return total / jnp.sum(mask, axis=axis).astype(total.dtype)


def masked_var(values, mask, unbiased=True):
    """Variance over live entries; unbiased applies Bessel's n/(n-1) as TRL does."""
    mean = masked_mean(values, mask)
    variance = masked_mean(jnp.square(values - mean), mask)
    if unbiased:
        n = jnp.sum(mask).astype(variance.dtype)
        variance = variance * n / (n - 1)
    return variance


def masked_whiten(values, mask, shift_mean=True):
    """(x - mean) / sqrt(var + 1e-8) over live entries; the mean is added back if not ``shift_mean``."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * jax.lax.rsqrt(masked_var(values, mask) + WHITEN_EPS)
    return whitened if shift_mean else whitened + mean
