"""One forward of each prompt per group against every row's own (``shared_prompt_forward``), and the prompts'
shared start once for all (``shared_prompt_prefix``): the gradient of the response log-probs (the update's forward
and backward) of GRPO groups of G samples, and the sampler's prefill of distinct prompts, on SmolLM2-135M's shape
with random weights, float32.

Each form takes the same rows (each group's G rows hold one prompt, left-padded, and G responses; with
``--prefix-length`` q every prompt starts with the same q tokens) and gives the same log-probs and gradients
(tests/test_shared_prompt.py, tests/test_shared_prefix.py); the padded form runs every row's prompt, the shared form
each group's once, the prefix form also the q shared tokens once. The prefill (``--prefill-prompts`` N > 0): N
distinct prompts into a KV cache, whole or with the shared q tokens once (``ppojax.rl.sampler.prefill``). Prints
and writes (``--json``) the median seconds of each, their ratios, the host and the commit.

    python -m benchmarks.shared_prompt --groups 2 --group-size 4 --prompt-length 256 --response-length 64 \
        --prefix-length 192 --prefill-prompts 32 --json out.json
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import SIZES, machine_info, median_seconds, source_commit
from ppojax.io.strict_json import write_json
from ppojax.models import CausalLM, ModelConfig, init_cache
from ppojax.rl.forward import logprobs_from_hidden, row_layout
from ppojax.rl.sampler import prefill

PAD = 0


def prompts_with_prefix(key, rows: int, prompt_length: int, prefix_length: int, vocab: int):
    """i32[rows, P]: prompts whose first eighth is left padding, each starting with the same ``prefix_length``
    tokens."""
    prompts = jax.random.randint(key, (rows, prompt_length), 2, vocab)
    pad = prompt_length // 8
    prompts = prompts.at[:, pad:pad + prefix_length].set(prompts[0, pad:pad + prefix_length])
    return prompts.at[:, :pad].set(PAD)


def grouped_rows(key, groups: int, group_size: int, prompt_length: int, response_length: int, vocab: int,
                 prefix_length: int = 0):
    """i32[groups * G, P + R]: each group's prompt (:func:`prompts_with_prefix`) repeated G times, then each row's
    own response."""
    prompt_key, response_key = jax.random.split(key)
    prompts = prompts_with_prefix(prompt_key, groups, prompt_length, prefix_length, vocab)
    responses = jax.random.randint(response_key, (groups * group_size, response_length), 2, vocab)
    return jnp.concatenate([jnp.repeat(prompts, group_size, axis=0), responses], axis=1)


def gradient_fn(graphdef, rows, prompt_length: int, prompt_group: int, prompt_prefix: int = 0):
    """The gradient of the summed response log-probs, the rows laid out with ``row_layout``."""
    def objective(params):
        lm = nnx.merge(graphdef, params)
        layout = row_layout(rows, prompt_length, PAD, prompt_group, prompt_prefix)
        logprobs, _ = logprobs_from_hidden(lm, layout.hidden(lm), layout.tokens, 1.0)
        return jnp.sum(logprobs)

    return jax.jit(jax.grad(objective))


def prefill_fn(graphdef, prompts, prefix_length: int):
    """The prompts i32[N, P] into an empty cache of P slots (``ppojax.rl.sampler.prefill``) -> their last logits."""
    def run(params):
        model = nnx.merge(graphdef, params)
        cache = init_cache(model.cfg, prompts.shape[0], prompts.shape[1], jnp.float32)
        last, _, _ = prefill(model, prompts, PAD, cache, prefix_length)
        return model.logits(last)

    return jax.jit(run)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--prefix-length", type=int, default=0,
                        help="tokens every prompt starts with (0: no prefix form)")
    parser.add_argument("--prefill-prompts", type=int, default=0, help="distinct prompts to prefill (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    config = ModelConfig.from_hf(dict(model_type="llama", **SIZES["smollm2"]["model"]))
    graphdef, params = nnx.split(CausalLM(config, rngs=nnx.Rngs(0)))
    rows = grouped_rows(jax.random.key(1), args.groups, args.group_size, args.prompt_length, args.response_length,
                        config.vocab_size, args.prefix_length)
    seconds = {}
    forms = [("padded", 1, 0), ("shared", args.group_size, 0)]
    if args.prefix_length:
        forms.append(("prefix", args.group_size, args.prefix_length))
    for name, group, prefix in forms:
        fn = gradient_fn(graphdef, rows, args.prompt_length, group, prefix)
        seconds[name] = median_seconds(lambda _: jax.block_until_ready(fn(params)), args.repeats)
    if args.prefill_prompts and args.prefix_length:
        prompts = prompts_with_prefix(jax.random.key(2), args.prefill_prompts, args.prompt_length, args.prefix_length,
                                      config.vocab_size)
        for name, prefix in (("prefill", 0), ("prefill_prefix", args.prefix_length)):
            fn = prefill_fn(graphdef, prompts, prefix)
            seconds[name] = median_seconds(lambda _: jax.block_until_ready(fn(params)), args.repeats)
    report = dict(groups=args.groups, group_size=args.group_size, prompt_length=args.prompt_length,
                  response_length=args.response_length, prefix_length=args.prefix_length,
                  prefill_prompts=args.prefill_prompts, padded_s=seconds["padded"], shared_prompt_s=seconds["shared"],
                  ratio=seconds["padded"] / seconds["shared"])
    line = (f"{args.groups} groups of {args.group_size}, prompts {args.prompt_length} + responses "
            f"{args.response_length} tokens, gradient of the log-probs: every row's prompt {seconds['padded']:.2f} s, "
            f"each group's once {seconds['shared']:.2f} s ({report['ratio']:.2f}x)")
    if "prefix" in seconds:
        report.update(shared_prefix_s=seconds["prefix"], prefix_ratio=seconds["padded"] / seconds["prefix"])
        line += (f", and the first {args.prefix_length} tokens once for all {seconds['prefix']:.2f} s "
                 f"({report['prefix_ratio']:.2f}x)")
    if "prefill" in seconds:
        report.update(prefill_s=seconds["prefill"], prefill_prefix_s=seconds["prefill_prefix"],
                      prefill_ratio=seconds["prefill"] / seconds["prefill_prefix"])
        line += (f"; prefill of {args.prefill_prompts} prompts: whole {seconds['prefill']:.2f} s, the shared start "
                 f"once {seconds['prefill_prefix']:.2f} s ({report['prefill_ratio']:.2f}x)")
    report.update(machine=machine_info(), commit=source_commit())
    print(line)
    if args.json:
        write_json(args.json, report, indent=1)
    return report


if __name__ == "__main__":
    main()
