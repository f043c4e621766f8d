"""Sharding by rules, not by hand: each parameter's logical axis names (``ppojax.models`` annotates every parameter:
``vocab, embed, heads, kv_heads, head_dim, mlp, layers, norm, positions``) map to mesh axes through a rule table,
and so do the batch's rows and the KV cache's axes.

:data:`TRAIN_RULES` shards weights over ``fsdp`` and ``tensor``; :data:`GENERATE_RULES` replicates over ``fsdp``
(weights gathered once for the whole decode loop instead of once per token; ``fsdp`` devices act as data parallel
there). A dimension whose size does not divide by its mesh axes is replicated instead (logged at DEBUG), so tiny
test models run on any mesh. Parameters without logical names (the toy test models, the legacy value head dict,
any plain array): the :data:`UNNAMED` rule applies, which shards the LARGEST dimension divisible by the ``fsdp``
size over ``fsdp`` (training) and replicates (generation); scalars are always replicated.

Inside ``jit`` a ``jnp.sum`` over a batch-sharded array is already the GLOBAL sum, so statistics (the whitening of
docs/algorithm.md, "Advantages") are over the global batch on any mesh: no hand-written collectives.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)


#: Rule-table key for parameters without logical axis names (see the module docstring).
UNNAMED = "<unnamed>"


#: Training: batch over (data, fsdp); weights over fsdp (embed) and tensor (heads, kv_heads, mlp, vocab).
TRAIN_RULES: Mapping[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "positions": None,
    "length": None,
    UNNAMED: "fsdp",
}


#: Generation (and the rollout forwards of the policy): weights replicated over fsdp (gathered for the
#: decode loop), still split over tensor; the batch and the KV cache split over (data, fsdp).
GENERATE_RULES: Mapping[str, Any] = {**TRAIN_RULES, "embed": None, UNNAMED: None}


#: Logical axes of the KV cache fields (``ppojax.models.KVCache``: keys/values [L, B, T, K, hd], or [L, B, T, K * hd]
#: where the kernels store a slot's key heads side by side: the first four, the merged axis split as the key heads).
KV_CACHE_AXES = {
    "keys": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "values": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "key_mask": ("batch", "length"),
    "index": (),
}


def _as_axes(rule) -> tuple:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def fallback_spec(shape: Sequence[int], mesh: Mesh, axis: Optional[str] = "fsdp") -> PartitionSpec:
    """Spec of a parameter without logical names: its largest dimension divisible by ``axis``'s size is
    split over ``axis`` (the first such if tied); replicated if none divides, or for scalars."""
    size = mesh.shape[axis] if axis is not None else 1
    if size == 1 or not shape:
        return PartitionSpec()
    candidates = [d for d in range(len(shape)) if shape[d] % size == 0]
    if not candidates:
        logger.debug("unnamed parameter %s: no dimension divisible by %s=%d; replicated", shape, axis, size)
        return PartitionSpec()
    best = max(candidates, key=lambda d: (shape[d], -d))
    return PartitionSpec(*([None] * best + [axis]))


def logical_to_spec(shape: Sequence[int], names: Optional[Sequence[Optional[str]]], mesh: Mesh,
                    rules: Mapping[str, Any] = TRAIN_RULES) -> PartitionSpec:
    """PartitionSpec of one array of ``shape`` whose axes are named ``names``.

    ``names`` None (or empty for a non-scalar): the :data:`UNNAMED` fallback. Per dimension, the rule's
    mesh axes are used when the dimension divides by their total size; otherwise the trailing mesh axes
    are dropped until it does (down to replication, logged at DEBUG). A mesh axis is used at most once
    per array (a later dimension that would reuse it is replicated); axes of size 1 are omitted.
    """
    shape = tuple(shape)
    if not names and shape:
        return fallback_spec(shape, mesh, rules.get(UNNAMED))
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match an array of shape {shape}: expected one "
                         "name (or None) per dimension.")
    used, parts = set(), []
    for dim, name in zip(shape, names):
        if name is not None and name not in rules:
            logger.debug("no sharding rule for logical axis %r; replicated", name)
        axes = [a for a in _as_axes(rules.get(name)) if mesh.shape.get(a, 1) > 1 and a not in used]
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            logger.debug("axis %r of size %d does not divide over mesh axes %s; dropping %r", name, dim,
                         axes, axes[-1])
            axes.pop()
        used.update(axes)
        parts.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def param_logical_axes(params) -> Any:
    """The logical axis names of every array in ``params``, as a tree like ``params`` with tuple leaves.

    Reads the names that ``ppojax.models`` attaches to each ``nnx.Variable`` (``out_sharding`` metadata,
    the same as ``ppojax.models.logical_axes``); arrays without names (plain dicts, un-annotated modules)
    get ``()``, which the rules treat as :data:`UNNAMED`. Works on abstract trees (``jax.eval_shape``).
    """
    nodes = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    names = []
    for node in nodes:
        found = ()
        if isinstance(node, nnx.Variable):
            meta = node.get_metadata()
            found = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding") or ()
            found = tuple(found) if _is_names(tuple(found)) else ()
        names.append(found)
    treedef = jax.tree.structure(params)
    if treedef.num_leaves != len(names):
        raise ValueError(f"params have {treedef.num_leaves} arrays but {len(names)} variables/leaves; "
                         "expected one array per nnx.Variable.")
    return jax.tree.unflatten(treedef, names)


def logical_to_sharding(logical_axes_tree, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES,
                        shapes=None) -> Any:
    """Tree of :class:`NamedSharding` from a tree of logical-axis tuples (e.g. ``ppojax.models.logical_axes``
    or :func:`param_logical_axes`), with the tree structure of the parameters.

    shapes: a tree like ``params`` (arrays or ``jax.ShapeDtypeStruct``) used for the divisibility fallback
    and for unnamed leaves; without it every named dimension is assumed divisible.
    """
    names, treedef = jax.tree.flatten(logical_axes_tree, is_leaf=_is_names)
    if shapes is None:
        specs = [logical_to_spec([0] * len(n), n, mesh, rules) for n in names]  # 0 divides by anything
    else:
        shape_leaves = [np.shape(x) if not hasattr(x, "shape") else tuple(x.shape)
                        for x in jax.tree.leaves(shapes)]
        if len(shape_leaves) != len(names):
            raise ValueError(f"{len(names)} logical-axis entries but {len(shape_leaves)} arrays in `shapes`.")
        specs = [logical_to_spec(s, n, mesh, rules) for s, n in zip(shape_leaves, names)]
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def param_shardings(params, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, *, logical_axes=None):
    """NamedSharding of every array in ``params`` (arrays or abstract), same tree structure.

    logical_axes: a tree of name tuples like ``params`` (default: read from the nnx Variables).
    """
    if logical_axes is None:
        logical_axes = param_logical_axes(params)
    return logical_to_sharding(logical_axes, mesh, rules, shapes=params)


def train_state_shardings(state, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, *, logical_axes=None):
    """Shardings of a ``ppojax.rl.types.TrainState`` (concrete or from ``jax.eval_shape``).

    params and the frozen models: by the rules. opt_state: every subtree with the structure of ``params``
    (Adam's ``mu``, ``nu``, any optax state that mirrors the parameters) takes the parameters' shardings;
    other leaves (step counts, scalars) are replicated, or use the :data:`UNNAMED` fallback if they are
    arrays. The KL coefficient, score moments and counters: replicated. An asynchronous run's ``in_flight``
    batches [k, B, ...]: rows over the batch axes, as the batches they were sampled from.
    """
    params_sh = param_shardings(state.params, mesh, rules, logical_axes=logical_axes)
    params_def = jax.tree.structure(state.params)
    rep = replicated(mesh)

    def mirrors_params(node):
        return jax.tree.structure(node) == params_def

    def opt_leaf(node):
        if mirrors_params(node):
            return params_sh
        shape = tuple(np.shape(node))
        return rep if not shape else NamedSharding(mesh, fallback_spec(shape, mesh, rules.get(UNNAMED)))

    opt_sh = jax.tree.map(opt_leaf, state.opt_state, is_leaf=mirrors_params)
    frozen_sh = None if state.frozen is None else param_shardings(state.frozen, mesh, rules)
    return state.replace(params=params_sh, opt_state=opt_sh, frozen=frozen_sh,
                         kl_coef=rep, hyperparams=jax.tree.map(lambda _: rep, state.hyperparams),
                         score_moments=jax.tree.map(lambda _: rep, state.score_moments),
                         update_count=rep, optimizer_steps=rep, nonfinite_streak=rep, nonfinite_total=rep,
                         episode=rep,
                         in_flight=None if state.in_flight is None else jax.tree.map(
                             lambda _: NamedSharding(mesh, batch_partition_spec(mesh, rules, axis=1)), state.in_flight))


def batch_partition_spec(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, axis: int = 0) -> PartitionSpec:
    """Rows (dimension ``axis``) over the ``batch`` rule's mesh axes, ('data', 'fsdp'); the rest unsplit."""
    axes = _as_axes(rules.get("batch"))
    return PartitionSpec(*([None] * axis), axes) if axes else PartitionSpec()


def batch_sharding(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES) -> NamedSharding:
    """Rows (leading axis) over the ``batch`` rule's mesh axes, ('data', 'fsdp'); the rest replicated."""
    return NamedSharding(mesh, batch_partition_spec(mesh, rules))


def batch_leaf_sharding(x, mesh, rules):
    shape = np.shape(x)
    if not shape:
        return replicated(mesh)
    n = data_parallel_size(mesh, rules)
    if shape[0] % n:
        raise ValueError(f"a batch array of shape {tuple(shape)} has {shape[0]} rows, which do not split over "
                         f"{n} data-parallel devices (mesh {dict(mesh.shape)}); make the batch (and every "
                         f"micro-batch) a multiple of {n}.")
    return batch_sharding(mesh, rules)


def batch_shardings(tree, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """Tree of shardings for a batch pytree (e.g. ``rollout.Experience``): leading axis split, scalars
    replicated; a clear error when the rows do not divide by the data-parallel size."""
    return jax.tree.map(lambda x: batch_leaf_sharding(x, mesh, rules), tree)


def kv_cache_shardings(cache, mesh: Mesh, rules: Mapping[str, Any] = GENERATE_RULES):
    """Shardings of a ``ppojax.models.KVCache`` (concrete or abstract): batch over (data, fsdp), kv heads
    over tensor (replicated where they do not divide), layers / length / head_dim unsplit."""
    fields = {}
    for name, axes in KV_CACHE_AXES.items():  # a cache stored [L, B, T, K * hd] (`Kernels.slot_shape`): 4 axes
        shape = np.shape(getattr(cache, name))
        fields[name] = NamedSharding(mesh, logical_to_spec(shape, axes[:len(shape)], mesh, rules))
    return cache.replace(**fields)  # the static fields (``value_dtype``) as the cache's


def attention_operand_placement(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """``place(q, k, v, mask) -> (q, k, v, mask)`` for a fused attention kernel on ``mesh``
    (``ppojax.backends.gpu.kernels``): q [B, S, H, hd], k and v [B, T, K, hd] constrained to ONE spec, rows over
    the ``batch`` rule's axes and heads over the ``heads`` rule's where both H and K divide (cuDNN's partitioner
    takes nothing else; the specs of ``attention_specs``, which TPUs' splash kernel runs per shard on); mask
    bool[B, S, T] by the same rows."""

    def place(q, k, v, mask):
        qkv_spec, rows_spec = attention_specs(mesh, q.shape[0], q.shape[2], k.shape[2], rules)
        q, k, v = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, qkv_spec)) for x in (q, k, v))
        return q, k, v, jax.lax.with_sharding_constraint(mask, NamedSharding(mesh, rows_spec))

    return place


def attention_specs(mesh: Mesh, rows: int, heads: int, kv_heads: int,
                    rules: Mapping[str, Any] = TRAIN_RULES) -> tuple[PartitionSpec, PartitionSpec]:
    """(q/k/v, segments) specs for a full forward's attention kernel run per shard
    (``ppojax.backends.tpu.kernels``): q [B, S, H, hd] and k, v [B, S, K, hd] rows over the ``batch`` rule's axes
    and heads over the ``heads`` rule's where both H and K divide (each shard keeps whole groups of query heads
    with their key head); segments [B, S] by rows."""
    row_spec = logical_to_spec((rows,), ("batch",), mesh, rules)
    row_axes = row_spec[0] if len(row_spec) else None
    head_spec = logical_to_spec((heads,), ("heads",), mesh, rules)
    kv_spec = logical_to_spec((kv_heads,), ("heads",), mesh, rules)
    head_axes = head_spec[0] if len(head_spec) and head_spec == kv_spec else None
    return PartitionSpec(row_axes, None, head_axes, None), PartitionSpec(row_axes)


def cache_attention_specs(mesh: Mesh, rows: int, heads: int, kv_heads: int,
                          rules: Mapping[str, Any] = GENERATE_RULES) -> tuple[PartitionSpec, ...]:
    """(q, cache, mask) specs for a decode-attention kernel run per shard (``ppojax.backends.tpu.kernels``), as
    the KV cache is laid out (``kv_cache_shardings``): q [B, H, hd] rows over the ``batch`` rule's axes and heads
    over the ``kv_heads`` rule's where both H and K divide (each shard keeps whole groups of query heads with
    their key head); the cache [L, B, T, K, hd] (or [L, B, T, K * hd]) alike; the mask [B, T] by rows."""
    row_spec = logical_to_spec((rows,), ("batch",), mesh, rules)
    row_axes = row_spec[0] if len(row_spec) else None
    head_spec = logical_to_spec((heads,), ("kv_heads",), mesh, rules)
    kv_spec = logical_to_spec((kv_heads,), ("kv_heads",), mesh, rules)
    head_axes = head_spec[0] if len(head_spec) and head_spec == kv_spec else None
    return (PartitionSpec(row_axes, head_axes), PartitionSpec(None, row_axes, None, head_axes),
            PartitionSpec(row_axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES) -> int:
    """How many ways the batch is split (the product of the ``batch`` rule's mesh axes)."""
    return math.prod(mesh.shape[a] for a in _as_axes(rules.get("batch")))
