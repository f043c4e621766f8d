"""DAPO's dynamic sampling (``filter_groups``, ppojax/rl/dynamic_sampling.py):

- the selection (which groups are dropped, the order the batch is filled, what fills it when the bound on rounds
  stops it) equals a plain-Python reference on crafted scores, and its metrics read as documented;
- the prompt batches give the rounds' prompts without taking them and take the rounds an update used;
- refused before compute: a bound of 0, an estimator without group-relative advantages, one sample per prompt,
  the fields without filter_groups, rounds that can never fill the batch, the legacy step();
- whole tiny runs through PPOTrainer with a Python reward that is constant on some prompts: every batch full, the
  metrics equal the reference selection on the reward's own calls, one compiled program, no prompt skipped; the
  first round samples what an update without dynamic sampling samples; padding_free and rollout_slots give the
  same run; a resumed run equals the uninterrupted one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.rl.dynamic_sampling import Round, select_groups, selection_metrics
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.trainer.data import PromptBatches
from ppojax.trainer.ppo_trainer import PPOTrainer
from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer


# ------------------------------------------------------------------------------------------------------------
# The selection, against a plain-Python reference
# ------------------------------------------------------------------------------------------------------------
def reference_selection(scores, trainable, groups_wanted, group_size, max_rounds):
    """Plain Python: rounds until K informative groups are kept (or the bound); the batch is the kept groups in
    sampling order, then (when not full) the first dropped groups in sampling order. scores / trainable:
    [rounds][rows]. Returns (slots as (round, group), kept, dropped, all_truncated, rounds used)."""
    K, G = groups_wanted, group_size
    kept, spare, dropped, all_truncated, used = [], [], 0, 0, 0
    for r in range(max_rounds):
        if len(kept) == K:
            break
        used += 1
        for g in range(len(scores[r]) // G):
            values = [float(v) for v in scores[r][g * G:(g + 1) * G]]
            trains = any(trainable[r][g * G:(g + 1) * G])
            all_truncated += not trains
            finite = all(np.isfinite(values))
            informative = (not finite or max(values) > min(values)) and trains
            if informative:
                if len(kept) < K:
                    kept.append((r, g))  # past K: the last round's surplus, dropped as verl does
            else:
                dropped += 1
                if len(spare) < K:
                    spare.append((r, g))
    return kept + spare[:K - len(kept)], len(kept), dropped, all_truncated, used


T, Q, G, K = 3, 3, 2, 4  # rounds, prompts per round, samples per prompt, groups per batch


@jax.jit
def select(scores, trainable):
    """select_groups on crafted rounds: scores f32[T, Q*G], trainable bool[T, Q*G]; each row's id is
    round * 100 + group * 10 + sample."""
    ids = (jnp.arange(T)[:, None, None] * 100 + jnp.arange(Q)[None, :, None] * 10
           + jnp.arange(G)[None, None, :]).reshape(T, Q * G)

    def sample_round(r):  # round r's decode loop: (r + 1) busy of 4 * (r + 1) computed row-steps
        work = (jnp.float32(r + 1), jnp.float32(4 * (r + 1)))
        return Round(dict(id=ids[r], score=scores[r]), scores[r], trainable[r], jnp.int32(r == 1), None, work)

    return select_groups(sample_round, groups_wanted=K, group_size=G, max_rounds=T)


CASES = {  # name: (scores [T][Q*G], trainable or None: all)
    "full in round 1": ([[0, 1, 2, 3, 4, 5], [7] * 6, [7] * 6], None),
    "refilled in round 2, the surplus dropped": ([[0, 1, 2, 2, 4, 5], [0, 1, 3, 3, 1, 0], [7] * 6], None),
    "the bound: part full, spares after": ([[1, 1, 0, 1, 2, 2], [3, 3, 3, 3, 0, 1], [5, 5, 5, 5, 5, 5]], None),
    "nothing informative": ([[1, 1, 2, 2, 3, 3]] * 3, None),
    "not finite is kept": ([[np.nan, np.nan, 1, 1, np.inf, np.inf], [1, 2, 1, 2, 1, 1], [0] * 6], None),
    "a group all truncated is dropped": ([[0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1]],
                                         [[0, 0, 1, 0, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]]),
}


def random_cases(count=12):
    rng = np.random.default_rng(0)
    return {f"random {i}": (rng.integers(0, 2, (T, Q * G)).tolist(), rng.random((T, Q * G)) > 0.2)
            for i in range(count)}


@pytest.mark.parametrize("name, case", list({**CASES, **random_cases()}.items()))
def test_the_selection_equals_the_reference(name, case):
    scores, trainable = case
    scores = np.asarray(scores, np.float32)
    trainable = np.ones(scores.shape, bool) if trainable is None else np.asarray(trainable, bool)
    slots, kept, dropped, all_truncated, rounds = reference_selection(scores, trainable, K, G, T)
    got = jax.device_get(select(scores, trainable))
    expected_ids = [r * 100 + g * 10 + s for r, g in slots for s in range(G)]
    np.testing.assert_array_equal(got.rows["id"], expected_ids)
    np.testing.assert_array_equal(got.rows["score"], [scores[r][g * G + s] for r, g in slots for s in range(G)])
    np.testing.assert_array_equal(got.trained, [i < kept * G for i in range(K * G)])
    assert (int(got.rounds), int(got.kept), int(got.dropped), int(got.all_truncated)) == (
        rounds, kept, dropped, all_truncated)
    assert int(got.failures) == (rounds >= 2)  # summed over the rounds that ran (round 1 reports one)
    sampled = scores[:rounds].reshape(-1)
    np.testing.assert_allclose(got.sampled_score_sum, np.sum(sampled[np.isfinite(sampled)]), rtol=1e-6)
    assert int(got.sampled_score_count) == np.isfinite(sampled).sum()
    ran = np.arange(1, rounds + 1)  # the decode work of the rounds that ran, summed
    assert (float(got.decode_busy), float(got.decode_computed)) == (ran.sum(), 4 * ran.sum())


def test_groups_judged_by_one_reward_ignore_the_rows_it_does_not_apply_to():
    """filter_groups_metric: a group is judged by one reward's values where it applies (NaN elsewhere), not by the
    score: here the scores all differ, the reward's values decide."""
    nan = np.nan
    judged = jnp.asarray([[1, 1, 0, 1, 2, nan], [nan, nan, 3, nan, 4, 5], [0, 1, 0, 1, 0, 1]], jnp.float32)
    scores = jnp.arange(T * Q * G, dtype=jnp.float32).reshape(T, Q * G)

    def sample_round(r):
        return Round(dict(id=jnp.arange(Q * G) + 10 * r), scores[r], None, jnp.int32(0), judged[r])

    got = jax.device_get(jax.jit(lambda: select_groups(sample_round, groups_wanted=K, group_size=G,
                                                       max_rounds=T))())
    # round 0: (1, 1) equal, (0, 1) kept, (2, NaN) one value: equal; round 1: (NaN, NaN) none, (3, NaN) one value,
    # (4, 5) kept; round 2: its first two groups fill the batch
    np.testing.assert_array_equal(got.rows["id"], [2, 3, 14, 15, 20, 21, 22, 23])
    assert (int(got.kept), int(got.dropped), int(got.rounds)) == (4, 4, 3)


def test_the_metrics_read_the_selection():
    full = select(np.asarray(CASES["refilled in round 2, the surplus dropped"][0], np.float32), np.ones((T, 6), bool))
    metrics = jax.device_get(selection_metrics(full, groups_wanted=K, group_size=G, prompts_per_round=Q,
                                               with_truncation=False))
    assert metrics == pytest.approx({
        "dynamic_sampling/rounds": 2, "dynamic_sampling/groups_dropped": 2, "dynamic_sampling/filled_fraction": 1.0,
        "dynamic_sampling/batch_full": 1.0, "dynamic_sampling/generated_over_trained": 2 * Q * G / (K * G),
        "dynamic_sampling/sampled_scores": np.mean([0, 1, 2, 2, 4, 5, 0, 1, 3, 3, 1, 0])})
    part = select(np.asarray(CASES["the bound: part full, spares after"][0], np.float32), np.ones((T, 6), bool))
    metrics = jax.device_get(selection_metrics(part, groups_wanted=K, group_size=G, prompts_per_round=Q,
                                               with_truncation=True))
    assert metrics["dynamic_sampling/batch_full"] == 0 and metrics["dynamic_sampling/filled_fraction"] == 2 / K
    assert metrics["dynamic_sampling/generated_over_trained"] == pytest.approx(T * Q * G / (2 * G))
    assert metrics["dynamic_sampling/groups_all_truncated"] == 0
    none = select(np.ones((T, 6), np.float32), np.ones((T, 6), bool))
    metrics = jax.device_get(selection_metrics(none, groups_wanted=K, group_size=G, prompts_per_round=Q,
                                               with_truncation=False))
    assert np.isnan(metrics["dynamic_sampling/generated_over_trained"]) and metrics["dynamic_sampling/rounds"] == T


# ------------------------------------------------------------------------------------------------------------
# The rounds' prompts
# ------------------------------------------------------------------------------------------------------------
def test_prompt_batches_show_the_rounds_and_take_those_used():
    ids = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
    batches = PromptBatches(ids, batch_size=3, seed=1)  # 3 batches an epoch, one prompt left out each epoch
    plain = PromptBatches(ids, batch_size=3, seed=1)
    order = [next(plain) for _ in range(7)]
    shown = batches.peek(4)  # across the epoch's end
    assert (batches.epoch, batches.position) == (0, 0)  # nothing taken
    np.testing.assert_array_equal(shown.input_ids, np.stack([b.input_ids for b in order[:4]]))
    np.testing.assert_array_equal(shown.indices, np.stack([b.indices for b in order[:4]]))
    batches.take(2)
    resumed = PromptBatches(ids, batch_size=3, seed=1).load_state_dict(batches.state_dict())
    for source in (batches, resumed):
        np.testing.assert_array_equal(source.peek(3).indices, np.stack([b.indices for b in order[2:5]]))
        source.take(3)
        np.testing.assert_array_equal(next(source).indices, order[5].indices)


# ------------------------------------------------------------------------------------------------------------
# Refused before compute
# ------------------------------------------------------------------------------------------------------------
GRPO = dict(advantage_estimator="grpo", num_generations=4, batch_size=16)


@pytest.mark.parametrize("values, message", [
    (dict(filter_groups=True, max_num_gen_batches=0, **GRPO),
     "max_num_gen_batches=0: expected an integer >= 1. Fix: set max_num_gen_batches to the most generation rounds"),
    (dict(filter_groups=True, max_num_gen_batches=-1, **GRPO), "verl's 0 or less, no bound, cannot be"),
    (dict(filter_groups=True, batch_size=16), "its values still give them advantages"),
    (dict(filter_groups=True, advantage_estimator="reinforce_pp", num_generations=4, batch_size=16),
     "it gives each token its own advantage"),
    (dict(filter_groups=True, advantage_estimator="reinforce_pp_baseline", batch_size=16),
     "needs num_generations >= 2"),
    (dict(gen_batch_size=8, **GRPO), "gen_batch_size=8 is read only with filter_groups: true"),
    (dict(max_num_gen_batches=5, **GRPO), "max_num_gen_batches=5 is read only with filter_groups: true"),
    (dict(filter_groups=True, gen_batch_size=1, max_num_gen_batches=3, **GRPO),
     "max_num_gen_batches=3 rounds of gen_batch_size=1 prompts can never fill an update's 4 prompts"),
    (dict(filter_groups=True, gen_batch_size=3, local_rollout_forward_batch_size=8, **GRPO),
     "local_rollout_forward_batch_size=8 does not divide the 12 rows a generation round scores"),
    (dict(filter_groups=True, rollout_slots=12, gen_batch_size=2, max_num_gen_batches=2, **GRPO),
     "rollout_slots=12 is more than the 8 rows a generation round"),
    (dict(filter_groups_metric="acc", **GRPO), "filter_groups_metric='acc' is read only with filter_groups: true"),
    (dict(filter_groups=True, filter_groups_metric="acc", reward_funcs=["gsm8k_strict", "format:reward"], **GRPO),
     "filter_groups_metric='acc' names none of this run's rewards (gsm8k_strict, reward); set it to one of them"),
])
def test_bad_combinations_are_refused_with_the_fix(values, message):
    with pytest.raises(ConfigError) as err:
        PPOConfig(**values)
    assert message in str(err.value)


def test_gen_batch_size_must_split_over_the_data_parallel_devices():
    config = PPOConfig(filter_groups=True, gen_batch_size=3, **GRPO)
    assert config.derived(1).prompts_per_round == 3
    with pytest.raises(ConfigError, match="gen_batch_size=3 prompts do not split over 2 data-parallel devices"):
        config.derived(2)


# ------------------------------------------------------------------------------------------------------------
# The program: scanned, and (tests/test_sharding.py) on a mesh
# ------------------------------------------------------------------------------------------------------------
def steady_on_even_endings(queries, responses):
    """A traced reward: 0.5 for every sample of a prompt whose last token id is even, else the first response
    token's id / 16 (the 4 samples of a prompt almost never share it)."""
    return jnp.where(queries[:, -1] % 2 == 0, 0.5, responses[:, 0] / 16)


def program_with_dynamic_sampling(mesh=None, data_parallel=1):
    """A critic-free GRPO program with dynamic sampling (3 rounds of 4 prompts x 4 samples for 4 groups) and a
    traced reward, on ``mesh`` (None: one device)."""

    from ppojax.models import CausalLM
    from ppojax.rl.actor_critic import ActorCritic
    from ppojax.rl.optimizer import make_optimizer
    from ppojax.rl.program import PPOProgram
    from ppojax.rl.rewards import TracedScores
    from ppojax.rl.settings import StepSettings
    from tests.tiny_setup import tiny_config

    config = PPOConfig(batch_size=16, response_length=6, max_prompt_length=6, learning_rate=1e-2, temperature=1.0,
                       num_ppo_epochs=2, num_mini_batches=2, num_generations=4, advantage_estimator="grpo",
                       kl_coef=0.0, kl_loss_coef=0.04, filter_groups=True, max_num_gen_batches=3)
    settings = StepSettings.from_config(config, pad_token_id=0, stop_token_id=1, eos_token_id=1, num_updates=3,
                                        data_parallel_size=data_parallel)
    policy_def = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(tiny_config(), rngs=nnx.Rngs(0))))
    actor_critic = ActorCritic(policy_def, None, 0, 1.0, has_critic=False)
    return PPOProgram(actor_critic, TracedScores(steady_on_even_endings), settings, make_optimizer(), mesh)


def critic_free_state(program, seed=0, learning_rate=1e-2):

    from ppojax.models import CausalLM
    from ppojax.rl.settings import Hyperparams
    from ppojax.rl.types import init_train_state
    from tests.tiny_setup import tiny_config

    policy = nnx.state(CausalLM(tiny_config(), rngs=nnx.Rngs(params=jax.random.key(seed))))
    return init_train_state({"policy": policy}, program.optimizer,
                            hyperparams=Hyperparams.create(learning_rate=learning_rate),
                            frozen={"ref": jax.tree.map(jnp.copy, policy), "reward": None})


#: per update, per round, which of its 4 prompts end with an odd token id (so that their groups count): the
#: first update fills in one round, the second in two, the third in three
ODD_ENDINGS = [[[1, 1, 1, 1], [1, 0, 0, 1], [0, 0, 0, 0]],
               [[0, 1, 0, 1], [1, 0, 1, 0], [1, 1, 1, 1]],
               [[1, 0, 0, 0], [0, 0, 1, 0], [1, 1, 0, 1]]]


def round_prompts(steps=3):
    """i32[steps, 3, 4, 6]: each update's 3 rounds of 4 left-padded prompts, all different, ending as
    ``ODD_ENDINGS`` says."""
    from ppojax.trainer.data import left_pad

    tok = tiny_tokenizer()
    ids = left_pad([tok(p)["input_ids"] for p in PROMPTS], 6, 0)
    by_parity = {parity: iter(ids[ids[:, -1] % 2 == parity]) for parity in (0, 1)}
    return jnp.asarray([[[next(by_parity[odd]) for odd in round_] for round_ in update]
                        for update in ODD_ENDINGS[:steps]])


def test_scanned_updates_equal_the_steps_one_by_one_in_one_program():
    from ppojax.rl.program import make_train_step, make_train_steps
    from ppojax.trainer.loop import step_key

    program = program_with_dynamic_sampling()
    prompts, keys = round_prompts(3), jnp.stack([step_key(0, i) for i in range(3)])
    step, state, one_by_one = make_train_step(program), critic_free_state(program), []
    for i in range(3):
        state, metrics = step(state, prompts[i], keys[i])
        one_by_one.append(jax.device_get(metrics))
    assert step.jitted._cache_size() == 1
    assert [int(m["dynamic_sampling/rounds"]) for m in one_by_one] == [1, 2, 3]  # one program for each
    assert [int(m["dynamic_sampling/groups_dropped"]) for m in one_by_one] == [0, 4, 7]
    assert all(m["dynamic_sampling/batch_full"] == 1 for m in one_by_one)
    scanned_state, scanned = make_train_steps(program)(critic_free_state(program), prompts, keys)
    for i, metrics in enumerate(one_by_one):
        for name, value in metrics.items():
            np.testing.assert_allclose(scanned[name][i], value, rtol=1e-5, atol=1e-6, err_msg=f"{i}: {name}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), scanned_state.params,
                 state.params)
    with pytest.raises(ValueError, match=r"prompts of shape \(4, 6\): with dynamic sampling \(filter_groups\) a step "
                                         r"takes the prompts of every round it may sample, \[max_num_gen_batches=3"):
        step(state, prompts[0, 0], keys[0])


# ------------------------------------------------------------------------------------------------------------
# Whole tiny runs
# ------------------------------------------------------------------------------------------------------------
WHOLE_RUN = pytest.mark.slow  # PPOTrainer runs: left out of the fast lane (tests/conftest.py)
RUN = dict(report_to="none", batch_size=16, num_generations=4, advantage_estimator="grpo", response_length=8,
           max_prompt_length=6, learning_rate=1e-2, temperature=1.0, num_sample_generations=0, seed=0,
           stop_token="eos", filter_groups=True, max_num_gen_batches=3, total_episodes=16 * 4)
DATASET = [{"prompt": p, "steady": i % 3 == 0, "index": i} for i, p in enumerate(PROMPTS)]


def recorded_reward(steady_rows=None):
    """A reward constant (0.5) on the 'steady' prompts (or those ``steady_rows(index)`` says), else the
    completion's distinct words / 8, which the samples of a prompt rarely share; each call's rows, scores and
    completions are kept in ``.calls``."""
    calls = []

    def distinct_words(prompts, completions, steady, index, **columns):
        if steady_rows is not None:
            steady = [steady_rows(i) for i in index]
        scores = [0.5 if s else len(set(c.split())) / 8 for s, c in zip(steady, completions)]
        calls.append(dict(index=list(index), scores=scores, completions=list(completions)))
        return scores

    distinct_words.calls = calls
    return distinct_words


def run_for(tmp_path, name, updates=None, steady_rows=None, **values):
    reward = recorded_reward(steady_rows)
    config = PPOConfig.from_dict({**RUN, "output_dir": str(tmp_path / name), **values})
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), reward_funcs=[reward],
                         train_dataset=DATASET)
    return trainer, trainer.train(num_updates=updates, progress=False), reward.calls


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run every other is compared with: 4 updates of 4 prompts x 4 samples, rounds of 4 prompts."""
    return run_for(tmp_path_factory.mktemp("straight"), "run")


def reference_updates(history, calls, group_size=4, groups_wanted=4):
    """Per update, from the reward's own calls (one a round): the rounds it used (its metric), the kept groups'
    mean score, the groups dropped and the mean score of every row sampled (the reference selection)."""
    out, first = [], 0
    for metrics in history:
        rounds = int(metrics["dynamic_sampling/rounds"])
        scores = [c["scores"] for c in calls[first:first + rounds]]
        first += rounds
        groups = [s[i:i + group_size] for s in scores for i in range(0, len(s), group_size)]
        informative = [g for g in groups if max(g) > min(g)]
        kept = informative[:groups_wanted]
        out.append(dict(kept=len(kept), dropped=len(groups) - len(informative),
                        kept_score=float(np.mean(kept)) if kept else np.nan, sampled_score=float(np.mean(groups)),
                        rounds=rounds))
    assert first == len(calls)  # every call belongs to a round an update used
    return out


@WHOLE_RUN
def test_a_run_fills_every_batch_and_reports_what_it_cost(straight):
    trainer, history, calls = straight
    assert len(history) == 4 and trainer.train_step.jitted._cache_size() == 1  # one program, whatever the rounds
    expected = reference_updates(history, calls)
    assert sum(e["dropped"] for e in expected) > 0 and max(e["rounds"] for e in expected) > 1  # refills happened
    for metrics, want in zip(history, expected):
        assert want["kept"] == 4 and metrics["dynamic_sampling/batch_full"] == 1
        assert metrics["dynamic_sampling/filled_fraction"] == 1
        assert metrics["dynamic_sampling/groups_dropped"] == want["dropped"]
        assert metrics["dynamic_sampling/generated_over_trained"] == want["rounds"]  # rounds x 16 rows / 16
        np.testing.assert_allclose(metrics["objective/scores"], want["kept_score"], rtol=1e-6)
        np.testing.assert_allclose(metrics["dynamic_sampling/sampled_scores"], want["sampled_score"], rtol=1e-6)
        assert metrics["ppo/skipped_steps"] == 0 and np.isfinite(metrics["loss/policy_avg"])
    # the rounds took the data's batches in order, each prompt sampled num_generations times: none skipped
    order = PromptBatches(np.zeros((len(PROMPTS), 1)), batch_size=4, seed=0)
    rounds = sum(e["rounds"] for e in expected)
    seen = [i for call in calls for i in call["index"][::4]]
    assert seen == [i for _ in range(rounds) for i in next(order).indices]
    assert all(call["index"] == list(np.repeat(call["index"][::4], 4)) for call in calls)
    state = trainer.run.batches.state_dict()
    assert state["epoch"] * trainer.run.batches.batches_per_epoch + state["position"] == rounds


@WHOLE_RUN
def test_the_first_round_samples_what_a_run_without_it_samples(tmp_path, straight):
    _, _, calls = straight
    _, plain_history, plain_calls = run_for(tmp_path, "plain", updates=1, filter_groups=False)
    assert plain_calls[0]["completions"] == calls[0]["completions"] and plain_calls[0]["index"] == calls[0]["index"]
    # the decode loop's occupancy (the rounds' work summed): with one round at most, the run without it's
    _, one_round, _ = run_for(tmp_path, "one_round", updates=1, max_num_gen_batches=1)
    assert one_round[0]["dynamic_sampling/rounds"] == 1
    assert one_round[0]["sampling/slot_occupancy"] == plain_history[0]["sampling/slot_occupancy"] < 1


COMPARED = ("objective/scores", "loss/policy_avg", "objective/kl", "lr", "dynamic_sampling/rounds",
            "dynamic_sampling/groups_dropped", "dynamic_sampling/sampled_scores")


@WHOLE_RUN
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, straight):
    """The rounds an update used are part of the data position a checkpoint keeps."""
    trainer, history, calls = straight
    first, _, first_calls = run_for(tmp_path, "b", updates=2, save_steps=2)
    resumed, got, resumed_calls = run_for(tmp_path, "b", resume="auto")
    assert int(resumed.state.update_count) == 4 and len(got) == 2
    for a, b in zip(history[2:], got):
        for name in COMPARED:
            assert a[name] == b[name], name
    assert first_calls + resumed_calls == calls  # the same prompts, the same completions
    jax.tree.map(np.testing.assert_array_equal, trainer.state.params, resumed.state.params)
    assert resumed.run.batches.state_dict() == trainer.run.batches.state_dict()


@WHOLE_RUN
@pytest.mark.parametrize("values", [dict(padding_free=True), dict(rollout_slots=8)], ids=["padding_free",
                                                                                          "rollout_slots"])
def test_packed_updates_and_continuous_decoding_give_the_same_run(tmp_path, straight, values):
    _, history, calls = straight
    trainer, got, got_calls = run_for(tmp_path, "variant", updates=2, **values)
    assert trainer.train_step.jitted._cache_size() == 1
    assert got_calls == calls[:len(got_calls)]  # the same rounds, the same samples
    for a, b in zip(history, got):
        for name in COMPARED:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, atol=1e-6, err_msg=name)


@WHOLE_RUN
def test_overlong_filtering_with_it(tmp_path):
    """mask_truncated_completions and the soft overlong punishment with dynamic sampling, the groups judged by the
    reward alone (filter_groups_metric, as DAPO's recipe judges by accuracy: the penalty, which differs with the
    lengths, would make the steady prompts' groups count): a group is dropped when the reward's values are equal
    or every response of it was cut off (counted apart)."""
    trainer, history, calls = run_for(tmp_path, "overlong", updates=3, mask_truncated_completions=True,
                                      soft_punish_cache=4, max_num_gen_batches=4,
                                      filter_groups_metric="distinct_words")
    for metrics, want in zip(history, reference_updates(history, calls)):
        truncated, dropped = (metrics[f"dynamic_sampling/{n}"] for n in ("groups_all_truncated", "groups_dropped"))
        assert want["dropped"] <= dropped <= want["dropped"] + truncated
        assert metrics["dynamic_sampling/batch_full"] == 1 and metrics["ppo/skipped_steps"] == 0
        assert np.isfinite(metrics["loss/policy_avg"]) and 0 <= metrics["objective/truncated_fraction"] < 1
    assert sum(m["dynamic_sampling/groups_all_truncated"] for m in history) > 0
    assert trainer.train_step.jitted._cache_size() == 1


@WHOLE_RUN
def test_when_the_bound_stops_it_the_update_trains_what_it_kept(tmp_path):
    """Few prompts whose samples differ: some updates keep part of a batch (their other rows are dropped groups,
    out of the loss), some none (no optimizer step: Adam's moments alone would move the weights); the run goes on
    with finite metrics."""
    trainer, history, calls = run_for(tmp_path, "bound", updates=4, max_num_gen_batches=2,
                                      steady_rows=lambda i: i % 8 != 1)
    steps = trainer.run.settings.optim.steps_per_update
    filled = [m["dynamic_sampling/filled_fraction"] for m in history]
    assert 0 in filled and any(0 < f < 1 for f in filled)
    for metrics, want in zip(history, reference_updates(history, calls)):
        assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/batch_full"] == 0
        assert metrics["dynamic_sampling/filled_fraction"] == want["kept"] / 4
        assert metrics["ppo/skipped_steps"] == (steps if want["kept"] == 0 else 0)
        assert metrics["ppo/nonfinite_steps"] == 0 and np.isfinite(metrics["objective/scores"])
        assert np.isnan(metrics["dynamic_sampling/generated_over_trained"]) == (want["kept"] == 0)
    assert int(trainer.state.update_count) == 4
    assert int(trainer.state.optimizer_steps) == steps * sum(f > 0 for f in filled)


def test_a_metric_naming_no_reward_is_refused_at_the_build(tmp_path):
    with pytest.raises(ConfigError, match="filter_groups_metric='acc' names none of this run's rewards "
                                          "\\(distinct_words\\)"):
        run_for(tmp_path, "unknown metric", filter_groups_metric="acc")


@WHOLE_RUN
def test_the_legacy_step_is_refused(straight):
    trainer, _, _ = straight
    with pytest.raises(ConfigError, match="step\\(\\) trains on the responses and scores it is given, but "
                                          "filter_groups=True"):
        trainer.step([[2, 3]] * 16, [[4, 5]] * 16, [0.0] * 16)
