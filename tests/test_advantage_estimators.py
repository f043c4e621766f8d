"""Critic-free advantage estimators and the loss options, against independent references.

- grpo / rloo advantages and the GRPO-style loss (clip-higher, dual-clip, KL in the loss, aggregation modes)
  against numbers TRL 1.12's own code produced (``tests/data/make_trl_grpo_rloo_reference.py``, run once);
- reinforce_pp against a plain Python loop;
- every aggregation mode: micro-batch losses with the mini-batch's counts sum to the big batch's gradient.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax import core as ppo
from ppojax.rl.types import UpdateBatch

REFERENCE = json.loads((Path(__file__).parent / "data" / "trl_grpo_rloo_reference.json").read_text())
TOL = dict(rtol=1e-5, atol=1e-5)


def _f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def _inputs_with_returns(returns, completion_mask):
    """AdvantageInputs whose rows' rewards sum to ``returns`` (the score on the slot after the last token, as
    the 'trl' score position puts it, docs/algorithm.md), with TRL's completion mask as the live tokens."""
    live = jnp.asarray(completion_mask, bool)
    padding_mask = ~live
    last = jnp.sum(live, axis=1) - 1
    slot = ppo.score_index(last, live.shape[1])
    rewards = jnp.zeros(live.shape, jnp.float32).at[jnp.arange(live.shape[0]), slot].set(returns)
    padding_mask_p1 = jnp.arange(live.shape[1])[None, :] > (last[:, None] + 1)
    return ppo.AdvantageInputs(rewards, returns, None, padding_mask, padding_mask_p1)


def _settings(**values):
    defaults = dict(num_generations=4, scale_rewards="group", normalize_advantages=False, gamma=1.0, lam=0.95)
    return SimpleNamespace(**{**defaults, **values})


@pytest.mark.parametrize("case", REFERENCE["grpo_advantages"], ids=lambda c: c["name"])
def test_grpo_advantages_equal_trl(case):
    inputs = case["inputs"]
    batch = _inputs_with_returns(_f32(np.asarray(inputs["rewards"]).reshape(-1)), inputs["completion_mask"])
    settings = _settings(num_generations=case["config"]["num_generations"],
                         scale_rewards=case["config"]["scale_rewards"])
    adv = ppo.advantage_estimator("grpo").fn(batch, settings)
    expected = np.asarray(case["outputs"]["advantages"])
    live = np.asarray(inputs["completion_mask"], bool)
    np.testing.assert_allclose(np.asarray(adv.advantages), np.where(live, expected[:, None], 0.0), **TOL)


@pytest.mark.parametrize("case", REFERENCE["rloo_advantages"], ids=lambda c: c["name"])
def test_rloo_advantages_equal_trl(case):
    """TRL's RLOO puts beta * sum(k1) in the reward: here kl_coef = beta with the k1 estimator, through
    ppojax's own shaped rewards."""
    inputs, config = case["inputs"], case["config"]
    live = jnp.asarray(inputs["completion_mask"], bool)
    masks = SimpleNamespace(padding_mask=~live, last_index=jnp.sum(live, axis=1) - 1)
    masks.padding_mask_p1 = jnp.arange(live.shape[1])[None, :] > (masks.last_index[:, None] + 1)
    logprobs = jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, _f32(inputs["old_per_token_logps"]))
    ref_logprobs = jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, _f32(inputs["ref_per_token_logps"]))
    scores = _f32(np.asarray(inputs["rewards"]).reshape(-1))
    kl = ppo.kl_per_token(logprobs, ref_logprobs, "k1")
    shaped = ppo.shaped_rewards(scores, kl, masks.last_index, config["beta"], masks.padding_mask_p1)
    batch = ppo.AdvantageInputs(shaped.rewards, scores, None, masks.padding_mask, masks.padding_mask_p1)
    settings = _settings(num_generations=config["num_generations"],
                         normalize_advantages=config["normalize_advantages"])
    adv = ppo.advantage_estimator("rloo").fn(batch, settings)
    expected = np.asarray(case["outputs"]["advantages"])
    np.testing.assert_allclose(np.asarray(adv.advantages), np.where(live, expected[:, None], 0.0), **TOL)


# TRL's GRPO loss_type -> ppojax's loss_agg_mode.
LOSS_TYPE_TO_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}


def _comparable(case):
    """TRL multiplies the k3 term by the unclipped ratio by default (use_bias_correction_kl); ppojax's KL term
    is the plain estimator, so those cases are compared only when the KL term is off or uncorrected."""
    return case["config"]["beta"] == 0.0 or not case["config"]["use_bias_correction_kl"]


@pytest.mark.parametrize("case", [c for c in REFERENCE["grpo_loss"] if _comparable(c)], ids=lambda c: c["name"])
def test_grpo_loss_equals_trl(case):
    inputs, config = case["inputs"], case["config"]
    live = jnp.asarray(inputs["completion_mask"], bool)
    padding_mask = ~live
    last = jnp.sum(live, axis=1) - 1
    padding_mask_p1 = jnp.arange(live.shape[1])[None, :] > (last[:, None] + 1)
    old = jnp.where(padding_mask, ppo.INVALID_LOGPROB, _f32(inputs["old_per_token_logps"]))
    ref = jnp.where(padding_mask, ppo.INVALID_LOGPROB, _f32(inputs["ref_per_token_logps"]))
    advantages = jnp.where(padding_mask, 0.0, _f32(inputs["advantages"])[:, None])
    zeros = jnp.zeros(live.shape, jnp.float32)
    batch = UpdateBatch(None, old, zeros, advantages, zeros, padding_mask, padding_mask_p1, ref_logprobs=ref)
    loss, stats = ppo.ppo_loss(
        _f32(inputs["per_token_logps"]), zeros, _f32(inputs["entropies"]), batch,
        cliprange=config["epsilon_low_used"], cliprange_high=config["epsilon_high_used"], cliprange_value=0.2,
        vf_coef=0.0, dual_clip_c=config["delta"], loss_agg_mode=LOSS_TYPE_TO_AGG[config["loss_type"]],
        kl_loss_coef=config["beta"], kl_loss_fn=ppo.kl_estimator("k3").fn, with_value=False)
    assert float(loss) == pytest.approx(case["outputs"]["loss"], rel=1e-5, abs=1e-6)
    assert "vf_loss" not in stats and ("kl_loss" in stats) == (config["beta"] > 0)


def test_the_trl_cases_exercise_every_option():
    """The reference has clipping active on both sides, the dual-clip bound active, and KL terms."""
    names = [c["name"] for c in REFERENCE["grpo_loss"] if _comparable(c)]
    diagnostics = REFERENCE["grpo_loss"][0]["diagnostics"]
    assert diagnostics["n_ratio_gt_1.28_and_A_pos"] > 0 and diagnostics["n_ratio_lt_0.8_and_A_neg"] > 0
    assert diagnostics["n_ratio_gt_1.5_and_A_neg"] > 0
    for loss_type in LOSS_TYPE_TO_AGG:
        for option in ("eh0.28", "delta1.5", "beta0.04_nobiascorr"):
            assert any(f"_{loss_type}_" in n and option in n for n in names), (loss_type, option)


def test_dual_clip_and_clip_higher_change_the_loss_where_they_should():
    new = jnp.log(jnp.array([[1.25, 2.0, 0.5]]))
    old = jnp.zeros((1, 3))
    advantages = jnp.array([[1.0, -1.0, -1.0]])
    pad = jnp.zeros((1, 3), bool)

    def per_token(**kw):
        return [float(ppo.policy_loss(new[:, i:i + 1], old[:, i:i + 1], advantages[:, i:i + 1], pad[:, i:i + 1],
                                      0.2, **kw)[0]) for i in range(3)]

    plain = per_token()
    assert plain == pytest.approx([-1.2, 2.0, 0.8])                      # max(-A r, -A clip(r))
    assert per_token(cliprange_high=0.28) == pytest.approx([-1.25, 2.0, 0.8])  # clip-higher lets r = 1.25 through
    assert per_token(dual_clip_c=1.5) == pytest.approx([-1.2, 1.5, 0.8])  # A < 0: loss at most -A c


def reinforce_pp_loop(rewards, padding_mask, gamma):
    """REINFORCE++ in plain Python: reward-to-go per row, then whitening over live tokens (unbiased var)."""
    rewards, live = np.asarray(rewards, np.float64), ~np.asarray(padding_mask)
    to_go = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            running = rewards[b, t] + gamma * running
            to_go[b, t] = running
    values = to_go[live]
    mean, var = values.mean(), values.var(ddof=1)
    whitened = (to_go - mean) / np.sqrt(var + 1e-8)
    return np.where(live, whitened, 0.0), to_go


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_equals_a_plain_loop(gamma):
    rng = np.random.default_rng(0)
    B, R = 6, 7
    last = rng.integers(0, R, B)
    padding_mask = np.arange(R)[None] > last[:, None]
    padding_mask_p1 = np.arange(R)[None] > last[:, None] + 1
    rewards = np.where(padding_mask_p1, 0.0, rng.normal(size=(B, R)) * 0.1)  # -kl_coef * kl and the score
    batch = ppo.AdvantageInputs(_f32(rewards), None, None, jnp.asarray(padding_mask), jnp.asarray(padding_mask_p1))
    adv = ppo.advantage_estimator("reinforce_pp").fn(batch, _settings(gamma=gamma))
    expected, to_go = reinforce_pp_loop(rewards, padding_mask, gamma)
    np.testing.assert_allclose(np.asarray(adv.advantages), expected, **TOL)
    np.testing.assert_allclose(np.asarray(adv.returns), to_go, **TOL)


def test_low_var_kl_is_k3_clamped_and_k2_is_half_the_squared_log_ratio():
    logprobs = jnp.array([[-1.0, -20.0, -0.5]])
    ref = jnp.array([[-1.5, -1.0, -0.5]])
    log_ratio = np.asarray(ref - logprobs)
    k3 = np.exp(log_ratio) - log_ratio - 1
    np.testing.assert_allclose(ppo.kl_estimator("low_var_kl").fn(logprobs, ref), np.clip(k3, -10, 10), rtol=1e-6)
    assert float(ppo.kl_estimator("low_var_kl").fn(logprobs, ref)[0, 1]) == 10.0  # k3 alone is e^19
    np.testing.assert_allclose(ppo.kl_estimator("k2").fn(logprobs, ref), 0.5 * log_ratio ** 2, rtol=1e-6)


@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_each_aggregation_mode_accumulates_to_the_big_batch(mode):
    """Micro-batches normalised by the mini-batch's counts sum to the whole batch's loss and gradient."""
    rng = np.random.default_rng(1)
    B, R = 8, 5
    last = rng.integers(-1, R, B)  # -1: a row with no live token
    padding_mask = jnp.asarray(np.arange(R)[None] > last[:, None])
    old = jnp.asarray(rng.normal(size=(B, R)) * 0.1 - 1.0, jnp.float32)
    advantages = jnp.asarray(rng.normal(size=(B, R)), jnp.float32)
    new = old + jnp.asarray(rng.normal(size=(B, R)) * 0.3, jnp.float32)
    tokens = jnp.sum(~padding_mask)

    def loss(n, part=slice(None), **counts):
        return ppo.policy_loss(n[part], old[part], advantages[part], padding_mask[part], 0.2,
                               cliprange_high=0.28, dual_clip_c=2.0, loss_agg_mode=mode, **counts)[0]

    whole, grad = jax.value_and_grad(loss)(new)
    halves = [jax.value_and_grad(lambda n, s=s: loss(n, s, policy_tokens=tokens, rows=B))(new)
              for s in (slice(0, 4), slice(4, 8))]
    np.testing.assert_allclose(sum(h[0] for h in halves), whole, rtol=1e-6)
    np.testing.assert_allclose(sum(h[1] for h in halves), grad, rtol=1e-6, atol=1e-7)
