"""Rematerialisation (activation checkpointing) policies for the layer body.

A policy decides which intermediates of a layer the forward keeps for the backward pass; the rest is recomputed
during the backward from the layer's input:
  "none": keep everything (fastest, most memory);
  "full": keep only each layer's input (the residual stream `[B, S, D]` per layer); the backward reruns the layer;
  "dots": keep the outputs of the matmuls without batch dimensions: the q/k/v/o projections and the MLP's
    up/gate/down (all 2-D dots on the flattened tokens, see `transformer._dense_in`); recompute the rest
    (norms, activations, RoPE, and attention itself, whose score matmuls are batched over batch and heads and
    quadratic in the sequence length). The policy is the model's kernels' (`Kernels.dots_policy`): a backend whose
    products are not plain dots names what it saves.
"""

from __future__ import annotations

from typing import Callable

import jax


REMAT_POLICIES = ("none", "full", "dots")


def check_remat(remat) -> None:
    """Raise a clear `ValueError` unless `remat` is one of `REMAT_POLICIES`."""
    if not isinstance(remat, str) or remat not in REMAT_POLICIES:
        hint = " (remat=True was the old spelling of 'full')" if remat is True else ""
        raise ValueError(f"remat={remat!r} is not one of {REMAT_POLICIES}{hint}: 'none' keeps every activation, "
                         f"'full' recomputes each layer in the backward, 'dots' keeps only the matmul outputs")


def remat_layer(body: Callable, remat: str, dots_policy: Callable = None, *, prevent_cse: bool = True) -> Callable:
    """`body` wrapped in `jax.checkpoint` with the policy named `remat` (unchanged for "none"). dots_policy: what
    "dots" saves (the model's `Kernels.dots_policy()`; default the matmuls without batch dimensions).

    prevent_cse: False only where the caller runs `body` under `lax.scan`, which already keeps XLA from merging
    the recomputation into the forward (`jax.checkpoint`'s documentation); True elsewhere.
    """
    check_remat(remat)
    if remat == "none":
        return body
    if dots_policy is None:
        dots_policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    policy = None if remat == "full" else dots_policy
    return jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)
