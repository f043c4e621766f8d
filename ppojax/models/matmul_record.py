"""Which GEMM library `matmul_implementation: auto` takes on this CPU, from a measurement on that CPU.

oneDNN's and MKL's float32 GEMMs win on different CPUs at a model's shapes (`benchmarks/RESULTS.md`: on a Zen 4
host oneDNN's in-place products beat MKL's; TRL's update, on MKL, ran faster on an Intel AMX host than ppojax's on
oneDNN), so the choice is a measurement, never a rule typed in for one host:

    ``python -m benchmarks.gemm_shapes --record`` times one update's GEMMs through ppojax's in-place handlers on
    each library that can be had here and records the fastest (oneDNN's sgemm unless another beats it by 10 %)
    under this CPU's signature (its model name and instruction sets, as ``ppojax.xla_cpu_options`` keys its
    records) in ``~/.cache/ppojax/matmul_library.json``
      -> "auto" takes the recorded library where its handlers can be had, oneDNN's otherwise.

"onednn" and "mkl" name their library whatever the record says; a CPU with no record takes oneDNN's.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping, Optional

from ..strict_json import write_text_atomic
from ..xla_cpu_options import Cpu, read_records, record_path as _records_path, this_cpu

RECORD_FILE = "matmul_library.json"


def record_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/ppojax/matmul_library.json`` (``~/.cache/ppojax/...``)."""
    return _records_path(environ, RECORD_FILE)


def record(library: str, measurements: dict, libraries, *, cpu: Optional[Cpu] = None,
           environ: Mapping[str, str] = os.environ) -> Path:
    """Record `library` (one of `libraries`) as the measured choice for `cpu` (default: this one); `measurements`
    (what decided it: seconds per library) kept beside it. Other CPUs' records are kept. Written atomically."""
    if library not in libraries:
        raise ValueError(f"library {library!r}: expected one of {', '.join(libraries)}")
    cpu = cpu or this_cpu()
    path = record_path(environ)
    records = read_records(path)
    records[cpu.signature] = {"library": library, "measurements": measurements,
                              "recorded": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(records, indent=1, sort_keys=True))


def recorded_library(libraries, *, cpu: Optional[Cpu] = None,
                     environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The library recorded for `cpu` (default: this one) if it is one of `libraries`, else None (no record, or an
    unreadable one)."""
    entry = read_records(record_path(environ)).get((cpu or this_cpu()).signature)
    library = entry.get("library") if isinstance(entry, dict) else None
    return library if library in libraries else None
