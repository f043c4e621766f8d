"""The keys a config may be given under: legacy (TRL <= 0.11) and other libraries' names of ppojax's fields
(LEGACY_ALIASES), mapped on load; the keys of TRL and transformers' ``TrainingArguments`` ppojax has no field for
(FOREIGN_KEYS), refused with what to set instead; any other unknown key, refused with the closest field name."""
from __future__ import annotations

import difflib
from typing import Any

from ppojax.errors import ConfigError
from ppojax.trainer.config.checks import checked_value
from ppojax.trainer.config.schema import FIELD_NAMES
from ppojax.trainer.config.trl_grpo import GRPO_FOREIGN_KEYS, read_trl_names

# Legacy (TRL <= 0.11) and TRL-alternative names -> ppojax's field names.
LEGACY_ALIASES = {
    "ppo_epochs": "num_ppo_epochs",
    "init_kl_coef": "kl_coef",
    "adap_kl_ctrl": "adaptive_kl",
    "target": "target_kl_for_adaptive",
    "kl_penalty": "kl_estimator",
    "model_name": "model_name_or_path",
    "sft_model_path": "model_name_or_path",
    "query_dataset": "dataset",
    "exp_name": "run_name",
    "steps": "total_episodes",
    "forward_batch_size": "local_rollout_forward_batch_size",
    "ent_coef": "entropy_coef",
    "dtype": "precision",
    "rloo_k": "num_generations",           # legacy TRL RLOO
    "epsilon": "cliprange",                # TRL GRPO / RLOO
    "epsilon_high": "cliprange_high",      # TRL GRPO / RLOO
    "clip_ratio_low": "cliprange_low",     # verl
    "clip_ratio_high": "cliprange_high",   # verl
    "clip_ratio_c": "dual_clip_c",         # verl
    "delta": "dual_clip_c",                # TRL GRPO's two-sided clipping bound
    "adv_estimator": "advantage_estimator",  # verl
    "num_iterations": "num_ppo_epochs",    # TRL GRPO / RLOO's mu
    "max_completion_length": "response_length",  # TRL GRPO / RLOO
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",  # TRL GRPO's deprecated name
}


def _same(reason: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, reason)


_NOT_TRAINER = ("a transformers Trainer option with no ppojax counterpart (ppojax is not built on "
                "transformers' Trainer); remove it")

FOREIGN_KEYS: dict[str, str] = {
    # precision
    "bf16": "use precision: mixed (float32 master weights, bfloat16 matmuls) or precision: bfloat16 (bf16: false is "
            "precision: float32, the default)",
    "fp16": "ppojax has no float16; use precision: mixed or bfloat16 (or float32)",
    **_same("evaluation runs in the training dtype; set dtype (float32 or bfloat16)",
            "bf16_full_eval", "fp16_full_eval", "half_precision_backend", "fp16_opt_level", "fp16_backend"),
    "tf32": "no such knob: XLA chooses matmul precision; set dtype (float32 or bfloat16)",
    # run length, optimizer
    "max_steps": "set total_episodes (updates x batch_size prompts) or num_train_epochs",
    "warmup_ratio": "set warmup_steps (in updates)",
    **_same("ppojax uses AdamW (optax): set adam_beta1, adam_beta2, adam_epsilon, weight_decay",
            "optim", "optim_args", "optim_target_modules"),
    "lr_scheduler_kwargs": "no scheduler arguments: lr_scheduler_type is 'linear' or 'constant', with warmup_steps",
    # logging
    "log_with": "use report_to (tensorboard, wandb, none or a list)",
    **_same("no project field: wandb reads its project from the WANDB_PROJECT environment variable; run_name "
            "names the run", "tracker_project_name", "project"),
    **_same("ppojax does not use accelerate; report_to picks the metric sinks",
            "tracker_kwargs", "accelerator_kwargs", "project_kwargs", "accelerator_config"),
    "beta": "TRL's GRPO beta is the KL IN THE LOSS: kl_loss_coef; TRL's RLOO/PPO beta is the KL in the reward: "
            "kl_coef. Set the one you mean (beta is read as the first in a file that sets TRL's loss_type or "
            "advantage_estimator: grpo, as the second with advantage_estimator: rloo)",
    "logging_dir": "logs are written under output_dir (metrics.jsonl, tensorboard/); set output_dir",
    "logging_strategy": "use logging_steps (log every N updates)",
    **_same("no such knob: ppojax logs on process 0 every logging_steps updates",
            "logging_first_step", "log_level", "log_level_replica", "log_on_each_node", "disable_tqdm",
            "logging_nan_inf_filter", "include_num_input_tokens_seen", "include_tokens_per_second"),
    # evaluation
    **_same("ppojax scores num_eval_prompts held-out prompts before and after training, and every eval_steps "
            "updates (in batches of batch_size); set num_eval_prompts and eval_steps", "eval_strategy",
            "evaluation_strategy", "do_eval",
            "eval_on_start", "eval_delay", "per_device_eval_batch_size", "eval_accumulation_steps",
            "eval_do_concat_batches", "eval_use_gather_object", "batch_eval_metrics", "include_for_metrics",
            "include_inputs_for_metrics", "prediction_loss_only", "do_predict", "per_gpu_eval_batch_size"),
    # checkpoints, hub
    "save_strategy": "use save_steps (a checkpoint every N updates; 0: only at the end)",
    **_same("checkpoints hold the whole training state (to resume); the trained policy is written in Hugging "
            "Face format to output_dir/policy", "save_only_model", "save_on_each_node", "save_safetensors",
            "enable_jit_checkpoint", "restore_callback_states_from_checkpoint"),
    "resume_from_checkpoint": "use resume (auto, or a checkpoint path)",
    **_same("no best-model selection: the policy after the last update is saved",
            "load_best_model_at_end", "metric_for_best_model", "greater_is_better"),
    **_same("ppojax does not upload: the trained policy is saved in Hugging Face format in output_dir/policy "
            "(upload it with `hf upload`)", "push_to_hub", "hub_model_id", "hub_token", "hub_private_repo",
            "hub_strategy", "hub_always_push", "hub_revision", "push_to_hub_if_best_kwargs",
            "push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token"),
    # memory and compilation
    **_same("no such knob: log-prob logits are computed in chunks recomputed in the backward pass "
            "(logits_chunk_size); layer rematerialisation is not exposed", "gradient_checkpointing",
            "gradient_checkpointing_kwargs", "activation_checkpointing", "activation_checkpointing_kwargs"),
    **_same("no such knob: every step is compiled by XLA (jax.jit); compilation_cache_dir keeps the programs",
            "torch_compile", "torch_compile_backend", "torch_compile_mode", "torchdynamo", "jit_mode_eval"),
    **_same("a PyTorch option with no JAX counterpart; remove it", "use_liger_kernel", "liger_kernel_config",
            "torch_empty_cache_steps", "optimize_cuda_cache", "optimize_device_cache", "use_cache", "use_ipex",
            "use_mps_device"),
    **_same("JAX picks the devices; set JAX_PLATFORMS=cpu in the environment to force the CPU",
            "use_cpu", "no_cuda"),
    "auto_find_batch_size": "no such knob: set batch_size (and local_rollout_forward_batch_size, "
                            "logits_chunk_size to bound memory)",
    # distribution
    **_same("set the device mesh: mesh_data, mesh_fsdp, mesh_tensor (multi-host runs use jax.distributed)",
            "deepspeed", "fsdp", "fsdp_config", "ds3_gather_for_generation", "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph", "ddp_backend", "ddp_timeout",
            "local_rank", "parallelism_config", "tpu_num_cores", "sharded_ddp"),
    # sizes TRL derives
    **_same("a derived size: set batch_size, num_mini_batches and gradient_accumulation_steps (and the mesh)",
            "world_size", "num_total_batches", "micro_batch_size", "local_batch_size", "local_mini_batch_size",
            "backward_batch_size", "global_backward_batch_size", "global_batch_size", "per_gpu_train_batch_size"),
    # data
    **_same("no such knob: prompts are tokenised once, in memory; dataset_text_field names the prompt column",
            "dataset_num_proc", "dataloader_drop_last", "dataloader_num_workers", "dataloader_pin_memory",
            "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
            "dataloader_in_order", "remove_unused_columns", "label_names", "length_column_name",
            "group_by_length", "train_sampling_strategy"),
    **_same("seed drives every random stream (data order included) and runs are deterministic; set seed",
            "data_seed", "full_determinism"),
    # models
    **_same("no named adapters: with lora_r > 0 the policy is the base model + ppojax's LoRA adapters and the "
            "reference is the same base with the adapters off (TRL's default for a PEFT policy)",
            "model_adapter_name", "ref_adapter_name", "is_peft_model"),
    **_same("set lora_r > 0 (e.g. 16) to train LoRA adapters, with lora_alpha, lora_dropout and "
            "lora_target_modules (PEFT's LoraConfig(r, lora_alpha, lora_dropout, target_modules))",
            "use_peft", "peft_config", "lora_rank"),
    **_same("not supported: ppojax's adapters are plain LoRA (alpha / r scaling) on the projections named in "
            "lora_target_modules; remove it", "use_rslora", "use_dora", "lora_modules_to_save", "lora_task_type",
            "load_in_4bit", "load_in_8bit"),
    "reward_model": "use reward_model_path (a sequence-classification checkpoint) or reward_function",
    "is_encoder_decoder": "ppojax trains causal LMs only",
    # the rest of TrainingArguments and legacy TRL
    **_same(_NOT_TRAINER, "label_smoothing_factor", "neftune_noise_alpha", "average_tokens_across_devices",
            "debug", "skip_memory_metrics", "do_train", "ignore_data_skip", "trackio_space_id",
            "trackio_bucket_id", "trackio_static_space_id", "past_index", "ray_scope", "mp_parameters",
            "tpu_metrics_debug", "dispatch_batches", "split_batches", "task_name", "compare_steps", "tracker",
            "hub_private", "use_legacy_prediction_loop"),
    **GRPO_FOREIGN_KEYS,
}
"""Keys of TRL's PPOConfig (1.12 and legacy) and transformers' TrainingArguments that are not ppojax fields:
what to set instead, or why ppojax has no such knob."""


def _unknown_key_line(key) -> str:
    text = str(key)
    if text in FOREIGN_KEYS:
        return f"{text!r} (TRL / transformers): {FOREIGN_KEYS[text]}."
    close = difflib.get_close_matches(text, sorted(set(FIELD_NAMES) | set(LEGACY_ALIASES)), n=1)
    return f"{text!r}: Did you mean {close[0]!r}?" if close else f"{text!r}: no field has a similar name."


def normalise_keys(values: dict[str, Any]) -> dict[str, Any]:
    """Map legacy names to fields, read a TRL GRPOTrainer config as one (``trl_grpo.read_trl_names``), derive
    num_mini_batches from a legacy mini_batch_size, and refuse unknown keys (all of them in one message, each with
    its replacement or closest valid name)."""
    known = set(FIELD_NAMES)
    out: dict[str, Any] = {}
    values, aliases = read_trl_names(values, LEGACY_ALIASES)
    mini_batch_size = values.pop("mini_batch_size", None)
    unknown = [key for key in values if aliases.get(key, key) not in known]
    if unknown:
        lines = [_unknown_key_line(key) for key in unknown]
        head = (f"Unknown config key {lines[0]}" if len(lines) == 1
                else f"{len(lines)} unknown config keys:\n" + "\n".join("  " + line for line in lines))
        raise ConfigError(f"{head}\n`ppojax train --help` lists every field.")
    given_as: dict[str, str] = {}
    for key, value in values.items():
        name = aliases.get(key, key)
        if name in out and out[name] != value:
            raise ConfigError(f"{given_as[name]}={out[name]!r} and {key}={value!r} both set {name!r} (one is its "
                              "legacy name); keep one of them.")
        out[name], given_as[name] = value, key
    if mini_batch_size is not None:
        mini = mini_batch_size
        if isinstance(mini, bool) or not isinstance(mini, int) or mini < 1:
            raise ConfigError(f"mini_batch_size={mini!r} (legacy): expected an integer >= 1. Fix: set it to the "
                              "prompts per optimizer step, or use num_mini_batches instead.")
        batch = checked_value("batch_size", out.get("batch_size"))
        if batch is None or batch % mini:
            raise ConfigError(f"mini_batch_size={mini} (legacy) needs a batch_size that is a multiple "
                              f"of it; got batch_size={batch}. Set batch_size (e.g. {4 * mini}) or use "
                              "num_mini_batches instead.")
        out["num_mini_batches"] = batch // mini
    return out


def field_names() -> list[str]:
    return list(FIELD_NAMES)
