"""16-bit floats that are written into, or read from, a larger array slot by slot, carried as their uint16 bits.

Whether to carry them so is the backend's choice (`Kernels.stores_bits`; a backend whose compiler has no in-place
16-bit slot update, or reads a 16-bit slice through a widened copy of the whole array, asks for it: on 16-bit
integers the same ops stay in place). This module is the mechanics, for every backend that asks:

- the KV cache (`transformer.KVCache`: `init_cache` stores a 16-bit cache as uint16, `_block` writes and reads
  through `to_bits` / `from_bits`);
- the projections' outputs that `remat: dots` saves for the backward (`saved_as_bits`: the saved value is the
  uint16 view, named `SAVED_BITS`, for the backend's remat policy to save in place of a float32 product);
- the 16-bit weight stacks a forward with a KV cache (generation) slices per layer (`sliced_as_bits`; no
  gradient flows there, and differentiating through it raises).

The layer scan also saves each layer's input, the residual stream carried from layer to layer: an integer carry
would stop the gradient, so there a 16-bit stream travels as float32 holding exactly its 16-bit values
(`float32_holding`; `transformer.Backbone.forward`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

#: The name under which `saved_as_bits` marks a projection's output for `remat: dots` (see remat.py).
SAVED_BITS = "ppojax_projection_bits"

BITS = jnp.uint16


def to_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array -> its uint16 bits (same shape)."""
    return jax.lax.bitcast_convert_type(x, BITS)


def from_bits(bits: jax.Array, dtype) -> jax.Array:
    """uint16 bits -> the 16-bit float `dtype` they hold (same shape)."""
    return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype))


def sliced_as_bits(stack, stores_bits):
    """A pytree of per-layer stacked weights -> (the same with each leaf whose dtype `stores_bits` (a predicate on
    dtypes, the backend's) as its uint16 bits, `restore`: one layer's slice of it -> that slice with its 16-bit
    floats back).

    For loops that only READ a 16-bit stack slice by slice (the sampler's layer scan, once per token): XLA:CPU
    would read it through a float32 copy of the whole stack, twice the bytes. A bitcast to an integer has no
    gradient: differentiating through it raises (`_read_only_bits`) rather than giving a zero gradient."""
    leaves, treedef = jax.tree.flatten(stack)
    dtypes = [a.dtype if stores_bits(a.dtype) else None for a in leaves]
    if not any(d is not None for d in dtypes):
        return stack, lambda layer: layer

    def restore(layer):
        return treedef.unflatten([a if d is None else from_bits(a, d)
                                  for a, d in zip(jax.tree.leaves(layer), dtypes, strict=True)])

    return treedef.unflatten([a if d is None else _read_only_bits(a) for a, d in zip(leaves, dtypes)]), restore


@jax.custom_jvp
def _read_only_bits(x):
    return to_bits(x)


@_read_only_bits.defjvp
def _read_only_bits_jvp(primals, tangents):
    raise TypeError("the model's 16-bit weights were differentiated through a forward with a KV cache, which "
                    "reads them as their uint16 bits here (no gradient): that forward is for generation; "
                    "differentiate a forward without a cache")


def float32_holding(x: jax.Array) -> jax.Array:
    """A 16-bit float `x` as float32 with exactly its values. The explicit rounding keeps XLA (which may drop a
    round trip through 16 bits, `xla_allow_excess_precision`) from carrying unrounded float32 values instead."""
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant)


def saved_as_bits(y: jax.Array) -> jax.Array:
    """`y` (a 16-bit float) unchanged, with its uint16 view marked as the value `remat: dots` saves.

    The identity for autodiff (a bitcast to an integer would otherwise stop the gradient)."""
    return _through_named_bits(y)


def _named_bits(y):
    return from_bits(checkpoint_name(to_bits(y), SAVED_BITS), y.dtype)


@jax.custom_jvp
def _through_named_bits(y):
    return _named_bits(y)


@_through_named_bits.defjvp
def _through_named_bits_jvp(primals, tangents):
    # the primal as plain ops (not this custom_jvp again), so that the remat policy sees the name
    (y,), (dy,) = primals, tangents
    return _named_bits(y), dy
