"""A Pallas (Triton) kernel for decode attention on NVIDIA GPUs: one query per row over a layer's KV-cache slots,
read where they lie in the stacked cache, with the model's boolean mask; split over the slots (flash decoding).

Why our own kernel rather than JAX's `jax.experimental.pallas.ops.gpu.decode_attention.gqa`: it takes a start and a
length per row (keys `[start, length)` are real), and ppojax's mask is not a range: a sampled pad id inside a
response is a hole, and so is an episode's observation padding (`ppojax.models.attention`). It also reads a
layer's keys as an array of their own; this kernel reads them from the stacked cache `[L, B, T, K, hd]` at the
layer it is given, so no copy of the layer's slots is made.

Grid: (row, key head, split of the slots). Each program keeps its key head's G query heads (padded to 16 rows, the
tensor cores' smallest tile) and runs an online softmax over its split's blocks of slots; the splits' partial
results are merged outside the kernel by their maxima and sums (`_merge`). Values: float32 softmax, masked logits
at XLA's constant, so it equals `ppojax.models.attention.xla_attention` up to the order of summation and, for
16-bit caches, bfloat16's rounding of the unnormalised probabilities.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ppojax.backends.per_shard import over_models
from ppojax.models.attention import MASKED_LOGIT as MASKED

Array = jax.Array

#: slots per block of the inner loop, and the query rows a program computes (its G heads padded)
BLOCK_SLOTS = 64
QUERY_ROWS = 16
#: programs to aim for (rows x key heads x splits): a few per streaming multiprocessor of a large GPU
TARGET_PROGRAMS = 512


def splits_for(rows: int, kv_heads: int, slots_read: int) -> int:
    """How many splits of the slots read: enough programs to fill the GPU, each split whole blocks."""
    blocks = slots_read // BLOCK_SLOTS
    wanted = max(1, -(-TARGET_PROGRAMS // (rows * kv_heads)))
    return max(d for d in range(1, blocks + 1) if blocks % d == 0 and d <= wanted)


def _kernel(layer_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, sums_ref, maxima_ref, *, scale: float, group: int,
            split_slots: int, rows_per_model: int):
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    m, b = row // rows_per_model, row % rows_per_model  # the model (a vmapped sweep's element) and its row
    layer = layer_ref[m]
    rows = jnp.arange(QUERY_ROWS) < group
    q = plgpu.load(q_ref.at[m, b, head, pl.ds(0, QUERY_ROWS), :], mask=rows[:, None], other=0.0)  # [16, hd]
    head_dim = q.shape[-1]
    start = split * split_slots

    def block(i, carry):
        acc, m_prev, l_prev = carry
        slots = pl.ds(start + i * BLOCK_SLOTS, BLOCK_SLOTS)
        k = k_ref[m, layer, b, slots, head, :]  # [bt, hd]
        s = plgpu.dot(q, k.T).astype(jnp.float32) * scale  # [16, bt]
        valid = mask_ref[m, b, slots] != 0
        s = jnp.where(valid[None, :], s, MASKED)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m_prev - m_new)
        v = v_ref[m, layer, b, slots, head, :]
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
        return acc, m_new, alpha * l_prev + p.sum(axis=1)

    init = (jnp.zeros((QUERY_ROWS, head_dim), jnp.float32), jnp.full((QUERY_ROWS,), -jnp.inf, jnp.float32),
            jnp.zeros((QUERY_ROWS,), jnp.float32))
    acc, maxima, sums = jax.lax.fori_loop(0, split_slots // BLOCK_SLOTS, block, init)
    plgpu.store(o_ref.at[split, m, b, head, pl.ds(0, QUERY_ROWS), :], acc, mask=rows[:, None])
    plgpu.store(sums_ref.at[split, m, b, head, pl.ds(0, QUERY_ROWS)], sums, mask=rows)
    plgpu.store(maxima_ref.at[split, m, b, head, pl.ds(0, QUERY_ROWS)], maxima, mask=rows)


def _merge(out, sums, maxima):
    """The splits' unnormalised outputs [S, M, B, K, G, hd], their softmax sums and maxima [S, M, B, K, G] ->
    [M, B, K, G, hd]."""
    weight = jnp.exp(maxima - maxima.max(axis=0)[None])
    return (out * weight[..., None]).sum(axis=0) / (sums * weight).sum(axis=0)[..., None]


def decode_attention(q: Array, keys: Array, values: Array, layer: Array, mask: Array, *, scale: float,
                     slots_read: int, interpret: bool = False) -> Array:
    """q [B, H, hd]; keys, values [L, B, T, K, hd] (the stacked cache, q's dtype); layer i32[] (which layer);
    mask bool[B, slots_read] (True = may attend), slots_read a multiple of BLOCK_SLOTS. Returns [B, H, hd] in
    q.dtype: attention over the layer's first `slots_read` slots. interpret: Pallas's interpreter (any backend).
    Under `vmap` (a sweep's models) ONE kernel runs over the stacked models (`per_shard.over_models`)."""
    kernel = functools.partial(_models_decode_attention, scale=scale, slots_read=slots_read, interpret=interpret)
    return over_models(kernel)(q, keys, values, layer, mask)


def _models_decode_attention(q: Array, keys: Array, values: Array, layer: Array, mask: Array, *, scale: float,
                             slots_read: int, interpret: bool) -> Array:
    """`decode_attention` of M models at once: q [M, B, H, hd]; keys, values [M, L, B, T, K, hd]; layer i32[M];
    mask bool[M, B, slots_read] -> [M, B, H, hd]."""
    models, b, h, hd = q.shape
    kv_heads = keys.shape[4]
    group = h // kv_heads
    splits = splits_for(models * b, kv_heads, slots_read)
    q = q.reshape(models, b, kv_heads, group, hd)
    partial = jax.ShapeDtypeStruct((splits, models, b, kv_heads, group), jnp.float32)
    out, sums, maxima = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), group=group, split_slots=slots_read // splits,
                          rows_per_model=b),
        grid=(models * b, kv_heads, splits),
        out_shape=(jax.ShapeDtypeStruct((splits, models, b, kv_heads, group, hd), jnp.float32), partial, partial),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="ppojax_decode_attention",
    )(layer.astype(jnp.int32), q, keys, values, mask.astype(jnp.int32))
    return _merge(out, sums, maxima).astype(q.dtype).reshape(models, b, h, hd)


def fits(q_shape, cache_shape, dtype, slots_read: int) -> bool:
    """Whether a call of these static shapes runs the kernel: q [B, S, H, hd] with one query per row, a cache
    [B, T, K, hd] of a 16-bit or float32 dtype, G = H / K at most 16 query heads per key head, hd a power of two
    of at least 16 (Triton's tiles), and the slots read whole blocks."""
    _, s, h, hd = q_shape
    kv_heads = cache_shape[2]
    return (s == 1 and h % kv_heads == 0 and h // kv_heads <= QUERY_ROWS and hd >= 16 and hd & (hd - 1) == 0
            and slots_read % BLOCK_SLOTS == 0 and math.prod(cache_shape) > 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)))
