"""Backend-specific code behind one seam: the choices a run makes ONCE, when it is built.

- `kernels_for(modules, ...)`: the models' `Kernels` (`ppojax.models.kernels`): XLA's on TPU and GPU (and on the
  CPU with ppojax's CPU backend off, `PPOJAX_CPU_BACKEND=0`); the CPU's (`cpu.kernels.CpuKernels`) on CPU devices.
  Building the C++ handlers and measuring GEMM libraries happen here, never while a program is traced.
- `use_kernels(kernels, *modules)`: set them on every backbone of the models.
- `optimizer_step_for(...)`: AdamW's step implementation (`ppojax.rl.optimizer`): optax's, or the CPU's one pass
  over each parameter (`cpu.adam_in_place.InPlaceAdamStep`) on a single CPU device.

The models, the RL programs and the math import nothing from here: a new backend adds a package beside `cpu/` and
a branch in these functions.
"""
from __future__ import annotations

from typing import Iterable, Sequence

# jax, flax and the models are imported where they are used: `ppojax.backends.cpu`'s start-up modules (the
# capability probe, the XLA options, the allocator re-exec) run before jax may be imported


def _cpu_backend_on(devices: Sequence) -> bool:
    """Whether ppojax's CPU backend serves these devices: CPU devices and the backend not switched off."""
    from ppojax.backends.cpu import capabilities

    return bool(devices) and devices[0].platform == "cpu" and not capabilities.backend_off()


def _backbones(modules: Iterable) -> list:
    from flax import nnx

    from ppojax.models import Backbone

    found = []
    for module in modules:
        if isinstance(module, nnx.Module):
            found += [sub for _, sub in nnx.iter_modules(module) if isinstance(sub, Backbone)]
    return found


def model_shapes(modules: Iterable) -> tuple:
    """The shapes the models multiply by, in groups: per backbone the (d_in, d_out) of each of a layer's
    projection kernels (repeats kept: their sum is a layer's size), and per LM head its weight's shape; from
    arrays or abstract shapes."""
    from flax import nnx

    from ppojax.backends.cpu.kernels import projection_shapes

    groups = []
    for module in modules:
        if not isinstance(module, nnx.Module):
            continue
        for backbone in _backbones([module]):
            groups.append(tuple(projection_shapes(nnx.to_pure_dict(nnx.state(backbone.layers)))))
        head = getattr(module, "lm_head", False)
        if head is None:  # tied: the embedding [V, D], read transposed
            groups.append((tuple(module.backbone.embed["embedding"].shape),))
        elif head:
            groups.append((tuple(head["kernel"].shape),))
    return tuple(tuple(tuple(int(n) for n in shape) for shape in group) for group in groups if group)


def kernels_for(modules: Iterable, *, matmul_implementation: str = "auto", devices: Sequence | None = None):
    """The `Kernels` for `modules` (ppojax models, arrays or abstract) run on `devices` (default: all of jax's).
    matmul_implementation: the config's ("auto", "xla", or a GEMM library's name; only the CPU's kernels read it).
    Raises `ValueError` naming why where a library named explicitly cannot run here."""
    import jax

    from ppojax.models.kernels import XLA

    devices = list(jax.devices() if devices is None else devices)
    if not _cpu_backend_on(devices):
        return XLA
    from ppojax.backends.cpu.kernels import CpuKernels

    return CpuKernels.for_shapes(matmul_implementation, model_shapes(modules), len(devices))


def use_kernels(kernels, *modules) -> None:
    """Set `kernels` on every backbone of `modules` (a static attribute: the weights are untouched)."""
    for backbone in _backbones(modules):
        backbone.kernels = kernels


def optimizer_step_for(implementation: str = "auto", devices: Sequence | None = None):
    """AdamW's step implementation on `devices` (`ppojax.rl.optimizer.AdamW.step`): the CPU's one pass ("auto" on a
    single CPU device where its handler is built), else None: optax's ("optax", or anywhere else)."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    if implementation != "auto" or len(devices) != 1 or not _cpu_backend_on(devices):
        return None
    from ppojax.backends.cpu import adam_in_place

    return None if adam_in_place.unavailable_reason() else adam_in_place.InPlaceAdamStep()
