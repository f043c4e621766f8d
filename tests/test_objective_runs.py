"""Whole runs with the policy objectives (``loss_type``) on the tiny model: the update calls the selected objective.

- GSPO (loss_type grpo, sequence-level importance sampling) and CISPO learn the 'good' reward, in one compile;
- a config written for TRL's GRPOTrainer (configs/trl_grpo.yaml: DAPO's options) runs unchanged but for the tiny
  model's sizes, and logs the objective's metrics and the share of truncated responses it left out;
- GMPO and VESPO with REINFORCE++-baseline, and SAPO with GDPO's normalize_then_sum, run with finite losses.
"""
from pathlib import Path

import numpy as np
import pytest

from ppojax.trainer.config import PPOConfig, load_yaml_mapping
from ppojax.trainer.ppo_trainer import PPOTrainer
from tests.test_trainer import good_fraction
from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]

TINY = dict(report_to="none", batch_size=16, max_prompt_length=6, num_sample_generations=0, seed=0)


def trainer_for(tmp_path, values, reward_funcs=None):
    config = PPOConfig.from_dict({"output_dir": str(tmp_path / "run"), **TINY, **values})
    return PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(),
                      reward_model=None if reward_funcs else good_fraction, reward_funcs=reward_funcs,
                      train_dataset=PROMPTS)


LEARNING_RUNS = {  # TRL's names, as a GRPOTrainer config writes them
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
}


@pytest.mark.parametrize("name", LEARNING_RUNS)
def test_each_objective_learns(tmp_path, name):
    trainer = trainer_for(tmp_path, dict(num_generations=4, max_completion_length=8, learning_rate=1e-2,
                                         num_iterations=4, total_episodes=16 * 30, **LEARNING_RUNS[name]))
    assert trainer.run.settings.algorithm.uses_policy_objective
    history = trainer.train(progress=False)
    scores = [m["objective/scores"] for m in history]
    first, last = np.mean(scores[:3]), np.mean(scores[-3:])
    assert last > first + 0.3, (name, first, last)
    assert trainer.train_step.jitted._cache_size() == 1
    own = "clip_ratio/region_mean" if name == "gspo" else "cispo_clip_ratio"
    assert all(np.isfinite(m[own]) for m in history)  # the selected objective computed the loss
    assert set(trainer.state.params) == {"policy"}  # GRPO's advantages: no value model


def test_a_trl_grpo_config_runs_unchanged(tmp_path):
    values = load_yaml_mapping(REPO / "configs" / "trl_grpo.yaml")
    for key in ("model_name_or_path", "reward_funcs", "output_dir", "report_to", "seed", "num_train_epochs"):
        values.pop(key)  # the tiny setup's model, reward and length instead
    values.update(max_completion_length=8, soft_punish_cache=2, total_episodes=16 * 3)
    trainer = trainer_for(tmp_path, values)
    algorithm = trainer.run.settings.algorithm
    assert (algorithm.loss_type, algorithm.advantage_estimator, algorithm.top_entropy_quantile) == ("dapo", "grpo", 0.2)
    history = trainer.train(progress=False)
    assert len(history) == 3 and trainer.train_step.jitted._cache_size() == 1
    for metrics in history:
        assert np.isfinite(metrics["loss/policy_avg"]) and 0 <= metrics["objective/truncated_fraction"] <= 1
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert 0 <= metrics[name] <= 1, name


def good_words(prompts, completions):
    return [float(sum(w == "good" for w in c.split())) for c in completions]


def short_completions(prompts, completions):
    return [-len(c.split()) / 8.0 for c in completions]


@pytest.mark.parametrize("values, reward_funcs", [
    (dict(loss_type="gmpo", advantage_estimator="reinforce_pp_baseline"), None),
    (dict(loss_type="vespo", advantage_estimator="reinforce_pp_baseline", beta=0.01), None),
    (dict(loss_type="sapo", multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
     [good_words, short_completions]),
])
def test_other_objectives_run(tmp_path, values, reward_funcs):
    trainer = trainer_for(tmp_path, dict(num_generations=4, max_completion_length=8, learning_rate=1e-3,
                                         total_episodes=16 * 2, **values), reward_funcs)
    history = trainer.train(progress=False)
    assert all(np.isfinite(m["loss/total_avg"]) and m["ppo/skipped_steps"] == 0 for m in history)
    assert trainer.train_step.jitted._cache_size() == 1
