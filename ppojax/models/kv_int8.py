"""An 8-bit KV cache: each token's key (or value) of each kv head stored as ``head_dim`` int8 codes and its float32
scale, packed into one int8 array ``[..., head_dim + 4]`` (the scale's four bytes last), so every operation on the
cache's arrays (per-row writes, slot copies, row repeats, shardings over rows and heads) handles it unchanged.

Symmetric absmax quantization per (token, head): ``scale = max|x| / 127``, ``code = round(x / scale)``; a vector
is read back as ``code * scale``, so each element is off by at most ``scale / 2``. The log-probs this moves are
measured in docs/performance.md ("An 8-bit KV cache").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

#: what a cache's dtype is for 8-bit storage (``init_cache(..., dtype=INT8)``)
INT8 = jnp.dtype(jnp.int8)
SCALE_BYTES = 4


def is_int8(stack) -> bool:
    """Whether a cache array holds 8-bit codes with their scales."""
    return jnp.dtype(stack.dtype) == INT8


def stored_width(head_dim: int) -> int:
    return head_dim + SCALE_BYTES


def quantize(x) -> jax.Array:
    """x f[..., hd] -> int8[..., hd + 4]: the codes, then the float32 scale's bytes."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    codes = jnp.clip(jnp.round(x / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    return jnp.concatenate([codes, jax.lax.bitcast_convert_type(scale, jnp.int8)[..., 0, :]], axis=-1)


def dequantize(stored, dtype) -> jax.Array:
    """int8[..., hd + 4] (``quantize``) -> dtype[..., hd]."""
    codes, scale_bytes = stored[..., :-SCALE_BYTES], stored[..., -SCALE_BYTES:]
    scale = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)[..., None]
    return (codes.astype(jnp.float32) * scale).astype(dtype)
