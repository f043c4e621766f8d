"""Checking a config's values: each field's type and rule (:func:`checked_value`, with the other spellings of a
value in VALUE_ALIASES), then the checks that need several fields, the registered names, and the advantage
estimator's options. ``PPOConfig.validate`` runs them in that order and reports every problem in one
ConfigError naming the field, the value, what was expected and the fix."""
from __future__ import annotations

import math
import typing
from typing import TYPE_CHECKING, Any

import yaml

from ppojax.errors import ConfigError
from ppojax.trainer.config.schema import FIELD_BY_NAME, FIELD_HINTS, FIELD_NAMES
from ppojax.trainer.config.sections.batches import packing_problems, shared_prompt_problems
from ppojax.trainer.config.sections.models import IN_PLACE_MATMULS
from ppojax.trainer.config.sections.offpolicy import policy_objective_off_policy
from ppojax.trainer.config.sections.objective import (POLICY_OBJECTIVE_NAME, advantage_estimator_traits,
                                                      per_sequence_advantages, policy_objective_level_reason,
                                                      policy_objective_traits)

if TYPE_CHECKING:  # ppo_config imports this module to validate
    from ppojax.trainer.config.ppo_config import PPOConfig

# Other spellings of a value -> the value (matched by type too, so `resume: 1` is not `resume: true`).
VALUE_ALIASES: dict[str, list[tuple[Any, Any]]] = {
    "kl_estimator": [("kl", "k1")],           # legacy TRL's kl_penalty: 'kl'
    "scale_rewards": [(True, "group"), (False, "none")],  # TRL GRPOConfig's booleans
    "advantage_estimator": [("reinforce_plus_plus", "reinforce_pp"),  # verl's names
                            ("reinforce_plus_plus_baseline", "reinforce_pp_baseline")],
    "resume": [(True, "auto"), (False, None)],
    "report_to": [(None, "none")],
}


def type_in_words(hint) -> str:
    """'an integer' / 'a number' / 'a string' / 'true or false' for a field's (non-None) type."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(base, "a value")


def expected_of(name: str) -> str:
    """What a field takes, in words: 'null or an integer >= 1'."""
    hint, rule = FIELD_HINTS[name], FIELD_BY_NAME[name].metadata["rule"]
    words = rule.expected.format(a=type_in_words(hint)) if rule is not None else type_in_words(hint)
    return f"null or {words}" if type(None) in typing.get_args(hint) else words


def _default_text(name: str) -> str:
    """The default as written in YAML (null, true, 3.0e-06), strings quoted."""
    default = FIELD_BY_NAME[name].default
    if isinstance(default, str):
        return repr(default)
    return yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()


def _bad(name: str, value: Any, got: str = "", fix: str = "") -> ConfigError:
    expected = expected_of(name)
    fix = fix or f"Fix: set {name} to {expected} (the default is {_default_text(name)})."
    return ConfigError(f"{name}={value!r}: expected {expected}{got}. {fix}")


def value_kind(value) -> str:
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
    hint = FIELD_HINTS[name]
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
            raise _bad(name, value, f", got {value_kind(value)}")
        numbers = []
        for v in value:
            if isinstance(v, bool) or not isinstance(v, (int, float, str)):
                raise _bad(name, value, f", got an entry that is {value_kind(v)}")
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
        raise _bad(name, value, f", got {value_kind(value)}")
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
        rule = FIELD_BY_NAME[name].metadata["rule"]  # a number of the wrong kind: the field's own fix applies
        raise _bad(name, value, ", got a value that is not a whole number",
                   fix=rule.fix if rule is not None and not isinstance(value, str) else "")
    if target is bool:
        if isinstance(value, bool):
            return value
        raise _bad(name, value, f", got {value_kind(value)}")
    if target is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise _bad(name, value, f", got {value_kind(value)}")


def checked_value(name: str, given: Any) -> Any:
    """One field's value normalised (aliases, type) and checked against its rule, or ConfigError."""
    value = given
    for spelling, meaning in VALUE_ALIASES.get(name, ()):
        if type(value) is type(spelling) and value == spelling:
            value = meaning
            break
    value = _typed(name, value)
    rule = FIELD_BY_NAME[name].metadata["rule"]
    if value is not None and rule is not None and rule.registry is None and not rule.ok(value):
        raise _bad(name, given, fix=rule.fix)
    return value


def registry_problems(config: PPOConfig) -> list[ConfigError]:
    problems = []
    for name in FIELD_NAMES:
        rule, value = FIELD_BY_NAME[name].metadata["rule"], getattr(config, name)
        if rule is not None and rule.registry is not None and value is not None and not rule.ok(value):
            names = rule.registry()
            problems.append(ConfigError(f"{name}={value!r}: expected one of {', '.join(map(repr, names))}. "
                                        f"Fix: set {name} to one of them (the default is "
                                        f"{_default_text(name)})."))
    return problems


def problems_together(c: PPOConfig) -> list[str]:
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
    out.extend(packing_problems(c))
    lora_set = [f"{n}={getattr(c, n)!r}" for n in ("lora_alpha", "lora_dropout", "lora_target_modules")
                if getattr(c, n) != FIELD_BY_NAME[n].default]
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
    if c.eval_steps and c.num_eval_prompts == 0:
        out.append(f"eval_steps={c.eval_steps} scores the held-out prompts during training, but num_eval_prompts=0 "
                   "holds none out; hold some out (e.g. num_eval_prompts: 64) or set eval_steps: 0.")
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
    out.extend(shared_prompt_problems(c, None if sizes is None else sizes.micro_batch_size))
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


def estimator_problems(c: PPOConfig) -> list[str]:
    """The advantage estimator's options against each other (the estimator is a registered one)."""
    uses_critic, from_group = advantage_estimator_traits(c.advantage_estimator)
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
    if critic_free and c.critic_learning_rate is not None:
        out.append(f"critic_learning_rate={c.critic_learning_rate} but advantage_estimator={c.advantage_estimator!r} "
                   "has no critic to train; remove critic_learning_rate (or use advantage_estimator: gae).")
    if critic_free and c.value_model_path is not None:
        out.append(f"value_model_path={c.value_model_path!r} is set but advantage_estimator="
                   f"{c.advantage_estimator!r} uses no value model; remove value_model_path.")
    if c.kl_loss_type == "full":
        out.append("kl_loss_type='full' is not available in the loss (it needs both full distributions, computed "
                   "once in the rollout); use 'low_var_kl', 'k3', 'k2' or 'k1'.")
    return out


def dynamic_sampling_problems(c: PPOConfig) -> list[str]:
    """DAPO's dynamic sampling (filter_groups) against the estimator and the batch (the rounds' sizes: ``derived``)."""
    if not c.filter_groups:
        return [f"{name}={getattr(c, name)!r} is read only with filter_groups: true (DAPO's dynamic sampling); set "
                f"filter_groups: true, or remove {name}." for name in ("max_num_gen_batches", "gen_batch_size",
                                                                       "filter_groups_metric")
                if getattr(c, name) != FIELD_BY_NAME[name].default]
    out = []
    if c.num_generations < 2:
        out.append(f"filter_groups=True drops the prompts whose samples all scored the same, which needs "
                   f"num_generations >= 2 samples of each prompt (got {c.num_generations}); set e.g. "
                   "num_generations: 8.")
    uses_critic, _ = advantage_estimator_traits(c.advantage_estimator)
    if uses_critic or not per_sequence_advantages(c.advantage_estimator):
        why = ("its values still give them advantages" if uses_critic else
               "it gives each token its own advantage, not one from the prompt's samples")
        out.append(f"filter_groups=True drops the groups whose scores are all equal because a group-relative "
                   f"advantage is 0 there; with advantage_estimator={c.advantage_estimator!r} {why}. Use "
                   "advantage_estimator: grpo (DAPO's), rloo or reinforce_pp_baseline, or remove filter_groups.")
    names = c.reward_names  # (functions passed in Python are checked at the build)
    if c.filter_groups_metric is not None and names and c.filter_groups_metric not in names:
        out.append(f"filter_groups_metric={c.filter_groups_metric!r} names none of this run's rewards "
                   f"({', '.join(names)}); set it to one of them, or remove it to judge groups by the score.")
    forward = c.local_rollout_forward_batch_size
    if forward is not None and c.gen_batch_size is not None and (c.gen_batch_size * c.num_generations) % forward:
        rows = c.gen_batch_size * c.num_generations
        out.append(f"local_rollout_forward_batch_size={forward} does not divide the {rows} rows a generation round "
                   f"scores (gen_batch_size {c.gen_batch_size} x num_generations {c.num_generations}); use a "
                   f"divisor of {rows}, or null.")
    return out


def agent_problems(c: PPOConfig) -> list[str]:
    """An agent run (tools or environment_factory) and the fields that shape its episodes."""
    agent_only = [name for name in ("turn_length", "tool_chat_template") if getattr(c, name) is not None]
    if not c.is_agent_run:
        return [f"{name}={getattr(c, name)!r} is read only by an agent run (tools or environment_factory); set one "
                "of those, or remove it." for name in agent_only]
    out = []
    if c.filter_groups:
        out.append("filter_groups=True (dynamic sampling) is not available with tools or an environment_factory yet: "
                   "an agent run samples its episodes in one batch. Set filter_groups: false.")
    if c.turn_length is not None and c.turn_length > c.response_length:
        out.append(f"turn_length={c.turn_length} is longer than response_length={c.response_length}, the whole "
                   "episode's tokens; lower turn_length or raise response_length.")
    return out


def objective_problems(c: PPOConfig) -> list[str]:
    """The policy objective (``loss_type``, a registered one) against its options and the advantages it reads."""
    aggregation, levels, sequence_advantages, options = policy_objective_traits(c.loss_type)
    name = f"loss_type={c.loss_type!r}"
    out = []
    if c.importance_sampling_level not in levels:
        reason = policy_objective_level_reason(c.loss_type)
        out.append(f"importance_sampling_level={c.importance_sampling_level!r} with {name}: it takes "
                   f"{' or '.join(map(repr, levels))} only{f': {reason}' if reason else ''}. Set "
                   f"importance_sampling_level: {levels[0]}.")
    if aggregation is not None and c.loss_agg_mode not in (FIELD_BY_NAME["loss_agg_mode"].default, aggregation):
        out.append(f"loss_agg_mode={c.loss_agg_mode!r} with {name}, which averages by {aggregation!r} itself; "
                   f"remove loss_agg_mode, or use loss_type: ppo with loss_agg_mode: {c.loss_agg_mode}.")
    read_by = {}
    for other in POLICY_OBJECTIVE_NAME.registry():
        for option in policy_objective_traits(other)[3]:
            read_by.setdefault(option, []).append(other)
    for option, objectives in read_by.items():
        value = getattr(c, option)
        if option != "loss_agg_mode" and option not in options and value != FIELD_BY_NAME[option].default:
            out.append(f"{option}={value!r} is not read by {name} (only by {', '.join(objectives)}); remove it.")
    if sequence_advantages and not per_sequence_advantages(c.advantage_estimator):
        out.append(f"{name} reads one advantage per sequence, but advantage_estimator={c.advantage_estimator!r} "
                   "gives each token its own; use advantage_estimator: grpo, rloo or reinforce_pp_baseline.")
    if c.mask_truncated_completions and c.stop_token is None and c.stop_token_id is None:
        out.append("mask_truncated_completions=True leaves out the responses without the stop token, which is "
                   "every response without one: set stop_token: eos (or stop_token_id), or remove "
                   "mask_truncated_completions.")
    if c.multi_objective_aggregation == "normalize_then_sum":
        if c.advantage_estimator != "grpo":
            out.append(f"multi_objective_aggregation='normalize_then_sum' only applies to advantage_estimator: "
                       f"grpo (this run uses {c.advantage_estimator!r}); remove it.")
        if c.scale_rewards != "group":
            out.append(f"scale_rewards={c.scale_rewards!r} plays no part with multi_objective_aggregation="
                       "'normalize_then_sum' (each reward is normalised in its group, the sum over the batch); "
                       "remove it.")
        for penalty in ("missing_eos_penalty", "soft_punish_cache"):
            if getattr(c, penalty):
                out.append(f"{penalty}={getattr(c, penalty)!r} adjusts the summed score, which "
                           "multi_objective_aggregation='normalize_then_sum' does not read (it normalises each "
                           f"reward); add the penalty as a reward function, or remove {penalty}.")
    if c.soft_punish_cache >= c.response_length:
        out.append(f"soft_punish_cache={c.soft_punish_cache} is not below response_length={c.response_length}: "
                   "the penalty would start at the first token. Set it below response_length (DAPO: a fifth of "
                   f"it, e.g. {max(c.response_length // 5, 1)}), or 0 for no penalty.")
    return out



_IMPORTANCE_SAMPLING_OPTIONS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                                "vllm_importance_sampling_clip_min")


def async_problems(c: PPOConfig) -> list[str]:
    """Asynchronous RL (``max_staleness`` > 0): what the pipeline of in-flight batches supports."""
    k = c.max_staleness
    if not k:
        out = [] if not c.rollout_devices else [
            f"rollout_devices={c.rollout_devices} samples on devices of their own while the others train on older "
            "batches, which needs max_staleness >= 1 (the batches in flight between the two). Set max_staleness: 1 "
            "(or more), or remove rollout_devices."]
        if c.in_flight_weight_updates:
            out.append("in_flight_weight_updates: true spreads each batch's decode over max_staleness + 1 updates, "
                       "which needs max_staleness >= 1. Set max_staleness: 1 (or more), or remove "
                       "in_flight_weight_updates.")
        return out
    out = []
    if c.in_flight_weight_updates and c.rollout_devices:
        out.append(f"in_flight_weight_updates: true swaps new weights into the decode on the devices that train, but "
                   f"rollout_devices={c.rollout_devices} samples on devices of their own, which get the weights "
                   "after each update. Remove one of the two.")
    if c.behaviour_logprobs != "sampler":
        out.append(f"max_staleness={k} learns from batches an older policy sampled, whose log-probs only the sampler "
                   f"kept, but behaviour_logprobs={c.behaviour_logprobs!r} would recompute them with the current "
                   "policy (the stale tokens would pass for on-policy ones). Set behaviour_logprobs: sampler.")
    if c.filter_groups:
        out.append(f"max_staleness={k} with filter_groups: true is not supported (dynamic sampling's rounds are "
                   "sampled and filtered inside one update). Remove filter_groups, or set max_staleness: 0.")
    if c.is_agent_run:
        out.append(f"max_staleness={k} with tools or an environment is not supported: a multi-turn run's episodes "
                   "are learned by the update that played them. Set max_staleness: 0.")
    return out


def off_policy_problems(c: PPOConfig) -> list[str]:
    """The off-policy corrections (docs/algorithm.md, "Off-policy corrections") against each other, the behaviour
    log-probs and the policy objective."""
    out = []
    correction, decoupled = c.vllm_importance_sampling_correction, c.use_decoupled_loss
    if not correction:
        out += [f"{name}={getattr(c, name)!r} is read only with vllm_importance_sampling_correction: true; set "
                f"vllm_importance_sampling_correction: true, or remove {name}." for name in _IMPORTANCE_SAMPLING_OPTIONS
                if getattr(c, name) != FIELD_BY_NAME[name].default]
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    if correction and low is not None and high is not None and low >= high:
        out.append(f"vllm_importance_sampling_clip_min={low} is not below vllm_importance_sampling_clip_max={high}: "
                   "no weight would be left between them. Set clip_min below clip_max (or null).")
    if correction and c.vllm_importance_sampling_mode.endswith("_truncate") and low is None and high is None:
        out.append(f"vllm_importance_sampling_mode={c.vllm_importance_sampling_mode!r} truncates the weights to "
                   "[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max], but both are null; set "
                   "at least one of them (TRL's default: vllm_importance_sampling_clip_max: 3.0).")
    if c.behav_imp_weight_cap is not None and not decoupled:
        out.append(f"behav_imp_weight_cap={c.behav_imp_weight_cap} caps the behaviour weights of the decoupled "
                   "objective; set use_decoupled_loss: true, or remove behav_imp_weight_cap.")
    if correction and decoupled:
        out.append("vllm_importance_sampling_correction=True and use_decoupled_loss=True both weigh each token by "
                   "pi_prox / pi_behav (the loss would take it twice); keep one: use_decoupled_loss (AReaL's, capped "
                   "by behav_imp_weight_cap) or vllm_importance_sampling_correction (TRL's modes and bounds).")
    for name in ("vllm_importance_sampling_correction", "use_decoupled_loss"):
        if getattr(c, name) and c.behaviour_logprobs != "sampler":
            out.append(f"{name}=True weighs the sampler's log-probs (the behaviour policy) against the training "
                       f"policy's forward (the proximal one), but behaviour_logprobs={c.behaviour_logprobs!r} makes "
                       "the behaviour log-probs that same forward: every weight would be 1. Set behaviour_logprobs: "
                       f"sampler, or remove {name}.")
    kind, reason = policy_objective_off_policy(c.loss_type)
    asked = [f"{name}={getattr(c, name)!r}" for name in ("vllm_importance_sampling_correction", "use_decoupled_loss",
                                                         "off_policy_mask_threshold")
             if getattr(c, name) not in (False, None)]
    if kind == "unsupported" and asked:
        out.append(f"{', '.join(asked)} with loss_type={c.loss_type!r}, which takes no off-policy correction"
                   f"{f': {reason}' if reason else ''}. Use another loss_type (e.g. grpo), or remove "
                   f"{' and '.join(a.split('=')[0] for a in asked)}.")
    if kind == "folded" and correction and not c.vllm_importance_sampling_mode.startswith("token_"):
        out.append(f"vllm_importance_sampling_mode={c.vllm_importance_sampling_mode!r} with loss_type="
                   f"{c.loss_type!r}: it takes per-token weights only{f': {reason}' if reason else ''}. Set "
                   "vllm_importance_sampling_mode: token_truncate or token_mask.")
    return out
