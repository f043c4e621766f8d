"""Which XLA:CPU option set runs a training step fastest on this CPU, measured, and recorded for
:func:`ppojax.backends.cpu.xla_options.apply` to add at start-up.

    python -m ppojax.backends.cpu.xla_options_tuning [--sets default,ynn_dot,...] [--reps 20] [--record] [--json F]

XLA reads ``XLA_FLAGS`` once, when its CPU backend starts, so every option set runs in a process of its own: one
training step (forward, backward and Adam) of a SmolLM2-135M-shaped Llama cut to ``layers`` layers, on 8
sequences, at float32 and at ``mixed`` (bf16 matmuls over float32 weights), its best time of ``--reps``. The sets
timed are those this CPU's instruction sets make worth timing (``xla_options.candidates``) unless ``--sets``
names others. ``--record`` keeps, per kind of matmul, the fastest set where it beats XLA's defaults by more than
``RECORD_MARGIN`` (else ``default``) under this CPU's signature and the installed jaxlib (``xla_options.record``).
A few minutes on two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ppojax.backends.cpu import xla_options
from ppojax.backends.cpu.xla_options import CANDIDATES
from ppojax.io.strict_json import write_json
from ppojax.models import CausalLM, ModelConfig

#: name -> its XLA_FLAGS fragment ("default": none)
OPTION_SETS = {s.name: s.flags for s in CANDIDATES}
#: --record keeps a set only when it beats the default by more than this fraction (the spread of repeats)
RECORD_MARGIN = 0.05
#: the measured model: SmolLM2-135M's shapes (its config.json), cut to `layers` layers
SMOLLM2_SHAPE = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                     hidden_act="silu")
#: XLA errors whose cause is known, explained where a set fails with them
KNOWN_FAILURES = {
    "partition compile failed": "XLA's oneDNN fusion takes an element-wise op into a dot's input, which oneDNN "
                                "cannot compile; `(p * s) @ v` alone aborts (jaxlib 0.10.2)",
}


def measure_step(tokens: int, reps: int, layers: int = 6) -> dict:
    """In the child process: best seconds of one training step at float32 and at mixed, ``tokens`` = 8 sequences
    of ``tokens // 8``."""
    cfg = ModelConfig.from_hf(dict(SMOLLM2_SHAPE, num_hidden_layers=layers))
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


def explain(error: str) -> str:
    """``error`` with the known cause appended when there is one."""
    cause = next((why for text, why in KNOWN_FAILURES.items() if text in error), None)
    return f"{error} ({cause})" if cause else error


def run_set(name: str, tokens: int, reps: int) -> dict:
    """:func:`measure_step` in a fresh process under option set ``name``; ``{"error": ...}`` where it fails."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), OPTION_SETS[name]) if f)
    proc = subprocess.run([sys.executable, "-m", __name__, "--child", "--tokens", str(tokens), "--reps", str(reps)],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        return {"error": explain(last)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=None, help="comma-separated names among " + ", ".join(OPTION_SETS) +
                   " (default: the ones this CPU's instruction sets make worth timing)")
    p.add_argument("--tokens", type=int, default=512, help="token rows of the step (8 sequences)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--record", action="store_true",
                   help="record the fastest set for this CPU, one for float32 matmuls and one for bf16 ones")
    p.add_argument("--json", default=None, help="write every set's figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(measure_step(a.tokens, a.reps)))
        return 0
    cpu = xla_options.this_cpu()
    sets = a.sets.split(",") if a.sets else [s.name for s in xla_options.candidates(cpu)]
    unknown = [name for name in sets if name not in OPTION_SETS]
    if unknown:
        p.error(f"--sets: unknown {', '.join(unknown)}; expected names among {', '.join(OPTION_SETS)}")
    results = {"cpu": cpu.signature, "tokens": a.tokens, "sets": {}}
    for name in sets:
        r = results["sets"][name] = run_set(name, a.tokens, a.reps)
        if "error" in r:
            print(f"{name:12s} failed: {r['error']}")
        else:
            print(f"{name:12s} float32 {r['by_dtype']['float32']['seconds']:7.3f} s   "
                  f"mixed {r['by_dtype']['mixed']['seconds']:7.3f} s", flush=True)
    if a.record:
        for precision, matmuls in (("float32", "float32"), ("mixed", "bf16")):
            allowed = {s.name for s in xla_options.candidates(cpu, matmuls)}
            winner, seconds = choose({k: v for k, v in results["sets"].items() if k in allowed}, precision)
            path = xla_options.record(winner, seconds, matmuls=matmuls)
            print(f"recorded {winner} for {cpu.signature}, {matmuls} matmuls, in {path}")
    if a.json:
        write_json(a.json, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
