"""Backend-specific code behind one door: every choice a run or plan makes about its backend, made ONCE when it
is built and handed to the programs as data (nothing below the trainer tests the platform while tracing).

- `kernels_for(modules, ...)`: the models' `Kernels` (`ppojax.models.kernels`), attention included: NVIDIA GPUs'
  (`gpu.kernels.GpuKernels`: cuDNN's fused attention where it fits, laid out for the run's mesh); TPUs'
  (`tpu.kernels.TpuKernels`: a Pallas decode-attention kernel reading the KV cache where it lies); the CPU's
  (`cpu.kernels.CpuKernels`) on CPU devices with ppojax's CPU backend on; XLA's everywhere else (the CPU with
  `PPOJAX_CPU_BACKEND=0`, and wherever attention_implementation is 'xla'). Building C++ handlers and measuring
  GEMM libraries happen here, never while a program is traced.
- `use_kernels(kernels, *modules)`: set them on every backbone of the models.
- `optimizer_step_for(...)`: AdamW's step implementation (`ppojax.rl.optimizer`): optax's, or the CPU's one pass
  over each parameter (`cpu.adam_in_place.InPlaceAdamStep`) on a single CPU device.
- `matmul_unavailable_reason(...)`: why a GEMM library named in the config cannot run here (checked before any
  weight loads).
- A program's start, before JAX starts its backend: `prepare_process` (the platform where libtpu is installed on a
  host without TPU chips; the CPU's allocator), `prepare_compiler` (XLA:CPU's options for this CPU), or both:
  `start_program`. `import ppojax` already keeps JAX off an installed libtpu on a host without TPU chips.

The models, the RL programs and the math import nothing from here: a new backend adds a package beside `cpu/` and
`gpu/` and a branch in these functions.
"""
from __future__ import annotations

from typing import Iterable, Sequence

# The start-up modules (the platform choice, the capability probe, the XLA options, the allocator re-exec) run
# before jax may be imported: jax, flax and the models are imported where the choices are made.
from ppojax.backends.cpu import xla_options as _xla_cpu_options
from ppojax.backends.cpu.absent_tpu import skip_absent_tpu
from ppojax.backends.cpu.capabilities import backend_off as _cpu_backend_off
from ppojax.backends.cpu.host_memory import reexec_with_huge_pages

__all__ = ["kernels_for", "use_kernels", "optimizer_step_for", "matmul_unavailable_reason", "model_shapes",
           "prepare_process", "prepare_compiler", "start_program", "skip_absent_tpu"]


def prepare_process() -> None:
    """What a ppojax program does first, before JAX starts (and before anything a re-executed process would lose):
    name the CPU as JAX's platform where libtpu is installed on a host without accelerators (`skip_absent_tpu`),
    then re-execute once with mimalloc preloaded and glibc's huge-page tunable on a CPU host (XLA:CPU's per-step
    buffers are reused from one step to the next instead of faulted in afresh)."""
    skip_absent_tpu()  # first: the re-executed process inherits it
    reexec_with_huge_pages()


def prepare_compiler(precision: str = "float32") -> None:
    """Add the XLA:CPU options recorded as fastest for this CPU and the run's `precision` (XLA reads `XLA_FLAGS`
    once, when its backend starts; a no-op on accelerator hosts)."""
    _xla_cpu_options.apply(precision=precision)


def start_program(precision: str = "float32") -> None:
    """`prepare_process` then `prepare_compiler`, for a program that knows its precision at once (the benchmarks);
    from Python (a notebook) call it before the first JAX operation."""
    prepare_process()
    prepare_compiler(precision)


def _cpu_backend_on(devices: Sequence) -> bool:
    """Whether ppojax's CPU backend serves these devices: CPU devices and the backend not switched off."""
    return bool(devices) and devices[0].platform == "cpu" and not _cpu_backend_off()


def _backbones(modules: Iterable) -> list:
    from flax import nnx  # noqa: PLC0415 - JAX after XLA's options (above)

    from ppojax.models import Backbone  # noqa: PLC0415 - JAX after XLA's options (above)

    found = []
    for module in modules:
        if isinstance(module, nnx.Module):
            found += [sub for _, sub in nnx.iter_modules(module) if isinstance(sub, Backbone)]
    return found


def model_shapes(modules: Iterable) -> tuple:
    """The shapes the models multiply by, in groups: per backbone the (d_in, d_out) of each of a layer's
    projection kernels (repeats kept: their sum is a layer's size), and per LM head its weight's shape; from
    arrays or abstract shapes."""
    from flax import nnx  # noqa: PLC0415 - JAX after XLA's options (above)

    from ppojax.backends.cpu.kernels import projection_shapes  # noqa: PLC0415 - JAX after XLA's options (above)

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


def kernels_for(modules: Iterable, *, matmul_implementation: str = "auto", attention_implementation: str = "auto",
                devices: Sequence | None = None, mesh=None, cpu_backend: bool = True,
                long_packed_rows: bool = False):
    """The `Kernels` for `modules` (ppojax models, arrays or abstract) run on `devices` (default: the mesh's, else
    all of jax's; compile-only devices of another machine too).

    matmul_implementation: the config's ("auto", "xla", or a GEMM library's name; only the CPU's kernels read it);
    attention_implementation: "auto", "xla", "cudnn" or "pallas" (`ppojax.models.attention.ATTENTION_IMPLEMENTATIONS`);
    mesh: the run's device mesh (fused attention lays its operands out for it); cpu_backend: False keeps XLA's
    kernels on CPU devices (a plan whose virtual CPU devices stand in for accelerators); long_packed_rows: the
    forwards pack rows longer than a padded row (`packed_row_length`), where TPUs' attention skips the blocks of
    other sequences.
    Raises `ValueError` naming why where an implementation named explicitly cannot run here."""
    import jax  # noqa: PLC0415 - JAX after XLA's options (above)

    from ppojax.backends.gpu.kernels import GpuKernels, check_cudnn_fits, compute_capability  # noqa: PLC0415 - JAX after XLA's options (above)
    from ppojax.models.attention import ATTENTION_IMPLEMENTATIONS  # noqa: PLC0415 - JAX after XLA's options (above)
    from ppojax.models.kernels import XLA  # noqa: PLC0415 - JAX after XLA's options (above)

    if attention_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attention_implementation={attention_implementation!r} is not one of "
                         f"{ATTENTION_IMPLEMENTATIONS}; use 'auto' to let ppojax pick cuDNN's fused kernel where it "
                         f"applies and XLA elsewhere")
    modules = list(modules)
    if devices is None:
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
    devices = list(devices)
    capability = compute_capability(devices[0]) if devices else None
    if attention_implementation == "cudnn":
        if capability is None:
            raise ValueError(f"attention_implementation='cudnn' needs an NVIDIA GPU, but the run's devices are "
                             f"{devices[0].platform!r}; use attention_implementation='auto' or 'xla'")
        for backbone in _backbones(modules):
            check_cudnn_fits(backbone.dtype, backbone.cfg.head_dim)
    if capability is not None:
        if attention_implementation == "xla":
            return XLA
        return GpuKernels(attention_implementation, capability, mesh)
    if devices and devices[0].platform == "tpu":
        from ppojax.backends.tpu.kernels import TpuKernels  # noqa: PLC0415 - JAX after XLA's options (above)

        if attention_implementation == "xla":
            return XLA
        return TpuKernels(mesh=mesh, skip_other_sequences=long_packed_rows)
    if attention_implementation == "pallas":
        raise ValueError(f"attention_implementation='pallas' needs a TPU or an NVIDIA GPU, but the run's devices are "
                         f"{devices[0].platform!r}; use attention_implementation='auto' or 'xla'")
    if not cpu_backend or not _cpu_backend_on(devices):
        return XLA
    from ppojax.backends.cpu.kernels import CpuKernels  # noqa: PLC0415 - JAX after XLA's options (above)

    return CpuKernels.for_shapes(matmul_implementation, model_shapes(modules), len(devices))


def use_kernels(kernels, *modules) -> None:
    """Set `kernels` on every backbone of `modules` (a static attribute: the weights are untouched)."""
    for backbone in _backbones(modules):
        backbone.kernels = kernels


def optimizer_step_for(implementation: str = "auto", devices: Sequence | None = None):
    """AdamW's step implementation on `devices` (`ppojax.rl.optimizer.AdamW.step`): the CPU's one pass ("auto" on a
    single CPU device where its handler is built), else None: optax's ("optax", or anywhere else)."""
    import jax  # noqa: PLC0415 - JAX after XLA's options (above)

    devices = list(jax.devices() if devices is None else devices)
    if implementation != "auto" or len(devices) != 1 or not _cpu_backend_on(devices):
        return None
    from ppojax.backends.cpu import adam_in_place  # noqa: PLC0415 - JAX after XLA's options (above)

    return None if adam_in_place.unavailable_reason() else adam_in_place.InPlaceAdamStep()


def matmul_unavailable_reason(implementation: str, device_count: int) -> str:
    """"" where the GEMM library `implementation` names (an in-place one: 'onednn', 'onednn_primitive', 'mkl') can
    multiply on `device_count` devices of the default backend, else why not (one line)."""
    from ppojax.backends.cpu import matmul_tuning  # noqa: PLC0415 - JAX after XLA's options (above)

    return matmul_tuning.unavailable_on(device_count, implementation)
