"""Parallelism over device meshes, JAX's own machinery throughout (``jax.sharding``, ``jax.distributed``; no
``pmap``, no hand-written collectives):

- ``mesh``: device meshes with axes ``('data', 'fsdp', 'tensor')``;
- ``rules``: logical axis names -> mesh axes (rule tables), the shardings of parameters, batches, the train state
  and the KV cache, and the layout a fused attention kernel needs;
- ``placement``: arrays put into those shardings, and global arrays brought back to the host;
- ``distributed``: multi-process start-up.

The names below are the package's API (``from ppojax import parallel``; ``parallel.make_mesh(...)``).
"""
from ppojax.parallel.mesh import (MESH_AXES, mesh_shape, make_mesh, slice_count, mesh_from_config)
from ppojax.parallel.rules import (UNNAMED, TRAIN_RULES, GENERATE_RULES, KV_CACHE_AXES, fallback_spec,
                                   logical_to_spec, param_logical_axes, logical_to_sharding, param_shardings,
                                   train_state_shardings, batch_partition_spec, batch_sharding, batch_shardings,
                                   kv_cache_shardings, attention_operand_placement, replicated, data_parallel_size)
from ppojax.parallel.placement import (shard_params, copy_arrays, each_buffer_once, shard_batch_axis, shard_batch,
                                       put_replicated, process_local_rows, host_local_batch_to_global, to_host,
                                       to_main_host, addressable_bytes)
from ppojax.parallel.distributed import (initialize_distributed, is_main_process)

__all__ = ["MESH_AXES", "mesh_shape", "make_mesh", "slice_count", "mesh_from_config", "UNNAMED", "TRAIN_RULES",
           "GENERATE_RULES", "KV_CACHE_AXES", "fallback_spec", "logical_to_spec", "param_logical_axes",
           "logical_to_sharding", "param_shardings", "train_state_shardings", "batch_partition_spec",
           "batch_sharding", "batch_shardings", "kv_cache_shardings", "attention_operand_placement", "replicated",
           "data_parallel_size", "shard_params", "copy_arrays", "each_buffer_once", "shard_batch_axis", "shard_batch",
           "put_replicated", "process_local_rows", "host_local_batch_to_global", "to_host", "to_main_host",
           "addressable_bytes", "initialize_distributed", "is_main_process"]
