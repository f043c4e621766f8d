"""One prefill per group against G prefills: GRPO/RLOO's G samples of each prompt, the prompts prefilled once
(``generate``'s ``group_size``) or repeated G times, on SmolLM2-135M's shape with random weights.

The prefill alone is timed: ``generate`` with a response of one token. Prints and writes (``--json``) the median
seconds of each form, their ratio, the host and the commit.

    python -m benchmarks.prefill_groups --prompts 8 --group-size 8 --prompt-length 128 --json out.json
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import SIZES, machine_info, median_seconds, source_commit
from ppojax.io.strict_json import write_json
from ppojax.models import CausalLM, ModelConfig
from ppojax.rl.sampler import generate


def _prefill(graphdef, group_size: int):
    return jax.jit(lambda params, prompts: generate(graphdef, params, prompts, jax.random.key(0), response_length=1,
                                                    pad_token_id=0, group_size=group_size))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    config = ModelConfig.from_hf(dict(model_type="llama", **SIZES["smollm2"]["model"]))
    graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    prompts = jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_length), 2, config.vocab_size)
    grouped_fn, repeated_fn = _prefill(graphdef, args.group_size), _prefill(graphdef, 1)
    repeated_prompts = jnp.repeat(prompts, args.group_size, axis=0)
    grouped = median_seconds(lambda _: jax.block_until_ready(grouped_fn(params, prompts)), args.repeats)
    repeated = median_seconds(lambda _: jax.block_until_ready(repeated_fn(params, repeated_prompts)), args.repeats)
    report = dict(prompts=args.prompts, group_size=args.group_size, prompt_length=args.prompt_length,
                  one_prefill_per_group_s=grouped, g_prefills_s=repeated, ratio=repeated / grouped,
                  machine=machine_info(), commit=source_commit())
    print(f"prefill of {args.prompts} prompts x {args.prompt_length} tokens, G = {args.group_size}: once per group "
          f"{grouped:.3f} s, G times {repeated:.3f} s ({repeated / grouped:.2f}x)")
    if args.json:
        write_json(args.json, report, indent=1)
    return report


if __name__ == "__main__":
    main()
