"""Whole PPO runs of a tiny language model, one per seed, as ONE compiled program (purejaxrl-style).

Every piece of a ppojax iteration is a pure function of its inputs, so a complete run — initialising the
policy, value model and reference from a seed, then K PPO iterations (sampling, forwards, a reward written in
JAX, GAE, epochs of clipped updates, all inside ``lax.scan``) — is one function of the seed, and ``jax.vmap``
runs several of them side by side. Run it (about a minute on a 2-core CPU)::

    python examples/vmap_seeds.py

or paste the cells into a notebook. The reward: the fraction of generated tokens that are the word "good".
"""
# %% Imports and the tiny setup
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax.rl.actor_critic import ActorCritic
from ppojax.trainer.config import PPOConfig
from ppojax.models import CausalLM, ModelConfig, ScoreModel
from ppojax.rl.rewards import TracedScores
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.program import PPOProgram, ppo_iteration
from ppojax.rl.types import init_train_state
from ppojax.rl.optimizer import make_optimizer

PAD, EOS, GOOD = 0, 1, 2          # token ids of a 16-word vocabulary
SEEDS, ITERATIONS, BATCH = 4, 20, 16

model_config = ModelConfig.from_hf(dict(
    model_type="llama", vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD))


def good_fraction(queries, responses):
    """The reward, in JAX: f32[B] fraction of live response tokens that are GOOD."""
    live = responses != PAD
    return jnp.sum((responses == GOOD) & live, axis=1) / jnp.maximum(jnp.sum(live, axis=1), 1)


# %% The program: static settings, graph definitions, the reward source
config = PPOConfig(batch_size=BATCH, response_length=8, max_prompt_length=4, learning_rate=3e-3,
                   temperature=1.0, num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.05)
settings = StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=EOS, eos_token_id=EOS,
                                    num_updates=ITERATIONS)
policy_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(model_config, rngs=nnx.Rngs(0))))
value_def = nnx.graphdef(nnx.eval_shape(lambda: ScoreModel(model_config, rngs=nnx.Rngs(0))))
program = PPOProgram(ActorCritic(policy_def, value_def, PAD, temperature=1.0), TracedScores(good_fraction),
                     settings, make_optimizer())


# %% One whole run as a pure function of the seed
def run(seed, prompts):
    """prompts: i32[ITERATIONS, BATCH, P]. Returns the per-iteration mean score f32[ITERATIONS]."""
    key = jax.random.key(seed)
    policy = nnx.state(CausalLM(model_config, rngs=nnx.Rngs(params=key)))
    value = nnx.state(ScoreModel(model_config, rngs=nnx.Rngs(params=jax.random.fold_in(key, 1))))
    state = init_train_state({"policy": policy, "value": value}, program.optimizer,
                             hyperparams=Hyperparams.from_config(config),
                             frozen={"ref": jax.tree.map(jnp.copy, policy), "reward": None}, kl_coef=0.05)
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(ITERATIONS))
    _, metrics = jax.lax.scan(lambda s, xs: ppo_iteration(program, s, *xs), state, (prompts, keys))
    return metrics["objective/scores"]


# %% Prompts (random words, left padded) and all seeds at once
rng = np.random.default_rng(0)
prompts = rng.integers(3, 16, size=(ITERATIONS, BATCH, 4)).astype(np.int32)
prompts[..., :1] = np.where(rng.random((ITERATIONS, BATCH, 1)) < 0.5, PAD, prompts[..., :1])

if __name__ == "__main__":
    scores = jax.jit(jax.vmap(run, in_axes=(0, None)))(jnp.arange(SEEDS), jnp.asarray(prompts))
    scores = np.asarray(scores)  # [SEEDS, ITERATIONS]
    for seed, row in enumerate(scores):
        print(f"seed {seed}: mean score {row[:3].mean():.3f} (first 3 iterations) -> {row[-3:].mean():.3f} (last 3)")
    print(f"across seeds: {scores[:, :3].mean():.3f} -> {scores[:, -3:].mean():.3f} "
          f"(std of the final score over seeds {scores[:, -3:].mean(1).std():.3f})")
