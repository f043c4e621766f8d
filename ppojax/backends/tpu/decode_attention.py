"""A Pallas (Mosaic) kernel for decode attention on TPUs: one query per row over a layer's KV-cache slots, read
where they lie in the stacked cache, with the model's boolean mask.

Why our own kernel rather than JAX's `ragged_paged_attention` / `paged_attention`: those take a length per
sequence (keys `[0, kv_len)` are real), and ppojax's mask is not a prefix. Rows are LEFT padded, a sampled pad id
inside a response is a hole, and an episode's observation padding is a hole too; the mask is the single source of
truth (`ppojax.models.attention`). This kernel takes the mask as the model computes it.

Layout. Where a slot's K key heads of an `hd` below 128 fill whole lanes together (`merged_slots`: K * hd a
multiple of 128), TPUs' kernels store the cache as `[L, B, T, K * hd]` (`TpuKernels.slot_shape`): the slots are
rows of K * hd lanes, and a decode step's write of one slot touches one row of its tiles. Any other cache is
`[L, B, T, K, hd]`, and the kernel reads it as the TPU compiler lays it out (`cache_layout`): with an `hd` below
128 the slots are the minor (lane) axis, so `hd` is not padded to 128 lanes, and the kernel views the cache as
`[L, B, K, hd, T]` (a transpose that relabels the same bytes; a one-slot write there rewrites whole tiles, which is
why the merged form exists); with an `hd` of 128 or more, as written (or each key head's slots together). One
block holds `bt` slots of all K key heads, the layer chosen by a scalar-prefetched index, so no copy of the
layer's slots is made. Per key head, its G = H / K query heads make one product with the block's slots of that
head (in the merged form, its hd lanes of the block).

Values: an online (flash) softmax over the blocks in float32, masked logits at XLA's constant (-0.7 x float32
max), so a row whose every key is masked averages its keys as `xla_attention` does. It equals
`ppojax.models.attention.xla_attention` up to the order of summation (float32) and bfloat16's rounding of the
unnormalised probabilities (16-bit caches).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ppojax.backends.per_shard import over_models
from ppojax.models.attention import MASKED_LOGIT as MASKED
from ppojax.models.kernels import stored_kv_heads

Array = jax.Array

#: most bytes one block of keys (or values) holds: keys and values, double-buffered, stay far inside a TPU core's
#: VMEM
MAX_BLOCK_BYTES = 1 << 20
LANES = 128


def block_slots(slots_read: int, max_length: int, kv_heads: int, head_dim: int, dtype) -> int | None:
    """The slots per block for a read of `slots_read` of a cache's `max_length` slots: the largest multiple of 128
    (the lanes) that divides `slots_read` with a block of at most MAX_BLOCK_BYTES, or all slots in one block
    where the read is the whole (short) cache; None where neither fits (XLA's attention)."""
    per_slot = kv_heads * head_dim * jnp.dtype(dtype).itemsize
    if slots_read == max_length and max_length * per_slot <= MAX_BLOCK_BYTES:
        return max_length
    for bt in range(MAX_BLOCK_BYTES // per_slot // LANES * LANES, 0, -LANES):
        if slots_read % bt == 0:
            return bt
    return None


def merged_slots(kv_heads: int, head_dim: int) -> bool:
    """Whether a cache of these heads is stored `[L, B, T, K * hd]` on TPUs: hd below 128 and K * hd whole lanes."""
    return head_dim < LANES and (kv_heads * head_dim) % LANES == 0


def cache_layout(kv_heads: int, head_dim: int) -> str | None:
    """How the TPU compiler lays out a KV cache [L, B, T, K, hd] (its default layout for such arrays, which the
    kernel reads as it lies; tests/test_tpu_compile.py checks that no copy is made): "slots_minor" (hd below 128:
    the slots are the lanes, hd is not padded), "rows_major" (hd a multiple of 128 and K a power of two: as
    written), "heads_major" (hd a multiple of 128, other K, one included: each key head's slots together); None for
    any other head_dim (XLA's attention)."""
    if head_dim < 128:
        return "slots_minor"
    if head_dim % 128:
        return None
    return "rows_major" if kv_heads > 1 and kv_heads & (kv_heads - 1) == 0 else "heads_major"


#: per layout: the cache's view (a transpose that is a relabelling of the bytes as the compiler lays them out), a
#: block of it for bt slots of all K heads, and that block's index
VIEWS = {
    "slots_minor": ((0, 1, 3, 4, 2), lambda k, hd, bt: (k, hd, bt), lambda j: (0, 0, j)),  # [L, B, K, hd, T]
    "rows_major": ((0, 1, 2, 3, 4), lambda k, hd, bt: (bt, k, hd), lambda j: (j, 0, 0)),  # [L, B, T, K, hd]
    "heads_major": ((0, 1, 3, 2, 4), lambda k, hd, bt: (k, bt, hd), lambda j: (0, j, 0)),  # [L, B, K, T, hd]
    "merged": ((0, 1, 2, 3), lambda k, hd, bt: (bt, k * hd), lambda j: (j, 0)),  # [L, B, T, K * hd]
}


def _kernel(layer_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, acc_ref, *, scale: float,
            kv_heads: int, n_blocks: int, layout: str):
    del layer_ref  # read by the index maps
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    hd = q_ref.shape[-1]

    def head_slots(ref, head):  # one key head's bt slots: [hd, bt] (slots minor) or [bt, hd]
        if layout == "merged":
            return ref[:, head * hd:(head + 1) * hd]
        return ref[:, head, :] if layout == "rows_major" else ref[head]

    slots_last = (((1,), (0,)), ((), ())) if layout == "slots_minor" else (((1,), (1,)), ((), ()))
    valid = mask_ref[...] != 0  # [1, bt]
    for head in range(kv_heads):
        q = q_ref[head]  # [G, hd]
        s = jax.lax.dot_general(q, head_slots(k_ref, head), slots_last, preferred_element_type=jnp.float32)
        s = jnp.where(valid, s * scale, MASKED)  # [G, bt]
        m_prev = m_ref[head]  # [G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        l_ref[head] = alpha * l_ref[head] + jnp.sum(p, axis=1, keepdims=True)
        v = head_slots(v_ref, head)
        pv_dims = (((1,), (1,)), ((), ())) if layout == "slots_minor" else (((1,), (0,)), ((), ()))
        pv = jax.lax.dot_general(p.astype(v.dtype), v, pv_dims, preferred_element_type=jnp.float32)
        acc_ref[head] = alpha * acc_ref[head] + pv  # [G, hd]
        m_ref[head] = m_new

    @pl.when(j == n_blocks - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def decode_attention(q: Array, keys: Array, values: Array, layer: Array, mask: Array, *, scale: float,
                     slots_read: int, bt: int, layout: str | None = None, interpret: bool = False) -> Array:
    """q [B, H, hd]; keys, values [L, B, T, K, hd] or [L, B, T, K * hd] (the stacked cache, q's dtype; the merged
    form: `merged_slots`); layer i32[] (which layer); mask bool[B, slots_read] (True = may attend); bt: slots per
    block (`block_slots`: dividing slots_read, a multiple of 128 or the whole cache); layout: how the compiler lays
    the cache out ("merged" for a 4-D cache, else `cache_layout`, its default). Returns [B, H, hd] in q.dtype:
    attention over the layer's first `slots_read` slots. interpret: run Pallas's interpreter (any backend; the
    tests' CPU). Under `vmap` (a sweep's models) ONE kernel runs over the stacked models
    (`ppojax.backends.per_shard.over_models`)."""
    layout = layout or ("merged" if keys.ndim == 4 else cache_layout(keys.shape[3], q.shape[-1]))
    kernel = functools.partial(_models_decode_attention, scale=scale, slots_read=slots_read, bt=bt, layout=layout,
                               interpret=interpret)
    return over_models(kernel)(q, keys, values, layer, mask)


def _models_decode_attention(q: Array, keys: Array, values: Array, layer: Array, mask: Array, *, scale: float,
                             slots_read: int, bt: int, layout: str, interpret: bool) -> Array:
    """`decode_attention` of M models at once: q [M, B, H, hd]; keys, values [M, L, B, T, K(, hd)]; layer i32[M];
    mask bool[M, B, slots_read] -> [M, B, H, hd]."""
    models, b, h, hd = q.shape
    kv_heads = stored_kv_heads(keys.shape[4:], hd)  # keys [M, L, B, T, K, hd] or [M, L, B, T, K * hd]
    group = h // kv_heads
    n_blocks = slots_read // bt
    q = q.reshape(models, b, kv_heads, group, hd)
    order, block_shape, block_index = VIEWS[layout]
    order = (0,) + tuple(axis + 1 for axis in order)
    keys, values = (jnp.transpose(x, order) for x in (keys, values))
    mask = mask.astype(jnp.int32)[:, :, None, :]  # [M, B, 1, slots_read]
    cache_block = pl.BlockSpec((None, None, None, *block_shape(kv_heads, hd, bt)),
                               lambda m, i, j, layer: (m, layer[m], i, *block_index(j)))
    row_block = pl.BlockSpec((None, None, kv_heads, group, hd), lambda m, i, j, layer: (m, i, 0, 0, 0))
    itemsize = jnp.dtype(keys.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * models * b * h * slots_read * hd, transcendentals=models * b * h * slots_read,
        bytes_accessed=models * (2 * b * slots_read * kv_heads * hd * itemsize + 4 * b * slots_read
                                 + 2 * b * h * hd * jnp.dtype(q.dtype).itemsize))
    call = pl.pallas_call(
        functools.partial(_kernel, scale=float(scale), kv_heads=kv_heads, n_blocks=n_blocks, layout=layout),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(models, b, n_blocks),
            in_specs=[row_block, cache_block, cache_block,
                      pl.BlockSpec((None, None, 1, bt), lambda m, i, j, layer: (m, i, 0, j))],
            out_specs=row_block,
            scratch_shapes=[pltpu.VMEM((kv_heads, group, 1), jnp.float32),
                            pltpu.VMEM((kv_heads, group, 1), jnp.float32),
                            pltpu.VMEM((kv_heads, group, hd), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct((models, b, kv_heads, group, hd), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost, interpret=interpret, name="ppojax_decode_attention")
    return call(layer.astype(jnp.int32), q, keys, values, mask).reshape(models, b, h, hd)


def fits(q_shape, cache_shape, dtype, slots_read: int) -> int | None:
    """The slots per block (`block_slots`) where a call of these static shapes runs the kernel, else None: q
    [B, S, H, hd] with one query per row (decode), a cache [B, T, K, hd] or [B, T, K * hd] (one layer's shape), H a
    multiple of K."""
    _, s, h, hd = q_shape
    max_length = cache_shape[1]
    kv_heads = stored_kv_heads(tuple(cache_shape[2:]), hd)
    layout = ("merged" if merged_slots(kv_heads, hd) else None) if len(cache_shape) == 3 else \
        cache_layout(kv_heads, hd)
    if s != 1 or h % kv_heads or math.prod(cache_shape) == 0 or layout is None:
        return None
    return block_slots(slots_read, max_length, kv_heads, hd, dtype)
