"""Arrays placed on a mesh and brought back: parameters and batches put into their rules' shardings
(``jax.device_put``), copies that own their buffers, per-host rows made global arrays, and global arrays gathered
to the host (every process must call the gathers).

Multi-host (one process per host, all running the same program): each host loads only its rows of the prompt
batch (:func:`process_local_rows`) and turns them into global arrays with :func:`host_local_batch_to_global`;
:func:`to_host` gathers a global array to every host.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from ppojax.parallel.distributed import is_main_process
from ppojax.parallel.rules import (TRAIN_RULES, batch_leaf_sharding, batch_partition_spec, batch_sharding,
                                   batch_shardings, param_shardings, replicated)


def _put(x, sharding: NamedSharding):
    """device_put that also works across processes: a host value (identical on every process) becomes a
    global array of which each process keeps its own shards; a global array is resharded."""
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_params(params, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, *, logical_axes=None):
    """Place ``params`` on the mesh by the rules (a no-op copy for arrays already placed that way).

    Multi-host: every process passes the same host values; each keeps only its devices' shards.
    """
    shardings = param_shardings(params, mesh, rules, logical_axes=logical_axes)
    return jax.tree.map(_put, params, shardings)


def copy_arrays(tree):
    """Fresh buffers holding ``tree``'s values in the same shardings: a ``device_put`` copy per array, so no
    program is compiled per leaf shape (``jnp.copy`` would); traced values (under ``jax.eval_shape``) go
    through ``jnp.copy``."""
    concrete = lambda x: isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)  # noqa: E731
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False) if concrete(x) else jnp.copy(x),
                        tree)


def each_buffer_once(tree):
    """``tree`` with a copy in place of every array whose buffer an earlier leaf already holds (one module in
    two roles): a buffer can be donated only once."""
    seen = set()

    def once(x):
        if not isinstance(x, jax.Array):
            return x
        buffers = _buffer_key(x)
        if buffers in seen:
            return jax.device_put(x, x.sharding, may_alias=False)
        seen.add(buffers)
        return x

    return jax.tree.map(once, tree)


def _buffer_key(x: jax.Array) -> tuple:
    """What identifies ``x``'s memory: its shards' buffer addresses (two Array objects may share a buffer),
    or the object itself where a backend gives no address."""
    try:
        return tuple(shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards)
    except (RuntimeError, NotImplementedError):
        return ("array", id(x))


def shard_batch_axis(x, mesh: Mesh, axis: int, rules: Mapping[str, Any] = TRAIN_RULES):
    """Place an array whose dimension ``axis`` holds the batch rows (e.g. prompts i32[K, B, P] of
    ``train_steps``: axis 1) with those rows over ('data', 'fsdp')."""
    return _put(x, NamedSharding(mesh, batch_partition_spec(mesh, rules, axis)))


def shard_batch(tree, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """Place a GLOBAL batch (the same values on every process) with rows over ('data', 'fsdp').
    For per-host data use :func:`host_local_batch_to_global`."""
    return jax.tree.map(_put, tree, batch_shardings(tree, mesh, rules))


def put_replicated(tree, mesh: Mesh):
    """Replicate small values (PRNG keys, scalars) on every device of the mesh."""
    rep = replicated(mesh)
    return jax.tree.map(lambda x: _put(x, rep), tree)


def process_local_rows(global_batch_size: int, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """The global row indices whose data this process must load (sorted; contiguous for meshes made by
    :func:`make_mesh`). i64[global_batch_size / process_count] for a batch split over every process."""
    sharding = batch_sharding(mesh, rules)
    batch_leaf_sharding(np.empty((global_batch_size,)), mesh, rules)  # divisibility check
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch_size,)).values():
        rows.update(range(global_batch_size)[index[0]])
    return np.array(sorted(rows), dtype=np.int64)


def host_local_batch_to_global(local_batch, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """Global arrays (rows over ('data', 'fsdp')) from each process's own rows, via
    ``jax.make_array_from_process_local_data``. ``local_batch``: a pytree of host arrays holding this
    process's rows, ``global[process_local_rows(B, mesh)]``; scalars must be equal on all processes."""
    def one(x):
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.make_array_from_process_local_data(replicated(mesh), x, ())
        return jax.make_array_from_process_local_data(batch_sharding(mesh, rules), x)

    return jax.tree.map(one, local_batch)


def to_host(tree):
    """numpy copies of (possibly multi-host) global arrays, gathered on every process (all must call)."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                x = jax.random.key_data(x)
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


def to_main_host(tree):
    """``tree`` as numpy copies on the main process, gathered one array at a time (all processes must call);
    the other processes take part in each gather and drop its result (they return None). So no process but the
    main one ever holds more than one of the arrays whole, and no device holds any: what a model export needs
    (the main process writes the file)."""
    main = is_main_process()
    leaves, treedef = jax.tree.flatten(tree)
    kept = []
    for leaf in leaves:
        value = to_host(leaf)  # a collective: every process takes part
        kept.append(value if main else None)
    return jax.tree.unflatten(treedef, kept) if main else None


def addressable_bytes(tree, device=None) -> int:
    """Bytes of ``tree``'s shards held by ``device`` (default: the first local device); for memory
    accounting (e.g. FSDP: ~1/fsdp of the parameters per device)."""
    device = jax.local_devices()[0] if device is None else device
    total = 0
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            if shard.device == device:
                total += shard.data.size * shard.data.dtype.itemsize
    return total
