"""Float32 GEMM rates at SmolLM2-135M's own shapes, by each implementation a PPO update on the CPU can run.

    python -m benchmarks.gemm_shapes [--rounds 10] [--only xla,onednn,onednn_primitive,mkl,torch] [--json F]
                                     [--record]

The implementations:

- ``xla``: XLA's dot on whole operands (ppojax's `matmul_implementation: xla`);
- ``onednn``: oneDNN's GEMM on one layer of a stacked kernel, in place (`ppojax.backends.cpu.stacked_matmul`'s handlers:
  ppojax's default projections on a single CPU device), where the wheel and the handlers can be had;
- ``onednn_primitive``: the handlers on oneDNN's matmul primitive (its brgemm kernels where the CPU has them;
  `matmul_implementation: onednn_primitive`) instead of its `dnnl_sgemm`: whether oneDNN's API matters on a CPU
  (the nineteenth session's ``onednn_matmul`` column, a benchmark-only handler of the same primitive);
- ``mkl``: ppojax's handlers on MKL's `sgemm_` as torch's x86 wheels carry it (`matmul_implementation: mkl`):
  whether the handlers on MKL run at torch's rates (``torch`` adds its own dispatch and, for ``dw``, a transposed
  output);
- ``torch``: `torch.nn.functional.linear` and the products of its backward (what TRL's step runs: MKL's sgemm in
  torch's x86 wheels), with as many threads as this process may use.

For each distinct projection shape of a layer (q/o 576 -> 576, k/v 576 -> 192, gate/up 576 -> 1536, down 1536 -> 576,
at the update's 384 token rows) and for the tied LM head (the embedding W [49152, 576] at the 256 response rows),
the three products of a training step: ``fwd`` x @ W, ``dx`` g @ W.T, ``dw`` x.T @ g, for 30 layers in turn (each
its own operands, as a layer scan's backward has them; the LM head once: its forward, hidden states times W.T, is
the ``dx`` kind, its input gradient the ``fwd`` kind, its weight gradient the ``dw`` kind). Each figure is the median over ``rounds`` of such a pass; the
implementations take turns within each round, each after one untimed pass (that wakes its threads). ``update_s``
sums one PPO update's products as the benchmark's work runs them (4 epochs; policy and value model, 30 layers
each; the policy's LM head): the time the update's GEMMs alone would take, by implementation, and as ppojax runs
them (``ppojax``: each product of each shape, the head's too, by the in-place library ``--record`` would record from
these figures); ``update_s_by_product``: the projections' seconds per implementation and product.
The projections' forward at a decode step's 8 rows too (``decode_step_s``: one decode step's projections, the
policy's 30 layers): there the in-place columns run the handlers' own few-row kernels where the CPU has them
(`stacked_matmul.few_rows_limit`, whatever the library), the library's GEMM elsewhere. Run it pinned
(`taskset`) to the cores compared. ``--record``: record for each projection shape and product the in-place library
(``onednn``, ``onednn_primitive`` or ``mkl``) that was fastest there as this CPU's choice for
`matmul_implementation: auto` at those shapes (`ppojax.backends.cpu.matmul_record`); oneDNN's sgemm stays unless another
beats it by 10 % (`matmul_record.RECORD_MARGIN`).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

HIDDEN, KV, INTERMEDIATE, VOCAB, LAYERS = 576, 192, 1536, 49152, 30  # SmolLM2-135M
UPDATE_ROWS, RESPONSE_ROWS, EPOCHS, MODELS = 8 * 48, 8 * 32, 4, 2  # the benchmark's work (benchmarks.common)
#: (name, rows, d_in, d_out, uses per layer and model) — `uses` None: the tied LM head (W: the embedding [V, D]),
#: once per update epoch
SHAPES = (("q_o", UPDATE_ROWS, HIDDEN, HIDDEN, 2), ("k_v", UPDATE_ROWS, HIDDEN, KV, 2),
          ("gate_up", UPDATE_ROWS, HIDDEN, INTERMEDIATE, 2), ("down", UPDATE_ROWS, INTERMEDIATE, HIDDEN, 1),
          ("lm_head", RESPONSE_ROWS, VOCAB, HIDDEN, None))
#: the same projections at a decode step's rows (one new token of each of the 8 sequences): the forward only, the
#: policy alone (generation); ppojax multiplies these in place where the CPU has its few-row kernels
DECODE_ROWS = 8
DECODE_SHAPES = tuple((f"{name}@decode", DECODE_ROWS, d_in, d_out, uses)
                      for name, _rows, d_in, d_out, uses in SHAPES if uses is not None)
PRODUCTS = ("fwd", "dx", "dw")
IMPLEMENTATIONS = ("xla", "onednn", "onednn_primitive", "mkl", "torch")


def operands(rows: int, d_in: int, d_out: int, layers: int, seed: int = 0) -> dict:
    """float32 numpy, one of each per layer (as the layer scan's backward has): x [layers, rows, d_in],
    w [layers, d_in, d_out], g [layers, rows, d_out]."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((layers, rows, d_in), np.float32),
            "w": (rng.standard_normal((layers, d_in, d_out), np.float32) * 0.02).astype(np.float32),
            "g": rng.standard_normal((layers, rows, d_out), np.float32)}


def reference(product: str, ops: dict, layer: int) -> np.ndarray:
    """One layer's product in float64: fwd [rows, d_out], dx [rows, d_in], dw [d_in, d_out]."""
    x, w, g = (ops[k][layer].astype(np.float64) for k in ("x", "w", "g"))
    return {"fwd": x @ w, "dx": g @ w.T, "dw": x.T @ g}[product]


# Each implementation gives, per product, (every_layer, one_layer): `every_layer()` runs the product for every
# layer in turn (as a layer scan does; the outputs are dropped but one element, so that nothing but the GEMMs and
# what an implementation needs around them is timed) and returns something to wait on; `one_layer(i)` returns
# layer i's product, to check the value.

def xla_products(ops: dict) -> dict:
    """XLA's dots in a `lax.scan` over the stacked operands (the layer's weights sliced out of the stack first,
    as XLA:CPU's dot takes whole buffers: ppojax's `xla` projections)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    x, w, g = (jnp.array(ops[k]) for k in ("x", "w", "g"))  # in XLA's own buffers, as a model's are
    dims = {"fwd": (((1,), (0,)), ((), ())), "dx": (((1,), (1,)), ((), ())),  # the forms autodiff of x @ w gives
            "dw": (((0,), (0,)), ((), ()))}
    pairs = {"fwd": ("x", "w"), "dx": ("g", "w"), "dw": ("x", "g")}
    arrays = {"x": x, "w": w, "g": g}

    def product(name, a, b):
        return lax.dot_general(a, b, dims[name])

    def scan(name):
        def body(carry, ab):
            return carry + product(name, *ab)[0, 0], None
        first, second = (arrays[k] for k in pairs[name])
        return jax.jit(lambda a, b: lax.scan(body, jnp.float32(0), (a, b))[0]), first, second

    out = {}
    for name in PRODUCTS:
        every, a, b = scan(name)
        one = jax.jit(lambda a, b, name=name: product(name, a, b))
        out[name] = (lambda every=every, a=a, b=b: every(a, b),
                     lambda i, one=one, a=a, b=b: one(a[i], b[i]))
    return out


def _scanned_over_layer_index(layer_product: dict, arrays: tuple) -> dict:
    """(every_layer, one_layer) per product for custom calls that take the layer's index: `layer_product[name](x,
    w, g, i)` run for i in a `lax.scan` over every layer of `arrays` = (x, w, g)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    layers = jnp.arange(arrays[1].shape[0], dtype=jnp.int32)
    out = {}
    for name in PRODUCTS:
        def every(x, w, g, name=name):
            return lax.scan(lambda carry, i: (carry + layer_product[name](x, w, g, i)[0, 0], None),
                            jnp.float32(0), layers)[0]
        every, one = jax.jit(every), jax.jit(layer_product[name])
        out[name] = (lambda every=every: every(*arrays), lambda i, one=one: one(*arrays, jnp.int32(i)))
    return out


def _handler_products(ops: dict, library: str) -> dict:
    """ppojax's in-place handlers on `library`'s GEMM in a `lax.scan` over the layer index, the weights read in place
    in the stack. Raises RuntimeError naming why where the handlers cannot be had."""
    import jax
    import jax.numpy as jnp

    from ppojax.backends.cpu import stacked_matmul

    why = stacked_matmul.unavailable_reason(library)
    if why:
        raise RuntimeError(why)
    x, w, g = (jnp.array(ops[k]) for k in ("x", "w", "g"))  # in XLA's own buffers, as a model's are
    weight_grad = jax.ffi.ffi_call(stacked_matmul.TARGETS[library]["weight_grad"],
                                   jax.ShapeDtypeStruct(ops["w"].shape[1:], jnp.float32))
    layer_product = {"fwd": lambda x, w, g, i: stacked_matmul._gemm(x[i], w, i, False, library),
                     "dx": lambda x, w, g, i: stacked_matmul._gemm(g[i], w, i, True, library),
                     "dw": lambda x, w, g, i: weight_grad(x[i], g[i])}
    return _scanned_over_layer_index(layer_product, (x, w, g))


def onednn_products(ops: dict) -> dict:
    """ppojax's oneDNN handlers (its default projections on a single CPU device)."""
    return _handler_products(ops, "onednn")


def mkl_products(ops: dict) -> dict:
    """ppojax's handlers on MKL (`matmul_implementation: mkl`: torch's MKL), with as many threads as this process may
    use: whether the handlers on MKL run at torch's rates."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))  # MKL's threads too
    return _handler_products(ops, "mkl")


def onednn_primitive_products(ops: dict) -> dict:
    """ppojax's handlers on oneDNN's matmul primitive (`matmul_implementation: onednn_primitive`; its brgemm kernels
    where the CPU has them) instead of its `dnnl_sgemm`: whether oneDNN's API is what its rate on a CPU turns on."""
    return _handler_products(ops, "onednn_primitive")


def torch_products(ops: dict) -> dict:
    """torch's `nn.Linear` forward and the two products of its backward, layer by layer from Python (as TRL's
    step runs them; the weight stored [d_out, d_in]), with as many threads as this process may use."""
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    x, g = torch.from_numpy(ops["x"]), torch.from_numpy(ops["g"])
    weight = torch.from_numpy(np.ascontiguousarray(ops["w"].transpose(0, 2, 1)))  # [layers, d_out, d_in]
    layer_product = {"fwd": lambda i: torch.nn.functional.linear(x[i], weight[i]),
                     "dx": lambda i: g[i] @ weight[i],
                     "dw": lambda i: (g[i].t() @ x[i]).t()}  # autograd's [d_out, d_in] gradient, read transposed
    out = {}
    for name in PRODUCTS:
        def every(name=name):
            with torch.no_grad():
                return [layer_product[name](i) for i in range(weight.shape[0])][-1]
        out[name] = (every, layer_product[name])
    return out


def _make(implementation: str, ops: dict) -> dict:
    return {"xla": xla_products, "onednn": onednn_products, "onednn_primitive": onednn_primitive_products,
            "mkl": mkl_products, "torch": torch_products}[implementation](ops)


def _numpy(result) -> np.ndarray:
    return result.numpy() if type(result).__module__.startswith("torch") else np.asarray(result)


def _wait(result):
    if hasattr(result, "block_until_ready"):  # jax dispatches asynchronously
        result.block_until_ready()


def _timed(every_layer) -> float:
    _wait(every_layer())  # untimed: wakes this implementation's threads (another's may still be spinning)
    t0 = time.perf_counter()
    _wait(every_layer())
    return time.perf_counter() - t0


def measure(implementations=IMPLEMENTATIONS, rounds: int = 10, shapes=SHAPES, layers: int = LAYERS,
            decode_shapes=DECODE_SHAPES) -> dict:
    """{"results": {shape: {product: {implementation: {"s", "gflops", "error"}}}}, "unavailable": {impl: why},
    "update_s": {implementation or "ppojax": seconds}, "decode_step_s": {implementation: seconds}}. ``s``: one
    layer's product (the median over `rounds` of a pass over `layers` layers, over `layers`; the LM head: one);
    ``error``: the last layer's largest difference from the float64 product, relative to its largest value.
    `decode_shapes`: the forward only; ``decode_step_s``: one decode step's projections (the policy's layers)."""
    unavailable, results = {}, {}
    work = [(shape, PRODUCTS) for shape in shapes] + [(shape, ("fwd",)) for shape in decode_shapes]
    for (name, rows, d_in, d_out, uses), products_here in work:
        depth = 1 if uses is None else layers
        ops = operands(rows, d_in, d_out, depth)
        calls_by_impl = {}
        for impl in implementations:
            if impl in unavailable:
                continue
            try:
                calls_by_impl[impl] = _make(impl, ops)
            except (RuntimeError, ImportError) as err:
                unavailable[impl] = str(err)
        row = results[name] = {}
        for product in products_here:
            want = reference(product, ops, depth - 1)
            cell = row[product] = {}
            for impl, products in calls_by_impl.items():  # compile and check the value
                got = _numpy(products[product][1](depth - 1)).astype(np.float64)
                cell[impl] = {"error": float(np.abs(got - want).max() / np.abs(want).max())}
            times = {impl: [] for impl in calls_by_impl}
            for r in range(rounds):
                order = list(calls_by_impl) if r % 2 == 0 else list(reversed(calls_by_impl))
                for impl in order:
                    times[impl].append(_timed(calls_by_impl[impl][product][0]) / depth)
            flops = 2.0 * rows * d_in * d_out
            for impl, ts in times.items():
                s = statistics.median(ts)
                cell[impl].update(s=s, gflops=flops / s / 1e9)
    decode = {impl: sum(uses * LAYERS * results[name]["fwd"][impl]["s"] for name, _r, _i, _o, uses in decode_shapes)
              for impl in implementations
              if decode_shapes and all("s" in results[name]["fwd"].get(impl, {}) for name, *_ in decode_shapes)}
    return {"results": results, "unavailable": unavailable, "update_s": update_seconds(results, shapes),
            "update_s_by_product": projections_by_product(results, shapes), "decode_step_s": decode}


def _uses_per_update(uses) -> int:
    """How many times one PPO update runs a shape's product (`uses` per layer, or None: the LM head, once)."""
    return EPOCHS * (1 if uses is None else uses * LAYERS * MODELS)


def projections_by_product(results: dict, shapes=SHAPES) -> dict:
    """{implementation: {product: seconds}}: one PPO update's layer projections (the LM head left out)
    per product, for the implementations measured at every shape."""
    found = {impl for cells in results.values() for cell in cells.values() for impl in cell}
    layers = [(name, uses) for name, _rows, _d_in, _d_out, uses in shapes if uses is not None]
    return {impl: {product: sum(_uses_per_update(uses) * results[name][product][impl]["s"] for name, uses in layers)
                   for product in PRODUCTS}
            for impl in IMPLEMENTATIONS if impl in found
            and all("s" in results[name][product].get(impl, {}) for name, _ in layers for product in PRODUCTS)}


def update_seconds(results: dict, shapes=SHAPES) -> dict:
    """One PPO update's GEMM seconds (the benchmark's work) by implementation, and as ppojax runs them (each
    product of each shape, the LM head's too, by the library `fastest_libraries` takes; XLA's where none was
    measured)."""
    found = {impl for cells in results.values() for cell in cells.values() for impl in cell}

    def total(pick) -> float | None:  # pick(name, uses, product) -> implementation
        seconds = 0.0
        for name, _rows, _d_in, _d_out, uses in shapes:
            for product in PRODUCTS:
                impl = pick(name, uses, product)
                if "s" not in results[name][product].get(impl, {}):
                    return None
                seconds += _uses_per_update(uses) * results[name][product][impl]["s"]
        return seconds

    out = {impl: total(lambda name, uses, product, impl=impl: impl) for impl in IMPLEMENTATIONS if impl in found}
    chosen = (fastest_libraries(results, shapes) or ({},))[0]
    dims = {name: (d_in, d_out) for name, _rows, d_in, d_out, _uses in shapes}
    out["ppojax"] = total(lambda name, uses, product: getattr(chosen[dims[name]], product) if dims[name] in chosen
                          else "xla")
    return out


def fastest_libraries(results: dict, shapes=SHAPES) -> tuple | None:
    """({(d_in, d_out): the in-place libraries to record, one per product (`matmul_record.Libraries`)},
    {(d_in, d_out): {library: {product: seconds of one layer's product}}}) for `shapes` (the layers' projections and
    the LM head), among the in-place libraries measured at every one of them in `results`, or None where none was
    (`matmul_record.choose`: per shape and product the fastest, but oneDNN's sgemm unless another beats it by 10 %)."""
    from ppojax.backends.cpu.matmul_record import choose
    from ppojax.backends.cpu.stacked_matmul import LIBRARIES

    layers = [(name, (d_in, d_out)) for name, _rows, d_in, d_out, _uses in shapes]
    measured = {shape: {lib: {product: results[name][product][lib]["s"] for product in PRODUCTS}
                        for lib in LIBRARIES
                        if all("s" in results[n][product].get(lib, {}) for n, _ in layers for product in PRODUCTS)}
                for name, shape in layers}
    if not layers or not all(measured.values()):
        return None
    return {shape: choose(by_library) for shape, by_library in measured.items()}, measured


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--only", default=",".join(IMPLEMENTATIONS), help="implementations, comma-separated")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--record", action="store_true",
                        help="record the fastest in-place library per shape and product as this CPU's choice for "
                             "matmul_implementation: auto")
    args = parser.parse_args(argv)
    only = [i for i in args.only.split(",") if i]
    unknown = sorted(set(only) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: the implementations are {', '.join(IMPLEMENTATIONS)}")
    if args.record:
        from ppojax.backends.cpu.stacked_matmul import buildable_libraries

        missing = [lib for lib in buildable_libraries() if lib not in only]
        if missing:  # "auto" would measure them itself and replace the record
            parser.error(f"--record with --only {args.only}: a record must measure every in-place library that can "
                         f"be had here; add {','.join(missing)} to --only")
    from benchmarks.common import machine_info
    from ppojax.backends.cpu.program_start import start_program

    start_program()  # as the ppojax command does (mimalloc, the recorded XLA options)
    report = {"machine": machine_info(), "cpus": len(os.sched_getaffinity(0)),
              **measure(only, rounds=args.rounds)}
    for impl, why in report["unavailable"].items():
        print(f"{impl}: not available ({why})")
    shown = [i for i in only if i not in report["unavailable"]]
    print(f"{'shape':18} {'product':7} " + " ".join(f"{i:>13}" for i in shown) + "   (GFLOP/s, median)")
    for name, products in report["results"].items():
        for product, cell in products.items():
            print(f"{name:18} {product:7} " + " ".join(f"{cell[i]['gflops']:13.0f}" for i in shown))
    print("one update's GEMMs (s): " + ", ".join(f"{k} {v:.2f}" for k, v in report["update_s"].items()
                                                 if v is not None))
    print("one update's projections by product (s): " + "; ".join(
        f"{impl} " + " / ".join(f"{product} {v:.2f}" for product, v in by_product.items())
        for impl, by_product in report["update_s_by_product"].items()))
    print("one decode step's projections (ms): " + ", ".join(f"{k} {v * 1e3:.2f}"
                                                             for k, v in report["decode_step_s"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.record:
        from ppojax.backends.cpu import matmul_record
        from ppojax.backends.cpu import stacked_matmul

        fastest = fastest_libraries(report["results"])
        if fastest is None:
            print("--record: no in-place library could be measured here; nothing recorded")
            return 1
        chosen, measured = fastest
        path = matmul_record.record(chosen, measured, tuple(stacked_matmul.LIBRARIES))
        print(f"recorded {stacked_matmul.choice_str(chosen)} for this CPU in {path}: "
              f"matmul_implementation 'auto' takes it at these shapes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
