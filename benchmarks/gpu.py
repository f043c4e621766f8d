"""ppojax on an accelerator: generation and update throughput, update MFU against the device's measured bf16
matmul peak, and decode's fraction of the HBM-bandwidth roofline, per model size and precision policy.

    python -m benchmarks.gpu --json out.json [--only tiny,smollm2] [--precisions mixed,bfloat16]

For each case: the same PPO work as ``benchmarks.ppojax_ppo`` (policy, frozen reference, reward and value
models of one shape; random weights), run as the phases' own compiled programs after one untimed call each:
the sampler (``generation_s``) and the update (``learn``: rewards, advantages, epochs of optimizer steps;
``update_s``). The ``smollm2`` case (the CPU benchmark's work) also runs the whole ``train_step`` for
episodes/s, comparable with TRL on the same device (``benchmarks/trl_ppo.py --device cuda --bf16``).

Figures:
- generation tok/s = B·R / generation_s; update tok/s = epochs·B·(P+R) / update_s;
- update MFU = model FLOPs of the update (``ppojax.models.flops``) / update_s / measured bf16 peak;
- decode roofline fraction: one decode step must read every weight once (in the compute dtype: the sampler
  casts them once before the loop) and the KV cache slots its attention reads (``[L, B, slots, K, hd]`` keys and
  values in the compute dtype; with ``decode_segments`` the slots each loop reads, averaged over the steps, else
  all P+R); that many bytes at the measured copy bandwidth is the step's lower bound, divided by the measured
  time of a step ((generation_s - prefill) / (R - 1), the prefill timed alone).
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PPO_SETTINGS, SIZES, make_prompts, source_commit
from ppojax.io.strict_json import write_json
from ppojax.models.flops import Dims, backbone_forward, lm_head, ppo_update_flops

#: Llama-3.2-1B's published shape (config.json of meta-llama/Llama-3.2-1B), random weights here.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu")

CASES = {
    # name: (model, batch, prompt length, response length)
    "tiny": (SIZES["tiny"]["model"], 16, 16, 32),
    "smollm2": (SIZES["smollm2"]["model"], 8, 16, 32),          # the CPU benchmark's work (vs TRL)
    "smollm2-b64": (SIZES["smollm2"]["model"], 64, 64, 128),
    "llama1b": (LLAMA_1B, 32, 64, 128),
}


def measure_peaks() -> dict:
    """The device's bf16 matmul rate (8192^3) and copy bandwidth (read + write of a 2 GiB array)."""
    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    t0 = time.perf_counter()
    for _ in range(10):
        out = mm(a)
    jax.block_until_ready(out)
    matmul_s = (time.perf_counter() - t0) / 10
    x = jnp.ones((2 ** 29,), jnp.float32)  # 2 GiB
    copy = jax.jit(lambda v: v + 1.0)
    jax.block_until_ready(copy(x))
    t0 = time.perf_counter()
    for _ in range(10):
        y = copy(x)
    jax.block_until_ready(y)
    copy_s = (time.perf_counter() - t0) / 10
    return {"bf16_matmul_flops_per_s": 2 * n ** 3 / matmul_s, "copy_bytes_per_s": 2 * x.nbytes / copy_s}


def run_case(name: str, precision: str, peaks: dict, fused: bool, attention: str = "auto") -> dict:
    from benchmarks.ppojax_ppo import build
    from ppojax.rl import rollout
    from ppojax.rl.sampler import decode_segments, generate
    from ppojax.rl.program import make_rollout, make_train_step
    from ppojax.rl.update import learn

    model, B, P, R = CASES[name]
    epochs = PPO_SETTINGS["num_ppo_epochs"]
    config = dict(PPO_SETTINGS, model=dict(model, pad_token_id=0, bos_token_id=1, eos_token_id=2), batch_size=B,
                  prompt_length=P, response_length=R, num_updates=4, num_mini_batches=1, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, precision=precision, model_dir=None,
                  attention_implementation=attention)
    prompts = np.asarray(make_prompts(4 * B, P, model["vocab_size"]), np.int32)
    t0 = time.perf_counter()
    program, state, shardings = build(config)
    out = {"case": name, "precision": precision, "attention": attention, "batch_size": B, "prompt_length": P,
           "response_length": R, "setup_s": time.perf_counter() - t0}
    key = jax.random.key(0)

    sample = jax.jit(lambda s, q, k: rollout.sample(program, s, q, k)[0])
    prefill = jax.jit(lambda s, q, k: generate(program.actor_critic.policy_graphdef,
                                                rollout._in_compute_dtype(program.actor_critic.policy_graphdef,
                                                                          s.params["policy"]),
                                                q, k, response_length=1, pad_token_id=0))
    experience, _ = make_rollout(program)(state, prompts[:B], key)
    update = jax.jit(lambda s, e, k: learn(program, s, e, k))
    timings = {}
    for label, fn in (("generation_s", lambda k: sample(state, prompts[:B], k)),
                      ("prefill_s", lambda k: prefill(state, prompts[:B], k)),
                      ("update_s", lambda k: update(state, experience, k))):
        c0 = time.perf_counter()
        jax.block_until_ready(fn(key))  # compiles
        out[f"compile_{label[:-2]}_s"] = time.perf_counter() - c0
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(jax.random.fold_in(key, i)))
            times.append(time.perf_counter() - t0)
        timings[label] = float(np.median(times))
    out.update(timings)

    dims = Dims.from_config(model)
    flops = ppo_update_flops(model, B, P, R, epochs)
    out["generation_tokens_per_s"] = B * R / timings["generation_s"]
    out["update_tokens_per_s"] = epochs * B * (P + R) / timings["update_s"]
    out["update_flops"] = flops["update"]
    out["update_mfu"] = flops["update"] / timings["update_s"] / peaks["bf16_matmul_flops_per_s"]
    generation_flops = B * (backbone_forward(dims, P) + lm_head(dims, 1)) + sum(
        B * (backbone_forward(dims, 1, past=P + t) + lm_head(dims, 1)) for t in range(R - 1))
    out["generation_mfu"] = generation_flops / timings["generation_s"] / peaks["bf16_matmul_flops_per_s"]
    # decode roofline: weights (compute dtype, 2 bytes) + the KV cache slots the attention reads, once per step
    # (with decode segments, each loop reads the slots filled by its end: their mean over the steps)
    params = sum(x.size for x in jax.tree.leaves(state.params["policy"]))
    segments = program.settings.sampling.decode_segments
    plan, start, slots_read = decode_segments(P, R, segments), 1, 0
    for end, slots in plan:
        slots_read, start = slots_read + (end - start) * slots, end
    mean_slots = slots_read / max(R - 1, 1) if plan else P + R
    out["decode_segments"], out["decode_mean_slots_read"] = segments, mean_slots
    kv_bytes = 2 * dims.layers * B * mean_slots * dims.kv_heads * dims.head_dim * 2
    step_bytes = 2 * params + kv_bytes
    step_s = (timings["generation_s"] - timings["prefill_s"]) / max(R - 1, 1)
    out["decode_step_s"] = step_s
    out["decode_step_bytes"] = step_bytes
    out["decode_roofline_fraction"] = step_bytes / peaks["copy_bytes_per_s"] / step_s
    stats = jax.devices()[0].memory_stats() or {}
    out["peak_device_bytes"] = stats.get("peak_bytes_in_use")

    if fused:  # the whole train_step, as the CPU benchmark's headline
        step = make_train_step(program, shardings)
        records = []
        for u in range(4):
            t0 = time.perf_counter()
            state, metrics = step(state, prompts[u * B:(u + 1) * B], jax.random.fold_in(key, 100 + u))
            jax.block_until_ready((state, metrics))
            records.append(time.perf_counter() - t0)
        out["first_update_s"] = records[0]
        out["episodes_per_s"] = B * 3 / sum(records[1:])
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--precisions", default="mixed,bfloat16")
    parser.add_argument("--json", default=None)
    parser.add_argument("--attention", default="auto",
                        help="attention_implementation values, comma-separated (e.g. auto,pallas: the Pallas decode "
                             "kernel against XLA's decode)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    report = {"device": getattr(device, "device_kind", str(device)), "platform": device.platform,
              "jax": jax.__version__, "commit": source_commit(), "peaks": measure_peaks(), "cases": []}
    print(json.dumps(report), flush=True)
    for name in args.only.split(","):
        for precision in args.precisions.split(","):
            for attention in args.attention.split(","):
                try:
                    result = run_case(name, precision, report["peaks"], fused=name == "smollm2" and
                                      attention == "auto", attention=attention)
                except Exception as err:  # keep the other cases' figures
                    result = {"case": name, "precision": precision, "attention": attention,
                              "error": f"{type(err).__name__}: {err}"}
                report["cases"].append(result)
                print(json.dumps(result), flush=True)
                if args.json:
                    write_json(args.json, report, indent=1)


if __name__ == "__main__":
    main()
