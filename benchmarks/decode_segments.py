"""The sampler's decode loop in segments (``decode_segments``) against one loop over the whole KV cache, on this
machine: compile time and wall time of ``generate`` for the same batch, key and tokens.

    python -m benchmarks.decode_segments [--size smollm2] [--batch 8] [--prompt 128 --response 512]
        [--segments 1,4] [--repeats 2] [--json out.json]

The model is the size's config from ``benchmarks.common`` with random weights (float32, as a CPU run's
default), prompts of ``--prompt`` random tokens, no stop token: every row decodes ``--response`` tokens, so each
variant does the same steps. One segment reads all prompt + response slots at every step; S segments read, in
the k-th loop, only the slots filled by its end. Reported per variant: the compile, and the median of
``--repeats`` calls after a warm-up, the variants taking turns; the tokens are checked equal to the first
variant's.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import SIZES, machine_info


def measure(size: str, batch: int, prompt: int, response: int, segments: list[int], repeats: int) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from ppojax.models import CausalLM
    from ppojax.rl.sampler import decode_segments, generate_jit
    from ppojax.trainer import plan

    spec = SIZES[size]["model"]
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(
            {**spec, "model_type": "llama", "eos_token_id": 2, "pad_token_id": 0,
             "max_position_embeddings": max(spec["max_position_embeddings"], prompt + response)}))
        model_cfg, _, _ = plan.model_config_for(directory)
    graphdef, params = nnx.split(CausalLM(model_cfg, rngs=nnx.Rngs(0)))
    prompts = jax.random.randint(jax.random.key(1), (batch, prompt), 1, spec["vocab_size"])
    variants = []
    for count in segments:
        kwargs = dict(response_length=response, pad_token_id=0, temperature=1.0, segments=count)
        start = time.perf_counter()
        generate_jit.lower(graphdef, params, prompts, jax.random.key(0), **kwargs).compile()
        compile_s = time.perf_counter() - start
        call = functools.partial(generate_jit, graphdef, params, prompts, jax.random.key(0), **kwargs)
        variants.append({"count": count, "call": call, "compile_s": compile_s, "tokens": np.asarray(call()),
                         "times": []})  # the first call warms jit's own cache
    for _ in range(repeats):  # the variants take turns, so a slow spell of the machine hits each alike
        for variant in variants:
            start = time.perf_counter()
            variant["call"]().block_until_ready()
            variant["times"].append(time.perf_counter() - start)
    rows = []
    for variant in variants:
        median = statistics.median(variant["times"])
        rows.append({"segments": variant["count"],
                     "slots_read": [s for _, s in decode_segments(prompt, response, variant["count"])],
                     "compile_s": round(variant["compile_s"], 2), "generate_s": round(median, 3),
                     "times_s": [round(t, 3) for t in variant["times"]],
                     "same_tokens": bool((variant["tokens"] == variants[0]["tokens"]).all()),
                     "tokens_per_s": round(batch * response / median, 1)})
    return {"size": size, "batch": batch, "prompt": prompt, "response": response, "cache_slots": prompt + response,
            "jax": jax.__version__, "backend": jax.default_backend(), "machine": machine_info(), "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="smollm2", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--segments", default="1,4", help="comma-separated decode_segments values")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = measure(args.size, args.batch, args.prompt, args.response,
                     [int(s) for s in args.segments.split(",")], args.repeats)
    for row in result["rows"]:
        print(f"decode_segments={row['segments']}: slots read {row['slots_read']}; compile {row['compile_s']} s, "
              f"generate {row['generate_s']} s ({row['tokens_per_s']} tokens/s), same tokens: {row['same_tokens']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
