"""``shared_prompt_forward``: each group's prompt through the model once, its samples' responses after it
(``ppojax.rl.forward.SharedPromptLayout``). The reference is the padded forward, every row its own prompt (itself
checked against transformers in tests/test_forward.py): hidden states, log-probs, gradients, the rollout's
forwards, an update and the whole experience must equal it to float rounding; the update's mini-batches must hold
whole groups; a config the shared forward cannot serve is refused."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppojax.errors import ConfigError
from ppojax.models import CausalLM, ModelConfig, ScoreModel
from ppojax.rl import rollout, update
from ppojax.rl.forward import SharedPromptLayout, logprobs_from_hidden, row_layout
from ppojax.rl.rewards import ModelScores
from ppojax.trainer.config import PPOConfig
from tests.test_packing import (PAD, B, P, R, actor_critic_for, experience_for, lengths_case, params_for,
                                program_for, state_for, synthetic_rows)
from tests.tiny_setup import tiny_config

G = 4


def grouped_rows(case, seed, group=G):
    """``tests.test_packing``'s synthetic rows i32[B, P+R] with each group of ``group`` rows holding its first
    row's prompt (left padding included): GRPO's samples of one prompt. -> (rows, live response lengths)."""
    rng = np.random.default_rng(seed)
    pads, live = lengths_case(case, rng)
    qr = np.array(synthetic_rows(pads, live, rng))
    qr[:, :P] = np.repeat(qr[::group, :P], group, axis=0)
    return jnp.asarray(qr), live, rng


def gpt2_like():
    """Learned position embeddings (positions read from the given ids) and a LayerNorm MLP model."""
    return ModelConfig.from_hf(dict(model_type="gpt2", vocab_size=tiny_config().vocab_size, n_embd=32, n_layer=2,
                                     n_head=4, n_positions=64, bos_token_id=1, eos_token_id=1))


@pytest.mark.parametrize("cfg", [tiny_config(), gpt2_like()], ids=["llama", "gpt2"])
def test_shared_prompt_hidden_logprobs_and_gradients_equal_the_padded_forward(cfg):
    qr, _, rng = grouped_rows("uniform", 0)
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(3)))
    weights = jnp.asarray(rng.normal(size=(B, R)), jnp.float32)

    def outputs(params, group):
        lm, layout = nnx.merge(graphdef, params), row_layout(qr, P, PAD, group)
        assert isinstance(layout, SharedPromptLayout) == (group > 1)
        hidden = layout.hidden(lm)
        logprobs, _ = logprobs_from_hidden(lm, hidden, layout.tokens, 0.7)
        return hidden, logprobs

    def objective(params, group):
        return jnp.sum(outputs(params, group)[1] * weights)

    hidden = assert_forwards_agree(outputs, objective, params, 1, G)
    assert hidden.shape == (B, R, cfg.hidden_size)


def assert_forwards_agree(outputs, objective, params, plain, shared):
    """``outputs(params, variant)`` -> (hidden, log-probs) and the gradient of ``objective(params, variant)`` equal
    for the ``plain`` and the ``shared`` variant (static), the gradient not zero -> the plain hidden states."""
    (hidden_a, logprobs_a), (hidden_b, logprobs_b) = (jax.jit(outputs, static_argnums=1)(params, variant)
                                                      for variant in (plain, shared))
    assert hidden_b.shape == hidden_a.shape
    np.testing.assert_allclose(hidden_b, hidden_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logprobs_b, logprobs_a, rtol=1e-5, atol=1e-5)
    grads_a, grads_b = (jax.jit(jax.grad(objective), static_argnums=1)(params, variant) for variant in (plain, shared))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5), grads_a, grads_b)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads_a)) > 1e-3
    return hidden_a


def test_the_prompt_runs_once_per_group():
    """The model sees B/G prompt rows of P slots and B response rows of R slots: no row's prompt a second time."""
    qr, _, _ = grouped_rows("uniform", 1)
    graphdef, params = nnx.split(CausalLM(tiny_config(), rngs=nnx.Rngs(0)))
    calls = []

    class Recording:
        def __init__(self, lm):
            self.lm = lm

        def __call__(self, ids, *args, **kwargs):
            calls.append((ids.shape, "prefix" in kwargs))
            return self.lm(ids, *args, **kwargs)

    jax.eval_shape(lambda p: row_layout(qr, P, PAD, G).hidden(Recording(nnx.merge(graphdef, p))), params)
    assert calls == [((B // G, P), False), ((B, R), True)]


@pytest.mark.parametrize("kind,with_full_kl", [("grpo", False), ("value_head", True), ("value_model", False)])
def test_rollout_forwards_with_a_shared_prompt_equal_the_padded_ones(kind, with_full_kl):
    """Behaviour and reference log-probs, values (a value head reads the shared forward's hidden states; a value
    model keeps its padded forward) and the full KL, two rows-per-forward chunks of two groups each."""
    qr, _, rng = grouped_rows("long_tail", 2)
    ac, params = actor_critic_for(kind), params_for(kind)
    frozen = {"ref": params_for(kind, seed=5)["policy"]}

    def forwards(params, frozen, group):
        return ac.rollout_forwards(params, frozen, qr, P, with_full_kl=with_full_kl, forward_batch_size=2 * G,
                                   prompt_group=group)

    padded, shared = (jax.jit(forwards, static_argnums=2)(params, frozen, group) for group in (1, G))
    for name, a, b in zip(("logprobs", "ref_logprobs", "values", "full_kl"), padded, shared):
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_allclose(b, a, err_msg=name, rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(padded[1] - padded[0]))) > 1e-2  # the reference is not the policy


def test_epoch_order_keeps_each_group_whole():
    key = jax.random.key(0)
    np.testing.assert_array_equal(update.epoch_order(key, 16, 2), jax.random.permutation(key, 16).reshape(2, 8))
    order = np.asarray(update.epoch_order(key, 16, 2, group=4))
    assert order.shape == (2, 8) and sorted(order.ravel().tolist()) == list(range(16))
    groups = order.reshape(-1, 4)
    assert (groups % 4 == np.arange(4)).all() and (groups // 4 == groups[:, :1] // 4).all()  # whole, in order
    assert not np.array_equal(groups[:, 0], np.arange(0, 16, 4))  # the groups are shuffled


def run_learn(shared, accumulation, monkeypatch):
    """``learn`` (two epochs x two mini-batches, SGD) on grouped rows with the shared forward or without it. Without
    it the epochs still draw whole groups, so both runs step on the same rows."""
    qr, live, rng = grouped_rows("long_tail", 7)
    experience = experience_for(qr, live, rng, "grpo")
    program, config = program_for("grpo", accumulation, False, optax.sgd(1.0), shared_prompt_forward=shared)
    assert program.settings.batch.prompt_group == (G if shared else 1)
    if not shared:
        grouped = update.epoch_order
        monkeypatch.setattr(update, "epoch_order", lambda key, b, n, group=1: grouped(key, b, n, G))
    state = state_for(program, config, "grpo")
    return jax.jit(lambda s, e, k: update.learn(program, s, e, k))(state, experience, jax.random.key(3))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_update_with_a_shared_prompt_equals_the_padded_update(accumulation, monkeypatch):
    (state_a, metrics_a), (state_b, metrics_b) = (run_learn(shared, accumulation, monkeypatch)
                                                  for shared in (False, True))
    assert set(metrics_a) == set(metrics_b)
    for name, value in metrics_a.items():
        np.testing.assert_allclose(metrics_b[name], value, err_msg=name, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5), state_a.params,
                 state_b.params)


def test_experience_with_a_shared_prompt_equals_the_padded_one():
    """``rollout.experience`` (reference forward shared, a reward model's padded) equals the padded one, every field."""
    qr, _, _ = grouped_rows("uniform", 4)
    score_def, weights = nnx.split(ScoreModel(tiny_config(), rngs=nnx.Rngs(6)))
    results = []
    for shared in (False, True):
        program, config = program_for("grpo", 1, False, optax.sgd(1.0), shared_prompt_forward=shared,
                                      local_rollout_forward_batch_size=2 * G, behaviour_logprobs="forward")
        program = dataclasses.replace(program, reward=ModelScores(score_def, PAD, 2))
        state = state_for(program, config, "grpo")
        state = state.replace(frozen={**state.frozen, "reward": weights})
        results.append(jax.jit(lambda s: rollout.experience(program, s, qr, P)[0])(state))
    flat_a, flat_b = (jax.tree_util.tree_flatten_with_path(r)[0] for r in results)
    assert [path for path, _ in flat_a] == [path for path, _ in flat_b]
    for (path, a), (_, b) in zip(flat_a, flat_b):
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), err_msg=str(path),
                                   rtol=1e-5, atol=1e-5)


GRPO = dict(advantage_estimator="grpo", num_generations=4)


@pytest.mark.parametrize("options,message", [
    (dict(num_generations=1), r"num_generations=1 samples each prompt once; set num_generations >= 2"),
    (dict(GRPO, padding_free=True), r"shared_prompt_forward=True and padding_free=True"),
    (dict(GRPO, batch_size=16, num_mini_batches=2, gradient_accumulation_steps=4),
     r"micro_batch_size=2 is not a multiple of num_generations=4; make it one \(e\.g\. 4\)"),
    (dict(GRPO, batch_size=24, local_rollout_forward_batch_size=6),
     r"local_rollout_forward_batch_size=6 is not a multiple of num_generations=4"),
])
def test_config_refuses_what_the_shared_forward_cannot_serve(options, message):
    with pytest.raises(ConfigError, match=message):
        PPOConfig(shared_prompt_forward=True, **options)
    PPOConfig(**options)  # valid without it
