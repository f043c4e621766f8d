"""16-bit slot storage on the CPU (`ppojax.models.slot_storage`) on and off, at SmolLM2-135M's shapes.

    python -m benchmarks.slot_storage [--reps 12] [--precision mixed] [--json F]

Two workloads of a randomly initialised SmolLM2-135M under a 16-bit precision policy:

- ``gradient``: the gradient of the real tokens' mean log-probability (``remat: dots``), 8 left-padded rows of
  48 tokens (the PPO benchmark's update rows);
- ``generation``: 32 sampled tokens after 8 prompts of 16 (the PPO benchmark's rollout), the weights cast once
  to the compute dtype before the decode loop as the rollout does (since the tenth session; before, the loop
  converted the float32 master weights per token).

Each in two variants, compiled in the same process and called alternately so that both meet the same minutes
of the host: ``plain`` (the 16-bit program without slot storage: XLA:CPU rewrites each 16-bit slot write as a
float32 conversion of the whole stack, and reads the sampler's 16-bit weight stacks through float32 copies)
and ``slot_storage`` (as ppojax runs it). Both generate the same tokens;
their gradients agree within bf16 rounding (the plain program may use an unrounded float32 product where slot
storage saves the rounded one). Both are reported on every run and checked in ``tests/test_benchmarks.py``.
Current figures per host: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import time

VARIANTS = ("plain", "slot_storage")
WORKLOADS = ("gradient", "generation")


def kernels(variant: str):
    """The CPU's kernels of ``variant``: ``plain`` stores no 16-bit value as bits, ``slot_storage`` as ppojax runs."""
    from ppojax.backends.cpu.kernels import CpuKernels

    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: expected one of {VARIANTS}")
    return CpuKernels(bits=variant == "slot_storage")


def programs(cfg, precision: str, rows: int = 8, prompt: int = 16, response: int = 32, seed: int = 0) -> dict:
    """{(workload, variant): jitted () -> output} for a random ``CausalLM(cfg)`` under ``precision``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ppojax.rl.sampler import generate
    from ppojax.models import CausalLM, apply_causal_lm
    from ppojax.models.precision import precision_dtypes
    from ppojax.rl.rollout import _in_compute_dtype

    dtype, param_dtype = precision_dtypes(precision)
    new = lambda: CausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype, remat="dots")  # noqa: E731
    params = jax.jit(lambda: nnx.state(new()))()
    rng = np.random.default_rng(seed)
    length = prompt + response
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (rows, length)), jnp.int32)
    real = jnp.asarray(np.arange(length)[None] >= rng.integers(0, prompt // 2 + 1, rows)[:, None])
    prompts = jnp.where(real[:, :prompt], ids[:, :prompt], 0)

    def workloads(variant):
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(seed), dtype=dtype,
                                                                param_dtype=param_dtype, remat="dots",
                                                                kernels=kernels(variant))))

        def loss(p):
            logits = apply_causal_lm(graphdef, p, ids, real)[0]
            logp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], axis=-1)[..., 0]
            live = real[:, 1:]
            return -jnp.sum(jnp.where(live, logp, 0.0)) / jnp.sum(live)

        def sample(p):  # as the rollout samples: the weights cast once to the compute dtype, then the loop
            return generate(graphdef, _in_compute_dtype(graphdef, p), prompts, jax.random.key(seed),
                            response_length=response, pad_token_id=0, temperature=0.7)

        return (("gradient", jax.grad(loss)), ("generation", sample))

    fns = {}
    for variant in VARIANTS:
        for workload, fn in workloads(variant):
            compiled = jax.jit(fn).lower(params).compile()
            fns[workload, variant] = lambda compiled=compiled: compiled(params)
    return fns


DIFFERENCE = {"gradient": "largest |difference| / largest |gradient| of a weight",
              "generation": "fraction of generated tokens that differ"}


def difference(plain, stored) -> float:
    """How far two variants' outputs are apart: for tokens the fraction that differ, for gradients the largest
    |difference| relative to the largest |gradient| of the same weight."""
    import jax
    import numpy as np

    worst = 0.0
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(stored), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iu":
            worst = max(worst, float(np.mean(a != b)))
        else:
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)))
    return worst


def measure(reps: int, precision: str) -> dict:
    import jax
    import numpy as np

    from benchmarks.common import SIZES
    from ppojax.models import ModelConfig

    cfg = ModelConfig.from_hf(dict(SIZES["smollm2"]["model"], model_type="llama"))
    fns = programs(cfg, precision)
    outputs = {key: jax.block_until_ready(fn()) for key, fn in fns.items()}
    differences = {w: difference(outputs[w, "plain"], outputs[w, "slot_storage"]) for w in WORKLOADS}
    times = {key: [] for key in fns}
    for r in range(reps):
        for workload in WORKLOADS:
            for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                start = time.perf_counter()
                jax.block_until_ready(fns[workload, variant]())
                times[workload, variant].append(time.perf_counter() - start)
    out = {"precision": precision, "reps": reps, "jax": jax.__version__, "difference": differences,
           "by_workload": {}}
    for (workload, variant), seconds in times.items():
        seconds = sorted(seconds)
        out["by_workload"].setdefault(workload, {})[variant] = {
            "best_ms": 1e3 * seconds[0], "median_ms": 1e3 * seconds[len(seconds) // 2]}
    return out


def main(argv=None) -> int:
    from benchmarks.common import positive_int

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=positive_int, default=12)
    parser.add_argument("--precision", choices=("mixed", "bfloat16"), default="mixed")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from ppojax.backends.cpu.program_start import start_program

    start_program()
    from benchmarks.common import machine_info, write_report

    result = dict(measure(args.reps, args.precision), machine=machine_info())
    for workload, variants in result["by_workload"].items():
        for name, figures in variants.items():
            print(f"{workload:10s} {name:12s} best {figures['best_ms']:8.1f} ms  median {figures['median_ms']:8.1f} ms")
        print(f"{workload:10s} {DIFFERENCE[workload]}: {result['difference'][workload]:.2g}")
    if args.json:
        write_report(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
