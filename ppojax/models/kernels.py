"""The seam between the models and a backend: `Kernels`, the few operations whose best form differs by backend.

A model holds one `Kernels` object (a static attribute of its backbone, part of the graphdef), chosen ONCE when a
run is built (`ppojax.backends.kernels_for`) and never while tracing: tracing only reads what it decided. This
base class is XLA's own operations, which every backend compiles (TPU, GPU and CPU alike); it is the default of
every model. A backend that does better subclasses it (the CPU's: `ppojax.backends.cpu.kernels.CpuKernels`).

What a backend may change, and nothing else:
  - `matmul`: a 2-D product in the compute dtype (the layers' projections and LoRA's thin products);
  - `output_projection`: the attention output projection `[B, S, H, hd] x [H, hd, D]`;
  - `split_layer_kernels` / `layer_products`: projections that read their layer's kernel where it lies in the
    stacked `[L, ...]` weights instead of the layer scan's per-layer slice;
  - `head_logits`: the LM head's product;
  - `stores_bits`: whether 16-bit values written or read slot by slot (KV cache, saved activations, the sampler's
    weight stacks) travel as their uint16 bits (`slot_storage`);
  - `dots_policy`: what `remat: dots` saves (it must recognise the backend's own products).
Values: every implementation computes the same products; only the summation order may differ.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

Array = jax.Array

#: (group, projection) -> how many leading kernel axes (after `layers`) are its input: q [L, D, H, hd] has one,
#: o [L, H, hd, D] two. The projections a backend may compute from the stacked kernels.
LAYER_PROJECTIONS = {("attn", "q"): 1, ("attn", "k"): 1, ("attn", "v"): 1, ("attn", "o"): 2,
                     ("mlp", "up"): 1, ("mlp", "gate"): 1, ("mlp", "down"): 1}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """XLA's operations (the default). Frozen and hashable: a model's graphdef, hence a jit cache key, holds it."""

    #: a short name for logs and reports
    name: str = dataclasses.field(default="xla", init=False)

    def stores_bits(self, dtype) -> bool:
        """Whether 16-bit values of `dtype` stored slot by slot travel as uint16 bits (`slot_storage`)."""
        return False

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

    def dots_policy(self) -> Callable:
        """The `jax.checkpoint` policy of `remat: dots`: the matmuls without batch dimensions (the projections)."""
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


#: the default of every model
XLA = Kernels()


def check_kernels(kernels) -> None:
    """Raise a clear `TypeError` unless `kernels` is a `Kernels` object."""
    if not isinstance(kernels, Kernels):
        raise TypeError(f"kernels={kernels!r} is not a ppojax.models.kernels.Kernels; leave it out for XLA's, or "
                        f"pass ppojax.backends.kernels_for(...)'s choice")
