"""Which GEMM library `matmul_implementation: auto` takes on this CPU, from a measurement on that CPU.

oneDNN's and MKL's float32 GEMMs win on different CPUs at a model's shapes (`benchmarks/RESULTS.md`: on a Zen 4
host oneDNN's in-place products beat MKL's; TRL's update, on MKL, ran faster on an Intel AMX host than ppojax's on
oneDNN), so the choice is a measurement, never a rule typed in for one host. The measured seconds per library are
recorded under this CPU's signature (its model name and instruction sets, as ``ppojax.xla_cpu_options`` keys its
records) in ``~/.cache/ppojax/matmul_library.json``, with the library chosen (:func:`choose`: the fastest, but
oneDNN's sgemm unless another beats it by 10 %). Two measurements write it:

- ``matmul_tuning``: the first model "auto" puts on the in-place handlers on a CPU without a record (or with one
  that did not measure every library to be had now) measures a few seconds' worth of one layer's products;
- ``python -m benchmarks.gemm_shapes --record``: one whole update's GEMMs at SmolLM2's shapes, per library.

"onednn", "onednn_primitive" and "mkl" name their library whatever the record says.
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
#: another library replaces oneDNN's sgemm (the default) only when its GEMMs take at most this share of oneDNN's: on
#: Zen 4 the matmul primitive's 4-6 % lead in an update's GEMMs gave no faster step (RESULTS, twentieth session)
RECORD_MARGIN = 0.9


def choose(measured: Mapping[str, float]) -> str:
    """The library to take from `measured` ({library: seconds of the same GEMMs}, not empty): the fastest, unless
    oneDNN's sgemm was measured and the fastest does not beat it by `RECORD_MARGIN`."""
    fastest = min(measured, key=measured.get)
    if "onednn" in measured and measured[fastest] > RECORD_MARGIN * measured["onednn"]:
        return "onednn"
    return fastest


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


def recorded_choice(candidates, *, cpu: Optional[Cpu] = None,
                    environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The library to take among `candidates` (those whose handlers can be had now) by `cpu`'s record, or None
    where the record did not measure every candidate (none yet, another CPU's, an unreadable one, or a library
    installed since): the recorded library where it is a candidate, else :func:`choose` among the candidates'
    recorded seconds."""
    entry = read_records(record_path(environ)).get((cpu or this_cpu()).signature)
    measured = entry.get("measurements") if isinstance(entry, dict) else None
    if not candidates or not isinstance(measured, dict) or not all(
            isinstance(measured.get(lib), (int, float)) for lib in candidates):
        return None
    if entry.get("library") in candidates:
        return entry["library"]
    return choose({lib: float(measured[lib]) for lib in candidates})
