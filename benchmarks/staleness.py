"""A staleness study in miniature (AReaL's table on a toy): a tiny random Llama learns to write the word "good"
(reward: the share of its response tokens that are token 2), at ``max_staleness`` 0, 2 and 4, with plain PPO (the
clipped ratio against the stale sampler's log-probs) and with AReaL's decoupled objective.

Each configuration is ONE compiled program: whole runs (init from the seed, the fill of the first k batches,
``--updates`` iterations in a ``lax.scan``, then the held-out score) ``jax.vmap``-ed over the seeds. The held-out
score: the mean reward of responses to 64 prompts never trained on, sampled at T = 1 (``held_out``: the
policy's own distribution) and near-greedy (T = 0.01, ``held_out_greedy``). Prints a table and writes
(``--json``) every run's score, the host and the commit.

    python -m benchmarks.staleness --seeds 3 --updates 40 --json out.json
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks.common import machine_info, source_commit
from ppojax.core.masks import truncate_response
from ppojax.io.strict_json import write_json
from ppojax.models import CausalLM, ModelConfig, ScoreModel
from ppojax.rl import in_flight_updates, rollout
from ppojax.rl.actor_critic import ActorCritic
from ppojax.rl.optimizer import make_optimizer
from ppojax.rl.program import PPOProgram, iteration_keys, ppo_iteration
from ppojax.rl.rewards import TracedScores
from ppojax.rl.settings import AsyncSettings, Hyperparams, StepSettings
from ppojax.rl.types import NO_ROW, Prompts, init_train_state
from ppojax.trainer.config import PPOConfig

VOCAB, GOOD, STOP, PROMPT_LENGTH, RESPONSE_LENGTH, BATCH = 16, 2, 1, 6, 8, 16
MODEL = ModelConfig.from_hf(dict(
    model_type="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
    tie_word_embeddings=False, bos_token_id=STOP, eos_token_id=STOP, pad_token_id=0))


def good_share(queries, responses):
    """f32[B]: the share of the response's tokens that are GOOD."""
    live = responses != 0
    return jnp.sum((responses == GOOD) & live, axis=1) / jnp.maximum(jnp.sum(live, axis=1), 1)


def program_for(max_staleness: int, decoupled: bool, learning_rate: float, num_updates: int,
                behav_imp_weight_cap: float | None = None, in_flight: bool = False) -> PPOProgram:
    config = PPOConfig(batch_size=BATCH, response_length=RESPONSE_LENGTH, max_prompt_length=PROMPT_LENGTH,
                       learning_rate=learning_rate, temperature=1.0, num_ppo_epochs=2, num_mini_batches=2,
                       kl_coef=0.05, behaviour_logprobs="sampler", use_decoupled_loss=decoupled,
                       behav_imp_weight_cap=behav_imp_weight_cap if decoupled else None)
    settings = StepSettings.from_config(config, pad_token_id=0, stop_token_id=STOP, eos_token_id=STOP,
                                        num_updates=num_updates)  # the learning rate decays to 0 over them
    settings = dataclasses.replace(settings, asynchronous=AsyncSettings(max_staleness,
                                                                        in_flight_weight_updates=in_flight))
    policy_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(MODEL, rngs=nnx.Rngs(0))))
    value_def = nnx.graphdef(nnx.eval_shape(lambda: ScoreModel(MODEL, rngs=nnx.Rngs(0))))
    return PPOProgram(ActorCritic(policy_def, value_def, 0, 1.0), TracedScores(good_share), settings,
                      make_optimizer()), Hyperparams.from_config(config)


def whole_run(program, hyperparams, seed, train_prompts, eval_prompts):
    """init -> fill -> updates -> held-out score, pure. train_prompts i32[k + N, BATCH, P]; eval i32[E, P]."""
    key = jax.random.key(seed)
    policy = nnx.state(CausalLM(MODEL, rngs=nnx.Rngs(params=key)))
    value = nnx.state(ScoreModel(MODEL, rngs=nnx.Rngs(params=jax.random.fold_in(key, 1))))
    state = init_train_state({"policy": policy, "value": value}, program.optimizer, hyperparams=hyperparams,
                             frozen={"ref": jax.tree.map(jnp.copy, policy), "reward": None}, kl_coef=0.05)
    k = program.settings.asynchronous.max_staleness
    rows = lambda ids: jnp.full(ids.shape[:-1], NO_ROW, jnp.int32)  # noqa: E731
    if k:
        fill_keys = jax.vmap(lambda i: iteration_keys(jax.random.fold_in(key, 10_000 + i))[0])(jnp.arange(k))
        state, _ = in_flight_updates.fill_queue(program, state, Prompts(train_prompts[:k], rows(train_prompts[:k])),
                                                fill_keys)
    updates = train_prompts[k:]
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(updates.shape[0]))
    state, metrics = jax.lax.scan(lambda s, xs: ppo_iteration(program, s, Prompts(xs[0], rows(xs[0])), xs[1]),
                                  state, (updates, keys))
    held_out = []
    for temperature in (1.0, 0.01):  # the policy's own distribution, and near-greedy
        settings = dataclasses.replace(program.settings, sampling=dataclasses.replace(program.settings.sampling,
                                                                                      temperature=temperature))
        query_responses, _ = rollout.sample(dataclasses.replace(program, settings=settings), state, eval_prompts,
                                            jax.random.fold_in(key, 99))
        held_out.append(jnp.mean(good_share(None, truncate_response(query_responses[:, PROMPT_LENGTH:], STOP, 0))))
    return held_out, metrics["objective/scores"], metrics["objective/kl"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--objectives", nargs="+", choices=["plain", "decoupled"], default=["plain", "decoupled"])
    parser.add_argument("--behav-imp-weight-cap", type=float, default=None,
                        help="AReaL's cap on the decoupled objective's behaviour weights (default: none)")
    parser.add_argument("--modes", nargs="+", choices=["whole", "in-flight"], default=["whole"],
                        help="whole: each batch sampled by one stale policy; in-flight: its decode spread over k + 1 "
                             "updates (in_flight_weight_updates); in-flight needs staleness >= 1")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    k_max = max(args.staleness)
    draw = jax.random.randint(jax.random.key(123), ((k_max + args.updates) * BATCH + 64, PROMPT_LENGTH), 3, VOCAB)
    eval_prompts, train_all = draw[:64], draw[64:].reshape(k_max + args.updates, BATCH, PROMPT_LENGTH)
    runs = []
    configurations = [(k, objective == "decoupled", mode == "in-flight") for mode in args.modes
                      for k in args.staleness for objective in args.objectives if k or mode == "whole"]
    for k, decoupled, in_flight in configurations:
        program, hyperparams = program_for(k, decoupled, args.learning_rate, args.updates,
                                           args.behav_imp_weight_cap, in_flight)
        train_prompts = train_all[k_max - k:]  # k batches to fill, then the N batches every k's updates sample
        start = time.perf_counter()
        (held_out, greedy), scores, kl = jax.jit(jax.vmap(
            lambda seed: whole_run(program, hyperparams, seed, train_prompts, eval_prompts)))(
            jnp.arange(args.seeds))
        seconds = time.perf_counter() - start
        runs.append(dict(max_staleness=k, objective="decoupled" if decoupled else "plain",
                         mode="in-flight" if in_flight else "whole",
                         held_out=[round(float(x), 4) for x in held_out],
                         held_out_greedy=[round(float(x), 4) for x in greedy],
                         final_batch_score=[round(float(x), 4) for x in scores[:, -1]],
                         final_kl=[round(float(x), 4) for x in kl[:, -1]], seconds=round(seconds, 1)))
        print(f"staleness {k} {runs[-1]['objective']:9s} {runs[-1]['mode']:9s}: held-out {runs[-1]['held_out']} "
              f"(mean {float(jnp.mean(held_out)):.3f}), final KL {runs[-1]['final_kl']}, {seconds:.0f} s",
              flush=True)
    report = dict(seeds=args.seeds, updates=args.updates, learning_rate=args.learning_rate,
                  behav_imp_weight_cap=args.behav_imp_weight_cap, runs=runs,
                  machine=machine_info(), commit=source_commit())
    if args.json:
        write_json(args.json, report, indent=1)
    return report


if __name__ == "__main__":
    main()
