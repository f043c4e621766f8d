"""The seam between the models and a backend: `Kernels`, the few operations whose best form differs by backend.

A model holds one `Kernels` object (a static attribute of its backbone, part of the graphdef), chosen ONCE when a
run or plan is built (`ppojax.backends.kernels_for`) and never while tracing: tracing only reads what it decided.
This base class is XLA's own operations in their plain `jnp` forms, which every backend compiles (TPU, GPU and CPU
alike); it is the default of every model. A backend that does better subclasses it (the CPU's:
`ppojax.backends.cpu.kernels.CpuKernels`; NVIDIA GPUs': `ppojax.backends.gpu.kernels.GpuKernels`; TPUs':
`ppojax.backends.tpu.kernels.TpuKernels`).

What a backend may change, and nothing else:
  - `attention`: masked grouped-query attention (XLA's by default, `attention.xla_attention`; TPUs' splash kernel
    reads the `segments` hint of a forward without a cache), and
    `cache_attention`: the same over a KV cache read where it lies in the stacked cache (a kernel that must not
    copy a layer's slots out first: TPUs' decode, `ppojax.backends.tpu.kernels.TpuKernels`);
  - `matmul`: a 2-D product in the compute dtype (the layers' projections and LoRA's thin products);
  - `output_projection`: the attention output projection `[B, S, H, hd] x [H, hd, D]`;
  - `split_layer_kernels` / `layer_products`: projections that read their layer's kernel where it lies in the
    stacked `[L, ...]` weights instead of the layer scan's per-layer slice;
  - `head_logits`: the LM head's product;
  - how values written or read slot by slot are stored (`slot_shape`, `slot_dtype`, `to_slots`, `from_slots`: the
    KV cache),
    how a forward with a KV cache reads its stacked weights (`read_only_layers`) and what the layer scan carries
    between layers (`residual_carry`);
  - `dots_policy`: what `remat: dots` saves (it must recognise the backend's own products);
  - `all_finite` (the update's check of its gradients) and `argmax` (the sampler's draw);
  - `slot_alignment`: what the KV-cache slots a sampler's loop reads are rounded up to (each distinct count is a
    loop body of its own).
Values: every implementation computes the same results; only the summation order of products may differ.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from ppojax.models.attention import xla_attention

Array = jax.Array

#: (group, projection) -> how many leading kernel axes (after `layers`) are its input: q [L, D, H, hd] has one,
#: o [L, H, hd, D] two. The projections a backend may compute from the stacked kernels.
LAYER_PROJECTIONS = {("attn", "q"): 1, ("attn", "k"): 1, ("attn", "v"): 1, ("attn", "o"): 2,
                     ("mlp", "up"): 1, ("mlp", "gate"): 1, ("mlp", "down"): 1}


def stored_kv_heads(slot_dims: tuple[int, ...], head_dim: int) -> int:
    """The key heads K of a cache whose slots are stored as `slot_dims` (what `Kernels.slot_shape` gave: `(K, hd)`,
    or `(K * hd,)` with the heads side by side)."""
    return slot_dims[0] if len(slot_dims) == 2 else slot_dims[0] // head_dim


@dataclasses.dataclass(frozen=True)
class Kernels:
    """XLA's operations (the default). Frozen and hashable: a model's graphdef, hence a jit cache key, holds it."""

    #: a short name for logs and reports
    name: str = dataclasses.field(default="xla", init=False)
    #: the slots a sampler's loop reads are rounded up to a multiple of this: a TPU's cache layout keeps the slots
    #: as its 128 lanes (and its decode kernel reads whole blocks of them); a backend without such tiles may read
    #: closer to the slots filled
    slot_alignment: int = dataclasses.field(default=128, init=False)

    def attention(self, q: Array, k: Array, v: Array, mask: Array, *, scale: float, is_causal: bool = False,
                  window: Optional[int] = None, segments: Optional[Array] = None) -> Array:
        """Grouped-query attention, shapes and hints as `ppojax.models.attention.xla_attention` (whose result
        every implementation equals at every query that sees a key): q [B, S, H, hd], k and v [B, T, K, hd], mask
        bool[B, S, T] -> [B, S, H, hd]. Hints the mask implies: `is_causal`; `window` (a sliding window's length);
        `segments` i32[B, S], given only where it and the two others say the whole mask (a forward without a
        cache): a real token's sequence id, -1 at every key the mask hides."""
        return xla_attention(q, k, v, mask, scale=scale)

    def cache_attention(self, q: Array, keys: Array, values: Array, layer_idx: Array, mask: Array, *,
                        scale: float, slots_read: int) -> Optional[Array]:
        """Attention over a KV cache read where it lies: q [B, S, H, hd]; keys, values the whole stacked cache
        [L, B, T, K, hd] as stored; layer_idx i32[] (which layer's slots); mask bool[B, S, slots_read] over the first
        `slots_read` slots -> [B, S, H, hd], equal to `attention` over that layer's slots; or None where these
        kernels have no such form for the call (the caller then reads the slots and calls `attention`). XLA's: None
        (its reads of the slots fuse into the attention's products)."""
        return None

    def matmul(self, x: Array, w: Array) -> Array:
        """x [N, D] @ w [D, F] -> [N, F], operands and result in the compute dtype."""
        return jnp.dot(x, w)

    def output_projection(self, o: Array, kernel: Array) -> Array:
        """The attention output projection o [B, S, H, hd] x kernel [H, hd, D] -> [B, S, D] (kernel in o's dtype)."""
        return jnp.einsum("bshk,hkd->bsd", o, kernel)

    def split_layer_kernels(self, layers: dict, rows: int, dtype) -> tuple[dict, Any]:
        """(the layer scan's per-layer weights, whatever `layer_products` needs) for calls of `rows` token rows in
        the compute `dtype`. XLA's: the weights unchanged, nothing split off."""
        return layers, None

    def layer_products(self, split: Any, layer_idx: Array) -> dict[tuple[str, str], Callable[[Array], Array]]:
        """{(group, projection): x2 [N, in] -> [N, *out]} for the projections whose kernels
        `split_layer_kernels` took out of the scanned weights (their biases stay there). XLA's: none."""
        return {}

    def head_logits(self, hidden: Array, weight: Array, tied: bool) -> Optional[Array]:
        """The LM head's product f32[..., V] of hidden [..., D] and `weight` (the embedding [V, D] when `tied`, else
        the head's kernel [D, V]), or None to leave it to XLA's dot."""
        return None

    # ---- values stored slot by slot (the KV cache) and the layer scan's carries ----
    def slot_shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape one slot's keys (or values) are stored in: `(kv_heads, head_dim)` (the cache [L, B, T, K, hd]),
        or `(kv_heads * head_dim,)` where a backend's tiles want the key heads side by side (the cache
        [L, B, T, K * hd]); the model reshapes what it writes and reads."""
        return (kv_heads, head_dim)

    def slot_dtype(self, dtype) -> jnp.dtype:
        """The dtype in which values of `dtype` written and read slot by slot are stored (the cache's arrays)."""
        return jnp.dtype(dtype)

    def to_slots(self, x: Array, dtype) -> Array:
        """`x` as values of `dtype` in their stored form (`slot_dtype(dtype)`)."""
        return x.astype(dtype)

    def from_slots(self, stored: Array, dtype) -> Array:
        """Stored values (`to_slots`) back as `dtype`."""
        return stored.astype(dtype)

    def read_only_layers(self, layers) -> tuple[Any, Callable]:
        """(the stacked layer weights a forward with a KV cache reads once per layer, `restore`: one layer's slice
        of that -> the weights the layer computes with). No gradient flows through such a forward."""
        return layers, _unchanged

    def residual_carry(self, dtype) -> Callable[[Array], Array]:
        """What the layer scan carries (and saves for the backward) between layers, for a residual stream of
        `dtype`: a function of the stream; the layers see it cast back to `dtype`."""
        return _unchanged

    # ---- the update's and the sampler's reductions ----
    def all_finite(self, tree) -> Array:
        """bool[]: True when no floating leaf of `tree` holds an inf or a NaN."""
        checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                  if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
        return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)

    def argmax(self, x: Array) -> Array:
        """x f[..., V] -> i32[...]: the index of the first largest value along the last axis (a NaN counts as the
        largest), as `jnp.argmax`."""
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def dots_policy(self) -> Callable:
        """The `jax.checkpoint` policy of `remat: dots`: the matmuls without batch dimensions (the projections)."""
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _unchanged(x):
    return x


#: the default of every model
XLA = Kernels()


def check_kernels(kernels) -> None:
    """Raise a clear `TypeError` unless `kernels` is a `Kernels` object."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels={kernels!r} is not a ppojax.models.kernels.Kernels; leave it out for XLA's, or "
                        f"pass ppojax.backends.kernels_for(...)'s choice")
