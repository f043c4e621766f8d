"""Build: a validated config (and optional user objects) -> everything a run needs, as one ``Run``.

    config -> mesh -> policy (+ tokenizer) -> reward source -> value function -> reference -> prompts
           -> StepSettings (static) + Hyperparams (traced) -> optimizer -> sharded TrainState -> PPOProgram

Every user mistake found here is a ``ConfigError`` (``ppojax train`` prints it without a traceback and exits
with 2); the checks that need only ``config.json`` files and the device count run before any weights are
loaded.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax.parallel import sharding
from ppojax.rl import placement
from ppojax.rl.actor_critic import ActorCritic
from ppojax.trainer.compile_cache import enable_compilation_cache
from ppojax.trainer.config import BUILTIN_REWARDS, IN_PLACE_MATMULS, ConfigError, PPOConfig
from ppojax.models.families.keys import hf_num_labels
from ppojax.models.lora import LoraSpec, resolve_target_modules, with_lora
from ppojax.core.advantages import advantage_estimator
from ppojax.trainer.data import (BUILTIN_ARITHMETIC, BUILTIN_MOVIE_REVIEWS, PromptBatches, arithmetic_split,
                                 check_tokenizer, load_prompt_dataset, load_prompt_table, prepare_prompts)
from ppojax.rl.reward_calls import RewardCall
from ppojax.rl.rewards import ColumnTable, FunctionScores, ModelScores, TracedScores, WeightedRewards
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.program import PPOProgram
from ppojax.rl.types import TrainState
from ppojax.rl.optimizer import optimizer_from_config

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What a run is made of. ``state`` is the only part that changes (it is donated to every step).

    program: the static PPO program (models' graphdefs, reward source, settings, optimizer, mesh).
    train_queries / eval_queries: np i32[N, P] left-padded prompt ids (eval: held out, or None).
    batches: the resumable prompt-batch iterator (None without a dataset: the legacy ``step()`` API).
    """

    config: PPOConfig
    tokenizer: Any
    model_config: Any
    mesh: Any
    program: PPOProgram
    state: TrainState
    state_shardings: Any
    num_updates: int
    train_queries: Optional[np.ndarray]
    eval_queries: Optional[np.ndarray]
    batches: Optional[PromptBatches]
    compilation_cache_dir: Any = None
    lora: Optional[LoraSpec] = None  # the policy's LoRA adapters (None: full fine-tuning)
    model_path: Optional[str] = None  # the policy's checkpoint directory (None: the caller passed the model)
    train_step: Optional[Callable] = None  # the step compiled ahead (build_run's compile_ahead), else None

    @property
    def settings(self) -> StepSettings:
        return self.program.settings

    @property
    def reward(self):
        return self.program.reward


# --------------------------------------------------------------------------------------------------
# Resolving names to objects
# --------------------------------------------------------------------------------------------------
def _builtin_reward(name: str) -> Callable:
    """The reward function a built-in name (``config.BUILTIN_REWARDS``) stands for."""
    if name == "vader":
        from ppojax.rl.rewards import vader_sentiment_reward
        fn = vader_sentiment_reward()
        fn.__name__ = "vader"
        return fn
    from ppojax.tasks import math_answers
    return getattr(math_answers, name)


def resolve_reward_function(spec) -> Callable:
    """A built-in name ('vader', 'gsm8k_strict', ...), 'module:function', or a callable -> a reward function."""
    if callable(spec):
        return spec
    if spec in BUILTIN_REWARDS:
        return _builtin_reward(spec)
    module_name, sep, attr = str(spec).partition(":")
    if not sep:
        raise ConfigError(f"reward function {spec!r}: expected one of {BUILTIN_REWARDS} or 'module:function' "
                          "(e.g. 'my_rewards:length_reward').")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # noqa: BLE001 - any failure to import the user's module is a config error
        raise ConfigError(f"reward_function={spec!r} could not be imported ({type(err).__name__}: {err}); check "
                          "that the module is on PYTHONPATH, imports cleanly and defines that function.") from err
    if not callable(fn):
        raise ConfigError(f"reward_function={spec!r} is a {type(fn).__name__}, not a function f(prompts, "
                          "completions) -> floats.")
    return fn


def resolve_model_path(path: str) -> str:
    """'smollm2' -> the bundled SmolLM2-135M-Instruct checkpoint (converted once); otherwise the path itself."""
    if path == "smollm2":
        from ppojax.assets import smollm2_checkpoint
        return str(smollm2_checkpoint())
    return path


def load_model(role: str, path, **kwargs):
    """``load_pretrained`` with every way a checkpoint directory can be unusable (no config.json, missing,
    truncated or corrupt weights, mismatched shapes) turned into a ConfigError naming the role and the path."""
    from ppojax.models import load_pretrained
    try:
        return load_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        cause = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ConfigError(f"could not load the {role} from {str(path)!r}: {cause}") from err


def as_config_error(fn, *args, **kwargs):
    """Run a data/tokenizer check, re-raising its ValueError as a ConfigError, so that `ppojax train` prints
    the message instead of a traceback."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, OSError) as err:
        raise ConfigError(str(err)) from err


# --------------------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------------------
NO_REWARD = ("No reward: set reward_funcs (e.g. [vader] or [my_module:my_reward]) or reward_model_path (a "
             "sequence-classification checkpoint), or pass reward_funcs / reward_model to PPOTrainer.")


# --------------------------------------------------------------------------------------------------
# Checks from config.json files and the device count alone (no weights, no tokenizer)
# --------------------------------------------------------------------------------------------------
def _model_config(role: str, path):
    from ppojax.models import load_config
    try:
        return load_config(path)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"could not read the {role}'s config from {str(path)!r}: {err}") from err


def _hf_config(path) -> dict:
    import json
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
    import jax

    try:
        mesh_shape = sharding.mesh_shape(config.mesh_data, config.mesh_fsdp, config.mesh_tensor,
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
        policy = _model_config("policy", path)
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
            resolve_reward_function(spec)  # importable, and a function
    if config.reward_model_path is not None and not reward_given:
        hf = _hf_config(config.reward_model_path)
        _model_config("reward model", config.reward_model_path)  # exists, parses, supported architecture
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
        _model_config("value model", config.value_model_path)
    if config.dataset and not dataset_given and _dataset_source(config) != BUILTIN_MOVIE_REVIEWS:
        # a prompt file is read in a moment; a malformed one must not cost a model load first
        as_config_error(load_prompt_dataset, _dataset_source(config), column=config.dataset_text_field)


def build_run(config: PPOConfig, processing_class=None, model=None, ref_model=None, reward_model=None,
              train_dataset=None, value_model=None, *, reward_funcs=None, compile_ahead: bool = False) -> Run:
    """Everything a run needs, from a validated config and (optionally) user-made objects (TRL's
    ``PPOTrainer`` arguments; see ``ppojax.trainer.ppo_trainer.PPOTrainer``).

    reward_funcs: Python reward functions (callables, or specs as in ``config.reward_funcs``), which replace
    the config's; summed with a reward model when there is one (TRL's GRPOTrainer ``reward_funcs``).
    Order: checks, prompts, tokenizer and prompt ids (no weights yet), then the models, then the state.
    compile_ahead: when the run has prompts and a reward source, the models are first formed abstractly
    (``abstract_pretrained``: shapes from the checkpoints' configs) and ``train_step`` is compiled for them
    on a background thread while the weights load (``ppojax.trainer.compile_ahead``); ``Run.train_step`` is
    that step, whose first call finds the program compiled."""
    config = config.validate()
    sharding.initialize_distributed()  # a no-op on one process; must precede other device work
    # the prompt texts are read here, once, before any model (the preflight leaves them to this)
    preflight(config, policy_given=model is not None, reward_given=reward_model is not None,
              functions_given=reward_funcs is not None, dataset_given=True)
    texts, columns, n_train_texts = None, {}, None
    if train_dataset is not None or config.dataset:
        texts, columns = as_config_error(load_prompt_table,
                                         train_dataset if train_dataset is not None else _dataset_source(config),
                                         column=config.dataset_text_field)
        if config.eval_dataset is not None:
            texts, columns, n_train_texts = _with_eval_dataset(config, texts, columns)
    cache_dir = enable_compilation_cache(config.compilation_cache_dir)
    mesh = as_config_error(sharding.mesh_from_config, config)
    uses_critic = advantage_estimator(config.advantage_estimator).uses_critic
    data_parallel = sharding.data_parallel_size(mesh)
    config.derived(data_parallel)  # batch sizes must split over the data-parallel devices (before loading)
    _check_matmul_implementation(config, mesh)
    for given, role in ((model, "policy"), (ref_model, "reference model"), (reward_model, "reward model"),
                        (value_model, "value model")):
        follow_config(given, config, role)

    # ---- tokenizer and token ids (the policy's config.json gives its vocabulary: no weights yet) ----
    model_path = None if model is not None else resolve_model_path(config.model_name_or_path)
    policy_cfg = model.cfg if model is not None else _model_config("policy", model_path)
    if processing_class is None:
        if model_path is None:
            raise ConfigError("processing_class (the tokenizer) is required when `model` is given.")
        from ppojax.models import load_tokenizer
        processing_class = as_config_error(load_tokenizer, model_path)
    pad_token_id = as_config_error(check_tokenizer, processing_class, policy_cfg.vocab_size)
    stop_token_id = config.stop_token_id
    if stop_token_id is None and config.stop_token_is_eos:
        stop_token_id = processing_class.eos_token_id
    if stop_token_id is not None and stop_token_id == pad_token_id:
        raise ConfigError(f"stop token id {stop_token_id} equals the pad token id; ppojax keys its masks on "
                          "`token != pad`. Give the tokenizer a distinct pad token.")
    if uses_critic and config.value_head == "policy" and model is not None and not hasattr(model, "value"):
        raise ConfigError("value_head='policy' needs a CausalLMWithValueHead policy (load it with "
                          "kind='value_head'), or set value_head='separate'.")
    if config.missing_eos_penalty is not None and stop_token_id is None:
        raise ConfigError("missing_eos_penalty is set but there is no stop token: every response would be "
                          "penalised. Set stop_token: eos (or stop_token_id).")
    reward_calls, traced, order = _reward_calls(config, reward_model, reward_funcs)
    if callable(reward_model) and not isinstance(reward_model, nnx.Module):
        reward_model = None

    # ---- data ----
    train_queries = eval_queries = batches = table = None
    if texts is not None:
        prompts = as_config_error(prepare_prompts, texts, processing_class, config.max_prompt_length,
                                  chat_template=config.chat_template, stop_token_id=stop_token_id,
                                  pad_token_id=pad_token_id)
        num_eval = config.num_eval_prompts
        if n_train_texts is not None:  # held-out prompts from eval_dataset: those that survived the length filter
            num_eval = sum(i >= n_train_texts for i in prompts.indices)
            if num_eval == 0:
                raise ConfigError(f"eval_dataset={config.eval_dataset!r}: none of its prompts fits "
                                  f"max_prompt_length={config.max_prompt_length}; raise it.")
        train_queries, eval_queries = _split_eval(prompts.input_ids, num_eval)
        if columns:  # the kept prompts' rows, in prompt-table order (training rows first, then held-out ones)
            table = ColumnTable({name: [values[i] for i in prompts.indices] for name, values in columns.items()})
    for call in reward_calls:  # a function that needs a column the dataset lacks: said before any model loads
        as_config_error(call.check_arguments, table.names if table is not None else [])
    sizes = config.derived(data_parallel)
    dataset_size = len(train_queries) if train_queries is not None else sizes.prompts_per_batch
    num_updates = config.num_updates(dataset_size)
    if train_queries is not None:
        if len(train_queries) < sizes.prompts_per_batch:
            per_update = (f"batch_size={sizes.batch_size}" if config.num_generations == 1 else
                          f"the {sizes.prompts_per_batch} prompts an update takes (batch_size={sizes.batch_size} / "
                          f"num_generations={config.num_generations})")
            raise ConfigError(f"The dataset has {len(train_queries)} training prompts after filtering and "
                              f"holding out num_eval_prompts={config.num_eval_prompts}, fewer than "
                              f"{per_update}; lower batch_size or add prompts.")
        batches = PromptBatches(train_queries, sizes.prompts_per_batch, seed=config.seed,
                                process_index=jax.process_index(), process_count=jax.process_count())

    # ---- the models: abstract first (compiling ahead), then their weights ----
    has_model_reward = reward_model is not None or config.reward_model_path is not None
    function_scores = None
    if reward_calls:
        function_scores = FunctionScores(reward_calls, processing_class, pad_token_id, table=table,
                                         allow_nonfinite=config.on_nonfinite_reward == "skip", mesh=mesh,
                                         sole=not has_model_reward and not traced)
    has_reward = function_scores is not None or bool(traced) or has_model_reward
    model_reward_name = (Path(config.reward_model_path).name if config.reward_model_path is not None
                         else "reward_model")

    def program_for(models: "_Models") -> PPOProgram:
        parts = ([] if function_scores is None else [function_scores]) + traced
        if models.reward_graphdef is not None:
            parts.append(ModelScores(models.reward_graphdef, pad_token_id, config.local_rollout_forward_batch_size,
                                     name=model_reward_name))
        reward = as_config_error(_combined_reward, parts, _weights_in_part_order(config.reward_weights, order))
        return make_program(config, mesh, (models.policy_graphdef, models.value_graphdef, models.ref_graphdef),
                            reward, pad_token_id=pad_token_id, stop_token_id=stop_token_id,
                            eos_token_id=processing_class.eos_token_id, num_updates=num_updates,
                            vocab_size=policy_cfg.vocab_size, base_graphdef=models.base_graphdef,
                            lora_scale=None if models.lora_spec is None else models.lora_spec.scale)

    sources = dict(config=config, model_path=model_path, model=model, ref_model=ref_model, reward_model=reward_model,
                   value_model=value_model, uses_critic=uses_critic, has_reward_function=bool(reward_calls))
    ahead = abstract = None
    if compile_ahead and batches is not None and has_reward:
        from ppojax.trainer.compile_ahead import start_train_step
        try:
            abstract = _abstract_models(**sources)
            if abstract is not None:
                ahead = start_train_step(program_for(abstract), abstract.params, abstract.frozen,
                                         hyperparams=Hyperparams.from_config(config), kl_coef=config.kl_coef,
                                         prompts_shape=(
                                             batches.batch_size // batches.process_count, batches.input_ids.shape[1]))
        except Exception as err:  # noqa: BLE001 - a head start only: the real build below reports real problems
            log.info("train_step not compiled ahead: %s: %s", type(err).__name__, err)
            ahead = None
    # every weight goes straight into its place on the mesh (read shard by shard: never whole on one device)
    models = _models(functools.partial(load_model, mesh=mesh), **sources)
    if ahead is not None and abstract.static == models.static:
        program, train_step = ahead.program, ahead.train_step
    else:  # no compile ahead, or its structure guess differs from the loaded models' (the step compiles later)
        program, train_step = program_for(models), None
    state, state_shardings = placement.init_sharded_train_state(models.params, program.optimizer, mesh,
                                                               hyperparams=Hyperparams.from_config(config),
                                                               frozen=models.frozen, kl_coef=config.kl_coef,
                                                               donate=True)
    return Run(config=config, tokenizer=processing_class, model_config=models.policy_cfg, mesh=mesh,
               program=program, state=state, state_shardings=state_shardings, num_updates=num_updates,
               train_queries=train_queries, eval_queries=eval_queries, batches=batches,
               compilation_cache_dir=cache_dir, lora=models.lora_spec, model_path=model_path, train_step=train_step)


@dataclass
class _Models:
    """The model part of a run: graphdefs (static) and the trainable / frozen trees (arrays, or, from
    :func:`_abstract_models`, their ``jax.ShapeDtypeStruct`` shapes).

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

    @property
    def static(self) -> tuple:
        """Everything the compiled program depends on besides the trees' shapes."""
        return (self.policy_graphdef, self.value_graphdef, self.ref_graphdef, self.reward_graphdef,
                self.base_graphdef, self.lora_spec)


def _models(load, **sources) -> _Models:
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
    return nnx.merge(graphdef, sharding.copy_arrays(state))


def _model_inputs(load, *, config, model_path, model, ref_model, reward_model, value_model, uses_critic,
                  has_reward_function) -> dict:
    """{policy, ref_model, reward_module, value_module}: the caller's modules, and those the config names by
    path loaded by ``load`` (:func:`load_model`, or :func:`abstract_model`); None where there is none."""
    model_options = model_kwargs(config)
    if model is None:
        kind = "value_head" if config.value_head == "policy" and uses_critic else "causal_lm"
        model, _ = load("policy", model_path, kind=kind, seed=config.seed, **model_options)
    if reward_model is None and config.reward_model_path is not None:
        reward_model, _ = load("reward model", config.reward_model_path, kind="score",
                               score_label=config.reward_model_label, **model_options)
    if uses_critic and config.value_head == "separate" and value_model is None \
            and config.value_model_path is not None:
        value_model, _ = load("value model", config.value_model_path, kind="score", **model_options)
    _use_backend_kernels(config, model, ref_model, reward_model, value_model)
    return dict(policy=model, ref_model=ref_model, reward_module=reward_model, value_module=value_model)


def _use_backend_kernels(config, *modules) -> None:
    """Choose the backend's kernels for the run's models (once, from their shapes: abstract models get the same
    choice as loaded ones) and set them on every backbone. The modules are the run's own (copies of the caller's)."""
    from ppojax import backends

    present = [m for m in modules if m is not None]
    kernels = as_config_error(backends.kernels_for, present, matmul_implementation=config.matmul_implementation,
                              devices=_run_devices(config))
    backends.use_kernels(kernels, *present)


def _run_devices(config) -> list:
    """The devices a run computes on (its mesh's; every device jax sees)."""
    return list(jax.devices())


def _assemble(config, *, policy, ref_model, reward_module, value_module, uses_critic) -> _Models:
    """The run's trainable and frozen trees from its modules: the value model (given, else the reward model's
    copy as TRL, else the policy's backbone + a new head), LoRA adapters on the policy, the reference (given,
    the LoRA base, or a frozen copy of the initial policy). Pure in the modules' arrays, so it also runs
    under ``jax.eval_shape`` on abstract ones (:func:`_abstract_models`)."""
    params, frozen = {}, {}
    value_graphdef = None
    if uses_critic and config.value_head == "separate":
        value = value_module if value_module is not None else reward_module
        if value is None:
            value = _new_value_model(config, policy, dict(model_kwargs(config), kernels=policy.kernels))
        value_graphdef, params["value"] = nnx.split(value)
        if value_module is None and reward_module is not None:
            # the value model trains; the reward model must not
            params["value"] = sharding.copy_arrays(params["value"])
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
        ref_graphdef, ref_params = policy_graphdef, sharding.copy_arrays(params["policy"])
    reward_graphdef, reward_params = nnx.split(reward_module) if reward_module is not None else (None, None)
    frozen.update(ref=ref_params, reward=reward_params)
    return _Models(policy_graphdef, value_graphdef, ref_graphdef, reward_graphdef, base_graphdef, lora_spec,
                   policy.cfg, params, frozen)


def abstract_model(role: str, path, **kwargs):
    """:func:`load_model`'s model, abstract (``abstract_pretrained``: config.json and tensor names only)."""
    from ppojax.models import abstract_pretrained
    try:
        return abstract_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"could not read the {role}'s structure from {str(path)!r}: {err}") from err


def _abstract_models(**sources) -> Optional[_Models]:
    """:func:`_models` with no weight read or drawn: the checkpoints by their structure
    (:func:`abstract_model`), then :func:`assemble_abstractly`. Its ``static`` equals the real models' when
    the checkpoints load as their structure says. None when a checkpoint's structure cannot be read (loading
    it reports why, with the fix)."""
    try:
        inputs = _model_inputs(abstract_model, **sources)
    except ConfigError:
        return None
    return assemble_abstractly(sources["config"], inputs, uses_critic=sources["uses_critic"])


def assemble_abstractly(config, inputs: dict, *, uses_critic: bool) -> _Models:
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


def lora_spec_from_config(config, model_config) -> Optional[LoraSpec]:
    """The policy's LoRA adapters from ``lora_*`` (None when lora_r = 0); target names checked against the
    policy's family (a ConfigError naming the bad names and the ones the model has)."""
    if config.lora_r == 0:
        return None
    targets = as_config_error(resolve_target_modules, model_config, config.lora_target_modules)
    return LoraSpec(config.lora_r, config.lora_alpha, targets, config.lora_dropout)


def make_program(config: PPOConfig, mesh, graphdefs, reward, *, pad_token_id: int, stop_token_id, eos_token_id,
                 num_updates: int, vocab_size: int, base_graphdef=None, lora_scale=None) -> PPOProgram:
    """The static PPO program: settings, model forwards, reward source and optimizer on ``mesh``.

    graphdefs: (policy, value or None for a value head on the policy, reference or None for the policy's).
    base_graphdef, lora_scale: under LoRA, the policy without adapters and alpha / r (``ActorCritic``). Shared by ``build_run`` (real weights) and ``ppojax.trainer.plan`` (abstract shapes).
    """
    policy_graphdef, value_graphdef, ref_graphdef = graphdefs
    settings = StepSettings.from_config(config, pad_token_id=pad_token_id, num_updates=num_updates,
                                        stop_token_id=stop_token_id, eos_token_id=eos_token_id,
                                        data_parallel_size=sharding.data_parallel_size(mesh), vocab_size=vocab_size)
    actor_critic = ActorCritic(policy_graphdef, value_graphdef, pad_token_id, config.temperature,
                               ref_graphdef=ref_graphdef,
                               has_critic=advantage_estimator(config.advantage_estimator).uses_critic,
                               base_graphdef=base_graphdef, lora_scale=lora_scale)
    from ppojax import backends

    step = backends.optimizer_step_for(config.optimizer_implementation,
                                       list(mesh.devices.flat) if mesh is not None else None)
    return PPOProgram(actor_critic, reward, settings, optimizer_from_config(config, step), mesh)


def _reward_calls(config: PPOConfig, reward_model, reward_funcs) -> tuple[list, list, list]:
    """The run's reward functions: (Python ones as ``RewardCall``s, JAX ones as ``TracedScores``, the place of
    each in the user's list, Python ones first). From ``reward_funcs`` given to the trainer (callables, specs or
    ``TracedScores``), a callable passed as ``reward_model``, or the config's reward_funcs / reward_function."""
    if reward_funcs is not None:
        given = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
    elif callable(reward_model) and not isinstance(reward_model, nnx.Module):
        given = [reward_model]
    elif reward_model is not None and config.reward_funcs is None:
        given = []  # a reward model given: reward_function does not add to it (reward_funcs does)
    else:
        given = config.reward_function_specs
    python = [i for i, f in enumerate(given) if not isinstance(f, TracedScores)]
    calls = [RewardCall.of(resolve_reward_function(given[i]),
                           given[i].rpartition(":")[2] if isinstance(given[i], str) else None) for i in python]
    traced = [f for f in given if isinstance(f, TracedScores)]
    return calls, traced, python + [i for i, f in enumerate(given) if isinstance(f, TracedScores)]


def _weights_in_part_order(weights, order: list):
    """reward_weights (the user's order: reward_funcs, then the model) in the parts' order (Python functions,
    traced ones, the model)."""
    if weights is None or len(weights) != len(order) + 1 and len(weights) != len(order):
        return weights  # None, or a count WeightedRewards refuses with both numbers
    return [weights[i] for i in order] + list(weights[len(order):])


def _combined_reward(parts, weights):
    """One reward source from the run's parts (None without any): a part alone as it is, several (or any
    weights) summed by ``WeightedRewards``."""
    if not parts:
        return None
    if len(parts) == 1 and weights is None:
        return parts[0]
    return WeightedRewards(parts, weights)


def _dataset_source(config, name=None):
    """A dataset field's value -> what ``load_prompt_table`` reads (built-in names resolved)."""
    name = config.dataset if name is None else name
    if name == "movie_reviews":
        return BUILTIN_MOVIE_REVIEWS
    if name in BUILTIN_ARITHMETIC:
        return arithmetic_split(name)
    return name


def _with_eval_dataset(config, texts: list, columns: dict) -> tuple[list, dict, int]:
    """The training prompts followed by eval_dataset's first num_eval_prompts ones (and their columns, None where
    a dataset lacks a column) -> (texts, columns, number of training prompts)."""
    eval_texts, eval_columns = as_config_error(load_prompt_table, _dataset_source(config, config.eval_dataset),
                                               column=config.dataset_text_field)
    eval_texts = eval_texts[:config.num_eval_prompts]
    n_train, n_eval = len(texts), len(eval_texts)
    merged = {name: list(columns.get(name, [None] * n_train)) + list(eval_columns.get(name, [None] * n_eval))[:n_eval]
              for name in dict.fromkeys([*columns, *eval_columns])}
    return texts + eval_texts, merged, n_train


def _split_eval(ids, num_eval):
    """Held-out prompts come off the END of the prompt set; the rest are for training."""
    if num_eval >= len(ids):
        raise ConfigError(f"num_eval_prompts={num_eval} leaves no training prompts out of {len(ids)}.")
    return (ids[:len(ids) - num_eval], ids[len(ids) - num_eval:]) if num_eval else (ids, None)


def _check_matmul_implementation(config, mesh) -> None:
    """An in-place matmul_implementation ('onednn', 'onednn_primitive', 'mkl') must be able to run here: one CPU device, the handlers built (before
    any weight is loaded; 'auto' falls back to XLA's dots silently)."""
    if config.matmul_implementation not in IN_PLACE_MATMULS:
        return
    from ppojax.backends.cpu import stacked_matmul

    why = stacked_matmul.unavailable_on(mesh.devices.size if mesh is not None else jax.device_count(),
                                        config.matmul_implementation)
    if why:
        raise ConfigError(f"matmul_implementation={config.matmul_implementation!r} cannot be used: {why}. Set "
                          "matmul_implementation: auto (oneDNN where it can run, XLA's dots elsewhere) or xla.")


def model_kwargs(config) -> dict:
    """The model constructor arguments the config sets: precision (compute and parameter dtypes),
    rematerialisation, attention implementation. The backend's kernels are chosen for the loaded models
    (:func:`_use_backend_kernels`)."""
    from ppojax.models import precision_dtypes
    compute, params = precision_dtypes(config.precision)
    return dict(dtype=compute, param_dtype=params, remat=config.remat,
                attention_implementation=config.attention_implementation)


def follow_config(module, config: PPOConfig, role: str) -> None:
    """A model the caller built (PPOTrainer's ``model``, ``ref_model``, ``reward_model``, ``value_model``) runs
    with the config's compute choices, as a model ppojax loads does: ``remat`` and ``attention_implementation``
    are set on its backbones (static choices: the weights are the same; the backend's kernels are set on the
    run's copy, :func:`_use_backend_kernels`). Its
    precision cannot be changed without recasting the weights, so one that differs from ``precision`` is
    refused, naming how to build the model. Modules that are not ppojax's transformers are left alone."""
    from ppojax.models import precision_dtypes
    from ppojax.models.transformer import Backbone

    if not isinstance(module, nnx.Module):
        return
    backbones = [sub for _, sub in nnx.iter_modules(module) if isinstance(sub, Backbone)]
    for backbone in backbones:
        backbone.remat = config.remat
        backbone.attention_implementation = config.attention_implementation
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


def _new_value_model(config, policy, model_options):
    """The value model when there is neither a given one nor a reward model (TRL initialises the value model
    from the reward model; with a reward function there is none): the policy's backbone with a fresh score head."""
    from ppojax.models import ScoreModel
    # Built abstractly: the backbone is the policy's (copied), only the new head is drawn (as transformers
    # initialises a missing score head: normal(0, initializer_range)). An eager init of the whole model would
    # compile and run a random draw per weight shape, only to be overwritten.
    abstract = nnx.eval_shape(lambda: ScoreModel(policy.cfg, rngs=nnx.Rngs(config.seed + 1), **model_options))
    graphdef, state = nnx.split(abstract)
    head = state["score"]["kernel"]
    kernel = policy.cfg.initializer_range * jax.random.normal(jax.random.key(config.seed + 1), head.shape, head.dtype)
    backbone = sharding.copy_arrays(nnx.state(policy.backbone))
    state = nnx.State({"backbone": backbone, "score": {"kernel": kernel}})
    return nnx.merge(graphdef, state)
