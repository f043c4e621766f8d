"""PPOConfig: defaults, legacy aliases, derived sizes, YAML round trip, overrides, errors."""
import pytest

from ppojax.config import ConfigError, PPOConfig, field_help, parse_overrides


def test_defaults_are_trls():
    c = PPOConfig().validate()
    assert (c.num_ppo_epochs, c.num_mini_batches, c.cliprange, c.cliprange_value, c.vf_coef) == (4, 1, 0.2, 0.2, 0.1)
    assert (c.gamma, c.lam, c.temperature, c.response_length, c.kl_estimator) == (1.0, 0.95, 0.7, 53, "k1")
    assert (c.learning_rate, c.kl_coef, c.max_grad_norm, c.whiten_rewards) == (3e-6, 0.05, None, False)


def test_legacy_aliases_map_to_fields():
    c = PPOConfig.from_dict(dict(ppo_epochs=2, init_kl_coef=0.2, adap_kl_ctrl=True, target=6, horizon=10000,
                                 kl_penalty="kl", batch_size=32, mini_batch_size=8, model_name="x"))
    assert (c.num_ppo_epochs, c.kl_coef, c.adaptive_kl, c.kl_estimator) == (2, 0.2, True, "k1")
    assert (c.num_mini_batches, c.model_name_or_path, c.target_kl_for_adaptive) == (4, "x", 6)


def test_derived_sizes_follow_trl():
    c = PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=3)
    d = c.derived(data_parallel_size=2)
    assert (d.batch_size, d.mini_batch_size, d.micro_batch_size) == (48, 16, 8)
    d = PPOConfig(batch_size=16, num_mini_batches=2, gradient_accumulation_steps=4).derived()
    assert (d.batch_size, d.mini_batch_size, d.micro_batch_size) == (16, 8, 2)
    assert PPOConfig(batch_size=10, total_episodes=95).num_updates(dataset_size=1000) == 10
    assert PPOConfig(batch_size=10, num_train_epochs=2).num_updates(dataset_size=35) == 7


@pytest.mark.parametrize("values,message", [
    (dict(batch_size=10, num_mini_batches=3), "does not split into num_mini_batches=3"),
    (dict(batch_size=12, num_mini_batches=2, gradient_accumulation_steps=4), "gradient_accumulation_steps=4"),
    (dict(learning_rte=1e-5), "Did you mean 'learning_rate'"),
    (dict(kl_estimator="k2"), "kl_estimator='k2'"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(batch_size=10, mini_batch_size=3), "mini_batch_size=3"),
    (dict(reward_model_path="a", reward_function="vader"), "keep one of them"),
    (dict(mesh_data=-1, mesh_fsdp=-1), "at most one -1"),
])
def test_bad_values_name_the_value_and_fix(values, message):
    with pytest.raises(ConfigError, match=message):
        PPOConfig.from_dict(values)


def test_yaml_round_trip_and_overrides(tmp_path):
    c = PPOConfig(batch_size=16, learning_rate=1e-5, stop_token="eos")
    path = tmp_path / "c.yaml"
    c.to_yaml(path)
    again = PPOConfig.from_yaml(path, ["learning_rate=2e-4", "missing_eos_penalty=1.0", "run_name=x"])
    assert again.batch_size == 16 and again.stop_token == "eos"
    assert again.learning_rate == 2e-4 and again.missing_eos_penalty == 1.0 and again.run_name == "x"
    assert parse_overrides(["a=[1, 2]", "b=null", "c=true"]) == {"a": [1, 2], "b": None, "c": True}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["learning_rate"])
    with pytest.raises(ConfigError, match="does not exist"):
        PPOConfig.from_yaml(tmp_path / "missing.yaml")


def test_every_field_has_help():
    rows = field_help()
    assert len(rows) == len(PPOConfig.__dataclass_fields__)
    documented = {name for name, _, doc in rows if doc}
    assert {"model_name_or_path", "reward_function", "batch_size", "stop_token"} <= documented


def test_types_are_coerced_or_refused():
    c = PPOConfig.from_dict(dict(learning_rate="1e-5", batch_size=16.0, kl_coef=1))
    assert c.learning_rate == 1e-5 and c.batch_size == 16 and isinstance(c.kl_coef, float)
    with pytest.raises(ConfigError, match="batch_size=2.5"):
        PPOConfig.from_dict(dict(batch_size=2.5))
    with pytest.raises(ConfigError, match="whiten_rewards='yes'"):
        PPOConfig.from_dict(dict(whiten_rewards="yes"))
