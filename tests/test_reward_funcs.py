"""Verifiable rewards: the answer checker, reward functions called as TRL's GRPOTrainer calls them (keyword
arguments, dataset columns, None, weights, per-function metrics), concurrency, and the arithmetic task."""
import asyncio
import json
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax.errors import ConfigError, RewardFunctionError
from ppojax.agents.calls import call
from ppojax.host import event_loop
from ppojax.rl.reward_calls import RewardBatch, RewardCall, call_all
from ppojax.rl.rewards import TracedScores
from ppojax.tasks import arithmetic
from ppojax.tasks.math_answers import answer_format, extract_answer, gsm8k_flexible, gsm8k_strict, boxed_answer
from ppojax.trainer.config import PPOConfig


# ------------------------------------------------------------------------------------------ the checker
@pytest.mark.parametrize("completion, reference, strict, flexible", [
    ("3 + 4 = 7.\n#### 7", "7", 1.0, 1.0),
    ("So the answer is 7.", "7", 0.0, 1.0),                       # right number, no format
    ("#### 7\nbut then 8", "7", 1.0, 0.0),                        # strict reads the marker, flexible the last number
    ("#### -12", "-12", 1.0, 1.0),                                # negative
    ("10 - 4 = 6", "-4", 0.0, 0.0),                               # subtraction is not a negative number
    ("#### 1,234", "1234", 1.0, 1.0),                             # thousands separators
    ("It costs $1,000.", "#### 1000", 0.0, 1.0),                  # dollar sign, full stop; GSM8K-style reference
    ("#### 2.50", "2.5", 1.0, 1.0),                               # decimals compare as numbers
    ("#### 2.51", "2.5", 0.0, 0.0),
    ("I do not know.", "3", 0.0, 0.0),                            # no answer at all
    ("#### 5 ... #### 6", "6", 1.0, 1.0),                         # the last marker counts
    ("Natalia sold 24 clips.\n#### 72", "She sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0, 1.0),
])
def test_the_numeric_answer_checker_on_hand_written_cases(completion, reference, strict, flexible):
    assert gsm8k_strict([completion], answer=[reference]) == [strict]
    assert gsm8k_flexible([completion], answer=[reference]) == [flexible]
    assert answer_format([completion]) == [float(extract_answer(completion, "strict") is not None)]


def test_boxed_answers_and_rows_without_a_reference():
    assert boxed_answer([r"so \boxed{\frac{1}{2}} then \boxed{42}", r"\boxed{41}", "42"], answer=["42"] * 3) == \
        [1.0, 0.0, 0.0]
    assert extract_answer(r"\boxed{x^{2}}", "boxed") == "x^{2}"      # nested braces
    assert gsm8k_strict(["#### 3", "#### 3"], answer=["3", None]) == [1.0, None]  # None: the reward does not apply
    assert gsm8k_strict(["#### 3"], solution=["3"]) == [1.0]  # TRL's column name works too
    with pytest.raises(KeyError, match="answer"):
        gsm8k_strict(["#### 3"], question=["q"])


# ------------------------------------------------------------------------------------------ calling conventions
def _batch():
    return RewardBatch(prompts=["p0", "p1"], completions=["c0", "c1"], completion_ids=[[5], [6, 7]],
                       columns={"answer": ["a0", "a1"], "level": [1, 2]})


def test_functions_receive_what_their_signatures_name():
    seen = {}

    def takes_all(completions, **kwargs):
        seen["all"] = dict(kwargs, completions=completions)
        return [1.0, 2.0]

    def takes_some(completions, answer):
        seen["some"] = (completions, answer)
        return [0.0, 1.0]

    def per_sample(completion, answer, completion_ids):
        return float(len(completion_ids)) + (0.5 if answer == "a1" else 0.0)

    def positional(p, c):  # ppojax's older convention: (prompts, completions) under any names
        return [float(x == "p1") for x in p]

    async def batched_async(prompts, completions, level):
        await asyncio.sleep(0)
        return [float(v) for v in level]

    async def per_sample_async(prompt, level):
        await asyncio.sleep(0)
        return None if level == 1 else 3.0

    fns = [takes_all, takes_some, per_sample, positional, batched_async, per_sample_async]
    calls = [RewardCall.of(f) for f in fns]
    assert [c.per_sample for c in calls] == [False, False, True, False, False, True]
    assert [c.is_async for c in calls] == [False, False, False, False, True, True]
    results = call_all(calls, _batch())
    assert results == [[1.0, 2.0], [0.0, 1.0], [1.0, 2.5], [0.0, 1.0], [1.0, 2.0], [None, 3.0]]
    assert seen["all"] == {"prompts": ["p0", "p1"], "completions": ["c0", "c1"], "completion_ids": [[5], [6, 7]],
                           "answer": ["a0", "a1"], "level": [1, 2]}
    assert seen["some"] == (["c0", "c1"], ["a0", "a1"])
    assert [c.name for c in calls] == [f.__name__ for f in fns]  # the metric names, as TRL's


def test_a_function_needing_a_column_the_dataset_lacks_is_named_with_the_fix():
    def needs_solution(completions, solution):
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"needs_solution needs 'solution'.*has \['answer', 'level'\]"):
        RewardCall.of(needs_solution).check_arguments(["answer", "level"])
    RewardCall.of(needs_solution).check_arguments(["solution"])


def test_errors_name_the_function_and_the_row():
    def breaks_on_row_1(completion):
        if completion == "c1":
            raise ZeroDivisionError("boom")
        return 1.0

    with pytest.raises(RewardFunctionError, match=r"breaks_on_row_1 raised ZeroDivisionError: boom on row 1 "
                                                  r"\(prompt 'p1', completion 'c1'\)"):
        call_all([RewardCall.of(breaks_on_row_1)], _batch())


def test_the_functions_of_a_batch_run_at_the_same_time():
    """Two synchronous functions that can only finish together (a two-party barrier), and an async per-sample
    function whose rows can only finish together: serialised calls would time out instead."""
    barrier = threading.Barrier(2, timeout=10)

    def first(completions):
        barrier.wait()
        return [1.0] * len(completions)

    def second(completions):
        barrier.wait()
        return [2.0] * len(completions)

    arrived = []

    async def rows_together(completion):
        arrived.append(completion)
        for _ in range(1000):
            if len(arrived) == 2:
                return 3.0
            await asyncio.sleep(0.01)
        raise TimeoutError("the rows were not awaited together")

    results = call_all([RewardCall.of(f) for f in (first, second, rows_together)], _batch())
    assert results == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


# ------------------------------------------------------------------------------------------ sources
class _Words:
    """A tokenizer stand-in: id i decodes to 'w<i>'; 0 is padding."""
    all_special_ids = [0]

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(f"w{t}" for t in row if t != 0) for row in rows]


def test_weighted_sum_of_python_and_traced_rewards_skips_those_that_do_not_apply():
    from ppojax.rl.rewards import ColumnTable, FunctionScores, PADDING_ROW, TracedScores, WeightedRewards

    table = ColumnTable({"target": ["w3", "w4", "w9"]})

    def hits(completions, target):  # needs the column; None where the target is w9
        return [None if t == "w9" else float(t in c.split()) for c, t in zip(completions, target)]

    def length(completion_ids):
        return [float(len(ids)) for ids in completion_ids]

    def first_token(queries, responses):
        return responses[:, 0].astype(jnp.float32)

    reward = WeightedRewards([FunctionScores([hits, length], _Words(), 0, table=table, sole=False),
                              TracedScores(first_token)], weights=[2.0, 0.5, -1.0])
    queries = jnp.array([[1, 2], [1, 2], [1, 2], [1, 2]], jnp.int32)
    responses = jnp.array([[3, 5, 0], [7, 0, 0], [4, 4, 4], [9, 9, 0]], jnp.int32)
    rows = jnp.array([0, 1, 2, PADDING_ROW], jnp.int32)
    out = jax.jit(lambda q, r, k: reward.scores(None, q, r, k))(queries, responses, rows)
    hit = np.array([1.0, 0.0, np.nan, 0.0])  # row 2's target is w9: not applicable; row 3 is padding (0)
    lengths = np.array([2.0, 1.0, 3.0, 0.0])
    first = np.array([3.0, 7.0, 4.0, 9.0])
    expected = np.nansum(np.stack([2.0 * hit, 0.5 * lengths, -1.0 * first]), axis=0)
    np.testing.assert_allclose(np.asarray(out.scores), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.components["hits"]), hit)
    assert set(out.components) == {"hits", "length", "first_token"} and int(out.failures) == 0


def test_a_row_that_no_reward_applies_to_is_an_error_naming_it():
    from ppojax.rl.rewards import FunctionScores

    def only_even(completion_ids):
        return [1.0 if i % 2 == 0 else None for i in range(len(completion_ids))]

    source = FunctionScores(only_even, _Words(), 0)
    with pytest.raises(RewardFunctionError, match=r"only_even returned None for row 1 \(prompt 'w1'"):
        source.host_components(np.array([[1], [1], [1]]), np.array([[2], [3], [4]]))


# ------------------------------------------------------------------------------------------ through the trainer
def _records():
    from tests.tiny_setup import PROMPTS, WORDS

    prompts = list(dict.fromkeys(PROMPTS))  # unique, so a prompt's text names its row
    return [{"prompt": p, "target": WORDS[i % 5], "level": i % 3} for i, p in enumerate(prompts)]


CALLS = []


def target_hit(prompts, completions, prompt, target, **kwargs):
    CALLS.append(("target_hit", list(prompt), list(target), list(completions)))
    return [float(t in c.split()) for c, t in zip(completions, target)]


def short(completions, level):
    """Shorter is better; does not apply to level-0 prompts."""
    CALLS.append(("short", None, list(level), list(completions)))
    return [None if lv == 0 else -float(len(c.split())) for c, lv in zip(completions, level)]


def _trainer(tmp_path, **overrides):
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.tiny_setup import tiny_policy, tiny_tokenizer

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    config = PPOConfig.from_dict(dict(
        output_dir=str(tmp_path / "run"), report_to="none", dataset=str(tmp_path / "data.jsonl"),
        reward_funcs=["tests.test_reward_funcs:target_hit", "tests.test_reward_funcs:short"],
        reward_weights=[2.0, 0.25], batch_size=8, num_generations=2, advantage_estimator="grpo",
        response_length=5, max_prompt_length=6, total_episodes=16, num_eval_prompts=6, num_sample_generations=0,
        stop_token="eos", seed=0, **overrides))
    return PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy())


def test_reward_funcs_get_their_rows_columns_and_the_weighted_sum_is_the_score(tmp_path):
    CALLS.clear()
    trainer = _trainer(tmp_path)
    history = trainer.train(num_updates=2, progress=False)
    by_prompt = {r["prompt"]: r for r in _records()}
    hits = [c for c in CALLS if c[0] == "target_hit"]
    shorts = [c for c in CALLS if c[0] == "short"]
    assert len(hits) == len(shorts) == 2  # one call per function per update
    for update, (hit_call, short_call) in enumerate(zip(hits, shorts)):
        _, prompts, targets, completions = hit_call
        assert len(prompts) == 8 and prompts[0::2] == prompts[1::2]  # 4 prompts x 2 generations, in groups
        assert targets == [by_prompt[p]["target"] for p in prompts]  # each row's own column value
        assert short_call[2] == [by_prompt[p]["level"] for p in prompts]
        hit = np.array([float(t in c.split()) for c, t in zip(completions, targets)])
        brief = np.array([np.nan if by_prompt[p]["level"] == 0 else -len(c.split())
                          for p, c in zip(prompts, completions)])
        metrics = history[update]
        np.testing.assert_allclose(metrics["rewards/target_hit/mean"], hit.mean(), rtol=1e-6)
        np.testing.assert_allclose(metrics["rewards/target_hit/std"], hit.std(ddof=1), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(metrics["rewards/short/mean"], np.nanmean(brief), rtol=1e-6)
        np.testing.assert_allclose(metrics["rewards/short/std"], np.nanstd(brief, ddof=1), rtol=1e-5)
        score = 2.0 * hit + np.where(np.isnan(brief), 0.0, 0.25 * brief)
        np.testing.assert_allclose(metrics["objective/scores"], score.mean(), rtol=1e-5)

    CALLS.clear()
    result = trainer.evaluate(step=0)  # held-out rows get their own columns too
    assert set(result["rewards"]) == {"target_hit", "short"}
    (_, prompts, targets, completions), = [c for c in CALLS if c[0] == "target_hit"]
    assert len(prompts) == 6  # the padding rows of the last sampler batch are not shown to the functions
    assert targets == [by_prompt[p]["target"] for p in prompts]
    assert prompts == [r["prompt"] for r in _records()[-6:]]
    expected = np.mean([float(t in c.split()) for c, t in zip(completions, targets)])
    np.testing.assert_allclose(result["rewards"]["target_hit"], expected)


def test_a_reward_function_needing_a_missing_column_stops_the_build(tmp_path):
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none",
                                      reward_funcs=["tests.test_reward_funcs:target_hit"], batch_size=8,
                                      response_length=4, max_prompt_length=6, total_episodes=8))
    with pytest.raises(ConfigError, match=r"target_hit needs 'prompt', 'target'"):
        PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), train_dataset=PROMPTS)


def test_a_missing_eval_dataset_is_named_by_its_field(tmp_path):
    """eval_dataset naming no file stops the build before any model is used, as eval_dataset (not "prompt
    dataset": the training prompts were found)."""
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", reward_funcs=["vader"],
                                      batch_size=8, response_length=4, max_prompt_length=6, total_episodes=8,
                                      eval_dataset=str(tmp_path / "held_out.jsonl"), num_eval_prompts=2))
    with pytest.raises(ConfigError, match=r"^eval_dataset '.*held_out.jsonl' is not a local file or folder"):
        PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), train_dataset=PROMPTS)


def test_reward_config_mistakes_are_named():
    with pytest.raises(ConfigError, match=r"reward_weights=\[1.0\] has 1 weights for 2 rewards \(a, b\)"):
        PPOConfig.from_dict(dict(reward_funcs=["m:a", "m:b"], reward_weights=[1.0]))
    with pytest.raises(ConfigError, match="Both reward_funcs"):
        PPOConfig.from_dict(dict(reward_funcs=["m:a"], reward_function="vader"))
    with pytest.raises(ConfigError, match="reward_funcs"):
        PPOConfig.from_dict(dict(reward_funcs=["not a spec"]))
    with pytest.raises(ConfigError, match="num_eval_prompts=0"):
        PPOConfig.from_dict(dict(eval_dataset="arithmetic:test"))
    config = PPOConfig.from_dict(dict(reward_funcs=["gsm8k_strict", "m:fmt"], reward_weights=["1", 0.5]))
    assert config.reward_weights == [1.0, 0.5] and config.reward_names == ["gsm8k_strict", "fmt"]


# ------------------------------------------------------------------------------------------ data
def test_every_file_format_brings_its_columns(tmp_path):
    import pandas as pd

    from ppojax.trainer.prompt_sources import load_prompt_table

    records = [{"prompt": "two plus two", "answer": "4"}, {"prompt": [{"role": "user", "content": "hi"}],
                                                            "answer": "0"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts, columns = load_prompt_table(str(tmp_path / "d.jsonl"))
    assert prompts == [r["prompt"] for r in records] and columns["answer"] == ["4", "0"]
    flat = records[:1] * 2
    pd.DataFrame(flat).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(flat).to_parquet(tmp_path / "d.parquet")
    for name in ("d.csv", "d.parquet"):
        prompts, columns = load_prompt_table(str(tmp_path / name))
        assert prompts == ["two plus two"] * 2 and columns == {"prompt": prompts, "answer": ["4", "4"]}
    import datasets
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "hf"))
    assert load_prompt_table(str(tmp_path / "hf"))[1]["answer"] == ["4", "4"]


def test_the_arithmetic_task_is_seeded_split_and_answered_right(tmp_path):
    first = list(arithmetic.problems(3, 50))
    assert first == list(arithmetic.problems(3, 50)) and first != list(arithmetic.problems(4, 50))
    train, test = arithmetic.write_splits(tmp_path, seed=1, train=300, test=40)
    train_rows = [json.loads(line) for line in train.read_text().splitlines()]
    test_rows = [json.loads(line) for line in test.read_text().splitlines()]
    assert len(train_rows) == 300 and len(test_rows) == 40
    assert not {r["question"] for r in train_rows} & {r["question"] for r in test_rows}
    assert {r["kind"] for r in train_rows} == set(arithmetic.KINDS)
    for r in train_rows + test_rows:
        numbers = [int(n) for n in re.findall(r"\d+", r["question"])]
        expected = {"add": lambda a, b: a + b, "take_away": lambda a, b: a - b, "groups": lambda a, b: a * b,
                    "two_steps": lambda a, b, c: a + b - c}[r["kind"]](*numbers)
        assert r["answer"].endswith(f"#### {expected}") and expected >= 0
        assert gsm8k_strict([f"#### {expected}"], answer=[r["answer"]]) == [1.0]
        assert r["prompt"].endswith(arithmetic.INSTRUCTION)


def test_a_traced_reward_sums_with_python_functions_in_the_users_order(tmp_path):
    """reward_funcs=[traced, python] with weights in that order: the JAX reward stays in the program, and the score
    is the weighted sum of both (recomputed from the completions the Python function saw)."""
    from ppojax.rl.rewards import TracedScores
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

    seen = []

    def words(completions):
        seen.append(list(completions))
        return [float(len(c.split())) for c in completions]

    def good_tokens(queries, responses):  # id 2 is "good"
        return jnp.sum(responses == 2, axis=1).astype(jnp.float32)

    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=8,
                                      response_length=5, max_prompt_length=6, total_episodes=8,
                                      reward_weights=[3.0, 0.5], num_sample_generations=0, stop_token="eos", seed=0))
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), train_dataset=PROMPTS,
                         reward_funcs=[TracedScores(good_tokens), words])
    metrics = trainer.train(num_updates=1, progress=False)[0]
    (completions,) = seen
    good = np.array([c.split().count("good") for c in completions], float)
    n_words = np.array([len(c.split()) for c in completions], float)
    np.testing.assert_allclose(metrics["rewards/good_tokens/mean"], good.mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics["objective/scores"], (3.0 * good + 0.5 * n_words).mean(), rtol=1e-5)


def test_a_reward_function_that_cannot_be_had_is_named_by_its_field():
    """A function listed in reward_funcs that cannot be imported, or is no function, is reported as that list's
    entry (the field the user wrote), with the fix; one named by reward_function as that field."""
    from ppojax.trainer.run_rewards import resolve_reward_function

    with pytest.raises(ConfigError, match=r"reward_funcs entry 'no_such_module_xyz:score' could not be imported "
                                          r"\(ModuleNotFoundError.*check that the module is on PYTHONPATH"):
        resolve_reward_function("no_such_module_xyz:score", "reward_funcs")
    with pytest.raises(ConfigError, match=r"reward_function='math:pi' is a float, not a function"):
        resolve_reward_function("math:pi", "reward_function")


def test_async_rewards_tools_and_environments_share_one_event_loop():
    """A client an environment opens on the loop in `reset` stays usable by an async reward function or tool: they
    are all awaited on the process's one loop (ppojax.host), not one loop per layer."""
    loops = []

    async def reward(completions):
        loops.append(asyncio.get_running_loop())
        return [0.0] * len(completions)

    async def tool():
        return asyncio.get_running_loop()

    call_all([RewardCall.of(reward)], _batch())
    assert call(tool) is loops[0] is event_loop()


def _first_token_is_even(queries, responses):
    return (responses[:, 0] % 2 == 0).astype(jnp.float32)


#: a JAX reward whose own name differs from the module attribute a config names it by
parity_reward = TracedScores(_first_token_is_even, name="even_first_token")


def test_a_traced_reward_named_by_a_spec_reports_under_the_specs_name(tmp_path):
    """'module:name' naming a TracedScores that calls itself something else: the run's source is named after
    the spec, as a function is and as config.reward_names (reward_weights' messages) says; the user's object keeps
    its own name."""
    from ppojax.trainer.run_rewards import reward_calls_of

    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none",
                                      reward_funcs=["tests.test_reward_funcs:parity_reward"]))
    calls, traced, _ = reward_calls_of(config, None, None)
    assert calls == [] and traced[0].names == config.reward_names == ["parity_reward"]
    assert parity_reward.names == ["even_first_token"]
    ids = jnp.asarray([[3, 4], [5, 7]])
    np.testing.assert_array_equal(traced[0].components(None, ids, ids)[0], [[0.0, 0.0]])
    np.testing.assert_array_equal(traced[0].components(None, ids, ids[:, ::-1])[0], [[1.0, 0.0]])


def test_a_traced_reward_named_in_the_config_runs_in_the_program_and_equals_its_python_twin(tmp_path):
    """reward_funcs entries 'module:name' naming a TracedScores (configs/tiny.yaml's reward) are traced into the
    program; the JAX reward on the ids equals the Python function on the decoded texts, row by row."""
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from ppojax.trainer.run_rewards import reward_calls_of
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

    specs = ["tests.test_cli:good_fraction_of_ids", "tests.test_cli:good_fraction"]
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=16,
                                      response_length=6, max_prompt_length=6, total_episodes=16, reward_funcs=specs,
                                      reward_weights=[1.0, 0.0], num_sample_generations=0, stop_token="eos",
                                      temperature=1.0, seed=0))
    calls, traced, order = reward_calls_of(config, None, None)
    assert [c.name for c in calls] == ["good_fraction"] and traced[0].names == ["good_fraction_of_ids"]
    assert order == [1, 0]
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), train_dataset=PROMPTS)
    metrics = trainer.train(num_updates=1, progress=False)[0]
    assert metrics["rewards/good_fraction/mean"] > 0  # some completions hold "good": the comparison has content
    np.testing.assert_allclose(metrics["rewards/good_fraction_of_ids/mean"], metrics["rewards/good_fraction/mean"],
                               rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/good_fraction_of_ids/std"], metrics["rewards/good_fraction/std"],
                               rtol=1e-5)
    np.testing.assert_allclose(metrics["objective/scores"], metrics["rewards/good_fraction/mean"], rtol=1e-6)
