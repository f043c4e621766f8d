"""PPOConfig: every knob of a run, under TRL's names, checked when it is built.

Field names and defaults follow TRL 1.12's ``PPOConfig`` (docs/algorithm.md, "Defaults"); the legacy (TRL <= 0.11) names
are accepted as aliases and mapped on load, and the TRL / transformers ``TrainingArguments`` keys ppojax has no
field for are refused with the field that replaces them (``FOREIGN_KEYS``). Derived sizes (``batch_size``,
``mini_batch_size``, ``micro_batch_size``) are computed by :meth:`PPOConfig.derived`, never stored twice.

Every field is declared with :func:`setting`: its default, and metadata that the rest of ppojax derives from
instead of copying field lists by hand:

    static     the value shapes a compiled program (a ``jax.jit`` static argument): :meth:`static_settings`
    on_resume  'must_match' / 'may_change' / 'ignored' when a run resumes from a checkpoint:
               :func:`resume_compatibility`
    rule       what the value must satisfy beyond its type (checked with the type by ``__post_init__``)

and a docstring under it, its description (``ppojax train --help``, via :func:`field_help`).

Checks run when the config is built, in Python (``PPOConfig(...)``) and from YAML alike, before any model is
loaded: each field's type (no bool where a number is expected, no NaN/inf, no list where a number is
expected) and range, then the checks that need several fields. Every bad value is reported in one
``ConfigError`` naming the field, the value, what was expected and the fix. Checks that need the model or
the devices (vocabulary, position limit, mesh vs devices) happen when the trainer is built.

Batch sizes (global, over all devices and hosts):
    batch_size        prompts per rollout = one PPO update
                      (default: per_device_train_batch_size * gradient_accumulation_steps
                                * num_mini_batches * data-parallel world size, as TRL)
    mini_batch_size   batch_size / num_mini_batches: one optimizer step each
    micro_batch_size  mini_batch_size / gradient_accumulation_steps: one forward/backward each
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional, Union

import yaml

from ppojax.errors import ConfigError  # noqa: F401 - raised here, importable from here

#: the models' `matmul_implementation` values (`ppojax.backends.cpu.stacked_matmul.IMPLEMENTATIONS`, spelled here without
#: jax): the in-place ones name the GEMM library of ppojax's handlers
IN_PLACE_MATMULS = ("onednn", "onednn_primitive", "mkl")
MATMUL_IMPLEMENTATIONS = ("auto", "xla", *IN_PLACE_MATMULS)


# ----------------------------------------------------------------------------------------------------------
# field metadata

MUST_MATCH = "must_match"  # a resumed run refuses a different value (models, data, shapes, batch structure)
MAY_CHANGE = "may_change"  # a resumed run may use another value (reported): learning rate, clip ranges, ...
IGNORED = "ignored"        # where and how long to run, what to log
ON_RESUME = (MUST_MATCH, MAY_CHANGE, IGNORED)


@dataclass(frozen=True)
class Rule:
    """What a field's value must satisfy beyond its type.

    ok: the predicate (called on a value of the field's type, never on None).
    expected: what a good value is, e.g. '{a} >= 0' ({a} becomes 'an integer' or 'a number').
    fix: how to fix a bad value ('' for the generic "set NAME to EXPECTED").
    registry: for a name looked up in a registry of ppojax.core, the registered names (a function: a
        notebook may register more before the config is built; see ``registered``).
    """

    ok: Callable[[Any], bool]
    expected: str
    fix: str = ""
    registry: Optional[Callable[[], tuple]] = None


def at_least(low) -> Rule:
    return Rule(lambda v: v >= low, f"{{a}} >= {low}")


def above(low, fix: str = "") -> Rule:
    return Rule(lambda v: v > low, f"{{a}} > {low}", fix)


def between(low, high, *, open_low=False, open_high=False) -> Rule:
    def ok(v):
        return (low < v if open_low else low <= v) and (v < high if open_high else v <= high)
    return Rule(ok, f"{{a}} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}")


def one_of(*choices, fix: str = "") -> Rule:
    words = " or ".join(map(repr, choices)) if len(choices) <= 2 else "one of " + ", ".join(map(repr, choices))
    return Rule(lambda v: v in choices, words, fix)


NON_EMPTY = Rule(lambda v: v.strip() != "", "a non-empty string")


def registered(what: str, module: str, names_function: str, builtin: tuple) -> Rule:
    """A name that must be registered in ``ppojax.core.<module>`` (listed by its ``names_function()``).

    Importing that module imports JAX, which takes seconds, and a config is checked before that. Until the
    module is imported nothing but its built-in names can be registered there, so the check reads ``builtin``
    then (tests/test_config.py checks ``builtin`` equals what the module registers by itself); once it is
    imported (a notebook that registered its own estimator), the registry itself.
    """
    def names() -> tuple:
        loaded = sys.modules.get(f"ppojax.core.{module}")
        return tuple(getattr(loaded, names_function)()) if loaded is not None else builtin
    return Rule(lambda v: v in names(), f"one of the registered {what}", registry=names)


BUILTIN_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs", "mse", "full")
BUILTIN_ADVANTAGE_ESTIMATORS = {  # name: (uses_critic, needs_groups)
    "gae": (True, False), "grpo": (False, True), "rloo": (False, True), "reinforce_pp": (False, False)}
SCORE_POSITIONS = ("trl", "legacy")
"""What ppojax.core defines, kept here so that a config is checked without importing JAX."""


KL_ESTIMATOR_NAME = registered("KL estimators", "kl", "kl_estimator_names", BUILTIN_KL_ESTIMATORS)
ADVANTAGE_ESTIMATOR_NAME = registered("advantage estimators", "advantages", "advantage_estimator_names",
                                      tuple(BUILTIN_ADVANTAGE_ESTIMATORS))


def _advantage_estimator_traits(name: str) -> tuple[bool, bool]:
    """(uses_critic, needs_groups) of a registered advantage estimator; JAX-free as ``registered`` is."""
    loaded = sys.modules.get("ppojax.core.advantages")
    if loaded is None:
        return BUILTIN_ADVANTAGE_ESTIMATORS[name]
    estimator = loaded.advantage_estimator(name)
    return estimator.uses_critic, estimator.needs_groups


BUILTIN_REWARDS = ("vader", "gsm8k_strict", "gsm8k_flexible", "boxed_answer", "answer_format")
"""Reward functions named without a module (``ppojax.trainer.build.BUILTIN_REWARD_FUNCTIONS`` maps them)."""


def _is_reward_function_spec(v: str) -> bool:
    module, sep, function = v.partition(":")
    return v in BUILTIN_REWARDS or (bool(sep) and bool(module.strip()) and bool(function.strip()))


def _are_reward_function_specs(v) -> bool:
    names = [v] if isinstance(v, str) else list(v)
    return bool(names) and all(isinstance(n, str) and _is_reward_function_spec(n) for n in names)


REPORT_SINKS = ("tensorboard", "wandb")
"""Where metrics go besides the always-written JSONL files; report_to also takes 'none' and 'all'."""


def _valid_report_to(v) -> bool:
    names = [v] if isinstance(v, str) else list(v)
    allowed = set(REPORT_SINKS) | {"none", "all"}
    return bool(names) and all(n in allowed for n in names) and ("none" not in names or len(names) == 1)


def setting(default, *, static: bool, on_resume: str, rule: Optional[Rule] = None):
    """A PPOConfig field: its default and its metadata (see the module docstring)."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume={on_resume!r}: expected one of {ON_RESUME}")
    return dataclasses.field(default=default, metadata={"static": static, "on_resume": on_resume, "rule": rule})


@dataclass
class PPOConfig:
    # ---- models ----
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
                                            rule=one_of("auto", "xla", "cudnn"))
    """'auto' (cuDNN's fused kernel on an NVIDIA GPU when it applies, XLA elsewhere), 'xla', or 'cudnn'."""
    matmul_implementation: str = setting("auto", static=True, on_resume=MAY_CHANGE,
                                         rule=one_of(*MATMUL_IMPLEMENTATIONS))
    """The layers' projections (and the LM head, at calls of at least 64 rows) of a float32 model on a single CPU
    device: 'auto' (oneDNN's GEMM reading each layer's kernel where it lies in the stacked weights, for models
    whose layers hold at least 1 M kernel elements and calls of at least 64 token rows, where the onednn-cpu-gomp
    wheel and a C++ compiler let ppojax build its handlers, on the GEMM library measured fastest on this CPU for
    each projection shape and product (forward, input gradient, weight gradient): timed once per CPU and shape, a
    few seconds, and recorded in ~/.cache/ppojax/matmul_library.json; a decode step's at most 8 rows by the
    handlers' own kernels on AVX-512 or AVX2 CPUs; else XLA's dots, which copy each layer's kernels out first), 'xla', 'onednn'
    (whatever the size; an error where it cannot be had), 'onednn_primitive' (as 'onednn', through oneDNN's matmul
    primitive) or 'mkl' (as 'onednn', on MKL's GEMM as torch's x86 wheels carry it): 'auto' measures which is
    faster at the model's shapes (`python -m ppojax.backends.cpu.matmul_tuning` does it ahead). Other precisions,
    meshes and accelerators always use XLA's dots."""

    # ---- LoRA (PEFT's LoraConfig(r, lora_alpha, lora_dropout, target_modules); TRL's --use_peft --lora_r ...) ----
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

    # ---- data ----
    dataset: str = setting("movie_reviews", static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Prompts: 'movie_reviews' (bundled), 'arithmetic' (generated word problems with an answer column), or a
    local json/jsonl/csv/parquet file or HF datasets directory. Its other columns reach reward_funcs."""
    eval_dataset: Optional[str] = setting(None, static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Held-out prompts from another dataset (e.g. 'arithmetic:test', or a test.jsonl): its first
    num_eval_prompts prompts. None: num_eval_prompts are taken off the end of dataset."""
    dataset_text_field: str = setting("prompt", static=False, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """Column holding the prompt text."""
    max_prompt_length: int = setting(32, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Prompts are left padded to this many tokens; longer ones are filtered out (and counted)."""
    chat_template: bool = setting(False, static=False, on_resume=MUST_MATCH)
    """Wrap each prompt in the tokenizer's chat template before tokenising."""
    num_eval_prompts: int = setting(0, static=False, on_resume=MUST_MATCH, rule=at_least(0))
    """Held-out prompts (taken off the end of the dataset, never trained on), scored before and after
    training with near-greedy decoding (T = 0.01) for summary.json. 0: no evaluation."""

    # ---- run ----
    output_dir: str = setting("outputs/ppojax", static=False, on_resume=IGNORED, rule=NON_EMPTY)
    """Directory of the run: logs, samples, checkpoints/, the trained policy/ and summary.json."""
    run_name: Optional[str] = setting(None, static=False, on_resume=IGNORED)
    """Name of the run in TensorBoard / wandb (None: the output_dir's name)."""
    seed: int = setting(0, static=False, on_resume=MUST_MATCH, rule=Rule(
        lambda v: 0 <= v < 2**31, "an integer in [0, 2147483647]",
        "Fix: use a seed in that range (JAX keys take 32 bits: a larger seed would silently give another "
        "seed's stream)."))
    """Seed of every random stream: initial value head, prompt order, sampling."""
    total_episodes: Optional[int] = setting(None, static=False, on_resume=IGNORED, rule=at_least(1))
    """Episodes (sampled responses: num_generations per prompt) to train on in all, rounded up to whole
    updates; None: num_train_epochs passes over the data."""
    num_train_epochs: float = setting(1.0, static=False, on_resume=IGNORED, rule=above(0))
    """Passes over the training prompts when total_episodes is None (may be fractional)."""

    # ---- batch sizes ----
    per_device_train_batch_size: int = setting(8, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """TRL's micro-batch per data-parallel device; ignored when batch_size is set."""
    batch_size: Optional[int] = setting(None, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Global episodes (sampled responses) per update: batch_size / num_generations prompts. None derives it
    as TRL does (see the module docstring)."""
    gradient_accumulation_steps: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Micro-batches whose gradients are summed into one optimizer step (splits each mini-batch)."""
    num_mini_batches: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Optimizer steps per PPO epoch: each update's batch is split into this many mini-batches."""
    local_rollout_forward_batch_size: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE,
                                                              rule=at_least(1))
    """Rows per forward pass in the rollout's reference/value/reward forwards (None: the whole batch); must
    divide the batch."""
    behaviour_logprobs: str = setting("forward", static=True, on_resume=MAY_CHANGE,
                                      rule=one_of("forward", "sampler"))
    """Where the rollout's behaviour log-probs (the PPO ratio's denominator) come from: 'forward' (a policy
    forward over the sampled sequences, the same computation as the loss's, so the first epoch's ratio is 1)
    or 'sampler' (each token's log-prob taken from the decode loop's logits, as TRL does: no policy forward
    in the rollout when the value model is separate or there is none; the two agree to float rounding)."""
    padding_free: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Run the rollout's forwards (log-probs, values, a reward model) and the update's forwards and backward on
    packed rows: each sequence's real tokens (prompt and response, no padding) side by side in rows of
    max_prompt_length + response_length slots, attention kept within each sequence, and only as many packed
    micro-batches as the real tokens fill. Losses, gradients and metrics are the padded run's (to float
    rounding); only the time changes (docs/packing.md)."""
    max_tokens_per_micro_batch: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """With padding_free: token slots per device per packed micro-batch (a multiple of max_prompt_length +
    response_length; the rows it holds bound the activation memory). None: a padded micro-batch's rows (the
    rollout's forwards: local_rollout_forward_batch_size rows when set)."""
    logits_chunk_size: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """Response positions per float32 logits chunk in log-prob computations (bounds [rows, chunk, vocab]
    memory). None: all positions at once when a micro-batch's logits fit in 256 MB per device, else the
    largest chunk that fits (chunks are recomputed in the backward pass instead of stored)."""

    # ---- PPO ----
    num_ppo_epochs: int = setting(4, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """Passes over each rollout batch per update."""
    learning_rate: float = setting(3e-6, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Peak learning rate of AdamW (policy and value model); a traced value of the state (``Hyperparams``)."""
    lr_scheduler_type: str = setting("linear", static=True, on_resume=MAY_CHANGE, rule=one_of("linear", "constant"))
    """'linear' (to 0 over the updates, as TRL) or 'constant'."""
    warmup_steps: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Updates of linear learning-rate warmup (the schedule steps once per update, as TRL's PPO)."""
    max_grad_norm: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Clip the global gradient norm (None: off, as TRL's PPO)."""
    adam_beta1: float = setting(0.9, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_high=True))
    """AdamW's first-moment decay."""
    adam_beta2: float = setting(0.999, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_high=True))
    """AdamW's second-moment decay."""
    adam_epsilon: float = setting(1e-8, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """AdamW's epsilon (added to the second-moment root)."""
    weight_decay: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """AdamW's decoupled weight decay."""
    optimizer_implementation: str = setting("auto", static=True, on_resume=MAY_CHANGE, rule=one_of("auto", "optax"))
    """How AdamW's step runs: 'auto' (in one pass over each parameter, reading the parameter, its gradient and
    moments once and writing them in place, through a handler ppojax builds with the system's g++ (Linux x86-64),
    for float32 parameters on a single CPU device; optax's elsewhere) or 'optax' (optax's transformations, which
    XLA:CPU runs as three passes). The same arithmetic; XLA fuses some multiply-adds, so the two agree to a few
    units in the last place."""
    cliprange: float = setting(0.2, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """PPO's policy ratio clip range epsilon: the ratio is clipped to [1 - cliprange, 1 + cliprange]."""
    cliprange_value: float = setting(0.2, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Clip range of the value prediction around the rollout's values."""
    vf_coef: float = setting(0.1, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the value loss in the total loss."""
    entropy_coef: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the entropy bonus subtracted from the loss (0: off, as TRL). Its value is traced; turning the
    bonus on or off (0 <-> > 0) compiles anew."""
    gamma: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=between(0, 1))
    """Discount factor of the returns."""
    lam: float = setting(0.95, static=True, on_resume=MAY_CHANGE, rule=between(0, 1))
    """GAE's lambda: 0 uses one-step TD errors (low variance), 1 the full returns (no bias)."""
    whiten_rewards: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Whiten the KL-shaped rewards (over the batch's response tokens) before GAE."""
    kl_coef: float = setting(0.05, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of the per-token KL penalty to the reference model (the adaptive controller's initial value)."""
    kl_estimator: str = setting("k1", static=True, on_resume=MAY_CHANGE,
                                rule=KL_ESTIMATOR_NAME)
    """Per-token KL estimator: 'k1', 'k3', or legacy 'abs', 'mse', 'full'."""
    advantage_estimator: str = setting("gae", static=True, on_resume=MUST_MATCH,
                                       rule=ADVANTAGE_ESTIMATOR_NAME)
    """How advantages are computed from the rewards: 'gae' (generalised advantage estimation with the value
    model: PPO); the critic-free ones, which build no value model: 'grpo' (group-relative: (R - group mean) /
    group std), 'rloo' (leave-one-out group baseline), 'reinforce_pp' (REINFORCE++: the token-level KL-shaped
    reward-to-go whitened over the batch). grpo and rloo need num_generations >= 2."""
    num_generations: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Samples per prompt (TRL's GRPO/RLOO name; legacy RLOO: rloo_k): each prompt is sampled this many
    times and its samples form one group of consecutive rows. batch_size counts samples, so an update takes
    batch_size / num_generations prompts."""
    scale_rewards: str = setting("group", static=True, on_resume=MAY_CHANGE, rule=one_of("group", "batch", "none"))
    """grpo only (TRL's name): divide the centred returns by the std of their group ('group'), of the whole
    batch ('batch'), or not at all ('none': Dr. GRPO)."""
    normalize_advantages: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """rloo only (TRL's name): whiten the leave-one-out advantages over the batch."""
    critic_warmup: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Updates at the start of the run that train only the value function (verl's critic_warmup): the
    policy's parameters stay as they are. Needs a critic (advantage_estimator: gae)."""
    kl_loss_coef: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Weight of a KL-to-the-reference term IN THE LOSS (GRPO-style; TRL's GRPO beta, verl's kl_loss_coef);
    0: off. kl_coef is the KL in the REWARD (PPO-style): set it to 0 to keep the KL in the loss only. Its value is
    traced; turning the term on or off (0 <-> > 0) compiles anew."""
    kl_loss_type: str = setting("low_var_kl", static=True, on_resume=MAY_CHANGE,
                                rule=KL_ESTIMATOR_NAME)
    """The per-token KL estimator of the loss term: 'low_var_kl' (k3 clamped to [-10, 10], verl), 'k3'
    (TRL's GRPO), 'k2', 'k1', ... ('full' is for the reward only)."""
    cliprange_low: Optional[float] = setting(None, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Lower policy clip range: the ratio is clipped below at 1 - cliprange_low (None: cliprange; TRL's
    GRPO epsilon, verl's clip_ratio_low)."""
    cliprange_high: Optional[float] = setting(None, static=False, on_resume=MAY_CHANGE, rule=above(0))
    """Upper policy clip range ("clip-higher", DAPO recommends 0.28): clipped above at 1 + cliprange_high
    (None: cliprange_low where it is set, else cliprange, as TRL's epsilon_high defaults to its epsilon; TRL's
    epsilon_high, verl's clip_ratio_high)."""
    dual_clip_c: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(1))
    """Dual-clip PPO: for negative advantages the per-token loss is at most -A * dual_clip_c (> 1; verl's
    clip_ratio_c, TRL's GRPO delta). None: off."""
    loss_agg_mode: str = setting("token-mean", static=True, on_resume=MAY_CHANGE,
                                 rule=one_of("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    """How per-token policy (and KL) losses are averaged (verl's names): 'token-mean' over the batch's live
    tokens (PPO; TRL's GRPO 'bnpo'/'dapo'), 'seq-mean-token-mean' (each sequence's mean, then over sequences:
    TRL's 'grpo'), 'seq-mean-token-sum-norm' (sum / (sequences x response_length): TRL's 'dr_grpo')."""
    adaptive_kl: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy adaptive KL controller (Ziegler et al.); kl_coef is its initial value."""
    target_kl_for_adaptive: float = setting(6.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """The KL (nats per sequence) the adaptive controller steers towards (legacy TRL's `target`)."""
    horizon: int = setting(10000, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """The adaptive controller's horizon: how fast kl_coef moves (legacy TRL's `horizon`)."""
    score_position: str = setting("trl", static=True, on_resume=MAY_CHANGE,
                                  rule=one_of(*SCORE_POSITIONS))
    """'trl': the score goes on the slot after the last token; 'legacy': on the last token."""
    missing_eos_penalty: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Subtracted from the score of a response without the stop token (None: off; needs a stop token)."""
    use_score_scaling: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: divide scores by their running standard deviation."""
    use_score_norm: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: also subtract the running mean (needs use_score_scaling)."""
    score_clip: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy: clip the (scaled) scores to [-score_clip, score_clip] (None: off)."""
    ratio_threshold: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy: skip a mini-batch whose masked mean ratio exceeds this (None: off)."""
    early_stopping: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Legacy: stop an update's epochs once the policy KL exceeds 1.5 * target_kl."""
    target_kl: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Legacy early stopping: stop the epochs once the policy KL exceeds 1.5 * target_kl."""

    # ---- generation ----
    response_length: int = setting(53, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Tokens sampled per prompt (responses are padded after the stop token to this length)."""
    temperature: float = setting(0.7, static=True, on_resume=MAY_CHANGE, rule=above(0, fix=(
        "Fix: PPO learns from sampled responses, so it needs a sampling temperature > 0; for near-greedy "
        "sampling use a small one such as 0.01 (the default is 0.7).")))
    """Sampling temperature (> 0: PPO needs sampled responses; near-greedy: e.g. 0.01)."""
    top_k: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Sample only among the k most likely tokens (0: off)."""
    top_p: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_low=True))
    """Nucleus sampling: the smallest token set holding this probability (1.0: off)."""
    stop_token: Optional[str] = setting(None, static=True, on_resume=MAY_CHANGE, rule=one_of(
        "eos", fix="Fix: write stop_token: eos to stop at the tokenizer's eos token, or set stop_token_id."))
    """'eos': stop at the tokenizer's eos token; None: no stop token unless stop_token_id is set."""
    stop_token_id: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Token id that ends a response (instead of stop_token; must be in the vocabulary, not the pad id)."""
    rollout_slots: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """0: the rollout decodes all rows together until the longest response is done. S >= 1 (at most the
    batch_size): continuous batching, S sequences decoded at a time, each finished one replaced by the next
    waiting prompt, so the decode work follows the sum of the response lengths instead of batch x the longest.
    Same tokens for the same seed; pays when a few responses run much longer than most (docs/algorithm.md)."""
    decode_segments: int = setting(4, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """The decode loop as this many loops of about equal steps, each one's attention reading only the KV-cache
    slots filled by its end (prompt + tokens so far) instead of all prompt + response_length. Same tokens; each
    segment is one more compiled loop body (none where a cut would save fewer than 128 slots a step). 1: one loop
    over the whole cache. Not used with rollout_slots."""

    # ---- logging, samples, checkpoints ----
    logging_steps: int = setting(1, static=False, on_resume=IGNORED, rule=Rule(
        lambda v: v >= 1, "an integer >= 1",
        "Fix: give a number of updates (TRL's fractional logging_steps, a share of the run, is not supported)."))
    """Log metrics (metrics.jsonl, TensorBoard, wandb) every N updates."""
    num_sample_generations: int = setting(10, static=False, on_resume=IGNORED, rule=at_least(0))
    """How many times during training to print sample completions (near-greedy, T = 0.01); 0: never."""
    save_steps: int = setting(0, static=False, on_resume=IGNORED, rule=at_least(0))
    """Checkpoint every N updates (0: only at the end)."""
    save_total_limit: int = setting(3, static=False, on_resume=IGNORED, rule=Rule(
        lambda v: v >= 1, "an integer >= 1",
        "Fix: set save_total_limit to an integer >= 1 (the default is 3); to keep every checkpoint, to more than "
        "the run's saves."))
    """Checkpoints kept in output_dir/checkpoints (the oldest are deleted)."""
    resume: Optional[str] = setting(None, static=False, on_resume=IGNORED, rule=NON_EMPTY)
    """None (or false): start fresh; 'auto' (or true): resume from the latest checkpoint in output_dir, or
    start fresh when there is none; or the path of a checkpoint."""
    overwrite_output_dir: bool = setting(False, static=False, on_resume=IGNORED)
    """Start a fresh run even though output_dir holds another run: the old run is moved aside to
    '<output_dir>.replaced-<UTC time>' (never deleted). Hugging Face TrainingArguments' name."""
    resume_with_changes: bool = setting(False, static=False, on_resume=IGNORED)
    """Let a resume continue a run whose tunable settings (learning rate, clip ranges, ...) differ from the
    saved run's; without it such a resume is refused with the list of changes (fields that must match are
    always refused)."""
    max_nonfinite_steps: int = setting(3, static=False, on_resume=IGNORED, rule=at_least(1))
    """Stop after this many optimizer steps in a row skipped for a non-finite loss or gradient."""
    on_nonfinite_reward: str = setting("error", static=True, on_resume=IGNORED, rule=one_of("error", "skip"))
    """A reward function returning NaN/inf: 'error' stops with a message naming the prompt; 'skip' lets it
    through, so every optimizer step of that update is skipped (counted in ppo/nonfinite_total) and the run
    goes on. 'skip' needs max_nonfinite_steps > num_ppo_epochs * num_mini_batches (the steps of one update)."""
    report_to: Union[str, list[str]] = setting("tensorboard", static=False, on_resume=IGNORED, rule=Rule(
        _valid_report_to, "'tensorboard', 'wandb', 'none', 'all', or a list of 'tensorboard' and 'wandb'",
        "Fix: e.g. report_to: [tensorboard, wandb]; metrics.jsonl is always written."))
    """Metric sinks besides metrics.jsonl: 'tensorboard', 'wandb', a list of them, 'all' (every installed
    one) or 'none'."""
    compilation_cache_dir: Optional[str] = setting("auto", static=False, on_resume=IGNORED)
    """JAX's persistent compilation cache: a later run (a resume, a re-run with the same shapes) loads the
    compiled programs instead of compiling them again. 'auto' (or None):
    $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/ppojax/xla; a path; or 'none' (off)."""
    compile_ahead: bool = setting(False, static=False, on_resume=IGNORED)
    """Compile the training step on a background thread while the weights load: the models' shapes come
    from the checkpoints' configs first, and the first update waits for that compile instead of starting
    it. Pays where loading waits on storage (large checkpoints) or cores are idle; on a host whose cores the
    load and XLA's compile both keep busy it gains little and raises the peak memory of the build by the
    compile's."""

    export_check: Optional[bool] = setting(None, static=False, on_resume=IGNORED)
    """After `ppojax train` saves the policy, transformers (torch) loads the export and greedy-decodes a few
    held-out prompts, which must give ppojax's own greedy continuations (summary.json: export_greedy_match).
    None (auto): when torch is installed, the run holds out prompts and the policy has at most 3e9 parameters
    (the check holds the whole export in float32 in the main process's memory and decodes on its CPU); true:
    always (needs torch and num_eval_prompts > 0); false: never."""

    # ---- mesh ----
    mesh_data: int = setting(-1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Data-parallel mesh axis size; -1 takes the devices left over (at most one axis may be -1)."""
    mesh_fsdp: int = setting(1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Fully-sharded (parameters and optimizer state) mesh axis size; -1: the devices left over."""
    mesh_tensor: int = setting(1, static=True, on_resume=MAY_CHANGE, rule=Rule(
        lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"))
    """Tensor-parallel mesh axis size; -1: the devices left over."""

    # --------------------------------------------------------------------------------------------------
    def __post_init__(self):
        self.validate()

    @property
    def stop_token_is_eos(self) -> bool:
        return self.stop_token == "eos"

    @property
    def report_sinks(self) -> tuple[str, ...]:
        """report_to as the sinks to open: () for 'none'; 'all': tensorboard, and wandb when installed."""
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        if "all" in names:
            import importlib.util
            return tuple(s for s in REPORT_SINKS if s != "wandb" or importlib.util.find_spec("wandb"))
        return tuple(dict.fromkeys(n for n in names if n != "none"))

    def static_settings(self) -> "StaticSettings":
        """The static fields only, as a hashable, immutable view (a ``jax.jit`` static argument): equal
        for configs that differ only in non-static fields (output_dir, kl_coef, ...)."""
        def hashable(v):
            return tuple(v) if isinstance(v, list) else v  # lora_target_modules

        return StaticSettings(**{name: hashable(getattr(self, name)) for name in STATIC_FIELDS})

    def derived(self, data_parallel_size: int = 1, *, mesh_known: bool = True) -> "DerivedSizes":
        """The global batch sizes of the update structure (docs/algorithm.md, "Update structure"), checked to divide.

        mesh_known=False (a config checked before the devices are known): a batch_size derived from
        per_device_train_batch_size may grow with the mesh, so rollout_slots is checked against it later."""
        batch = self.batch_size
        if batch is None:
            batch = (self.per_device_train_batch_size * self.gradient_accumulation_steps
                     * self.num_mini_batches * data_parallel_size)
        if batch % self.num_mini_batches:
            raise ConfigError(
                f"batch_size={batch} does not split into num_mini_batches={self.num_mini_batches}; "
                f"choose a batch_size that is a multiple of {self.num_mini_batches}.")
        mini = batch // self.num_mini_batches
        if mini % self.gradient_accumulation_steps:
            raise ConfigError(
                f"mini_batch_size={mini} (batch_size {batch} / num_mini_batches {self.num_mini_batches}) does "
                f"not split into gradient_accumulation_steps={self.gradient_accumulation_steps}; make "
                f"batch_size a multiple of {self.num_mini_batches * self.gradient_accumulation_steps}.")
        micro = mini // self.gradient_accumulation_steps
        if micro % data_parallel_size:
            raise ConfigError(
                f"micro_batch_size={micro} does not split over {data_parallel_size} data-parallel devices; "
                f"make batch_size a multiple of "
                f"{self.num_mini_batches * self.gradient_accumulation_steps * data_parallel_size}.")
        groups = self.num_generations
        if batch % (groups * data_parallel_size):
            raise ConfigError(
                f"batch_size={batch} (samples) does not split into num_generations={groups} samples of each "
                f"prompt{f' with the same number of prompts on each of {data_parallel_size} data-parallel devices' if data_parallel_size > 1 else ''}; "
                f"make batch_size a multiple of {groups * data_parallel_size}.")
        if self.rollout_slots > batch and (mesh_known or self.batch_size is not None):
            raise ConfigError(
                f"rollout_slots={self.rollout_slots} is more than the {batch} rows (batch_size) a rollout samples; "
                f"set rollout_slots to at most {batch} (0: decode all rows together).")
        return DerivedSizes(batch_size=batch, mini_batch_size=mini, micro_batch_size=micro,
                            prompts_per_batch=batch // groups)

    def num_updates(self, dataset_size: int, data_parallel_size: int = 1) -> int:
        episodes = self.total_episodes
        if episodes is None:  # episodes are samples: num_generations per prompt
            episodes = int(self.num_train_epochs * dataset_size) * self.num_generations
        return max(1, math.ceil(episodes / self.derived(data_parallel_size).batch_size))

    # ---- validation ----
    def validate(self) -> "PPOConfig":
        """Check (and normalise) every value; raise one ConfigError listing every bad one. Returns self.

        Runs at construction; call it again after changing a field by hand."""
        problems = []
        for name in FIELD_NAMES:
            try:
                setattr(self, name, _checked_value(name, getattr(self, name)))
            except ConfigError as err:
                problems.append(str(err))
        if not problems:  # the checks below need every value well typed
            problems += _problems_together(self)
        if not problems:  # a registered name's message lists the registry: only once the rest is right
            problems += [str(err) for err in _registry_problems(self)]
        if not problems:
            problems += _estimator_problems(self)
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError(f"{len(problems)} config values are not valid:\n"
                              + "\n".join("  - " + p.replace("\n", "\n    ") for p in problems))
        return self

    @property
    def reward_function_specs(self) -> list[str]:
        """reward_funcs (or reward_function) as a list of specs."""
        specs = self.reward_funcs if self.reward_funcs is not None else self.reward_function
        return [] if specs is None else [specs] if isinstance(specs, str) else list(specs)

    @property
    def reward_names(self) -> list[str]:
        """The rewards' names, in reward_weights' order: the functions, then the reward model's folder name."""
        names = [spec.rpartition(":")[2] for spec in self.reward_function_specs]
        if self.reward_model_path is not None:
            names.append(Path(self.reward_model_path).name or "reward_model")
        return names

    def check_reward_source(self) -> "PPOConfig":
        """For a training run (the CLI): one reward source must be set. (The legacy ``step()`` API takes
        scores from the caller, so a config without one is valid in itself.)"""
        if self.reward_model_path is None and self.reward_function is None and self.reward_funcs is None:
            raise ConfigError(
                "No reward source: set reward_funcs (a list of 'module:function' or built-in reward functions), "
                "reward_function ('vader', or 'module:function' taking (prompts, completions) -> floats) or "
                "reward_model_path (a sequence-classification checkpoint).")
        return self

    # ---- (de)serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path=None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PPOConfig":
        """Build from a mapping, translating legacy names and refusing unknown keys (all in one message)."""
        return cls(**normalise_keys(values))

    @classmethod
    def from_yaml(cls, path, overrides: Optional[list[str]] = None) -> "PPOConfig":
        """Build from a YAML file plus ``key=value`` overrides; malformed YAML and duplicate keys are errors
        naming the file, line and column."""
        values = load_yaml_mapping(path)
        values.update(parse_overrides(overrides or []))
        return cls.from_dict(values)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(PPOConfig))
_FIELDS = {f.name: f for f in fields(PPOConfig)}
_HINTS = typing.get_type_hints(PPOConfig)

STATIC_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_NAMES if _FIELDS[n].metadata["static"])
"""Fields whose value shapes a compiled program (in declaration order)."""
MUST_MATCH_FIELDS = frozenset(n for n in FIELD_NAMES if _FIELDS[n].metadata["on_resume"] == MUST_MATCH)
MAY_CHANGE_FIELDS = frozenset(n for n in FIELD_NAMES if _FIELDS[n].metadata["on_resume"] == MAY_CHANGE)
IGNORED_ON_RESUME_FIELDS = frozenset(n for n in FIELD_NAMES if _FIELDS[n].metadata["on_resume"] == IGNORED)

StaticSettings = dataclasses.make_dataclass(
    "StaticSettings", [(n, _FIELDS[n].type) for n in STATIC_FIELDS], frozen=True)
StaticSettings.__module__ = __name__
StaticSettings.__doc__ = ("PPOConfig's static fields (STATIC_FIELDS) as a frozen, hashable view: "
                          "PPOConfig.static_settings().")


@dataclass(frozen=True)
class DerivedSizes:
    batch_size: int         # rollout rows (samples) per update
    mini_batch_size: int
    micro_batch_size: int
    prompts_per_batch: int  # batch_size / num_generations


# ----------------------------------------------------------------------------------------------------------
# checking values

# Other spellings of a value -> the value (matched by type too, so `resume: 1` is not `resume: true`).
VALUE_ALIASES: dict[str, list[tuple[Any, Any]]] = {
    "kl_estimator": [("kl", "k1")],           # legacy TRL's kl_penalty: 'kl'
    "resume": [(True, "auto"), (False, None)],
    "report_to": [(None, "none")],
}


def _a(hint) -> str:
    """'an integer' / 'a number' / 'a string' / 'true or false' for a field's (non-None) type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(base, "a value")


def expected_of(name: str) -> str:
    """What a field takes, in words: 'null or an integer >= 1'."""
    hint, rule = _HINTS[name], _FIELDS[name].metadata["rule"]
    words = rule.expected.format(a=_a(hint)) if rule is not None else _a(hint)
    return f"null or {words}" if type(None) in typing.get_args(hint) else words


def _default_text(name: str) -> str:
    """The default as written in YAML (null, true, 3.0e-06), strings quoted."""
    default = _FIELDS[name].default
    if isinstance(default, str):
        return repr(default)
    return yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()


def _bad(name: str, value: Any, got: str = "", fix: str = "") -> ConfigError:
    expected = expected_of(name)
    fix = fix or f"Fix: set {name} to {expected} (the default is {_default_text(name)})."
    return ConfigError(f"{name}={value!r}: expected {expected}{got}. {fix}")


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _typed(name: str, value: Any) -> Any:
    """The value converted to the field's type (YAML 1.1 reads '1e-5' as a string), or ConfigError."""
    hint = _HINTS[name]
    args = typing.get_args(hint)
    if value is None:
        if type(None) in args:
            return None
        raise _bad(name, value, ", got null")
    types = [a for a in args if a is not type(None)] or [hint]
    if list[str] in types and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    if list[float] in types:
        if not isinstance(value, (list, tuple)):
            raise _bad(name, value, f", got {_kind(value)}")
        numbers = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise _bad(name, value, f", got an entry that is {_kind(v)}")
            try:
                number = float(v)
            except ValueError:
                raise _bad(name, value, f", got {v!r}, which is not a number") from None
            if not math.isfinite(number):
                raise _bad(name, value, ", got a non-finite number")
            numbers.append(number)
        return numbers
    target = types[0]
    if target in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
        raise _bad(name, value, f", got {_kind(value)}")
    if target is float:
        try:
            number = float(value)
        except (ValueError, OverflowError):
            raise _bad(name, value, ", got a string that is not a number") from None
        if not math.isfinite(number):
            raise _bad(name, value, ", got a non-finite number")
        return number
    if target is int:
        if isinstance(value, int):
            return value
        try:
            number = float(value)
            if number == int(number):
                return int(number)
        except (ValueError, OverflowError):
            pass
        rule = _FIELDS[name].metadata["rule"]  # a number of the wrong kind: the field's own fix applies
        raise _bad(name, value, ", got a value that is not a whole number",
                   fix=rule.fix if rule is not None and not isinstance(value, str) else "")
    if target is bool:
        if isinstance(value, bool):
            return value
        raise _bad(name, value, f", got {_kind(value)}")
    if target is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise _bad(name, value, f", got {_kind(value)}")


def _checked_value(name: str, given: Any) -> Any:
    """One field's value normalised (aliases, type) and checked against its rule, or ConfigError."""
    value = given
    for spelling, meaning in VALUE_ALIASES.get(name, ()):
        if type(value) is type(spelling) and value == spelling:
            value = meaning
            break
    value = _typed(name, value)
    rule = _FIELDS[name].metadata["rule"]
    if value is not None and rule is not None and rule.registry is None and not rule.ok(value):
        raise _bad(name, given, fix=rule.fix)
    return value


def _registry_problems(config: PPOConfig) -> list[ConfigError]:
    problems = []
    for name in FIELD_NAMES:
        rule, value = _FIELDS[name].metadata["rule"], getattr(config, name)
        if rule is not None and rule.registry is not None and value is not None and not rule.ok(value):
            names = rule.registry()
            problems.append(ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, names))}. "
                                        f"Fix: set {name} to one of them (the default is "
                                        f"{_default_text(name)})."))
    return problems


def _problems_together(c: PPOConfig) -> list[str]:
    """The checks that need several fields (each field's own value already checked)."""
    out = []
    if c.reward_model_path is not None and c.reward_function is not None:
        out.append(f"Both reward_model_path={c.reward_model_path!r} and reward_function={c.reward_function!r} "
                   "are set; keep one of them, or list the function in reward_funcs to sum both.")
    if c.eval_dataset is not None and c.num_eval_prompts == 0:
        out.append(f"eval_dataset={c.eval_dataset!r} is set but num_eval_prompts=0 takes none of its prompts; set "
                   "num_eval_prompts (e.g. 200) or remove eval_dataset.")
    if c.reward_funcs is not None and c.reward_function is not None:
        out.append(f"Both reward_funcs={c.reward_funcs!r} and reward_function={c.reward_function!r} are set; "
                   "list every function in reward_funcs and remove reward_function.")
    if c.reward_weights is not None and c.reward_names:  # (functions passed in Python are counted at the build)
        names = c.reward_names
        if len(c.reward_weights) != len(names):
            out.append(f"reward_weights={c.reward_weights!r} has {len(c.reward_weights)} weights for "
                       f"{len(names)} rewards ({', '.join(names) or 'none'}); give one weight per reward, in that "
                       "order.")
    if c.reward_model_label is not None and c.reward_model_path is None:
        out.append(f"reward_model_label={c.reward_model_label} is set but there is no reward_model_path (the label "
                   "picks one output of a classifier reward model); set reward_model_path or remove "
                   "reward_model_label.")
    if c.value_head == "policy" and c.value_model_path is not None:
        out.append(f"value_model_path={c.value_model_path!r} is set but value_head='policy' puts the value head "
                   "on the policy (the value model would be ignored); remove value_model_path or set "
                   "value_head: separate.")
    row = c.max_prompt_length + c.response_length
    if c.max_tokens_per_micro_batch is not None and not c.padding_free:
        out.append(f"max_tokens_per_micro_batch={c.max_tokens_per_micro_batch} is set but padding_free is off (the "
                   "budget sizes packed micro-batches); set padding_free: true or remove max_tokens_per_micro_batch.")
    elif c.max_tokens_per_micro_batch is not None and c.max_tokens_per_micro_batch < row:
        out.append(f"max_tokens_per_micro_batch={c.max_tokens_per_micro_batch} is below one packed row "
                   f"(max_prompt_length {c.max_prompt_length} + response_length {c.response_length} = {row} slots, "
                   f"which a single sequence may fill); set it to at least {row}, e.g. {4 * row}.")
    lora_set = [f"{n}={getattr(c, n)!r}" for n in ("lora_alpha", "lora_dropout", "lora_target_modules")
                if getattr(c, n) != _FIELDS[n].default]
    if c.lora_r == 0 and lora_set:
        out.append(f"{', '.join(lora_set)} set but lora_r=0 (LoRA off: every weight trains). Set lora_r > 0 "
                   "(e.g. 16) to train LoRA adapters, or remove the lora_* settings.")
    if c.matmul_implementation in IN_PLACE_MATMULS and c.precision != "float32":
        out.append(f"matmul_implementation={c.matmul_implementation!r} multiplies float32 models only, but "
                   f"precision={c.precision!r}; set matmul_implementation: auto (XLA's bf16 kernels serve it) or "
                   "precision: float32.")
    axes = {"mesh_data": c.mesh_data, "mesh_fsdp": c.mesh_fsdp, "mesh_tensor": c.mesh_tensor}
    if list(axes.values()).count(-1) > 1:
        out.append(f"mesh sizes {axes}: at most one -1 (the axis taking the devices left over) among mesh_data/"
                   "mesh_fsdp/mesh_tensor; give the others explicit sizes >= 1.")
    if c.export_check and c.num_eval_prompts == 0:
        out.append("export_check=True decodes held-out prompts with the exported policy, but num_eval_prompts=0 "
                   "holds none out; hold some out (e.g. num_eval_prompts: 16) or set export_check: null (auto).")
    steps_per_update = c.num_ppo_epochs * c.num_mini_batches
    if c.on_nonfinite_reward == "skip" and c.max_nonfinite_steps <= steps_per_update:
        out.append(
            f"on_nonfinite_reward='skip' with max_nonfinite_steps={c.max_nonfinite_steps}: an update with a "
            f"NaN/inf reward skips all its num_ppo_epochs * num_mini_batches = {steps_per_update} optimizer "
            f"steps, so the first one would stop the run. Set max_nonfinite_steps to more than "
            f"{steps_per_update} (e.g. {2 * steps_per_update + 1} to stop after 3 bad updates in a row).")
    try:
        sizes = c.derived(mesh_known=False)  # divisibility on one device; the trainer re-checks with the real mesh
    except ConfigError as err:
        out.append(str(err))
        sizes = None
    forward = c.local_rollout_forward_batch_size
    if forward is not None and c.batch_size is not None and c.batch_size % forward:
        out.append(f"local_rollout_forward_batch_size={forward} does not divide batch_size={c.batch_size}; "
                   f"use a divisor of {c.batch_size} (e.g. "
                   f"{max(d for d in range(1, forward + 1) if c.batch_size % d == 0)}), or null for the "
                   "whole batch in one forward.")
    if sizes is not None and c.total_episodes is not None:
        most = math.ceil(c.total_episodes / sizes.batch_size)  # with more data-parallel devices: fewer
        if c.warmup_steps >= most:
            out.append(f"warmup_steps={c.warmup_steps} is not below the run's {'' if c.batch_size else 'at most '}"
                       f"{most} update(s) (total_episodes {c.total_episodes} / batch_size {sizes.batch_size}): "
                       f"the learning rate would never finish warming up. Set warmup_steps below {most}.")
    if c.adaptive_kl and c.kl_coef == 0:
        out.append("adaptive_kl=True with kl_coef=0.0: the controller scales kl_coef, its initial value, so it "
                   "would stay 0; set kl_coef > 0 (e.g. 0.05) or adaptive_kl: false.")
    if c.use_score_norm and not c.use_score_scaling:
        out.append("use_score_norm=True only acts together with use_score_scaling (legacy TRL); set "
                   "use_score_scaling: true too, or drop use_score_norm.")
    if c.stop_token is not None and c.stop_token_id is not None:
        out.append(f"stop_token={c.stop_token!r} and stop_token_id={c.stop_token_id} are both set; keep one "
                   "(stop_token: eos means the tokenizer's eos id).")
    if c.missing_eos_penalty is not None and c.stop_token is None and c.stop_token_id is None:
        out.append(f"missing_eos_penalty={c.missing_eos_penalty} needs a stop token (without one every response "
                   "would be penalised): set stop_token: eos (or stop_token_id), or remove missing_eos_penalty.")
    return out


def _estimator_problems(c: PPOConfig) -> list[str]:
    """The advantage estimator's options against each other (the estimator is a registered one)."""
    uses_critic, from_group = _advantage_estimator_traits(c.advantage_estimator)
    critic_free = not uses_critic
    out = []
    if from_group and c.num_generations < 2:
        out.append(f"advantage_estimator={c.advantage_estimator!r} compares the samples of each prompt, so it needs "
                   f"num_generations >= 2 (got {c.num_generations}); set e.g. num_generations: 4.")
    if c.scale_rewards != "group" and c.advantage_estimator != "grpo":
        out.append(f"scale_rewards={c.scale_rewards!r} only applies to advantage_estimator: grpo (this run uses "
                   f"{c.advantage_estimator!r}); remove it.")
    if c.normalize_advantages and c.advantage_estimator != "rloo":
        out.append(f"normalize_advantages=True only applies to advantage_estimator: rloo (this run uses "
                   f"{c.advantage_estimator!r}; gae already whitens its advantages); remove it.")
    if critic_free and c.critic_warmup:
        out.append(f"critic_warmup={c.critic_warmup} but advantage_estimator={c.advantage_estimator!r} has no critic "
                   "to warm up; remove critic_warmup (or use advantage_estimator: gae).")
    if critic_free and c.value_model_path is not None:
        out.append(f"value_model_path={c.value_model_path!r} is set but advantage_estimator="
                   f"{c.advantage_estimator!r} uses no value model; remove value_model_path.")
    if c.kl_loss_type == "full":
        out.append("kl_loss_type='full' is not available in the loss (it needs both full distributions, computed "
                   "once in the rollout); use 'low_var_kl', 'k3', 'k2' or 'k1'.")
    return out


# ----------------------------------------------------------------------------------------------------------
# keys: legacy aliases, keys of TRL / transformers that ppojax has no field for, unknown keys

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
            "kl_coef. Set the one you mean",
    "loss_type": "set loss_agg_mode: TRL's GRPO 'grpo' is 'seq-mean-token-mean', 'bnpo' and 'dapo' are "
                 "'token-mean', 'dr_grpo' is 'seq-mean-token-sum-norm'",
    "logging_dir": "logs are written under output_dir (metrics.jsonl, tensorboard/); set output_dir",
    "logging_strategy": "use logging_steps (log every N updates)",
    **_same("no such knob: ppojax logs on process 0 every logging_steps updates",
            "logging_first_step", "log_level", "log_level_replica", "log_on_each_node", "disable_tqdm",
            "logging_nan_inf_filter", "include_num_input_tokens_seen", "include_tokens_per_second"),
    # evaluation
    **_same("ppojax scores num_eval_prompts held-out prompts before and after training (in batches of "
            "batch_size); set num_eval_prompts", "eval_strategy", "evaluation_strategy", "eval_steps", "do_eval",
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
    """Map legacy names to fields, derive num_mini_batches from a legacy mini_batch_size, and refuse unknown
    keys (all of them in one message, each with its replacement or closest valid name)."""
    known = set(FIELD_NAMES)
    out: dict[str, Any] = {}
    values = dict(values)
    mini_batch_size = values.pop("mini_batch_size", None)
    unknown = [key for key in values if LEGACY_ALIASES.get(key, key) not in known]
    if unknown:
        lines = [_unknown_key_line(key) for key in unknown]
        head = (f"Unknown config key {lines[0]}" if len(lines) == 1
                else f"{len(lines)} unknown config keys:\n" + "\n".join("  " + line for line in lines))
        raise ConfigError(f"{head}\n`ppojax train --help` lists every field.")
    given_as: dict[str, str] = {}
    for key, value in values.items():
        name = LEGACY_ALIASES.get(key, key)
        if name in out and out[name] != value:
            raise ConfigError(f"{given_as[name]}={out[name]!r} and {key}={value!r} both set {name!r} (one is its "
                              "legacy name); keep one of them.")
        out[name], given_as[name] = value, key
    if mini_batch_size is not None:
        mini = mini_batch_size
        if isinstance(mini, bool) or not isinstance(mini, int) or mini < 1:
            raise ConfigError(f"mini_batch_size={mini!r} (legacy): expected an integer >= 1. Fix: set it to the "
                              "prompts per optimizer step, or use num_mini_batches instead.")
        batch = _checked_value("batch_size", out.get("batch_size"))
        if batch is None or batch % mini:
            raise ConfigError(f"mini_batch_size={mini} (legacy) needs a batch_size that is a multiple "
                              f"of it; got batch_size={batch}. Set batch_size (e.g. {4 * mini}) or use "
                              "num_mini_batches instead.")
        out["num_mini_batches"] = batch // mini
    return out


def field_names() -> list[str]:
    return list(FIELD_NAMES)


# ----------------------------------------------------------------------------------------------------------
# YAML and overrides

class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                try:
                    key = self.construct_object(key_node, deep=True)
                    seen = first_line.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise ConfigError(
                        f"{key_node.start_mark.name}:{line}: key {key!r} is given twice (lines {seen} and {line}); "
                        "YAML would silently keep the last one. Keep one of them.")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(where: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    position = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    problem = " ".join(filter(None, [getattr(err, "context", None), getattr(err, "problem", None)])) or str(err)
    return ConfigError(f"{position}: not valid YAML ({problem}). Fix the line (YAML: `key: value`, one per "
                       "line, spaces not tabs for indentation; quote values with ':' or '#').")


def load_yaml_mapping(path) -> dict[str, Any]:
    """A YAML config file as a dict; every way it can be unreadable is a ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"Config file {str(path)!r} is a directory; pass the path of a YAML file "
                          "(see configs/ for examples).")
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist; pass the path of a YAML file "
                          "(see configs/ for examples).")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start}); "
                          "save the config as UTF-8.") from None
    try:
        values = yaml.load(text, Loader=_loader_for(str(path)))
    except yaml.YAMLError as err:
        raise _yaml_error(str(path), err) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value (one `key: value` per line), got "
                          f"{_kind(values)}.")
    return values


def _loader_for(name: str):
    """_StrictLoader whose marks carry ``name`` (PyYAML names a string's stream '<unicode string>')."""
    class Loader(_StrictLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.name = name
    return Loader


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['key=value', ...] -> {key: YAML-parsed value}; a key given twice is an error."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"Override {item!r} is not of the form key=value (e.g. learning_rate=1e-5).")
        if key in parsed:
            raise ConfigError(f"Override key {key!r} is given twice; keep one of them.")
        try:
            parsed[key] = yaml.load(raw, Loader=_loader_for(f"override {item!r}")) if raw.strip() else None
        except yaml.YAMLError as err:
            raise _yaml_error(f"override {item!r}", err) from None
    return parsed


# ----------------------------------------------------------------------------------------------------------
# resuming: which differences a checkpoint tolerates

_ABSENT = object()


def _json_value(value):
    import json
    return json.loads(json.dumps(value, default=str))


def resume_compatibility(saved: dict, now: dict) -> list[str]:
    """Refuse to resume a run whose config differs from the checkpoint's where it matters.

    saved / now: config dicts (``PPOConfig.to_dict()``; a PPOConfig is accepted too). Raises ConfigError
    listing every differing must_match field (and any key that is not a field) as ``name: saved -> now``.
    Returns the differing may_change fields (same format) so the caller can report them; ignored fields
    (output_dir, logging, save_steps, total_episodes, resume, ...) are skipped. A field one side lacks counts
    as its default (checkpoints from older versions stay loadable).
    """
    saved, now = (_json_value(c.to_dict() if isinstance(c, PPOConfig) else dict(c)) for c in (saved, now))
    defaults = _json_value({n: _FIELDS[n].default for n in FIELD_NAMES})
    strict, tunable = [], []
    for name in sorted(set(saved) | set(now)):
        if name in IGNORED_ON_RESUME_FIELDS:
            continue
        if name == "per_device_train_batch_size" and saved.get("batch_size") is not None \
                and saved.get("batch_size") == now.get("batch_size"):
            continue  # ignored when the global batch_size is set (and equal)
        a = saved.get(name, defaults.get(name, _ABSENT))
        b = now.get(name, defaults.get(name, _ABSENT))
        if a == b:
            continue
        line = f"  {name}: {'<absent>' if a is _ABSENT else repr(a)} -> {'<absent>' if b is _ABSENT else repr(b)}"
        (tunable if name in MAY_CHANGE_FIELDS else strict).append(line)
    if strict:
        raise ConfigError(
            "The checkpoint was written by a run with a different configuration "
            f"({len(strict)} field(s) that must match differ; saved -> now):\n" + "\n".join(strict)
            + "\nUse the checkpoint's values (its config.json), or start a fresh run (resume: null, or another "
              "output_dir).")
    return [line.strip() for line in tunable]


# ----------------------------------------------------------------------------------------------------------
# help

def field_help() -> list[tuple[str, str, str]]:
    """(name, default, description) for every field, for `ppojax train --help`."""
    docs = _field_docstrings()
    return [(f.name, repr(f.default), docs.get(f.name, "")) for f in fields(PPOConfig)]


def configuration_markdown() -> str:
    """docs/configuration.md: every field of PPOConfig with its default, whether changing it recompiles
    (static) and whether a resumed run may change it, and its description; generated from the fields' metadata and
    docstrings (``python -m ppojax.trainer.config > docs/configuration.md``; a test checks the file is current)."""
    lines = ["# Configuration", "",
             "Every field of `PPOConfig` (YAML keys, `key=value` overrides of `ppojax train`, or keyword arguments in",
             "Python), generated from the fields' docstrings by `python -m ppojax.trainer.config > docs/configuration.md`.",
             "*static*: part of the compiled program (changing it compiles anew); *on resume*: whether a resumed run",
             "must keep it (`must_match`), may change it (`may_change`, reported) or ignores it (`ignored`).", "",
             "| field | default | static | on resume | description |", "|---|---|---|---|---|"]
    docs = _field_docstrings()
    for f in fields(PPOConfig):
        static = "yes" if f.metadata.get("static") else "no"
        on_resume = f.metadata.get("on_resume", "")
        text = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{f.default!r}` | {static} | {on_resume} | {text} |")
    return "\n".join(lines) + "\n"


def _field_docstrings() -> dict[str, str]:
    """The string literal right under each field in this file's source is its description."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(PPOConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(getattr(following, "value", None), ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())  # type: ignore[attr-defined]
    return docs


def check_compatible(saved_config, config) -> list[str]:
    """:func:`resume_compatibility` on dicts or PPOConfigs (``to_dict()``), raising `CheckpointError` where a field
    that must match differs: the checkpoint cannot be resumed with this config."""
    from ppojax.errors import CheckpointError
    from ppojax.io.checkpoint import config_as_dict

    try:
        return resume_compatibility(config_as_dict(saved_config), config_as_dict(config))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None


if __name__ == "__main__":
    sys.stdout.write(configuration_markdown())
