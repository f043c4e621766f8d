"""TPUs' `Kernels` (`ppojax.models.kernels`): decode attention as a Pallas (Mosaic) kernel that reads the KV cache
where it lies (`decode_attention`); a forward without a cache (the update's, the scoring forwards', packed rows)
through JAX's splash attention (`splash_attention`); XLA's operations for the rest.

The decode kernel takes a call with one query per row over a cache stored in the compute dtype whose slots read
split into blocks of a multiple of 128 (`decode_attention.fits`); a cache whose key heads fill whole lanes together
is stored with them side by side (`slot_shape`, `decode_attention.merged_slots`). Splash takes a forward without a
cache whose rows are a multiple of 128 tokens and whose mask the model described by its `segments` hint
(`splash_attention.fits`).
Any other call (a prefill or an observation into a cache, an 8-bit cache, a cache of another dtype, rows of
another length, layers of mixed sliding windows) is XLA's attention.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax

from ppojax.backends.per_shard import run_attention_kernel, run_decode_kernel
from ppojax.backends.tpu import splash_attention
from ppojax.backends.tpu.decode_attention import decode_attention, fits, merged_slots
from ppojax.models.kernels import Kernels
from ppojax.parallel.rules import GENERATE_RULES, logical_to_spec

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TpuKernels(Kernels):
    """mesh: the run's device mesh (None: one device), on which the kernel runs per shard
    (`ppojax.backends.per_shard`). interpret: run the kernels in Pallas's interpreter (any backend: the tests run
    them on the CPU)."""

    mesh: Any = None
    interpret: bool = False
    #: rows packed longer than a padded row: splash skips the key blocks of other sequences (`splash_attention`)
    skip_other_sequences: bool = False
    name: str = dataclasses.field(default="tpu", init=False)

    def attention(self, q: Array, k: Array, v: Array, mask: Array, *, scale: float, is_causal: bool = False,
                  window: Optional[int] = None, segments: Optional[Array] = None) -> Array:
        block = None if segments is None else splash_attention.fits(q.shape, k.shape)
        if block is None:
            return super().attention(q, k, v, mask, scale=scale)
        call = functools.partial(splash_attention.splash_attention, scale=scale, block=block, window=window,
                                 skip_other_sequences=self.skip_other_sequences, interpret=self.interpret)
        return run_attention_kernel(call, self.mesh, q, k, v, segments)

    def slot_shape(self, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        # K * hd lanes per slot where they fill whole lanes (a decode step's write then touches one row of the
        # cache's tiles), unless the mesh would split the merged axis otherwise than the key heads
        if not merged_slots(kv_heads, head_dim):
            return (kv_heads, head_dim)
        if self.mesh is not None and logical_to_spec((kv_heads,), ("kv_heads",), self.mesh, GENERATE_RULES) != \
                logical_to_spec((kv_heads * head_dim,), ("kv_heads",), self.mesh, GENERATE_RULES):
            return (kv_heads, head_dim)
        return (kv_heads * head_dim,)

    def cache_attention(self, q: Array, keys: Array, values: Array, layer_idx: Array, mask: Array, *,
                        scale: float, slots_read: int) -> Optional[Array]:
        bt = fits(q.shape, keys.shape[1:], keys.dtype, slots_read) if keys.dtype == q.dtype else None
        if bt is None:
            return None
        call = functools.partial(decode_attention, scale=scale, slots_read=slots_read, bt=bt,
                                 interpret=self.interpret)
        return run_decode_kernel(call, self.mesh, q, keys, values, layer_idx, mask)
