"""NVIDIA GPUs' `Kernels` (`ppojax.models.kernels`): cuDNN's fused flash attention, through JAX's own
`jax.nn.dot_product_attention(implementation="cudnn")`, where the call fits it; with attention_implementation
'pallas', also decode attention as a Pallas (Triton) kernel that reads the KV cache where it lies
(`decode_attention`); XLA's operations for the rest.

Why the mask goes in as a boolean tensor. Rows are LEFT padded: a real query at slot i attends to the real keys
in `[first_real, i]`. `jax.nn.dot_product_attention`'s cheap padding form (`query_seq_lengths` /
`key_value_seq_lengths`) means "slots `[0, length)` are real", i.e. right padding, so it cannot say "skip the
first `p_b` slots". So the mask is passed whole; cuDNN's path turns it into an additive bias `[B, 1, S, T]`, read
per block in the forward and written as a bias gradient in the backward, and `is_causal` still lets it skip the
blocks above the diagonal. GQA: cuDNN groups the H query heads over the K key heads natively.

Why decode takes the Pallas kernel only when asked ('pallas'): its speed against XLA's fused products has not been
measured on a GPU yet (`benchmarks/gpu.py` measures both); 'pallas' otherwise chooses as 'auto' does.

"auto" takes the kernel on an Ampere-or-later GPU when the call fits: a 16-bit dtype, head_dim a multiple of 8 and
<= 128 (<= 256 from Hopper on), and (because the mask enters as a bias, whose backward cuDNN runs only on even
lengths) even query and key lengths; never for a single query (decode), where XLA's fused matrix-vector products
beat the flash kernel, whose query tile is then nearly empty. "cudnn" takes it for every call.

On a device mesh, cuDNN's SPMD partitioner takes q, k and v only when they are sharded alike (rows and heads,
never the sequence or head_dim), and the mask's rows like theirs; XLA's propagation gives q and k different
shardings on an fsdp mesh (their projections' weights differ), so the kernels lay them out for the run's mesh
(`ppojax.parallel.rules.attention_operand_placement`) before the call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from ppojax.backends.gpu import decode_attention
from ppojax.backends.per_shard import run_decode_kernel
from ppojax.models.kernels import Kernels
from ppojax.parallel.rules import attention_operand_placement

Array = jax.Array

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def compute_capability(device) -> Optional[tuple[int, int]]:
    """(major, minor) of an NVIDIA GPU `device` (a real or compile-only one), else None."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return major, minor


def check_cudnn_fits(dtype, head_dim: int) -> None:
    """Raise a clear `ValueError` where attention_implementation='cudnn' cannot run a model of this compute
    `dtype` and `head_dim` (checked when the run is built, before any compute)."""
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        raise ValueError(f"attention_implementation='cudnn' needs a bfloat16 or float16 compute dtype, got "
                         f"{jnp.dtype(dtype).name}; use precision 'bfloat16' or 'mixed', or "
                         f"attention_implementation='auto'")
    if head_dim % 8 or head_dim > 256:
        raise ValueError(f"attention_implementation='cudnn' needs head_dim a multiple of 8 and <= 256 "
                         f"(<= 128 before Hopper), got {head_dim}; use attention_implementation='auto' or 'xla'")


@dataclasses.dataclass(frozen=True)
class GpuKernels(Kernels):
    """implementation: "auto", "cudnn" or "pallas" (module doc); capability: the GPUs' compute capability (major,
    minor); mesh: the run's device mesh, on which cuDNN's operands are laid out alike and the Pallas kernel runs
    per shard (None: one device); interpret: the Pallas kernel in Pallas's interpreter (the tests' CPU)."""

    implementation: str = "auto"
    capability: tuple = (8, 0)
    mesh: Any = None
    interpret: bool = False
    name: str = dataclasses.field(default="gpu", init=False)

    def cache_attention(self, q: Array, keys: Array, values: Array, layer_idx: Array, mask: Array, *,
                        scale: float, slots_read: int) -> Optional[Array]:
        if self.implementation != "pallas" or keys.dtype != q.dtype or \
                not decode_attention.fits(q.shape, keys.shape[1:], keys.dtype, slots_read):
            return None
        call = functools.partial(decode_attention.decode_attention, scale=scale, slots_read=slots_read,
                                 interpret=self.interpret)
        return run_decode_kernel(call, self.mesh, q, keys, values, layer_idx, mask)

    def takes_cudnn(self, dtype, head_dim: int, q_len: int, kv_len: int) -> bool:
        """Whether a call of these static shapes runs cuDNN's kernel (module doc)."""
        if self.implementation == "cudnn":
            return True
        max_head_dim = 256 if self.capability >= (9, 0) else 128
        return (self.capability >= (8, 0) and jnp.dtype(dtype) in [jnp.dtype(d) for d in CUDNN_DTYPES]
                and head_dim % 8 == 0 and head_dim <= max_head_dim
                and q_len > 1 and q_len % 2 == 0 and kv_len % 2 == 0)

    def attention(self, q: Array, k: Array, v: Array, mask: Array, *, scale: float, is_causal: bool = False,
                  window: Optional[int] = None, segments: Optional[Array] = None) -> Array:
        if not self.takes_cudnn(q.dtype, q.shape[3], q.shape[1], k.shape[1]):
            return super().attention(q, k, v, mask, scale=scale)
        if self.mesh is not None:
            q, k, v, mask = attention_operand_placement(self.mesh)(q, k, v, mask)
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask[:, None, :, :], scale=float(scale), is_causal=is_causal,
            local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")
