"""Checks of a run's config that need no weights: what the models' ``config.json`` files, the prompt file and the
device count can refute, made before anything is loaded (``ppojax train`` runs them before claiming its output
directory). Every user mistake found is a ``ConfigError``, which ``ppojax train`` prints without a traceback.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

import jax

from ppojax import backends
from ppojax.assets import smollm2_checkpoint
from ppojax.models import load_config
from ppojax.models.families.keys import hf_num_labels
from ppojax.models.lora import LoraSpec, resolve_target_modules
from ppojax import parallel
from ppojax.trainer.config import IN_PLACE_MATMULS, ConfigError, PPOConfig
from ppojax.trainer.prompt_sources import (BUILTIN_ARITHMETIC, BUILTIN_GUESS_NUMBER, BUILTIN_MOVIE_REVIEWS,
                                           arithmetic_split, guess_number_split, load_prompt_dataset)
from ppojax.trainer.run_rewards import as_config_error, resolve_reward_function, reward_field


def resolve_model_path(path: str) -> str:
    """'smollm2' -> the bundled SmolLM2-135M-Instruct checkpoint (converted once); otherwise the path itself."""
    if path == "smollm2":
        return str(smollm2_checkpoint())
    return path


def model_config_of(role: str, path):
    try:
        return load_config(path)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"could not read the {role}'s config from {str(path)!r}: {err}") from err


def _hf_config(path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def preflight(config: PPOConfig, *, policy_given: bool = False, reward_given: bool = False,
              dataset_given: bool = False, functions_given: bool = False) -> None:
    """Everything about ``config`` that the models' ``config.json`` files, the prompt file and the device count
    can refute, before any weights are loaded (``ppojax train`` calls it before claiming output_dir).
    ``*_given``: the caller passed that model (or the reward functions) as an object (the config's is not used);
    ``dataset_given``: the caller has the prompts, or reads them itself next (``build_run`` does)."""
    try:
        mesh_shape = parallel.mesh_shape(config.mesh_data, config.mesh_fsdp, config.mesh_tensor,
                                         num_devices=jax.device_count())
    except ValueError as err:
        raise ConfigError(f"{err} (this process sees {jax.device_count()} {jax.default_backend()} device(s); "
                          "with several processes, every process's devices count).") from err
    if config.export_check and importlib.util.find_spec("torch") is None:
        raise ConfigError("export_check=True needs torch (transformers loads the exported policy with it); install "
                          "it (pip install torch==2.13.0 takes the CPU wheel) or set export_check: null (auto).")
    data_parallel = mesh_shape[0] * mesh_shape[1]
    sizes = config.derived(data_parallel)
    rows = config.local_rollout_forward_batch_size
    if rows is not None and sizes.batch_size % rows:
        raise ConfigError(f"local_rollout_forward_batch_size={rows} does not divide batch_size={sizes.batch_size} "
                          f"(the rollout forwards the batch in slices of that many rows); pick a divisor of "
                          f"{sizes.batch_size}.")
    if not policy_given:
        path = resolve_model_path(config.model_name_or_path)
        policy = model_config_of("policy", path)
        length = config.max_prompt_length + config.response_length
        if length > policy.max_position_embeddings:
            raise ConfigError(
                f"max_prompt_length + response_length = {config.max_prompt_length} + {config.response_length} = "
                f"{length} exceeds the policy's max_position_embeddings={policy.max_position_embeddings} "
                f"({path}/config.json); shorten the prompts or the responses.")
        lora_spec_from_config(config, policy)  # LoRA target modules the policy's family has
        if config.stop_token_id is not None and config.stop_token_id >= policy.vocab_size:
            raise ConfigError(f"stop_token_id={config.stop_token_id} is outside the policy's vocabulary "
                              f"(vocab_size={policy.vocab_size}): it can never be sampled, so no response would "
                              "ever stop. Use a token id of the tokenizer (e.g. stop_token: eos).")
    if not reward_given and not functions_given:
        for spec in config.reward_function_specs:
            resolve_reward_function(spec, reward_field(config))  # importable, and a function
    if config.reward_model_path is not None and not reward_given:
        hf = _hf_config(config.reward_model_path)
        model_config_of("reward model", config.reward_model_path)  # exists, parses, supported architecture
        architectures = hf.get("architectures") or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(
                f"reward_model_path={config.reward_model_path!r} is a {', '.join(architectures)} checkpoint, not a "
                "reward model: it has no trained score head, so its scores would come from a random one. Use a "
                "sequence-classification checkpoint (XForSequenceClassification with num_labels=1, e.g. from "
                "TRL's RewardTrainer), or a reward_function.")
        labels = hf_num_labels(hf)
        label = config.reward_model_label
        if labels != 1 and label is None:
            names = ", ".join(f"{i} = {name}" for i, name in
                              sorted((hf.get("id2label") or {}).items(), key=lambda item: int(item[0])))
            raise ConfigError(
                f"reward_model_path={config.reward_model_path!r} is a classifier with {labels} labels"
                f"{f' ({names})' if names else ''}; a reward model has ONE output (num_labels=1), the score. To "
                f"score with one label's logit, set reward_model_label to its index (e.g. "
                f"reward_model_label: {labels - 1}).")
        if label is not None and label >= labels:
            raise ConfigError(f"reward_model_label={label} is not an output of reward_model_path="
                              f"{config.reward_model_path!r}, which has {labels} label(s); use 0 to {labels - 1}.")
    if config.value_model_path is not None:
        model_config_of("value model", config.value_model_path)
    if config.dataset and not dataset_given and dataset_source(config) != BUILTIN_MOVIE_REVIEWS:
        # a prompt file is read in a moment; a malformed one must not cost a model load first
        as_config_error(load_prompt_dataset, dataset_source(config), column=config.dataset_text_field)


def lora_spec_from_config(config, model_config) -> Optional[LoraSpec]:
    """The policy's LoRA adapters from ``lora_*`` (None when lora_r = 0); target names checked against the
    policy's family (a ConfigError naming the bad names and the ones the model has)."""
    if config.lora_r == 0:
        return None
    targets = as_config_error(resolve_target_modules, model_config, config.lora_target_modules)
    return LoraSpec(config.lora_r, config.lora_alpha, targets, config.lora_dropout)


def check_matmul_implementation(config, mesh) -> None:
    """An in-place matmul_implementation ('onednn', 'onednn_primitive', 'mkl') must be able to run here: one CPU device,
    the handlers built (before any weight is loaded; 'auto' falls back to XLA's dots silently)."""
    if config.matmul_implementation not in IN_PLACE_MATMULS:
        return
    why = backends.matmul_unavailable_reason(config.matmul_implementation,
                                             mesh.devices.size if mesh is not None else jax.device_count())
    if why:
        raise ConfigError(f"matmul_implementation={config.matmul_implementation!r} cannot be used: {why}. Set "
                          "matmul_implementation: auto (oneDNN where it can run, XLA's dots elsewhere) or xla.")


def dataset_source(config, name=None):
    """A dataset field's value -> what ``load_prompt_table`` reads (built-in names resolved)."""
    name = config.dataset if name is None else name
    if name == "movie_reviews":
        return BUILTIN_MOVIE_REVIEWS
    if name in BUILTIN_ARITHMETIC:
        return arithmetic_split(name)
    if name in BUILTIN_GUESS_NUMBER:
        return guess_number_split(name)
    return name

