"""The whole PPO update of SPEC.md as ONE jitted program (DESIGN "The shape of the update").

    ppo_update(state, experience, key, kl_coef):
        rewards, kl   = shaped_rewards(scores, logprobs, ref_logprobs, ...)
        advantages    = whiten(gae(rewards, values))                      # global statistics
        for epoch (lax.scan, key_e = split(key, epochs)[e]):
            order = permutation(key_e, B).reshape(num_mini_batches, -1)
            for mini-batch (lax.scan): grads = sum over micro-batches (lax.scan) of token-weighted grads
                                       ONE optimizer step
        metrics = mean of per-micro-batch diagnostics + rollout metrics, under TRL's names

Semantics chosen where TRL differs (see README): one optimizer step per mini-batch (TRL >= 0.17 steps once
per epoch when num_mini_batches > 1); micro-batch losses are token-weighted over the mini-batch, so
accumulation equals one big batch exactly; the learning-rate schedule advances once per UPDATE, as TRL's
scheduler does. Non-finite loss or gradients skip the optimizer step and are counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct

from . import ppo
from .actor_critic import ActorCritic


@struct.dataclass
class TrainState:
    """Everything the update changes. params: the trainable pytree of an :class:`ActorCritic`.

    update_count: PPO updates done (drives the learning-rate schedule); optimizer_steps: steps applied;
    nonfinite_streak / nonfinite_total: optimizer steps skipped for a non-finite loss or gradient.
    """

    params: Any
    opt_state: Any
    update_count: jnp.ndarray
    optimizer_steps: jnp.ndarray
    nonfinite_streak: jnp.ndarray
    nonfinite_total: jnp.ndarray


@dataclass(frozen=True)
class UpdateSettings:
    """The static knobs of one update (hashable; shapes and loop counts depend on them)."""

    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    gradient_accumulation_steps: int = 1
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    kl_estimator: str = "k1"
    score_position: str = "trl"
    ratio_threshold: Optional[float] = None
    early_stop_kl: Optional[float] = None
    # learning-rate schedule, a function of the update index
    learning_rate: float = 3e-6
    lr_scheduler_type: str = "linear"
    warmup_steps: int = 0
    num_updates: int = 1

    @classmethod
    def from_config(cls, config, num_updates: int) -> "UpdateSettings":
        return cls(
            num_ppo_epochs=config.num_ppo_epochs, num_mini_batches=config.num_mini_batches,
            gradient_accumulation_steps=config.gradient_accumulation_steps, cliprange=config.cliprange,
            cliprange_value=config.cliprange_value, vf_coef=config.vf_coef, entropy_coef=config.entropy_coef,
            gamma=config.gamma, lam=config.lam, whiten_rewards=config.whiten_rewards,
            kl_estimator=config.kl_estimator, score_position=config.score_position,
            ratio_threshold=config.ratio_threshold,
            early_stop_kl=1.5 * config.target_kl if config.early_stopping else None,
            learning_rate=config.learning_rate, lr_scheduler_type=config.lr_scheduler_type,
            warmup_steps=config.warmup_steps, num_updates=num_updates)


def learning_rate_at(settings: UpdateSettings, update_index):
    """HF's linear schedule with warmup, stepped once per update (as TRL's PPO steps its scheduler)."""
    u = jnp.asarray(update_index, jnp.float32)
    base = jnp.float32(settings.learning_rate)
    warmup = jnp.float32(max(settings.warmup_steps, 0))
    if settings.lr_scheduler_type == "constant":
        factor = jnp.where(u < warmup, u / jnp.maximum(warmup, 1.0), 1.0)
    else:
        total = jnp.float32(settings.num_updates)
        decay = jnp.maximum(0.0, (total - u) / jnp.maximum(total - warmup, 1.0))
        factor = jnp.where(u < warmup, u / jnp.maximum(warmup, 1.0), decay)
    return base * factor


def make_optimizer(*, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                   max_grad_norm=None) -> optax.GradientTransformation:
    """AdamW WITHOUT the learning rate (the update multiplies by ``learning_rate_at``), so the schedule is
    a traced function of the update index. Optional global-norm clipping first."""
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    parts += [optax.scale_by_adam(b1=adam_beta1, b2=adam_beta2, eps=adam_epsilon)]
    if weight_decay:
        parts.append(optax.add_decayed_weights(weight_decay))
    return optax.chain(*parts)


def optimizer_from_config(config) -> optax.GradientTransformation:
    return make_optimizer(adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                          adam_epsilon=config.adam_epsilon, weight_decay=config.weight_decay,
                          max_grad_norm=config.max_grad_norm)


def init_train_state(params, optimizer) -> TrainState:
    def zero():  # distinct buffers: the state is donated, and one buffer may not be donated twice
        return jnp.zeros((), jnp.int32)

    return TrainState(params=params, opt_state=optimizer.init(params), update_count=zero(),
                      optimizer_steps=zero(), nonfinite_streak=zero(), nonfinite_total=zero())


class UpdateBatch(NamedTuple):
    """Per-row tensors the loss reads; all share the leading batch axis [B, ...]."""

    query_responses: jnp.ndarray  # i32[B, P+R]
    logprobs: jnp.ndarray         # f32[B, R]  behaviour log-probs (INVALID_LOGPROB on padding)
    values: jnp.ndarray           # f32[B, R]  rollout values (0 on padding_mask_p1)
    advantages: jnp.ndarray       # f32[B, R]  whitened, 0 on padding
    returns: jnp.ndarray          # f32[B, R]
    padding_mask: jnp.ndarray     # bool[B, R] True = padding
    padding_mask_p1: jnp.ndarray  # bool[B, R]


def shaped_rewards_and_advantages(settings: UpdateSettings, experience, kl_coef):
    """SPEC's KL-shaped rewards, GAE and whitening on the whole (global) rollout batch.

    Returns (UpdateBatch, rollout metrics dict).
    """
    if settings.kl_estimator == "full":
        kl = experience.full_kl  # f32[B, R], computed in the rollout from both full distributions
    else:
        kl = ppo.kl_per_token(experience.logprobs, experience.ref_logprobs, settings.kl_estimator)
    shaped = ppo.shaped_rewards(experience.scores, kl, experience.last_index, kl_coef,
                                experience.padding_mask_p1, score_position=settings.score_position,
                                whiten_rewards=settings.whiten_rewards)
    adv = ppo.advantages_and_returns(shaped.rewards, experience.values, experience.padding_mask,
                                     settings.gamma, settings.lam)
    metrics = ppo.rollout_metrics(experience.scores, kl, shaped.non_score_reward, experience.logprobs,
                                  experience.padding_mask, num_stop_tokens=None)
    batch = UpdateBatch(experience.query_responses, experience.logprobs, experience.values,
                        adv.advantages, adv.returns, experience.padding_mask, experience.padding_mask_p1)
    return batch, metrics


def micro_batch_loss(actor_critic: ActorCritic, settings: UpdateSettings, params, batch: UpdateBatch,
                     policy_tokens, value_tokens):
    """Token-weighted PPO loss of one micro-batch on the current parameters. Returns (loss, stats)."""
    response_length = batch.logprobs.shape[1]
    prompt_length = batch.query_responses.shape[1] - response_length
    logprobs, entropy, vpred = actor_critic.evaluate(params, batch.query_responses, prompt_length)
    loss, stats = ppo.ppo_loss(
        logprobs, vpred, entropy, batch.logprobs, batch.values, batch.advantages, batch.returns,
        batch.padding_mask, batch.padding_mask_p1, cliprange=settings.cliprange,
        cliprange_value=settings.cliprange_value, vf_coef=settings.vf_coef,
        entropy_coef=settings.entropy_coef, policy_tokens=policy_tokens, value_tokens=value_tokens)
    live = ~batch.padding_mask
    masked_new = jnp.where(batch.padding_mask, ppo.INVALID_LOGPROB, logprobs)
    stats["policykl"] = ppo.masked_mean(batch.logprobs - masked_new, live)  # legacy early-stopping KL
    return loss, stats


def _take_rows(batch, rows):
    return jax.tree.map(lambda x: x[rows], batch)


def _split_leading(batch, parts):
    return jax.tree.map(lambda x: x.reshape(parts, x.shape[0] // parts, *x.shape[1:]), batch)


def _all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _select(condition, new, old):
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o), new, old)


def ppo_update(actor_critic: ActorCritic, settings: UpdateSettings, optimizer: optax.GradientTransformation,
               state: TrainState, experience, key, kl_coef):
    """One PPO update on one rollout batch. Pure; jit it with :func:`make_ppo_update`.

    experience: any object with query_responses i32[B, P+R], logprobs, ref_logprobs, values f32[B, R],
    scores f32[B], last_index i32[B], padding_mask, padding_mask_p1 bool[B, R] (see rollout.Experience).
    key: PRNG key for the epoch permutations; kl_coef: f32 scalar (traced).
    Returns (new state, metrics dict of scalars under TRL's names).
    """
    batch, rollout_stats = shaped_rewards_and_advantages(settings, experience, kl_coef)
    batch_size = batch.logprobs.shape[0]
    mini_size = batch_size // settings.num_mini_batches
    grad_fn = jax.value_and_grad(
        lambda p, mb, pt, vt: micro_batch_loss(actor_critic, settings, p, mb, pt, vt), has_aux=True)
    lr = learning_rate_at(settings, state.update_count)

    def mini_batch_step(carry, rows):
        state, stopped = carry
        mini = _take_rows(batch, rows)
        policy_tokens = jnp.sum(~mini.padding_mask)
        value_tokens = jnp.sum(~mini.padding_mask_p1)

        def micro_step(grad_sum, micro):
            (loss, stats), grads = grad_fn(state.params, micro, policy_tokens, value_tokens)
            return jax.tree.map(jnp.add, grad_sum, grads), stats

        if settings.gradient_accumulation_steps == 1:
            # No accumulator: zero-filling and adding a parameter-sized buffer costs ~3 % of a SmolLM2 update.
            (_, stats), grads = grad_fn(state.params, mini, policy_tokens, value_tokens)
            stats = jax.tree.map(lambda s: s[None], stats)  # [micro_batches=1, ...] like the scan's
        else:
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, stats = jax.lax.scan(micro_step, zeros,
                                        _split_leading(mini, settings.gradient_accumulation_steps))
        finite = _all_finite(grads) & jnp.all(jnp.isfinite(stats["loss"]))
        skip = stopped
        if settings.ratio_threshold is not None:  # legacy: drop a mini-batch whose ratio blew up
            skip = skip | (jnp.mean(stats["ratio"]) > settings.ratio_threshold)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), state.params, updates)
        apply = finite & ~skip
        new_state = state.replace(
            params=_select(apply, params, state.params),
            opt_state=_select(apply, opt_state, state.opt_state),
            optimizer_steps=state.optimizer_steps + apply.astype(jnp.int32),
            nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + (~skip).astype(jnp.int32)),
            nonfinite_total=state.nonfinite_total + (~finite & ~skip).astype(jnp.int32))
        if settings.early_stop_kl is not None:  # legacy: stop the epochs once the policy KL is too large
            stopped = stopped | (jnp.mean(stats["policykl"]) > settings.early_stop_kl)
        stats["skipped"] = jnp.broadcast_to(~apply, stats["loss"].shape).astype(jnp.float32)
        return (new_state, stopped), stats

    def epoch_step(carry, epoch_key):
        order = jax.random.permutation(epoch_key, batch_size).reshape(settings.num_mini_batches, mini_size)
        return jax.lax.scan(mini_batch_step, carry, order)

    epoch_keys = jax.random.split(key, settings.num_ppo_epochs)
    (state, _), stats = jax.lax.scan(epoch_step, (state, jnp.bool_(False)), epoch_keys)
    # stats leaves: [epochs, mini_batches, micro_batches]
    metrics = dict(rollout_stats)
    for short, name in ppo.UPDATE_METRIC_NAMES.items():
        metrics[name] = jnp.mean(stats[short])
    metrics["policy/policykl_avg"] = jnp.mean(stats["policykl"])
    metrics["ppo/skipped_steps"] = jnp.sum(stats["skipped"][..., 0])
    metrics["ppo/nonfinite_total"] = state.nonfinite_total
    metrics["lr"] = lr
    metrics["objective/kl_coef"] = jnp.asarray(kl_coef, jnp.float32)
    metrics["first_micro_batch/ratio"] = stats["ratio"][0, 0, 0]
    metrics["first_micro_batch/approxkl"] = stats["approxkl"][0, 0, 0]
    return state.replace(update_count=state.update_count + 1), metrics


def make_ppo_update(actor_critic: ActorCritic, settings: UpdateSettings, optimizer):
    """The jitted update ``(state, experience, key, kl_coef) -> (state, metrics)`` with the state donated.

    Shardings follow the inputs' (jit propagates them); see ``ppojax.sharding`` for the rules.
    """
    def update(state, experience, key, kl_coef):
        return ppo_update(actor_critic, settings, optimizer, state, experience, key, kl_coef)

    return jax.jit(update, donate_argnums=(0,))
