"""Which instruction sets this CPU has: the one place every CPU-specific path asks before it is chosen.

ppojax meets x86 hosts with AVX2 only (AMD Zen 3), with AVX-512 and its BF16 extension (AMD Zen 4) and with
AVX-512, BF16 and AMX (Intel Sapphire Rapids and later), and ARM hosts. Every path that needs more than the
x86-64 baseline (XLA:CPU option sets, oneDNN's bfloat16 GEMM, the in-place GEMM handlers' few-rows kernels, the
in-place Adam step's vector clones) names the instruction sets it needs (:data:`REQUIREMENTS`) and asks
:func:`probe` whether this CPU has them; nothing tests the CPU anywhere else.

``PPOJAX_CPU_BACKEND=0`` turns all of that off (:func:`backend_off`): the pure-XLA / optax path.

``PPOJAX_CPU_ISA=<level>`` caps what the probe reports at a level of :data:`LEVELS` (``avx2``: AVX2 and FMA,
nothing of AVX-512, BF16 or AMX), so that an AVX-512 host runs every path as an AVX2-only host would. The cap also
reaches the libraries that choose their own kernels (:func:`library_environment`): XLA's code generation
(``--xla_cpu_max_isa``), oneDNN (``ONEDNN_MAX_CPU_ISA``), MKL (``MKL_ENABLE_INSTRUCTIONS``) and torch
(``ATEN_CPU_CAPABILITY``); :func:`apply_cap` sets them, before JAX or torch starts. A cap never adds an
instruction set the CPU lacks.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import os
import platform
from pathlib import Path
from typing import Mapping, MutableMapping

from ppojax.errors import ConfigError, CpuFeatureMissing  # noqa: F401 - CpuFeatureMissing: importable from here

CAP_VARIABLE = "PPOJAX_CPU_ISA"
#: ``PPOJAX_CPU_BACKEND=0`` (false/off/no): none of ppojax's CPU-only code (C++ handlers, in-place GEMMs, the
#: one-pass Adam step) is chosen; the run takes the pure-XLA / optax path that accelerator users run
BACKEND_SWITCH = "PPOJAX_CPU_BACKEND"

#: The instruction sets that decide which code paths pay off or run at all: a CPU's signature (the key of its
#: recorded choices) keeps only these, so a record survives a flag that does not matter but never another unit.
RELEVANT_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                  "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")

#: The x86 flags above AVX2 (what a cap at ``avx2`` removes), and those above AVX-512 and above its BF16 extension.
_ABOVE_AVX512_BF16 = ("amx_",)
_ABOVE_AVX512 = ("avx512_bf16", "avx512_fp16") + _ABOVE_AVX512_BF16
_ABOVE_AVX2 = ("avx512", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx_vnni_int8") + _ABOVE_AVX512

#: cap level -> (flag prefixes it removes, XLA's --xla_cpu_max_isa, oneDNN's ONEDNN_MAX_CPU_ISA,
#: MKL's MKL_ENABLE_INSTRUCTIONS, torch's ATEN_CPU_CAPABILITY).
LEVELS = {
    "avx2": (_ABOVE_AVX2, "AVX2", "AVX2", "AVX2", "avx2"),
    "avx512": (_ABOVE_AVX512, "AVX512", "AVX512_CORE", "AVX512", "avx512"),
    "avx512_bf16": (_ABOVE_AVX512_BF16, "AVX512_BF16", "AVX512_CORE_BF16", "AVX512", "avx512"),
}


@dataclasses.dataclass(frozen=True)
class Requirement:
    """What a code path needs: ALL of ``flags`` (/proc/cpuinfo's names), said as ``name`` in messages."""

    name: str
    flags: tuple[str, ...]


#: The named needs of ppojax's CPU-specific paths.
REQUIREMENTS = {
    # oneDNN's and MKL's float32 GEMMs run on any x86-64 CPU; ppojax's handlers are built for Linux x86-64
    "x86_64": Requirement("x86-64", ()),
    # the in-place handlers' few-rows kernels (stacked_gemm.cc), either width
    "avx2_fma": Requirement("AVX2 with FMA", ("avx2", "fma")),
    "avx512": Requirement("AVX-512 (F)", ("avx512f",)),
    # oneDNN's bfloat16 GEMM (dnnl_gemm_bf16bf16f32) and its bf16 matmul kernels: avx512_core at least (it
    # converts on AVX-512 without BF16, runs natively with AVX512-BF16 or AMX); on AVX2-only CPUs it fails
    "onednn_bf16": Requirement("AVX-512 (F, BW, VL, DQ)", ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
}


@dataclasses.dataclass(frozen=True)
class Cpu:
    """What the host CPU can run: its model name, its instruction-set flags (/proc/cpuinfo's names, after any
    cap) and the cap in force (a key of :data:`LEVELS`, or "")."""

    model_name: str
    flags: frozenset
    cap: str = ""

    @property
    def signature(self) -> str:
        """The key of this CPU's recorded choices: the model name and the relevant instruction sets."""
        relevant = sorted(f for f in self.flags if f in RELEVANT_FLAGS)
        return f"{self.model_name} [{' '.join(relevant)}]"

    @property
    def is_x86_64(self) -> bool:
        # a cpuinfo with x86 flags (sse2 is in every x86-64 CPU's), or a mocked one that names AVX
        return bool(self.flags & {"sse2", "avx", "avx2"})

    def missing(self, requirement: str | Requirement) -> tuple[str, ...]:
        """The flags of ``requirement`` (a key of :data:`REQUIREMENTS` or a Requirement) this CPU lacks."""
        req = REQUIREMENTS[requirement] if isinstance(requirement, str) else requirement
        if req is REQUIREMENTS["x86_64"]:
            return () if self.is_x86_64 else ("x86-64",)
        return tuple(f for f in req.flags if f not in self.flags)

    def has(self, requirement: str | Requirement) -> bool:
        return not self.missing(requirement)

    def lacks(self, requirement: str | Requirement, what: str, alternative: str) -> str:
        """"" when this CPU has ``requirement``, else one line: ``what`` needs it, which flags are missing, the
        CPU, and ``alternative`` (what to use instead)."""
        missing = self.missing(requirement)
        if not missing:
            return ""
        req = REQUIREMENTS[requirement] if isinstance(requirement, str) else requirement
        capped = f", capped by {CAP_VARIABLE}={self.cap}" if self.cap else ""
        return (f"{what} needs {req.name}, and this CPU ({self.model_name}{capped}) lacks {', '.join(missing)}; "
                f"{alternative}")

    def capped(self, level: str) -> "Cpu":
        """This CPU as it runs under the cap ``level`` (a key of :data:`LEVELS`)."""
        removed = LEVELS[level][0]
        return Cpu(self.model_name, frozenset(f for f in self.flags if not f.startswith(removed)), level)


def parse_cpuinfo(text: str) -> Cpu:
    """/proc/cpuinfo's text -> Cpu (x86: 'model name' and 'flags'; ARM: 'CPU part' and 'Features')."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's entry
            fields[key.strip()] = value.strip()
    name = fields.get("model name") or fields.get("CPU part") or platform.processor() or "unknown"
    flags = fields.get("flags") or fields.get("Features") or ""
    return Cpu(" ".join(name.split()), frozenset(flags.split()))


def cap_level(environ: Mapping[str, str] = os.environ) -> str:
    """The cap ``PPOJAX_CPU_ISA`` asks for ("" for none); a value that is no level raises a `ConfigError` (the
    ``ppojax`` command's one-line error, exit 2), naming the levels."""
    level = environ.get(CAP_VARIABLE, "").strip().lower()
    if level and level not in LEVELS:
        raise ConfigError(f"{CAP_VARIABLE}={environ[CAP_VARIABLE]!r} is not a level: use one of "
                                f"{', '.join(LEVELS)} (or unset it to use every instruction set this CPU has)")
    return level


def read_cpu(environ: Mapping[str, str] = os.environ, cpuinfo: Path = Path("/proc/cpuinfo")) -> Cpu:
    """This CPU (``cpuinfo``'s first processor) under the cap ``environ`` asks for."""
    try:
        cpu = parse_cpuinfo(cpuinfo.read_text())
    except OSError:  # not Linux: no flags, so only the paths that need none are chosen
        cpu = Cpu(platform.processor() or platform.machine() or "unknown", frozenset())
    level = cap_level(environ)
    return cpu.capped(level) if level else cpu


@functools.cache
def _probed(level: str) -> Cpu:
    return read_cpu({CAP_VARIABLE: level} if level else {})


def probe() -> Cpu:
    """This CPU, under ``PPOJAX_CPU_ISA``'s cap if set (read once per process and cap). Tests mock this function
    to simulate another host."""
    return _probed(cap_level())


def switched_off(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment variable ``name`` turns a start-up behaviour off: 0, false, off or no (any
    case). Shared by the switches of the ``ppojax`` command's start-up (``ppojax.backends.prepare_process``)."""
    return environ.get(name, "").strip().lower() in ("0", "false", "off", "no")


def backend_off(environ: Mapping[str, str] = os.environ) -> str:
    """"" where ppojax's CPU-only code may be chosen, else why not (one line, for "unavailable" messages)."""
    if switched_off(BACKEND_SWITCH, environ):
        return f"ppojax's CPU backend is off ({BACKEND_SWITCH}={environ[BACKEND_SWITCH]}): XLA's dots and optax's step"
    return ""


#: device files of the accelerators JAX runs on (NVIDIA GPUs, TPU chips through the accel or vfio driver, AMD GPUs)
ACCELERATOR_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def accelerator_host(environ: Mapping[str, str] = os.environ) -> str:
    """"" where a run will compute on this CPU, else why not (one line): ``JAX_PLATFORMS`` names another platform
    first, or (unset) the host has an accelerator's device files. Read before JAX starts, without importing it: the
    CPU-only start-up steps (the allocator re-exec) are skipped on GPU and TPU hosts."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return "" if first == "cpu" else f"JAX_PLATFORMS={platforms}"
    found = next((f for pattern in ACCELERATOR_DEVICE_FILES for f in sorted(glob.glob(pattern))), None)
    return f"this host has an accelerator ({found})" if found else ""


def library_environment(level: str) -> dict[str, str]:
    """The environment variables that cap the libraries' own kernel choice at ``level`` (see the module doc)."""
    _, xla, onednn, mkl, aten = LEVELS[level]
    return {"ONEDNN_MAX_CPU_ISA": onednn, "DNNL_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl,
            "ATEN_CPU_CAPABILITY": aten, "XLA_FLAGS": f"--xla_cpu_max_isa={xla}"}


def apply_cap(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set :func:`library_environment` for ``PPOJAX_CPU_ISA``'s level in ``environ`` (before JAX or torch starts:
    they read it once). A variable the user set is left as it is; XLA's flag is added to ``XLA_FLAGS`` unless they
    hold a ``--xla_cpu_max_isa`` of their own. Returns the level ("" where none is set)."""
    level = cap_level(environ)
    if not level:
        return ""
    for name, value in library_environment(level).items():
        if name == "XLA_FLAGS":
            flags = environ.get("XLA_FLAGS", "")
            if "--xla_cpu_max_isa" not in flags:
                environ["XLA_FLAGS"] = f"{flags} {value}".strip()
        else:
            environ.setdefault(name, value)
    return level


#: every value :func:`build_defines` can give (a prebuild for an unknown host builds each)
ALL_BUILD_DEFINES = ((), ("-DPPOJAX_MAX_ISA_AVX2",), ("-DPPOJAX_MAX_ISA_BASELINE",))


def build_defines(cpu: Cpu | None = None) -> tuple[str, ...]:
    """The C++ defines that keep ppojax's handlers (`ppojax/ffi`, `stacked_gemm.cc`) inside ``cpu``'s instruction
    sets (default: the probe's). The handlers test the CPU themselves at load time; a define caps them below that
    where the probe reports less (a cap), and names a build apart in the cache."""
    cpu = cpu or probe()
    if not cpu.has("avx2_fma"):
        return ("-DPPOJAX_MAX_ISA_BASELINE",)
    if not cpu.has("avx512"):
        return ("-DPPOJAX_MAX_ISA_AVX2",)
    return ()
