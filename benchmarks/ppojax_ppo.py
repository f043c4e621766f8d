"""ppojax's side of the PPO benchmark: the same work as ``benchmarks.trl_ppo`` (contract in
``benchmarks/common.py``): policy + frozen reference + reward model + value model (reward/value = the policy's
backbone shape + a Linear(hidden, 1) score head), fixed-length responses, ``num_ppo_epochs`` epochs.

    python -m benchmarks.ppojax_ppo --size tiny [--updates N] [--model-dir DIR] [--json out.json]

Each update = one rollout (jitted sampler, then the jitted reference/value/reward forwards) and one update
(the single jitted program of ``ppojax.update``), timed after ``jax.block_until_ready``.
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.common import make_config, peak_rss_mb, summarize


def _models(config):
    """(policy, reward ScoreModel, value ScoreModel, ModelConfig) for the benchmark's shapes."""
    from ppojax.models import CausalLM, ModelConfig, ScoreModel, load_pretrained

    if config.get("model_dir"):
        policy, cfg = load_pretrained(config["model_dir"])
        reward, _ = load_pretrained(config["model_dir"], kind="score", seed=1)
    else:
        cfg = ModelConfig.from_hf(dict(config["model"], model_type="llama"))
        policy = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
        # Random init compiled once (an eager init of a large model is slow).
        graphdef, _ = nnx.split(policy)
        state = jax.jit(lambda: nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))[1])()
        policy = nnx.merge(graphdef, state)
        reward_graphdef, _ = nnx.split(nnx.eval_shape(lambda: ScoreModel(cfg, rngs=nnx.Rngs(1))))
        reward = nnx.merge(reward_graphdef, jax.jit(lambda: nnx.split(ScoreModel(cfg, rngs=nnx.Rngs(1)))[1])())
    return policy, reward, cfg


def run(config: dict) -> dict:
    from ppojax.actor_critic import ActorCritic
    from ppojax.forward import auto_chunk_size
    from ppojax.rollout import RolloutSettings, experience_forwards, finalize_scores, sample_responses
    from ppojax.update import UpdateSettings, init_train_state, make_ppo_update, make_optimizer

    t_setup = time.perf_counter()
    policy, reward, _ = _models(config)
    policy_graphdef, policy_params = nnx.split(policy)
    reward_graphdef, reward_params = nnx.split(reward)
    ref_params = jax.tree.map(jnp.copy, policy_params)
    value_params = jax.tree.map(jnp.copy, reward_params)  # TRL: the value model starts as the reward model
    pad = config["pad_token_id"]
    # logits chunking as PPOTrainer sizes it (logits_chunk_size=None): one micro-batch = the whole batch
    chunk = auto_chunk_size(config["batch_size"], config["response_length"], policy.cfg.vocab_size)
    settings = RolloutSettings(response_length=config["response_length"], pad_token_id=pad,
                               temperature=config["temperature"], stop_token_id=None, logprob_chunk_size=chunk)
    actor_critic = ActorCritic(policy_graphdef, reward_graphdef, pad, config["temperature"], chunk)
    update_settings = UpdateSettings(num_ppo_epochs=config["num_ppo_epochs"],
                                     num_mini_batches=config["num_mini_batches"],
                                     learning_rate=config["learning_rate"], num_updates=config["num_updates"])
    optimizer = make_optimizer()
    state = init_train_state({"policy": policy_params, "value": value_params}, optimizer)
    update = make_ppo_update(actor_critic, update_settings, optimizer)
    prompts = np.asarray(config["prompts"], np.int32)
    B, P = config["batch_size"], config["prompt_length"]
    key = jax.random.key(config["seed"])
    jax.block_until_ready(state)
    setup_s = time.perf_counter() - t_setup

    records = []
    previous_end = time.perf_counter()
    # ``stop_after_updates``: time only the first updates of a run configured for ``num_updates`` (the
    # learning-rate schedule, hence the compiled update, depends on num_updates).
    for u in range(config.get("stop_after_updates") or config["num_updates"]):
        cpu0 = time.process_time()
        key, k_gen, k_upd = jax.random.split(key, 3)
        queries = jnp.asarray(prompts[u * B:(u + 1) * B])
        t0 = time.perf_counter()
        query_responses = jax.block_until_ready(
            sample_responses(policy_graphdef, state.params["policy"], queries, k_gen, settings))
        t1 = time.perf_counter()
        experience = experience_forwards(
            state.params["policy"], ref_params, state.params["value"], reward_params, query_responses,
            prompt_length=P, settings=settings, policy_graphdef=policy_graphdef,
            value_graphdef=reward_graphdef, reward_graphdef=reward_graphdef)
        experience = jax.block_until_ready(finalize_scores(experience, experience.scores, settings))
        t2 = time.perf_counter()
        state, metrics = update(state, experience, k_upd, jnp.float32(0.05))
        jax.block_until_ready((state, metrics))
        t3 = time.perf_counter()
        records.append({"total_s": t3 - previous_end, "generation_s": t1 - t0, "rollout_s": t2 - t0,
                        "update_s": t3 - t2, "cpu_s": time.process_time() - cpu0})
        previous_end = t3
    out = summarize(config, records, setup_s)
    out["peak_rss_mb"] = peak_rss_mb()
    out["jax_version"] = jax.__version__
    out["device"] = str(jax.devices()[0].platform)
    out["update_compilations"] = update._cache_size()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--updates", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from ppojax.host_memory import keep_freed_memory

    keep_freed_memory()  # as the ppojax CLI does, before JAX starts
    result = run(make_config(args.size, quick=args.quick, num_updates=args.updates, model_dir=args.model_dir))
    text = json.dumps({k: v for k, v in result.items() if k != "updates"}, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
