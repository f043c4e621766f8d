"""GAE against a plain loop, property tests, controllers, and every public function under jit/vmap/grad."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ppojax import core as ppo
from ppojax.rl.types import UpdateBatch


def gae_loop(rewards, values, gamma, lam):
    """TRL's reference loop, in numpy."""
    batch, length = rewards.shape
    advantages = np.zeros_like(rewards)
    for b in range(batch):
        last = 0.0
        for t in reversed(range(length)):
            next_value = values[b, t + 1] if t < length - 1 else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            advantages[b, t] = last
    return advantages


def random_masks(rng, batch, length):
    last = rng.integers(-1, length, size=batch)
    t = np.arange(length)[None]
    return last, t > last[:, None], t > last[:, None] + 1


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (0.5, 0.0)])
def test_gae_matches_python_loop(gamma, lam):
    rng = np.random.default_rng(0)
    _, _, padding_mask_p1 = random_masks(rng, 6, 11)
    rewards = rng.normal(size=(6, 11)).astype(np.float32)
    values = np.where(padding_mask_p1, 0.0, rng.normal(size=(6, 11))).astype(np.float32)
    np.testing.assert_allclose(ppo.gae(jnp.asarray(rewards), jnp.asarray(values), gamma, lam),
                               gae_loop(rewards, values, gamma, lam), atol=1e-5)


def multi_turn_gae_loop(rewards, values, policy_mask, gamma, lam):
    """verl's multi-turn GAE (``compute_gae_advantage_return`` with a response mask that is 0 on observation tokens),
    transcribed: the next value and the running advantage pass unchanged through masked tokens."""
    next_value, last = np.zeros(rewards.shape[0]), np.zeros(rewards.shape[0])
    advantages = np.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last
        next_value = values[:, t] * policy_mask[:, t] + (1 - policy_mask[:, t]) * next_value
        last = candidate * policy_mask[:, t] + (1 - policy_mask[:, t]) * last
        advantages[:, t] = last
    return advantages


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_passes_through_environment_tokens(gamma, lam):
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(5, 12)).astype(np.float32)
    values = rng.normal(size=(5, 12)).astype(np.float32)
    environment = rng.random((5, 12)) < 0.4
    environment[:, 0] = False  # an episode starts with the policy's turn
    got = ppo.gae(jnp.asarray(rewards), jnp.asarray(values), gamma, lam, jnp.asarray(environment))
    np.testing.assert_allclose(got, multi_turn_gae_loop(rewards, values, (~environment).astype(np.float32), gamma,
                                                        lam), atol=1e-5)
    # the policy's tokens get the advantages of the same episode with the environment's tokens cut out
    for b in range(5):
        keep = ~environment[b]
        np.testing.assert_allclose(np.asarray(got)[b, keep], gae_loop(rewards[b:b + 1, keep], values[b:b + 1, keep],
                                                                      gamma, lam)[0], atol=1e-5)
    # no environment token: the plain scan
    np.testing.assert_allclose(ppo.gae(jnp.asarray(rewards), jnp.asarray(values), gamma, lam,
                                       jnp.zeros((5, 12), bool)), gae_loop(rewards, values, gamma, lam), atol=1e-5)


finite = st.floats(-5, 5, allow_nan=False, width=32)


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6), st.integers(2, 9), st.integers(0, 10_000))
def test_whitened_advantages_have_zero_mean_unit_variance(batch, length, seed):
    rng = np.random.default_rng(seed)
    last = rng.integers(0, length, size=batch)
    last[0] = length - 1  # at least two live tokens
    padding_mask = np.arange(length)[None] > last[:, None]
    rewards = rng.normal(size=(batch, length)).astype(np.float32)
    values = rng.normal(size=(batch, length)).astype(np.float32)
    advantages = np.asarray(_whitened_advantages(rewards, values, padding_mask))
    live = ~padding_mask
    np.testing.assert_allclose(advantages[live].mean(), 0.0, atol=1e-4)
    np.testing.assert_allclose(advantages[live].var(ddof=1), 1.0, atol=1e-3)
    assert np.abs(advantages[padding_mask]).sum() == 0.0


@jax.jit
def _whitened_advantages(rewards, values, padding_mask):
    """One program per shape (the eager form compiles each operation on its own, for every shape drawn)."""
    return ppo.advantages_and_returns(rewards, values, padding_mask, 0.99, 0.95).advantages


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(finite, min_size=6, max_size=6), min_size=1, max_size=4))
def test_gae_with_gamma_lam_one_and_zero_values_is_reward_to_go(rows):
    rewards = np.asarray(rows, np.float32)
    advantages = _undiscounted_gae(rewards)
    reward_to_go = np.flip(np.cumsum(np.flip(rewards, 1), 1), 1)
    np.testing.assert_allclose(advantages, reward_to_go, atol=1e-4)


@jax.jit
def _undiscounted_gae(rewards):
    return ppo.gae(rewards, jnp.zeros_like(rewards), 1.0, 1.0)


@settings(max_examples=30, deadline=None)
@given(st.lists(finite, min_size=5, max_size=5), st.lists(finite, min_size=5, max_size=5),
       st.integers(-1, 4))
def test_every_kl_estimator_is_zero_on_equal_logprobs_and_on_padding(a, b, last):
    logprobs = -jnp.abs(jnp.asarray([a], jnp.float32))
    ref = -jnp.abs(jnp.asarray([b], jnp.float32))
    padding = jnp.arange(5)[None] > last
    logprobs = jnp.where(padding, ppo.INVALID_LOGPROB, logprobs)
    ref = jnp.where(padding, ppo.INVALID_LOGPROB, ref)
    for estimator in ("k1", "k3", "abs", "mse"):
        assert float(jnp.abs(ppo.kl_per_token(logprobs, logprobs, estimator)).max()) == 0.0
        on_padding = jnp.where(padding, ppo.kl_per_token(logprobs, ref, estimator), 0.0)
        assert float(jnp.abs(on_padding).max()) == 0.0
    dist = jax.nn.log_softmax(jnp.asarray([a], jnp.float32)[..., None] * jnp.arange(3.0))
    assert float(jnp.abs(ppo.kl_full(dist, dist, padding)).max()) < 1e-6


def test_kl_estimators_match_formulas_and_full_kl_matches_definition():
    rng = np.random.default_rng(1)
    lp, rp = -rng.random((3, 4)).astype(np.float32), -rng.random((3, 4)).astype(np.float32)
    np.testing.assert_allclose(ppo.kl_k1(lp, rp), lp - rp, atol=1e-6)
    np.testing.assert_allclose(ppo.kl_k3(lp, rp), np.exp(rp - lp) - 1 - (rp - lp), atol=1e-6)
    np.testing.assert_allclose(ppo.kl_abs(lp, rp), np.abs(lp - rp), atol=1e-6)
    np.testing.assert_allclose(ppo.kl_mse(lp, rp), 0.5 * (lp - rp) ** 2, atol=1e-6)
    p = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 4, 7)), jnp.float32))
    q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(3, 4, 7)), jnp.float32))
    expected = np.sum(np.exp(p) * (p - q), -1)
    np.testing.assert_allclose(ppo.kl_full(p, q, jnp.zeros((3, 4), bool)), expected, atol=1e-6)
    assert (np.asarray(ppo.kl_full(p, q, jnp.zeros((3, 4), bool))) >= -1e-6).all()
    with pytest.raises(ValueError, match="kl_full"):
        ppo.kl_per_token(lp, rp, "full")


def test_clipped_losses_have_zero_gradient_where_clip_is_active():
    old = jnp.zeros((1, 4))
    advantages = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    new = jnp.array([[0.5, 0.0, -0.5, 0.0]])  # ratio 1.65 (clipped, A>0), 1, 0.61 (clipped, A<0), 1
    no_padding = jnp.zeros((1, 4), bool)
    grad = jax.grad(lambda n: ppo.policy_loss(n, old, advantages, no_padding, 0.2)[0])(new)
    assert grad[0, 0] == 0.0 and grad[0, 2] == 0.0
    assert grad[0, 1] != 0.0 and grad[0, 3] != 0.0
    _, _, clipped = ppo.policy_loss(new, old, advantages, no_padding, 0.2)
    np.testing.assert_array_equal(clipped, [[True, False, True, False]])

    values, returns = jnp.zeros((1, 3)), jnp.array([[1.0, 1.0, 1.0]])
    vpred = jnp.array([[0.5, 0.1, -0.5]])  # old values 0, clip range +-0.2
    grad_v = jax.grad(lambda v: ppo.value_loss(v, values, returns, no_padding[:, :3], 0.2)[0])(vpred)
    # vpred=0.5: clipped 0.2 -> (0.8)^2 > (0.5)^2, the clipped term wins: zero gradient.
    # vpred=0.1: inside the clip range: gradient flows. vpred=-0.5: unclipped (1.5)^2 wins: gradient flows.
    assert grad_v[0, 0] == 0.0 and grad_v[0, 1] != 0.0 and grad_v[0, 2] != 0.0


def test_ppo_loss_token_weighting_adds_up_to_big_batch():
    rng = np.random.default_rng(2)
    shape = (4, 6)
    args = [jnp.asarray(rng.normal(size=shape) * 0.1, jnp.float32) for _ in range(7)]
    last = jnp.array([5, 2, 0, 3])
    padding_mask = jnp.arange(6)[None] > last[:, None]
    padding_mask_p1 = jnp.arange(6)[None] > last[:, None] + 1
    kw = dict(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.01)

    def loss(rows, **extra):
        new_logprobs, vpred, entropy, old_logprobs, old_values, advantages, returns = [a[rows] for a in args]
        batch = UpdateBatch(None, old_logprobs, old_values, advantages, returns, padding_mask[rows],
                            padding_mask_p1[rows])
        return ppo.ppo_loss(new_logprobs, vpred, entropy, batch, **kw, **extra)[0]

    big = loss(slice(None))
    counts = dict(policy_tokens=jnp.sum(~padding_mask), value_tokens=jnp.sum(~padding_mask_p1))
    halves = loss(slice(0, 2), **counts) + loss(slice(2, 4), **counts)
    np.testing.assert_allclose(halves, big, rtol=1e-6)


def test_entropy_is_a_statistic_without_an_entropy_bonus():
    """entropy_coef=0: the entropy reaches the stats but not the gradient (TRL computes it under no_grad), so
    a non-finite entropy gradient (here d sqrt(x)/dx at 0) cannot turn the loss gradient into 0 * inf = nan.
    entropy_coef>0: its gradient flows, -coef * d mean(entropy)."""
    rng = np.random.default_rng(3)
    shape = (2, 3)
    new_logprobs, old_logprobs, advantages = (jnp.asarray(rng.normal(size=shape) * 0.1, jnp.float32)
                                              for _ in range(3))
    no_padding = jnp.zeros(shape, bool)
    batch = UpdateBatch(None, old_logprobs, jnp.zeros(shape), advantages, jnp.zeros(shape), no_padding, no_padding)
    x = jnp.zeros(shape).at[0, 0].set(0.0).at[1, 2].set(4.0)

    def loss(x, coef):
        entropy = jnp.sqrt(x)  # gradient inf at x = 0
        loss, stats = ppo.ppo_loss(new_logprobs, jnp.zeros(shape), entropy, batch, cliprange=0.2,
                                   cliprange_value=0.2, vf_coef=0.1, entropy_coef=coef, with_value=False)
        return loss, stats["entropy"]

    grad, entropy_stat = jax.grad(loss, has_aux=True)(x, 0.0)
    np.testing.assert_array_equal(grad, np.zeros(shape))
    np.testing.assert_allclose(entropy_stat, 2.0 / 6, rtol=1e-6)  # the statistic is still the mean entropy
    x_positive = x + 1.0
    grad_bonus, _ = jax.grad(loss, has_aux=True)(x_positive, 0.5)
    np.testing.assert_allclose(grad_bonus, -0.5 * 0.5 / jnp.sqrt(x_positive) / 6, rtol=1e-6)


def test_adaptive_kl_controller_formula():
    coef = ppo.adaptive_kl_update(0.2, 9.0, 256, 6.0, 10000)  # error clipped to +0.2
    np.testing.assert_allclose(coef, 0.2 * (1 + 0.2 * 256 / 10000), rtol=1e-6)
    coef = ppo.adaptive_kl_update(0.2, 5.4, 100, 6.0, 10000)  # error -0.1
    np.testing.assert_allclose(coef, 0.2 * (1 - 0.1 * 100 / 10000), rtol=1e-6)
    assert ppo.fixed_kl_update(0.05, 100.0, 64) == 0.05


def test_running_moments_match_numpy_over_all_scores():
    rng = np.random.default_rng(3)
    batches = [rng.normal(2.0, 3.0, size=n).astype(np.float32) for n in (8, 5, 13)]
    moments = ppo.RunningMoments.create()
    for batch in batches:
        moments, batch_mean, batch_std = ppo.update_running_moments(moments, jnp.asarray(batch))
        np.testing.assert_allclose(batch_mean, batch.mean(), rtol=1e-5)
        np.testing.assert_allclose(batch_std, batch.std(ddof=1), rtol=1e-5)
    everything = np.concatenate(batches)
    np.testing.assert_allclose(moments.mean, everything.mean(), rtol=1e-5)
    np.testing.assert_allclose(moments.std, everything.std(ddof=1), rtol=1e-4)


def test_process_scores_scaling_norm_and_clip():
    scores = jnp.array([1.0, 3.0, 5.0, 7.0])
    out, moments = ppo.process_scores(scores, ppo.RunningMoments.create(), use_score_scaling=True,
                                      use_score_norm=True)
    np.testing.assert_allclose(out, (scores - 4.0) / np.std([1, 3, 5, 7], ddof=1), rtol=1e-4)
    out, _ = ppo.process_scores(scores, ppo.RunningMoments.create(), use_score_scaling=True)
    np.testing.assert_allclose(out, scores / np.std([1, 3, 5, 7], ddof=1), rtol=1e-4)
    out, same = ppo.process_scores(scores, moments, score_clip=2.0)
    np.testing.assert_allclose(out, [1.0, 2.0, 2.0, 2.0])
    assert same is moments


def test_entropy_from_logits():
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(2, 3, 9)), jnp.float32)
    p = jax.nn.softmax(logits)
    np.testing.assert_allclose(ppo.entropy_from_logits(logits), -np.sum(p * np.log(p), -1), atol=1e-5)


# ---- every public function under jit and vmap ----

def _batch():
    rng = np.random.default_rng(5)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    responses = jnp.asarray(rng.integers(0, 6, size=(3, 2, 7)), jnp.int32)
    return dict(responses=responses, lp=-jnp.abs(f(3, 2, 7)), rp=-jnp.abs(f(3, 2, 7)), values=f(3, 2, 7),
                scores=f(3, 2), dist=jax.nn.log_softmax(f(3, 2, 7, 5)), logits=f(3, 2, 7, 5))


def _per_example_functions():
    """name -> function of one example batch (leading axis [2] rows), all public math in one pipeline."""
    def pipeline(b):
        truncated = ppo.truncate_response(b["responses"], 0, 5)
        masks = ppo.response_masks(truncated, 5)
        scores = ppo.apply_missing_eos_penalty(b["scores"], truncated, 0, 1.0)
        kl = ppo.kl_per_token(b["lp"], b["rp"], "k3")
        shaped = ppo.shaped_rewards(scores, kl, masks.last_index, 0.05, masks.padding_mask_p1, whiten_rewards=True)
        adv = ppo.advantages_and_returns(shaped.rewards, b["values"], masks.padding_mask, 0.99, 0.95)
        ent = ppo.entropy_from_logits(b["logits"])
        batch = UpdateBatch(None, b["lp"], b["values"], adv.advantages, adv.returns, masks.padding_mask,
                            masks.padding_mask_p1)
        loss, stats = ppo.ppo_loss(b["lp"] + 0.01, b["values"], ent, batch, cliprange=0.2, cliprange_value=0.2,
                                   vf_coef=0.1)
        metrics = ppo.rollout_metrics(scores, kl, shaped.non_score_reward, b["lp"], masks.padding_mask,
                                      jnp.sum(ppo.contains_stop_token(truncated, 0)))
        full = ppo.kl_full(b["dist"], b["dist"][::-1], masks.padding_mask)
        moments, _ = ppo.process_scores(scores, ppo.RunningMoments.create(), use_score_scaling=True,
                                        use_score_norm=True, score_clip=3.0)
        coef = ppo.adaptive_kl_update(jnp.float32(0.2), metrics["objective/kl"], 2, 6.0, 10000)
        first = ppo.first_true_indices(b["responses"] == 3)
        extra = [ppo.kl_per_token(b["lp"], b["rp"], e) for e in ("k1", "abs", "mse")]
        whitened = ppo.masked_whiten(b["values"], ~masks.padding_mask, shift_mean=False)
        return dict(loss=loss, adv=adv.advantages, full=full, moments=moments, coef=coef, first=first,
                    extra=jnp.stack(extra), whitened=whitened, metrics=metrics, stats=stats,
                    gae=ppo.gae(shaped.rewards, b["values"], 1.0, 1.0), fixed=ppo.fixed_kl_update(coef, 0.0, 1))
    return pipeline


def test_public_functions_under_jit_and_vmap_agree_with_eager():
    pipeline = _per_example_functions()
    batch = _batch()
    eager = [pipeline({k: v[i] for k, v in batch.items()}) for i in range(3)]
    vmapped = jax.jit(jax.vmap(pipeline))(batch)
    for i in range(3):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b[i], rtol=1e-4, atol=1e-5), eager[i], vmapped)


def test_loss_is_differentiable_under_jit():
    batch = {k: v[0] for k, v in _batch().items()}
    pipeline = _per_example_functions()

    def loss_of(lp):
        return pipeline(dict(batch, lp=lp))["loss"]

    grad = jax.jit(jax.grad(loss_of))(batch["lp"])
    assert grad.shape == batch["lp"].shape and bool(jnp.all(jnp.isfinite(grad)))
