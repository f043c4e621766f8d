"""A backend's decode-attention kernel on a device mesh: a Pallas kernel is one device's program, so on a mesh it
runs per shard (`shard_map`) on the rows and key heads the KV cache holds there
(`ppojax.parallel.rules.cache_attention_specs`)."""
from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import PartitionSpec

from ppojax.parallel.rules import cache_attention_specs


def cache_attention_per_shard(call: Callable, mesh, rows: int, heads: int, kv_heads: int) -> Callable:
    """`call(q [B, H, hd], keys, values [L, B, T, K, hd], layer i32[], mask bool[B, T']) -> [B, H, hd]` run per
    shard of `mesh` (unchanged without a mesh or on one device)."""
    if mesh is None or mesh.size == 1:
        return call
    q_spec, cache_spec, mask_spec = cache_attention_specs(mesh, rows, heads, kv_heads)
    specs = (q_spec, cache_spec, cache_spec, PartitionSpec(), mask_spec)
    return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
