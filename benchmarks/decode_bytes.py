"""Bytes one decode step moves, as the TPU compiler counts them, against the floor: every weight read once plus
the whole KV cache (a measurement without a TPU: run it by hand, not in the tests).

    python -m benchmarks.decode_bytes [--model llama-3.2-1b] [--target tpu:v5e:1x1] [--batch 8]
        [--prompt 512 --response 1024] [--segments 4] [--attention auto|xla] [--weight-layout default|auto]
        [--logprobs] [--json out.json]

Compiles ONE step of the sampler's decode loop (``ppojax.rl.sampler.decode_step`` and the sampling of the next
token), as the rollout runs it, for one chip with the config's batch rows on it: the policy in bfloat16 with its
KV cache of ``prompt + response`` slots (donated), twice: with the layer loop as the models run it (a
``lax.scan``), and unrolled. The one-step program takes the cache from outside and returns it, so with the scan
the TPU compiler copies the cache into the loop's own layout and back (cache-sized copies, counted in the bytes);
inside the sampler the cache never leaves the program and the decode loop writes it in place
(tests/test_tpu_compile.py checks that no copy of the cache lies inside the loop). The unrolled step has no such
copies: its bytes are a step's own traffic. Reported: XLA's cost analysis ("bytes
accessed": reads and writes of every HLO op, fused ops counted once), the memory analysis, an estimate of the
bytes per jax operation from the optimized HLO (``hlo_text.bytes_by_instruction``) and the part of them that
lies in HBM (the compiler's count adds the traffic of what it placed in a core's VMEM, ``S(1)`` in a layout:
activations, prefetched weight slices; that traffic does not take HBM bandwidth), and the floor: the
policy's weights (a decode step reads each one once; tied embeddings are the LM head) plus the KV cache's keys
and values (the attention reads every slot: shapes are static). The time at the chip's HBM bandwidth follows for
both.

Then the decode loop as the sampler runs it by default, cut into ``--segments`` loops (``decode_segments``), each
reading only the cache slots filled by its end: the unrolled step compiled once per segment with the cache's
``read_length``, and the mean over the loop's steps (each segment weighted by its steps), against the mean floor
(the weights plus the slots read).

``--weight-layout auto`` lets the compiler choose how the weights lie in memory (``Layout.AUTO`` for the
parameters) instead of taking them row-major as a program's arguments arrive by default: the layout a dot wants
for a ``[D, heads, head_dim]`` projection kernel is not row-major on TPUs, and with row-major weights each step
slices that kernel out of the stacked layers and transposes it.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from benchmarks import hlo_text


def measure(model: str, target_text: str, batch: int, prompt: int, response: int, scan_layers: bool = True,
            read_length: int | None = None, attention: str = "auto", weight_layout: str = "default",
            logprobs: bool = False) -> dict:
    from ppojax.trainer import plan, plan_targets

    spec = plan_targets.parse_target(target_text)
    if spec.is_cpu:
        raise SystemExit("--target: a TPU target (tpu:<chip>:<topology>); the CPU's cost analysis is not the floor's")
    plan.use_host_for_tracing()

    from ppojax import backends
    from ppojax.models import CausalLM, init_cache, precision_dtypes
    from ppojax.rl.sampler import decode_step, sample_logits, token_logprobs

    target = plan_targets.load_target(spec)
    # the attention a run on this chip takes ("auto": the TPU's Pallas decode kernel) or XLA's ("xla")
    kernels = backends.kernels_for([], devices=target.devices[:1], attention_implementation=attention)
    model_cfg, _, _ = plan.model_config_for(model)
    compute, weights = precision_dtypes("bfloat16")
    policy = nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0), dtype=compute, param_dtype=weights,
                                             scan_layers=scan_layers, kernels=kernels))
    graphdef, params = nnx.split(policy)
    length = prompt + response
    cache = jax.eval_shape(lambda: init_cache(model_cfg, batch, length, compute, kernels))
    cache = cache.replace(read_length=read_length)
    mesh = Mesh(np.array(target.devices[:1]), ("chip",))
    on_chip = NamedSharding(mesh, PartitionSpec())

    def placed(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), tree)

    pad = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0

    def step(params, cache, token, position, key):
        logits, cache, live = decode_step(graphdef, params, cache, token, position, pad)
        new = sample_logits(logits, key, temperature=1.0)
        if logprobs:  # as the sampler keeps each token's log-prob (behaviour_logprobs: sampler)
            return new, token_logprobs(logits, new, 1.0), cache, position + live.astype(jnp.int32)
        return new, cache, position + live.astype(jnp.int32)

    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=on_chip)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=on_chip)
    # the weights as a program's arguments arrive by default (row-major), or in the layout the compiler picks
    weights_in = jax.tree.map(lambda _: Format(Layout.AUTO, on_chip), params) if weight_layout == "auto" else on_chip
    jitted = jax.jit(step, donate_argnums=(1,), in_shardings=(weights_in, on_chip, on_chip, on_chip, on_chip))
    compiled = jitted.lower(placed(params), placed(cache), rows, rows, key).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    memory = compiled.memory_analysis()
    weight_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    kv_bytes = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in (cache.keys, cache.values))
    kv_read_bytes = kv_bytes * cache.slots_read // length  # the slots the attention reads
    floor = weight_bytes + kv_bytes
    moved = float(cost["bytes accessed"])
    bandwidth = spec.chip.hbm_gb_per_s * 1e9
    text = compiled.as_text()
    groups: dict[str, int] = {}
    hbm = 0
    for row in hlo_text.bytes_by_instruction(text):  # where the bytes go, by the jax operation that made them
        group = re.sub(r"\d+", "#", row["op_name"].replace("jit(step)/", "")) or row["op"]
        groups[group] = groups.get(group, 0) + row["read"] + row["written"]
        hbm += row["hbm_read"] + row["hbm_written"]
    by_op = dict(sorted(groups.items(), key=lambda kv: -kv[1])[:10])
    cache_copies = sum(1 for line in text.splitlines()
                       if " copy(" in line and f"[{','.join(map(str, cache.keys.shape))}]" in line.split("copy(")[0])
    return {"model": model, "target": spec.text, "compiler": target.compiler, "batch": batch, "logprobs": logprobs,
            "attention": kernels.name, "weight_layout": weight_layout,
            "kernel_calls": len(re.findall(r"ppojax_decode_attention[.\d]* = ", text)),
            "layers": "scan" if scan_layers else "unrolled", "cache_copies": cache_copies,
            "cache_slots": length, "slots_read": cache.slots_read, "kv_read_bytes": kv_read_bytes,
            "bytes_accessed": moved, "weight_bytes": weight_bytes, "kv_cache_bytes": kv_bytes,
            "floor_bytes": floor, "bytes_over_floor": moved / floor, "flops": cost.get("flops"),
            "argument_bytes": int(memory.argument_size_in_bytes), "temp_bytes": int(memory.temp_size_in_bytes),
            "hbm_gb_per_s": spec.chip.hbm_gb_per_s, "floor_ms": floor / bandwidth * 1e3,
            "compiler_bytes_ms": moved / bandwidth * 1e3,
            "estimated_bytes_by_op": by_op, "estimated_bytes": sum(groups.values()), "estimated_hbm_bytes": hbm,
            "floor_read_bytes": weight_bytes + kv_read_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--target", default="tpu:v5e:1x1")
    parser.add_argument("--batch", type=int, default=8, help="rows on the chip (configs/plan.yaml: 8 per device)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=1024)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--segments", type=int, default=4, help="decode_segments (the config's default: 4)")
    parser.add_argument("--attention", default="auto", choices=["auto", "xla"],
                        help="attention_implementation: 'auto' takes the TPU's Pallas decode kernel")
    parser.add_argument("--weight-layout", default="default", choices=["default", "auto"],
                        help="the weights row-major as arguments arrive ('default') or laid out as the compiler "
                             "chooses ('auto')")
    parser.add_argument("--logprobs", action="store_true",
                        help="the step also keeps the drawn token's log-prob, as a run sampling with "
                             "behaviour_logprobs: sampler does")
    args = parser.parse_args(argv)
    from ppojax.rl.sampler import decode_segments

    results = [measure(args.model, args.target, args.batch, args.prompt, args.response, scan_layers=scan,
                       attention=args.attention, weight_layout=args.weight_layout, logprobs=args.logprobs)
               for scan in (True, False)]
    start, segments = 1, []
    for end, slots in decode_segments(args.prompt, args.response, args.segments):
        segments.append({**measure(args.model, args.target, args.batch, args.prompt, args.response,
                                   scan_layers=False, read_length=slots, attention=args.attention,
                                   weight_layout=args.weight_layout, logprobs=args.logprobs),
                         "steps": end - start})
        start = end
    steps = sum(seg["steps"] for seg in segments)
    mean = lambda key: sum(seg[key] * seg["steps"] for seg in segments) / steps  # noqa: E731
    segmented = {"segments": args.segments, "layers": "unrolled", "steps": steps,
                 "bytes_accessed_mean": mean("bytes_accessed"),
                 "floor_bytes_mean": segments[0]["weight_bytes"] + mean("kv_read_bytes"),
                 "estimated_hbm_bytes_mean": mean("estimated_hbm_bytes"),
                 "per_segment": segments}
    gb = 1e9
    for result in results:
        print(f"{result['model']} decode step{' keeping log-probs' if result['logprobs'] else ''} on "
              f"{result['target']} ({result['compiler']}), attention "
              f"{result['attention']} ({result['kernel_calls']} kernel calls), weights laid out "
              f"{result['weight_layout']}, {result['batch']} rows "
              f"x {result['cache_slots']} cache slots, layers {result['layers']}:\n"
              f"  bytes accessed (the compiler's count) {result['bytes_accessed'] / gb:.3f} GB; temporaries "
              f"{result['temp_bytes'] / gb:.3f} GB; cache-sized copies {result['cache_copies']}\n"
              f"  floor: weights {result['weight_bytes'] / gb:.3f} GB + KV cache {result['kv_cache_bytes'] / gb:.3f} "
              f"GB = {result['floor_bytes'] / gb:.3f} GB\n"
              f"  ratio {result['bytes_over_floor']:.3f}; at {result['hbm_gb_per_s']:g} GB/s: "
              f"{result['compiler_bytes_ms']:.2f} ms vs the floor's {result['floor_ms']:.2f} ms")
    full = results[1]
    print("  where the unrolled step's bytes go (an estimate from its HLO, "
          f"{full['estimated_bytes'] / gb:.3f} GB in all; {full['estimated_hbm_bytes'] / gb:.3f} GB of it in HBM, "
          f"x{full['estimated_hbm_bytes'] / full['floor_bytes']:.3f} the floor):")
    for group, moved in full["estimated_bytes_by_op"].items():
        print(f"    {moved / gb:7.3f} GB  {group}")
    print(f"the decode loop in {args.segments} segments (unrolled), slots read "
          f"{[seg['slots_read'] for seg in segments]} over {[seg['steps'] for seg in segments]} steps:\n"
          f"  mean bytes accessed per step {segmented['bytes_accessed_mean'] / gb:.3f} GB (one loop over all "
          f"{full['cache_slots']} slots: {full['bytes_accessed'] / gb:.3f} GB, x"
          f"{segmented['bytes_accessed_mean'] / full['bytes_accessed']:.3f}); mean floor "
          f"{segmented['floor_bytes_mean'] / gb:.3f} GB, ratio "
          f"{segmented['bytes_accessed_mean'] / segmented['floor_bytes_mean']:.3f}; against the full cache's floor "
          f"{segmented['bytes_accessed_mean'] / full['floor_bytes']:.3f}\n"
          f"  of which in HBM (the estimate without what the compiler placed on chip): mean "
          f"{segmented['estimated_hbm_bytes_mean'] / gb:.3f} GB, ratio "
          f"{segmented['estimated_hbm_bytes_mean'] / segmented['floor_bytes_mean']:.3f}")
    if args.json:
        from ppojax.io.strict_json import write_json

        write_json(args.json, results + [segmented], indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
