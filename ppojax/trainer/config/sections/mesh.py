"""The mesh section: the device mesh's axis sizes (checked against the devices when the trainer is built)."""
from __future__ import annotations

from dataclasses import dataclass

from ppojax.trainer.config.fields import MAY_CHANGE, Rule, setting


@dataclass
class MeshSettings:
    """The device mesh: data-parallel, fully-sharded and tensor-parallel axes."""

    mesh_data: int = setting(-1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Data-parallel mesh axis size; -1 takes the devices left over (at most one axis may be -1)."""
    mesh_fsdp: int = setting(1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Fully-sharded (parameters and optimizer state) mesh axis size; -1: the devices left over."""
    mesh_tensor: int = setting(1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Tensor-parallel mesh axis size; -1: the devices left over."""
