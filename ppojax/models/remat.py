"""Rematerialisation (activation checkpointing) policies for the layer body.

A policy decides which intermediates of a layer the forward keeps for the backward pass; the rest is recomputed
during the backward from the layer's input:
  "none": keep everything (fastest, most memory);
  "full": keep only each layer's input (the residual stream `[B, S, D]` per layer); the backward reruns the layer;
  "dots": keep the outputs of the matmuls without batch dimensions: the q/k/v/o projections and the MLP's
    up/gate/down (all 2-D dots on the flattened tokens, see `transformer._dense_in`); recompute the rest
    (norms, activations, RoPE, and attention itself, whose score matmuls are batched over batch and heads and
    quadratic in the sequence length). `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`, except that
    on the CPU a 16-bit projection's output is saved as its uint16 bits (`slot_storage.saved_as_bits`) instead
    of its float32 product: the stacked per-layer copies stay in place and half the size; a projection that
    `stacked_matmul` computes (a custom call, not a dot) is saved by its name.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ppojax.models import slot_storage
from ppojax.models.slot_storage import SAVED_BITS
from ppojax.backends.cpu.stacked_matmul import SAVED_NAME as STACKED_PROJECTION

REMAT_POLICIES = ("none", "full", "dots")


def check_remat(remat) -> None:
    """Raise a clear `ValueError` unless `remat` is one of `REMAT_POLICIES`."""
    if not isinstance(remat, str) or remat not in REMAT_POLICIES:
        hint = " (remat=True was the old spelling of 'full')" if remat is True else ""
        raise ValueError(f"remat={remat!r} is not one of {REMAT_POLICIES}{hint}: 'none' keeps every activation, "
                         f"'full' recomputes each layer in the backward, 'dots' keeps only the matmul outputs")


def remat_layer(body: Callable, remat: str, *, prevent_cse: bool = True) -> Callable:
    """`body` wrapped in `jax.checkpoint` with the policy named `remat` (unchanged for "none").

    prevent_cse: False only where the caller runs `body` under `lax.scan`, which already keeps XLA from merging
    the recomputation into the forward (`jax.checkpoint`'s documentation); True elsewhere.
    """
    check_remat(remat)
    if remat == "none":
        return body
    policy = None if remat == "full" else _saves_dots
    return jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)


def _dot_saved_whole(prim, *avals, **params) -> bool:
    """A dot without batch dimensions, unless its 16-bit operands ask for a float32 product on the CPU (the
    projections of `transformer._matmul`, whose rounded output is saved as bits instead)."""
    if not jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params):
        return False
    float32_of_16_bit = (params.get("preferred_element_type") == jnp.float32
                         and all(slot_storage.stores_bits(a.dtype) for a in avals[:2]))
    return not float32_of_16_bit


_saves_dots = jax.checkpoint_policies.save_from_both_policies(
    _dot_saved_whole, jax.checkpoint_policies.save_only_these_names(SAVED_BITS, STACKED_PROJECTION))
