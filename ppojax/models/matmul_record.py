"""Which GEMM library `matmul_implementation: auto` takes on this CPU for each product, from a measurement there.

oneDNN's and MKL's float32 GEMMs win on different CPUs at a model's shapes (`benchmarks/RESULTS.md`: on a Zen 4
host oneDNN's in-place products beat MKL's; TRL's update, on MKL, ran faster on an Intel AMX host than ppojax's on
oneDNN), and on different products of one CPU (oneDNN's matmul primitive reads a layer transposed, the input
gradient, faster than its sgemm on both hosts), so the choice is a measurement per product, never a rule typed in
for one host. The measured seconds per library and product are recorded under this CPU's signature (its model
name and instruction sets, as ``ppojax.xla_cpu_options`` keys its records) in
``~/.cache/ppojax/matmul_library.json``, with the libraries chosen (:func:`choose`: per product the fastest, but
oneDNN's sgemm unless another beats it by 10 %). Two measurements write it:

- ``matmul_tuning``: the first model "auto" puts on the in-place handlers on a CPU without a record (or with one
  that did not measure every library and product to be had now) measures a few seconds' worth of one layer's
  products;
- ``python -m benchmarks.gemm_shapes --record``: one whole update's GEMMs at SmolLM2's shapes, per library and
  product.

"onednn", "onednn_primitive" and "mkl" name their library for every product whatever the record says.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

from ..strict_json import write_text_atomic
from ..xla_cpu_options import Cpu, read_records, record_path as _records_path, this_cpu

RECORD_FILE = "matmul_library.json"
#: another library replaces oneDNN's sgemm (the default) for a product only when it takes at most this share of
#: oneDNN's time there: on Zen 4 neither the matmul primitive's 4-6 % lead in an update's GEMMs nor its 8 % lead in
#: the input gradients gave a measurably faster step (RESULTS, twentieth and twenty-third sessions)
RECORD_MARGIN = 0.9
#: a projection's three products, each measured and chosen on its own (among the libraries only: XLA's dot, which
#: reads no weight for the weight gradient, led it in isolation on the Intel host yet made a Zen 4 step 1.6 s slower,
#: RESULTS, twenty-third session)
PRODUCTS = ("fwd", "dx", "dw")


class Libraries(NamedTuple):
    """The GEMM library of each product of a layer's projection: the forward ``x @ W``, the input gradient
    ``g @ W.T`` (the layer read transposed) and the weight gradient ``x.T @ g``."""
    fwd: str
    dx: str
    dw: str

    @classmethod
    def every(cls, library: str) -> "Libraries":
        return cls(library, library, library)

    def __str__(self) -> str:  # "onednn", or "fwd onednn, dx onednn_primitive, dw onednn"
        if len(set(self)) == 1:
            return self.fwd
        return ", ".join(f"{product} {library}" for product, library in zip(PRODUCTS, self))


def choose(measured: Mapping[str, Mapping[str, float]]) -> Libraries:
    """The libraries to take from `measured` ({library: {product: seconds of the same GEMMs}}, not empty): per
    product the fastest, unless oneDNN's sgemm was measured and the fastest does not beat it by `RECORD_MARGIN`."""
    def fastest(product: str) -> str:
        seconds = {library: by_product[product] for library, by_product in measured.items()}
        best = min(seconds, key=seconds.get)
        if "onednn" in seconds and seconds[best] > RECORD_MARGIN * seconds["onednn"]:
            return "onednn"
        return best

    return Libraries(*map(fastest, PRODUCTS))


def record_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/ppojax/matmul_library.json`` (``~/.cache/ppojax/...``)."""
    return _records_path(environ, RECORD_FILE)


def record(chosen: Libraries, measurements: dict, libraries, *, cpu: Optional[Cpu] = None,
           environ: Mapping[str, str] = os.environ) -> Path:
    """Record `chosen` (each product's library one of `libraries`) as the measured choice for `cpu` (default: this
    one); `measurements` (what decided it: {library: {product: seconds}}) kept beside it. Other CPUs' records are
    kept. Written atomically."""
    for library in chosen:
        if library not in libraries:
            raise ValueError(f"library {library!r}: expected one of {', '.join(libraries)}")
    cpu = cpu or this_cpu()
    path = record_path(environ)
    records = read_records(path)
    records[cpu.signature] = {"libraries": dict(zip(PRODUCTS, chosen)), "measurements": measurements,
                              "recorded": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(records, indent=1, sort_keys=True))


def recorded_choice(candidates, *, cpu: Optional[Cpu] = None,
                    environ: Mapping[str, str] = os.environ) -> Optional[Libraries]:
    """The libraries to take among `candidates` (those whose handlers can be had now) by `cpu`'s record, or None
    where the record did not measure every candidate's every product (none yet, another CPU's, an unreadable one,
    one written before the products were measured apart, or a library installed since): the recorded libraries
    where each is a candidate, else :func:`choose` among the candidates' recorded seconds."""
    entry = read_records(record_path(environ)).get((cpu or this_cpu()).signature)
    measured = entry.get("measurements") if isinstance(entry, dict) else None
    if not candidates or not isinstance(measured, dict) or not all(
            isinstance(measured.get(lib), dict)
            and all(isinstance(measured[lib].get(product), (int, float)) for product in PRODUCTS)
            for lib in candidates):
        return None
    chosen = entry.get("libraries")
    if isinstance(chosen, dict) and all(chosen.get(product) in candidates for product in PRODUCTS):
        return Libraries(*(chosen[product] for product in PRODUCTS))
    return choose({lib: {product: float(measured[lib][product]) for product in PRODUCTS} for lib in candidates})
