"""Whole runs with the critic-free estimators and the PPO options of issue 16, on the tiny model.

- each estimator learns the 'good' reward (seeded);
- a critic-free run has no value model: no value parameters, no value optimizer state, no value metrics;
- num_generations: every group is one prompt's samples, on consecutive rows;
- critic_warmup: the policy stays exactly as it was while the value function trains;
- the estimators' options are refused where they do not apply (one ConfigError, before any model loads).
"""
import jax
import numpy as np
import pytest

from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.rl.program import make_rollout
from tests.test_trainer import make_trainer

ESTIMATOR_RUNS = {
    "grpo": dict(advantage_estimator="grpo", num_generations=4, kl_coef=0.0, kl_loss_coef=0.01,
                 loss_agg_mode="seq-mean-token-mean"),
    "rloo": dict(advantage_estimator="rloo", num_generations=4, kl_coef=0.01),
    "reinforce_pp": dict(advantage_estimator="reinforce_pp", kl_coef=0.01),
}


@pytest.mark.parametrize("name", ESTIMATOR_RUNS)
def test_each_estimator_learns(tmp_path, name):
    trainer = make_trainer(tmp_path, **ESTIMATOR_RUNS[name])
    history = trainer.train(progress=False)
    scores = [m["objective/scores"] for m in history]
    first, last = np.mean(scores[:3]), np.mean(scores[-3:])
    assert last > first + 0.3, (name, first, last)
    assert trainer.train_step.jitted._cache_size() == 1
    assert history[-1]["episode"] == 16 * 30  # episodes are samples: 16 per update whatever the group size


def test_critic_free_run_has_no_value_model(tmp_path):
    with_critic = make_trainer(tmp_path / "gae", total_episodes=16)
    critic_free = make_trainer(tmp_path / "grpo", total_episodes=16, **ESTIMATOR_RUNS["grpo"])
    assert set(with_critic.state.params) == {"policy", "value"}
    assert set(critic_free.state.params) == {"policy"}

    def size(tree):
        return sum(x.size for x in jax.tree.leaves(tree))

    policy = size(critic_free.state.params["policy"])
    assert size(critic_free.state.opt_state) == 2 * policy + 1  # Adam's mu and nu of the policy, and a count
    assert size(with_critic.state.opt_state) > size(critic_free.state.opt_state) + size(
        with_critic.state.params["value"])
    metrics = critic_free.train(progress=False)[-1]
    assert not {"loss/value_avg", "val/clipfrac_avg"} & set(metrics)
    assert {"loss/policy_avg", "loss/kl_avg", "loss/total_avg"} <= set(metrics)


def test_groups_are_one_prompts_samples_on_consecutive_rows(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=16, **ESTIMATOR_RUNS["rloo"])
    prompts = next(trainer.run.batches).input_ids
    assert prompts.shape[0] == 4  # batch_size 16 / num_generations 4
    experience, _ = make_rollout(trainer.run.program)(trainer.state, prompts, jax.random.key(0))
    queries = np.asarray(experience.queries).reshape(4, 4, -1)
    assert (queries == np.asarray(prompts)[:, None, :]).all()
    responses = np.asarray(experience.responses).reshape(4, 4, -1)
    assert any(len({tuple(r) for r in group}) > 1 for group in responses)  # samples differ within a group


def _params_after_two_updates(trainer):
    """(policy, value) parameters before, as numpy, after two updates of `trainer`."""
    before = {name: jax.tree.map(np.asarray, trainer.state.params[name]) for name in ("policy", "value")}
    trainer.train(num_updates=2, progress=False)
    return before["policy"], before["value"]


def _unchanged(before, after) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), before, after)))


def _largest_move(before, after) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - np.asarray(b)).max(), before, after)))


def test_critic_warmup_trains_only_the_value_function(tmp_path):
    trainer = make_trainer(tmp_path, total_episodes=16 * 3, critic_warmup=2)
    policy_before, value_before = _params_after_two_updates(trainer)
    assert _unchanged(policy_before, trainer.state.params["policy"])
    assert _largest_move(value_before, trainer.state.params["value"]) > 1e-4
    counts = [int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.opt_state)
              if "count" in jax.tree_util.keystr(path)]
    assert counts == [2 * trainer.run.settings.optim.steps_per_update]  # Adam's step count (the critic's) advanced
    trainer.train(progress=False)  # update 3: the policy moves too
    assert _largest_move(policy_before, trainer.state.params["policy"]) > 1e-4


def test_a_critic_learning_rate_of_zero_keeps_the_value_model_while_the_policy_learns(tmp_path):
    """critic_learning_rate is the critic's own: at 0 the value model (started at zero: value_head_init) stays
    exactly as it was while the policy moves at learning_rate."""
    trainer = make_trainer(tmp_path, total_episodes=16 * 2, critic_learning_rate=0.0, value_head_init="zeros")
    head = np.asarray(trainer.state.params["value"]["score"]["kernel"])
    np.testing.assert_array_equal(head, np.zeros_like(head))
    policy_before, value_before = _params_after_two_updates(trainer)
    assert _unchanged(value_before, trainer.state.params["value"])
    assert _largest_move(policy_before, trainer.state.params["policy"]) > 1e-4


@pytest.mark.parametrize("values, message", [
    (dict(advantage_estimator="grpo"), "needs num_generations >= 2"),
    (dict(advantage_estimator="rloo", num_generations=1), "needs num_generations >= 2"),
    (dict(advantage_estimator="gae", scale_rewards="none"), "scale_rewards='none' only applies to"),
    (dict(advantage_estimator="grpo", num_generations=4, normalize_advantages=True),
     "normalize_advantages=True only applies to"),
    (dict(advantage_estimator="reinforce_pp", critic_warmup=3), "has no critic to warm up"),
    (dict(advantage_estimator="grpo", num_generations=4, critic_learning_rate=1e-5), "has no critic to train"),
    (dict(advantage_estimator="grpo", num_generations=4, value_model_path="x"), "uses no value model"),
    (dict(advantage_estimator="grpo", num_generations=3, batch_size=16), "does not split into num_generations=3"),
    (dict(dual_clip_c=1.0), "dual_clip_c=1.0: expected null or a number > 1"),
    (dict(loss_agg_mode="seq-mean"), "loss_agg_mode='seq-mean': expected one of"),
    (dict(kl_loss_type="full", kl_loss_coef=0.1), "kl_loss_type='full' is not available in the loss"),
    (dict(beta=0.04), "kl_loss_coef"),
    (dict(loss_type="dr_grpo", loss_agg_mode="seq-mean-token-mean", num_generations=4, batch_size=16),
     "loss_agg_mode='seq-mean-token-mean' with loss_type='dr_grpo', which averages by 'seq-mean-token-sum-norm' "
     "itself"),
])
def test_estimator_options_are_refused_where_they_do_not_apply(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOConfig.from_dict(values)


def test_trl_and_verl_names_map_to_ppojax_fields():
    config = PPOConfig.from_dict(dict(rloo_k=4, epsilon=0.1, epsilon_high=0.28, clip_ratio_c=3.0,
                                      adv_estimator="rloo"))
    assert (config.num_generations, config.cliprange, config.cliprange_high, config.dual_clip_c,
            config.advantage_estimator) == (4, 0.1, 0.28, 3.0, "rloo")
