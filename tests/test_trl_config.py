"""TRL GRPOConfig's names in a ppojax config, and the objective combinations refused before compute.

- a config written for TRL 1.12's GRPOTrainer (configs/trl_grpo.yaml) loads unchanged, with TRL's meanings: the
  keys it sets, and GRPOConfig's defaults for those it leaves out; a config without TRL's loss_type is unchanged;
- beta is read as the KL its file is written for (GRPO: in the loss; RLOO: in the reward), refused otherwise;
- every GRPOConfig key is a field, an alias, or refused with what to set instead;
- each combination an objective cannot take is refused with the fix, in one ConfigError, before any model loads.
"""
import dataclasses
from pathlib import Path

import pytest

from ppojax.trainer import config as C
from ppojax.trainer.config import ConfigError, PPOConfig

REPO = Path(__file__).resolve().parents[1]

# TRL 1.12's GRPOConfig fields beyond transformers' TrainingArguments (trl/trainer/grpo_config.py).
TRL_1_12_GRPO = """model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout cast_lm_head_to_fp32
num_generations num_generations_eval max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of
generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs chat_template_kwargs
repetition_penalty cache_implementation use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode
vllm_structured_outputs_regex vllm_server_base_url vllm_server_host vllm_server_port vllm_server_timeout
vllm_group_port vllm_gpu_memory_utilization vllm_max_model_length vllm_tensor_parallel_size beta num_iterations epsilon
delta epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg
importance_sampling_level reward_weights multi_objective_aggregation scale_rewards loss_type mask_truncated_completions
sync_ref_model ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef use_adaptive_entropy
entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target max_tool_calling_iterations
vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_clip_max
vllm_importance_sampling_clip_min off_policy_mask_threshold use_bias_correction_kl log_completions log_multimodal
num_completions_to_print log_unique_prompts log_completions_hub_repo use_transformers_continuous_batching
transformers_continuous_batching_config use_transformers_paged vllm_importance_sampling_cap""".split()


def test_a_trl_grpo_config_loads_unchanged_with_trls_meanings():
    config = PPOConfig.from_yaml(REPO / "configs" / "trl_grpo.yaml")
    # the keys it sets, under TRL's names
    assert (config.loss_type, config.cliprange, config.cliprange_high, config.kl_loss_coef) == ("dapo", 0.2, 0.28, 0.0)
    assert (config.num_generations, config.response_length, config.num_ppo_epochs) == (4, 16, 2)
    assert (config.importance_sampling_level, config.top_entropy_quantile, config.mask_truncated_completions) == (
        "token", 0.2, True)
    assert config.use_bias_correction_kl and config.reward_funcs == ["vader"] and config.soft_punish_cache == 4
    assert config.derived().batch_size == 16  # per_device_train_batch_size x accumulation, as TRL
    # what it leaves out: GRPOConfig's defaults where ppojax's differ
    assert (config.advantage_estimator, config.kl_coef, config.kl_loss_type, config.stop_token) == (
        "grpo", 0.0, "k3", "eos")
    assert config.max_grad_norm == C.TRL_GRPO_DEFAULTS["max_grad_norm"] == 1.0


def test_only_trls_loss_type_makes_a_grpo_trainer_config():
    ppojax_default = PPOConfig.from_dict({})
    for values in ({"loss_type": "ppo"}, {"epsilon": 0.1}, {"importance_sampling_level": "sequence"}):
        config = PPOConfig.from_dict(values)
        assert (config.advantage_estimator, config.kl_coef, config.num_generations, config.response_length) == (
            ppojax_default.advantage_estimator, ppojax_default.kl_coef, 1, ppojax_default.response_length), values
    grpo = PPOConfig.from_dict({"loss_type": "grpo"})
    assert {f: getattr(grpo, f) for f in C.TRL_GRPO_DEFAULTS} == C.TRL_GRPO_DEFAULTS
    gmpo = PPOConfig.from_dict({"loss_type": "gmpo"})
    assert gmpo.cliprange == 0.4 and PPOConfig.from_dict({"loss_type": "gmpo", "epsilon": 0.3}).cliprange == 0.3
    # a field given under any of its names is the file's own
    kept = PPOConfig.from_dict({"loss_type": "grpo", "adv_estimator": "rloo", "num_iterations": 3, "stop_token_id": 7,
                                "max_completion_length": 10})
    assert (kept.advantage_estimator, kept.num_ppo_epochs, kept.stop_token, kept.stop_token_id,
            kept.response_length) == ("rloo", 3, None, 7, 10)
    # a saved ppojax config (every field) reads back as it was
    saved = PPOConfig.from_dict({"loss_type": "cispo", "advantage_estimator": "gae", "epsilon_high": 5.0}).to_dict()
    assert PPOConfig.from_dict(saved).to_dict() == saved


def test_beta_is_read_as_the_kl_its_file_means():
    assert PPOConfig.from_dict({"loss_type": "dapo", "beta": 0.04}).kl_loss_coef == 0.04
    grpo = PPOConfig.from_dict({"advantage_estimator": "grpo", "num_generations": 4, "beta": 0.02})
    assert (grpo.kl_loss_coef, grpo.kl_coef) == (0.02, 0.05)  # no TRL defaults without loss_type
    rloo = PPOConfig.from_dict({"advantage_estimator": "rloo", "num_generations": 4, "beta": 0.03})
    assert (rloo.kl_coef, rloo.kl_loss_coef) == (0.03, 0.0)
    with pytest.raises(ConfigError, match="TRL's GRPO beta is the KL IN THE LOSS: kl_loss_coef"):
        PPOConfig.from_dict({"beta": 0.04})
    with pytest.raises(ConfigError, match="both set 'kl_loss_coef'"):
        PPOConfig.from_dict({"loss_type": "dapo", "beta": 0.04, "kl_loss_coef": 0.1})


def test_trls_value_spellings_and_verls_names():
    assert PPOConfig.from_dict({"loss_type": "dr_grpo", "scale_rewards": False}).scale_rewards == "none"
    assert PPOConfig.from_dict({"loss_type": "grpo", "scale_rewards": True}).scale_rewards == "group"
    config = PPOConfig.from_dict({"adv_estimator": "reinforce_plus_plus_baseline", "clip_ratio_c": 3.0})
    assert (config.advantage_estimator, config.dual_clip_c) == ("reinforce_pp_baseline", 3.0)
    assert PPOConfig.from_dict({"adv_estimator": "reinforce_plus_plus"}).advantage_estimator == "reinforce_pp"
    assert PPOConfig.from_dict({"loss_agg_mode": "seq-mean-token-sum"}).loss_agg_mode == "seq-mean-token-sum"


def test_every_grpo_config_key_is_a_field_an_alias_or_explained():
    accepted = set(C.FIELD_NAMES) | set(C.LEGACY_ALIASES)
    missing = [k for k in TRL_1_12_GRPO if k not in accepted and k not in C.FOREIGN_KEYS]
    assert not missing, missing
    assert not set(C.FOREIGN_KEYS) & accepted
    with pytest.raises(ConfigError) as err:
        PPOConfig.from_dict({"loss_type": "dapo", "use_vllm": False, "min_p": 0.1})
    assert "'use_vllm' (TRL / transformers): ppojax samples with its own compiled decode loop" in str(err.value)
    assert "'min_p' (TRL / transformers): the sampling options are temperature" in str(err.value)


def test_help_and_the_reference_list_the_other_names():
    rows = dict(C.alias_help())
    assert rows["epsilon_high"] == "cliprange_high" and rows["num_iterations"] == "num_ppo_epochs"
    assert rows["max_completion_length"] == "response_length" and "kl_loss_coef" in rows["beta"]
    markdown = C.configuration_markdown()
    assert "| `delta` | dual_clip_c |" in markdown and "### A TRL GRPOTrainer config" in markdown
    assert "num_ppo_epochs: 1" in C.trl_grpo_reading()


GROUPS = dict(num_generations=4, batch_size=16)


@pytest.mark.parametrize("values, message", [
    (dict(loss_type="vespo", importance_sampling_level="sequence"),
     "importance_sampling_level='sequence' with loss_type='vespo': it takes 'token' only: VESPO weighs"),
    (dict(loss_type="gmpo", importance_sampling_level="sequence"),
     "with loss_type='gmpo': it takes 'token' only: GMPO's ratio is already the geometric mean"),
    (dict(loss_type="luspo"), "it takes 'sequence' only: LUSPO is GSPO's sequence-level objective"),
    (dict(loss_type="grpo", loss_agg_mode="seq-mean-token-sum-norm"),
     "loss_agg_mode='seq-mean-token-sum-norm' with loss_type='grpo', which averages by 'seq-mean-token-mean' "
     "itself; remove loss_agg_mode, or use loss_type: ppo"),
    (dict(loss_type="cispo", delta=1.5), "dual_clip_c=1.5 is not read by loss_type='cispo' (only by ppo, grpo"),
    (dict(loss_type="dapo", sapo_temperature_neg=2.0), "sapo_temperature_neg=2.0 is not read by loss_type='dapo'"),
    (dict(vespo_k_pos=1.0), "vespo_k_pos=1.0 is not read by loss_type='ppo' (only by vespo)"),
    (dict(loss_type="gmpo", advantage_estimator="gae"),
     "loss_type='gmpo' reads one advantage per sequence, but advantage_estimator='gae' gives each token its own"),
    (dict(loss_type="vespo", advantage_estimator="reinforce_pp"), "use advantage_estimator: grpo, rloo or "
                                                                   "reinforce_pp_baseline"),
    (dict(top_entropy_quantile=1.5), "top_entropy_quantile=1.5: expected a number in [0, 1]"),
    (dict(top_entropy_quantile=-0.1), "top_entropy_quantile=-0.1: expected a number in [0, 1]"),
    (dict(top_entropy_quantile=0.2, padding_free=True), "set padding_free: false or top_entropy_quantile: 1.0"),
    (dict(mask_truncated_completions=True), "set stop_token: eos (or stop_token_id), or remove "
                                            "mask_truncated_completions"),
    (dict(importance_sampling_level="segment"), "importance_sampling_level='segment': expected 'token' or "
                                                "'sequence'"),
    (dict(loss_type="ppo2"), "loss_type='ppo2': expected one of 'ppo', 'grpo'"),
    (dict(multi_objective_aggregation="normalize_then_sum"),
     "multi_objective_aggregation='normalize_then_sum' only applies to advantage_estimator: grpo"),
    (dict(advantage_estimator="grpo", multi_objective_aggregation="normalize_then_sum", scale_rewards="batch",
          **GROUPS), "scale_rewards='batch' plays no part with multi_objective_aggregation='normalize_then_sum'"),
    (dict(advantage_estimator="grpo", multi_objective_aggregation="normalize_then_sum", soft_punish_cache=8,
          **GROUPS), "soft_punish_cache=8 adjusts the summed score"),
    (dict(soft_punish_cache=53), "soft_punish_cache=53 is not below response_length=53"),
    (dict(sapo_temperature_pos=0.0, loss_type="sapo"), "sapo_temperature_pos=0.0: expected a number > 0"),
    (dict(loss_type="dapo", num_generations=1), "needs num_generations >= 2 (got 1)"),
])
def test_bad_objective_combinations_are_refused_with_the_fix(values, message):
    with pytest.raises(ConfigError) as err:
        PPOConfig.from_dict(values)
    assert message in str(err.value), str(err.value)


def test_the_objective_fields_are_in_the_objective_section():
    section = next(s for s in C.SECTIONS if s.__name__ == "ObjectiveSettings")
    assert {"loss_type", "importance_sampling_level", "top_entropy_quantile", "mask_truncated_completions",
            "use_bias_correction_kl", "multi_objective_aggregation", "soft_punish_cache"} <= {
        f.name for f in dataclasses.fields(section)}
