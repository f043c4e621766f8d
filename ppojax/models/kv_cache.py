"""The KV cache of generation, and the keys and values of a shared prefix.

KV cache (`KVCache`, `init_cache`): keys/values `[L, B, T, K, hd]`, `key_mask bool[B, T]`, `index i32[]` (next write
slot; the kernels say how its keys and values are stored, `Kernels.slot_shape` and `Kernels.slot_dtype`: TPUs' keep
a slot's small key heads side by side, `[L, B, T, K * hd]`). A call with a cache writes its S tokens
at slots `[index, index + S)`, marks them valid where `attention_mask`, lets query slot `index + s` attend to valid
slots `<= index + s`, and returns `index + S`. Prefill = the whole left-padded prompt on an empty cache; decode = S = 1
calls. Static shapes, jit-friendly. `index` may also be i32[B], one per row (each row writes at its own slot;
`write_slots`). `init_cache(..., dtype=jnp.int8)` stores 8-bit codes and a scale per token and head instead
(`kv_int8`: keys/values int8 `[L, B, T, K, kv_int8.stored_width(hd)]`), read back in the compute dtype.
A layer writes its keys and values into the stacked cache and reads them back as the cache stores them
(`write_layer`, `read_layer`).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from ppojax.models import kv_int8
from ppojax.models.config import ModelConfig
from ppojax.models.kernels import XLA, Kernels

Array = jax.Array


@flax.struct.dataclass
class KVCache:
    """Stacked per-layer key/value cache.

    keys, values: [L, B, T, K, hd] (the values' dtype, or the form the kernels store it in: `value_dtype`; or
        [L, B, T, K * hd] where the kernels store a slot's key heads side by side, `Kernels.slot_shape`);
    key_mask: bool[B, T] (True = slot holds a real token);
    index: i32[] (next slot to write; the same for every row, rows are left-padded), or i32[B] (each row's
    own next slot: rows holding sequences started at different times, `ppojax.rl.continuous`).
    read_length: attention reads only slots `[0, read_length)` (None: all T). The caller promises that every
    slot written so far, and those the call writes, lie below it: a sampler that knows how far its cache is
    filled (`ppojax.rl.sampler`'s decode segments) saves reading, and attending over, the empty slots.
    """

    keys: Array
    values: Array
    key_mask: Array
    index: Array
    #: the dtype of the values `keys` / `values` hold, where their storage differs (`Kernels.slot_dtype`), else None
    value_dtype: str | None = flax.struct.field(pytree_node=False, default=None)
    read_length: int | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    @property
    def slots_read(self) -> int:
        """How many slots, from the first, attention reads (`read_length`, else all)."""
        return self.max_length if self.read_length is None else self.read_length

    @property
    def dtype(self):
        """The dtype of the keys and values the cache holds (whatever their storage)."""
        return jnp.dtype(self.value_dtype) if self.value_dtype else self.keys.dtype


@flax.struct.dataclass
class PromptKV:
    """Every layer's keys and values of some rows' tokens, for a forward of the tokens that follow them
    (`Backbone.forward(..., prefix=)`): the G samples of a prompt attend to its keys and values computed once.

    keys, values: [L, B, P, K, hd] (compute dtype, after the position encoding); key_mask: bool[B, P] (True = a
    real token).
    """

    keys: Array
    values: Array
    key_mask: Array

    def repeat_rows(self, times: int) -> "PromptKV":
        """Each row `times` times, the copies consecutive (row b of the result is row b // times)."""
        return PromptKV(keys=jnp.repeat(self.keys, times, axis=1), values=jnp.repeat(self.values, times, axis=1),
                        key_mask=jnp.repeat(self.key_mask, times, axis=0))

    def followed_by(self, later: "PromptKV") -> "PromptKV":
        """These tokens' keys and values, then ``later``'s (the same rows): the slots of both, in that order."""
        return PromptKV(keys=jnp.concatenate([self.keys, later.keys], axis=2),
                        values=jnp.concatenate([self.values, later.values], axis=2),
                        key_mask=jnp.concatenate([self.key_mask, later.key_mask], axis=1))


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int, dtype=jnp.float32,
               kernels: Kernels = XLA) -> KVCache:
    """An empty cache for `max_length` slots (prompt + generated tokens) of `dtype` keys and values, stored as
    the model's `kernels` store such values (`Kernels.slot_dtype`). Pass the model's `kernels`."""
    shape = (cfg.num_layers, batch_size, max_length, cfg.num_kv_heads, cfg.head_dim)
    if jnp.dtype(dtype) == kv_int8.INT8:  # 8-bit codes and a scale per token and head (ppojax.models.kv_int8)
        shape, storage = shape[:-1] + (kv_int8.stored_width(cfg.head_dim),), kv_int8.INT8
        return KVCache(keys=jnp.zeros(shape, storage), values=jnp.zeros(shape, storage),
                       key_mask=jnp.zeros((batch_size, max_length), bool), index=jnp.zeros((), jnp.int32))
    storage = kernels.slot_dtype(dtype)
    shape = shape[:3] + kernels.slot_shape(cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        keys=jnp.zeros(shape, storage),
        values=jnp.zeros(shape, storage),
        key_mask=jnp.zeros((batch_size, max_length), bool),
        index=jnp.zeros((), jnp.int32),
        value_dtype=jnp.dtype(dtype).name if storage != jnp.dtype(dtype) else None,
    )


def write_slots(stack: Array, new: Array, layer_idx, index: Array) -> Array:
    """`stack` with `new` written at slot `index` of its length axis, in layer `layer_idx` when not None.

    With a layer: stack [L, B, T, ...], new [1, B, S, ...]; without: stack [B, T, ...], new [B, S, ...] (the key
    mask). index: i32[] (every row writes at the same slot: one dynamic_update_slice) or i32[B] (each row at
    its own slot, as the continuous-batching sampler's slots, each at its own point of its sequence)."""
    lead = () if layer_idx is None else (layer_idx,)
    axis = len(lead)  # the batch axis
    tail = (0,) * (stack.ndim - axis - 2)
    if jnp.ndim(index) == 0:
        return jax.lax.dynamic_update_slice(stack, new, (*lead, 0, index, *tail))
    # One index per row: a scatter at explicit (row, slot) pairs, done in place (slots past the end are dropped).
    # A vmapped dynamic_update_slice is a scatter too, but one XLA:CPU did not do in place: it copied the whole
    # stacked cache at every layer's write (decode steps several times slower).
    row_new = new[0] if lead else new  # [B, S, ...]
    rows = jnp.arange(row_new.shape[0], dtype=jnp.int32)[:, None]
    slots = index[:, None] + jnp.arange(row_new.shape[1], dtype=jnp.int32)[None, :]  # [B, S]
    return stack.at[(*lead, rows, slots)].set(row_new.astype(stack.dtype), mode="drop")


def write_layer(stack: Array, new: Array, layer_idx, index: Array, kernels: Kernels, cache_dtype) -> Array:
    """The whole stacked keys or values `stack` ([L, B, T, ...]) with a call's `new` ([B, S, K, hd]) written into
    layer `layer_idx` at slot `index` (`write_slots`), stored as the cache stores them: 8-bit codes (`kv_int8`)
    or `cache_dtype` values in the form `kernels` keep (`Kernels.to_slots`)."""
    if kv_int8.is_int8(stack):
        stored = kv_int8.quantize(new[None])
    else:
        stored = kernels.to_slots(new[None], cache_dtype).reshape(1, *new.shape[:2], *stack.shape[3:])
    return write_slots(stack, stored, layer_idx, index)


def read_layer(stack: Array, layer_idx, slots_read: int | None, dtype, cfg: ModelConfig, kernels: Kernels,
               cache_dtype) -> Array:
    """Layer `layer_idx`'s first `slots_read` slots (None: all) of the stacked keys or values `stack`, as ONE
    slice (fused into its readers), in `dtype` -> [B, T, K, hd]."""
    sizes = (1, stack.shape[1], slots_read or stack.shape[2], *stack.shape[3:])
    layer = jax.lax.dynamic_slice(stack, (layer_idx,) + (0,) * (stack.ndim - 1), sizes)[0]
    if kv_int8.is_int8(stack):
        return kv_int8.dequantize(layer, dtype, cfg.head_dim)
    layer = kernels.from_slots(layer, cache_dtype).astype(dtype)
    return layer.reshape(*layer.shape[:2], cfg.num_kv_heads, cfg.head_dim)
