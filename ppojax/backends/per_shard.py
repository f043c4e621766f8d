"""A backend's attention kernel where the program is more than one model on one device: on a device mesh a Pallas
kernel is one device's program, so it runs per shard (`shard_map`): a decode kernel on the rows and key heads the
KV cache holds there (`ppojax.parallel.rules.cache_attention_specs`), a full forward's kernel on the rows and heads
of its operands (`ppojax.parallel.rules.attention_specs`); under `vmap` (a sweep over seeds or learning rates,
one model per element) a decode kernel runs once over the stacked models' caches (`over_models`)."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ppojax.models.kernels import stored_kv_heads
from ppojax.parallel.rules import attention_specs, cache_attention_specs


def cache_attention_per_shard(call: Callable, mesh, rows: int, heads: int, kv_heads: int) -> Callable:
    """`call(q [B, H, hd], keys, values [L, B, T, K, hd], layer i32[], mask bool[B, T']) -> [B, H, hd]` run per
    shard of `mesh` (unchanged without a mesh or on one device)."""
    if mesh is None or mesh.size == 1:
        return call
    q_spec, cache_spec, mask_spec = cache_attention_specs(mesh, rows, heads, kv_heads)
    specs = (q_spec, cache_spec, cache_spec, PartitionSpec(), mask_spec)
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)


def run_decode_kernel(call: Callable, mesh, q, keys, values, layer_idx, mask):
    """A `Kernels.cache_attention` call (q [B, 1, H, hd], mask bool[B, 1, T']) through a backend's decode kernel
    `call` (one query per row: q [B, H, hd], mask [B, T']), per shard of `mesh` -> [B, 1, H, hd]."""
    kv_heads = stored_kv_heads(keys.shape[3:], q.shape[-1])  # keys [L, B, T, K, hd] or [L, B, T, K * hd]
    call = cache_attention_per_shard(call, mesh, q.shape[0], q.shape[2], kv_heads)
    return call(q[:, 0], keys, values, layer_idx, mask[:, 0])[:, None]


def run_attention_kernel(call: Callable, mesh, q, k, v, segments):
    """A `Kernels.attention` call of a forward without a cache through a backend's kernel `call(q [B, S, H, hd],
    k, v [B, S, K, hd], segments i32[B, S]) -> [B, S, H, hd]`, per shard of `mesh` (unchanged without a mesh or on
    one device): each shard's rows and heads, whole groups of query heads with their key head."""
    if mesh is None or mesh.size == 1:
        return call(q, k, v, segments)
    qkv_spec, segments_spec = attention_specs(mesh, q.shape[0], q.shape[2], k.shape[2])
    return jax.shard_map(call, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, segments_spec),
                         out_specs=qkv_spec, check_vma=False)(q, k, v, segments)


def over_models(kernel: Callable) -> Callable:
    """`kernel(q [M, B, H, hd], keys, values [M, L, B, T, K, hd], layer i32[M], mask bool[M, B, T']) -> [M, B, H, hd]`
    as the function of ONE model's arrays (q [B, H, hd], keys, values [L, B, T, K, hd], layer i32[], mask
    bool[B, T']). Why: Pallas batches a kernel under `vmap` as a loop that slices each element's operands out,
    here each model's whole cache per call; this rule stacks the vmapped models into the kernel's leading axis
    instead (nested vmaps flatten into it), one kernel over all of them. No gradient (decode only)."""

    @jax.custom_batching.custom_vmap
    def models(q, keys, values, layer, mask):
        return kernel(q, keys, values, layer, mask)

    @models.def_vmap
    def _models_vmapped(axis_size, in_batched, *args):  # [V, M, ...] -> [V * M, ...] and back
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(args, in_batched)]
        flat = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args]
        out = models(*flat)
        return out.reshape(axis_size, -1, *out.shape[1:]), True

    @jax.custom_batching.custom_vmap
    def one(q, keys, values, layer, mask):
        return kernel(q[None], keys[None], values[None], layer[None], mask[None])[0]

    @one.def_vmap
    def _one_vmapped(axis_size, in_batched, *args):
        args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, batched in zip(args, in_batched)]
        return models(*args), True

    return one
