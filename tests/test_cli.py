"""`ppojax train CONFIG key=value ...` end to end on a tiny checkpoint directory, and `--help`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import jax.numpy as jnp

from ppojax.rl.rewards import TracedScores
from ppojax.trainer.cli import main
from ppojax.trainer.config import PPOConfig
from tests.tiny_setup import WORDS, write_tiny_run_inputs

REPO = Path(__file__).resolve().parents[1]


def good_fraction(prompts, completions):
    """Reward of configs/tiny.yaml: the fraction of completion words that are 'good'."""
    return [sum(w == "good" for w in c.split()) / max(1, len(c.split())) for c in completions]


GOOD = 2 + WORDS.index("good")  # the tiny tokenizer: one word a token, 0 pad, 1 eos, 2... the words


def _good_fraction_of_ids(queries, responses):
    """``good_fraction`` on the token ids (i32[B, R] -> f32[B]): the words are the ids before the first pad (0) or
    eos (1): the completions' texts end there (a sampled pad cannot be told from padding)."""
    words = jnp.cumprod(responses >= 2, axis=-1)
    return (words * (responses == GOOD)).sum(-1) / jnp.maximum(1, words.sum(-1))


# configs/tiny.yaml's reward: the same scores traced into the program (its programs have no host callback: the
# persistent compilation cache keeps them on every backend, and the suite's many tiny runs compile each program once).
good_fraction_of_ids = TracedScores(_good_fraction_of_ids, name="good_fraction_of_ids")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("tiny"))


def test_train_command_writes_every_output(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", str(REPO / "configs/tiny.yaml"), f"model_name_or_path={tiny_dirs / 'model'}",
                 f"dataset={tiny_dirs / 'prompts.jsonl'}", f"output_dir={out}", "eval_steps=2", "logging_steps=3",
                 "export_check=null"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    # the held-out prompts scored before, every eval_steps updates (the last one is the after-training score)
    # and after; an update that scored them is logged whatever logging_steps says
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4] and ["eval/mean_score" in r for r in rows] == [True, False, False]
    curve = summary["held_out_curve"]
    assert [point["update"] for point in curve] == [0, 2, 4]
    assert curve[0]["mean_score"] == summary["held_out_mean_score_before"]
    assert curve[1]["mean_score"] == rows[0]["eval/mean_score"]
    assert curve[2]["mean_score"] == summary["held_out_mean_score_after"]
    from ppojax.trainer.ppo_trainer import PPOTrainer  # the mid-run score, again from the step-2 checkpoint
    config = PPOConfig.from_dict({**json.loads((out / "checkpoints/step_2/config/config.json").read_text()),
                                  "resume": None, "output_dir": str(tmp_path / "again"), "report_to": "none"})
    again = PPOTrainer(config)
    again.resume(str(out / "checkpoints/step_2"))
    assert again.evaluate(step=2)["mean_score"] == pytest.approx(curve[1]["mean_score"], abs=1e-6)
    assert summary["updates"] == 4 and summary["episodes"] == 64
    assert summary["held_out_prompts"] == 16
    assert 0.0 <= summary["held_out_mean_score_before"] <= 1.0
    assert (out / "policy" / "config.json").is_file() and (out / "policy" / "model.safetensors").is_file()
    assert (out / "training_curves.png").stat().st_size > 5000
    assert summary["export_greedy_match"] is True  # transformers writes ppojax's greedy continuations
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]
    assert any((out / "tensorboard").iterdir())
    after = json.loads((out / "eval_after.json").read_text())
    assert after["mean_score"] == pytest.approx(summary["held_out_mean_score_after"])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    keys = [(s["step"], s["prompt"]) for s in samples]
    assert len(keys) == len(set(keys)) and 0 in {s["step"] for s in samples}  # each step's samples once
    printed = capsys.readouterr().out
    assert "held-out mean score before training" in printed and "samples at update" in printed

    # a second run with resume=auto finds the run complete and trains nothing more
    code = main(["train", str(REPO / "configs/tiny.yaml"), f"model_name_or_path={tiny_dirs / 'model'}",
                 f"dataset={tiny_dirs / 'prompts.jsonl'}", f"output_dir={out}", "resume=auto"])
    assert code == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["updates"] == 4
    assert again["held_out_mean_score_before"] == summary["held_out_mean_score_before"]  # not re-scored
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_bad_override_is_a_clear_error(tmp_path, capsys):
    code = main(["train", str(REPO / "configs/tiny.yaml"), "learning_rte=1"])
    assert code == 2
    assert "Did you mean 'learning_rate'" in capsys.readouterr().err


def test_help_lists_every_field_with_its_default():
    text = subprocess.run([sys.executable, "-m", "ppojax.trainer.cli", "train", "--help"], capture_output=True,
                          text=True, check=True, cwd=REPO).stdout
    from ppojax.trainer.config import field_names
    for name in field_names():
        assert f"  {name} (default " in text, name
    assert "kl_coef (default 0.05)" in text


def test_a_policy_too_large_for_the_automatic_export_check_is_exported_unchecked(tiny_dirs, tmp_path, capsys,
                                                                                monkeypatch):
    """export_check: null (auto) leaves a policy above its size limit unchecked (transformers would hold it whole
    in one host's memory) and says why and how to check it anyway; here the tiny policy counts as large."""
    import ppojax.trainer.export_check
    monkeypatch.setattr(ppojax.trainer.export_check, "AUTO_MAX_PARAMS", 1000)
    out = tmp_path / "run"
    code = main(["train", str(REPO / "configs/tiny.yaml"), f"model_name_or_path={tiny_dirs / 'model'}",
                 f"dataset={tiny_dirs / 'prompts.jsonl'}", f"output_dir={out}", "total_episodes=16",
                 "export_check=null"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "the export is not checked against transformers: the policy has" in printed
    assert "set export_check: true to check it anyway" in printed and "checking the export" not in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export_greedy_match"] is None and (out / "policy" / "model.safetensors").is_file()


def test_the_export_check_runs_where_it_can_and_was_asked_to():
    from ppojax.trainer.export_check import AUTO_MAX_PARAMS, export_check_skipped
    small, large = 135_000_000, AUTO_MAX_PARAMS + 1
    ready = dict(held_out=True, torch_available=True)
    assert export_check_skipped(None, num_params=small, **ready) is None
    assert "set export_check: true" in export_check_skipped(None, num_params=large, **ready)
    assert export_check_skipped(True, num_params=large, **ready) is None  # asked for: any size
    assert export_check_skipped(False, num_params=small, **ready) == "export_check is false"
    assert "num_eval_prompts" in export_check_skipped(None, num_params=small, held_out=False, torch_available=True)
    assert "torch" in export_check_skipped(None, num_params=small, held_out=True, torch_available=False)


def test_export_check_true_without_torch_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    code = main(["train", str(REPO / "configs/tiny.yaml"), "export_check=true", "num_eval_prompts=4",
                 f"output_dir={tmp_path / 'run'}", "model_name_or_path=/nonexistent/never-loaded"])
    assert code == 2
    err = capsys.readouterr().err
    assert "export_check=True needs torch" in err and "pip install torch==2.13.0" in err
    assert not (tmp_path / "run").exists()
