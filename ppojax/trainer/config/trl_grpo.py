"""Reading a config written for TRL 1.12's GRPOTrainer (docs/configuration.md, "Other libraries' names").

GRPOConfig's objective options are ppojax fields under TRL's own names (``loss_type``, ``importance_sampling_level``,
``top_entropy_quantile``, ...) or aliases of ppojax's (``epsilon``, ``delta``, ``num_iterations``,
``max_completion_length``, in ``names.LEGACY_ALIASES``). Two things need the file as a whole:

- A file that sets ``loss_type`` to one of TRL's (:data:`TRL_LOSS_TYPES`; ppojax's own objective is ``ppo``) is
  a GRPOTrainer config: the fields it leaves out take GRPOConfig's defaults where ppojax's differ
  (:data:`TRL_GRPO_DEFAULTS`), so it trains what it trained under TRL. A file without ``loss_type`` keeps
  ppojax's defaults.
- ``beta`` is the KL coefficient of TRL's GRPO (in the loss: ``kl_loss_coef``) and of TRL's RLOO (in the reward:
  ``kl_coef``): read as the one its file is written for, and refused where that is not said.

:data:`GRPO_FOREIGN_KEYS` says, for GRPOConfig's keys ppojax has no field for, what to set instead.
"""
from __future__ import annotations

from typing import Any

TRL_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo", "gmpo")
"""GRPOConfig's loss types, and GMPO (TRL's experimental GMPOTrainer)."""

TRL_GRPO_DEFAULTS: dict[str, Any] = {
    "advantage_estimator": "grpo",   # GRPOTrainer's group-relative advantages
    "kl_coef": 0.0,                  # GRPOTrainer has no KL in the reward (beta is in the loss)
    "kl_loss_type": "k3",            # the estimator of GRPOTrainer's KL term
    "use_bias_correction_kl": True,  # GRPOConfig's default
    "num_generations": 8,
    "response_length": 512,          # max_completion_length
    "num_ppo_epochs": 1,             # num_iterations (GRPO's mu)
    "learning_rate": 1e-6,
    "temperature": 1.0,
    "max_grad_norm": 1.0,            # transformers' TrainingArguments
    "num_train_epochs": 3.0,         # transformers' TrainingArguments
    "stop_token": "eos",             # GRPOTrainer's generation always ends at EOS
}
"""ppojax field -> the value a GRPOTrainer config means when it leaves the field (and its TRL name) out."""

GMPO_DEFAULTS: dict[str, Any] = {"cliprange": 0.4}
"""TRL's GMPOConfig: epsilon is a log-ratio bound, 0.4 by default."""


_SET_BY = {"stop_token": ("stop_token_id",)}  # fields another field stands in for


def _given(field: str, values: dict, aliases: dict[str, str]) -> bool:
    """Whether ``values`` sets ``field`` under its name or one of its aliases (or a field standing in for it)."""
    fields = (field, *_SET_BY.get(field, ()))
    return any(key in fields or aliases.get(key) in fields for key in values)


def read_trl_names(values: dict[str, Any], aliases: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(values with GRPOConfig's defaults added when the file is a GRPOTrainer config, the aliases to read them
    with: ``aliases`` plus ``beta``'s meaning where the file says it). The caller refuses an unresolved ``beta``
    (``FOREIGN_KEYS``)."""
    values, aliases = dict(values), dict(aliases)
    grpo_trainer = values.get("loss_type") in TRL_LOSS_TYPES
    estimator = next((values[key] for key in ("advantage_estimator", "adv_estimator") if key in values), None)
    if "beta" in values and (grpo_trainer or estimator == "grpo"):
        aliases["beta"] = "kl_loss_coef"
    elif "beta" in values and estimator == "rloo":
        aliases["beta"] = "kl_coef"
    if grpo_trainer:
        defaults = {**TRL_GRPO_DEFAULTS, **(GMPO_DEFAULTS if values["loss_type"] == "gmpo" else {})}
        for field, value in defaults.items():
            if not _given(field, values, aliases):
                values[field] = value
    return values, aliases


def _same(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


GRPO_FOREIGN_KEYS: dict[str, str] = {
    **_same("ppojax samples with its own compiled decode loop, not vLLM or transformers' generate; remove it",
            "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_structured_outputs_regex",
            "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
            "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_tensor_parallel_size",
            "use_transformers_continuous_batching", "transformers_continuous_batching_config",
            "use_transformers_paged", "cache_implementation", "ds3_gather_for_generation"),
    **_same("the sampling options are temperature, top_k, top_p and the stop token; remove it",
            "min_p", "repetition_penalty", "generation_kwargs"),
    **_same("a derived size: each update samples batch_size rows (batch_size / num_generations prompts) and takes "
            "num_ppo_epochs x num_mini_batches optimizer steps on them; set batch_size and num_mini_batches",
            "generation_batch_size", "steps_per_generation"),
    "num_generations_eval": "held-out prompts are scored once each with near-greedy decoding; set num_eval_prompts",
    "model_init_kwargs": "models load from model_name_or_path in the precision set by precision; remove it",
    "trust_remote_code": "ppojax runs its own model code for the model families it supports, never a checkpoint's; "
                         "remove it",
    "router_aux_loss_coef": "ppojax trains dense models only; remove it",
    "cast_lm_head_to_fp32": "log-softmax and losses are float32 whatever the precision; remove it",
    "disable_dropout": "ppojax's policy forwards never use dropout; remove it",
    "shuffle_dataset": "prompts are always shuffled (by seed); remove it",
    "pad_to_multiple_of": "shapes are fixed by max_prompt_length and response_length; remove it",
    "chat_template_kwargs": "set chat_template: true to wrap prompts in the tokenizer's chat template",
    **_same("no reference-model syncing: the reference stays the initial policy; remove it",
            "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps"),
    **_same("no adaptive entropy control: entropy_coef is a fixed weight; remove it",
            "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target"),
    **_same("sample completions are printed num_sample_generations times during training; set that instead",
            "log_completions", "log_multimodal", "num_completions_to_print", "log_unique_prompts",
            "log_completions_hub_repo"),
}
"""TRL 1.12 GRPOConfig keys that are not ppojax fields: what to set instead, or why ppojax has no such knob."""
