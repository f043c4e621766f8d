"""Padding left out: the update and the rollout's forwards padded vs packed (``padding_free``) and the rollout's
decode loop padded vs continuous batching (``rollout_slots``), on realistic response lengths, in one run on one host.

    python -m benchmarks.padding_free [--json out.json] [--repeats 3]

For each length distribution, one rollout batch of B rows (prompt P, response limit R) is built with those
lengths (random tokens, left-padded prompts, a stop token at each response's end) and ONE PPO update (``learn``:
GAE with a value model, 1 epoch, 1 mini-batch of B rows, 2 padded micro-batches of B/2 rows) is compiled and
timed: padded, packed with the default budget (micro-batches of B/2 packed rows), packed in micro-batches of
2 rows (``max_tokens_per_micro_batch`` = 2 rows: finer steps) and, with ``--long-rows K``, in micro-batches of one
row of K padded rows' slots (``packed_row_length``: spans longer than half a padded row share it), in turn,
``--repeats`` times each; the median is reported with the padding fraction, the real tokens per second and the
compiler's temporaries (XLA:CPU's memory analysis). The rollout's forwards on the same batch
(``experience_forwards``: policy, reference and value model, all rows at once when padded; 8-row and 2-row packed
micro-batches, and the long rows) are timed alongside. Distributions:

- ``lognormal``: responses drawn lognormally (median R/8) with a long tail, clipped to R (so some hit it);
- ``lognormal_half``: the same with median R/3, about half the slots padding;
- ``math_run``: the response lengths of a math run's held-out answers (``configs/math_grpo.yaml``), the
  SmolLM2 policy's own stop-token distribution, scaled from its 64-token limit to R;
- ``half``: every response exactly half the limit (a padding fraction near 50 %);
- ``full``: every response at the limit (no response padding: the packing's overhead).

The rollout: the sampler's decode loop (``generate``, all B rows until the longest is done) against continuous
batching (``generate_continuous`` with B/4 slots) on the same model, whose stop token is made likely after
any of k chosen tokens (its LM-head column is the sum of their embeddings, scaled): sampling then stops after
each token with a fixed probability, geometric lengths with a long tail clipped at R. Both give the same tokens
(tests/test_continuous_sampler.py); timed are the whole compiled sampler calls, and the decode steps each ran.

The model is a small Llama (the tiny benchmark shape made deeper and wider) in float32, random weights.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: response lengths (tokens, the stop token included; limit 64) of SmolLM2-135M-Instruct's answers to 100 held-out
#: arithmetic problems after a math run (configs/math_grpo.yaml, seed 0): the policy's own stop-token distribution
MATH_RUN_LENGTHS = (
    64, 46, 35, 36, 37, 64, 63, 64, 36, 21, 37, 64, 29, 33, 38, 64, 64, 31, 49, 31, 64, 36, 41, 35, 64, 64, 40,
    53, 64, 19, 64, 25, 30, 64, 34, 37, 29, 36, 64, 46, 64, 28, 51, 64, 64, 28, 47, 39, 39, 37, 64, 34, 59, 64,
    29, 32, 43, 64, 35, 38, 64, 64, 38, 38, 31, 33, 29, 24, 39, 50, 27, 32, 64, 19, 27, 49, 63, 39, 64, 33, 64,
    29, 64, 64, 64, 34, 26, 32, 36, 19, 64, 35, 45, 64, 35, 30, 37, 44, 32, 39)

P, R, B = 64, 512, 16
MODEL = dict(model_type="llama", vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
             num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
PAD, STOP = 0, 2


def response_lengths(name: str, rng) -> np.ndarray:
    if name == "lognormal":
        return np.clip(rng.lognormal(np.log(R / 8), 1.0, size=B).astype(int), 1, R)
    if name == "lognormal_half":
        return np.clip(rng.lognormal(np.log(R / 3), 1.0, size=B).astype(int), 1, R)
    if name == "math_run":
        source = np.asarray(MATH_RUN_LENGTHS)
        return np.clip((rng.choice(source, size=B) * (R / 64)).astype(int), 1, R)
    if name == "half":
        return np.full(B, R // 2)
    if name == "full":
        return np.full(B, R)
    raise ValueError(name)


def experience(lengths, rng):
    from ppojax.core.masks import INVALID_LOGPROB
    from ppojax.rl.types import Experience

    qr = rng.integers(3, MODEL["vocab_size"], size=(B, P + R))
    pads = rng.integers(0, P // 2, size=B)
    for i in range(B):
        qr[i, :pads[i]] = PAD
        qr[i, P + lengths[i] - 1] = STOP
        qr[i, P + lengths[i]:] = PAD
    t = np.arange(R)[None, :]
    padding_mask = jnp.asarray(t >= lengths[:, None])
    padding_mask_p1 = jnp.asarray(t > lengths[:, None])
    near = -np.log(MODEL["vocab_size"]) + 0.3 * rng.normal(size=(B, R))
    logprobs = jnp.where(padding_mask, INVALID_LOGPROB, jnp.asarray(near, jnp.float32))
    qr = jnp.asarray(qr, jnp.int32)
    return Experience(queries=qr[:, :P], query_responses=qr, responses=qr[:, P:], logprobs=logprobs,
                      ref_logprobs=logprobs, values=jnp.where(padding_mask_p1, 0.0, 0.1),
                      scores=jnp.asarray(rng.normal(size=B), jnp.float32),
                      last_index=jnp.asarray(lengths - 1, jnp.int32), padding_mask=padding_mask,
                      padding_mask_p1=padding_mask_p1, contains_stop=jnp.ones(B, bool),
                      num_eos_tokens=jnp.int32(B))


def programs(long_rows: int = 0):
    from ppojax.models import CausalLM, ModelConfig, ScoreModel
    from ppojax.rl.actor_critic import ActorCritic
    from ppojax.rl.optimizer import make_optimizer
    from ppojax.rl.program import PPOProgram
    from ppojax.rl.rewards import GivenScores
    from ppojax.rl.settings import Hyperparams, StepSettings
    from ppojax.rl.types import init_train_state
    from ppojax.trainer.config import PPOConfig

    cfg = ModelConfig.from_hf(MODEL)
    policy = CausalLM(cfg, rngs=nnx.Rngs(0))
    value = ScoreModel(cfg, rngs=nnx.Rngs(1))
    actor_critic = ActorCritic(nnx.graphdef(policy), nnx.graphdef(value), PAD, 0.7)
    out = {}
    variants = {"padded": dict(padding_free=False), "packed": dict(padding_free=True),
                "packed_2_rows": dict(padding_free=True, max_tokens_per_micro_batch=2 * (P + R))}
    if long_rows:  # one row of K padded rows' slots: spans longer than half a padded row share it
        variants["packed_long_row"] = dict(padding_free=True, packed_row_length=long_rows * (P + R),
                                           max_tokens_per_micro_batch=long_rows * (P + R))
    for variant, options in variants.items():
        config = PPOConfig(batch_size=B, max_prompt_length=P, response_length=R, num_ppo_epochs=1,
                           num_mini_batches=1, gradient_accumulation_steps=2, **options)
        settings = StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=STOP, eos_token_id=STOP,
                                            vocab_size=cfg.vocab_size)
        program = PPOProgram(actor_critic, GivenScores(None), settings, make_optimizer())  # learn() reads no reward
        params = {"policy": nnx.state(policy), "value": nnx.state(value)}
        state = init_train_state(params, program.optimizer, hyperparams=Hyperparams.from_config(config),
                                 frozen={"ref": nnx.state(policy), "reward": None})
        out[variant] = (program, state)
    return out


DISTRIBUTIONS = ("lognormal", "lognormal_half", "math_run", "half", "full")


def measure(repeats: int, distributions=DISTRIBUTIONS, long_rows: int = 0) -> list:
    from ppojax.rl.rollout import experience_forwards
    from ppojax.rl.update import learn

    rng = np.random.default_rng(0)
    built = programs(long_rows)
    rows, compiled, forwards = [], {}, {}
    for name in distributions:
        lengths = response_lengths(name, np.random.default_rng([0, DISTRIBUTIONS.index(name)]))
        exp = experience(lengths, rng)
        result = {"distribution": name, "response_lengths": lengths.tolist()}
        if not compiled:  # every distribution has the same shapes: one program per variant and phase
            for variant, (program, state) in built.items():
                step = jax.jit(lambda s, e, k, program=program: learn(program, s, e, k))
                compiled[variant] = step.lower(state, exp, jax.random.key(0)).compile()
                rollout_forwards = jax.jit(lambda s, qr, program=program: experience_forwards(program, s, qr, P))
                forwards[variant] = rollout_forwards.lower(state, exp.query_responses).compile()
        times, metrics, forward_times = {v: [] for v in built}, {}, {v: [] for v in built}
        for variant in built:
            result[f"{variant}_temp_bytes"] = int(compiled[variant].memory_analysis().temp_size_in_bytes)
            result[f"{variant}_forwards_temp_bytes"] = int(forwards[variant].memory_analysis().temp_size_in_bytes)
        for _ in range(repeats):
            for variant, (program, state) in built.items():
                start = time.perf_counter()
                _, metrics[variant] = jax.block_until_ready(compiled[variant](state, exp, jax.random.key(0)))
                times[variant].append(time.perf_counter() - start)
                start = time.perf_counter()
                jax.block_until_ready(forwards[variant](state, exp.query_responses))
                forward_times[variant].append(time.perf_counter() - start)
        real = float(metrics["padded"]["perf/real_tokens"])
        result.update(padding_fraction=float(metrics["padded"]["perf/padding_fraction"]), real_tokens=real,
                      padded_micro_batches=2, times=times)
        line = f"{name:>10}: padding {result['padding_fraction']:.2f}"
        for variant in built:
            seconds = statistics.median(times[variant])
            result[f"{variant}_s"] = seconds
            result[f"{variant}_real_tokens_per_s"] = real / seconds
            line += f"  {variant} {seconds:.2f} s"
            if variant != "padded":
                micro = float(metrics[variant]["perf/packed_micro_batches"])
                result[f"{variant}_micro_batches"] = micro
                result[f"{variant}_speedup"] = result["padded_s"] / seconds
                line += f" ({result['padded_s'] / seconds:.2f}x, {micro:.0f} micro-batches)"
        result["forward_times"] = forward_times
        line += "\n" + " " * 12 + "rollout forwards:"
        for variant in built:
            seconds = statistics.median(forward_times[variant])
            result[f"{variant}_forwards_s"] = seconds
            line += f"  {variant} {seconds:.2f} s"
            if variant != "padded":
                result[f"{variant}_forwards_speedup"] = result["padded_forwards_s"] / seconds
                line += f" ({result['padded_forwards_s'] / seconds:.2f}x)"
        print(line, flush=True)
        rows.append(result)
    return rows


def stop_after(policy, tokens, scale: float):
    """``policy`` with its stop token's LM-head column set to ``scale`` x the sum of ``tokens``' embeddings: after
    one of them the stop token is the likeliest next token."""
    embedding = policy.backbone.embed["embedding"][...]
    kernel = policy.lm_head["kernel"]
    kernel.value = kernel[...].at[:, STOP].set(scale * embedding[np.asarray(tokens)].sum(axis=0))
    return policy


def measure_rollout(repeats: int, scale: float, chosen: int) -> dict:
    from ppojax.models import CausalLM, ModelConfig
    from ppojax.rl.continuous import generate_continuous_jit
    from ppojax.rl.sampler import generate_jit

    cfg = ModelConfig.from_hf(MODEL)
    rng = np.random.default_rng(1)
    policy = stop_after(CausalLM(cfg, rngs=nnx.Rngs(0)), rng.choice(np.arange(3, cfg.vocab_size), chosen,
                                                                   replace=False), scale)
    graphdef, params = nnx.split(policy)
    prompts = np.asarray(rng.integers(3, cfg.vocab_size, size=(B, P)), np.int32)
    prompts[:, :4] = PAD
    options = dict(response_length=R, pad_token_id=PAD, stop_token_id=STOP, temperature=1.0)
    slots = B // 4

    def padded(key):
        return generate_jit(graphdef, params, prompts, key, **options)

    def continuous(key):
        return generate_continuous_jit(graphdef, params, prompts, key, slots=slots, return_steps=True, **options)

    times = {"padded": [], "continuous": []}
    key = jax.random.key(5)
    responses = jax.block_until_ready(padded(key))
    (same, steps) = jax.block_until_ready(continuous(key))  # compiles both
    for _ in range(repeats):
        for name, fn in (("padded", padded), ("continuous", continuous)):
            start = time.perf_counter()
            jax.block_until_ready(fn(key))
            times[name].append(time.perf_counter() - start)
    responses = np.asarray(responses)
    stopped = responses == STOP
    lengths = np.where(stopped.any(1), stopped.argmax(1) + 1, R)
    padded_s, continuous_s = statistics.median(times["padded"]), statistics.median(times["continuous"])
    result = dict(slots=slots, response_lengths=lengths.tolist(), same_tokens=bool((np.asarray(same) ==
                  responses).all()), padded_decode_steps=int(lengths.max()), continuous_decode_steps=int(steps),
                  response_padding_fraction=float(1 - lengths.sum() / (B * R)), padded_s=padded_s,
                  continuous_s=continuous_s, speedup=padded_s / continuous_s,
                  padded_tokens_per_s=float(lengths.sum() / padded_s),
                  continuous_tokens_per_s=float(lengths.sum() / continuous_s), times=times)
    print(f"rollout: lengths mean {lengths.mean():.0f} max {lengths.max()}; padded {padded_s:.2f} s "
          f"({result['padded_decode_steps']} steps of {B} rows), continuous {continuous_s:.2f} s "
          f"({result['continuous_decode_steps']} steps of {slots} rows): {padded_s / continuous_s:.2f}x", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stop-scale", type=float, default=40.0, help="how likely the stop token is made after "
                        "its chosen tokens (the LM-head column's scale)")
    parser.add_argument("--stop-tokens", type=int, default=128, help="tokens after which the stop token is likely")
    parser.add_argument("--only", choices=("update", "rollout"))
    parser.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=DISTRIBUTIONS)
    parser.add_argument("--long-rows", type=int, default=0, metavar="K",
                        help="also pack into rows of K padded rows' slots (packed_row_length), one row per micro-batch")
    parser.add_argument("--json")
    args = parser.parse_args()
    from ppojax.backends import start_program

    start_program()
    from benchmarks.common import machine_info
    from ppojax.io.strict_json import write_json

    out = {"machine": machine_info(), "shape": dict(prompt=P, response_limit=R, batch=B, model=MODEL),
           "update": "learn: GAE + value model, 1 epoch, 1 mini-batch, 2 micro-batches, float32"}
    if args.only != "rollout":
        out["rows"] = measure(args.repeats, args.distributions, args.long_rows)
    if args.only != "update":
        out["rollout"] = measure_rollout(args.repeats, args.stop_scale, args.stop_tokens)
    if args.json:
        write_json(args.json, out, indent=1)


if __name__ == "__main__":
    main()
