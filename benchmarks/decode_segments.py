"""The sampler's decode loop in segments (``decode_segments``) against one loop over the whole KV cache, on this
machine: compile time and wall time of ``generate`` for the same batch, key and tokens.

    python -m benchmarks.decode_segments [--size smollm2] [--batch 8] [--prompt 128 --response 512]
        [--segments 1,4] [--repeats 2] [--json out.json]

The model is the size's config from ``benchmarks.common`` with random weights (float32, as a CPU run's
default), prompts of ``--prompt`` random tokens, no stop token: every row decodes ``--response`` tokens, so each
variant does the same steps. One segment reads all prompt + response slots at every step; S segments read, in
the k-th loop, only the slots filled by its end. Reported per variant: the compile, and the median of
``--repeats`` calls after a warm-up; the tokens are checked equal to the first variant's.
"""
from __future__ import annotations

import argparse
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
    rows, first = [], None
    for count in segments:
        kwargs = dict(response_length=response, pad_token_id=0, temperature=1.0, segments=count)
        start = time.perf_counter()
        generate_jit.lower(graphdef, params, prompts, jax.random.key(0), **kwargs).compile()
        compile_s = time.perf_counter() - start
        call = lambda: generate_jit(graphdef, params, prompts, jax.random.key(0), **kwargs).block_until_ready()  # noqa: E731
        tokens = np.asarray(call())  # warm-up (and jit's own cache entry)
        first = tokens if first is None else first
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        rows.append({"segments": count, "slots_read": [s for _, s in decode_segments(prompt, response, count)],
                     "compile_s": round(compile_s, 2), "generate_s": round(statistics.median(times), 3),
                     "times_s": [round(t, 3) for t in times], "same_tokens": bool((tokens == first).all()),
                     "tokens_per_s": round(batch * response / statistics.median(times), 1)})
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
