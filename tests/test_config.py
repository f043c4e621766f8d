"""PPOConfig: defaults, legacy aliases, derived sizes, YAML round trip, overrides, errors."""
import dataclasses
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from ppojax.core.objectives import ObjectiveParams
from ppojax.rl import settings
from ppojax.trainer import config as C
from ppojax.trainer.config import ConfigError, PPOConfig, field_help, parse_overrides
from ppojax.trainer.config.checks import type_in_words
from ppojax.trainer.config.schema import FIELD_BY_NAME, FIELD_HINTS

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_trls():
    c = PPOConfig().validate()
    assert (c.num_ppo_epochs, c.num_mini_batches, c.cliprange, c.cliprange_value, c.vf_coef) == (4, 1, 0.2, 0.2, 0.1)
    assert (c.gamma, c.lam, c.temperature, c.response_length, c.kl_estimator) == (1.0, 0.95, 0.7, 53, "k1")
    assert (c.learning_rate, c.kl_coef, c.max_grad_norm, c.whiten_rewards) == (3e-6, 0.05, None, False)


#: names whose default in a pure-function layer means the same as the config's in another spelling
SPELLED_OTHERWISE = {("SamplingSettings", "kv_cache_dtype"): (None, "auto")}  # None there: the model's dtype


def _layer_defaults():
    """(layer, name, default) of every parameter with a default in the settings the config fills
    (``ppojax.rl.settings``) and in the objectives' parameters (``ppojax.core``)."""
    for layer in (settings.AlgorithmSettings, settings.SamplingSettings, settings.OptimSettings,
                  settings.BatchSettings, settings.AsyncSettings):
        for field in dataclasses.fields(layer):
            if field.default is not dataclasses.MISSING:
                yield layer.__name__, field.name, field.default
    yield from (("ObjectiveParams", name, default) for name, default in ObjectiveParams._field_defaults.items())


def test_the_pure_function_layers_default_as_the_config_does():
    """A notebook that builds the settings or the objectives' parameters by hand gets the run's defaults: each
    layer states its own (they import no config), and they must not drift apart."""
    config, shared = PPOConfig(), 0
    for layer, name, default in _layer_defaults():
        if name not in FIELD_BY_NAME:
            continue
        shared += 1
        expected = getattr(config, name)
        if (layer, name) in SPELLED_OTHERWISE:
            assert (default, expected) == SPELLED_OTHERWISE[layer, name], (layer, name)
        else:
            assert default == expected and type(default) is type(expected), (
                f"{layer}.{name} defaults to {default!r}, PPOConfig.{name} to {expected!r}")
    assert shared >= 60, shared  # the layers still share their names with the config


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
    (dict(kl_estimator="k9"), "kl_estimator='k9'"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(batch_size=10, mini_batch_size=3), "mini_batch_size=3"),
    (dict(reward_model_path="a", reward_function="vader"), "keep one of them"),
    (dict(mesh_data=-1, mesh_fsdp=-1), "at most one -1"),
    (dict(export_check=True), r"export_check=True decodes held-out prompts.*num_eval_prompts: 16"),
    (dict(export_check="yes"), "export_check='yes': expected null or true or false"),
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


# ---- field metadata (issue 13) ----------------------------------------------------------------------------

# Today's hand-written checkpoint lists (before the metadata): the derived sets must keep their behaviour.
# num_eval_prompts was in none of them, i.e. strict by default; it is now declared must_match.
OLD_STRICT = {"model_name_or_path", "reward_model_path", "reward_function", "value_model_path", "value_head",
              "precision", "dataset", "dataset_text_field", "max_prompt_length", "chat_template", "seed",
              "response_length", "per_device_train_batch_size", "batch_size", "gradient_accumulation_steps",
              "num_mini_batches"}
OLD_HARMLESS = {"output_dir", "run_name", "resume", "total_episodes", "num_train_epochs", "logging_steps",
                "num_sample_generations", "save_steps", "save_total_limit", "report_to", "max_nonfinite_steps",
                "on_nonfinite_reward", "compilation_cache_dir"}
OLD_TUNABLE = {"num_ppo_epochs", "learning_rate", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "adam_beta1",
               "adam_beta2", "adam_epsilon", "weight_decay", "cliprange", "cliprange_value", "vf_coef", "entropy_coef",
               "gamma", "lam", "whiten_rewards", "kl_coef", "kl_estimator", "adaptive_kl", "target_kl_for_adaptive",
               "horizon", "score_position", "missing_eos_penalty", "use_score_scaling", "use_score_norm", "score_clip",
               "ratio_threshold", "early_stopping", "target_kl", "temperature", "top_k", "top_p", "stop_token",
               "stop_token_id", "local_rollout_forward_batch_size", "logits_chunk_size", "mesh_data", "mesh_fsdp",
               "mesh_tensor"}


def test_every_field_declares_its_metadata_and_a_description():
    docs = {name: doc for name, _, doc in field_help()}
    for f in dataclasses.fields(PPOConfig):
        assert set(f.metadata) >= {"static", "on_resume"}, f.name
        assert isinstance(f.metadata["static"], bool), f.name
        assert f.metadata["on_resume"] in ("must_match", "may_change", "ignored"), f.name
        assert len(docs[f.name]) > 15, f"{f.name} has no real description: {docs[f.name]!r}"


def test_derived_sets_are_what_the_fields_declare():
    declared = {kind: {f.name for f in dataclasses.fields(PPOConfig) if f.metadata["on_resume"] == kind}
                for kind in ("must_match", "may_change", "ignored")}
    assert C.MUST_MATCH_FIELDS == declared["must_match"]
    assert C.MAY_CHANGE_FIELDS == declared["may_change"]
    assert C.IGNORED_ON_RESUME_FIELDS == declared["ignored"]
    assert set(C.STATIC_FIELDS) == {f.name for f in dataclasses.fields(PPOConfig) if f.metadata["static"]}
    # the same classification as the hand-written lists they replace
    assert C.MUST_MATCH_FIELDS == OLD_STRICT | {"num_eval_prompts", "advantage_estimator",  # + new fields
                                                "num_generations", "lora_r", "lora_alpha", "lora_target_modules",
                                                "reward_model_label", "reward_funcs", "reward_weights",
                                                "eval_dataset",
                                                "gen_batch_size",  # dynamic sampling's data batch (issue 61)
                                                # an agent run's tools, environment, template and buffer shapes
                                                "tools", "environment_factory", "tool_chat_template", "turn_length",
                                                "observation_length",
                                                # the train state's queue of batches in flight, and its kind
                                                "max_staleness", "in_flight_weight_updates"}
    # fields added since those lists, each classified deliberately
    assert C.IGNORED_ON_RESUME_FIELDS == OLD_HARMLESS | {"overwrite_output_dir", "resume_with_changes",
                                                         "compile_ahead", "export_check", "eval_steps",
                                                         "value_head_init"}
    assert C.MAY_CHANGE_FIELDS == OLD_TUNABLE | {
        "remat", "attention_implementation", "matmul_implementation", "optimizer_implementation", "scale_rewards",
        "normalize_advantages",
        "critic_warmup", "critic_learning_rate",
        "kl_loss_coef", "kl_loss_type", "cliprange_low", "cliprange_high", "dual_clip_c", "loss_agg_mode",
        "lora_dropout", "behaviour_logprobs", "rollout_slots", "padding_free", "max_tokens_per_micro_batch",
        "packed_row_length",  # a packed row's slots: the packing changes, not the numbers (issue 63)
        "shared_prompt_forward",  # each group's prompt once: the numbers to float rounding, whole groups a mini-batch
        "shared_prompt_prefix",  # the prompts' shared start once: the numbers to float rounding
        "decode_segments",
        # the policy objectives (issue 61)
        "loss_type", "importance_sampling_level", "top_entropy_quantile", "mask_truncated_completions",
        "use_bias_correction_kl", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
        "vespo_k_neg", "vespo_lambda_neg", "multi_objective_aggregation", "soft_punish_cache",
        # dynamic sampling (issue 61)
        "filter_groups", "max_num_gen_batches", "filter_groups_metric",
        # the off-policy corrections (issue 62)
        "vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
        "vllm_importance_sampling_clip_min", "off_policy_mask_threshold", "use_decoupled_loss",
        "behav_imp_weight_cap",
        # where an asynchronous run samples (issue 62): a checkpoint is the same with or without it
        "rollout_devices",
        # how an agent run's tools are called (issue 60)
        "max_tool_calling_iterations", "tool_call_parser", "tool_timeout",
        # the KV cache's storage (issue 63)
        "kv_cache_dtype"}
    # the three classes partition the fields (what a resume compares is read from them alone)
    assert not (C.MUST_MATCH_FIELDS & C.IGNORED_ON_RESUME_FIELDS or C.MUST_MATCH_FIELDS & C.MAY_CHANGE_FIELDS
                or C.IGNORED_ON_RESUME_FIELDS & C.MAY_CHANGE_FIELDS)


def test_static_fields_cover_what_the_programs_read_today():
    """Every PPOConfig field that today's hand-copied settings (UpdateSettings, RolloutSettings) take is
    static, and the run/IO/logging fields and kl_coef (a traced state entry) are not."""
    import ppojax.rl.rollout as rollout
    import ppojax.rl.update as update
    copied = set()
    for module, name in ((update, "UpdateSettings"), (rollout, "RolloutSettings")):
        settings = getattr(module, name, None)
        if settings is not None:
            copied |= {f.name for f in dataclasses.fields(settings)} & set(C.FIELD_NAMES)
    copied |= {"early_stopping", "target_kl"}  # UpdateSettings.early_stop_kl = 1.5 * target_kl if early_stopping
    assert copied <= set(C.STATIC_FIELDS), copied - set(C.STATIC_FIELDS)
    assert not {"output_dir", "run_name", "seed", "resume", "report_to", "logging_steps", "save_steps", "kl_coef",
                "total_episodes", "compilation_cache_dir"} & set(C.STATIC_FIELDS)


def test_static_settings_is_a_jit_static_argument():
    traces = []

    def run(settings, x):
        traces.append(settings)
        return x * settings.lam

    run_jit = jax.jit(run, static_argnums=0)
    base = PPOConfig(batch_size=16)
    same = dataclasses.replace(base, output_dir="elsewhere", kl_coef=0.3, seed=7, save_steps=2)
    assert base.static_settings() == same.static_settings()
    assert hash(base.static_settings()) == hash(same.static_settings())
    other = dataclasses.replace(base, lam=0.1)
    assert other.static_settings() != base.static_settings()
    assert float(run_jit(base.static_settings(), jnp.float32(1))) == pytest.approx(0.95)
    run_jit(same.static_settings(), jnp.float32(2))
    assert len(traces) == 1  # equal views: no new trace
    assert float(run_jit(other.static_settings(), jnp.float32(1))) == pytest.approx(0.1)
    assert len(traces) == 2
    view = base.static_settings()
    assert view.response_length == 53 and view.batch_size == 16
    assert not hasattr(view, "output_dir") and not hasattr(view, "kl_coef")
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.cliprange = 0.3


def test_resume_compatibility_refuses_must_match_and_reports_may_change():
    saved = PPOConfig(model_name_or_path="tiny", response_length=8).to_dict()
    now = {**saved, "response_length": 16, "seed": 3, "output_dir": "b", "learning_rate": 1e-5, "report_to": "none"}
    with pytest.raises(ConfigError) as err:
        C.resume_compatibility(saved, now)
    message = str(err.value)
    assert "2 field(s) that must match differ" in message
    assert "  response_length: 8 -> 16" in message and "  seed: 0 -> 3" in message
    assert "  learning_rate:" not in message and "  output_dir:" not in message and "  report_to:" not in message
    assert C.resume_compatibility(saved, {**saved, "learning_rate": 1e-5, "output_dir": "b"}) == [
        "learning_rate: 3e-06 -> 1e-05"]
    from ppojax.errors import CheckpointError
    from ppojax.trainer.config import check_compatible
    with pytest.raises(CheckpointError) as again:  # a checkpoint that cannot be resumed with this config
        check_compatible(saved, now)
    assert str(again.value) == message


# ---- values checked when the config is built (issue 17) ---------------------------------------------------

def test_python_construction_is_checked():
    with pytest.raises(ConfigError, match=r"temperature=0: expected a number > 0.*0\.01"):
        PPOConfig(temperature=0)
    with pytest.raises(ConfigError, match="kl_coef=-0.1"):
        PPOConfig(kl_coef=-0.1)
    with pytest.raises(ConfigError, match="cliprange=0"):
        dataclasses.replace(PPOConfig(), cliprange=0)
    config = PPOConfig()
    config.vf_coef = -1.0  # a hand edit after construction: validate() sees it
    with pytest.raises(ConfigError, match="vf_coef=-1.0"):
        config.validate()


def test_all_bad_values_are_reported_together():
    with pytest.raises(ConfigError) as err:
        PPOConfig(kl_coef=-1, vf_coef=-1, entropy_coef=-1, total_episodes=0)
    message = str(err.value)
    assert message.startswith("4 config values are not valid:")
    for name in ("kl_coef=-1", "vf_coef=-1", "entropy_coef=-1", "total_episodes=0"):
        assert name in message


NUMERIC = [f.name for f in dataclasses.fields(PPOConfig)
           if type_in_words(FIELD_HINTS[f.name]) in ("an integer", "a number")]


@pytest.mark.parametrize("name", NUMERIC)
def test_every_numeric_field_refuses_bools_lists_and_non_finite(name):
    assert len(NUMERIC) > 40
    for bad, got in ((True, "got a boolean"), ([1, 2], "got a list"), (math.nan, ""), (math.inf, ""),
                     ("many", "")):
        with pytest.raises(ConfigError) as err:
            PPOConfig(**{name: bad})
        assert str(err.value).startswith(f"{name}={bad!r}: expected "), str(err.value)
        assert got in str(err.value) and "Fix:" in str(err.value)


def test_value_spellings_resume_and_report_to():
    assert PPOConfig(resume=True).resume == "auto" and PPOConfig(resume=False).resume is None
    assert PPOConfig(resume="auto").resume == "auto" and PPOConfig(resume="ckpt/step_4").resume == "ckpt/step_4"
    assert PPOConfig.from_dict({"resume": True}).to_dict()["resume"] == "auto"
    assert PPOConfig(report_to="none").report_sinks == ()
    assert PPOConfig(report_to=None).report_sinks == ()
    assert PPOConfig(report_to="wandb").report_sinks == ("wandb",)
    assert PPOConfig(report_to=["wandb", "tensorboard", "wandb"]).report_sinks == ("wandb", "tensorboard")
    assert PPOConfig(report_to="all").report_sinks[0] == "tensorboard"
    for bad in ("mlflow", ["tensorboard", "none"], [], ["wandb", 3], True):
        with pytest.raises(ConfigError, match="report_to="):
            PPOConfig(report_to=bad)
    assert PPOConfig(kl_estimator="kl").kl_estimator == "k1"  # legacy TRL's kl_penalty value


def test_help_text_no_longer_calls_temperature_zero_greedy():
    docs = {name: doc for name, _, doc in field_help()}
    assert "> 0" in docs["temperature"] and "greedy" not in docs["temperature"].replace("near-greedy", "")
    assert "every N updates" in docs["logging_steps"]


# TRL 1.12's PPOConfig fields (trl/experimental/ppo/ppo_config.py and trl/trainer/base_config.py) and legacy TRL
# (<= 0.11) PPOConfig fields, read from their sources.
TRL_1_12_PPO = """learning_rate dataset_num_proc num_mini_batches total_episodes local_rollout_forward_batch_size
num_sample_generations response_length stop_token stop_token_id temperature missing_eos_penalty sft_model_path
world_size num_total_batches micro_batch_size local_batch_size batch_size local_mini_batch_size mini_batch_size
push_to_hub reward_model_path model_adapter_name ref_adapter_name num_ppo_epochs whiten_rewards kl_coef kl_estimator
cliprange vf_coef cliprange_value gamma lam ds3_gather_for_generation logging_steps gradient_checkpointing bf16
lr_scheduler_kwargs use_liger_kernel torch_empty_cache_steps""".split()
TRL_LEGACY_PPO = """seed log_with task_name model_name query_dataset reward_model remove_unused_columns tracker_kwargs
accelerator_kwargs project_kwargs tracker_project_name push_to_hub_if_best_kwargs steps learning_rate adap_kl_ctrl
init_kl_coef kl_penalty target horizon gamma lam cliprange cliprange_value vf_coef batch_size forward_batch_size
mini_batch_size gradient_accumulation_steps world_size ppo_epochs max_grad_norm optimize_cuda_cache
optimize_device_cache early_stopping target_kl compare_steps ratio_threshold use_score_scaling use_score_norm
score_clip whiten_rewards is_encoder_decoder is_peft_model backward_batch_size global_backward_batch_size
global_batch_size""".split()


def test_every_trl_and_trainer_key_is_a_field_an_alias_or_explained():
    transformers = pytest.importorskip("transformers")
    trainer_keys = [f.name for f in dataclasses.fields(transformers.TrainingArguments)]
    accepted = set(C.FIELD_NAMES) | set(C.LEGACY_ALIASES) | {"mini_batch_size"}
    missing = [k for k in TRL_1_12_PPO + TRL_LEGACY_PPO + trainer_keys if k not in accepted and k not in C.FOREIGN_KEYS]
    assert not missing, missing
    assert not set(C.FOREIGN_KEYS) & accepted  # a key is either taken or explained, never both
    with pytest.raises(ConfigError) as err:
        PPOConfig.from_dict({"bf16": True, "learning_rte": 1e-5, "log_with": "wandb", "batch_size": 8, "zzzz": 1})
    message = str(err.value)
    assert message.startswith("4 unknown config keys:")
    assert "'bf16' (TRL / transformers): use precision: mixed" in message
    assert "'learning_rte': Did you mean 'learning_rate'?" in message
    assert "'log_with' (TRL / transformers): use report_to" in message
    assert "'zzzz': no field has a similar name" in message


def test_yaml_problems_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1.0e-5\nbatch_size: 16\nlearning_rate: 2.0e-5\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3: key 'learning_rate' is given twice \(lines 1 and 3\)"):
        PPOConfig.from_yaml(path)
    path.write_text("learning_rate: 1.0e-5\n  batch_size: 16\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2:13: not valid YAML \(mapping values are not allowed"):
        PPOConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="is a directory"):
        PPOConfig.from_yaml(tmp_path)
    with pytest.raises(ConfigError, match="given twice"):
        parse_overrides(["seed=1", "seed=2"])
    with pytest.raises(ConfigError, match=r"override 'seed=\[1':1:"):
        parse_overrides(["seed=[1"])


def test_config_only_cross_field_checks():
    PPOConfig(batch_size=16, local_rollout_forward_batch_size=4, warmup_steps=1, total_episodes=32)
    with pytest.raises(ConfigError, match=r"forward_batch_size=6 does not divide batch_size=16.*e\.g\. 4"):
        PPOConfig(batch_size=16, local_rollout_forward_batch_size=6)
    with pytest.raises(ConfigError, match="warmup_steps=2 is not below the run's 2 update"):
        PPOConfig(batch_size=16, warmup_steps=2, total_episodes=32)
    with pytest.raises(ConfigError, match="would stay 0"):
        PPOConfig(adaptive_kl=True, kl_coef=0)
    with pytest.raises(ConfigError, match="use_score_scaling"):
        PPOConfig(use_score_norm=True)
    with pytest.raises(ConfigError, match="needs a stop token"):
        PPOConfig(missing_eos_penalty=1.0)
    PPOConfig(missing_eos_penalty=1.0, stop_token="eos")
    with pytest.raises(ConfigError, match="value model would be ignored"):
        PPOConfig(value_head="policy", value_model_path="v")
    with pytest.raises(ConfigError, match="No reward source"):
        PPOConfig().check_reward_source()
    assert PPOConfig(reward_function="vader").check_reward_source().reward_function == "vader"


def test_registered_names_are_checked_without_jax_and_follow_the_registries(tmp_path):
    """In a fresh process (no test's registrations): a config is checked without importing JAX, its built-in
    names equal what ppojax.core registers by itself, and a name a notebook registers is then accepted."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent('''
        import sys
        from ppojax.trainer.config import (BUILTIN_ADVANTAGE_ESTIMATORS, BUILTIN_KL_ESTIMATORS, SCORE_POSITIONS,
                                   BUILTIN_POLICY_OBJECTIVES, PER_SEQUENCE_ADVANTAGE_ESTIMATORS,
                                   POLICY_OBJECTIVE_LEVEL_REASONS, ConfigError, PPOConfig)
        PPOConfig(kl_estimator="k3", advantage_estimator="rloo", num_generations=2, score_position="legacy")
        PPOConfig(loss_type="gmpo", advantage_estimator="rloo", num_generations=2)
        for bad in (dict(loss_type="my_loss"), dict(loss_type="vespo", importance_sampling_level="sequence")):
            try:
                PPOConfig(**bad)
                raise SystemExit(f"accepted {bad}")
            except ConfigError:
                pass
        for bad in (dict(kl_estimator="my_kl"), dict(advantage_estimator="grpo"), dict(kl_loss_type="k9")):
            try:
                PPOConfig(**bad)
                raise SystemExit(f"accepted {bad}")
            except ConfigError:
                pass
        assert "jax" not in sys.modules, "checking a config imported JAX"

        import ppojax.core as ppo
        from ppojax.core import advantages, kl
        assert kl.kl_estimator_names() == BUILTIN_KL_ESTIMATORS, kl.kl_estimator_names()
        traits = {n: (e.uses_critic, e.needs_groups) for n, e in advantages._REGISTRY.items()}
        assert traits == BUILTIN_ADVANTAGE_ESTIMATORS, traits
        per_sequence = tuple(n for n, e in advantages._REGISTRY.items() if e.per_sequence)
        assert per_sequence == PER_SEQUENCE_ADVANTAGE_ESTIMATORS, per_sequence
        from ppojax.core.objectives import registry
        traits = {n: (o.aggregation, o.levels, o.sequence_advantages, o.options) for n, o in registry._REGISTRY.items()}
        assert traits == BUILTIN_POLICY_OBJECTIVES, traits
        reasons = {n: o.level_reason for n, o in registry._REGISTRY.items() if o.level_reason}
        assert reasons == POLICY_OBJECTIVE_LEVEL_REASONS, reasons
        assert tuple(ppo.SCORE_POSITIONS) == SCORE_POSITIONS

        kl.register_kl_estimator("my_kl")(lambda logprobs, ref_logprobs: logprobs - ref_logprobs)
        registry.register_policy_objective("my_loss", aggregation="token-mean", levels=("token",),
                                           level_reason="mine")(None)
        assert PPOConfig(loss_type="my_loss").loss_type == "my_loss"
        try:
            PPOConfig(loss_type="my_loss", importance_sampling_level="sequence")
            raise SystemExit("a token-level objective was accepted at the sequence level")
        except ConfigError as err:
            assert "it takes 'token' only: mine" in str(err), err
        advantages.register_advantage_estimator("my_groups", uses_critic=False, needs_groups=True)(None)
        assert PPOConfig(kl_estimator="my_kl").kl_estimator == "my_kl"
        try:
            PPOConfig(advantage_estimator="my_groups", num_generations=1)
            raise SystemExit("a group estimator was accepted with num_generations=1")
        except ConfigError as err:
            assert "needs num_generations >= 2" in str(err), err
        print("OK")
    '''))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "OK", done.stdout + done.stderr
