"""Masked grouped-query attention: cuDNN's fused kernel (through `jax.nn.dot_product_attention`) or XLA.

One entry point, `attention(q, k, v, mask, ...)`, for the full forward (S queries over S keys) and for the KV-cache
calls (S queries over T cache slots; decode is S = 1). The boolean `mask` is the single source of truth for who
attends to whom (key padding, causality, sliding window); `is_causal` and `window` are exact hints that it
already implies, passed on so that cuDNN can skip whole blocks (above the diagonal, outside the window).

Why the mask goes in as a boolean tensor. Rows are LEFT padded: a real query at slot i attends to the real keys
in `[first_real, i]`. `jax.nn.dot_product_attention`'s cheap padding form (`query_seq_lengths` /
`key_value_seq_lengths`) means "slots `[0, length)` are real", i.e. right padding, so it cannot say "skip the
first `p_b` slots" (cuDNN's packed-segment offsets could, but `jax.nn.dot_product_attention` does not expose
them). Rolling each row to right padding would work only for masks whose real tokens are contiguous, while the
model's contract accepts any `attention_mask` (a sampled pad id inside a response makes a hole). So the mask is
passed whole; the cuDNN path turns it into an additive bias `[B, 1, S, T]`
(`jax._src.cudnn.fused_attention_stablehlo.combine_bias_and_mask`), read per block in the forward and written as
a bias gradient in the backward, and `is_causal` still lets it skip the blocks above the diagonal.

GQA: `k, v` keep their K heads, so no repeat of the keys is ever materialised. cuDNN groups the H query heads
natively. The XLA path (`_grouped_xla`) makes a key head's G = H/K query heads extra query rows: one batched
product of `[G*S, hd] x [hd, T]` per (row, key head). `jax.nn.dot_product_attention`'s XLA path vmaps over the
group instead (G products of `[S, hd] x [hd, T]`), which XLA:CPU runs no faster and usually a little slower.
Both keep jax's float32 softmax and its masking constant, so a fully masked row averages every key, as there.

Implementations: "xla" (any backend, any dtype), "cudnn" (NVIDIA GPU, bfloat16/float16, head_dim a multiple of 8
and <= 128, or <= 256 from Hopper on), "auto" (cuDNN where those hold and there is more than one query, else XLA:
`jax.nn.dot_product_attention`'s own `implementation=None` always means XLA today; for one query against the
cache, XLA's fused matrix-vector products beat the flash kernel, whose query tile is then nearly empty). Both keep
the softmax in float32, and a query whose every key is masked gets a finite output (an average over the keys the
kernel did not skip), never NaN; callers ignore such positions.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)

Array = jax.Array


def check_attention_implementation(implementation: str, dtype, head_dim: int) -> None:
    """Raise a clear `ValueError` for an unknown implementation, or for "cudnn" with what cuDNN cannot run.

    Checked when a model is built (before any compute); the backend is checked when the model is traced (a model
    may be built on a CPU host to plan a GPU run).
    """
    if implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention_implementation={implementation!r} is not one of {ATTENTION_IMPLEMENTATIONS}; "
                         f"use 'auto' to let ppojax pick cuDNN's fused kernel where it applies and XLA elsewhere")
    if implementation == "cudnn":
        if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
            raise ValueError(f"attention_implementation='cudnn' needs a bfloat16 or float16 compute dtype, got "
                             f"{jnp.dtype(dtype).name}; use precision 'bfloat16' or 'mixed', or "
                             f"attention_implementation='auto'")
        if head_dim % 8 or head_dim > 256:
            raise ValueError(f"attention_implementation='cudnn' needs head_dim a multiple of 8 and <= 256 "
                             f"(<= 128 before Hopper), got {head_dim}; use attention_implementation='auto' or 'xla'")


#: the device a program is traced for, where that is not JAX's default device: an ahead-of-time compile for
#: another machine (`ppojax plan --target`) traces on the host's CPU for a target's GPUs or TPUs
_TRACED_FOR = contextvars.ContextVar("ppojax_attention_traced_for", default=None)


@contextlib.contextmanager
def traced_for(device):
    """Choose each attention call's implementation for `device` (e.g. a compile-only device of another machine)
    instead of JAX's default device, while tracing inside this block."""
    token = _TRACED_FOR.set(device)
    try:
        yield
    finally:
        _TRACED_FOR.reset(token)


#: how the fused kernel's operands are placed where the program is traced on a device mesh (`operands_placed_by`)
_PLACE_OPERANDS = contextvars.ContextVar("ppojax_attention_place_operands", default=None)


@contextlib.contextmanager
def operands_placed_by(place):
    """While tracing inside this block, pass cuDNN's operands through ``place(q, k, v, mask) -> (q, k, v, mask)``.

    cuDNN's SPMD partitioner takes only q, k and v sharded alike (batch and heads; never the sequence or
    head_dim), and the mask's batch like theirs. XLA's propagation gives q and k different shardings on an fsdp
    mesh (their projections' weights differ), so the program that owns the mesh says how to lay them out
    (`ppojax.parallel.sharding.attention_operand_placement`); the model itself knows no mesh.
    """
    token = _PLACE_OPERANDS.set(place)
    try:
        yield
    finally:
        _PLACE_OPERANDS.reset(token)


def _target_device():
    return _TRACED_FOR.get() or jax.devices()[0]


def _cuda_compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the device traced for (`traced_for`; by default JAX's default device) when it is an
    NVIDIA GPU, else None."""
    device = _target_device()
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = (int(x) for x in str(capability).split(".")[:2])
    return major, minor


def resolve_implementation(implementation: str, dtype, head_dim: int, q_len: int, kv_len: int) -> str:
    """The implementation one attention call uses: "xla" or "cudnn" (static; decided at trace time).

    "auto" takes cuDNN's fused flash kernel on an Ampere-or-later NVIDIA GPU when the call fits it: a 16-bit dtype,
    a supported head_dim, and (because the mask enters as a bias, whose backward cuDNN runs only on even lengths)
    even query and key lengths; never for a single query (decode), where XLA is faster.
    """
    if implementation == "xla":
        return "xla"
    capability = _cuda_compute_capability()
    if implementation == "cudnn":
        if capability is None:
            raise ValueError(f"attention_implementation='cudnn' needs an NVIDIA GPU, but the device traced for is "
                             f"{_target_device().platform!r}; use attention_implementation='auto' or 'xla'")
        return "cudnn"
    max_head_dim = 256 if capability is not None and capability >= (9, 0) else 128
    fits = (capability is not None and capability >= (8, 0)
            and jnp.dtype(dtype) in [jnp.dtype(d) for d in CUDNN_DTYPES]
            and head_dim % 8 == 0 and head_dim <= max_head_dim
            and q_len > 1 and q_len % 2 == 0 and kv_len % 2 == 0)
    return "cudnn" if fits else "xla"


def attention(q: Array, k: Array, v: Array, mask: Array, *, scale: float, implementation: str = "auto",
              is_causal: bool = False, window: int | None = None) -> Array:
    """Grouped-query attention with a float32 softmax.

    q: [B, S, H, hd]; k, v: [B, T, K, hd] (H a multiple of K; same dtype as q); mask: bool[B, S, T] (True = may
    attend). scale: a Python float (cuDNN takes it as a constant; fold a traced factor into q instead).
    Hints, each implied by `mask` (so the result does not depend on them): `is_causal` (query s may attend only to
    keys t <= s: the no-cache forward, S == T), `window` (query s attends only to keys t > s - window, S == T).
    Returns [B, S, H, hd] in q.dtype.
    """
    s, hd = q.shape[1], q.shape[3]
    t = k.shape[1]
    if resolve_implementation(implementation, q.dtype, hd, s, t) == "xla":
        return _grouped_xla(q, k, v, mask, float(scale))  # the hints are implied by the mask
    place = _PLACE_OPERANDS.get()
    if place is not None:
        q, k, v, mask = place(q, k, v, mask)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask[:, None, :, :], scale=float(scale), is_causal=is_causal,
        local_window_size=None if window is None else (window - 1, 0), implementation="cudnn")


def _grouped_xla(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """XLA attention with each key head's query heads as extra query rows (shapes as `attention`).

    Logits in float32 (bfloat16/float16 inputs accumulate in float32, as `jax.nn.dot_product_attention`'s
    XLA path), masked with -0.7 * float32 max (its constant), float32 softmax, probabilities cast to v's dtype.
    """
    b, s, h, hd = q.shape
    t, kv = k.shape[1], k.shape[2]
    g = h // kv
    rows = jnp.transpose(q.reshape(b, s, kv, g, hd), (0, 2, 3, 1, 4)).reshape(b, kv, g * s, hd)
    logits = jnp.einsum("bkqd,btkd->bkqt", rows, k, preferred_element_type=jnp.float32) * jnp.float32(scale)
    row_mask = jnp.broadcast_to(mask[:, None, None], (b, kv, g, s, t)).reshape(b, kv, g * s, t)
    logits = jnp.where(row_mask, logits, -0.7 * jnp.finfo(jnp.float32).max)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkqt,btkd->bkqd", probs, v)  # [B, K, G*S, hd]
    return jnp.transpose(out.reshape(b, kv, g, s, hd), (0, 3, 1, 2, 4)).reshape(b, s, h, hd).astype(q.dtype)
