"""The golden vector (docs/algorithm.md, "Golden vector"), end to end through the pure functions."""
import jax.numpy as jnp
import numpy as np

from ppojax import core as ppo

PAD, STOP, R = 9, 0, 5
RESPONSES = jnp.array([[3, 4, 0, 7, 7], [3, 4, 5, 6, 2]])
LOGPROBS = jnp.array([[-1.0, -2.0, -0.5, -3.0, -3.0], [-1.0, -1.5, -2.0, -0.7, -0.9]])
REF_LOGPROBS = jnp.array([[-1.2, -1.8, -0.9, -2.0, -2.5], [-1.1, -1.5, -2.5, -0.6, -1.0]])
VALUES = jnp.array([[0.1, 0.2, 0.3, 0.4, 0.5], [0.0, -0.1, -0.2, -0.3, -0.4]])
SCORES = jnp.array([1.0, 0.5])


def run_golden():
    truncated = ppo.truncate_response(RESPONSES, STOP, PAD)
    masks = ppo.response_masks(truncated, PAD)
    logprobs = jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, LOGPROBS)
    ref_logprobs = jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, REF_LOGPROBS)
    values = jnp.where(masks.padding_mask_p1, 0.0, VALUES)
    scores = ppo.apply_missing_eos_penalty(SCORES, truncated, STOP, 1.0)
    kl = ppo.kl_per_token(logprobs, ref_logprobs, "k1")
    shaped = ppo.shaped_rewards(scores, kl, masks.last_index, 0.05, masks.padding_mask_p1)
    raw_advantages = ppo.gae(shaped.rewards, values, 1.0, 0.95)
    adv = ppo.advantages_and_returns(shaped.rewards, values, masks.padding_mask, 1.0, 0.95)
    metrics = ppo.rollout_metrics(scores, kl, shaped.non_score_reward, logprobs, masks.padding_mask,
                                  jnp.sum(truncated == STOP))
    return dict(truncated=truncated, masks=masks, scores=scores, shaped=shaped, raw=raw_advantages,
                adv=adv, metrics=metrics)


def test_golden_vector():
    out = run_golden()
    np.testing.assert_array_equal(out["truncated"], [[3, 4, 0, 9, 9], [3, 4, 5, 6, 2]])
    np.testing.assert_array_equal(out["masks"].last_index, [2, 4])
    np.testing.assert_allclose(out["scores"], [1.0, -0.5], atol=1e-6)
    np.testing.assert_array_equal(ppo.score_index(out["masks"].last_index, R), [3, 4])
    np.testing.assert_allclose(out["shaped"].rewards,
                               [[-0.01, 0.01, -0.02, 1.0, 0.0], [-0.005, 0.0, -0.025, 0.005, -0.505]],
                               atol=1e-4)
    np.testing.assert_allclose(out["raw"], [[0.7811, 0.7275, 0.65, 0.6, 0.0],
                                            [-0.4798, -0.3945, -0.31, -0.1948, -0.105]], atol=1e-4)
    np.testing.assert_allclose(out["adv"].returns, [[0.8811, 0.9275, 0.95, 1.0, 0.0],
                                                    [-0.4798, -0.4945, -0.51, -0.4948, -0.505]], atol=1e-4)
    np.testing.assert_allclose(out["adv"].advantages, [[1.292, 1.1926, 1.0489, 0, 0],
                                                       [-1.046, -0.8879, -0.7312, -0.5175, -0.351]], atol=1e-4)
    m = out["metrics"]
    np.testing.assert_allclose(m["objective/kl"], 0.5, atol=1e-4)
    np.testing.assert_allclose(m["objective/non_score_reward"], -0.025, atol=1e-4)
    np.testing.assert_allclose(m["objective/rlhf_reward"], 0.225, atol=1e-4)
    np.testing.assert_allclose(m["objective/entropy"], 4.8, atol=1e-4)
    assert int(m["val/num_eos_tokens"]) == 1


def test_legacy_score_position_puts_score_on_last_token():
    out = run_golden()
    kl = out["shaped"].kl
    legacy = ppo.shaped_rewards(out["scores"], kl, out["masks"].last_index, 0.05,
                                out["masks"].padding_mask_p1, score_position="legacy")
    np.testing.assert_allclose(legacy.rewards[0], [-0.01, 0.01, -0.02 + 1.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(legacy.rewards[1], [-0.005, 0.0, -0.025, 0.005, -0.005 - 0.5], atol=1e-6)


def test_whiten_rewards_keeps_mean_and_zeroes_padding():
    out = run_golden()
    masks = out["masks"]
    w = ppo.shaped_rewards(out["scores"], out["shaped"].kl, masks.last_index, 0.05, masks.padding_mask_p1,
                           whiten_rewards=True)
    live = ~masks.padding_mask_p1
    assert float(jnp.abs(jnp.where(masks.padding_mask_p1, w.rewards, 0.0)).sum()) == 0.0
    np.testing.assert_allclose(ppo.masked_mean(w.rewards, live), ppo.masked_mean(out["shaped"].rewards, live),
                               atol=1e-5)
    np.testing.assert_allclose(ppo.masked_var(w.rewards, live), 1.0, atol=1e-4)
