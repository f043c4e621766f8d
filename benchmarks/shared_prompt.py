"""One forward of each prompt per group against every row's own (``shared_prompt_forward``): the gradient of the
response log-probs (the update's forward and backward) of GRPO groups of G samples, on SmolLM2-135M's shape with
random weights, float32.

Both forms take the same rows (each group's G rows hold one prompt, left-padded, and G responses) and give the same
log-probs and gradients (tests/test_shared_prompt.py); the padded form runs every row's prompt, the shared form each
group's once. Prints and writes (``--json``) the median seconds of each, their ratio, the host and the commit.

    python -m benchmarks.shared_prompt --groups 2 --group-size 4 --prompt-length 256 --response-length 64 \
        --json out.json
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import SIZES, machine_info, median_seconds, source_commit
from ppojax.models import CausalLM, ModelConfig
from ppojax.rl.forward import logprobs_from_hidden, row_layout

PAD = 0


def grouped_rows(key, groups: int, group_size: int, prompt_length: int, response_length: int, vocab: int):
    """i32[groups * G, P + R]: each group's prompt (its first eighth left padding) repeated G times, then each row's
    own response."""
    prompt_key, response_key = jax.random.split(key)
    prompts = jax.random.randint(prompt_key, (groups, prompt_length), 2, vocab)
    prompts = prompts.at[:, :prompt_length // 8].set(PAD)
    responses = jax.random.randint(response_key, (groups * group_size, response_length), 2, vocab)
    return jnp.concatenate([jnp.repeat(prompts, group_size, axis=0), responses], axis=1)


def gradient_fn(graphdef, rows, prompt_length: int, prompt_group: int):
    """The gradient of the summed response log-probs, the rows laid out with ``row_layout``."""
    def objective(params):
        lm = nnx.merge(graphdef, params)
        layout = row_layout(rows, prompt_length, PAD, prompt_group)
        logprobs, _ = logprobs_from_hidden(lm, layout.hidden(lm), layout.tokens, 1.0)
        return jnp.sum(logprobs)

    return jax.jit(jax.grad(objective))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    config = ModelConfig.from_hf(dict(model_type="llama", **SIZES["smollm2"]["model"]))
    graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    rows = grouped_rows(jax.random.key(1), args.groups, args.group_size, args.prompt_length, args.response_length,
                        config.vocab_size)
    seconds = {}
    for name, group in (("padded", 1), ("shared", args.group_size)):
        fn = gradient_fn(graphdef, rows, args.prompt_length, group)
        seconds[name] = median_seconds(lambda _: jax.block_until_ready(fn(params)), args.repeats)
    ratio = seconds["padded"] / seconds["shared"]
    report = dict(groups=args.groups, group_size=args.group_size, prompt_length=args.prompt_length,
                  response_length=args.response_length, padded_s=seconds["padded"], shared_prompt_s=seconds["shared"],
                  ratio=ratio, machine=machine_info(), commit=source_commit())
    print(f"{args.groups} groups of {args.group_size}, prompts {args.prompt_length} + responses "
          f"{args.response_length} tokens, gradient of the log-probs: every row's prompt {seconds['padded']:.2f} s, "
          f"each group's once {seconds['shared']:.2f} s ({ratio:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
