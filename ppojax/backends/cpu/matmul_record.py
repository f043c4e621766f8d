"""Which GEMM library `matmul_implementation: auto` takes on this CPU for each product of each projection shape,
from a measurement there.

oneDNN's and MKL's float32 GEMMs win on different CPUs at a model's shapes (on a Zen 4
host oneDNN's in-place products beat MKL's; TRL's update, on MKL, ran faster on an Intel AMX host than ppojax's on
oneDNN), on different products of one CPU (oneDNN's matmul primitive reads a layer transposed, the input
gradient, faster than its sgemm on both hosts), and on different shapes of one product (on the Intel host MKL led
SmolLM2's 576 -> 1536 and 1536 -> 576 products, the primitive its 576 -> 192 ones, oneDNN's sgemm its 576 -> 576
weight gradient), so the choice is a measurement per projection shape (a layer kernel's
``(d_in, d_out)``) and product, never a rule typed in for one host. The measured seconds per shape, library and
product are recorded under this CPU's signature (its model name and instruction sets, as
``ppojax.backends.cpu.xla_options`` keys its records) in ``~/.cache/ppojax/matmul_library.json``, with the libraries
chosen (:func:`choose`: per product the fastest, but oneDNN's sgemm unless another beats it by 10 %). ``matmul_tuning``
writes it: the first model "auto" puts on the in-place handlers on a CPU whose record did not measure its
projection shapes (or every library and product to be had now there) measures a few seconds' worth of those
shapes' products, one layer at a time.

"onednn", "onednn_primitive" and "mkl" name their library for every product whatever the record says.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

from ppojax.io.strict_json import write_text_atomic
from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.capabilities import Cpu
from ppojax.backends.cpu.xla_options import read_records, record_path as _records_path

RECORD_FILE = "matmul_library.json"
#: another library replaces oneDNN's sgemm (the default) for a product only when it takes at most this share of
#: oneDNN's time there: smaller leads in isolated GEMMs gave no measurably faster step
RECORD_MARGIN = 0.9
#: a projection's three products, each measured and chosen on its own (among the libraries only: XLA's dot, which
#: reads no weight for the weight gradient, led it in isolation on one host yet made a whole step slower on another)
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


Shape = tuple  # (d_in, d_out): a projection's layer kernel read as a matrix [d_in, d_out]


def shape_key(shape: Shape) -> str:
    """"576x1536": a shape as the record keys it."""
    d_in, d_out = shape
    return f"{int(d_in)}x{int(d_out)}"


def record_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/ppojax/matmul_library.json`` (``~/.cache/ppojax/...``)."""
    return _records_path(environ, RECORD_FILE)


def record(chosen: Mapping[Shape, Libraries], measurements: Mapping[Shape, dict], libraries, *,
           cpu: Optional[Cpu] = None, environ: Mapping[str, str] = os.environ) -> Path:
    """Record `chosen` ({shape: libraries}, each product's library one of `libraries`) as the measured choice for
    `cpu` (default: this one), each shape's `measurements` (what decided it: {library: {product: seconds}}) kept
    beside it. The CPU's other shapes and other CPUs' records are kept. Written atomically."""
    for libs in chosen.values():
        for library in libs:
            if library not in libraries:
                raise ValueError(f"library {library!r}: expected one of {', '.join(libraries)}")
    cpu = cpu or capabilities.probe()
    path = record_path(environ)
    records = read_records(path)
    entry = records.get(cpu.signature)
    shapes = dict(entry["shapes"]) if isinstance(entry, dict) and isinstance(entry.get("shapes"), dict) else {}
    for shape, libs in chosen.items():
        shapes[shape_key(shape)] = {"libraries": dict(zip(PRODUCTS, libs)), "measurements": measurements[shape]}
    records[cpu.signature] = {"shapes": shapes, "recorded": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(records, indent=1, sort_keys=True))


def recorded_choice(candidates, shapes, *, cpu: Optional[Cpu] = None,
                    environ: Mapping[str, str] = os.environ) -> dict:
    """{shape: libraries} for those of `shapes` whose entry in `cpu`'s record measured every product of every one
    of `candidates` (the libraries whose handlers can be had now): the recorded libraries where each is a
    candidate, else :func:`choose` among the candidates' recorded seconds. A shape is left out where the record
    did not measure it so (none yet, another CPU's, an unreadable one, one written before shapes and products were
    measured apart, or a library installed since)."""
    entry = read_records(record_path(environ)).get((cpu or capabilities.probe()).signature)
    by_shape = entry.get("shapes") if isinstance(entry, dict) else None
    if not candidates or not isinstance(by_shape, dict):
        return {}
    found = {}
    for shape in shapes:
        cell = by_shape.get(shape_key(shape))
        measured = cell.get("measurements") if isinstance(cell, dict) else None
        if not isinstance(measured, dict) or not all(
                isinstance(measured.get(lib), dict)
                and all(isinstance(measured[lib].get(product), (int, float)) for product in PRODUCTS)
                for lib in candidates):
            continue
        chosen = cell.get("libraries")
        if isinstance(chosen, dict) and all(chosen.get(product) in candidates for product in PRODUCTS):
            found[shape] = Libraries(*(chosen[product] for product in PRODUCTS))
        else:
            found[shape] = choose({lib: {product: float(measured[lib][product]) for product in PRODUCTS}
                                   for lib in candidates})
    return found
