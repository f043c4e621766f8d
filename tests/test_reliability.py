"""Reliability (issue 9): a NaN reward is skipped and counted, a streak of them stops the run with its last good
checkpoint intact; SIGKILL at several points (between updates, in the middle of a checkpoint save) then
``resume=auto`` gives the uninterrupted run's metrics and parameters bit for bit; every bad input is a clear
error (or a counted filter) before any compute.

Bad inputs already tested elsewhere at the same level (not repeated here): an unknown config key with the
closest name (tests/test_cli.py through ``ppojax train``; tests/test_config.py), batch sizes that do not
divide at the config edge (tests/test_config.py), reward-function edge cases one by one (tests/test_rewards.py),
and NaN scores given to the legacy ``step()`` (tests/test_trainer.py).
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from ppojax.io.checkpoint import HOST_STATE_FILE, latest_checkpoint, restore_checkpoint
from ppojax.trainer.cli import main
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.models import save_pretrained
from ppojax.rl.rewards import RewardFunctionError
from tests.kill_points import block_once_saved, commands_in_one_process, wait_for_marker
from tests.test_trainer import good_fraction, make_trainer
from tests.tiny_setup import run_environment, write_tiny_run_inputs, PROMPTS, WORDS, tiny_config, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = str(REPO / "configs" / "tiny.yaml")
BLOCK_ENV = "PPOJAX_TEST_BLOCK_AT_REWARD_CALL"
SAVE_FAULT = "save fault"  # in KILL_POINTS: run `ppojax` through tests/save_faults.py, paused in that save
_reward_calls = [0]


def blocking_good_fraction(prompts, completions):
    """The reward of the kill tests (configs/tiny.yaml's); with PPOJAX_TEST_BLOCK_AT_REWARD_CALL=<n> set, its
    n-th call prints a marker and blocks until the process is killed (a kill in the middle of a rollout of update
    n, once the checkpoint of update n - 1, written in the background, is in place: a kill during that write is
    another kill point). The runs save every update (``save_steps=1``)."""
    _reward_calls[0] += 1
    if os.environ.get(BLOCK_ENV) == str(_reward_calls[0]):
        output_dir = next(Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("output_dir="))
        block_once_saved(output_dir / "checkpoints" / f"step_{_reward_calls[0] - 1}",
                         f"PPOJAX_BLOCKED reward call {_reward_calls[0]}")
    return good_fraction(prompts, completions)


def host_copy(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def assert_trees_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def metric_rows(path):
    """metrics.jsonl without wall-clock metrics (eps, time/*): what must equal an uninterrupted run."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [{k: v for k, v in row.items() if k != "eps" and not k.startswith("time/")} for row in rows]


# ------------------------------------------------------------------------------------------------------------
# Non-finite rewards
# ------------------------------------------------------------------------------------------------------------
class NanAtCalls:
    """good_fraction, with a NaN score for prompt 3 on the listed (1-based) calls."""

    def __init__(self, *bad_calls):
        self.bad_calls, self.calls = set(bad_calls), 0

    def __call__(self, prompts, completions):
        self.calls += 1
        scores = good_fraction(prompts, completions)
        if self.calls in self.bad_calls:
            scores[3] = float("nan")
        return scores


def test_nan_reward_update_is_skipped_counted_and_a_streak_stops_the_run(tmp_path, capsys):
    # 2 epochs x 1 mini-batch = 2 optimizer steps per update; max_nonfinite_steps=3: one bad update is
    # skipped and the run goes on, two in a row (4 skipped steps) stop it.
    trainer = make_trainer(tmp_path, total_episodes=16 * 6, num_ppo_epochs=2, on_nonfinite_reward="skip",
                           max_nonfinite_steps=3, save_steps=1, adaptive_kl=True, kl_coef=0.1,
                           use_score_scaling=True, use_score_norm=True)
    trainer.reward_fn = NanAtCalls(2, 4, 5)
    trainer.train(num_updates=1, progress=False)
    before = host_copy((trainer.state.params, trainer.state.opt_state, trainer.state.score_moments))
    kl_coef, steps = trainer.kl_coef, int(trainer.state.optimizer_steps)

    bad = trainer.train(num_updates=2, progress=False)[-1]  # update 2: the reward is NaN for one prompt
    assert math.isnan(bad["objective/scores"])
    assert bad["ppo/skipped_steps"] == 2 and bad["ppo/nonfinite_total"] == 2
    assert int(trainer.state.optimizer_steps) == steps and int(trainer.state.nonfinite_streak) == 2
    assert_trees_equal(before, (trainer.state.params, trainer.state.opt_state, trainer.state.score_moments))
    assert trainer.kl_coef == kl_coef  # the adaptive KL controller did not move on a skipped update
    assert "update 2: 2 of 2 optimizer steps skipped for a non-finite loss or gradient" in capsys.readouterr().out

    good = trainer.train(num_updates=3, progress=False)[-1]  # update 3: finite again, the run goes on
    assert good["ppo/skipped_steps"] == 0 and good["ppo/nonfinite_total"] == 2
    assert int(trainer.state.nonfinite_streak) == 0 and int(trainer.state.optimizer_steps) == steps + 2
    assert trainer.kl_coef != kl_coef and math.isfinite(trainer.kl_coef)
    assert all(np.isfinite(float(v)) for v in jax.tree.leaves(trainer.state.score_moments))
    params_3 = host_copy(trainer.state.params)

    # updates 4 and 5: NaN twice in a row -> 4 skipped steps >= 3: the run stops after logging update 5,
    # before checkpointing it; the last checkpoint (update 4, parameters of update 3) is intact.
    with pytest.raises(FloatingPointError, match=r"4 optimizer steps in a row were skipped .*max_nonfinite_steps=3"
                                                 r".*Last good checkpoint: .*step_4 \(continue from it"):
        trainer.train(progress=False)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(checkpoints) == checkpoints / "step_4" and not (checkpoints / "step_5").exists()
    restored, host, _ = restore_checkpoint(checkpoints / "step_4", trainer.state.without_frozen())
    assert_trees_equal(restored.params, params_3)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(host_copy(restored.params)))
    assert int(restored.nonfinite_total) == 4 and float(restored.kl_coef) == trainer.kl_coef
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["ppo/nonfinite_total"] for r in rows] == [0, 2, 2, 4, 6]
    assert rows[1]["objective/scores"] is None  # NaN is written as null


def test_skip_needs_room_for_one_bad_update():
    with pytest.raises(ConfigError, match=r"num_ppo_epochs \* num_mini_batches = 4 optimizer steps.*more than 4"):
        PPOConfig.from_dict(dict(on_nonfinite_reward="skip", max_nonfinite_steps=3))
    with pytest.raises(ConfigError, match="on_nonfinite_reward='ignore': expected 'error' or 'skip'"):
        PPOConfig.from_dict(dict(on_nonfinite_reward="ignore"))


@pytest.fixture(scope="module")
def error_trainer(tmp_path_factory):
    """One trainer for the bad-reward cases: each fails in the first rollout, so its state never changes."""
    return make_trainer(tmp_path_factory.mktemp("bad_reward"), total_episodes=32)


def _raises(prompts, completions):
    raise RuntimeError("reward server unreachable")


def _one_short(prompts, completions):
    return good_fraction(prompts, completions)[:-1]


def _nan_at_3(prompts, completions):
    return [float("nan") if i == 3 else s for i, s in enumerate(good_fraction(prompts, completions))]


def _inf_at_0(prompts, completions):
    return [math.inf] + good_fraction(prompts, completions)[1:]


@pytest.mark.parametrize("reward,message", [
    (_raises, r"reward function .*_raises raised RuntimeError: reward server unreachable"),
    (_one_short, r"reward function .*_one_short returned 15 scores for 16 prompts; expected 16"),
    (_nan_at_3, r"reward function .*_nan_at_3 returned nan for prompt index 3 \('.+'\); scores must be finite"),
    (_inf_at_0, r"reward function .*_inf_at_0 returned inf for prompt index 0 \('.+'\); scores must be finite"),
])
def test_bad_reward_function_stops_before_the_first_update(error_trainer, reward, message):
    error_trainer.reward_fn = reward
    with pytest.raises(RewardFunctionError, match=message):
        error_trainer.train(progress=False)
    assert int(error_trainer.state.update_count) == 0 and int(error_trainer.state.optimizer_steps) == 0
    run = Path(error_trainer.args.output_dir)
    assert not (run / "checkpoints").exists()
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text()


# ------------------------------------------------------------------------------------------------------------
# Bad inputs through `ppojax train`: a one-line error, before any compute
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("reliability"))


def _model_variant(root: Path, name: str, tokenizer=None, vocab_size=None) -> Path:
    """A copy of the tiny model directory with another tokenizer or vocabulary size."""
    out = root / name
    if vocab_size is not None:
        from ppojax.models import CausalLM
        save_pretrained(CausalLM(tiny_config(vocab_size), rngs=nnx.Rngs(0)), tiny_config(vocab_size), out)
        tiny_tokenizer().save_pretrained(str(out))  # 16 tokens
        return out
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(root / "model" / f, out / f)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def _tokenizer(pad_token):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                   **({} if pad_token is None else {"pad_token": pad_token}))


def _bad_input(root: Path, case: str) -> list[str]:
    """key=value overrides of configs/tiny.yaml that make one bad input."""
    data = root / "prompts.jsonl"
    if case == "empty dataset":
        (root / "empty.jsonl").write_text("")
        return [f"dataset={root / 'empty.jsonl'}"]
    if case == "missing prompt column":
        return ["dataset_text_field=text"]
    if case == "prompt ends with the stop token":
        (root / "stop.jsonl").write_text(data.read_text() + json.dumps({"prompt": "the movie <eos>"}) + "\n")
        return [f"dataset={root / 'stop.jsonl'}", "stop_token=eos"]
    if case == "pad == eos":
        return [f"model_name_or_path={_model_variant(root, 'pad_is_eos', _tokenizer('<eos>'))}"]
    if case == "no pad token":
        return [f"model_name_or_path={_model_variant(root, 'no_pad', _tokenizer(None))}"]
    if case == "tokenizer larger than the model's vocabulary":
        return [f"model_name_or_path={_model_variant(root, 'small_vocab', vocab_size=8)}"]
    if case == "batch_size not divisible by num_mini_batches":
        return ["batch_size=10", "num_mini_batches=3"]
    if case == "fewer prompts than batch_size":
        return ["num_eval_prompts=50"]
    if case == "missing weights":
        out = _model_variant(root, "no_weights", tiny_tokenizer())
        (out / "model.safetensors").unlink()
        return [f"model_name_or_path={out}"]
    if case == "truncated weights":
        out = _model_variant(root, "truncated", tiny_tokenizer())
        blob = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(blob[: len(blob) // 2])
        return [f"model_name_or_path={out}"]
    if case == "corrupt weights header":
        out = _model_variant(root, "garbage", tiny_tokenizer())
        blob = (out / "model.safetensors").read_bytes()
        (out / "model.safetensors").write_bytes(blob[:8] + b"\xff" * 64 + blob[72:])
        return [f"model_name_or_path={out}"]
    raise AssertionError(case)


BAD_INPUTS = {
    "empty dataset": r"prompt dataset '.*empty\.jsonl' is empty; it needs at least one prompt",
    "missing prompt column": r"prompts\.jsonl has no column 'text'; available columns: \['prompt'\]",
    "prompt ends with the stop token":
        r"prompt 64 \('the movie <eos>'\) ends with the stop token '<eos>' \(id 1\).*Strip the stop token",
    "pad == eos": r"the tokenizer's pad token '<eos>' \(id 1\) is also its eos token; ppojax needs pad != eos.*Fix:",
    "no pad token": r"the tokenizer has no pad token.*Fix:",
    "tokenizer larger than the model's vocabulary":
        r"the tokenizer has 16 tokens but the model's vocab_size is 8: ids >= 8 have no embedding",
    "batch_size not divisible by num_mini_batches": r"batch_size=10 does not split into num_mini_batches=3",
    "fewer prompts than batch_size":
        r"The dataset has 14 training prompts after filtering and holding out num_eval_prompts=50, fewer than "
        r"batch_size=16",
    "missing weights": r"could not load the policy from '.*no_weights': no weights in .*model\.safetensors",
    "truncated weights": r"could not load the policy from '.*truncated': .*truncated.*model\.safetensors is "
                         r"truncated: its tensors need \d+ bytes of data, the file holds \d+; re-download",
    "corrupt weights header": r"could not load the policy from '.*garbage': .*garbage.*model\.safetensors is corrupt: "
                              r"its header is not valid JSON",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_a_clear_error_before_compute(tiny_dirs, tmp_path, capsys, case):
    overrides = [f"model_name_or_path={tiny_dirs / 'model'}", f"dataset={tiny_dirs / 'prompts.jsonl'}",
                 f"output_dir={tmp_path / 'run'}", "report_to=none"]
    overrides += _bad_input(tiny_dirs, case)
    overrides = list({item.partition("=")[0]: item for item in overrides}.values())  # the case's value wins
    code = main(["train", TINY_YAML, *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "ppojax: error: " in err and "Traceback" not in err, err
    message = " ".join(err.split())
    assert re.search(BAD_INPUTS[case], message), (case, message)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_too_long_prompts_are_filtered_and_counted(tmp_path, capsys):
    trainer = make_trainer(tmp_path, max_prompt_length=3)
    too_long = sum(len(p.split()) > 3 for p in PROMPTS)
    assert too_long == 21
    assert (f"[ppojax] filtered {too_long} of {len(PROMPTS)} prompts longer than max_prompt_length=3 tokens "
            "(longest 4)") in capsys.readouterr().out
    assert len(trainer.train_queries) == len(PROMPTS) - too_long and trainer.train_queries.shape[1] == 3


# ------------------------------------------------------------------------------------------------------------
# SIGKILL at several points, then resume=auto: identical to an uninterrupted run
# ------------------------------------------------------------------------------------------------------------
# Each run: `ppojax train configs/tiny.yaml` (4 updates, a checkpoint after each, adaptive KL and score
# normalisation on, so every piece of host state matters), killed at one point, then resumed with resume=auto.
# The run killed in its FINAL save is also the uninterrupted reference: it ran all 4 updates without a break,
# and at its kill point (COMPLETE written, orbax's rename not yet done) its step_4.orbax-checkpoint-tmp/ holds the
# final train state and host state in full, and metrics.jsonl all 4 rows; they are copied away before that run is
# resumed. The kills in a save stop it with tests/save_faults.py.
REFERENCE_KILL = "in the final save (COMPLETE written, not renamed)"
KILL_POINTS = {
    # name: (extra environment, what the killed run must have left: latest checkpoint, metrics rows)
    REFERENCE_KILL: ({SAVE_FAULT: "marked@4"}, "step_3", 4),
    "in the rollout of update 3 (between checkpoints)": ({BLOCK_ENV: "3"}, "step_2", 2),
    "in the save of update 3 (state written, no COMPLETE)": ({SAVE_FAULT: "state_written@3"}, "step_2", 3),
}
MARKERS = ("PPOJAX_BLOCKED", "PPOJAX_PAUSED")
TIMEOUT = 300


def _run_args(dirs: Path, out: Path) -> list[str]:
    return ["train", TINY_YAML, f"model_name_or_path={dirs / 'model'}", f"dataset={dirs / 'prompts.jsonl'}",
            f"output_dir={out}", "reward_function=tests.test_reliability:blocking_good_fraction",
            "num_eval_prompts=0", "num_sample_generations=0", "report_to=tensorboard", "save_steps=1",
            "adaptive_kl=true", "kl_coef=0.1", "use_score_scaling=true", "use_score_norm=true"]


@pytest.fixture(scope="module")
def kill_env():
    """Subprocess environment (`tests.tiny_setup.run_environment`): the first run to need a program compiles it, the
    others load it, the train step with its blocking Python reward included; XLA's quickest compile (these runs are
    compared only with each other, all compiled alike)."""
    env = run_environment()
    env.pop(BLOCK_ENV, None)
    return env


def _start_killable(name, dirs: Path, env, root: Path):
    out, log = root / "run", root / "run.log"
    root.mkdir(parents=True, exist_ok=True)
    extra = dict(KILL_POINTS[name][0])
    fault = extra.pop(SAVE_FAULT, None)
    program = ["tests.save_faults", fault] if fault else ["ppojax.trainer.cli"]
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", *program, *_run_args(dirs, out)], cwd=REPO,
                                env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT)
    return proc, out, log


@pytest.fixture(scope="module", autouse=True)
def first_killed_run(request, tmp_path_factory):
    """When the SIGKILL test is selected, its first run (the one that compiles) starts with the module, in
    the background, so that it overlaps the in-process tests above."""
    if not any("sigkill" in item.name for item in request.session.items
               if getattr(item, "module", None) is request.module):
        yield None
        return
    dirs, env = request.getfixturevalue("tiny_dirs"), request.getfixturevalue("kill_env")
    proc, out, log = _start_killable(REFERENCE_KILL, dirs, env, tmp_path_factory.mktemp("killed_first"))
    try:
        yield proc, out, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_at_marker(proc, log: Path, deadline: float) -> None:
    wait_for_marker(proc, log, MARKERS, timeout=deadline - time.time())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_then_resume_equals_an_uninterrupted_run(tiny_dirs, kill_env, first_killed_run, tmp_path):
    import orbax.checkpoint as ocp

    deadline = time.time() + TIMEOUT
    runs, procs = {}, []
    try:
        proc, out, log = first_killed_run
        procs.append(proc)
        _kill_at_marker(proc, log, deadline)  # its programs (the train step too) are now in the persistent cache
        runs[REFERENCE_KILL] = out
        started = {name: _start_killable(name, tiny_dirs, kill_env, tmp_path / f"killed_{i}")
                   for i, name in enumerate(KILL_POINTS) if name != REFERENCE_KILL}  # concurrently
        procs += [proc for proc, _, _ in started.values()]
        for name, (proc, out, log) in started.items():
            _kill_at_marker(proc, log, deadline)
            runs[name] = out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for name, out in runs.items():  # what each kill left behind
        _, latest, rows = KILL_POINTS[name]
        assert latest_checkpoint(out / "checkpoints") == out / "checkpoints" / latest, name
        assert len((out / "metrics.jsonl").read_text().splitlines()) == rows, name
    reference = tmp_path / "reference"
    shutil.copytree(runs[REFERENCE_KILL] / "checkpoints" / "step_4.orbax-checkpoint-tmp", reference)
    shutil.copy(runs[REFERENCE_KILL] / "metrics.jsonl", reference / "metrics.jsonl")

    # resume all three with `ppojax train ... resume=auto`, in one process (one startup)
    outputs = commands_in_one_process([_run_args(tiny_dirs, out) + ["resume=auto"] for out in runs.values()],
                                      kill_env, REPO, TIMEOUT)
    resumed_at = sorted(int(line.rsplit(" ", 1)[1]) for line in "".join(outputs).splitlines()
                        if line.startswith("ppojax: resumed from"))
    assert resumed_at == [2, 2, 3], outputs

    want_rows = metric_rows(reference / "metrics.jsonl")
    assert [r["step"] for r in want_rows] == [1, 2, 3, 4]
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        want_state = host_copy(checkpointer.restore(reference / "train_state"))
        want_host = json.loads((reference / HOST_STATE_FILE).read_text())["host_state"]
        policies = set()
        for name, out in runs.items():
            final = out / "checkpoints" / "step_4"
            assert metric_rows(out / "metrics.jsonl") == want_rows, name
            # parameters, optimizer state and counters, bit for bit
            assert_trees_equal(host_copy(checkpointer.restore(final / "train_state")), want_state)
            # KL coefficient, score moments, PRNG key, data position, episode
            assert json.loads((final / HOST_STATE_FILE).read_text())["host_state"] == want_host, name
            policies.add((out / "policy" / "model.safetensors").read_bytes())
            assert_sinks_hold_every_step_once(out)
        assert len(policies) == 1  # the exported policies are byte-identical


def assert_sinks_hold_every_step_once(out: Path) -> None:
    """TensorBoard's scalars, read back from the event files, equal metrics.jsonl step by step: every step
    once, in order, none missing, nothing of a killed attempt left over."""
    from ppojax.io.tensorboard_sink import read_tensorboard_scalars

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = read_tensorboard_scalars(out / "tensorboard")
    tags = {name for row in rows for name, value in row.items() if name != "step" and value is not None}
    assert set(scalars) == tags, set(scalars) ^ tags
    for tag in tags:
        want = [(row["step"], np.float32(row[tag])) for row in rows if row.get(tag) is not None]
        got = [(step, np.float32(value)) for step, value in scalars[tag]]
        assert got == want, (out, tag, got, want)
    assert not [p for p in (out / "tensorboard").rglob("*") if p.is_file() and p.stat().st_size == 0]
