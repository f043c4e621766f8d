"""XLA:CPU option sets compared on the matmuls of a SmolLM2-135M update, each set in a fresh process.

    python -m benchmarks.xla_options [--sets default,ynn_dot,...] [--workload dots|step] [--reps 20]
                                     [--torch-python .venv-bench/bin/python] [--json F]

XLA reads ``XLA_FLAGS`` once, when the CPU backend starts, so every option set runs in its own subprocess.
Each runs the same dots at float32 and bfloat16 (inputs and output in that dtype, as the ``mixed`` policy's
matmuls): the forward ``x @ W``, the two backward contractions (``g @ W.T`` and ``x.T @ g``) of an MLP
projection and of the LM head, at ``tokens`` rows (a micro-batch of 8 sequences of 64 tokens). The figure per
set and dtype is the total FLOPs of the dots divided by the sum of their best times, so it weighs each shape
by the time it takes in a real update. ``--torch-python`` times the same dots with torch (oneDNN), the
reference for what the host's matmul units can do. ``--workload step`` times a whole training step instead
(forward, backward and Adam of a 6-layer SmolLM2-shaped model), where the options also touch the fusions
around the dots. Current figures per host: ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from ppojax.backends.cpu import xla_options as xla_cpu_options
from ppojax.backends.cpu.xla_options import CANDIDATES

# name -> XLA_FLAGS. "default" is what jax does with no flags. One list for the benchmark and the run-time choice.
OPTION_SETS = {s.name: s.flags for s in CANDIDATES}
#: --record keeps a set only when it beats the default by more than this fraction (the spread of repeats)
RECORD_MARGIN = 0.05

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152  # SmolLM2-135M


def _dots(tokens: int):
    """(name, lhs shape, rhs shape, contracting dims) of one projection's forward and backward and the head's."""
    out = []
    for label, d_in, d_out in (("mlp_up", HIDDEN, INTERMEDIATE), ("lm_head", HIDDEN, VOCAB)):
        out.append((f"{label}.forward", (tokens, d_in), (d_in, d_out), ((1,), (0,))))
        out.append((f"{label}.grad_input", (tokens, d_out), (d_in, d_out), ((1,), (1,))))
        out.append((f"{label}.grad_weight", (tokens, d_in), (tokens, d_out), ((0,), (0,))))
    return out


def measure(tokens: int, reps: int) -> dict:
    """Run in the child: best seconds of every dot at float32 and bfloat16."""
    import jax
    import jax.numpy as jnp

    result = {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "by_dtype": {}}
    for dtype in ("float32", "bfloat16"):
        rows, total_flops, total_secs = {}, 0.0, 0.0
        for name, lhs_shape, rhs_shape, (lc, rc) in _dots(tokens):
            ka, kb = jax.random.split(jax.random.key(0))
            a = jax.random.normal(ka, lhs_shape, jnp.float32).astype(dtype)
            b = jax.random.normal(kb, rhs_shape, jnp.float32).astype(dtype)
            dot = jax.jit(lambda x, y, lc=lc, rc=rc: jax.lax.dot_general(x, y, ((lc, rc), ((), ()))))
            dot(a, b).block_until_ready()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                dot(a, b).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            contracted = lhs_shape[lc[0]]
            free = [d for i, d in enumerate(lhs_shape) if i != lc[0]] + [d for i, d in enumerate(rhs_shape)
                                                                          if i != rc[0]]
            flops = 2.0 * contracted * free[0] * free[1]
            rows[name] = {"seconds": best, "gflops": flops / best / 1e9}
            total_flops += flops
            total_secs += best
        result["by_dtype"][dtype] = {"gflops": total_flops / total_secs / 1e9, "dots": rows}
    return result


def measure_step(tokens: int, reps: int, layers: int = 6) -> dict:
    """Run in the child: best seconds of one training step (forward, backward, Adam) of a SmolLM2-shaped Llama
    cut to ``layers`` layers, on ``tokens`` = 8 sequences, at float32 and mixed (bf16 matmuls, f32 weights)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from benchmarks.common import SIZES
    from ppojax.models import CausalLM, ModelConfig

    cfg = ModelConfig.from_hf(dict(SIZES["smollm2"]["model"], num_hidden_layers=layers, model_type="llama"))
    batch, seq = 8, tokens // 8
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size)
    mask = jnp.ones((batch, seq), jnp.int32)
    result = {"jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": layers,
              "by_dtype": {}}
    for label, dtype in (("float32", jnp.float32), ("mixed", jnp.bfloat16)):
        graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
        optimizer = optax.adam(1e-5)
        opt_state = optimizer.init(params)

        def loss_fn(p):
            model = nnx.merge(graphdef, p)
            hidden, _ = model(ids, mask)
            logits = model.logits(hidden[:, seq // 2 - 1:-1])
            picked = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, seq // 2:, None], -1)
            return -jnp.mean(picked)

        @jax.jit
        def step(p, o):
            grads = jax.grad(loss_fn)(p)
            updates, o = optimizer.update(grads, o, p)
            return optax.apply_updates(p, updates), o

        jax.block_until_ready(step(params, opt_state))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(params, opt_state))
            best = min(best, time.perf_counter() - t0)
        result["by_dtype"][label] = {"seconds": best}
    return result


def measure_torch(tokens: int, reps: int, python: str) -> dict:
    """The same dots with torch (``python``: an interpreter that has torch, e.g. .venv-bench's), 2 threads."""
    code = f"""
import json, time, torch
from benchmarks.xla_options import _dots
torch.set_num_threads(2)
out = {{"torch": torch.__version__, "by_dtype": {{}}}}
for dtype in (torch.float32, torch.bfloat16):
    total_flops = total_secs = 0.0
    for name, lhs, rhs, (lc, rc) in _dots({tokens}):
        a = torch.randn(*lhs).to(dtype)
        b = torch.randn(*rhs).to(dtype)
        left = a if lc == (1,) else a.T      # contract lhs dim lc with rhs dim rc, as dot_general does
        right = b if rc == (0,) else b.T
        torch.matmul(left, right)
        best = float("inf")
        for _ in range({reps}):
            t0 = time.perf_counter()
            torch.matmul(left, right)
            best = min(best, time.perf_counter() - t0)
        total_flops += 2.0 * left.shape[0] * left.shape[1] * right.shape[1]
        total_secs += best
    out["by_dtype"][str(dtype).replace("torch.", "")] = {{"gflops": total_flops / total_secs / 1e9}}
print(json.dumps(out))
"""
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


#: XLA errors whose cause is known, explained where a set fails with them
KNOWN_FAILURES = {
    "partition compile failed": "XLA's oneDNN fusion takes an element-wise op into a dot's input, which oneDNN "
                                "cannot compile; `(p * s) @ v` alone aborts (jaxlib 0.10.2)",
}


def explain(error: str) -> str:
    """``error`` with the known cause appended when there is one."""
    cause = next((why for text, why in KNOWN_FAILURES.items() if text in error), None)
    return f"{error} ({cause})" if cause else error


def run_set(name: str, tokens: int, reps: int, workload: str = "dots") -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), OPTION_SETS[name]) if f)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.xla_options", "--child", "--tokens", str(tokens),
                           "--reps", str(reps), "--workload", workload], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return {"error": explain(last)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=None, help="comma-separated names from OPTION_SETS (default: the ones this "
                   "CPU's instruction sets make worth timing, ppojax.backends.cpu.xla_options.candidates)")
    p.add_argument("--tokens", type=int, default=512, help="rows of every dot (sequences x tokens)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--workload", default="dots", choices=["dots", "step"],
                   help="dots: the matmuls alone; step: a 6-layer SmolLM2-shaped training step")
    p.add_argument("--torch-python", default=None,
                   help="also time the dots with torch under this interpreter (e.g. .venv-bench/bin/python)")
    p.add_argument("--json", default=None)
    p.add_argument("--record", action="store_true",
                   help="record the fastest set for this CPU, one for float32 matmuls and one for bf16 ones (ppojax "
                   "applies the run's at start-up; needs --workload step)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps((measure if a.workload == "dots" else measure_step)(a.tokens, a.reps)))
        return 0
    from benchmarks.common import machine_info

    if a.record and a.workload != "step":
        p.error("--record chooses by a whole training step: add --workload step")
    sets = a.sets.split(",") if a.sets else [s.name for s in xla_cpu_options.candidates(xla_cpu_options.this_cpu())]
    unknown = [name for name in sets if name not in OPTION_SETS]
    if unknown:
        p.error(f"--sets: unknown {', '.join(unknown)}; expected names among {', '.join(OPTION_SETS)}")
    results = {"machine": machine_info(), "tokens": a.tokens, "workload": a.workload, "sets": {}}
    for name in sets:
        results["sets"][name] = run_set(name, a.tokens, a.reps, a.workload)
        r = results["sets"][name]
        if "error" in r:
            print(f"{name:12s} failed: {r['error']}")
        elif a.workload == "step":
            print(f"{name:12s} float32 {r['by_dtype']['float32']['seconds']:7.3f} s   "
                  f"mixed {r['by_dtype']['mixed']['seconds']:7.3f} s", flush=True)
        else:
            print(f"{name:12s} float32 {r['by_dtype']['float32']['gflops']:7.1f} GFLOP/s   "
                  f"bfloat16 {r['by_dtype']['bfloat16']['gflops']:7.1f} GFLOP/s", flush=True)
    if a.torch_python and a.workload == "dots":
        r = results["torch"] = measure_torch(a.tokens, a.reps, a.torch_python)
        if "error" in r:
            print(f"torch        failed: {r['error']}")
        else:
            print(f"torch {r['torch']}: float32 {r['by_dtype']['float32']['gflops']:7.1f} GFLOP/s   "
                  f"bfloat16 {r['by_dtype']['bfloat16']['gflops']:7.1f} GFLOP/s", flush=True)
    if a.record:
        for precision, matmuls in (("float32", "float32"), ("mixed", "bf16")):
            allowed = {s.name for s in xla_cpu_options.candidates(xla_cpu_options.this_cpu(), matmuls)}
            winner, seconds = choose({k: v for k, v in results["sets"].items() if k in allowed}, precision)
            path = xla_cpu_options.record(winner, seconds, matmuls=matmuls)
            print(f"recorded {winner} for {xla_cpu_options.this_cpu().signature}, {matmuls} matmuls, in {path}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def choose(step_results: dict, precision: str = "float32") -> tuple[str, dict]:
    """-> (the set to record, the step's seconds at ``precision`` per set that ran): the fastest set if it beats
    "default" by more than RECORD_MARGIN, else "default". Each precision has its own winner (on an AMX host the
    bf16 step's winner slowed the float32 step)."""
    seconds = {name: r["by_dtype"][precision]["seconds"] for name, r in step_results.items() if "error" not in r}
    if "default" not in seconds:
        raise SystemExit("--record needs the default set to have run (it is the baseline)")
    best = min(seconds, key=seconds.get)
    winner = best if seconds[best] < seconds["default"] * (1 - RECORD_MARGIN) else "default"
    return winner, seconds


if __name__ == "__main__":
    sys.exit(main())
