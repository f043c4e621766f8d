"""What the compiled PPO programs are traced from (static) and the hyperparameters they read as values (traced).

Static settings, one small frozen dataclass per concern, each function taking the one(s) it reads:

    SamplingSettings   the sampler and the rollout's token conventions (lengths, token ids, temperature, top-k/p)
    DynamicSamplingSettings  DAPO's dynamic sampling: prompts per generation round, the bound on rounds (or None)
    AlgorithmSettings  rewards, advantages, the form of the loss and the legacy controllers
    OptimSettings      the update's structure (epochs, mini-batches, accumulation) and the learning-rate schedule
    BatchSettings      the global batch sizes over the mesh and the forwards' row and logits chunks
    AsyncSettings      asynchronous RL: the sampled batches kept in flight between sampling and learning (or None)

:class:`StepSettings` bundles them (a ``PPOProgram`` holds one; the dynamic sampling's and the asynchronous
settings are None when off);
:meth:`StepSettings.from_config` is the one place they are built from a ``PPOConfig`` and the values the build
derives from the models, the tokenizer and the mesh. All are hashable: equal settings reuse a compiled program.

:class:`Hyperparams` is the other half: the learning rate, the clip ranges and the loss coefficients as float32
scalars in the ``TrainState`` (the KL-in-reward coefficient is the state's ``kl_coef``, which the adaptive
controller moves). Changing them between two calls of a compiled step does not recompile, and a stack of them
(one per run) can be ``jax.vmap``-ed over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ppojax.rl import forward
from ppojax.rl.episodes import EpisodeShape


@dataclass(frozen=True)
class SamplingSettings:
    """The sampler's options and the token conventions of the rollout (docs/algorithm.md, "Rollout").

    response_length: tokens sampled per prompt; temperature / top_k / top_p: the sampling distribution (0 and
    1.0 are off); num_generations: samples per prompt (consecutive rows); behaviour_logprobs: 'forward' (a
    policy forward computes them) or 'sampler' (the decode loop's). stop_token_id: a response ends after it
    (None: never); eos_token_id: counted in the metrics. rollout_slots: 0 decodes all rows together
    (``ppojax.rl.sampler.generate``), S > 0 S sequences at a time (``ppojax.rl.continuous``). decode_segments:
    the loops ``generate`` cuts its decode into, each reading only the cache slots filled by its end. episodes: the
    sizes of multi-turn episodes (``ppojax.rl.episodes``; ``response_length`` is then an episode's T), or None: one
    sampled response per row. kv_cache_dtype: the KV cache's storage, 'int8' (``ppojax.models.kv_int8``) or None:
    the policy's compute dtype. prompt_prefix: q > 0 when every prompt starts with the same q real tokens, which
    the prefill runs once for all (``ppojax.rl.sampler.prefill``; the samplers without continuous batching, and
    the episodes' bank: ``shared_prompt_prefix``); 0 otherwise."""

    response_length: int
    pad_token_id: int
    stop_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    num_generations: int = 1
    behaviour_logprobs: str = "forward"
    rollout_slots: int = 0
    decode_segments: int = 4
    episodes: Optional[EpisodeShape] = None
    kv_cache_dtype: Optional[str] = None
    prompt_prefix: int = 0


@dataclass(frozen=True)
class DynamicSamplingSettings:
    """DAPO's dynamic sampling (``ppojax.rl.dynamic_sampling``): the groups whose scores are all equal are dropped
    and the batch refilled from further prompts, sampled in rounds of ``prompts_per_round`` prompts (verl's
    gen_batch_size), at most ``max_rounds`` rounds an update (verl's max_num_gen_batches). A train step then takes
    prompts i32[max_rounds, prompts_per_round, P]. metric: the reward whose values judge a group (verl's
    filter_groups.metric; None: the score)."""

    prompts_per_round: int
    max_rounds: int
    metric: Optional[str] = None


@dataclass(frozen=True)
class AsyncSettings:
    """Asynchronous RL with bounded staleness (``ppojax.rl.pipeline``): each update learns from the batch sampled
    ``max_staleness`` updates earlier, that many sampled and scored batches waiting in the state's ``in_flight``.
    0 runs the pipeline's code with nothing in flight (the synchronous run's numbers)."""

    max_staleness: int = 0
    #: each batch's decode spread over max_staleness + 1 updates, the policy swapped between its chunks
    #: (``ppojax.rl.in_flight_updates``)
    in_flight_weight_updates: bool = False


@dataclass(frozen=True)
class AlgorithmSettings:
    """Shaped rewards, advantages, the loss's form and the legacy controllers (docs/algorithm.md).

    An advantage estimator (``ppojax.core.advantages``) receives this object and reads ``gamma``, ``lam``,
    ``num_generations``, ``scale_rewards`` and ``normalize_advantages``. kl_in_loss / entropy_bonus: whether the
    loss has a KL-to-the-reference term / an entropy bonus (``kl_loss_coef`` / ``entropy_coef`` > 0 in the config;
    their weights are the traced ``Hyperparams.kl_loss_coef`` / ``entropy_coef``). Without an entropy bonus the
    entropy is a statistic only: no gradient flows through it.

    The policy objective (``ppojax.core.objectives``): ``loss_type`` and its options, TRL GRPOConfig's names
    (importance_sampling_level, top_entropy_quantile, use_bias_correction_kl, mask_truncated_completions, the
    sapo_* and vespo_* parameters); multi_objective_aggregation (grpo's) and soft_punish_cache (DAPO's overlong
    penalty on the scores, 0: off).

    The off-policy corrections (``ppojax.core.offpolicy``; docs/algorithm.md, "Off-policy corrections"): TRL's
    vllm_importance_sampling_correction with its mode and bounds and off_policy_mask_threshold, AReaL's
    use_decoupled_loss with behav_imp_weight_cap."""

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    num_generations: int = 1
    scale_rewards: str = "group"
    normalize_advantages: bool = False
    kl_estimator: str = "k1"
    score_position: str = "trl"
    whiten_rewards: bool = False
    missing_eos_penalty: Optional[float] = None
    use_score_scaling: bool = False
    use_score_norm: bool = False
    score_clip: Optional[float] = None
    kl_in_loss: bool = False
    entropy_bonus: bool = False
    kl_loss_type: str = "low_var_kl"
    dual_clip_c: Optional[float] = None
    loss_agg_mode: str = "token-mean"
    adaptive_kl: bool = False
    target_kl_for_adaptive: float = 6.0
    horizon: int = 10000
    loss_type: str = "ppo"
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    use_bias_correction_kl: bool = False
    mask_truncated_completions: bool = False
    multi_objective_aggregation: str = "sum_then_normalize"
    soft_punish_cache: int = 0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    vllm_importance_sampling_correction: bool = False
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: Optional[float] = 3.0
    vllm_importance_sampling_clip_min: Optional[float] = None
    off_policy_mask_threshold: Optional[float] = None
    use_decoupled_loss: bool = False
    behav_imp_weight_cap: Optional[float] = None

    @property
    def weighs_behaviour(self) -> bool:
        """Whether the loss weighs each token by sg(pi_prox / pi_behav), the rollout then keeping the training
        policy's forward (the proximal log-probs) beside the sampler's (the behaviour ones)."""
        return self.vllm_importance_sampling_correction or self.use_decoupled_loss

    @property
    def processes_scores(self) -> bool:
        """Whether the legacy score scaling / clipping runs."""
        return self.use_score_scaling or self.score_clip is not None

    @property
    def uses_policy_objective(self) -> bool:
        """Whether the loss's policy term is a registered objective's (``ppojax.core.objectives.policy_term``)
        rather than the clipped surrogate of ``ppojax.core.losses.policy_loss`` (``loss_type: ppo`` with none of
        the objective options: the same numbers)."""
        return (self.loss_type != "ppo" or self.importance_sampling_level != "token"
                or self.top_entropy_quantile < 1.0 or self.use_bias_correction_kl or self.weighs_behaviour
                or self.off_policy_mask_threshold is not None)


@dataclass(frozen=True)
class OptimSettings:
    """The update's structure and the learning-rate schedule's shape (its base value is traced).

    num_updates: PPO iterations of the run (the linear schedule decays to 0 over them); warmup_steps, critic_warmup:
    in updates. critic_learning_rate: the critic's base learning rate, static (None: the traced learning rate, as
    the policy's). ratio_threshold / early_stopping with target_kl: legacy mini-batch skipping (None / False: off)."""

    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    gradient_accumulation_steps: int = 1
    num_updates: int = 1
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    critic_warmup: int = 0
    critic_learning_rate: Optional[float] = None
    ratio_threshold: Optional[float] = None
    early_stopping: bool = False
    target_kl: float = 1.0

    @property
    def steps_per_update(self) -> int:
        """Optimizer steps of one PPO iteration."""
        return self.num_ppo_epochs * self.num_mini_batches

    def lr_schedule(self) -> optax.Schedule:
        """The learning-rate multiplier by update index: HF's ``get_linear_schedule_with_warmup`` /
        ``get_constant_schedule_with_warmup`` (stepped once per update, as TRL's PPO steps its scheduler), as optax
        schedules (``optax.join_schedules``): HF's warmup ``u / warmup_steps`` joined to 1 ('constant') or to HF's
        linear decay ``(num_updates - u) / max(num_updates - warmup_steps, 1)``, each computed in HF's order
        (optax's own linear schedules round differently in the last bit, which a long run's sampling magnifies)."""
        warmup = max(self.warmup_steps, 0)
        if self.lr_scheduler_type == "constant":
            after = optax.constant_schedule(1.0)
        else:
            remaining, span = self.num_updates - warmup, max(self.num_updates - warmup, 1)

            def after(steps_after_warmup):  # u - warmup: (N - W) - (u - W) is N - u exactly (small integers)
                return jnp.maximum(0.0, (jnp.float32(remaining) - steps_after_warmup) / jnp.float32(span))
        if warmup == 0:
            return after
        return optax.join_schedules([lambda u: u / jnp.float32(warmup), after], [warmup])


@dataclass(frozen=True)
class BatchSettings:
    """Global batch sizes over the mesh (``PPOConfig.derived``) and how the forwards chunk them.

    batch_size / mini_batch_size / micro_batch_size: rows per rollout / optimizer step / forward-backward.
    local_rollout_forward_batch_size: rows per rollout forward (None: all). update_logits_chunk /
    rollout_logits_chunk: response positions per float32 logits chunk in the loss and in the rollout forwards
    (None: all at once). padding_free: the update's forwards run on packed rows (``ppojax.rl.packed_update``),
    ``max_tokens_per_micro_batch`` tokens per device each (None: a padded micro-batch's rows), in rows of
    ``packed_row_length`` slots (None: a padded row's); vocab_size sizes
    their logits chunks when ``logits_chunk_size`` is None (None: ``update_logits_chunk``). prompt_group: G > 1
    when the policy's and the reference's forwards run each prompt once for its G consecutive rows
    (``shared_prompt_forward``; the update's mini-batches then hold whole groups); 1 otherwise. prompt_prefix: q > 0
    when every prompt starts with the same q real tokens, which the policy's and the reference's padded forwards
    run once for all rows (``shared_prompt_prefix``; ``ppojax.rl.forward.SharedPromptLayout``); 0 otherwise."""

    batch_size: int
    mini_batch_size: int
    micro_batch_size: int
    data_parallel_size: int = 1
    local_rollout_forward_batch_size: Optional[int] = None
    update_logits_chunk: Optional[int] = None
    rollout_logits_chunk: Optional[int] = None
    padding_free: bool = False
    max_tokens_per_micro_batch: Optional[int] = None
    packed_row_length: Optional[int] = None
    logits_chunk_size: Optional[int] = None
    vocab_size: Optional[int] = None
    prompt_group: int = 1
    prompt_prefix: int = 0


@dataclass(frozen=True)
class StepSettings:
    """The static settings of a PPO program, built by :meth:`from_config`. dynamic_sampling, asynchronous: None
    when off."""

    sampling: SamplingSettings
    algorithm: AlgorithmSettings
    optim: OptimSettings
    batch: BatchSettings
    dynamic_sampling: Optional[DynamicSamplingSettings] = None
    asynchronous: Optional[AsyncSettings] = None

    @classmethod
    def from_config(cls, config, *, pad_token_id: int, num_updates: int = 1, stop_token_id: Optional[int] = None,
                    eos_token_id: Optional[int] = None, data_parallel_size: int = 1,
                    vocab_size: Optional[int] = None, prompt_prefix: int = 0) -> "StepSettings":
        """Settings for ``config`` (a PPOConfig). ``vocab_size`` sizes the logits chunks when the config's
        ``logits_chunk_size`` is None (see :func:`ppojax.rl.forward.auto_chunk_size`). ``prompt_prefix``: the
        tokens every prompt of the run starts with (``ppojax.trainer.run_prompts.shared_prefix_length``), used
        where ``shared_prompt_prefix`` is on."""
        prompt_prefix = prompt_prefix if config.shared_prompt_prefix else 0
        c = config
        sizes = c.derived(data_parallel_size)
        update_chunk = rollout_chunk = c.logits_chunk_size
        if update_chunk is None and vocab_size is not None:
            micro_rows = -(-sizes.micro_batch_size // data_parallel_size)
            forward_rows = -(-(c.local_rollout_forward_batch_size or sizes.batch_size) // data_parallel_size)
            update_chunk = forward.auto_chunk_size(micro_rows, c.response_length, vocab_size)
            rollout_chunk = forward.auto_chunk_size(forward_rows, c.response_length, vocab_size)
        sampling = SamplingSettings(
            response_length=c.response_length, pad_token_id=pad_token_id, stop_token_id=stop_token_id,
            eos_token_id=eos_token_id, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            num_generations=c.num_generations, behaviour_logprobs=c.behaviour_logprobs,
            rollout_slots=c.rollout_slots, decode_segments=c.decode_segments,
            kv_cache_dtype=None if c.kv_cache_dtype == "auto" else c.kv_cache_dtype,
            episodes=EpisodeShape(turn_length=c.turn_length or c.response_length,
                                  observation_length=c.observation_length,
                                  max_turns=c.max_tool_calling_iterations + 1,
                                  episode_length=c.response_length) if c.is_agent_run else None,
            prompt_prefix=prompt_prefix)
        algorithm = AlgorithmSettings(
            advantage_estimator=c.advantage_estimator, gamma=c.gamma, lam=c.lam, num_generations=c.num_generations,
            scale_rewards=c.scale_rewards, normalize_advantages=c.normalize_advantages, kl_estimator=c.kl_estimator,
            score_position=c.score_position, whiten_rewards=c.whiten_rewards,
            missing_eos_penalty=c.missing_eos_penalty, use_score_scaling=c.use_score_scaling,
            use_score_norm=c.use_score_norm, score_clip=c.score_clip, kl_in_loss=bool(c.kl_loss_coef),
            entropy_bonus=bool(c.entropy_coef),
            kl_loss_type=c.kl_loss_type, dual_clip_c=c.dual_clip_c, loss_agg_mode=c.loss_agg_mode,
            adaptive_kl=c.adaptive_kl, target_kl_for_adaptive=c.target_kl_for_adaptive, horizon=c.horizon,
            loss_type=c.loss_type, importance_sampling_level=c.importance_sampling_level,
            top_entropy_quantile=c.top_entropy_quantile, use_bias_correction_kl=c.use_bias_correction_kl,
            mask_truncated_completions=c.mask_truncated_completions,
            multi_objective_aggregation=c.multi_objective_aggregation, soft_punish_cache=c.soft_punish_cache,
            sapo_temperature_pos=c.sapo_temperature_pos, sapo_temperature_neg=c.sapo_temperature_neg,
            vespo_k_pos=c.vespo_k_pos, vespo_lambda_pos=c.vespo_lambda_pos, vespo_k_neg=c.vespo_k_neg,
            vespo_lambda_neg=c.vespo_lambda_neg,
            vllm_importance_sampling_correction=c.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=c.vllm_importance_sampling_mode,
            vllm_importance_sampling_clip_max=c.vllm_importance_sampling_clip_max,
            vllm_importance_sampling_clip_min=c.vllm_importance_sampling_clip_min,
            off_policy_mask_threshold=c.off_policy_mask_threshold, use_decoupled_loss=c.use_decoupled_loss,
            behav_imp_weight_cap=c.behav_imp_weight_cap)
        optim = OptimSettings(
            num_ppo_epochs=c.num_ppo_epochs, num_mini_batches=c.num_mini_batches,
            gradient_accumulation_steps=c.gradient_accumulation_steps, num_updates=num_updates,
            lr_scheduler_type=c.lr_scheduler_type, warmup_steps=c.warmup_steps, critic_warmup=c.critic_warmup,
            critic_learning_rate=c.critic_learning_rate, ratio_threshold=c.ratio_threshold,
            early_stopping=c.early_stopping, target_kl=c.target_kl)
        batch = BatchSettings(
            batch_size=sizes.batch_size, mini_batch_size=sizes.mini_batch_size,
            micro_batch_size=sizes.micro_batch_size, data_parallel_size=data_parallel_size,
            local_rollout_forward_batch_size=c.local_rollout_forward_batch_size,
            update_logits_chunk=update_chunk, rollout_logits_chunk=rollout_chunk, padding_free=c.padding_free,
            max_tokens_per_micro_batch=c.max_tokens_per_micro_batch, packed_row_length=c.packed_row_length,
            logits_chunk_size=c.logits_chunk_size, vocab_size=vocab_size,
            prompt_group=c.num_generations if c.shared_prompt_forward else 1,
            prompt_prefix=0 if c.padding_free else prompt_prefix)
        dynamic = (DynamicSamplingSettings(prompts_per_round=sizes.prompts_per_round, max_rounds=c.max_num_gen_batches,
                                           metric=c.filter_groups_metric) if c.filter_groups else None)
        asynchronous = (AsyncSettings(max_staleness=c.max_staleness,
                                      in_flight_weight_updates=c.in_flight_weight_updates)
                        if c.max_staleness else None)
        return cls(sampling, algorithm, optim, batch, dynamic, asynchronous)


@struct.dataclass
class Hyperparams:
    """The traced hyperparameters (float32 scalars in the ``TrainState``; a leading axis when runs are vmapped).

    learning_rate: the schedule's base value (``OptimSettings.lr_schedule`` multiplies it).
    cliprange_low / cliprange_high: the policy ratio is clipped to [1 - low, 1 + high].
    cliprange_value, vf_coef, entropy_coef: the value clip range and the loss weights.
    kl_loss_coef: the weight of the KL-in-the-loss term.
    ``entropy_coef`` and ``kl_loss_coef`` weigh their terms only where the static ``AlgorithmSettings`` has them
    (``entropy_bonus``, ``kl_in_loss``: the config's value > 0).
    """

    learning_rate: jax.Array
    cliprange_low: jax.Array
    cliprange_high: jax.Array
    cliprange_value: jax.Array
    vf_coef: jax.Array
    entropy_coef: jax.Array
    kl_loss_coef: jax.Array

    @classmethod
    def create(cls, *, learning_rate=3e-6, cliprange=0.2, cliprange_low=None, cliprange_high=None,
               cliprange_value=0.2, vf_coef=0.1, entropy_coef=0.0, kl_loss_coef=0.0) -> "Hyperparams":
        """From PPOConfig's names and defaults: cliprange_low defaults to cliprange, cliprange_high to
        cliprange_low."""
        low = cliprange if cliprange_low is None else cliprange_low
        high = low if cliprange_high is None else cliprange_high
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return cls(learning_rate=f32(learning_rate), cliprange_low=f32(low), cliprange_high=f32(high),
                   cliprange_value=f32(cliprange_value), vf_coef=f32(vf_coef), entropy_coef=f32(entropy_coef),
                   kl_loss_coef=f32(kl_loss_coef))

    @classmethod
    def from_config(cls, config) -> "Hyperparams":
        """The config's values (a PPOConfig)."""
        return cls.create(learning_rate=config.learning_rate, cliprange=config.cliprange,
                          cliprange_low=config.cliprange_low, cliprange_high=config.cliprange_high,
                          cliprange_value=config.cliprange_value, vf_coef=config.vf_coef,
                          entropy_coef=config.entropy_coef, kl_loss_coef=config.kl_loss_coef)
