"""The planner against reality: ``ppojax plan``'s per-device peak vs the measured peak RSS of one SmolLM2-135M
rollout and one update on this machine's one CPU device (a measurement: run it by hand, not in the tests).

    python -m benchmarks.plan_vs_rss [--smollm2-dir DIR|random] [--out benchmarks/plan_vs_rss.json]
    python -m benchmarks.plan_vs_rss --remat full --phases update --out benchmarks/plan_vs_rss_remat_full.json

Each phase runs in a fresh process (so its peak RSS is its own): build the run with real weights (a reward
ScoreModel of the policy's shape, as the plan assumes), then compile and run the rollout (``make_rollout``)
or the update (``make_update`` on an experience of the rollout's shapes). Reported: the process's peak RSS,
its RSS before the phase's program was compiled (the built state + the runtime), and the plan's figures for
the same config (``ppojax plan ... --programs rollout,update --json``).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import status_mb

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / ".cache/ppojax/smollm2-135m-instruct"
OVERRIDES = ["precision=float32", "remat=none", "max_prompt_length=32", "response_length=32", "batch_size=8",
             "gradient_accumulation_steps=1", "num_mini_batches=1", "num_ppo_epochs=1", "logits_chunk_size=null",
             "stop_token=eos"]


def phase(name: str, model_dir: str, overrides: list) -> dict:
    """In this (fresh) process: build the run, then compile and run one ``name`` program; -> RSS figures."""
    from ppojax.backends.cpu.program_start import start_program
    start_program()  # as the ppojax command does (ppojax/backends/cpu/program_start.py)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.common import peak_rss_mb
    from ppojax.trainer.config import PPOConfig
    from ppojax.models import CausalLM, ScoreModel, load_pretrained, load_tokenizer
    from ppojax.trainer.plan import PRESETS, model_config_for
    from ppojax.trainer.build import build_run, model_kwargs
    from ppojax.rl.program import collect_experience, make_rollout, make_update

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", overrides)
    runtime_mb = status_mb("VmRSS")
    options = model_kwargs(config)  # the config's precision and remat, as the plan compiles them
    if model_dir == "random":  # a random init of SmolLM2's config (same shapes)
        cfg, _, _ = model_config_for("smollm2-135m")
        policy = CausalLM(cfg, rngs=nnx.Rngs(0), **options)
        tokenizer_dir = DEFAULT_DIR if DEFAULT_DIR.is_dir() else None
    else:
        policy, cfg = load_pretrained(model_dir, **options)
        tokenizer_dir = model_dir
    tokenizer = _tokenizer(tokenizer_dir, cfg)
    reward = ScoreModel(policy.cfg, rngs=nnx.Rngs(1), **options)
    run = build_run(config, processing_class=tokenizer, model=policy, reward_model=reward)
    del policy, reward
    jax.block_until_ready(run.state)  # the state's initialisation runs asynchronously
    prompts = jnp.full((run.settings.batch.batch_size, config.max_prompt_length), 5, jnp.int32)
    key = jax.random.key(0)
    built_mb = status_mb("VmRSS")
    if name == "rollout":
        program = make_rollout(run.program).jitted
        args = (run.state, prompts, key)
    else:
        shapes, _ = jax.eval_shape(lambda s, p, k: collect_experience(run.program, s, p, k), run.state, prompts, key)
        experience = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        program = make_update(run.program, run.state_shardings)
        args = (run.state, experience, key)
    compiled = program.lower(*args).compile()
    # The program's own peak: compiled beforehand (the compiler's memory is not the program's), freed memory
    # handed back to the kernel, then the kernel's high-water mark reset (clear_refs 5) just before the call.
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before_mb = status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    jax.block_until_ready(compiled(*args))
    program_peak_mb = status_mb("VmHWM")
    return {"phase": name, "runtime_rss_mb": runtime_mb, "built_rss_mb": built_mb, "peak_rss_mb": peak_rss_mb(),
            "before_program_rss_mb": before_mb, "program_peak_rss_mb": program_peak_mb,
            "model": model_dir, "presets_checked": "smollm2-135m" in PRESETS}


def _tokenizer(path, cfg):
    if path is not None:
        from ppojax.models import load_tokenizer
        return load_tokenizer(path)

    class Ids:  # the plan's token ids, without a tokenizer on disk
        eos_token_id = cfg.eos_token_ids[0]
        pad_token_id = 0
        vocab_size = cfg.vocab_size

        def __len__(self):
            return cfg.vocab_size
    return Ids()


def planned(phases: list, overrides: list) -> dict:
    """The plan of the same config (one device), from the CLI's JSON."""
    out = Path("/tmp/ppojax_plan_vs_rss.json")
    subprocess.run([sys.executable, "-m", "ppojax.trainer.cli", "plan", str(REPO / "configs/plan.yaml"), "--model", "smollm2",
                    "--programs", ",".join(phases), "--json", str(out), *overrides], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smollm2-dir", default=str(DEFAULT_DIR) if DEFAULT_DIR.is_dir() else "random")
    parser.add_argument("--remat", default="none", choices=["none", "full", "dots"])
    parser.add_argument("--phases", default="rollout,update", help="comma-separated: rollout,update")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "benchmarks/plan_vs_rss.json"))
    args = parser.parse_args()
    overrides = [o for o in OVERRIDES if not o.startswith("remat=")] + [f"remat={args.remat}"]
    phases = args.phases.split(",")
    if args.phase:
        print(json.dumps(phase(args.phase, args.smollm2_dir, overrides)))
        return
    from benchmarks.common import machine_info
    measured = {}
    for name in phases:
        done = subprocess.run([sys.executable, "-m", "benchmarks.plan_vs_rss", "--phase", name, "--smollm2-dir",
                               args.smollm2_dir, "--remat", args.remat], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode:  # e.g. -9: the kernel's OOM killer on a shared machine
            print(f"{name}: the measuring process failed (exit {done.returncode}): {done.stderr[-500:]}")
            measured[name] = {"peak_rss_mb": None, "runtime_rss_mb": None, "built_rss_mb": None,
                              "exit_code": done.returncode}
            continue
        measured[name] = json.loads(done.stdout.strip().splitlines()[-1])
    plan = planned(phases, overrides)
    rows = []
    for p in plan["programs"]:
        m = measured[p["name"]]
        rows.append({"program": p["name"], "plan_peak_mb": p["peak_bytes"] / 1e6,
                     "plan_resident_mb": p["resident_bytes"] / 1e6, "plan_temp_mb": p["temp_bytes"] / 1e6,
                     "plan_arguments_mb": p["argument_bytes"] / 1e6, "plan_outputs_mb": p["output_bytes"] / 1e6,
                     "plan_alias_mb": p["alias_bytes"] / 1e6,
                     "measured_peak_rss_mb": m["peak_rss_mb"], "runtime_rss_mb": m["runtime_rss_mb"],
                     "built_rss_mb": m["built_rss_mb"], "before_program_rss_mb": m.get("before_program_rss_mb"),
                     "program_peak_rss_mb": m.get("program_peak_rss_mb"),
                     "exit_code": m.get("exit_code", 0)})
    result = {"machine": machine_info(), "overrides": overrides, "model": args.smollm2_dir, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in rows:
        print(f"{r['program']:<8} plan peak {r['plan_peak_mb']:8.0f} MB (resident {r['plan_resident_mb']:.0f}, "
              f"temporaries {r['plan_temp_mb']:.0f}) | measured peak RSS {r['measured_peak_rss_mb']} MB (runtime "
              f"{r['runtime_rss_mb']} MB, after building {r['built_rss_mb']} MB); the program alone: "
              f"{r['before_program_rss_mb']} -> {r['program_peak_rss_mb']} MB")


if __name__ == "__main__":
    main()
