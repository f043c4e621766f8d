"""What ``ppojax plan`` compiles for (``--target``): the devices, their memory, and which compiler reads the program.

    cpu                           XLA:CPU on N virtual CPU devices (``--devices``): an estimate of an accelerator
    tpu:<chip>:<topology>         a TPU slice, compiled by the TPU compiler itself (libtpu) without its chips:
                                  tpu:v5e:4x4 (v5e-16), tpu:v5p:2x2x2 (v5p-16), tpu:v6e:8x8 (v6e-64)
    tpu:<chip>:<topology>:slices=K  K such slices joined by the data-center network (multi-slice)
    gpu:<gpu>x<N>[:hosts=K]       K hosts (default 1) of N NVIDIA GPUs each (h100, h200), compiled by XLA's GPU
                                  compiler (the CUDA plugin) without the GPUs: gpu:h100x8, gpu:h200x8:hosts=2

A TPU target's topology is its chip grid as libtpu names it: two sizes for v5e and v6e (a 2-D torus), three for
v5p; the Cloud accelerator type counts chips for v5e/v6e (v5e-16 = 4x4) and TensorCores for v5p (v5p-16 = 8
chips = 2x2x2). The compiler then assigns every buffer of the real program for those chips: what it reports per
device is what a run would hold, and a program that does not fit is refused with the bytes it would need.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator, Optional, Sequence

import jax
from jax.experimental import topologies

from ppojax.trainer.config import ConfigError

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation as a target. hbm_gib: the HBM per chip the TPU compiler lets a program use (its
    out-of-memory message states it; tests/test_tpu_compile.py checks it); the rest: the published figures per chip,
    for the roofline arithmetic of a plan (bf16 peak in TFLOP/s, HBM bandwidth in GB/s)."""

    name: str
    libtpu_name: str
    chip_config: str  # "default": one TensorCore per chip; "megacore": two cores acting as one device
    topology_dims: int
    max_chips: int    # the largest slice (a whole pod); libtpu aborts the process on some larger grids
    max_side: int     # the longest side of a slice's grid
    hbm_gib: float
    peak_bf16_tflops: float
    hbm_gb_per_s: float
    device_kind: str


TPU_CHIPS = {
    "v5e": TpuChip("v5e", "v5e", "default", 2, 256, 16, 15.75, 197.0, 819.0, "TPU v5 lite"),
    "v5p": TpuChip("v5p", "v5p", "megacore", 3, 8960, 28, 95.74, 459.0, 2765.0, "TPU v5"),
    "v6e": TpuChip("v6e", "v6e", "default", 2, 256, 16, 31.25, 918.0, 1640.0, "TPU v6 lite"),
}

#: chips per host in a multi-host slice (2 x 2 x 1): where the compiler places process boundaries (clipped to
#: the grid of a smaller slice); the compiled program's buffers do not depend on it
CHIPS_PER_HOST_BOUNDS = (2, 2, 1)


@dataclasses.dataclass(frozen=True)
class GpuModel:
    """One NVIDIA GPU as a target: what XLA's GPU compiler needs to know of it (its target config: SM count,
    memories, bandwidth, compute capability), and the memory a program may use (all of it: a run must then let JAX
    take more than its default 75 %, docs/scaling.md)."""

    name: str
    device_kind: str
    memory_bytes: int
    memory_bandwidth: int  # bytes/s
    core_count: int
    clock_ghz: float
    l2_cache_bytes: int
    compute_capability: tuple

    def target_config(self, cuda_major: int, cudnn: tuple) -> str:
        """The GPU's description in XLA's text format (stream_executor's GpuTargetConfigProto)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {self.core_count} fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth} l2_cache_size: {self.l2_cache_bytes} clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
runtime_version {{ major: {cuda_major} minor: 0 }}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} }}
device_description_str: "{self.device_kind}"
"""


#: Hopper GPUs: 132 SMs at 1.98 GHz, 50 MiB of L2; memory as CUDA reports it
GPUS = {
    "h100": GpuModel("h100", "NVIDIA H100 80GB HBM3", 84_929_347_584, 3_352_320_000_000, 132, 1.98, 52_428_800, (9, 0)),
    "h200": GpuModel("h200", "NVIDIA H200", 150_754_820_096, 4_800_000_000_000, 132, 1.98, 52_428_800, (9, 0)),
}


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """A parsed ``--target``: nothing loaded yet. chip and gpu None: the CPU estimate. topology: a TPU slice's
    chip grid, or for GPUs ``1x<hosts>x<GPUs per host>``."""

    text: str
    chip: Optional[TpuChip] = None
    topology: str = ""
    slices: int = 1
    gpu: Optional[GpuModel] = None

    @property
    def is_cpu(self) -> bool:
        return self.chip is None and self.gpu is None

    @property
    def device_noun(self) -> str:
        return "chip" if self.chip is not None else "GPU" if self.gpu is not None else "device"

    @property
    def chips(self) -> int:
        """The target's devices (TPU chips or GPUs)."""
        sizes = [int(x) for x in self.topology.split("x")] if self.topology else [0]
        product = 1
        for size in sizes:
            product *= size
        return product * self.slices

    @property
    def host_bounds(self) -> tuple:
        sizes = [int(x) for x in self.topology.split("x")] + [1]
        return tuple(min(bound, size) for bound, size in zip(CHIPS_PER_HOST_BOUNDS, sizes))


@dataclasses.dataclass
class Target:
    """The devices a plan compiles for. hbm_bytes: memory per device; compiler: who assigns the buffers."""

    spec: TargetSpec
    devices: list
    hbm_bytes: float
    compiler: str
    description: str

    @property
    def is_estimate(self) -> bool:
        return self.spec.is_cpu


_TPU_PATTERN = re.compile(r"^tpu:(?P<chip>[a-z0-9]+):(?P<topology>[0-9x]+)(?::slices=(?P<slices>[0-9]+))?$")
_GPU_PATTERN = re.compile(r"^gpu:(?P<gpu>[a-z0-9]+)x(?P<count>[0-9]+)(?::hosts=(?P<hosts>[0-9]+))?$")
_EXAMPLE = "e.g. --target tpu:v5e:4x4, tpu:v5p:2x2x2, tpu:v6e:8x8:slices=2, gpu:h100x8, gpu:h200x8:hosts=2, or cpu"


def _parse_gpu(text: str, found) -> TargetSpec:
    gpu = GPUS.get(found["gpu"])
    if gpu is None:
        raise ConfigError(f"--target {text!r}: unknown GPU {found['gpu']!r}; expected one of {', '.join(GPUS)} "
                          f"({_EXAMPLE}).")
    count, hosts = int(found["count"]), int(found["hosts"] or 1)
    if not 1 <= count <= 8 or hosts < 1:
        raise ConfigError(f"--target {text!r}: expected 1 to 8 GPUs per host and hosts >= 1 ({_EXAMPLE}).")
    return TargetSpec(text, topology=f"1x{hosts}x{count}", gpu=gpu)


def parse_target(text: str) -> TargetSpec:
    """``--target`` text -> TargetSpec; a ConfigError naming the value and the expected form (before JAX starts)."""
    text = (text or "cpu").strip()
    if text == "cpu":
        return TargetSpec("cpu")
    example = _EXAMPLE
    if _GPU_PATTERN.match(text):
        return _parse_gpu(text, _GPU_PATTERN.match(text))
    found = _TPU_PATTERN.match(text)
    if not found:
        raise ConfigError(f"--target {text!r}: expected 'cpu', 'tpu:<chip>:<topology>[:slices=K]' or "
                          f"'gpu:<gpu>x<N>[:hosts=K]' ({example}).")
    chip = TPU_CHIPS.get(found["chip"])
    if chip is None:
        raise ConfigError(f"--target {text!r}: unknown TPU chip {found['chip']!r}; expected one of "
                          f"{', '.join(TPU_CHIPS)} ({example}).")
    sizes = found["topology"].split("x")
    if len(sizes) != chip.topology_dims or not all(s.isdigit() and int(s) >= 1 for s in sizes):
        shape = "x".join(["N"] * chip.topology_dims)
        raise ConfigError(f"--target {text!r}: a {chip.name} topology has {chip.topology_dims} sizes ({shape}, "
                          f"the chip grid), got {found['topology']!r}.")
    chips = 1
    for size in sizes:
        chips *= int(size)
    if chips > chip.max_chips or max(int(s) for s in sizes) > chip.max_side:
        raise ConfigError(f"--target {text!r}: a {chip.name} slice has at most {chip.max_chips} chips and "
                          f"{chip.max_side} along a side; for more, join slices (:slices=K).")
    slices = int(found["slices"] or 1)
    if slices < 1:
        raise ConfigError(f"--target {text!r}: slices={slices}; expected a count >= 1.")
    return TargetSpec(text, chip, found["topology"], slices)


def tpu_compiler_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def cuda_plugin() -> Optional[str]:
    """The installed CUDA plugin of JAX (jax_cuda13_plugin or jax_cuda12_plugin), else None."""
    return next((name for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")
                 if importlib.util.find_spec(name) is not None), None)


def check_available(spec: TargetSpec) -> None:
    """A TPU target needs libtpu, the TPU compiler; a GPU target JAX's CUDA plugin: a ConfigError naming the fix
    where it is missing."""
    if spec.gpu is not None:
        if cuda_plugin() is None:
            raise ConfigError(f"--target {spec.text}: compiling for NVIDIA GPUs needs JAX's CUDA plugin and CUDA's "
                              "libraries, which are not installed in this Python environment; install them with "
                              "pip install 'ppojax[cuda]' (about 3.8 GB; or use --target cpu for XLA:CPU's estimate).")
        return
    if not spec.is_cpu and not tpu_compiler_installed():
        raise ConfigError(f"--target {spec.text}: compiling for a TPU needs libtpu, the TPU compiler, which is not "
                          "installed in this Python environment; install it with pip install 'ppojax[tpu]' (or use "
                          "--target cpu for XLA:CPU's estimate).")


@contextlib.contextmanager
def _stderr_to(sink) -> Iterator[None]:
    """The process's file descriptor 2 into ``sink`` (libtpu writes to it from C++, past Python's sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def tpu_devices(spec: TargetSpec) -> list:
    """The compile-only devices of the TPU slice(s) ``spec`` names (libtpu's topology, no chip needed)."""
    check_available(spec)
    # A compile without chips uses none: never wait for the lock of a process that holds the host's TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    name = f"{spec.chip.libtpu_name}:{spec.topology}"
    # libtpu starts by looking for the TPU VM it runs on (metadata server, worker hostnames) and warns that it
    # found none: true and beside the point for a compile without chips, so its start-up output is kept back
    # unless the topology is refused.
    with tempfile.TemporaryFile() as sink:
        with _stderr_to(sink):
            try:
                topology = topologies.get_topology_desc(
                    topology_name=name, platform="tpu", chip_config_name=spec.chip.chip_config,
                    chips_per_host_bounds=spec.host_bounds, num_slices=spec.slices)
                error = None
            except Exception as err:  # noqa: BLE001 - libtpu's own error type; reported below as the user's
                error = err
    if error is not None:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"--target {spec.text}: libtpu refused the topology {name!r} ({reason}); give the chip "
                          f"grid of a {spec.chip.name} slice, e.g. tpu:{spec.chip.name}:"
                          f"{'2x2x2' if spec.chip.topology_dims == 3 else '4x4'}.")
    devices = list(topology.devices)
    kinds = {d.device_kind for d in devices}
    if kinds != {spec.chip.device_kind}:
        raise ConfigError(f"--target {spec.text}: libtpu made {sorted(kinds)} devices, expected "
                          f"{spec.chip.device_kind!r}; a libtpu that does not match this jax? "
                          "pip install 'ppojax[tpu]'.")
    return devices


def _cudnn_version(plugin: str) -> tuple:
    for name in (f"nvidia-cudnn-cu{plugin[len('jax_cuda'):len('jax_cuda') + 2]}",):
        try:
            major, minor = importlib.metadata.version(name).split(".")[:2]
            return int(major), int(minor)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            pass
    return 9, 0


def gpu_devices(spec: TargetSpec) -> list:
    """The compile-only devices of ``spec``'s GPU hosts (XLA's GPU compiler, no GPU needed)."""
    check_available(spec)
    plugin = cuda_plugin()
    # Without a GPU (and its driver) the plugin's check of the CUDA libraries' versions fails and JAX would not
    # register the cuda platform at all; a compile without GPUs does not load those libraries' kernels.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    config = spec.gpu.target_config(int(plugin[len("jax_cuda"):len("jax_cuda") + 2]), _cudnn_version(plugin))
    try:
        topology = topologies.get_topology_desc(spec.gpu.name, "cuda", target_config=config,
                                                topology=spec.topology)
    except Exception as err:  # noqa: BLE001 - the plugin's own error types
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--target {spec.text}: JAX's CUDA plugin ({plugin}) made no GPU topology ({reason}); "
                          "reinstall it with pip install 'ppojax[cuda]'.") from None
    return list(topology.devices)


def plugin_version(plugin: str) -> str:
    try:
        return importlib.metadata.version(plugin.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def libtpu_version() -> str:
    """The installed libtpu's version, or the library JAX loads instead (``TPU_LIBRARY_PATH`` naming another file;
    the libtpu package itself sets the variable to its own library when imported)."""
    chosen = os.environ.get("TPU_LIBRARY_PATH")
    package = importlib.util.find_spec("libtpu")
    own = os.path.join(os.path.dirname(package.origin), "libtpu.so") if package and package.origin else None
    if chosen and os.path.isfile(chosen) and (own is None or not os.path.samefile(chosen, own)):
        return f"from {chosen}"
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def load_target(spec: TargetSpec, cpu_devices: Optional[Sequence] = None, hbm_gb: Optional[float] = None) -> Target:
    """The devices and memory of ``spec``. cpu: ``cpu_devices`` (the virtual CPU devices set up before JAX started)
    with ``hbm_gb`` (GB, 1e9 bytes; default 80) as each one's memory. TPU: the slice's compile-only devices and
    the chip's HBM."""
    if spec.is_cpu:
        devices = list(jax.devices() if cpu_devices is None else cpu_devices)
        memory = (80.0 if hbm_gb is None else hbm_gb) * 1e9
        return Target(spec, devices, memory, "XLA:CPU",
                      f"{len(devices)} virtual CPU device(s) (XLA:CPU's buffers: an estimate of an accelerator's)")
    if hbm_gb is not None:
        raise ConfigError(f"--hbm-gb with --target {spec.text}: the target's memory is its {spec.device_noun}'s; "
                          "leave --hbm-gb out.")
    if spec.gpu is not None:
        devices, plugin = gpu_devices(spec), cuda_plugin()
        compiler = f"XLA:GPU ({plugin.replace('_', '-')} {plugin_version(plugin)})"
        hosts = spec.topology.split("x")[1]
        return Target(spec, devices, spec.gpu.memory_bytes, compiler,
                      f"{len(devices)} {spec.gpu.device_kind} GPUs ({hosts} host(s)), compiled by {compiler}")
    devices = tpu_devices(spec)
    slices = f" x {spec.slices} slices" if spec.slices > 1 else ""
    return Target(spec, devices, spec.chip.hbm_gib * GIB, f"libtpu {libtpu_version()}",
                  f"{len(devices)} {spec.chip.device_kind} chips ({spec.chip.name}:{spec.topology}{slices}), "
                  f"compiled by libtpu {libtpu_version()}")
