"""Which bfloat16 matmuls reach the CPU's bf16 units from jax: XLA's own dot forms, and oneDNN through jax.ffi.

    python -m benchmarks.bf16_dots [--reps 20] [--tokens 384] [--json F]

Times, at SmolLM2-135M's shapes (an MLP projection 576 -> 1536 and the LM head 576 -> 49152, ``tokens`` rows),
the three contractions a linear layer's training step runs: the forward ``x @ W`` (``fwd``), the input
gradient ``g @ W.T`` (``dx``, the weight's contracting axis is its minor one) and the weight gradient
``x.T @ g`` (``dw``, the tokens are contracted), each in these forms:

- ``f32``: float32 operands and output (ppojax's ``float32`` policy);
- ``bf16_out``: bfloat16 operands and output (the ``mixed`` and ``bfloat16`` policies' matmuls today);
- ``bf16_f32acc``: bfloat16 operands, float32 output (``preferred_element_type=float32``);
- ``bf16_row_major``: as ``bf16_f32acc``, the operand that autodiff's form contracts on the wrong axis (``W`` of
  ``dx``, ``x`` of ``dw``) transposed into a row-major copy first (a layout constraint), as the 16-bit models'
  backward does (``ppojax.backends.cpu.kernels._matmul_16_bit``); the copy is timed with the product;
- ``onednn_ffi``: oneDNN's ``dnnl_gemm_bf16bf16f32`` called as an XLA custom call (``benchmarks/ffi``), when
  the ``onednn-cpu-gomp`` wheel and a C++ compiler are there (``pip install onednn-cpu-gomp==2023.2.0``);
  the operands arrive as float32 and are rounded to bfloat16 inside the program, as a mixed-precision
  layer's would be.

Each figure is GFLOP/s of the best of ``reps`` calls, with the largest error relative to the largest output
against a float64 product of the same (rounded) operands.

``--step xla|onednn_backward`` times the PPO benchmark's SmolLM2 ``train_step`` (random init, ``precision:
mixed``) instead: ``xla`` as ppojax runs it (since the ninth session its backward products too run in XLA's
bf16 kernels, `ppojax.backends.cpu.kernels._matmul_16_bit`); ``onednn_backward`` with each projection's two backward
products through the custom call (a custom VJP, its outputs saved for the backward like the dots they replace).
Current figures per host: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152  # SmolLM2-135M
FORMS = ("f32", "bf16_out", "bf16_f32acc", "bf16_row_major", "onednn_ffi")
LAYOUTS = ("fwd", "dx", "dw")
FFI_SOURCE = Path(__file__).parent / "ffi" / "bf16_gemm.cc"
FFI_TARGET = "ppojax_bench_bf16_gemm"
FFI_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "ppojax" / "ffi"  # ignored by git


def onednn_library() -> Path | None:
    """The ``libdnnl.so.3*`` of the installed ``onednn-cpu-gomp`` wheel, or None (ppojax's own lookup)."""
    from ppojax.backends.cpu.stacked_matmul import onednn_library as lookup

    return lookup()


def onednn_bf16_unavailable() -> str:
    """"" where this CPU (ppojax's probe) can run oneDNN's bfloat16 GEMM, else one line naming what it lacks."""
    from ppojax.backends.cpu import capabilities

    return capabilities.probe().lacks("onednn_bf16", "oneDNN's bfloat16 GEMM (the onednn_ffi form, --step onednn_backward)",
                         "use XLA's bf16 forms (bf16_f32acc, bf16_row_major; --step xla), which run on any CPU")


def build_ffi(cache_dir: Path) -> tuple[Path | None, str]:
    """Compile ``benchmarks/ffi/bf16_gemm.cc`` against oneDNN, once per source and library, into ``cache_dir``:
    (path, "") or (None, why not: also where this CPU cannot run oneDNN's bfloat16 GEMM)."""
    from ppojax.backends.cpu.ffi.build import build_cached

    why = onednn_bf16_unavailable()
    if why:
        return None, why
    lib = onednn_library()
    if lib is None:
        return None, "onednn-cpu-gomp is not installed (pip install onednn-cpu-gomp==2023.2.0)"
    return build_cached(FFI_SOURCE, FFI_SOURCE.name, lib, cache=cache_dir)


def register_ffi(library: Path) -> None:
    import ctypes

    import jax

    handler = ctypes.cdll.LoadLibrary(str(library)).Bf16Gemm
    jax.ffi.register_ffi_target(FFI_TARGET, jax.ffi.pycapsule(handler), platform="cpu")


def ffi_matmul(a, b, transpose_a: bool, transpose_b: bool):
    """f32[M, N] = op(a) @ op(b) by oneDNN, a and b rounded to bfloat16 first. Raises `CpuFeatureMissing` (before
    anything is traced) on a CPU that cannot run oneDNN's bfloat16 GEMM."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ppojax.backends.cpu.capabilities import CpuFeatureMissing

    why = onednn_bf16_unavailable()
    if why:
        raise CpuFeatureMissing(why)

    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(FFI_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), transpose_a=np.int64(transpose_a),
                transpose_b=np.int64(transpose_b))


def contraction(form: str, layout: str):
    """The jitted function of one (form, layout): (a, b) -> product, a and b as ``operands`` makes them."""
    import jax
    import jax.numpy as jnp

    t_a, t_b = layout == "dw", layout == "dx"
    if form == "onednn_ffi":
        return jax.jit(lambda a, b: ffi_matmul(a, b, t_a, t_b))
    if form == "bf16_row_major":
        from ppojax.backends.cpu.kernels import _row_major_transpose as t

        return jax.jit(lambda a, b: jnp.dot(t(a) if t_a else a, t(b) if t_b else b, preferred_element_type=jnp.float32))
    out = {"f32": None, "bf16_out": None, "bf16_f32acc": jnp.float32}[form]
    return jax.jit(lambda a, b: jnp.dot(a.T if t_a else a, b.T if t_b else b, preferred_element_type=out))


def operands(form: str, layout: str, tokens: int, d_in: int, d_out: int, seed: int = 0):
    """(a, b) of one contraction: fwd x[T, D] @ W[D, F]; dx g[T, F] @ W[D, F].T; dw x[T, D].T @ g[T, F]."""
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.key(seed))
    shapes = {"fwd": ((tokens, d_in), (d_in, d_out)), "dx": ((tokens, d_out), (d_in, d_out)),
              "dw": ((tokens, d_in), (tokens, d_out))}[layout]
    a, b = jax.random.normal(k1, shapes[0]), jax.random.normal(k2, shapes[1])
    if form in ("bf16_out", "bf16_f32acc", "bf16_row_major"):
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return a, b


def reference(form: str, layout: str, a, b):
    """float64 product of the operands the form actually multiplies (bfloat16-rounded for every bf16 form)."""
    import jax.numpy as jnp
    import numpy as np

    if form == "onednn_ffi":
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a.T if layout == "dw" else a) @ (b.T if layout == "dx" else b)


def measure(tokens: int = 384, reps: int = 20, forms=FORMS, cache_dir: Path | None = None) -> dict:
    """{"results": {matrix: {layout: {form: {"gflops", "max_rel_error"}}}}, "onednn_ffi": availability}."""
    import jax
    import numpy as np

    ffi = {"available": False, "why": "not asked for"}
    if "onednn_ffi" in forms:
        library, why = build_ffi(cache_dir or FFI_CACHE)
        ffi = {"available": library is not None, "why": why}
        if library is not None:
            register_ffi(library)
    results = {}
    for matrix, d_out in (("mlp_up", INTERMEDIATE), ("lm_head", VOCAB)):
        flops = 2 * tokens * HIDDEN * d_out
        for layout in LAYOUTS:
            row = results.setdefault(matrix, {}).setdefault(layout, {})
            for form in forms:
                if form == "onednn_ffi" and not ffi["available"]:
                    continue
                a, b = operands(form, layout, tokens, HIDDEN, d_out)
                fn = contraction(form, layout)
                got = np.asarray(jax.block_until_ready(fn(a, b)), np.float64)
                want = reference(form, layout, a, b)
                best = float("inf")
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(a, b))
                    best = min(best, time.perf_counter() - t0)
                row[form] = {"gflops": flops / best / 1e9,
                             "max_rel_error": float(np.abs(got - want).max() / np.abs(want).max())}
    return {"tokens": tokens, "reps": reps, "onednn_ffi": ffi, "results": results}


def onednn_backward_matmul():
    """(x [N, D], w [D, F]) -> bf16 [N, F]: XLA's forward dot, the two backward products through oneDNN."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def matmul(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def backward(residuals, g):
        x, w = residuals
        return (ffi_matmul(g, w, False, True).astype(x.dtype), ffi_matmul(x, g, True, False).astype(w.dtype))

    matmul.defvjp(lambda x, w: (matmul(x, w), (x, w)), backward)
    return matmul


def time_step(variant: str, steps: int = 4) -> dict:
    """Steady seconds per SmolLM2 ``train_step`` under ``precision: mixed`` (``variant``: xla|onednn_backward)
    and the process's peak RSS. ``onednn_backward``: the models get the CPU's kernels with this benchmark's
    projection product and its name saved by ``dots`` (the seam's choice replaced in this process: run it in a
    process of its own)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.ad_checkpoint import checkpoint_name

    from benchmarks.common import make_config, peak_rss_mb
    from benchmarks.ppojax_ppo import build
    from ppojax import backends
    from ppojax.backends.cpu.kernels import CpuKernels
    from ppojax.rl.program import make_train_step

    if variant == "onednn_backward":
        library, why = build_ffi(FFI_CACHE)
        if library is None:
            raise SystemExit(f"onednn_backward: {why}")
        register_ffi(library)
        matmul = onednn_backward_matmul()

        class OnednnBackward(CpuKernels):
            def matmul(self, x, w):
                if x.dtype == jnp.float32:
                    return super().matmul(x, w)
                return checkpoint_name(matmul(x, w.astype(x.dtype)), "projection")

            def dots_policy(self):  # `dots` saves dot outputs; this product is a custom call, saved by its name
                return jax.checkpoint_policies.save_from_both_policies(
                    super().dots_policy(), jax.checkpoint_policies.save_only_these_names("projection"))

        backends.kernels_for = lambda *args, **kwargs: OnednnBackward()
    elif variant != "xla":
        raise SystemExit(f"--step {variant!r}: expected xla or onednn_backward")
    config = dict(make_config("smollm2", num_updates=2), precision="mixed", behaviour_logprobs="sampler")
    program, state, shardings = build(config)
    step = make_train_step(program, shardings)
    prompts = np.asarray(config["prompts"], np.int32)[:config["batch_size"]]
    seconds = []
    for i in range(steps + 1):  # the first compiles
        t0 = time.perf_counter()
        state, metrics = jax.block_until_ready(step(state, prompts, jax.random.key(i)))
        seconds.append(time.perf_counter() - t0)
    return {"variant": variant, "step_s": seconds[1:], "steady_step_s": sum(seconds[1:]) / steps,
            "peak_rss_mb": peak_rss_mb()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=384, help="rows of the activations (8 sequences x 48)")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--step", default=None, metavar="VARIANT",
                        help="time SmolLM2 mixed train steps instead: xla or onednn_backward")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    from benchmarks.common import machine_info
    from ppojax.backends.cpu.program_start import start_program

    start_program()  # as the ppojax command does (mimalloc, the recorded XLA options)
    if args.step:
        report = {"machine": machine_info(), **time_step(args.step, args.steps)}
        print(f"{args.step}: {report['steady_step_s']:.2f} s per step "
              f"({', '.join(f'{t:.2f}' for t in report['step_s'])}), peak RSS {report['peak_rss_mb']:,.0f} MB")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        return

    report = {"machine": machine_info(), **measure(args.tokens, args.reps)}
    if not report["onednn_ffi"]["available"]:
        print(f"onednn_ffi: not available ({report['onednn_ffi']['why']})")
    print(f"{'matrix':8} {'layout':6} " + " ".join(f"{f:>12}" for f in FORMS) + "   (GFLOP/s)")
    for matrix, layouts in report["results"].items():
        for layout, row in layouts.items():
            cells = [f"{row[f]['gflops']:12.0f}" if f in row else f"{'-':>12}" for f in FORMS]
            print(f"{matrix:8} {layout:6} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
