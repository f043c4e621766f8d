"""Sharding by rules, not by hand (DESIGN principle 4): meshes, logical-axis rules, shardings, multi-host.

Everything here is JAX's own machinery: a :class:`jax.sharding.Mesh` with axes ``('data', 'fsdp',
'tensor')`` (all ``AxisType.Auto``: the compiler propagates shardings), :class:`NamedSharding` /
:class:`PartitionSpec` placed on the inputs with ``jax.device_put`` and on the outputs with ``jax.jit``'s
``out_shardings``, and ``jax.distributed`` for multi-host runs. No ``pmap``, no hand-written collectives:
inside ``jit`` a ``jnp.sum`` over a batch-sharded array is already the GLOBAL sum (so the whitening
statistics of docs/algorithm.md, "Advantages", are over the global batch on any mesh).

Mesh axes
    ``data``   pure data parallelism: the batch is split, parameters are replicated.
    ``fsdp``   ZeRO-3-like: the batch is split AND parameters / optimizer state are split (over their
               ``embed`` axis); XLA all-gathers a weight where it is used and reduce-scatters its gradient.
    ``tensor`` Megatron-like: heads / MLP / vocabulary axes of the weights are split; activations follow.

Rule tables map each parameter's logical axis names (``ppojax.models`` annotates every parameter:
``vocab, embed, heads, kv_heads, head_dim, mlp, layers, norm, positions``) to mesh axes.
:data:`TRAIN_RULES` shards weights over ``fsdp`` and ``tensor``; :data:`GENERATE_RULES` replicates over
``fsdp`` (weights gathered once for the whole decode loop instead of once per token; ``fsdp`` devices act
as data parallel there). A dimension whose size does not divide by its mesh axes is replicated instead
(logged at DEBUG), so tiny test models run on any mesh.

Parameters without logical names (the toy test models, the legacy value head dict, any plain array):
the :data:`UNNAMED` rule applies, which shards the LARGEST dimension divisible by the ``fsdp`` size over
``fsdp`` (training) and replicates (generation); scalars are always replicated.

Multi-host (one process per host, all running the same program): :func:`initialize_distributed` first,
then build the mesh over ``jax.devices()`` (all hosts' devices); each host loads only its rows of the
prompt batch (:func:`process_local_rows`) and turns them into global arrays with
:func:`host_local_batch_to_global`; only :func:`is_main_process` writes logs and exports;
:func:`to_host` gathers a global array to every host (all processes must call it).
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import math
import os
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
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

#: Logical axes of the KV cache fields (``ppojax.models.KVCache``: keys/values [L, B, T, K, hd]).
KV_CACHE_AXES = {
    "keys": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "values": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "key_mask": ("batch", "length"),
    "index": (),
}


# --------------------------------------------------------------------------------------------------
# Mesh
# --------------------------------------------------------------------------------------------------
def mesh_shape(data: int = -1, fsdp: int = 1, tensor: int = 1, num_devices: Optional[int] = None):
    """Resolve ``-1`` (the devices left over) and check the product. -> (data, fsdp, tensor)."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    sizes = [data, fsdp, tensor]
    if any(not isinstance(s, (int, np.integer)) or (s < 1 and s != -1) for s in sizes) or sizes.count(-1) > 1:
        raise ValueError(f"mesh sizes (data={data}, fsdp={fsdp}, tensor={tensor}) must be ints >= 1 with at "
                         "most one -1 (the devices left over).")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"mesh (data={data}, fsdp={fsdp}, tensor={tensor}): {num_devices} devices do not "
                             f"split into a multiple of {known}; pick sizes whose product divides "
                             f"{num_devices}.")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(f"mesh (data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]}) has "
                         f"{math.prod(sizes)} devices but {num_devices} are in use; make "
                         f"data * fsdp * tensor == {num_devices} (or set one of them to -1).")
    return tuple(int(s) for s in sizes)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A ``('data', 'fsdp', 'tensor')`` mesh over ``devices`` (default: all devices of all processes).

    Sizes: ``-1`` = the devices left over (at most one). ``jax.make_mesh`` orders the devices for the
    interconnect (e.g. TPU rings); the axes are ``AxisType.Auto`` (shardings placed on inputs propagate).
    Devices of several TPU slices (multi-slice): ``data`` spans the slices (their data-center network carries
    only the gradients' reduction), ``fsdp`` and ``tensor`` stay within a slice; ``data`` must be a multiple of
    the slice count.
    Example: ``make_mesh(data=2, fsdp=4)`` on 8 devices; ``make_mesh(devices=jax.devices()[:1])``.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices))
    slices = slice_count(devices)
    if slices == 1:
        try:
            return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)
        except NotImplementedError:
            return _mesh_across_torus_sides(shape, devices)
    if shape[0] % slices:
        raise ValueError(f"mesh (data={shape[0]}, fsdp={shape[1]}, tensor={shape[2]}) over {slices} TPU slices: "
                         f"data spans the slices, so it must be a multiple of {slices}; e.g. data={slices}.")
    from jax.experimental import mesh_utils

    grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, shape[1], shape[2]), (slices, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _mesh_across_torus_sides(shape, devices) -> Mesh:
    """A TPU slice whose torus sides do not multiply into each mesh axis (tensor=8 on a 4x4x4 v5p): an axis then
    spans parts of two sides (JAX's ``allow_split_physical_axes``), its ring no longer the torus' own."""
    from jax.experimental import mesh_utils

    logger.warning("mesh (data=%d, fsdp=%d, tensor=%d): an axis is not a product of the TPU slice's torus sides; "
                   "it spans parts of two sides, so its collectives cross more links than on a torus-aligned mesh",
                   *shape)
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def slice_count(devices: Sequence) -> int:
    """How many TPU slices ``devices`` span (1 for every other device)."""
    return len({getattr(d, "slice_index", 0) or 0 for d in devices})


def mesh_from_config(config, devices: Optional[Sequence] = None) -> Mesh:
    """:func:`make_mesh` from a ``PPOConfig`` (``mesh_data``, ``mesh_fsdp``, ``mesh_tensor``)."""
    return make_mesh(config.mesh_data, config.mesh_fsdp, config.mesh_tensor, devices=devices)


def data_parallel_size(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES) -> int:
    """How many ways the batch is split (the product of the ``batch`` rule's mesh axes)."""
    return math.prod(mesh.shape[a] for a in _as_axes(rules.get("batch")))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


# --------------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec
# --------------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------------
# Train state
# --------------------------------------------------------------------------------------------------
def train_state_shardings(state, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, *, logical_axes=None):
    """Shardings of a ``ppojax.rl.types.TrainState`` (concrete or from ``jax.eval_shape``).

    params and the frozen models: by the rules. opt_state: every subtree with the structure of ``params``
    (Adam's ``mu``, ``nu``, any optax state that mirrors the parameters) takes the parameters' shardings;
    other leaves (step counts, scalars) are replicated, or use the :data:`UNNAMED` fallback if they are
    arrays. The KL coefficient, score moments and counters: replicated.
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
                         episode=rep)


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


# --------------------------------------------------------------------------------------------------
# Batches and the KV cache
# --------------------------------------------------------------------------------------------------
def batch_partition_spec(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES, axis: int = 0) -> PartitionSpec:
    """Rows (dimension ``axis``) over the ``batch`` rule's mesh axes, ('data', 'fsdp'); the rest unsplit."""
    axes = _as_axes(rules.get("batch"))
    return PartitionSpec(*([None] * axis), axes) if axes else PartitionSpec()


def batch_sharding(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES) -> NamedSharding:
    """Rows (leading axis) over the ``batch`` rule's mesh axes, ('data', 'fsdp'); the rest replicated."""
    return NamedSharding(mesh, batch_partition_spec(mesh, rules))


def shard_batch_axis(x, mesh: Mesh, axis: int, rules: Mapping[str, Any] = TRAIN_RULES):
    """Place an array whose dimension ``axis`` holds the batch rows (e.g. prompts i32[K, B, P] of
    ``train_steps``: axis 1) with those rows over ('data', 'fsdp')."""
    return _put(x, NamedSharding(mesh, batch_partition_spec(mesh, rules, axis)))


def _batch_leaf_sharding(x, mesh, rules):
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
    return jax.tree.map(lambda x: _batch_leaf_sharding(x, mesh, rules), tree)


def shard_batch(tree, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """Place a GLOBAL batch (the same values on every process) with rows over ('data', 'fsdp').
    For per-host data use :func:`host_local_batch_to_global`."""
    return jax.tree.map(_put, tree, batch_shardings(tree, mesh, rules))


def put_replicated(tree, mesh: Mesh):
    """Replicate small values (PRNG keys, scalars) on every device of the mesh."""
    rep = replicated(mesh)
    return jax.tree.map(lambda x: _put(x, rep), tree)


def kv_cache_shardings(cache, mesh: Mesh, rules: Mapping[str, Any] = GENERATE_RULES):
    """Shardings of a ``ppojax.models.KVCache`` (concrete or abstract): batch over (data, fsdp), kv heads
    over tensor (replicated where they do not divide), layers / length / head_dim unsplit."""
    fields = {name: NamedSharding(mesh, logical_to_spec(np.shape(getattr(cache, name)), axes, mesh, rules))
              for name, axes in KV_CACHE_AXES.items()}
    return cache.replace(**fields)  # the static fields (``value_dtype``) as the cache's


def attention_operand_placement(mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """``place(q, k, v, mask) -> (q, k, v, mask)`` for a fused attention kernel on ``mesh``
    (``ppojax.backends.gpu.kernels``): q [B, S, H, hd], k and v [B, T, K, hd] constrained to ONE spec, rows over
    the ``batch`` rule's axes and heads over the ``heads`` rule's where both H and K divide (cuDNN's partitioner
    takes nothing else); mask bool[B, S, T] by
    the same rows."""

    def axes(size, name):  # the mesh axes one dimension of `size` named `name` is split over (None: unsplit)
        spec = logical_to_spec((size,), (name,), mesh, rules)
        return spec[0] if len(spec) else None

    def place(q, k, v, mask):
        rows = axes(q.shape[0], "batch")
        heads = axes(q.shape[2], "heads")
        heads = heads if heads == axes(k.shape[2], "heads") else None
        operands = NamedSharding(mesh, PartitionSpec(rows, None, heads, None))
        q, k, v = (jax.lax.with_sharding_constraint(x, operands) for x in (q, k, v))
        return q, k, v, jax.lax.with_sharding_constraint(mask, NamedSharding(mesh, PartitionSpec(rows)))

    return place


# --------------------------------------------------------------------------------------------------
# Multi-host
# --------------------------------------------------------------------------------------------------
def _cluster_env() -> Optional[str]:
    """A launcher JAX's ``jax.distributed.initialize()`` can auto-detect, when it runs several processes."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                              "SLURM_LOCALID")) and env["SLURM_NTASKS"].isdigit() and int(env["SLURM_NTASKS"]) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "open-mpi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    # a Cloud TPU VM (libtpu installed, TPU chips attached): JAX finds the pod slice's workers itself
    if importlib.util.find_spec("libtpu") is not None and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return "cloud-tpu"
    return None


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, *, auto: Optional[bool] = None,
                           **kwargs) -> bool:
    """Start JAX's multi-controller runtime (``jax.distributed.initialize``) when this is a multi-process
    run; call it first thing, before any other JAX call. Returns True when running distributed.

    Sources, in order: the arguments; ``PPOJAX_COORDINATOR`` (host:port of process 0),
    ``PPOJAX_NUM_PROCESSES``, ``PPOJAX_PROCESS_ID``; then ``jax.distributed.initialize()`` with no
    arguments, so that JAX detects the cluster itself, when one is seen (a Cloud TPU VM: libtpu + TPU
    chips; GKE TPU / multislice variables; SLURM with more than one task; Open MPI;
    ``JAX_COORDINATOR_ADDRESS``) or when ``auto=True`` / ``PPOJAX_DISTRIBUTED=1``; ``auto=False`` /
    ``PPOJAX_DISTRIBUTED=0`` turns the detection off. With none of these: single process, nothing to do
    (returns False). Extra keyword arguments go to ``jax.distributed.initialize`` (e.g.
    ``local_device_ids``, ``initialization_timeout``).
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    coordinator_address = coordinator_address or env.get("PPOJAX_COORDINATOR") or None

    def as_int(value, name):
        if value is None or value == "":
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r}; expected an integer.") from None

    num_processes = as_int(num_processes if num_processes is not None else env.get("PPOJAX_NUM_PROCESSES"),
                           "num_processes (PPOJAX_NUM_PROCESSES)")
    process_id = as_int(process_id if process_id is not None else env.get("PPOJAX_PROCESS_ID"),
                        "process_id (PPOJAX_PROCESS_ID)")
    if auto is None and env.get("PPOJAX_DISTRIBUTED"):
        auto = env["PPOJAX_DISTRIBUTED"].lower() not in ("0", "false", "no", "")
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None
    if explicit:
        if num_processes == 1 and coordinator_address is None:
            return False
        missing = [name for name, value in (("coordinator_address (PPOJAX_COORDINATOR)", coordinator_address),
                                            ("num_processes (PPOJAX_NUM_PROCESSES)", num_processes),
                                            ("process_id (PPOJAX_PROCESS_ID)", process_id)) if value is None]
        if missing and _cluster_env() is None and not auto:
            raise ValueError(f"multi-process run is missing {', '.join(missing)}: give all three of "
                             "coordinator_address, num_processes and process_id (or their PPOJAX_* "
                             "environment variables), or run under a launcher JAX detects.")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} with num_processes={num_processes}; expected "
                             f"0 <= process_id < num_processes.")
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    elif auto or (auto is None and _cluster_env() is not None):
        logger.info("initializing jax.distributed from the environment (%s)", _cluster_env() or "auto")
        jax.distributed.initialize(**kwargs)
    else:
        return False
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def is_main_process() -> bool:
    """True on process 0: the one that writes logs, sample tables and exports."""
    return jax.process_index() == 0


def process_local_rows(global_batch_size: int, mesh: Mesh, rules: Mapping[str, Any] = TRAIN_RULES):
    """The global row indices whose data this process must load (sorted; contiguous for meshes made by
    :func:`make_mesh`). i64[global_batch_size / process_count] for a batch split over every process."""
    sharding = batch_sharding(mesh, rules)
    _batch_leaf_sharding(np.empty((global_batch_size,)), mesh, rules)  # divisibility check
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
    from jax.experimental import multihost_utils  # noqa: PLC0415

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
