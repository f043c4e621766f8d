"""Agent runs end to end (tools / environment_factory in the config): a tiny random model plays guess-the-number
(ppojax.tasks.guess_number) through PPOTrainer, with a word-level tokenizer whose vocabulary holds the game's
words, so that its turns end at the end-of-turn token often enough for multi-turn episodes.

- the updates train on multi-turn episodes (turns > 1, environment tokens in the streams), one compiled program,
  with one cache row per episode or fewer rows refilled as episodes end (``rollout_slots``);
- the environment's reward is a reward of the run (logged as rewards/GuessNumber/mean), equal to a plain replay of
  the games in the sampled episodes;
- evaluation and sample tables play whole episodes;
- an environment that raises stops the run naming the environment, the method and the row, and the last
  checkpoint stays;
- a run interrupted (SIGINT) while an environment steps an episode finishes the update, writes its checkpoint and
  stops; one killed (SIGKILL) there loses only the update in flight; resumed, each equals the run never
  interrupted (metrics and parameters);
- text an environment's reset returns is appended to the prompt (the G episodes of a prompt must agree, and the
  prompt must still fit);
- the calculator tool evaluates arithmetic and refuses anything else;
- the config refuses an agent run without a stop token or a chat template, and TRL's names are accepted.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ppojax.errors import ConfigError, EnvironmentCallError
from ppojax.models import CausalLM
from ppojax.rl import rollout
from ppojax.tasks.calculator import calculate
from ppojax.tasks.guess_number import GuessNumber
from ppojax import PPOConfig, PPOTrainer
from tests.kill_points import block_once_saved, wait_for_marker
from tests.tiny_setup import run_environment, tiny_config

REPO = Path(__file__).resolve().parents[1]

WORDS = (["<pad>", "<eos>", "?", "user", "assistant", "higher", "lower", "answer", "with", "one", "whole", "number",
          ".", "guess", "it", "i", "am"] + [str(n) for n in range(1, 17)])
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}assistant {% endif %}")


def game_tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="?"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="?")
    out.chat_template = TEMPLATE
    return out


def games(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": "guess one number", "target": int(t)} for t in rng.integers(1, 17, n)]


def config_for(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=16, num_generations=4,
                  advantage_estimator="grpo", response_length=40, max_prompt_length=12, learning_rate=1e-2,
                  temperature=1.0, kl_coef=0.0, total_episodes=16 * 3, num_sample_generations=0, seed=0,
                  chat_template=True, stop_token="eos", environment_factory="ppojax.tasks.guess_number:GuessNumber",
                  max_tool_calling_iterations=3, turn_length=6, observation_length=8, num_eval_prompts=4,
                  save_steps=1)
    values.update(overrides)
    return PPOConfig.from_dict(values)


def trainer_for(config, dataset):
    return PPOTrainer(config, processing_class=game_tokenizer(),
                      model=CausalLM(tiny_config(vocab_size=len(WORDS)), rngs=nnx.Rngs(0)), train_dataset=dataset)


@pytest.mark.parametrize("options", [{}, dict(padding_free=True, rollout_slots=8)], ids=["padded", "packed-slots"])
def test_an_environment_run_trains_on_multi_turn_episodes(tmp_path, options):
    """Padded, and packed with 8 cache rows playing the 16 episodes of a batch (rows refilled as episodes end)."""
    trainer = trainer_for(config_for(tmp_path, **options), games(40))
    history = trainer.train(progress=False)
    assert len(history) == 3
    assert max(m["episodes/turns"] for m in history) > 1.05  # some episodes took several turns
    assert all(m["episodes/environment_tokens"] > 0 for m in history)
    assert all(np.isfinite(m["loss/policy_avg"]) for m in history)
    assert "rewards/GuessNumber/mean" in history[-1]
    assert trainer.train_step.jitted._cache_size() == 1
    result = trainer.evaluate(step=3)  # whole episodes, scored by the environment
    assert set(result["reward_values"]) == {"GuessNumber"}
    assert all(0.0 <= v <= 1.0 for v in result["reward_values"]["GuessNumber"])


def test_the_environment_reward_is_the_games_outcome(tmp_path):
    """The rewards of sampled episodes against a replay of each game from the stream's text."""

    trainer = trainer_for(config_for(tmp_path, total_episodes=16), games(40))
    run = trainer.run
    rows = np.arange(16)
    queries = np.asarray(run.train_queries[:16])
    queries = run.agents.begin(rows, queries)
    played = rollout.episodes_jit(run.program, run.state.params, run.state.frozen, jnp.asarray(queries),
                                  jax.random.key(5), jnp.float32(1.0), jnp.int32(16))
    tok = game_tokenizer()
    targets = [games(40)[r]["target"] for r in rows]
    solved_any = 0
    for e in range(16):
        stream, env = np.asarray(played.stream[e]), np.asarray(played.environment_mask[e])
        # the model's turns: maximal runs of non-environment tokens before the first pad
        turns, current = [], []
        for token, is_env in zip(stream, env):
            if token == 0 and not is_env:
                break
            if is_env:
                if current:
                    turns.append(current)
                current = []
            else:
                current.append(int(token))
        if current:
            turns.append(current)
        stepped = [t[:-1] for t in turns if t[-1] == 1]  # a turn without the end-of-turn token is not a move
        guesses = [int(g) for g in (next((w for w in tok.decode(t).split() if w.isdigit()), None) for t in stepped)
                   if g is not None]
        closest = min(guesses, key=lambda g: abs(g - targets[e]), default=None)
        expected = (0.0 if closest is None else 1.0 if closest == targets[e]
                    else 0.5 * (1 - abs(closest - targets[e]) / 15))
        assert float(played.environment_reward[e]) == pytest.approx(expected), e
        solved_any += closest is not None
    assert played.turns.max() > 1 and solved_any >= 2  # games with guesses: the partial credit is checked


class Exploding:
    """A protocol environment whose step fails on the row whose target is 16."""

    def reset(self, target, **row):
        self.target = target

    def step(self, action):
        if self.target == 16:
            raise RuntimeError("boom")
        from ppojax.agents import Step
        return Step(None, None, True)

    def get_reward(self):
        return 0.0


def test_an_environment_that_raises_stops_the_run_naming_it(tmp_path, monkeypatch):
    import sys
    import types

    from ppojax.agents import Environment

    module = types.ModuleType("exploding_env_test")
    module.Exploding = type("Exploding", (Exploding, Environment), {})
    monkeypatch.setitem(sys.modules, "exploding_env_test", module)
    data = [{"prompt": "guess one number", "target": 3}] * 20 + [{"prompt": "guess one number", "target": 16}] * 20
    config = config_for(tmp_path, environment_factory="exploding_env_test:Exploding", total_episodes=16 * 6,
                        num_eval_prompts=0)
    trainer = trainer_for(config, data)
    with pytest.raises(EnvironmentCallError, match=r"environment Exploding\.step raised RuntimeError: boom on row"):
        trainer.train(progress=False)


class Hinting:
    """A protocol environment whose reset returns text to append to the prompt (TRL's reset semantics): the same
    for every episode of a row, or (``differ``) a different one per episode."""

    differ = False
    count = 0

    def reset(self, target, **row):
        Hinting.count += 1
        self.target = target
        if self.differ:
            return " with one" if Hinting.count % 2 else " with one number"
        return " answer with one whole number" if target % 2 else None

    def step(self, action):
        from ppojax.agents import Step
        return Step(None, None, True)

    def get_reward(self):
        return float(self.target % 2)


def hinting_module(monkeypatch, differ=False):
    import sys
    import types

    from ppojax.agents import Environment

    module = types.ModuleType("hinting_env_test")
    module.Hinting = type("Hinting", (Hinting, Environment), {"differ": differ})
    monkeypatch.setitem(sys.modules, "hinting_env_test", module)


def test_text_from_reset_is_appended_to_the_prompt_and_trained_on(tmp_path, monkeypatch):
    """TRL's reset: text it returns is appended to the last user message. The prompts played are the template's
    rendering of the new message (the others untouched), and a run trains with them."""
    hinting_module(monkeypatch)
    data = [{"prompt": "guess one number", "target": t} for t in (1, 2, 3, 4) * 10]
    trainer = trainer_for(config_for(tmp_path, environment_factory="hinting_env_test:Hinting", max_prompt_length=16,
                                     total_episodes=16), data)
    run, tok = trainer.run, game_tokenizer()
    queries = np.asarray(run.train_queries[:4])
    played = run.agents.begin(np.repeat(np.arange(4), 4), queries, group_size=4)
    targets = run.agents.table.rows(np.arange(4))["target"]
    assert sorted(t % 2 for t in targets) == [0, 0, 1, 1]
    for prompt in range(4):
        target = targets[prompt]
        text = "guess one number" + (" answer with one whole number" if target % 2 else "")
        expected = [WORDS.index(w) for w in f"user {text} <eos> assistant".split()]  # TEMPLATE, word by word
        real = [t for t in played[prompt].tolist() if t != tok.pad_token_id]
        assert real == expected, prompt
        if not target % 2:
            np.testing.assert_array_equal(played[prompt], queries[prompt])
    history = trainer.train(progress=False)
    assert len(history) == 1 and np.isfinite(history[0]["loss/policy_avg"])


def test_text_from_reset_that_cannot_be_one_prompt_is_refused(tmp_path, monkeypatch):
    data = [{"prompt": "guess one number", "target": t} for t in (1, 2, 3, 4) * 10]
    hinting_module(monkeypatch)
    trainer = trainer_for(config_for(tmp_path, environment_factory="hinting_env_test:Hinting",
                                     max_prompt_length=8), data)
    with pytest.raises(ConfigError, match=r"prompt row 0 with the text hinting_env_test:Hinting.reset appended has "
                                          r"\d+ tokens, more than max_prompt_length=8"):
        trainer.run.agents.begin(np.repeat(np.arange(4), 4), np.asarray(trainer.run.train_queries[:4]), group_size=4)
    hinting_module(monkeypatch, differ=True)
    trainer = trainer_for(config_for(tmp_path, environment_factory="hinting_env_test:Hinting",
                                     max_prompt_length=16), data)
    with pytest.raises(EnvironmentCallError, match=r"returned different text for the 4 episodes of prompt row 0"):
        trainer.run.agents.begin(np.repeat(np.arange(4), 4), np.asarray(trainer.run.train_queries[:4]), group_size=4)


def test_a_shared_prompt_prefix_is_found_and_must_survive_reset_text(tmp_path, monkeypatch):
    """shared_prompt_prefix: the run finds the tokens every prompt starts with ("user guess one", where the prompts
    go on with "number" or "whole number"), the sampler and the update take them once, and a prompt rendered again
    with reset's text keeps them; where reset's text would change them (every prompt the same up to its last
    token), the run stops naming the fix."""
    hinting_module(monkeypatch)
    data = [{"prompt": "guess one " + ("number" if i % 2 else "whole number"), "target": t}
            for i, t in enumerate((1, 2, 3, 4) * 10)]
    trainer = trainer_for(config_for(tmp_path, environment_factory="hinting_env_test:Hinting", max_prompt_length=16,
                                     total_episodes=16, shared_prompt_prefix=True), data)
    settings = trainer.run.program.settings
    assert settings.sampling.prompt_prefix == settings.batch.prompt_prefix == 3
    history = trainer.train(progress=False)
    assert len(history) == 1 and np.isfinite(history[0]["loss/policy_avg"])
    same = [{"prompt": "guess one number", "target": t} for t in (1, 2, 3, 4) * 10]
    trainer = trainer_for(config_for(tmp_path / "same", environment_factory="hinting_env_test:Hinting",
                                     max_prompt_length=16, shared_prompt_prefix=True), same)
    assert trainer.run.program.settings.sampling.prompt_prefix == 5  # all of "user guess one number <eos>"
    with pytest.raises(ConfigError, match=r"no longer starts with the 5 tokens every prompt of the dataset starts "
                                          r"with.*set shared_prompt_prefix: false"):
        trainer.run.agents.begin(np.repeat(np.arange(4), 4), np.asarray(trainer.run.train_queries[:4]), group_size=4)


BLOCK_IN_STEP = "PPOJAX_TEST_BLOCK_IN_STEP"  # "<update>:<output_dir>": Interrupting blocks in that update


class Interrupting(GuessNumber):
    """GuessNumber that stops its run at its first step in an episode of update 2 when ``armed`` (SIGINT to its own
    process), or of update n when ``$PPOJAX_TEST_BLOCK_IN_STEP`` is "n:<output_dir>": once update n - 1's
    checkpoint is in place it prints a marker and blocks until the process is killed. Otherwise GuessNumber."""
    resets, armed, fired = 0, False, False

    def reset(self, **row):
        type(self).resets += 1
        return super().reset(**row)

    def step(self, action):
        cls = type(self)
        update = 1 + (cls.resets - 1) // 16  # 16 episodes an update, no evaluation
        if cls.armed and not cls.fired and update == 2:
            cls.fired = True
            os.kill(os.getpid(), signal.SIGINT)
        block = os.environ.get(BLOCK_IN_STEP)
        if block and update == int(block.split(":", 1)[0]):
            block_once_saved(Path(block.split(":", 1)[1]) / "checkpoints" / f"step_{update - 1}",
                             f"PPOJAX_BLOCKED in an episode of update {update}")
        return super().step(action)


def interrupting_config(tmp_path, out):
    return config_for(tmp_path, output_dir=str(tmp_path / out), total_episodes=16 * 4, num_eval_prompts=0,
                      environment_factory="tests.test_agent_runs:Interrupting", resume="auto")


def train_interrupting(tmp_path, out, armed=False):
    Interrupting.resets, Interrupting.armed, Interrupting.fired = 0, armed, False
    trainer = trainer_for(interrupting_config(tmp_path, out), games(40))
    return trainer, trainer.train(progress=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 4 updates of ``interrupting_config`` never interrupted: (its folder, its trained parameters)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    trainer, history = train_interrupting(tmp_path, "reference")
    assert len(history) == 4 and max(m["episodes/turns"] for m in history) > 1.05
    return tmp_path / "reference", jax.tree.map(np.asarray, trainer.run.state.params)


def assert_equals_the_uninterrupted_run(out, trainer, uninterrupted):
    from tests.test_reliability import metric_rows

    reference, params = uninterrupted
    assert metric_rows(out / "metrics.jsonl") == metric_rows(reference / "metrics.jsonl")
    for a, b in zip(jax.tree.leaves(trainer.run.state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_an_agent_run_interrupted_mid_episode_resumes_as_the_uninterrupted_run(tmp_path, uninterrupted):
    """SIGINT arrives while an environment steps an episode of update 2: the update finishes, its checkpoint is
    written, the run stops; ``resume=auto`` plays updates 3 and 4 (the environments reset again with the same rows)
    and the metrics and parameters equal those of the run that was never interrupted."""
    from ppojax.errors import RunInterrupted
    from tests.test_reliability import metric_rows

    with pytest.raises(RunInterrupted, match="stopped by SIGINT after update 2; checkpoint .*step_2 written"):
        train_interrupting(tmp_path, "interrupted", armed=True)
    assert Interrupting.fired and len(metric_rows(tmp_path / "interrupted" / "metrics.jsonl")) == 2
    assert sorted(p.name for p in (tmp_path / "interrupted" / "checkpoints").glob("step_*")) == ["step_1", "step_2"]
    resumed, rest = train_interrupting(tmp_path, "interrupted")
    assert len(rest) == 2
    assert_equals_the_uninterrupted_run(tmp_path / "interrupted", resumed, uninterrupted)


def test_an_agent_run_killed_mid_episode_resumes_as_the_uninterrupted_run(tmp_path, uninterrupted):
    """SIGKILL while an environment steps an episode of update 3 (a process of its own, update 2's checkpoint in
    place): the update in flight is lost, nothing of it is written (metrics hold updates 1-2); ``resume=auto``
    plays updates 3 and 4 again from step_2 and equals the run never interrupted."""
    from tests.test_reliability import metric_rows

    out = tmp_path / "killed"
    script = ("import sys; from pathlib import Path; from tests.test_agent_runs import train_interrupting; "
              "train_interrupting(Path(sys.argv[1]), 'killed')")
    # ppojax's CPU backend off, as in this process (tests/conftest.py): the same programs on both sides of the kill
    env = {**run_environment(), BLOCK_IN_STEP: f"3:{out}", "PPOJAX_CPU_BACKEND": "0"}
    log = tmp_path / "killed.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        wait_for_marker(proc, log)
    finally:
        proc.kill()
        proc.wait()
    assert len(metric_rows(out / "metrics.jsonl")) == 2
    assert not (out / "checkpoints" / "step_3").exists()
    resumed, rest = train_interrupting(tmp_path, "killed")
    assert len(rest) == 2  # updates 3 and 4
    assert_equals_the_uninterrupted_run(out, resumed, uninterrupted)


def test_the_calculator_evaluates_arithmetic_only():
    assert calculate("12 * 3 - 4") == "32"
    assert calculate("(7 + 5) / 4") == "3"
    assert calculate("-2.5 * 2") == "-5"
    for bad in ("__import__('os')", "2 ** 100", "x + 1", "3 +"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_agent_runs_need_a_stop_token_and_a_chat_template(tmp_path):
    with pytest.raises(ConfigError, match="needs a stop token"):
        trainer_for(config_for(tmp_path, stop_token=None), games(40))
    with pytest.raises(ConfigError, match="set chat_template: true"):
        trainer_for(config_for(tmp_path, chat_template=False), games(40))


def test_the_built_in_games_are_seeded_and_follow_their_text(tmp_path, monkeypatch):
    import json

    from ppojax.tasks import guess_number
    from ppojax.trainer import prompt_sources

    monkeypatch.setattr(prompt_sources, "cache_dir", lambda: tmp_path)
    train = prompt_sources.guess_number_split("guess_number", log=lambda *a, **k: None)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 2000 and {r["prompt"] for r in rows} == {guess_number.PROMPT}
    assert {r["target"] for r in rows} == set(range(guess_number.LOW, guess_number.HIGH + 1))
    assert rows[:5] == list(guess_number.records(0, 5))
    monkeypatch.setattr(prompt_sources, "GAME_PROMPT", "another text")  # a changed game is written anew, elsewhere
    assert prompt_sources.guess_number_split("guess_number", log=lambda *a, **k: None).parent != train.parent


def test_missing_eos_penalty_reads_whether_the_episode_ended_not_its_tokens():
    """Every answered turn of an episode ends with the stop token, so a truncated LAST turn is what the penalty is
    for: the scores read the Experience's ``contains_stop`` (the episodes' ``completed``), not the stream."""
    from types import SimpleNamespace

    settings = SimpleNamespace(algorithm=SimpleNamespace(missing_eos_penalty=0.5, soft_punish_cache=0))
    streams = jnp.array([[5, 1, 7, 7, 6, 1], [5, 1, 7, 7, 6, 6]])  # both hold the stop token (1) of a first turn
    completed = jnp.array([True, False])  # the second's last turn ran out of tokens
    scores = rollout.penalised_scores(jnp.array([1.0, 1.0]), completed, jnp.array([5, 5]), settings)
    np.testing.assert_allclose(np.asarray(scores), [1.0, 0.5])
    assert bool(jnp.all(jnp.any(streams == 1, axis=1)))  # a token test would have penalised neither
