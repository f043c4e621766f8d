"""XLA:CPU options chosen at run time for the CPU a run starts on, from a measurement on that CPU.

Which XLA:CPU options are fastest depends on the CPU (its vector width, its bf16/AMX units) and on the XLA
version, and one host's winner can lose on another. So nothing here is a rule typed in for one host:

    the CPU's features (``ppojax.backends.cpu.capabilities.probe``: model name, instruction-set flags)
      -> the option sets worth timing on it (``CANDIDATES``: each names the instruction sets it needs)
      -> ``python -m ppojax.backends.cpu.xla_options_tuning --record`` times them there and records the winner
         (``default`` when nothing beats XLA's defaults) under the CPU's signature and the jaxlib version, one
         per kind of matmul (``MATMULS``: float32, or the bf16 matmuls of the ``mixed`` and ``bfloat16``
         precisions; on an AMX host the two had different winners)
      -> at start-up :func:`apply` adds the options recorded for THIS CPU and the run's precision to ``XLA_FLAGS``.

A CPU with no record runs XLA's defaults. A user's own ``XLA_FLAGS`` holding any ``--xla_cpu_`` option wins:
nothing is added. ``PPOJAX_XLA_CPU_OPTIONS=0`` (or false/off/no) turns the choice off. XLA reads ``XLA_FLAGS``
once, when JAX starts its CPU backend, so the entry points (the ``ppojax`` command, ``program_start``) call
:func:`apply` before any computation; in a notebook call it before the first JAX operation.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Mapping, Optional

from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.capabilities import REQUIREMENTS, Cpu, apply_cap, switched_off
from ppojax.backends.cpu.capabilities import RELEVANT_FLAGS, parse_cpuinfo  # noqa: F401 - re-exported
from ppojax.io.strict_json import write_text_atomic

OFF_SWITCH = "PPOJAX_XLA_CPU_OPTIONS"
RECORD_FILE = "xla_cpu_options.json"

#: The kinds of matmul a record keeps a winner for: float32, and the bf16 matmuls that ``mixed`` and ``bfloat16``
#: both run (XLA reaches different kernels for them, and an option can speed one and slow the other).
MATMULS = ("float32", "bf16")


def matmuls_of(precision: str) -> str:
    """A config's ``precision`` -> the kind of matmul it runs (a key of a record)."""
    return "float32" if precision == "float32" else "bf16"


@dataclasses.dataclass(frozen=True)
class OptionSet:
    """A named ``XLA_FLAGS`` fragment and the instruction sets (all of them) it needs to be worth timing."""

    name: str
    flags: str
    needs: tuple[str, ...] = ()
    why: str = ""
    needs_bf16: tuple[str, ...] = ()  # needed on top of ``needs`` where it serves the bf16 matmuls


CANDIDATES = (
    OptionSet("default", "", (), "XLA's defaults (YNNPACK/XNNPACK dots, LLVM's vector width)"),
    OptionSet("ynn_dot", "--xla_cpu_experimental_ynn_fusion_type=dot", (),
              "dots fused into YNNPACK in their own dtype (a bf16 dot stays bf16)"),
    OptionSet("no_xnnpack", "--xla_cpu_use_xnnpack=false", (), "XLA's own (Eigen) dots"),
    OptionSet("concurrent", "--xla_cpu_enable_concurrency_optimized_scheduler=true", (),
              "an op order that lets the runtime run independent ops (the policy's and the value model's) at once"),
    OptionSet("vector_512", "--xla_cpu_prefer_vector_width=512", ("avx512f",),
              "512-bit vectors in LLVM's code for the fusions around the dots"),
    OptionSet("onednn_dot", "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot "
              "--xla_cpu_use_xnnpack=false", ("avx2",),
              "oneDNN's dots (torch's CPU library; the route to AVX512-BF16 and AMX units)",
              REQUIREMENTS["onednn_bf16"].flags),
)


def this_cpu() -> Cpu:
    """This CPU as ppojax's probe reports it (`ppojax.backends.cpu.capabilities`: a cap included)."""
    return capabilities.probe()


def candidates(cpu: Cpu, matmuls: str = "float32") -> list[OptionSet]:
    """The option sets worth timing on ``cpu`` for ``matmuls`` (a key of MATMULS): those whose instruction sets it
    has (for bf16 matmuls, ``needs_bf16``'s too)."""
    return [s for s in CANDIDATES
            if all(flag in cpu.flags for flag in s.needs + (s.needs_bf16 if matmuls == "bf16" else ()))]


def _jaxlib_version() -> str:
    try:
        return version("jaxlib")
    except PackageNotFoundError:
        return "unknown"


def record_path(environ: Mapping[str, str] = os.environ, name: str = RECORD_FILE) -> Path:
    """``$XDG_CACHE_HOME/ppojax/<name>`` (``~/.cache/ppojax/xla_cpu_options.json`` unless named: the per-CPU
    records live there)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "ppojax" / name


def _key(cpu: Cpu, jaxlib: str) -> str:
    # flag names and their meanings change between XLA versions: a record applies to the jaxlib it was timed on
    return f"{cpu.signature} jaxlib {jaxlib}"


def read_records(path: Path) -> dict:
    """A records file's JSON object; {} where it is missing or unreadable (a record is only ever a speed-up)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(option_set: str, measurements: dict, *, matmuls: str = "float32", cpu: Optional[Cpu] = None,
           jaxlib: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> Path:
    """Record ``option_set`` (a CANDIDATES name) as the measured choice for ``cpu`` (default: this one) and
    ``matmuls`` (one of MATMULS); ``measurements``: what decided it (seconds per set), kept beside it. The other
    kind's record for the CPU is kept. Written atomically."""
    chosen = next((s for s in CANDIDATES if s.name == option_set), None)
    if chosen is None:
        raise ValueError(f"option set {option_set!r}: expected one of {', '.join(s.name for s in CANDIDATES)}")
    if matmuls not in MATMULS:
        raise ValueError(f"matmuls {matmuls!r}: expected one of {', '.join(MATMULS)}")
    cpu, jaxlib = cpu or this_cpu(), jaxlib or _jaxlib_version()
    path = record_path(environ)
    records = read_records(path)
    by_matmuls = _by_matmuls(records.get(_key(cpu, jaxlib)))
    by_matmuls[matmuls] = {"option_set": chosen.name, "flags": chosen.flags, "measurements": measurements,
                           "recorded": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    records[_key(cpu, jaxlib)] = by_matmuls
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(records, indent=1, sort_keys=True))


def _by_matmuls(entry) -> dict:
    """A CPU's record -> {kind of matmul: choice}. A record from before the split (one choice, timed at float32)
    counts as the float32 one."""
    if not isinstance(entry, dict):
        return {}
    if "option_set" in entry:
        return {"float32": entry}
    return {k: v for k, v in entry.items() if k in MATMULS and isinstance(v, dict)}


def recorded_choice(cpu: Optional[Cpu] = None, jaxlib: Optional[str] = None,
                    environ: Mapping[str, str] = os.environ, precision: str = "float32") -> Optional[dict]:
    """The record for ``cpu``, ``jaxlib`` (default: this CPU, the installed jaxlib) and the matmuls of
    ``precision``, or None."""
    cpu, jaxlib = cpu or this_cpu(), jaxlib or _jaxlib_version()
    entry = _by_matmuls(read_records(record_path(environ)).get(_key(cpu, jaxlib))).get(matmuls_of(precision))
    known = {s.name: s for s in CANDIDATES}
    if not isinstance(entry, dict) or entry.get("option_set") not in known:
        return None
    return {**entry, "flags": known[entry["option_set"]].flags}  # the flags as this version of ppojax spells them


def apply(environ=os.environ, cpu: Optional[Cpu] = None, jaxlib: Optional[str] = None,
          announce: bool = True, precision: str = "float32") -> Optional[str]:
    """Add the XLA:CPU options recorded for this CPU and the matmuls of ``precision`` (a config's) to
    ``environ["XLA_FLAGS"]``. Returns the flags added, or None (no record, the record says ``default``, the user
    set ``--xla_cpu_`` options, or switched off)."""
    user_options = "--xla_cpu_" in environ.get("XLA_FLAGS", "")
    apply_cap(environ)  # PPOJAX_CPU_ISA's cap on XLA's (and oneDNN's, MKL's, torch's) instruction sets, if set
    if switched_off(OFF_SWITCH, environ) or user_options:
        return None
    entry = recorded_choice(cpu, jaxlib, environ, precision)
    if entry is None or not entry["flags"]:
        return None
    environ["XLA_FLAGS"] = " ".join(f for f in (environ.get("XLA_FLAGS", ""), entry["flags"]) if f)
    if announce:
        print(f"ppojax: XLA:CPU options measured fastest on this CPU for {matmuls_of(precision)} matmuls "
              f"({entry['option_set']}, recorded "
              f"{entry.get('recorded', '?')} in {record_path(environ)}): {entry['flags']}; "
              f"{OFF_SWITCH}=0 turns them off", flush=True)
    return entry["flags"]
