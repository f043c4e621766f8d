"""Packed update (``padding_free``) against the padded one.

- first-fit packing against a plain Python first-fit-decreasing, and every span copied unchanged;
- the packed forward's log-probs, entropy and values, put back in the padded layout, equal the padded forward's;
- one whole PPO update (``learn``): every metric, the gradients (an SGD step) and the parameters after several
  Adam steps equal the padded update's, for several length distributions, one and two micro-batches per
  mini-batch, GAE with a value model, a value head, and GRPO without a critic (SGD steps: see below);
- a whole ``train_step`` (sampling included) with ``padding_free`` equals the padded one on the same seed;
- the number of packed micro-batches follows the real tokens;
- the rollout's forwards (behaviour and reference log-probs, values, full KL) and a reward model's scores on
  packed rows equal the padded ones wherever the rollout keeps them, and so does a whole ``rollout.experience``.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppojax.core.masks import INVALID_LOGPROB
from ppojax.models import CausalLM, CausalLMWithValueHead, ScoreModel
from ppojax.rl.actor_critic import ActorCritic
from ppojax.rl.packing import NO_SEGMENT, first_fit, pack_rows, packed_layout, plan_packing, unpack_responses
from ppojax.rl import rollout
from ppojax.rl.packed_rollout import packed_rollout_forwards
from ppojax.rl.program import PPOProgram, make_train_step
from ppojax.rl.rewards import ModelScores, TracedScores
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.types import Experience, init_train_state
from ppojax.rl.update import learn
from ppojax.trainer.config import PPOConfig
from tests.test_train_step import good_token_fraction, prompt_blocks
from tests.tiny_setup import tiny_config

P, R, B = 6, 10, 16
PAD, STOP = 0, 1
VOCAB = tiny_config().vocab_size
TIGHT = dict(rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- the packing
def python_first_fit(lengths, capacity):
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    fill, row, offset = [], [0] * len(lengths), [0] * len(lengths)
    for i in order:
        r = next((k for k, f in enumerate(fill) if f + lengths[i] <= capacity), None)
        if r is None:
            fill.append(0)
            r = len(fill) - 1
        row[i], offset[i] = r, fill[r]
        fill[r] += lengths[i]
    return row, offset, len(fill)


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_is_first_fit_decreasing(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 17, size=24).tolist()
    row, offset, num_rows = first_fit(jnp.asarray(lengths, jnp.int32), 16)
    expected = python_first_fit(lengths, 16)
    assert (row.tolist(), offset.tolist(), int(num_rows)) == expected


def lengths_case(name, rng):
    """(left pads i32[B], live response tokens i32[B]) of a named length distribution."""
    pads = rng.integers(0, P - 1, size=B)
    if name == "full":  # no padding at all
        return np.zeros(B, int), np.full(B, R)
    if name == "uniform":
        return pads, rng.integers(0, R + 1, size=B)
    if name == "long_tail":  # most responses short, one at the limit
        live = np.minimum(rng.lognormal(0.5, 0.8, size=B).astype(int) + 1, R)
        live[3] = R
        return pads, live
    if name == "over_half":  # every span longer than half a padded row: one span per padded-length row
        return np.zeros(B, int), rng.integers(3, 6, size=B)
    if name == "empty_responses":
        live = rng.integers(0, 3, size=B)
        live[::4] = 0
        return pads, live
    raise ValueError(name)


def synthetic_rows(pads, live, rng):
    """query_responses i32[B, P+R]: left-padded prompts, responses of ``live`` tokens ending in the stop token,
    then (untruncated, as the sampler leaves them) more tokens, some of them pad ids."""
    qr = rng.integers(2, VOCAB, size=(B, P + R))
    for i in range(B):
        qr[i, :pads[i]] = PAD
        if live[i] > 0:
            qr[i, P + live[i] - 1] = STOP
    qr[rng.random((B, P + R)) < 0.05] = PAD  # holes: a pad id inside a row is a masked key, as the model sees it
    return jnp.asarray(qr, jnp.int32)


@pytest.mark.parametrize("case,row_length", [("uniform", None), ("over_half", 2 * (P + R))])
def test_packing_copies_every_span_and_nothing_else(case, row_length):
    """Rows of a padded row's slots, and rows twice as long, where spans longer than half a padded row share one."""
    rng = np.random.default_rng(0)
    pads, live = lengths_case(case, rng)
    qr = synthetic_rows(pads, live, rng)
    plan = plan_packing(qr, jnp.asarray(live), P, PAD, row_length)
    packed = pack_rows(qr, plan, B, PAD, row_length)
    assert packed.tokens.shape == (B, row_length or P + R)
    want_row, want_offset, want_rows = python_first_fit([int(x) for x in plan.length], row_length or P + R)
    assert ([int(x) for x in plan.row], [int(x) for x in plan.offset], int(plan.num_rows)) == (
        want_row, want_offset, want_rows)
    qr, seg, tokens = np.asarray(qr), np.asarray(packed.segment_ids), np.asarray(packed.tokens)
    for i in range(B):
        start = min(next((c for c in range(P) if qr[i, c] != PAD), P - 1), P - 1)
        end = P + live[i]
        r, o = int(plan.row[i]), int(plan.offset[i])
        np.testing.assert_array_equal(tokens[r, o:o + end - start], qr[i, start:end])
        assert (seg[r, o:o + end - start] == i).all()
    assert (seg >= 0).sum() == sum(int(x) for x in plan.length)  # no slot written twice or left over
    assert (seg[int(plan.num_rows):] == NO_SEGMENT).all()
    assert int(plan.num_rows) < B  # real lengths fill fewer rows than one per sequence


# ------------------------------------------------------------------------------------------ forwards packed
def actor_critic_for(kind):
    cfg = tiny_config()
    policy_cls = CausalLMWithValueHead if kind == "value_head" else CausalLM
    policy_def = nnx.graphdef(nnx.eval_shape(lambda: policy_cls(cfg, rngs=nnx.Rngs(0))))
    value_def = None
    if kind == "value_model":
        value_def = nnx.graphdef(nnx.eval_shape(lambda: ScoreModel(cfg, rngs=nnx.Rngs(0))))
    return ActorCritic(policy_def, value_def, PAD, 0.7, has_critic=kind != "grpo")


def params_for(kind, seed=0):
    cfg = tiny_config()
    key = jax.random.key(seed)
    policy_cls = CausalLMWithValueHead if kind == "value_head" else CausalLM
    policy = nnx.state(policy_cls(cfg, rngs=nnx.Rngs(params=key)))
    params = {"policy": policy}
    if kind == "value_model":
        params["value"] = nnx.state(ScoreModel(cfg, rngs=nnx.Rngs(params=jax.random.fold_in(key, 1))))
    return params


@pytest.mark.parametrize("kind", ["value_model", "value_head"])
def test_packed_forward_equals_padded_forward(kind):
    rng = np.random.default_rng(1)
    pads, live = lengths_case("uniform", rng)
    qr = synthetic_rows(pads, live, rng)
    ac, params = actor_critic_for(kind), params_for(kind)
    logprobs, entropy, values = jax.jit(lambda p: ac.evaluate(p, qr, P))(params)
    plan = plan_packing(qr, jnp.asarray(live), P, PAD)
    packed = pack_rows(qr, plan, B, PAD)
    outputs = jax.jit(lambda p: ac.evaluate_layout(p, packed_layout(packed)))(params)
    (lp, valid), (ent, _), (val, _) = (unpack_responses(x, plan, 0, P, R) for x in outputs)
    t = np.arange(R)[None, :]
    policy_live, value_live = t < live[:, None], t <= live[:, None]
    np.testing.assert_array_equal(np.asarray(valid), value_live)
    np.testing.assert_allclose(np.where(policy_live, lp, 0), np.where(policy_live, logprobs, 0), **TIGHT)
    np.testing.assert_allclose(np.where(policy_live, ent, 0), np.where(policy_live, entropy, 0), **TIGHT)
    np.testing.assert_allclose(np.where(value_live, val, 0), np.where(value_live, values, 0), **TIGHT)


# ------------------------------------------------------------------------------------- rollout forwards packed
def truncated(qr, live):
    """The rollout's view: responses cut after their stop token (pad after it), as ``truncate_response`` does."""
    t = np.arange(R)[None, :]
    return jnp.where(jnp.asarray(np.concatenate([np.zeros((B, P), bool), t >= live[:, None]], axis=1)), PAD, qr)


@pytest.mark.parametrize("kind,with_full_kl,sampler_logprobs,rows_per_micro,row_length", [
    ("value_model", True, False, 4, None), ("value_head", False, True, 2, None), ("grpo", False, True, 16, None),
    ("grpo", True, False, 3, None), ("value_model", True, False, 2, 3 * (P + R))])
def test_packed_rollout_forwards_equal_padded(kind, with_full_kl, sampler_logprobs, rows_per_micro, row_length):
    """Behaviour and reference log-probs, values and the full KL on every position the rollout keeps, with a
    reference that differs from the policy, 1 to 8 packed micro-batches, rows of a padded row's slots or three
    times as many."""
    rng = np.random.default_rng(2)
    pads, live = lengths_case("long_tail", rng)
    qr = synthetic_rows(pads, live, rng)
    ac, params = actor_critic_for(kind), params_for(kind)
    frozen = {"ref": params_for(kind, seed=5)["policy"]}
    given = jnp.asarray(rng.normal(size=(B, R)), jnp.float32) if sampler_logprobs else None
    padded = jax.jit(lambda p, f: ac.rollout_forwards(p, f, qr, P, with_full_kl=with_full_kl,
                                                      behaviour_logprobs=given, logits_chunk_size=4))(params, frozen)
    packed = jax.jit(lambda p, f: packed_rollout_forwards(
        ac, p, f, qr, P, jnp.asarray(live), rows_per_micro=rows_per_micro, with_full_kl=with_full_kl,
        behaviour_logprobs=given, row_length=row_length))(params, frozen)
    t = np.arange(R)[None, :]
    keep = {"logprobs": t < live[:, None], "ref_logprobs": t < live[:, None], "values": t <= live[:, None],
            "full_kl": t < live[:, None]}
    for name, a, b in zip(keep, padded, packed):
        assert (a is None) == (b is None) == (name == "full_kl" and not with_full_kl), name
        if a is not None:
            np.testing.assert_allclose(np.where(keep[name], b, 0), np.where(keep[name], a, 0), err_msg=name,
                                       **TIGHT)
    assert float(jnp.max(jnp.abs(padded[1] - padded[0]))) > 1e-2  # the reference is not the policy


@pytest.mark.parametrize("rows_per_micro", [1, 5, 16])
def test_packed_reward_model_scores_equal_padded(rows_per_micro):
    """A reward model's score of prompt + truncated response (TRL's get_reward: one before the first pad)."""
    rng = np.random.default_rng(3)
    pads, live = lengths_case("empty_responses", rng)
    qr = truncated(synthetic_rows(pads, live, rng), live)
    score_def, weights = nnx.split(ScoreModel(tiny_config(), rngs=nnx.Rngs(4)))
    reward = ModelScores(score_def, PAD)
    frozen = {"reward": weights}
    padded = jax.jit(lambda f: reward.scores(f, qr[:, :P], qr[:, P:]).scores)(frozen)
    packed = jax.jit(lambda f: reward.scores(f, qr[:, :P], qr[:, P:], packed_rows=rows_per_micro).scores)(frozen)
    np.testing.assert_allclose(packed, padded, **TIGHT)
    assert float(jnp.std(padded)) > 1e-3  # the scores differ from row to row


def test_packed_experience_equals_padded_experience():
    """``rollout.experience`` with ``padding_free`` (forwards and a reward model on packed rows, 2-row micro-batches)
    equals the padded one, every field."""
    rng = np.random.default_rng(4)
    pads, live = lengths_case("uniform", rng)
    qr = synthetic_rows(pads, live, rng)
    score_def, weights = nnx.split(ScoreModel(tiny_config(), rngs=nnx.Rngs(6)))
    results = []
    for free in (False, True):
        program, config = program_for("value_model", 1, free, optax.sgd(1.0), local_rollout_forward_batch_size=2)
        program = dataclasses.replace(program, reward=ModelScores(score_def, PAD, 2))
        state = state_for(program, config, "value_model")
        state = state.replace(frozen={**state.frozen, "reward": weights})
        results.append(jax.jit(lambda s: rollout.experience(program, s, qr, P)[0])(state))
    padded, packed = results
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(padded)[0], jax.tree_util.tree_flatten_with_path(packed)[0]
    assert [path for path, _ in flat_a] == [path for path, _ in flat_b]
    for (path, a), (_, b) in zip(flat_a, flat_b):
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), err_msg=str(path), **TIGHT)
    assert float(jnp.std(padded.scores)) > 1e-3


# -------------------------------------------------------------------------------------------- the update
def config_for(kind, accumulation, **extra):
    options = dict(batch_size=B, response_length=R, max_prompt_length=P, learning_rate=1e-2, temperature=0.7,
                   num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=accumulation, kl_coef=0.05,
                   cliprange_value=0.2)
    if kind == "grpo":
        options.update(advantage_estimator="grpo", num_generations=4, kl_coef=0.0, kl_loss_coef=0.04,
                       loss_agg_mode="seq-mean-token-mean")
    return PPOConfig(**{**options, **extra})


def program_for(kind, accumulation, padding_free, optimizer, **extra):
    config = config_for(kind, accumulation, padding_free=padding_free, **extra)
    settings = StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=STOP, eos_token_id=STOP,
                                        vocab_size=VOCAB)
    return PPOProgram(actor_critic_for(kind), TracedScores(good_token_fraction), settings, optimizer), config


def experience_for(qr, live, rng, kind):
    t = np.arange(R)[None, :]
    padding_mask = jnp.asarray(t > live[:, None] - 1)
    padding_mask_p1 = jnp.asarray(t > live[:, None])

    def logprobs():  # near the tiny random model's own (about -log V): ratios near 1, as in a real update
        near = -np.log(VOCAB) + 0.3 * rng.normal(size=(B, R))
        return jnp.where(padding_mask, INVALID_LOGPROB, jnp.asarray(near, jnp.float32))

    values = 0.0 if kind == "grpo" else jnp.where(padding_mask_p1, 0.0, jnp.asarray(rng.normal(size=(B, R))))
    return Experience(
        queries=qr[:, :P], query_responses=qr, responses=qr[:, P:], logprobs=logprobs(), ref_logprobs=logprobs(),
        values=jnp.broadcast_to(jnp.asarray(values, jnp.float32), (B, R)),
        scores=jnp.asarray(rng.normal(size=B), jnp.float32), last_index=jnp.asarray(live - 1, jnp.int32),
        padding_mask=padding_mask, padding_mask_p1=padding_mask_p1, contains_stop=jnp.asarray(live > 0),
        num_eos_tokens=jnp.int32(int((live > 0).sum())))


def state_for(program, config, kind):
    params = params_for(kind)
    return init_train_state(params, program.optimizer, hyperparams=Hyperparams.from_config(config),
                            frozen={"ref": jax.tree.map(jnp.copy, params["policy"]), "reward": None}, kl_coef=0.05)


def run_learn(kind, accumulation, padding_free, case, optimizer, environment_tokens=False, **extra):
    rng = np.random.default_rng(7)
    pads, live = lengths_case(case, rng)
    qr = synthetic_rows(pads, live, rng)
    experience = experience_for(qr, live, rng, kind)
    if environment_tokens:  # a tool's answer at response tokens 1 and 2 of every row longer than 3 tokens
        t = np.arange(R)[None, :]
        environment = (t >= 1) & (t <= 2) & (live[:, None] > 3)
        assert environment.any()
        experience = experience.replace(environment_mask=jnp.asarray(environment))
    program, config = program_for(kind, accumulation, padding_free, optimizer, **extra)
    state = state_for(program, config, kind)
    new_state, metrics = jax.jit(lambda s, e, k: learn(program, s, e, k))(state, experience, jax.random.key(3))
    return state, new_state, metrics


def assert_same_update(padded, packed, param_atol=1e-6):
    (_, state_a, metrics_a), (_, state_b, metrics_b) = padded, packed
    assert set(metrics_b) - set(metrics_a) == {"perf/packed_micro_batches"}
    for name, value in metrics_a.items():
        np.testing.assert_allclose(metrics_b[name], value, err_msg=name, **TIGHT)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-6, atol=param_atol), state_a.params,
                 state_b.params)


@pytest.mark.parametrize("case,accumulation", [("full", 2), ("uniform", 1), ("long_tail", 2),
                                               ("empty_responses", 1)])
def test_packed_gradient_equals_padded_gradient(case, accumulation):
    """One SGD step (learning rate 1): the parameter change IS the gradient."""
    sgd = optax.sgd(1.0)
    runs = [run_learn("value_model", accumulation, free, case, sgd, num_ppo_epochs=1, num_mini_batches=1,
                      learning_rate=1.0) for free in (False, True)]
    (before, padded, _), (_, packed, _) = runs
    assert_same_update(runs[0], runs[1])
    grads = jax.tree.map(lambda a, b: b - a, before.params, padded.params)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads)) > 1e-3  # a real step was taken


@pytest.mark.parametrize("kind,case,accumulation", [
    ("value_model", "long_tail", 2), ("value_head", "uniform", 1), ("grpo", "empty_responses", 2)])
def test_packed_update_equals_padded_update(kind, case, accumulation):
    """Two epochs x two mini-batches of optimizer steps: every metric and the parameters. SGD, not Adam: Adam
    divides by each gradient's own size, so float rounding of a near-zero gradient (which any change of shapes
    brings, packed or not) may move a parameter by up to the learning rate, and the later steps then differ
    by more than rounding."""
    runs = [run_learn(kind, accumulation, free, case, optax.sgd(1.0)) for free in (False, True)]
    assert_same_update(runs[0], runs[1])


@pytest.mark.parametrize("kind,accumulation", [("value_model", 2), ("grpo", 1)])
def test_longer_packed_rows_equal_the_padded_update_and_share_rows(kind, accumulation):
    """Spans longer than half a padded row (10-12 of 16 slots): in rows of 16 each takes a row of its own, in rows
    of 32 two or three share one. Every metric and the parameters still equal the padded update's, with fewer
    packed micro-batches for the same budget of 32 slots."""
    padded = run_learn(kind, accumulation, False, "over_half", optax.sgd(1.0))
    runs = {length: run_learn(kind, accumulation, True, "over_half", optax.sgd(1.0), packed_row_length=length,
                              max_tokens_per_micro_batch=2 * (P + R)) for length in (P + R, 2 * (P + R))}
    for packed in runs.values():
        assert_same_update(padded, packed)
    short, long = (float(runs[length][2]["perf/packed_micro_batches"]) for length in (P + R, 2 * (P + R)))
    assert long < short, (long, short)


@pytest.mark.parametrize("kind", ["value_model", "grpo"])
def test_packed_update_equals_padded_update_with_environment_tokens(kind):
    """A multi-turn episode's environment tokens inside the responses: out of the loss on both paths, but still
    the context of the policy's tokens after them, so a packed row keeps everything up to its last policy token."""
    runs = [run_learn(kind, 2, free, "long_tail", optax.sgd(1.0), environment_tokens=True) for free in (False, True)]
    assert_same_update(runs[0], runs[1])


def test_packed_micro_batches_follow_the_real_tokens():
    """Rows of P+R = 16 slots; a micro-batch of 8 rows. All full: a row per sequence, 8 rows a mini-batch (one
    micro-batch); mostly short sequences pack into far fewer rows (still one); a budget of 2 rows runs
    ceil(rows in use / 2)."""
    _, _, full = run_learn("value_model", 1, True, "full", optax.sgd(1.0), max_tokens_per_micro_batch=32)
    _, _, short = run_learn("value_model", 1, True, "empty_responses", optax.sgd(1.0),
                            max_tokens_per_micro_batch=32)
    assert float(full["perf/packed_micro_batches"]) == 4.0  # 8 sequences of 16 tokens: 8 rows, 2 per micro-batch
    assert float(short["perf/packed_micro_batches"]) < 4.0
    assert float(short["perf/padding_fraction"]) > 0.5 > float(full["perf/padding_fraction"])


def test_config_refuses_a_budget_below_one_row():
    with pytest.raises(Exception, match="max_tokens_per_micro_batch=10 is below one packed row"):
        PPOConfig(max_prompt_length=6, response_length=10, padding_free=True, max_tokens_per_micro_batch=10)
    with pytest.raises(Exception, match="padding_free is off"):
        PPOConfig(max_tokens_per_micro_batch=1000)
    with pytest.raises(Exception, match=r"packed_row_length=12 is below a padded row .* at least 16, e\.g\. 32"):
        PPOConfig(max_prompt_length=6, response_length=10, padding_free=True, packed_row_length=12)
    with pytest.raises(Exception, match=r"max_tokens_per_micro_batch=16 is below one packed row "
                                        r"\(packed_row_length=32\)"):
        PPOConfig(max_prompt_length=6, response_length=10, padding_free=True, packed_row_length=32,
                  max_tokens_per_micro_batch=16)
    with pytest.raises(Exception, match="packed_row_length=32 is set but padding_free is off"):
        PPOConfig(max_prompt_length=6, response_length=10, packed_row_length=32)


# ------------------------------------------------------------------------------------- a whole train_step
def train_step_program(padding_free: bool, mesh=None) -> PPOProgram:
    """The tiny PPO program of tests/test_train_step.py (value model, a traced reward), padded or packed, on
    ``mesh`` (None: one device)."""
    from tests.test_train_step import tiny_config_ppo

    data_parallel = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    settings = StepSettings.from_config(tiny_config_ppo(), pad_token_id=0, stop_token_id=1, eos_token_id=1,
                                        num_updates=1, vocab_size=VOCAB, data_parallel_size=data_parallel)
    settings = dataclasses.replace(settings, batch=dataclasses.replace(settings.batch, padding_free=padding_free))
    actor_critic = dataclasses.replace(actor_critic_for("value_model"), temperature=1.0)
    return PPOProgram(actor_critic, TracedScores(good_token_fraction), settings, optax.sgd(1.0), mesh)


def assert_steps_equal(padded, packed):
    """Two ``(state, metrics)`` results of one train_step: every metric and parameter equal (float32)."""
    (state_a, metrics_a), (state_b, metrics_b) = padded, packed
    for name, value in metrics_a.items():
        np.testing.assert_allclose(metrics_b[name], value, err_msg=name, **TIGHT)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, **TIGHT), state_a.params, state_b.params)


def test_train_step_packed_equals_padded():
    from tests.test_train_step import init_state  # the padded program's own fixtures

    prompts = prompt_blocks(1)[0]
    results = []
    for free in (False, True):
        p = train_step_program(free)
        state = init_state(p, 0)
        step = make_train_step(p)
        results.append(step(state, prompts, jax.random.key(11)))
    assert float(results[0][1]["perf/padding_fraction"]) > 0.2  # the sampled lengths vary: padding to skip
    assert_steps_equal(*results)
    state_b, metrics_b = results[1]
    # other lengths, other packed micro-batch counts: the same compiled program (the loops' trip counts are traced)
    _, again = step(state_b, prompt_blocks(2)[1], jax.random.key(12))
    assert float(again["perf/padding_fraction"]) != float(metrics_b["perf/padding_fraction"])
    assert step.jitted._cache_size() == 1
