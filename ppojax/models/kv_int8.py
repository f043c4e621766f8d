"""An 8-bit KV cache: each token's key (or value) of each kv head stored as ``head_dim`` int8 codes and one
float32 scale per ``GROUP`` of them, packed into one int8 array ``[..., head_dim + 4 * head_dim / GROUP]`` (the
scales' bytes last), so every operation on the cache's arrays (per-row writes, slot copies, row repeats, shardings
over rows and heads) handles it unchanged.

Symmetric absmax quantization per group: ``scale = max|x| / 127``, ``code = round(x / scale)``; a value is read
back as ``code * scale``, so each element is off by at most ``scale / 2``. Groups (rather than one scale per
head) keep a key's outlier channels from coarsening all of its other channels. The log-probs this moves are
measured by ``benchmarks/kv_cache_drift.py`` (docs/performance.md, "An 8-bit KV cache").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

#: what a cache's dtype is for 8-bit storage (``init_cache(..., dtype=INT8)``)
INT8 = jnp.dtype(jnp.int8)
SCALE_BYTES = 4
#: the channels that share one scale (a divisor of head_dim; the whole head where head_dim is smaller)
GROUP = 16


def is_int8(stack) -> bool:
    """Whether a cache array holds 8-bit codes with their scales."""
    return jnp.dtype(stack.dtype) == INT8


def _group(head_dim: int) -> int:
    return GROUP if head_dim % GROUP == 0 else head_dim


def stored_width(head_dim: int) -> int:
    return head_dim + SCALE_BYTES * (head_dim // _group(head_dim))


def quantize(x) -> jax.Array:
    """x f[..., hd] -> int8[..., stored_width(hd)]: the codes, then each group's float32 scale's bytes."""
    hd = x.shape[-1]
    groups = x.astype(jnp.float32).reshape(*x.shape[:-1], hd // _group(hd), _group(hd))
    scale = jnp.max(jnp.abs(groups), axis=-1, keepdims=True) / 127.0
    codes = jnp.clip(jnp.round(groups / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale[..., 0], jnp.int8)  # [..., groups, 4]
    return jnp.concatenate([codes.reshape(x.shape), scale_bytes.reshape(*x.shape[:-1], -1)], axis=-1)


def dequantize(stored, dtype, head_dim: int) -> jax.Array:
    """int8[..., stored_width(head_dim)] (``quantize``) -> dtype[..., head_dim]."""
    g = _group(head_dim)
    codes = stored[..., :head_dim].reshape(*stored.shape[:-1], head_dim // g, g)
    scale_bytes = stored[..., head_dim:].reshape(*stored.shape[:-1], head_dim // g, SCALE_BYTES)
    scale = jax.lax.bitcast_convert_type(scale_bytes, jnp.float32)[..., None]
    return (codes.astype(jnp.float32) * scale).reshape(*stored.shape[:-1], head_dim).astype(dtype)
