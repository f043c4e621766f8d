"""Masked grouped-query attention in XLA's operations: the models' default (`Kernels.attention`), and the result
every backend's attention kernel must equal.

One entry point for the full forward (S queries over S keys) and for the KV-cache calls (S queries over T cache
slots; decode is S = 1). The boolean `mask` is the single source of truth for who attends to whom (key padding,
causality, sliding window, packed segments): rows are LEFT padded and a sampled pad id inside a response makes a
hole, so no length-based form of the mask could say the same. A backend's kernel may also take the hints the mask
implies (`is_causal`, `window`) to skip whole blocks.

GQA: `k, v` keep their K heads, so no repeat of the keys is ever materialised: a key head's G = H/K query heads
become extra query rows, one batched product of `[G*S, hd] x [hd, T]` per (row, key head).
`jax.nn.dot_product_attention`'s XLA path vmaps over the group instead (G products of `[S, hd] x [hd, T]`), which
XLA:CPU runs no faster and usually a little slower. Both keep jax's float32 softmax and its masking constant, so a
query whose every key is masked gets a finite output (an average over the keys), never NaN; callers ignore such
positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: the config's `attention_implementation` values: "auto" (a backend's fused kernel where it applies, else XLA's),
#: "xla", "cudnn" (NVIDIA GPUs; `ppojax.backends.gpu`), "pallas" (the Pallas decode-attention kernels: TPUs' as
#: "auto", NVIDIA GPUs' on top of "auto")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")

Array = jax.Array

#: the logit of a masked key (`jax.nn.dot_product_attention`'s constant): finite, so a query whose every key is
#: masked averages the keys; every backend's kernel uses it too
MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)


def xla_attention(q: Array, k: Array, v: Array, mask: Array, *, scale: float) -> Array:
    """Grouped-query attention with a float32 softmax.

    q: [B, S, H, hd]; k, v: [B, T, K, hd] (H a multiple of K; same dtype as q); mask: bool[B, S, T] (True = may
    attend). scale: a Python float (a traced factor is folded into q by the caller). Returns [B, S, H, hd] in
    q.dtype. Logits in float32 (16-bit inputs accumulate in float32, as `jax.nn.dot_product_attention`'s XLA path),
    masked with -0.7 * float32 max (its constant), float32 softmax, probabilities cast to v's dtype.
    """
    b, s, h, hd = q.shape
    t, kv = k.shape[1], k.shape[2]
    g = h // kv
    rows = jnp.transpose(q.reshape(b, s, kv, g, hd), (0, 2, 3, 1, 4)).reshape(b, kv, g * s, hd)
    logits = jnp.einsum("bkqd,btkd->bkqt", rows, k, preferred_element_type=jnp.float32) * jnp.float32(scale)
    row_mask = jnp.broadcast_to(mask[:, None, None], (b, kv, g, s, t)).reshape(b, kv, g * s, t)
    logits = jnp.where(row_mask, logits, MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqt,btkd->bkqd", probs, v)  # [B, K, G*S, hd]
    return jnp.transpose(out.reshape(b, kv, g, s, hd), (0, 3, 1, 2, 4)).reshape(b, s, h, hd).astype(q.dtype)
