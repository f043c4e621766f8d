"""A learning-rate x seed grid of tiny PPO runs as ONE compiled, vmapped train step.

The learning rate (like the clip ranges and the loss coefficients) is a traced value of the ``TrainState``
(``state.hyperparams``), not part of the compiled program. So the states of several runs, each with its own seed
and learning rate, stack on a leading axis, and ``jax.vmap`` of one PPO iteration (sampling, forwards, a reward
written in JAX, GAE, epochs of clipped updates) advances all of them at once. Run it (about a minute on a 2-core
CPU)::

    python examples/vmap_lr_sweep.py

The reward: the fraction of generated tokens that are the word "good". tests/test_train_step.py checks that the
vmapped grid equals the same runs one by one.
"""
# %% Imports and the tiny setup
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax.models import CausalLM, ModelConfig, ScoreModel
from ppojax.rl.actor_critic import ActorCritic
from ppojax.rl.optimizer import make_optimizer
from ppojax.rl.program import PPOProgram, ppo_iteration
from ppojax.rl.rewards import TracedScores
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.types import init_train_state
from ppojax.trainer.config import PPOConfig

PAD, EOS, GOOD = 0, 1, 2          # token ids of a 16-word vocabulary
LEARNING_RATES = (3e-4, 1e-3, 3e-3)
SEEDS = (0, 1)
ITERATIONS, BATCH, PROMPT = 12, 16, 4

model_config = ModelConfig.from_hf(dict(
    model_type="llama", vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD))
config = PPOConfig(batch_size=BATCH, response_length=8, max_prompt_length=PROMPT, temperature=1.0,
                   num_ppo_epochs=2, num_mini_batches=2, kl_coef=0.05, lr_scheduler_type="constant")


def good_fraction(queries, responses):
    """The reward, in JAX: f32[B] fraction of live response tokens that are GOOD."""
    live = responses != PAD
    return jnp.sum((responses == GOOD) & live, axis=1) / jnp.maximum(jnp.sum(live, axis=1), 1)


# %% The program: static settings, graph definitions, the reward source (the same for every run of the grid)
def make_program(iterations=ITERATIONS):
    settings = StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=EOS, eos_token_id=EOS,
                                        num_updates=iterations)
    policy_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(model_config, rngs=nnx.Rngs(0))))
    value_def = nnx.graphdef(nnx.eval_shape(lambda: ScoreModel(model_config, rngs=nnx.Rngs(0))))
    return PPOProgram(ActorCritic(policy_def, value_def, PAD, temperature=1.0), TracedScores(good_fraction),
                      settings, make_optimizer())


# %% One run's state: models from the seed, the config's hyperparameters with this run's learning rate
def init_state(program, seed, learning_rate):
    """seed: i32[] and learning_rate: f32[] (either may be traced: vmap this over a grid)."""
    key = jax.random.key(seed)
    policy = nnx.state(CausalLM(model_config, rngs=nnx.Rngs(params=key)))
    value = nnx.state(ScoreModel(model_config, rngs=nnx.Rngs(params=jax.random.fold_in(key, 1))))
    hyperparams = Hyperparams.from_config(config).replace(learning_rate=jnp.asarray(learning_rate, jnp.float32))
    return init_train_state({"policy": policy, "value": value}, program.optimizer, hyperparams=hyperparams,
                            frozen={"ref": jax.tree.map(jnp.copy, policy), "reward": None},
                            kl_coef=config.kl_coef)


def grid(learning_rates=LEARNING_RATES, seeds=SEEDS):
    """The grid flattened, learning rate major: (learning_rates f32[N], seeds i32[N])."""
    lrs, sds = np.meshgrid(np.asarray(learning_rates, np.float32), np.asarray(seeds, np.int32), indexing="ij")
    return jnp.asarray(lrs.ravel()), jnp.asarray(sds.ravel())


def iteration_key(seed, iteration):
    return jax.random.fold_in(jax.random.key(seed), iteration)


def sweep_step(program):
    """One PPO iteration of every run: (states stacked on axis 0, prompts i32[B, P] shared, keys[N]) ->
    (states, metrics with a leading [N] axis). Pure: jit it (the states are donated)."""
    return jax.vmap(lambda state, prompts, key: ppo_iteration(program, state, prompts, key), in_axes=(0, None, 0))


def prompt_blocks(iterations=ITERATIONS):
    """Random words, some rows left padded: i32[iterations, BATCH, PROMPT]."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 16, size=(iterations, BATCH, PROMPT)).astype(np.int32)
    prompts[..., :1] = np.where(rng.random((iterations, BATCH, 1)) < 0.5, PAD, prompts[..., :1])
    return jnp.asarray(prompts)


# %% The whole grid
if __name__ == "__main__":
    program = make_program()
    learning_rates, seeds = grid()
    states = jax.jit(jax.vmap(lambda s, lr: init_state(program, s, lr)))(seeds, learning_rates)
    step = jax.jit(sweep_step(program), donate_argnums=(0,))
    prompts = prompt_blocks()
    scores = []
    for i in range(ITERATIONS):
        keys = jax.vmap(lambda s: iteration_key(s, i))(seeds)
        states, metrics = step(states, prompts[i], keys)
        scores.append(np.asarray(metrics["objective/scores"]))
    scores = np.stack(scores, axis=1)  # [runs, iterations]
    for lr in LEARNING_RATES:
        rows = scores[np.isclose(np.asarray(learning_rates), lr)]
        print(f"learning rate {lr:g}: mean score {rows[:, :3].mean():.3f} (first 3 iterations) -> "
              f"{rows[:, -3:].mean():.3f} (last 3), over {len(rows)} seeds")
