"""Which GEMM library the in-place handlers (`stacked_matmul`) run for each product of each projection shape
(:func:`library_of`, :func:`unavailable_on`): the one a `matmul_implementation` names, or for "auto" this CPU's
record (`matmul_record`), else a measurement here (:func:`tune`): the libraries timed once per projection shape and
product, the fastest kept.

The first model that "auto" puts on the in-place handlers (`stacked_matmul`) on a CPU whose record
(`matmul_record`) did not measure its projection shapes with every library to be had now times ppojax's handlers
on each of them and records the seconds and the libraries chosen (`matmul_record.choose`: one per shape and
product) under this CPU's signature; later processes on that CPU read the record. What is timed is what a
training step asks of them: one layer's forward, input-gradient and weight-gradient products (`x @ W`, `g @ W.T`,
`x.T @ g`; a tied LM head's products are these three kinds too, of its embedding's shape), each product of each
shape timed on its own, at an update's 384 token rows, the weights read in place from a stack of a few layers in a
layer scan (each layer's operands its own, as the update's backward has them; an LM head's weight alone).
The libraries and products take turns within each round; each one's figure is its fastest round (what another
process's load cannot make faster). A few seconds per shape at SmolLM2-135M's sizes, once per CPU, said when it
runs; ``python -m ppojax.backends.cpu.matmul_tuning`` does it ahead, at SmolLM2-135M's shapes.
"""
from __future__ import annotations

import argparse
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ppojax.backends.cpu import matmul_record, stacked_matmul
from ppojax.backends.cpu.matmul_record import PRODUCTS, Libraries
from ppojax.backends.cpu.stacked_matmul import LIBRARIES, LIBRARY_NAMES, PRODUCT_NAMES

#: (d_in, d_out) of SmolLM2-135M's projections: q/o, k/v, gate/up, down, and its tied LM head (the embedding
#: [V, D], read transposed) (what the once-per-machine command measures)
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (49152, 576))
#: a weight of at least this many elements (an LM head's) is measured as one layer, in at most 2 rounds: a stack of
#: several would take memory, and the rounds time, for no better figure
LARGE_WEIGHT_ELEMENTS = 1 << 24
ROWS = 384  # the benchmark's update micro-batch: 8 sequences of 48 tokens
LAYERS = 4  # a stack larger than the last-level cache of most CPUs, read layer by layer as a scan does
ROUNDS = 5


def operands(shapes, rows: int = ROWS, layers: int = LAYERS, seed: int = 0) -> list:
    """Per shape (x f32[layers, rows, d_in], stack f32[layers, d_in, d_out], g f32[layers, rows, d_out])."""
    rng = np.random.default_rng(seed)
    return [tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * scale)
                  for shape, scale in (((layers, rows, d_in), 1.0), ((layers, d_in, d_out), 0.02),
                                       ((layers, rows, d_out), 1.0)))
            for d_in, d_out in shapes]


def products(library: str, product: str):
    """A jitted function of `operands(shapes)` running every layer's `product` ("fwd", "dx" or "dw":
    `matmul_record.PRODUCTS`) through `library`'s handlers (registered: `stacked_matmul.unavailable_reason` first)
    -> f32[] (one element of each product, which keeps them all)."""
    one_layer = {"fwd": lambda x, stack, g, i: stacked_matmul._gemm(x[i], stack, i, False, library),
                 "dx": lambda x, stack, g, i: stacked_matmul._gemm(g[i], stack, i, True, library),
                 "dw": lambda x, stack, g, i: stacked_matmul.weight_grad(x[i], g[i], library)}[product]

    def one_shape(x, stack, g):
        def layer(total, i):
            return total + one_layer(x, stack, g, i)[0, 0], None

        return jax.lax.scan(layer, jnp.float32(0), jnp.arange(stack.shape[0]))[0]

    return jax.jit(lambda ops: sum(one_shape(*shape) for shape in ops))


def measure(libraries, rounds: int = ROUNDS, shapes=SHAPES, rows: int = ROWS, layers: int = LAYERS) -> dict:
    """{shape: {library: {product: seconds of one pass of `products` at that shape}}} (each its fastest of
    `rounds`) for `libraries` (their handlers registered) at `shapes` ((d_in, d_out) each; `layers` of each, but
    one of a `LARGE_WEIGHT_ELEMENTS` weight, in at most 2 rounds), every library's products taking turns within
    each round after one untimed pass each."""
    passes = {(library, product): products(library, product) for library in libraries for product in PRODUCTS}
    seconds = {}
    for shape in shapes:
        large = shape[0] * shape[1] >= LARGE_WEIGHT_ELEMENTS
        ops = operands((shape,), rows, 1 if large else layers)
        for run in passes.values():
            jax.block_until_ready(run(ops))  # compiles, and wakes the library's threads
        best = {key: float("inf") for key in passes}
        order = list(passes)
        for r in range(min(rounds, 2) if large else rounds):
            for key in order[r % len(order):] + order[:r % len(order)]:
                start = time.perf_counter()
                jax.block_until_ready(passes[key](ops))
                best[key] = min(best[key], time.perf_counter() - start)
        seconds[tuple(shape)] = {library: {product: best[library, product] for product in PRODUCTS}
                                 for library in libraries}
    return seconds


def tune(candidates, shapes) -> dict:
    """Measure `candidates` (libraries whose handlers are built; any that will not load is left out) at `shapes`,
    record the choice for this CPU and return it ({shape: a library per product}); say what was measured. A failed
    measurement takes oneDNN's sgemm and records nothing (said)."""
    candidates = [lib for lib in candidates if not stacked_matmul.unavailable_reason(lib)]  # loaded and registered
    onednn = {tuple(shape): Libraries.every("onednn") for shape in shapes}
    if "onednn" not in candidates:  # the baseline (library_of): nothing to measure against
        return onednn
    names = ", ".join(LIBRARY_NAMES[lib] for lib in candidates)
    at = ", ".join(map(matmul_record.shape_key, shapes))
    print(f"ppojax: matmul_implementation 'auto': timing {names} once for this CPU at {at} ...", flush=True)
    start = time.perf_counter()
    try:
        with jax.ensure_compile_time_eval():  # run now, also when a model's trace asked (not staged into it)
            seconds = measure(tuple(candidates), shapes=tuple(map(tuple, shapes)))
    except Exception as err:  # noqa: BLE001 - the choice is a speed-up only; oneDNN's sgemm is the default
        print(f"ppojax: the measurement failed ({type(err).__name__}: {err}); 'auto' takes {LIBRARY_NAMES['onednn']}",
              flush=True)
        return onednn
    chosen = {shape: matmul_record.choose(by_library) for shape, by_library in seconds.items()}
    where = ""
    try:
        where = f", recorded in {matmul_record.record(chosen, seconds, tuple(LIBRARIES))}"
    except OSError as err:  # a read-only cache: this process still takes the measured choice
        where = f" (not recorded: {err})"
    timings = "; ".join(f"{matmul_record.shape_key(shape)} " + ", ".join(
        f"{lib} " + "/".join(f"{s * 1e3:.1f}" for s in by_product.values()) for lib, by_product in by_library.items())
        for shape, by_library in seconds.items())
    print(f"ppojax: 'auto' takes {described(chosen)} (ms for fwd/dx/dw: {timings}; "
          f"{time.perf_counter() - start:.1f} s{where})", flush=True)
    return chosen


# ------------------------------------------------------------------ the choice: the record, else a measurement

def library_of(implementation: str, shapes=None) -> dict:
    """{shape: the GEMM library of each product} for each of `shapes` (projection shapes `(d_in, d_out)`; default
    `SHAPES`, SmolLM2-135M's) as an implementation's handlers run them: its own for a library's name
    ("onednn", "onednn_primitive", "mkl"); for "auto" per shape and product the one measured fastest on this CPU
    among those whose handlers can be had (`matmul_record`; measured now, once per CPU and shape, where no record
    covers them all: :func:`tune`); oneDNN's sgemm where it cannot be had itself (then `CpuKernels.for_shapes` keeps
    XLA's dots: oneDNN's in-place products are the ones measured faster than XLA's copy-then-dot, the others are
    measured against them)."""
    shapes = tuple(dict.fromkeys(tuple(map(int, shape)) for shape in (SHAPES if shapes is None else shapes)))
    if implementation in LIBRARIES:
        return {shape: Libraries.every(implementation) for shape in shapes}
    onednn = {shape: Libraries.every("onednn") for shape in shapes}
    candidates = stacked_matmul.buildable_libraries()
    if "onednn" not in candidates:  # the baseline the others must beat, itself measured against XLA's dots
        return onednn  # (not to be had: `CpuKernels.for_shapes` keeps XLA's dots)
    chosen = matmul_record.recorded_choice(candidates, shapes)
    missing = tuple(shape for shape in shapes if shape not in chosen)
    if missing:
        chosen.update(_measured_choice(candidates, missing))
    chosen = {shape: chosen[shape] for shape in shapes}
    if any(map(stacked_matmul.unavailable_reason, libraries_in(chosen))):  # handlers that would not load
        return onednn
    if chosen != onednn and not missing:  # a choice measured now was said by the measurement
        _announce_recorded(tuple(chosen.items()))
    return chosen


def libraries_in(chosen: dict) -> tuple:
    """The distinct libraries a choice ({shape: Libraries}) runs, in order."""
    return tuple(dict.fromkeys(library for libraries in chosen.values() for library in libraries))


def described(chosen: dict) -> str:
    """A choice ({shape: Libraries}) in words: "oneDNN's sgemm for the projections" (every shape and product
    alike), or "at 576x576 oneDNN's sgemm; at 576x1536 MKL's sgemm for the forward products, ..."."""
    def one(libraries: Libraries) -> str:
        if len(set(libraries)) == 1:
            return LIBRARY_NAMES[libraries.fwd]
        return ", ".join(f"{LIBRARY_NAMES[library]} for {PRODUCT_NAMES[product]}"
                         for product, library in zip(PRODUCTS, libraries))

    if len(chosen) > 1 and len(set(chosen.values())) == 1 and len(set(next(iter(chosen.values())))) == 1:
        return f"{LIBRARY_NAMES[next(iter(chosen.values())).fwd]} for the projections"
    return "; ".join(f"at {matmul_record.shape_key(shape)} {one(libraries)}" for shape, libraries in chosen.items())


def choice_str(chosen: dict) -> str:
    """A choice in short: "onednn", "fwd onednn, dx mkl, dw mkl" (every shape alike), or
    "576x576 onednn; 576x192 fwd onednn_primitive, dx onednn, dw onednn; ..."."""
    if len(set(chosen.values())) == 1:
        return str(next(iter(chosen.values())))
    return "; ".join(f"{matmul_record.shape_key(shape)} {libraries}" for shape, libraries in chosen.items())


def unavailable_on(devices: int, implementation: str = "onednn", shapes=None) -> str:
    """"" when `implementation`'s in-place products can run on `devices` devices of the default backend (one CPU
    device, the handlers of `library_of(implementation, shapes)` registered), else why not. The devices are checked
    first: "auto" chooses its libraries (building handlers, measuring once per CPU) only where the products can
    run."""
    if jax.default_backend() != "cpu" or devices != 1:
        return f"it runs on a single CPU device, and here are {devices} {jax.default_backend()} device(s)"
    chosen = library_of(implementation, shapes)
    return next(filter(None, map(stacked_matmul.unavailable_reason, libraries_in(chosen))), "")


_tuning_lock = threading.Lock()  # a compile_ahead thread and the main thread may both trace first


def _measured_choice(candidates: tuple, shapes: tuple) -> dict:
    """:func:`tune` ``(candidates, shapes)``, at most once per process, set of candidates and shapes (a record
    that cannot be written is not measured again at every trace)."""
    with _tuning_lock:
        return _tuned(candidates, shapes)


@functools.cache
def _tuned(candidates: tuple, shapes: tuple) -> dict:
    return tune(candidates, shapes)


@functools.cache
def _announce_recorded(chosen: tuple) -> None:
    """Say once per process and choice ((shape, Libraries) pairs) that "auto" follows this CPU's record (as the
    recorded XLA:CPU options are said)."""
    print(f"ppojax: matmul_implementation 'auto' takes {described(dict(chosen))}, measured fastest on this CPU "
          f"(recorded in {matmul_record.record_path()}; naming another implementation overrides it)", flush=True)


def main(argv=None) -> int:
    """``python -m ppojax.backends.cpu.matmul_tuning [--again]``: the GEMM libraries "auto" takes on this CPU.

    Builds the in-place handlers of every library that can be had and says which ones "auto" takes at
    SmolLM2-135M's shapes, measuring now where no record covers them (``--again``: measure anew whatever the record
    says). A once-per-machine step a deployment can run ahead of training."""
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--again", action="store_true", help="measure anew whatever this CPU's record says")
    args = parser.parse_args(argv)
    stacked_matmul.build_all_handlers()
    for library in LIBRARIES:
        print(f"{library}: {stacked_matmul.unavailable_reason(library) or 'handlers ready'}")
    if stacked_matmul.unavailable_reason("onednn"):
        print(f"'auto' keeps XLA's dots here: oneDNN's handlers, the in-place baseline, cannot be had "
              f"({stacked_matmul.unavailable_reason('onednn')})")
        return 0
    candidates = tuple(lib for lib in LIBRARIES if not stacked_matmul.unavailable_reason(lib))
    chosen = tune(candidates, SHAPES) if args.again else library_of("auto", SHAPES)
    print(f"'auto' takes: {choice_str(chosen)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
