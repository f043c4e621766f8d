"""Build: a validated config (and optional user objects) -> everything a run needs, as one ``Run``.

    config -> checks (preflight) -> prompt texts -> mesh -> tokenizer and token ids -> prompts and batches
           -> reward source -> models (abstract first when compiling ahead, then their weights)
           -> StepSettings (static) + Hyperparams (traced) -> optimizer -> sharded TrainState -> PPOProgram

The phases live beside this module: ``preflight`` (what config.json files and the device count refute),
``run_prompts`` (tokenizer, prompts, batches), ``run_rewards`` (the reward source), ``run_models`` (loading and
assembling the models). Every user mistake found is a ``ConfigError`` (``ppojax train`` prints it without a
traceback and exits with 2); the checks that need only ``config.json`` files and the device count run before any
weights are loaded.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import numpy as np

from ppojax import backends
from ppojax.core.advantages import advantage_estimator
from ppojax.errors import ConfigError
from ppojax.models.kernels import XLA
from ppojax.models.lora import LoraSpec
from ppojax import parallel
from ppojax.rl import in_flight_updates, placement
from ppojax.rl.actor_critic import ActorCritic
from ppojax.rl.episodes import EpisodeSource, first_turn_only
from ppojax.rl.optimizer import optimizer_from_config
from ppojax.rl.program import PPOProgram
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.types import TrainState
from ppojax.trainer.compile_ahead import start_train_step
from ppojax.trainer.compile_cache import enable_compilation_cache
from ppojax.trainer.config import PPOConfig
from ppojax.trainer.data import PromptBatches
from ppojax.trainer.preflight import check_matmul_implementation, preflight, resolve_model_path
from ppojax.trainer.run_models import (RunModels, abstract_models, follow_config, load_model, load_models,
                                       model_kwargs)
from ppojax.trainer.run_prompts import prompt_data, read_prompt_texts, token_ids
from ppojax.trainer.run_agents import RunAgents
from ppojax.trainer.run_rewards import NO_REWARD, RunRewards, as_config_error

__all__ = ["Run", "build_run", "make_program", "model_kwargs", "preflight", "as_config_error", "NO_REWARD"]

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
    prompt_texts: Optional[list] = None  # what the user wrote of each prompt, rows as train_queries + eval_queries
    agents: Optional[RunAgents] = None  # an agent run's tools and environment (None: one response per prompt)
    rollout_mesh: Any = None  # rollout_devices' mesh: the devices that sample apart from ``mesh`` (None: the same)

    @property
    def settings(self) -> StepSettings:
        return self.program.settings

    @property
    def reward(self):
        return self.program.reward


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
    parallel.initialize_distributed()  # a no-op on one process; must precede other device work
    # the prompt texts are read here, once, before any model (the preflight leaves them to this)
    preflight(config, policy_given=model is not None, reward_given=reward_model is not None,
              functions_given=reward_funcs is not None, dataset_given=True)
    texts, columns, n_train_texts = read_prompt_texts(config, train_dataset)
    cache_dir = enable_compilation_cache(config.compilation_cache_dir)
    mesh, rollout_mesh = as_config_error(meshes_of, config)
    uses_critic = advantage_estimator(config.advantage_estimator).uses_critic
    data_parallel = parallel.data_parallel_size(mesh)
    config.derived(data_parallel)  # batch sizes must split over the data-parallel devices (before loading)
    check_matmul_implementation(config, mesh)
    for given, role in ((model, "policy"), (ref_model, "reference model"), (reward_model, "reward model"),
                        (value_model, "value model")):
        follow_config(given, config, role)
    model_path = None if model is not None else resolve_model_path(config.model_name_or_path)
    tokens = token_ids(config, model, model_path, processing_class, uses_critic)
    rewards = RunRewards(config, reward_model, reward_funcs)
    rewards.check_filter_groups_metric()
    agents = None
    if config.is_agent_run:
        agents = as_config_error(RunAgents, config, tokens.tokenizer, stop_token_id=tokens.stop_token_id,
                                 pad_token_id=tokens.pad_token_id)
    prompts = prompt_data(config, texts, columns, n_train_texts, tokens, data_parallel,
                          template_kwargs=None if agents is None else agents.template_kwargs)
    if prompts.shared_prefix:
        log.info("shared_prompt_prefix: every prompt starts with the same %d tokens", len(prompts.shared_prefix))
    if agents is not None:
        agents.attach(prompts.raw_texts, prompts.table, prompts.shared_prefix)
    # the reward runs where the samples are: with rollout_devices, in the rollout program on its own mesh
    rewards.call_on_host(tokens.tokenizer, tokens.pad_token_id, prompts.table, rollout_mesh or mesh)

    def program_for(models: RunModels) -> PPOProgram:
        return make_program(config, mesh, (models.policy_graphdef, models.value_graphdef, models.ref_graphdef),
                            rewards.source(models.reward_graphdef, tokens.pad_token_id),
                            pad_token_id=tokens.pad_token_id, stop_token_id=tokens.stop_token_id,
                            eos_token_id=tokens.tokenizer.eos_token_id, num_updates=prompts.num_updates,
                            vocab_size=tokens.vocab_size, base_graphdef=models.base_graphdef,
                            lora_scale=None if models.lora_spec is None else models.lora_spec.scale,
                            kernels=models.kernels, agents=agents, prompt_prefix=len(prompts.shared_prefix))

    sources = dict(config=config, mesh=mesh, model_path=model_path, model=model, ref_model=ref_model,
                   reward_model=rewards.reward_model, value_model=value_model, uses_critic=uses_critic,
                   has_reward_function=bool(rewards.calls))
    ahead = _compile_ahead(config, program_for, sources, prompts.batches) \
        if compile_ahead and prompts.batches is not None and rewards.any and rollout_mesh is None else None
    # every weight goes straight into its place on the mesh (read shard by shard: never whole on one device)
    models = load_models(functools.partial(load_model, mesh=mesh), **sources)
    if ahead is not None and ahead[0].static == models.static:
        program, train_step = ahead[1].program, ahead[1].train_step
    else:  # no compile ahead, or its structure guess differs from the loaded models' (the step compiles later)
        program, train_step = program_for(models), None
    in_flight = in_flight_updates.in_flight_shapes(program, models.params, models.frozen, config.max_prompt_length)
    state, state_shardings = placement.init_sharded_train_state(models.params, program.optimizer, mesh,
                                                               hyperparams=Hyperparams.from_config(config),
                                                               frozen=models.frozen, kl_coef=config.kl_coef,
                                                               donate=True, in_flight=in_flight)
    return Run(config=config, tokenizer=tokens.tokenizer, model_config=models.policy_cfg, mesh=mesh,
               program=program, state=state, state_shardings=state_shardings, num_updates=prompts.num_updates,
               train_queries=prompts.train_queries, eval_queries=prompts.eval_queries, batches=prompts.batches,
               compilation_cache_dir=cache_dir, lora=models.lora_spec, model_path=model_path, train_step=train_step,
               prompt_texts=prompts.texts, agents=agents, rollout_mesh=rollout_mesh)


def meshes_of(config: PPOConfig):
    """(the training mesh, the rollout mesh or None): with ``rollout_devices`` = r, the first r devices sample
    (data-parallel) and the others train on the mesh the ``mesh_*`` fields describe; else one mesh for both."""
    if not config.rollout_devices:
        return parallel.mesh_from_config(config), None
    devices, r = jax.devices(), config.rollout_devices
    if jax.process_count() > 1:
        raise ConfigError(f"rollout_devices={r} runs in one process ({jax.process_count()} were started); remove "
                          "rollout_devices (every device then samples and trains) or start one process.")
    if r >= len(devices):
        raise ConfigError(f"rollout_devices={r} leaves none of the {len(devices)} devices to train on; set it below "
                          f"{len(devices)}.")
    return parallel.mesh_from_config(config, devices=devices[r:]), parallel.make_mesh(devices=devices[:r])


def _compile_ahead(config, program_for, sources: dict, batches: PromptBatches):
    """(the abstract models, ``compile_ahead.start_train_step``'s handle) with ``train_step`` compiling for the
    models' structure on a background thread, or None where the structure cannot be read or the start fails (a
    head start only: the real build reports real problems)."""
    try:
        abstract = abstract_models(**sources)
        if abstract is None:
            return None
        prompts_shape = (batches.batch_size // batches.process_count, batches.input_ids.shape[1])
        if config.filter_groups:  # one batch per generation round
            prompts_shape = (config.max_num_gen_batches, *prompts_shape)
        program = program_for(abstract)
        in_flight = in_flight_updates.in_flight_shapes(program, abstract.params, abstract.frozen,
                                                       config.max_prompt_length)
        return abstract, start_train_step(program, abstract.params, abstract.frozen,
                                          hyperparams=Hyperparams.from_config(config), kl_coef=config.kl_coef,
                                          prompts_shape=prompts_shape, in_flight=in_flight)
    except Exception as err:  # noqa: BLE001 - a head start only: the real build below reports real problems
        log.info("train_step not compiled ahead: %s: %s", type(err).__name__, err)
        return None


def make_program(config: PPOConfig, mesh, graphdefs, reward, *, pad_token_id: int, stop_token_id, eos_token_id,
                 num_updates: int, vocab_size: int, base_graphdef=None, lora_scale=None, kernels=XLA,
                 agents: Optional[RunAgents] = None, prompt_prefix: int = 0) -> PPOProgram:
    """The static PPO program: settings, model forwards, reward source and optimizer on ``mesh``.

    graphdefs: (policy, value or None for a value head on the policy, reference or None for the policy's).
    base_graphdef, lora_scale: under LoRA, the policy without adapters and alpha / r (``ActorCritic``); kernels:
    the backend's operations the models were built with; agents: an agent run's tools and environment. Shared by
    ``build_run`` (real weights) and ``ppojax.trainer.plan`` (abstract shapes). prompt_prefix: the tokens every
    prompt starts with (``shared_prompt_prefix``; ``run_prompts.shared_prefix_length``).
    """
    policy_graphdef, value_graphdef, ref_graphdef = graphdefs
    settings = StepSettings.from_config(config, pad_token_id=pad_token_id, num_updates=num_updates,
                                        stop_token_id=stop_token_id, eos_token_id=eos_token_id,
                                        data_parallel_size=parallel.data_parallel_size(mesh), vocab_size=vocab_size,
                                        prompt_prefix=prompt_prefix)
    actor_critic = ActorCritic(policy_graphdef, value_graphdef, pad_token_id, config.temperature,
                               ref_graphdef=ref_graphdef,
                               has_critic=advantage_estimator(config.advantage_estimator).uses_critic,
                               base_graphdef=base_graphdef, lora_scale=lora_scale, kernels=kernels)
    step = backends.optimizer_step_for(config.optimizer_implementation,
                                       list(mesh.devices.flat) if mesh is not None else None)
    episodes = None
    if settings.sampling.episodes is not None:  # without the run's environment (a plan): a stand-in, same shapes
        episodes = (agents.source(settings.sampling.episodes, mesh) if agents is not None else
                    EpisodeSource(first_turn_only(settings.sampling.episodes, pad_token_id)))
    return PPOProgram(actor_critic, reward, settings, optimizer_from_config(config, step), mesh, episodes)
