"""A run's models from its config and the trainer's arguments: the policy, reference, reward and value models
loaded (or formed abstractly from their checkpoints' structure, to compile ahead and to plan), the backend's kernels
chosen for them once, LoRA adapters attached, and the trainable / frozen trees assembled as the train state holds
them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ppojax import backends
from ppojax.models import (Backbone, ScoreModel, abstract_pretrained, load_pretrained, new_score_head,
                           precision_dtypes)
from ppojax.models.kernels import XLA
from ppojax.models.lora import LoraSpec, with_lora
from ppojax import parallel
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.trainer.preflight import lora_spec_from_config
from ppojax.trainer.run_rewards import as_config_error


def load_model(role: str, path, **kwargs):
    """``load_pretrained`` with every way a checkpoint directory can be unusable (no config.json, missing,
    truncated or corrupt weights, mismatched shapes) turned into a ConfigError naming the role and the path."""
    try:
        return load_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        cause = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ConfigError(f"could not load the {role} from {str(path)!r}: {cause}") from err


def abstract_model(role: str, path, **kwargs):
    """:func:`load_model`'s model, abstract (``abstract_pretrained``: config.json and tensor names only)."""
    try:
        return abstract_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"could not read the {role}'s structure from {str(path)!r}: {err}") from err


def model_kwargs(config) -> dict:
    """The model constructor arguments the config sets: precision (compute and parameter dtypes) and
    rematerialisation. The backend's kernels (attention included) are chosen for the loaded models
    (:func:`_use_backend_kernels`)."""
    compute, params = precision_dtypes(config.precision)
    return dict(dtype=compute, param_dtype=params, remat=config.remat)


def follow_config(module, config: PPOConfig, role: str) -> None:
    """A model the caller built (PPOTrainer's ``model``, ``ref_model``, ``reward_model``, ``value_model``) runs
    with the config's compute choices, as a model ppojax loads does: ``remat`` is set on its backbones (a static
    choice: the weights are the same; the backend's kernels, attention included, are set on the run's copy,
    :func:`_use_backend_kernels`). Its
    precision cannot be changed without recasting the weights, so one that differs from ``precision`` is
    refused, naming how to build the model. Modules that are not ppojax's transformers are left alone."""
    if not isinstance(module, nnx.Module):
        return
    backbones = [sub for _, sub in nnx.iter_modules(module) if isinstance(sub, Backbone)]
    for backbone in backbones:
        backbone.remat = config.remat
    if backbones:
        compute, weights = (jnp.dtype(d) for d in precision_dtypes(config.precision))
        computes = {jnp.dtype(m.dtype) for _, m in nnx.iter_modules(module) if hasattr(m, "dtype")}
        stored = {x.dtype for x in jax.tree.leaves(nnx.state(module, nnx.Param))}
        if computes != {compute} or stored != {weights}:
            raise ConfigError(
                f"the {role} passed to PPOTrainer computes in {'/'.join(sorted(d.name for d in computes))} with "
                f"{'/'.join(sorted(d.name for d in stored))} weights, but precision={config.precision!r} means "
                f"{compute.name} compute over {weights.name} weights. Build it with the config's options, "
                "ppojax.models.load_pretrained(path, **ppojax.trainer.build.model_kwargs(config)), or set "
                "precision to match the model.")


@dataclass
class RunModels:
    """The model part of a run: graphdefs (static) and the trainable / frozen trees (arrays, or, from
    :func:`abstract_models`, their ``jax.ShapeDtypeStruct`` shapes).

    params: {"policy", "value"?}; frozen: {"ref", "reward", "base"?} (None where absent)."""

    policy_graphdef: Any
    value_graphdef: Any
    ref_graphdef: Any
    reward_graphdef: Any
    base_graphdef: Any
    lora_spec: Optional[LoraSpec]
    policy_cfg: Any
    params: dict
    frozen: dict
    kernels: Any = XLA  # the backend's operations the models were built with

    @property
    def static(self) -> tuple:
        """Everything the compiled program depends on besides the trees' shapes."""
        return (self.policy_graphdef, self.value_graphdef, self.ref_graphdef, self.reward_graphdef,
                self.base_graphdef, self.lora_spec)


def load_models(load, **sources) -> RunModels:
    """The run's models: :func:`_model_inputs` loaded by ``load`` (:func:`load_model`), then :func:`_assemble`d.
    The caller's own modules enter as copies, so every array of the result is the run's: the train state takes
    them over (``init_sharded_train_state(donate=True)``) and the caller's modules stay as they were."""
    given = {name: _copy_module(sources[name]) for name in ("model", "ref_model", "reward_model", "value_model")
             if sources[name] is not None}
    return _assemble(sources["config"], uses_critic=sources["uses_critic"],
                     **_model_inputs(load, **{**sources, **given}))


def _copy_module(module):
    """The same module on fresh buffers (``device_put`` copies)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, parallel.copy_arrays(state))


def _model_inputs(load, *, config, mesh, model_path, model, ref_model, reward_model, value_model, uses_critic,
                  has_reward_function) -> dict:
    """{policy, ref_model, reward_module, value_module}: the caller's modules, and those the config names by
    path loaded by ``load`` (:func:`load_model`, or :func:`abstract_model`); None where there is none."""
    model_options = model_kwargs(config)
    if model is None:
        kind = "value_head" if config.value_head == "policy" and uses_critic else "causal_lm"
        head = {"head_init": config.value_head_init} if kind == "value_head" else {}
        model, _ = load("policy", model_path, kind=kind, seed=config.seed, **head, **model_options)
    if reward_model is None and config.reward_model_path is not None:
        reward_model, _ = load("reward model", config.reward_model_path, kind="score",
                               score_label=config.reward_model_label, **model_options)
    if uses_critic and config.value_head == "separate" and value_model is None \
            and config.value_model_path is not None:
        value_model, _ = load("value model", config.value_model_path, kind="score",
                              head_init=config.value_head_init, **model_options)
    _use_backend_kernels(config, mesh, model, ref_model, reward_model, value_model)
    return dict(policy=model, ref_model=ref_model, reward_module=reward_model, value_module=value_model)


def _use_backend_kernels(config, mesh, *modules) -> None:
    """Choose the backend's kernels for the run's models (once, from their shapes: abstract models get the same
    choice as loaded ones) and set them on every backbone. The modules are the run's own (copies of the caller's)."""
    present = [m for m in modules if m is not None]
    kernels = as_config_error(backends.kernels_for, present, matmul_implementation=config.matmul_implementation,
                              attention_implementation=config.attention_implementation, mesh=mesh,
                              long_packed_rows=config.packed_row_length is not None)
    backends.use_kernels(kernels, *present)


def _assemble(config, *, policy, ref_model, reward_module, value_module, uses_critic) -> RunModels:
    """The run's trainable and frozen trees from its modules: the value model (given, else the reward model's
    copy as TRL, else the policy's backbone + a new head), LoRA adapters on the policy, the reference (given,
    the LoRA base, or a frozen copy of the initial policy). Pure in the modules' arrays, so it also runs
    under ``jax.eval_shape`` on abstract ones (:func:`abstract_models`)."""
    params, frozen = {}, {}
    value_graphdef = None
    if uses_critic and config.value_head == "separate":
        value = value_module if value_module is not None else reward_module
        if value is None:
            value = _new_value_model(config, policy, dict(model_kwargs(config), kernels=policy.kernels))
        value_graphdef, params["value"] = nnx.split(value)
        if value_module is None and reward_module is not None:
            # the value model trains; the reward model must not
            params["value"] = parallel.copy_arrays(params["value"])
    lora_spec = lora_spec_from_config(config, policy.cfg)
    base_graphdef = None
    if lora_spec is not None:  # only the adapters train; the base weights are frozen and serve the reference too
        base_graphdef, policy_graphdef, params["policy"], frozen["base"] = with_lora(
            policy, lora_spec, jax.random.key(config.seed + 3))
    else:
        policy_graphdef, params["policy"] = nnx.split(policy)
    if ref_model is not None:
        ref_graphdef, ref_params = nnx.split(ref_model)
    elif lora_spec is not None:  # the base weights with the adapters off (ActorCritic.reference): no copy
        ref_graphdef, ref_params = None, None
    else:  # a frozen copy of the initial policy (never donated to the optimizer, never updated)
        ref_graphdef, ref_params = policy_graphdef, parallel.copy_arrays(params["policy"])
    reward_graphdef, reward_params = nnx.split(reward_module) if reward_module is not None else (None, None)
    frozen.update(ref=ref_params, reward=reward_params)
    return RunModels(policy_graphdef, value_graphdef, ref_graphdef, reward_graphdef, base_graphdef, lora_spec,
                   policy.cfg, params, frozen, policy.kernels)


def abstract_models(**sources) -> Optional[RunModels]:
    """:func:`load_models` with no weight read or drawn: the checkpoints by their structure
    (:func:`abstract_model`), then :func:`assemble_abstractly`. Its ``static`` equals the real models' when
    the checkpoints load as their structure says. None when a checkpoint's structure cannot be read (loading
    it reports why, with the fix)."""
    try:
        inputs = _model_inputs(abstract_model, **sources)
    except ConfigError:
        return None
    return assemble_abstractly(sources["config"], inputs, uses_critic=sources["uses_critic"])


def assemble_abstractly(config, inputs: dict, *, uses_critic: bool) -> RunModels:
    """:func:`_assemble` of ``inputs`` ({policy, ref_model, reward_module, value_module}: modules with arrays or
    ``jax.ShapeDtypeStruct`` weights, or None) traced by ``jax.eval_shape``: the run's graphdefs and the shapes
    of its trees, nothing allocated (its copies and new heads are shapes only). ``build_run``'s compile ahead
    and ``ppojax.trainer.plan`` use it, so both see the models a run builds."""
    present = {name: module for name, module in inputs.items() if module is not None}
    graphdefs = {name: nnx.graphdef(module) for name, module in present.items()}
    assembled = {}

    def assemble(states):
        modules = {name: nnx.merge(graphdefs[name], states[name]) if name in states else None for name in inputs}
        assembled["models"] = _assemble(config, uses_critic=uses_critic, **modules)
        return assembled["models"].params, assembled["models"].frozen

    params, frozen = jax.eval_shape(assemble, {name: nnx.state(module) for name, module in present.items()})
    return dataclasses.replace(assembled["models"], params=params, frozen=frozen)


def _new_value_model(config, policy, model_options):
    """The value model when there is neither a given one nor a reward model (TRL initialises the value model
    from the reward model; with a reward function there is none): the policy's backbone with a fresh score head."""
    # Built abstractly: the backbone is the policy's (copied), only the new head is drawn (as transformers
    # initialises a missing score head: normal(0, initializer_range); or zeros). An eager init of the whole model
    # would compile and run a random draw per weight shape, only to be overwritten.
    abstract = nnx.eval_shape(lambda: ScoreModel(policy.cfg, rngs=nnx.Rngs(config.seed + 1), **model_options))
    graphdef, state = nnx.split(abstract)
    kernel = new_score_head(policy.cfg, jax.random.key(config.seed + 1), state["score"]["kernel"].dtype,
                            config.value_head_init)
    backbone = parallel.copy_arrays(nnx.state(policy.backbone))
    state = nnx.State({"backbone": backbone, "score": {"kernel": kernel}})
    return nnx.merge(graphdef, state)

