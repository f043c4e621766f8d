"""A sampler's decode in progress parked in the train state between updates (in-flight weight updates,
``ppojax.rl.in_flight_updates``): every leaf rows-first, the layout of every batch in flight, so the state's
shardings, checkpoints, ``scan`` and ``vmap`` treat it as they treat those.

    parked        = park(carry, ("step",), queries, rows, key)     # the sampler's carry: Decoding or Slots
    carry, key    = unpark(parked, ("step",), empty_cache)

The carry's KV cache ([L, N, T, ...] keys and values) is stored as ``ParkedCache`` ([N, L, T, ...]: one transpose each
way); its scalar fields (named by the caller) are repeated on each of its N cache rows; the key on every batch row.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class ParkedCache:
    """A KVCache of N rows, rows first: keys, values [N, L, T, K, hd]; key_mask bool[N, T]; index i32[N] (each row's
    write index; a cache with one index for all rows has it repeated)."""

    keys: jax.Array
    values: jax.Array
    key_mask: jax.Array
    index: jax.Array

    @classmethod
    def of(cls, cache) -> "ParkedCache":
        rows = cache.key_mask.shape[0]
        return cls(keys=jnp.moveaxis(cache.keys, 1, 0), values=jnp.moveaxis(cache.values, 1, 0),
                   key_mask=cache.key_mask, index=jnp.broadcast_to(cache.index, (rows,)))

    def into(self, empty):
        """This cache's contents in ``empty`` (a cache of N rows as the sampler makes it: its storage form, its
        placement and whether it has one write index or one per row)."""
        index = self.index if jnp.ndim(empty.index) else self.index[0]
        return empty.replace(keys=jnp.moveaxis(self.keys, 0, 1).astype(empty.keys.dtype),
                             values=jnp.moveaxis(self.values, 0, 1).astype(empty.values.dtype),
                             key_mask=self.key_mask, index=index)


@struct.dataclass
class Parked:
    """A batch of B rows whose decode is under way: queries i32[B, P] each row's prompt (repeated over its group);
    rows i32[B] each row's dataset row; key_data u32[B, ...] the decode's key (``jax.random.key_data``) on every row;
    state: the sampler's carry with its cache a :class:`ParkedCache` and its scalars repeated per cache row."""

    queries: jax.Array
    rows: jax.Array
    key_data: jax.Array
    state: object


def park(carry, scalars: tuple[str, ...], queries, rows, key) -> Parked:
    """``carry`` (a sampler's loop state with a ``cache`` field) rows-first; ``scalars``: its i32[] fields."""
    cache_rows = carry.cache.key_mask.shape[0]
    data = jax.random.key_data(key)
    state = carry.replace(cache=ParkedCache.of(carry.cache),
                          **{name: jnp.broadcast_to(getattr(carry, name), (cache_rows,)) for name in scalars})
    return Parked(queries=queries, rows=rows, key_data=jnp.broadcast_to(data, (queries.shape[0],) + data.shape),
                  state=state)


def unpark(parked: Parked, scalars: tuple[str, ...], empty_cache):
    """The carry parked in ``parked``, its cache written into ``empty_cache`` -> (carry, its key)."""
    state = parked.state
    carry = state.replace(cache=state.cache.into(empty_cache),
                          **{name: getattr(state, name)[0] for name in scalars})
    return carry, jax.random.wrap_key_data(parked.key_data[0])
