"""Device meshes with axes ``('data', 'fsdp', 'tensor')`` (all ``AxisType.Auto``: the compiler propagates shardings).

    ``data``   pure data parallelism: the batch is split, parameters are replicated.
    ``fsdp``   ZeRO-3-like: the batch is split AND parameters / optimizer state are split (over their
               ``embed`` axis); XLA all-gathers a weight where it is used and reduce-scatters its gradient.
    ``tensor`` Megatron-like: heads / MLP / vocabulary axes of the weights are split; activations follow.

Devices of several TPU slices (multi-slice): ``data`` spans the slices, ``fsdp`` and ``tensor`` stay within one.
"""
from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

logger = logging.getLogger(__name__)


MESH_AXES = ("data", "fsdp", "tensor")


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

    grid = mesh_utils.create_hybrid_device_mesh((shape[0] // slices, shape[1], shape[2]), (slices, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _mesh_across_torus_sides(shape, devices) -> Mesh:
    """A TPU slice whose torus sides do not multiply into each mesh axis (tensor=8 on a 4x4x4 v5p): an axis then
    spans parts of two sides (JAX's ``allow_split_physical_axes``), its ring no longer the torus' own."""

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
