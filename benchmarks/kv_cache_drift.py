"""What an 8-bit KV cache (``kv_cache_dtype: int8``) changes in sampling: SmolLM2-135M-Instruct (the bundled
checkpoint) continues ``--prompts`` movie-review openings for ``--tokens`` tokens with a float32 cache and with an
int8 one, from the same key.

Reported: the cache's bytes of each; the sampled tokens' log-prob drift of the int8 sampler against a float32
forward over the same tokens (mean, 99th percentile and largest |difference|), beside a bfloat16 cache's (what a
bfloat16 model keeps) and the float32 sampler's own; the share of rows whose int8 tokens are the same as the float32
sampler's, and where the first difference falls; and the decode time of each (median of ``--repeats`` after one
compiling call).

    python -m benchmarks.kv_cache_drift --prompts 16 --tokens 64 --json out.json
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from benchmarks.common import machine_info, median_seconds, source_commit
from ppojax.assets import movie_review_prompts, smollm2_checkpoint
from ppojax.io.strict_json import write_json
from ppojax.models import init_cache, load_pretrained
from ppojax.rl.forward import response_logprobs
from ppojax.rl.sampler import generate
from ppojax.trainer.data import left_pad


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    path = smollm2_checkpoint(log=lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model, _ = load_pretrained(path)
    graphdef, params = nnx.split(model)
    pad = tokenizer.pad_token_id
    texts = [t for t in movie_review_prompts(log=lambda *a, **k: None)][:args.prompts]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, ids))
    prompts = jnp.asarray(left_pad(ids, width, pad))
    key = jax.random.key(0)

    def sampler(dtype):
        return jax.jit(lambda p, x, k: generate(graphdef, p, x, k, response_length=args.tokens, pad_token_id=pad,
                                                temperature=1.0, cache_dtype=dtype, return_logprobs=True))

    report = dict(prompts=args.prompts, tokens=args.tokens, machine=machine_info(), commit=source_commit())
    samples = {}
    for name, dtype in (("float32", None), ("bfloat16", "bfloat16"), ("int8", "int8")):
        run = sampler(dtype)
        responses, logprobs = jax.block_until_ready(run(params, prompts, key))
        decode_s = median_seconds(lambda i: jax.block_until_ready(run(params, prompts, jax.random.key(i + 1))),
                                  args.repeats)
        forward = response_logprobs(model, jnp.concatenate([prompts, responses], 1), width, pad, 1.0)[0]
        real = np.asarray(responses) != pad
        drift = np.abs(np.asarray(logprobs) - np.asarray(forward))[real]
        cache = init_cache(model.cfg, args.prompts, width + args.tokens, dtype or jnp.float32)
        report[name] = dict(cache_bytes=int(cache.keys.nbytes + cache.values.nbytes),
                            drift_mean=float(drift.mean()), drift_p99=float(np.quantile(drift, 0.99)),
                            drift_max=float(drift.max()), decode_s=decode_s)
        samples[name] = np.asarray(responses)
    same = samples["float32"] == samples["int8"]
    first = [int(np.argmin(row)) if not row.all() else args.tokens for row in same]
    report["rows_identical"] = float(np.mean(same.all(axis=1)))
    report["first_difference_median"] = float(statistics.median(first))
    f, b, q = report["float32"], report["bfloat16"], report["int8"]
    print(f"cache: float32 {f['cache_bytes'] / 1e6:.1f} MB, bfloat16 {b['cache_bytes'] / 1e6:.1f} MB, int8 "
          f"{q['cache_bytes'] / 1e6:.1f} MB; log-prob drift against a float32 forward (mean, p99, max): int8 "
          f"{q['drift_mean']:.2e}, {q['drift_p99']:.2e}, {q['drift_max']:.2e}; bfloat16 {b['drift_mean']:.2e}, "
          f"{b['drift_p99']:.2e}, {b['drift_max']:.2e}; float32 max {f['drift_max']:.2e}; rows identical to float32's "
          f"{100 * report['rows_identical']:.0f} %, first difference at token {report['first_difference_median']:.0f} "
          f"(median); decode {f['decode_s']:.2f} s / {b['decode_s']:.2f} s / {q['decode_s']:.2f} s")
    if args.json:
        write_json(args.json, report, indent=2)
    return report


if __name__ == "__main__":
    main()
