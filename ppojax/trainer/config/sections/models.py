"""The models section (the policy, the reward sources, the value model, precision and the kernels that run
them) and the LoRA section (the policy's adapters)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ppojax.trainer.config.fields import (IGNORED, MAY_CHANGE, MUST_MATCH, NON_EMPTY, Rule, above, at_least, between,
                                          one_of, setting)

#: the models' `matmul_implementation` values (`ppojax.backends.cpu.stacked_matmul.IMPLEMENTATIONS`, spelled here
#: without jax): the in-place ones name the GEMM library of ppojax's handlers
IN_PLACE_MATMULS = ("onednn", "onednn_primitive", "mkl")
MATMUL_IMPLEMENTATIONS = ("auto", "xla", *IN_PLACE_MATMULS)

BUILTIN_REWARDS = ("vader", "gsm8k_strict", "gsm8k_flexible", "boxed_answer", "answer_format")
"""Reward functions named without a module (``ppojax.trainer.build.BUILTIN_REWARD_FUNCTIONS`` maps them)."""


def _is_reward_function_spec(v: str) -> bool:
    module, sep, function = v.partition(":")
    return v in BUILTIN_REWARDS or (bool(sep) and bool(module.strip()) and bool(function.strip()))


def _are_reward_function_specs(v) -> bool:
    names = [v] if isinstance(v, str) else list(v)
    return bool(names) and all(isinstance(n, str) and _is_reward_function_spec(n) for n in names)


@dataclass
class ModelSettings:
    """Which models a run trains and scores with, and how they compute."""

    model_name_or_path: str = setting("smollm2", static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Policy: a local Hugging Face checkpoint directory, or 'smollm2' for the bundled SmolLM2-135M-Instruct."""
    reward_model_path: Optional[str] = setting(None, static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """A sequence-classification checkpoint scoring (prompt, completion); None when reward_function is set."""
    reward_model_label: Optional[int] = setting(None, static=False, on_resume=MUST_MATCH, rule=at_least(0))
    """Which output of a multi-label classifier reward model is the score (e.g. 1 = POSITIVE of a sentiment
    classifier: its logit); None: the reward model must have one output (num_labels=1, TRL's reward models)."""
    reward_function: Optional[str] = setting(None, static=True, on_resume=MUST_MATCH, rule=Rule(
        _is_reward_function_spec, "'vader' or 'module:function'",
        "Fix: name a function f(prompts, completions) -> floats as 'my_rewards:length_reward' (its module on "
        "PYTHONPATH), or use the built-in 'vader'."))
    """A Python reward 'module:function' taking (prompts, completions) -> floats, or 'vader' (sentiment).
    One function; reward_funcs takes several."""
    reward_funcs: Optional[Union[str, list[str]]] = setting(None, static=True, on_resume=MUST_MATCH, rule=Rule(
        _are_reward_function_specs, f"a list of reward functions: 'module:function' or one of {BUILTIN_REWARDS}",
        "Fix: list them as [my_rewards:correctness, answer_format] (modules on PYTHONPATH); each is called with "
        "prompts, completions, completion_ids and the dataset's columns as keyword arguments."))
    """Reward functions as TRL's GRPOTrainer takes them: each 'module:function' or built-in name is called with
    ``prompts``, ``completions``, ``completion_ids`` and every dataset column as keyword arguments (those its
    signature names) and returns a float per completion, or None where it does not apply. The score is their
    weighted sum (with reward_model_path's score, when set, as the last term); each is logged as
    ``rewards/<name>/mean`` and ``/std``. Built in: vader, gsm8k_strict, gsm8k_flexible, boxed_answer,
    answer_format (docs/rewards.md)."""
    reward_weights: Optional[list[float]] = setting(None, static=True, on_resume=MUST_MATCH)
    """One weight per reward (reward_funcs in order, then the reward model); None: all 1.0."""
    value_model_path: Optional[str] = setting(None, static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Value model checkpoint. None: TRL's choice (the reward model), or the policy backbone + a new head."""
    value_head: str = setting("separate", static=True, on_resume=MUST_MATCH, rule=one_of("separate", "policy"))
    """'separate': a value model of its own (TRL); 'policy': a Linear head on the policy backbone (legacy)."""
    value_head_init: str = setting("random", static=True, on_resume=IGNORED, rule=one_of("random", "zeros"))
    """How a value head the checkpoint lacks starts: 'random' (TRL's: torch.nn.Linear's init for the head on the
    policy, transformers' normal(0, initializer_range) for a separate model's score head) or 'zeros' (every value
    starts at 0, so the first advantages are the rewards' alone, not a random head's noise)."""
    precision: str = setting("float32", static=True, on_resume=MUST_MATCH,
                             rule=one_of("float32", "bfloat16", "mixed"))
    """Precision policy of every model: 'float32'; 'bfloat16' (parameters, optimizer moments and matmuls in
    bfloat16); 'mixed' (float32 parameters and optimizer moments, bfloat16 matmuls). Log-softmax, losses and
    statistics are float32 always. Legacy name: dtype."""
    remat: str = setting("dots", static=True, on_resume=MAY_CHANGE, rule=one_of("none", "full", "dots"))
    """Rematerialisation of the layers in the backward pass: 'dots' (keep the projection outputs, recompute
    attention and the element-wise ops: on XLA:CPU both faster and leaner than keeping everything, since it
    writes and reads fewer stacked activations), 'none' (keep every activation; TRL's layout), 'full' (keep
    only each layer's input, recompute the rest: least memory). The gradients are the same."""
    attention_implementation: str = setting("auto", static=True, on_resume=MAY_CHANGE,
                                            rule=one_of("auto", "xla", "cudnn", "pallas"))
    """'auto' (cuDNN's fused kernel on an NVIDIA GPU when it applies; on a TPU a Pallas kernel for decode attention,
    which reads the KV cache where it lies, and JAX's splash attention for forwards without a cache whose rows are
    a multiple of 128 tokens; XLA elsewhere), 'xla', 'cudnn', or 'pallas' ('auto' plus, on an NVIDIA GPU, the
    Pallas decode-attention kernel, not yet measured against XLA's there)."""
    matmul_implementation: str = setting("auto", static=True, on_resume=MAY_CHANGE,
                                         rule=one_of(*MATMUL_IMPLEMENTATIONS))
    """The layers' projections (and the LM head, at calls of at least 64 rows) of a float32 model on a single CPU
    device: 'auto' (oneDNN's GEMM reading each layer's kernel where it lies in the stacked weights, for models
    whose layers hold at least 1 M kernel elements and calls of at least 64 token rows, where the onednn-cpu-gomp
    wheel and a C++ compiler let ppojax build its handlers, on the GEMM library measured fastest on this CPU for
    each projection shape and product (forward, input gradient, weight gradient): timed once per CPU and shape, a
    few seconds, and recorded in ~/.cache/ppojax/matmul_library.json; a decode step's at most 8 rows by the
    handlers' own kernels on AVX-512 or AVX2 CPUs; else XLA's dots, which copy each layer's kernels out first), 'xla',
    'onednn' (whatever the size; an error where it cannot be had), 'onednn_primitive' (as 'onednn', through oneDNN's
    matmul primitive) or 'mkl' (as 'onednn', on MKL's GEMM as torch's x86 wheels carry it): 'auto' measures which is
    faster at the model's shapes (`python -m ppojax.backends.cpu.matmul_tuning` does it ahead). Other precisions,
    meshes and accelerators always use XLA's dots."""


@dataclass
class LoraSettings:
    """LoRA adapters on the policy (PEFT's LoraConfig(r, lora_alpha, lora_dropout, target_modules); TRL's
    --use_peft --lora_r ...)."""

    lora_r: int = setting(0, static=True, on_resume=MUST_MATCH, rule=at_least(0))
    """LoRA rank of the policy's adapters (PEFT's r; TRL's lora_r with use_peft). 0: no LoRA, every weight
    trains. r > 0: only the adapters train (the optimizer state holds only them), the reference is the same
    base weights with the adapters off (no copy of the policy), checkpoints hold the adapters (the base is
    reloaded from model_name_or_path), and the run writes the merged model to policy/ and a PEFT adapter
    directory to policy_adapter/. LoRA usually wants a ~100x larger learning_rate than full fine-tuning."""
    lora_alpha: float = setting(32.0, static=True, on_resume=MUST_MATCH, rule=above(0))
    """The adapters add (lora_alpha / lora_r) * x A B (PEFT's lora_alpha; TRL's default 32)."""
    lora_dropout: float = setting(0.0, static=False, on_resume=MAY_CHANGE, rule=between(0, 1, open_high=True))
    """PEFT's lora_dropout, written to the adapter's adapter_config.json. PPO itself runs the adapters without
    dropout, as TRL's PPOTrainer does (it turns off every dropout of its models, LoRA's included): dropout in
    the loss forward would move the probability ratio away from 1 before any update."""
    lora_target_modules: Union[str, list[str]] = setting("all-linear", static=True, on_resume=MUST_MATCH, rule=Rule(
        lambda v: v == "all-linear" if isinstance(v, str) else bool(v) and all(n.strip() for n in v),
        "'all-linear' or a non-empty list of module names",
        "Fix: list the modules to adapt, e.g. [q_proj, v_proj] (PEFT reads a single string as a regular "
        "expression; ppojax takes names), or use 'all-linear'."))
    """Modules to adapt, named as transformers / PEFT name them (PEFT's target_modules): Llama, Mistral, Qwen:
    q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; GPT-2: c_proj, c_fc; GPT-NeoX: dense,
    dense_h_to_4h, dense_4h_to_h. 'all-linear': all of them (never the LM head). Checked against the
    policy's family before any weights are loaded."""
