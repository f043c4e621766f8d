"""TPUs' attention for a forward without a KV cache (the update's, the scoring forwards', packed rows): JAX's splash
attention (`jax.experimental.pallas.ops.tpu.splash_attention`), a flash kernel whose softmax never leaves the core,
so no `[S, S]` float32 scores are written to HBM and read back, and whose causal mask skips the blocks above the
diagonal (half the products).

How ppojax's mask reaches it. The mask of a full forward is causal (within a window on sliding-window models),
hides the keys of left padding and of holes (a sampled pad id inside a response), and, on packed rows, keeps each
query inside its own sequence. The model passes that as `segments` i32[B, S] (`Backbone.forward`): a real token's
sequence id (0 on an unpacked row), -1 at every hidden key. The kernel's static mask is the causal one (or
`LocalMask`'s window), its segment ids are `segments` for queries and keys alike: a real query sees exactly the
earlier real keys of its own sequence. A hidden query (-1) sees hidden keys only, where XLA's attention averages
every key: positions no caller reads (module doc of `ppojax.models.attention`).

Rows packed longer than a padded row (`packed_row_length`): the causal mask alone computes every block below the
diagonal, so attention's work grows with the square of the row however short its sequences. There the kernel is
made from the row's own mask instead (`skip_other_sequences`: causal, and the query's sequence id equal to the
key's), a dynamic mask of which JAX's splash skips the blocks that are all hidden: a block of queries runs over the
key blocks that hold its own sequences only, so the work follows the sum of the sequences' squares (in blocks;
`blocks_computed` counts them). The price: the mask is held whole, a byte per query-key pair of a row in each
of the kernel's copies (forward and backward blocks), so it is chosen where rows are packed longer (`TpuKernels`'
`skip_other_sequences`, set when a run with `packed_row_length` is built), not for every forward.

GQA: the kernel's multi-head form takes H query heads over K key heads itself. One kernel per row (`vmap` over the
rows and, in a sweep, the models: Pallas adds them to its grid). The scale is folded into q.

Values: an online softmax in float32 with XLA's masking constant (the kernel's default, -0.7 x float32 max); equal to
`xla_attention` at every real query up to the order of summation, and in bfloat16 up to its rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

Array = jax.Array

#: the query and key block sizes tried, largest first; a block is a multiple of the TPU's 128 lanes
BLOCKS = (512, 256, 128)


def block_size(length: int) -> int | None:
    """The largest of BLOCKS that divides a row of `length` tokens (None: no block fits; XLA's attention)."""
    return next((b for b in BLOCKS if length % b == 0), None)


def fits(q_shape, k_shape) -> int | None:
    """The block size where a call of these static shapes runs the kernel, else None: q [B, S, H, hd] over keys
    [B, S, K, hd] of the same S (a forward without a cache), H a multiple of K, S a multiple of 128."""
    _, s, h, _ = q_shape
    t, kv = k_shape[1:3]
    if s != t or h % kv or s == 0:
        return None
    return block_size(s)


def _kernel(length: int, heads: int, window: int | None, block: int, interpret: bool):
    """The splash kernel of one row: q [H, S, hd], k and v [K, S, hd], causal (within `window` when given). Its
    mask's block structure is worked out on the host (JAX caches it per mask and block) and held as arrays of
    the trace that makes the kernel: made again for every trace, never kept."""
    shape = (length, length)
    one_head = splash_mask.CausalMask(shape) if window is None else \
        splash_mask.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    return splash.make_splash_mha_single_device(splash_mask.MultiHeadMask([one_head] * heads),
                                                block_sizes=_block_sizes(block), interpret=interpret)


def _block_sizes(block: int):
    """Splash's blocks, forward and backward alike, of `block` queries by `block` keys."""
    return splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                             block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)


def row_mask(ids: Array, window: int | None = None) -> Array:
    """bool[S, S] of one row's segment ids i32[S]: query i sees key j where j <= i (and i - j < window), both of one
    sequence (hidden positions, -1, see each other: the static kernel's segment ids do the same)."""
    position = jnp.arange(ids.shape[0])
    seen = position[:, None] >= position[None, :]
    if window is not None:
        seen &= position[:, None] - position[None, :] < window
    return seen & (ids[:, None] == ids[None, :])


def blocks_computed(segments: Array, block: int, window: int | None = None) -> Array:
    """i32[B]: the (query block, key block) pairs the kernel computes per row with `skip_other_sequences`, read from
    the block map it runs by (a pair where some query sees some key). Without it the kernel computes what a row of
    one sequence needs: every pair the causal (or window) mask reaches."""
    def one_row(ids):
        info = _row_kernel(row_mask(ids, window), block, interpret=True).fwd_mask_info
        return jnp.sum(info.block_mask != 0, dtype=jnp.int32)

    return jax.vmap(one_row)(segments)


def _row_kernel(mask: Array, block: int, interpret: bool):
    """The splash kernel of one row made from its mask bool[S, S] (the same for every head): JAX works out which
    blocks to skip while the program runs."""
    kernel = splash.make_splash_mha_single_device(mask[None], block_sizes=_block_sizes(block), interpret=interpret)
    # made inside a trace, the kernel's "dynamic mask" flag became an array; it is static (JAX reads it in Python)
    for name in ("fwd_mask_info", "dq_mask_info", "dkv_mask_info"):
        info = getattr(kernel, name)
        if info is not None:
            setattr(kernel, name, info._replace(is_dynamic_mask=True))
    return kernel


def splash_attention(q: Array, k: Array, v: Array, segments: Array, *, scale: float, block: int,
                     window: int | None = None, skip_other_sequences: bool = False, interpret: bool = False) -> Array:
    """q [B, S, H, hd]; k, v [B, S, K, hd] (q's dtype); segments i32[B, S] (module doc); block: `fits`'s;
    window: a sliding window's length (None: causal over the whole row); skip_other_sequences: the kernel made
    from each row's mask, skipping the blocks of other sequences (module doc). Returns [B, S, H, hd] in q.dtype.
    interpret: run Pallas's interpreter (any backend: the tests' CPU)."""
    heads = q.shape[2]
    heads_first = functools.partial(jnp.transpose, axes=(0, 2, 1, 3))  # [B, S, N, hd] <-> [B, N, S, hd]
    if skip_other_sequences:
        def one_row(q, k, v, ids):  # q [H, S, hd], k and v [K, S, hd], ids [S]
            return _row_kernel(row_mask(ids, window), block, interpret)(q, k, v)
    else:
        kernel = _kernel(q.shape[1], heads, window, block, interpret)

        def one_row(q, k, v, ids):
            return kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))

    scaled = q * jnp.asarray(scale, q.dtype)
    out = jax.vmap(one_row)(heads_first(scaled), heads_first(k), heads_first(v), segments.astype(jnp.int32))
    return heads_first(out).astype(q.dtype)
