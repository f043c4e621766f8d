"""The jitted PPO update (``ppojax.rl.update.learn``) against a plain Python loop of jax.grad + optax steps."""
import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppojax.backends.cpu.kernels import CpuKernels
from ppojax.models.kernels import XLA
from ppojax import core as ppo
from ppojax.rl.actor_critic import ActorCritic
from ppojax.trainer.config import PPOConfig
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.program import PPOProgram
from ppojax.rl.types import init_train_state
from ppojax.rl.optimizer import make_optimizer
from ppojax.rl.update import learn, loss_of_outputs, shaped_rewards_and_advantages
from tests.toy_models import ToyLM, ToyLMWithValueHead, ToyScore
from tests.xla_test_flags import cheap_compiles

PAD, STOP, V, P, R, B = 0, 1, 16, 4, 6, 8


class Exp(NamedTuple):
    query_responses: jnp.ndarray
    logprobs: jnp.ndarray
    ref_logprobs: jnp.ndarray
    values: jnp.ndarray
    scores: jnp.ndarray
    last_index: jnp.ndarray
    padding_mask: jnp.ndarray
    padding_mask_p1: jnp.ndarray
    num_eos_tokens: jnp.ndarray = None
    full_kl: jnp.ndarray = None
    trained: jnp.ndarray = None  # every row trains (no dynamic sampling)
    proximal_logprobs: jnp.ndarray = None  # logprobs are the ratio's denominator (no off-policy weights)
    policy_versions: jnp.ndarray = None
    environment_mask: jnp.ndarray = None  # single-turn

    def replace(self, **fields):  # as the Experience dataclass's
        return self._replace(**fields)


def settings_for(num_updates=1, **config):
    """(StepSettings, Hyperparams) of a PPOConfig with the toy shapes (logits in chunks of 4, as before)."""
    config = PPOConfig(batch_size=B, response_length=R, logits_chunk_size=4, **config)
    return (StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=STOP, num_updates=num_updates),
            Hyperparams.from_config(config))


def make_update(ac, settings, optimizer):
    """The jitted update ``(state, experience, key, kl_coef) -> (state, metrics)``, state donated."""
    program = PPOProgram(ac, None, settings, optimizer)
    return jax.jit(lambda state, exp, key, kl_coef: learn(program, state.replace(kl_coef=kl_coef), exp, key),
                   donate_argnums=(0,))


def build(value_head=False, seed=0):
    policy = (ToyLMWithValueHead if value_head else ToyLM)(V, 8, rngs=nnx.Rngs(seed))
    policy_def, policy_params = nnx.split(policy)
    if value_head:
        params = {"policy": policy_params}
        ac = ActorCritic(policy_def, None, PAD, temperature=0.7)
    else:
        value_def, value_params = nnx.split(ToyScore(V, 8, rngs=nnx.Rngs(seed + 1)))
        params = {"policy": policy_params, "value": value_params}
        ac = ActorCritic(policy_def, value_def, PAD, temperature=0.7)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(2, V, size=(B, P))
    prompts[:, :2] = np.where(rng.random((B, 2)) < 0.5, PAD, prompts[:, :2])  # some left padding
    responses = rng.integers(1, V, size=(B, R))
    query_responses = jnp.asarray(np.concatenate([prompts, responses], 1), jnp.int32)
    truncated = ppo.truncate_response(query_responses[:, P:], STOP, PAD)
    masks = ppo.response_masks(truncated, PAD)
    logprobs, _, values = ac.evaluate(params, query_responses, P, logits_chunk_size=4)  # as the update's
    ref_params = jax.tree.map(lambda x: x + 0.05, params)
    ref_logprobs, _, _ = ac.evaluate(ref_params, query_responses, P, logits_chunk_size=4)
    exp = Exp(query_responses,
              jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, logprobs),
              jnp.where(masks.padding_mask, ppo.INVALID_LOGPROB, ref_logprobs),
              jnp.where(masks.padding_mask_p1, 0.0, values),
              jnp.asarray(rng.normal(size=B), jnp.float32), masks.last_index, masks.padding_mask,
              masks.padding_mask_p1)
    return ac, params, exp


def reference_update(ac, settings, hyperparams, params, exp, key, kl_coef, update_index):
    """Plain loops: epochs x mini-batches, one jax.grad per mini-batch (big batch), optax.adamw."""
    batch, _, _ = shaped_rewards_and_advantages(settings.algorithm, exp, exp.scores, kl_coef)
    optim = settings.optim
    lr = float(hyperparams.learning_rate) * (1 - update_index / optim.num_updates)
    opt = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    opt_state = opt.init(params)
    mini = B // optim.num_mini_batches

    def loss_fn(p, mb):
        logprobs, entropy, vpred = ac.evaluate(p, mb.query_responses, P)
        return ppo.ppo_loss(logprobs, vpred, entropy, mb, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)

    @jax.jit  # one optimizer step, compiled once (not operation by operation); the loop around it stays plain
    def step(params, opt_state, mb):
        (_, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    all_stats, steps = [], 0
    for epoch_key in jax.random.split(key, optim.num_ppo_epochs):
        order = np.asarray(jax.random.permutation(epoch_key, B))
        for m in range(optim.num_mini_batches):
            rows = order[m * mini:(m + 1) * mini]
            params, opt_state, stats = step(params, opt_state, jax.tree.map(lambda x: x[rows], batch))
            all_stats.append(stats)
            steps += 1
    return params, steps, all_stats


@pytest.mark.parametrize("num_mini_batches,grad_accum,value_head", [
    (1, 1, False), pytest.param(2, 2, False, marks=pytest.mark.slow), pytest.param(4, 2, True, marks=pytest.mark.slow)])
def test_update_matches_python_loop(num_mini_batches, grad_accum, value_head):
    ac, params, exp = build(value_head=value_head)
    settings, hp = settings_for(num_ppo_epochs=2, num_mini_batches=num_mini_batches,
                                gradient_accumulation_steps=grad_accum, learning_rate=1e-2, num_updates=4)
    key, kl_coef = jax.random.key(3), jnp.float32(0.05)
    expected, expected_steps, all_stats = reference_update(ac, settings, hp, params, exp, key, 0.05, 0)
    first = all_stats[0]
    optimizer = make_optimizer()
    update = make_update(ac, settings, optimizer)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer, hyperparams=hp)
    state, metrics = update(state, exp, key, kl_coef)
    assert int(state.optimizer_steps) == expected_steps == 2 * num_mini_batches
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), state.params, expected)
    # the first micro-batch of epoch 0 sees the behaviour policy itself
    assert float(metrics["first_micro_batch/ratio"]) == 1.0
    if num_mini_batches * grad_accum == 1 and not cheap_compiles():  # the rollout's batch shape: bit-identical
        assert float(metrics["first_micro_batch/approxkl"]) == 0.0
    else:  # a smaller matmul (or, without LLVM's optimisation, another program's fusion) may round differently
        assert float(metrics["first_micro_batch/approxkl"]) < 1e-12
    if grad_accum == 1:
        np.testing.assert_allclose(metrics["first_micro_batch/ratio"], first["ratio"], atol=1e-6)
    assert float(metrics["lr"]) == pytest.approx(1e-2)
    assert int(state.update_count) == 1


@pytest.mark.parametrize("config", [
    dict(advantage_estimator="gae", kl_coef=0.05, entropy_coef=0.01),
    dict(advantage_estimator="grpo", num_generations=2, kl_coef=0.0, kl_loss_coef=0.1, entropy_coef=0.01),
    dict(advantage_estimator="reinforce_pp", kl_coef=0.05, loss_agg_mode="seq-mean-token-sum")],
    ids=["gae", "grpo-kl-loss", "reinforce_pp"])
def test_environment_tokens_get_exactly_zero_gradient_kl_and_counts(config):
    """A multi-turn episode's environment tokens (Experience.environment_mask) are in no loss term: the gradient
    of the update's loss with respect to the model's log-prob, entropy and value at those tokens is exactly 0
    (at the policy's tokens it is not); their KL is 0 and the entropy and token counts are the policy's tokens'."""
    ac, params, exp = build()
    settings, hp = settings_for(**config)
    live = ~np.asarray(exp.padding_mask)
    environment = np.zeros_like(live)
    environment[:, 1:3] = live[:, 1:3]  # a tool result after the first token, inside the episode
    environment[:, 0] = False
    assert environment.any() and (live & ~environment).any()
    exp = exp.replace(environment_mask=jnp.asarray(environment))
    batch, metrics, kl = shaped_rewards_and_advantages(settings.algorithm, exp, exp.scores, jnp.float32(0.05))
    policy = live & ~environment
    assert np.all(np.asarray(kl)[environment] == 0)
    np.testing.assert_allclose(metrics["objective/entropy"],
                               np.mean(np.sum(np.where(policy, -np.asarray(exp.logprobs), 0.0), axis=1)), rtol=1e-6)
    np.testing.assert_array_equal(~np.asarray(batch.padding_mask), policy)
    logprobs, entropy, values = ac.evaluate(params, exp.query_responses, P, logits_chunk_size=4)
    policy_tokens, value_tokens = jnp.sum(~batch.padding_mask), jnp.sum(~batch.padding_mask_p1)

    def loss(lp, ent, v):
        return loss_of_outputs(ac, settings.algorithm, hp, lp, ent, v, batch, policy_tokens, value_tokens, B)[0]

    grads = [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(logprobs, entropy, values)]
    for name, grad in zip(("log-prob", "entropy", "value"), grads):
        assert np.all(grad[environment] == 0.0), name
    assert np.abs(grads[0][policy]).max() > 0
    if settings.algorithm.entropy_bonus:
        assert np.abs(grads[1][policy]).max() > 0
    if settings.algorithm.advantage_estimator == "gae":
        assert np.abs(grads[2][policy]).max() > 0


def test_loss_metrics_are_the_loss_optimised_whatever_the_accumulation():
    """loss/policy_avg and loss/value_avg are the mean over optimizer steps of the mini-batch loss as optimised
    (the plain loop's), the same with 1 or 2 micro-batches per step (not 1/G of it)."""
    ac, params, exp = build()
    key, kl_coef = jax.random.key(5), jnp.float32(0.05)
    by_accumulation = {}
    for grad_accum in (1, 2):
        settings, hp = settings_for(num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=grad_accum,
                                    learning_rate=1e-2)
        optimizer = make_optimizer()
        update = make_update(ac, settings, optimizer)
        _, metrics = update(init_train_state(jax.tree.map(jnp.copy, params), optimizer, hyperparams=hp), exp, key,
                            kl_coef)
        by_accumulation[grad_accum] = metrics
    _, _, all_stats = reference_update(ac, settings, hp, params, exp, key, 0.05, 0)
    # TRL's val/ratio and val/ratio_var: mean and unbiased variance of the optimizer steps' mean ratios (here one
    # micro-batch per step)
    ratios = [float(stats["ratio"]) for stats in all_stats]
    np.testing.assert_allclose(float(by_accumulation[1]["val/ratio"]), np.mean(ratios), rtol=1e-6)
    np.testing.assert_allclose(float(by_accumulation[1]["val/ratio_var"]), np.var(ratios, ddof=1), rtol=1e-3)
    assert np.var(ratios, ddof=1) > 0
    for name, short in (("loss/policy_avg", "pg_loss"), ("loss/value_avg", "vf_loss")):
        expected = np.mean([float(stats[short]) for stats in all_stats])
        assert abs(expected) > 1e-4, name  # a loss that is not ~0, so a factor of 1/2 would show
        for grad_accum, metrics in by_accumulation.items():
            np.testing.assert_allclose(float(metrics[name]), expected, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}, gradient_accumulation_steps={grad_accum}")


def test_accumulated_gradients_equal_big_batch_gradient():
    ac, params, exp = build()
    settings, hp = settings_for()
    batch, _, _ = shaped_rewards_and_advantages(settings.algorithm, exp, exp.scores, 0.05)
    from ppojax.rl.update import micro_batch_loss
    tokens = (jnp.sum(~batch.padding_mask), jnp.sum(~batch.padding_mask_p1))
    chunk = dict(logits_chunk_size=settings.batch.update_logits_chunk)
    # each gradient one program (eagerly, the forward and backward would compile hundreds of one-operation programs)
    gradient = jax.jit(jax.grad(lambda p, rows: micro_batch_loss(ac, settings.algorithm, hp, p, rows, *tokens,
                                                                  **chunk)[0]))
    big = gradient(params, batch)
    halves = [gradient(params, jax.tree.map(lambda x: x[s], batch)) for s in (slice(0, 3), slice(3, B))]
    summed = jax.tree.map(jnp.add, *halves)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), summed, big)


def test_no_recompilation_and_linear_lr_decay():
    ac, params, exp = build()
    settings, hp = settings_for(num_ppo_epochs=1, learning_rate=1e-3, num_updates=4)
    optimizer = make_optimizer()
    update = make_update(ac, settings, optimizer)
    state = init_train_state(params, optimizer, hyperparams=hp)
    lrs = []
    for i in range(3):
        state, metrics = update(state, exp, jax.random.key(i), jnp.float32(0.05 + i))
        lrs.append(float(metrics["lr"]))
    assert update._cache_size() == 1
    np.testing.assert_allclose(lrs, [1e-3, 7.5e-4, 5e-4], rtol=1e-6)


def test_learning_rate_and_clip_range_changes_do_not_recompile():
    """The state's hyperparameters are traced: a new learning rate and clip ranges between two calls reuse the
    compiled update (compilations counted), and the second call uses them (its lr is the new base times the
    schedule; its clip fraction is the new clip range's, not the old one's)."""
    ac, params, exp = build()
    settings, hp = settings_for(num_ppo_epochs=1, learning_rate=1e-3, num_updates=4)
    optimizer = make_optimizer()
    update = make_update(ac, settings, optimizer)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    tight = hp.replace(learning_rate=jnp.float32(1e-2), cliprange_low=jnp.float32(1e-4),
                       cliprange_high=jnp.float32(1e-4))
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer, hyperparams=hp)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state, _ = update(state, exp, jax.random.key(0), jnp.float32(0.05))
        after_first = len(compiles)
        copies = [jax.tree.map(jnp.copy, state) for _ in range(2)]  # the state is donated
        copies[1] = copies[1].replace(hyperparams=tight)
        before = len(compiles)  # (copying may compile its own small programs)
        _, same = update(copies[0], exp, jax.random.key(1), jnp.float32(0.05))
        _, changed = update(copies[1], exp, jax.random.key(1), jnp.float32(0.05))
        after = len(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert after_first > 0 and after == before, (after_first, before, after)
    assert update._cache_size() == 1
    np.testing.assert_allclose([float(same["lr"]), float(changed["lr"])], [1e-3 * 0.75, 1e-2 * 0.75], rtol=1e-6)
    # after one update the ratios are off 1 by far more than 1e-4 (a clip range of 0.2 clips none of them)
    clipfrac = (float(same["policy/clipfrac_avg"]), float(changed["policy/clipfrac_avg"]))
    assert clipfrac[0] == 0.0 and clipfrac[1] > 0.2, clipfrac


@pytest.mark.parametrize("kind", ["linear", "constant"])
def test_learning_rate_schedule_is_hf_schedule_with_warmup(kind):
    """``OptimSettings.lr_schedule`` (optax's joined schedules) against transformers'
    ``get_linear_schedule_with_warmup`` / ``get_constant_schedule_with_warmup`` lambdas, written out here, for every
    update of a run: equal to the bit to HF's operations in HF's order in float32, both compiled by XLA (a last-bit
    difference is enough for a long run's sampling to diverge)."""
    from ppojax.rl.settings import OptimSettings
    for warmup, total in ((0, 5), (2, 6), (3, 3), (3, 30), (10, 97), (0, 30)):
        schedule = OptimSettings(num_updates=total, warmup_steps=warmup, lr_scheduler_type=kind).lr_schedule()

        def hf(u):  # the lambdas' arithmetic, u a float32 update index
            if kind == "constant":
                after = jnp.float32(1.0)
            else:
                after = jnp.maximum(0.0, (jnp.float32(total) - u) / jnp.float32(max(1, total - warmup)))
            return jnp.where(u < warmup, u / jnp.float32(max(1, warmup)), after)

        compiled_schedule, compiled_hf = jax.jit(schedule), jax.jit(hf)  # one compile each, scalars as in a step
        for u in range(total):
            got = np.asarray(compiled_schedule(jnp.int32(u)), np.float32)
            expected = np.asarray(compiled_hf(jnp.float32(u)), np.float32)
            assert got.tobytes() == expected.tobytes(), (warmup, total, u, got, expected)


def test_nonfinite_gradient_skips_the_step_and_is_counted():
    ac, params, exp = build()
    settings, hp = settings_for(num_ppo_epochs=2, num_mini_batches=2, learning_rate=1e-2)
    optimizer = make_optimizer()
    update = make_update(ac, settings, optimizer)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer, hyperparams=hp)
    bad = exp._replace(scores=exp.scores.at[0].set(jnp.nan))
    state, metrics = update(state, bad, jax.random.key(0), jnp.float32(0.05))
    assert int(state.optimizer_steps) == 0 and int(state.nonfinite_total) == 4
    assert int(state.nonfinite_streak) == 4 and float(metrics["ppo/skipped_steps"]) == 4
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state.params, params)
    state, _ = update(state, exp, jax.random.key(0), jnp.float32(0.05))
    assert int(state.optimizer_steps) == 4 and int(state.nonfinite_streak) == 0


def test_legacy_ratio_threshold_and_early_stopping_skip_steps():
    ac, params, exp = build()
    optimizer = make_optimizer()
    settings, hp = settings_for(num_ppo_epochs=2, num_mini_batches=2, ratio_threshold=0.5)  # ratio ~1 > 0.5
    fresh = lambda hp: init_train_state(jax.tree.map(jnp.copy, params), optimizer, hyperparams=hp)  # noqa: E731
    state, _ = make_update(ac, settings, optimizer)(fresh(hp), exp, jax.random.key(0), jnp.float32(0.05))
    assert int(state.optimizer_steps) == 0
    # early stopping at a (config-invalid) negative target: any KL after the first step exceeds it
    settings, hp = settings_for(num_ppo_epochs=3, num_mini_batches=2, early_stopping=True, learning_rate=1e-2)
    settings = dataclasses.replace(settings, optim=dataclasses.replace(settings.optim, target_kl=-1.0))
    state, metrics = make_update(ac, settings, optimizer)(fresh(hp), exp, jax.random.key(0), jnp.float32(0.05))
    assert int(state.optimizer_steps) == 1  # the first step runs, then the KL check stops the rest


@pytest.mark.parametrize("kernels", [XLA, CpuKernels()], ids=["xla", "cpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_all_finite_finds_every_inf_and_nan_and_nothing_else(dtype, kernels):
    """The gradient guard's check (``Kernels.all_finite``: XLA's plain form, and the CPU's matrix-vector form)
    against numpy's, leaf by leaf: one inf, -inf or NaN anywhere in any leaf (a scalar, 1-D, 2-D and a stacked 4-D
    leaf) makes it False; the largest finite values (whose sum overflows) and integer leaves do not."""
    all_finite = kernels.all_finite

    rng = np.random.default_rng(0)
    shapes = [(), (7,), (5, 3), (3, 4, 2, 6)]
    tree = {"a": [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes], "step": jnp.int32(3)}
    check = jax.jit(all_finite)
    assert bool(check(tree))
    big = jax.tree.map(lambda x: jnp.full_like(x, jnp.finfo(dtype).max) if x.dtype == dtype else x, tree)
    assert bool(check(big)) and np.isinf(np.sum([np.sum(np.asarray(x, np.float32)) for x in big["a"]]))
    for leaf, shape in enumerate(shapes):
        for bad in (np.inf, -np.inf, np.nan):
            index = tuple(int(rng.integers(n)) for n in shape)
            broken = jax.tree.map(lambda x: x, tree)
            broken["a"][leaf] = broken["a"][leaf].at[index].set(bad)
            expected = all(np.isfinite(np.asarray(x, np.float32)).all() for x in broken["a"])
            assert not expected and bool(check(broken)) is expected, (shape, index, bad)
