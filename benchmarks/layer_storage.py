"""How the layers' weights are stored, timed on the dense part of a SmolLM2-135M forward + backward.

    python -m benchmarks.layer_storage [--reps 10] [--layers 30] [--rows 384] [--json F]

ppojax stacks each per-layer weight along a leading ``layers`` axis and runs the layers under ``lax.scan``.
XLA:CPU hands a dot whole buffers, so every iteration first copies its layer's weights out of the stack
(``dynamic-slice``), once in the forward and once in the backward, and writes each layer's weight gradient into
the stacked gradient (``dynamic-update-slice``). This benchmark runs the same layers four ways:

- ``scan_stacked``: ``lax.scan`` over stacked weights (what ppojax does);
- ``unrolled_separate``: a Python loop over per-layer arrays, each its own buffer (the storage change: no
  copies at all);
- ``unrolled_static_slices``: a Python loop over static slices of the stacked weights (``scan_layers=False``);
- ``unstacked_per_call``: stacked storage, split into per-layer buffers once per call (one bulk copy, a custom
  VJP stacks the gradients back), then the Python loop;
- ``scan_stacked_onednn``: ``lax.scan`` over stacked weights whose products read each layer's kernel in place
  (``ppojax.backends.cpu.stacked_matmul``: oneDNN's GEMM through jax.ffi, what ppojax's float32 models do on one CPU
  device since the seventeenth session), when its handlers can be had.

The layer is the dense part of a Llama block (q, k, v, o projections with SmolLM2's GQA widths, the gated MLP,
two residual adds), no attention or norms, so the difference is the weight traffic, not the math. Every
variant computes the same gradient (``tests/test_benchmarks.py`` checks it). The figures per host are in
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import time

HIDDEN, INTERMEDIATE, Q_WIDTH, KV_WIDTH = 576, 1536, 576, 192  # SmolLM2-135M: 9 heads, 3 KV heads of 64


def init_stacked(layers: int, hidden=HIDDEN, intermediate=INTERMEDIATE, q_width=Q_WIDTH, kv_width=KV_WIDTH,
                 std=0.02, seed=0) -> dict:
    """Stacked weights ``{name: f32[layers, in, out]}``, normal with ``std`` (transformers' Llama init)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = dict(q=(hidden, q_width), k=(hidden, kv_width), v=(hidden, kv_width), o=(q_width, hidden),
                  gate=(hidden, intermediate), up=(hidden, intermediate), down=(intermediate, hidden))
    return {name: (rng.standard_normal((layers, *shape)) * std).astype(np.float32)
            for name, shape in shapes.items()}


def _layer(x, w):
    """x f32[rows, hidden] -> f32[rows, hidden]: the projections of a block; q, k, v meet in a cheap product
    standing in for attention so that none of them is dead code. w: {name: weight [in, out] or a function
    computing ``input @ weight``}."""
    import jax
    import jax.numpy as jnp

    mm = {name: (m if callable(m) else (lambda a, m=m: a @ m)) for name, m in w.items()}  # a weight or a product
    q, k, v = mm["q"](x), mm["k"](x), mm["v"](x)
    mixed = q * jnp.tile(k * v, q.shape[-1] // k.shape[-1])
    h = x + mm["o"](mixed)
    return h + mm["down"](jax.nn.silu(mm["gate"](h)) * mm["up"](h))


def _loss(x):
    import jax.numpy as jnp

    return jnp.mean(x * x)


def variants() -> dict:
    """name -> (loss(weights, x), how the weights are passed: "stacked" or "separate")."""
    import jax
    import jax.numpy as jnp

    def scan_stacked(stacked, x):
        y, _ = jax.lax.scan(lambda c, w: (_layer(c, w), None), x, stacked)
        return _loss(y)

    def unrolled_separate(layers, x):
        for w in layers:
            x = _layer(x, w)
        return _loss(x)

    def unrolled_static_slices(stacked, x):
        for i in range(next(iter(stacked.values())).shape[0]):
            x = _layer(x, {name: a[i] for name, a in stacked.items()})
        return _loss(x)

    @jax.custom_vjp
    def unstack(a):
        return jax.lax.optimization_barrier([a[i] for i in range(a.shape[0])])

    unstack.defvjp(lambda a: (unstack(a), None), lambda _, grads: (jnp.stack(grads),))

    def unstacked_per_call(stacked, x):
        columns = {name: unstack(a) for name, a in stacked.items()}
        for i in range(len(next(iter(columns.values())))):
            x = _layer(x, {name: column[i] for name, column in columns.items()})
        return _loss(x)

    out = {"scan_stacked": (scan_stacked, "stacked"), "unrolled_separate": (unrolled_separate, "separate"),
           "unrolled_static_slices": (unrolled_static_slices, "stacked"),
           "unstacked_per_call": (unstacked_per_call, "stacked")}
    from ppojax.backends.cpu import stacked_matmul

    if not stacked_matmul.unavailable_reason():
        def scan_stacked_onednn(stacked, x):
            def layer(h, i):
                w = {name: (lambda a, s=s: stacked_matmul.matmul(a, s, i)) for name, s in stacked.items()}
                return _layer(h, w), None
            y, _ = jax.lax.scan(layer, x, jnp.arange(next(iter(stacked.values())).shape[0], dtype=jnp.int32))
            return _loss(y)

        out["scan_stacked_onednn"] = (scan_stacked_onednn, "stacked")
    return out


def gradients(stacked: dict, x) -> dict:
    """name -> the variant's gradient of the loss w.r.t. the weights, as stacked numpy arrays (the check)."""
    import jax
    import numpy as np

    out = {}
    for name, (loss, layout) in variants().items():
        weights = _as(layout, stacked)
        grads = jax.jit(jax.grad(loss))(weights, x)
        if layout == "separate":
            grads = {k: np.stack([np.asarray(g[k]) for g in grads]) for k in stacked}
        out[name] = {k: np.asarray(v) for k, v in grads.items()}
    return out


def _as(layout: str, stacked: dict):
    import jax.numpy as jnp

    if layout == "stacked":
        return {k: jnp.asarray(v) for k, v in stacked.items()}
    layers = next(iter(stacked.values())).shape[0]
    return [{k: jnp.asarray(v[i]) for k, v in stacked.items()} for i in range(layers)]


def measure(layers: int, rows: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    stacked = init_stacked(layers)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, HIDDEN)).astype(np.float32))
    weights_per_layer = sum(a[0].size for a in stacked.values())
    # forward + backward (2x) of every projection; the first layer's input gradient is not needed, so this
    # counts a little more than runs, the same for every variant
    flops = 3 * 2 * rows * weights_per_layer * layers
    result = {"layers": layers, "rows": rows, "gflop": flops / 1e9, "variants": {}}
    for name, (loss, layout) in variants().items():
        weights = _as(layout, stacked)
        step = jax.jit(jax.grad(loss))
        t0 = time.perf_counter()
        compiled = step.lower(weights, x).compile()
        compile_s = time.perf_counter() - t0
        jax.block_until_ready(compiled(weights, x))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(weights, x))
            times.append(time.perf_counter() - t0)
        best, median = min(times), float(np.median(times))
        result["variants"][name] = {"best_s": best, "median_s": median, "compile_s": compile_s,
                                    "gflop_per_s_best": flops / best / 1e9}
        print(f"{name:24s} best {best * 1e3:7.1f} ms  median {median * 1e3:7.1f} ms  "
              f"{flops / best / 1e9:6.1f} GFLOP/s  compile {compile_s:.1f} s", flush=True)
    return result


def main(argv=None) -> int:
    from ppojax.backends.cpu.program_start import start_program

    start_program()  # huge pages and this CPU's XLA options, as the ppojax command runs
    from benchmarks.common import machine_info, positive_int

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=positive_int, default=10)
    p.add_argument("--layers", type=positive_int, default=30)
    p.add_argument("--rows", type=positive_int, default=384, help="tokens per call (the benchmark's 8 x 48)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = dict(machine=machine_info(), **measure(a.layers, a.rows, a.reps))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
