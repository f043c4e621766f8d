"""The PPO update on one rollout batch (docs/algorithm.md: "Shaped rewards", "Advantages", "Loss", "Update structure").

    learn(program, state, experience, key):
        scores        = process_scores(experience.scores, state.score_moments)     # legacy, off by default
        rewards, kl   = shaped_rewards(scores, kl_estimator(logprobs, ref_logprobs), state.kl_coef)
        advantages    = advantage_estimator(rewards, values)                          # global statistics
        weights       = behaviour_weights(proximal, behaviour logprobs)               # off-policy corrections, if on
        for epoch (lax.scan, key_e = split(key, epochs)[e]):
            order = epoch_order(key_e, B, num_mini_batches, G)  # whole groups with shared_prompt_forward
            for mini-batch (lax.scan): grads = sum over micro-batches (lax.scan) of token-weighted grads
                                       ONE optimizer step (skipped when non-finite)
        kl_coef       = adaptive_kl_update(kl_coef, kl)                               # legacy, off by default
        metrics       = rollout metrics + mean per-micro-batch diagnostics, under TRL's names

Semantics chosen where TRL differs (see README): one optimizer step per mini-batch (TRL >= 0.17 steps once
per epoch when num_mini_batches > 1); micro-batch losses are token-weighted over the mini-batch, so
accumulation equals one big batch exactly; the learning-rate schedule advances once per UPDATE, as TRL's
scheduler does. Non-finite loss or gradients skip the optimizer step and are counted; an update whose every
step was skipped leaves the KL coefficient and the score moments as they were.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ppojax import core as ppo
from ppojax.rl.optimizer import apply as apply_optimizer
from ppojax.rl.packed_update import packed_gradients, packed_micro_batch_shape, packed_row_length, rows_only
from ppojax.rl.types import UpdateBatch


def learning_rate_at(optim, learning_rate, update_index):
    """The learning rate of update ``update_index``: the traced base ``learning_rate`` times the schedule
    (``OptimSettings.lr_schedule``: optax's linear warmup, then constant or linear decay, stepped once per update
    as TRL's PPO steps its scheduler)."""
    return jnp.asarray(learning_rate, jnp.float32) * optim.lr_schedule()(update_index)


# --------------------------------------------------------------------------------------------------
# Rewards and advantages on the whole (global) rollout batch
# --------------------------------------------------------------------------------------------------
def process_scores(algorithm, experience, moments):
    """Legacy score scaling / normalisation / clipping (off by default). -> (scores f32[B], new moments).

    A NaN/inf score leaves the running moments as they were: that update is skipped anyway, and the moments
    must stay usable for the next one."""
    if not algorithm.processes_scores:
        return experience.scores, moments
    scores, new = ppo.process_scores(experience.scores, moments, use_score_scaling=algorithm.use_score_scaling,
                                     use_score_norm=algorithm.use_score_norm, score_clip=algorithm.score_clip)
    finite = jnp.all(jnp.isfinite(experience.scores))
    return scores, jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, moments)


def per_token_kl(algorithm, experience):
    """The configured KL estimator's f32[B, R] (0 on padding)."""
    if ppo.kl_estimator(algorithm.kl_estimator).needs_full_distribution:
        return experience.full_kl  # computed in the rollout from both full distributions
    return ppo.kl_per_token(experience.logprobs, experience.ref_logprobs, algorithm.kl_estimator)


def mask_environment_tokens(experience):
    """A multi-turn episode's environment tokens (``Experience.environment_mask``) made padding on both sides:
    from here on every loss term, the entropy, the KL and every live-token count leave them out, as they leave
    out padding. The mask itself stays for the estimators' scans. Single-turn experience is returned as it is."""
    environment = experience.environment_mask
    if environment is None:
        return experience
    return experience.replace(padding_mask=experience.padding_mask | environment,
                              padding_mask_p1=experience.padding_mask_p1 | environment)


def shaped_rewards_and_advantages(algorithm, experience, scores, kl_coef, reward_weights=None):
    """The KL-shaped rewards (docs/algorithm.md, "Shaped rewards") and the configured advantage estimator on the whole
    rollout batch; the rows ``experience.trained`` leaves out and, with ``mask_truncated_completions``, the rows
    without the stop token are then taken out of the loss (TRL's GRPO: their advantages still counted in their
    groups).

    scores: f32[B] (after legacy processing); kl_coef: f32[]; reward_weights: the reward source's weights, in
    ``experience.reward_components``' order (read by ``multi_objective_aggregation: normalize_then_sum``).
    Returns (UpdateBatch, rollout metrics, kl f32[B, R]).
    """
    experience = mask_environment_tokens(experience)
    kl = per_token_kl(algorithm, experience)
    if experience.environment_mask is not None:  # the KL estimate of a token the policy did not write
        kl = jnp.where(experience.environment_mask, 0.0, kl)
    shaped = ppo.shaped_rewards(scores, kl, experience.last_index, kl_coef, experience.padding_mask_p1,
                                score_position=algorithm.score_position, whiten_rewards=algorithm.whiten_rewards)
    estimator = ppo.advantage_estimator(algorithm.advantage_estimator)
    components, weights = reward_components(algorithm, experience, reward_weights)
    adv = estimator.fn(ppo.AdvantageInputs(shaped.rewards, scores, experience.values, experience.padding_mask,
                                           experience.padding_mask_p1, components, weights,
                                           experience.environment_mask), algorithm)
    metrics = ppo.rollout_metrics(experience.scores, kl, shaped.non_score_reward, experience.logprobs,
                                  experience.padding_mask, experience.num_eos_tokens)
    if algorithm.processes_scores:
        metrics["objective/scores_processed"] = jnp.mean(scores)
    proximal = experience.proximal_logprobs
    batch = UpdateBatch(experience.query_responses, experience.logprobs if proximal is None else proximal,
                        experience.values, adv.advantages, adv.returns, experience.padding_mask,
                        experience.padding_mask_p1,
                        ref_logprobs=experience.ref_logprobs if algorithm.kl_in_loss else None,
                        behaviour_logprobs=None if proximal is None else experience.logprobs)
    if experience.trained is not None:  # dynamic sampling's free slots (dropped groups): out of the loss
        batch = rows_only(batch, experience.trained)
    if algorithm.mask_truncated_completions:
        batch = rows_only(batch, experience.contains_stop)
        metrics["objective/truncated_fraction"] = 1.0 - jnp.mean(experience.contains_stop.astype(jnp.float32))
    if algorithm.weighs_behaviour and batch.behaviour_logprobs is not None:
        weights, weight_metrics = behaviour_weights(algorithm, batch)
        batch = batch._replace(behaviour_weights=weights)
        metrics.update(weight_metrics)
    return batch, metrics, kl


def behaviour_weights(algorithm, batch: UpdateBatch):
    """The off-policy behaviour weights sg(pi_prox / pi_behav) f32[B, R] of the batch's live tokens (after the rows
    out of the loss became padding, as TRL computes them on its loss mask) and their metrics
    (docs/algorithm.md, "Off-policy corrections"): AReaL's decoupled objective (``use_decoupled_loss``, capped by
    ``behav_imp_weight_cap``) or TRL's ``vllm_importance_sampling_correction`` by its mode and bounds. batch:
    ``logprobs`` the proximal log-probs, ``behaviour_logprobs`` the sampler's."""
    live = ~batch.padding_mask
    if algorithm.use_decoupled_loss:
        weights = ppo.decoupled_weights(batch.logprobs, batch.behaviour_logprobs, live, algorithm.behav_imp_weight_cap)
    else:
        weights = ppo.importance_weights(batch.logprobs, batch.behaviour_logprobs, live,
                                         algorithm.vllm_importance_sampling_mode,
                                         algorithm.vllm_importance_sampling_clip_max,
                                         algorithm.vllm_importance_sampling_clip_min)
    return weights.weights, ppo.importance_weight_metrics(weights, batch.logprobs, batch.behaviour_logprobs, live)


def reward_components(algorithm, experience, reward_weights):
    """(f32[F, B] each reward's values, f32[F] their weights) for ``normalize_then_sum``, else (None, None)
    (also without components: caller-given scores)."""
    if algorithm.multi_objective_aggregation != "normalize_then_sum" or not experience.reward_components:
        return None, None
    values = jnp.stack([jnp.asarray(v, jnp.float32) for v in experience.reward_components.values()])
    if reward_weights is None or len(reward_weights) != values.shape[0]:  # scores the caller gave: weight 1
        reward_weights = (1.0,) * values.shape[0]
    return values, jnp.asarray(reward_weights, jnp.float32)


def padding_metrics(batch: UpdateBatch, pad_token_id: int) -> dict:
    """``perf/real_tokens`` (prompt and response tokens the rollout holds, i32[]) and ``perf/padding_fraction``
    (the share of the padded [B, P+R] slots that are not: what a padded forward computes for nothing)."""
    response_length = batch.logprobs.shape[1]
    prompt_length = batch.query_responses.shape[1] - response_length
    real = (jnp.sum(batch.query_responses[:, :prompt_length] != pad_token_id, dtype=jnp.int32)
            + jnp.sum(~batch.padding_mask, dtype=jnp.int32))
    return {"perf/real_tokens": real,
            "perf/padding_fraction": 1.0 - real.astype(jnp.float32) / batch.query_responses.size}


# --------------------------------------------------------------------------------------------------
# The loss of one micro-batch
# --------------------------------------------------------------------------------------------------
def micro_batch_loss(actor_critic, algorithm, hyperparams, params, batch: UpdateBatch, policy_tokens, value_tokens,
                     rows=None, frozen=None, logits_chunk_size=None, prompt_group=1, prompt_prefix=0):
    """PPO loss of one micro-batch on the current parameters, normalised by its mini-batch's live-token and
    row counts (None: its own), so micro-batch gradients sum to the mini-batch's (``frozen``: the state's
    frozen models, read by the policy under LoRA). algorithm: the static ``AlgorithmSettings``; hyperparams:
    the traced ``Hyperparams`` (clip ranges, coefficients); prompt_group: ``BatchSettings.prompt_group`` (the
    micro-batch's rows then whole groups); prompt_prefix: ``BatchSettings.prompt_prefix``. Returns (loss, stats)."""
    response_length = batch.logprobs.shape[1]
    prompt_length = batch.query_responses.shape[1] - response_length
    logprobs, entropy, vpred = actor_critic.evaluate(params, batch.query_responses, prompt_length, frozen=frozen,
                                                     logits_chunk_size=logits_chunk_size, prompt_group=prompt_group,
                                                     prompt_prefix=prompt_prefix)
    return loss_of_outputs(actor_critic, algorithm, hyperparams, logprobs, entropy, vpred, batch, policy_tokens,
                           value_tokens, rows)


def loss_of_outputs(actor_critic, algorithm, hyperparams, logprobs, entropy, vpred, batch: UpdateBatch,
                    policy_tokens, value_tokens, rows):
    """The PPO loss and its diagnostics from the current parameters' outputs on ``batch``'s rows (logprobs,
    entropy, vpred: f32[b, R], unmasked), normalised by the mini-batch's counts. Returns (loss, stats)."""
    kl_loss_fn = ppo.kl_estimator(algorithm.kl_loss_type).fn if algorithm.kl_in_loss else None
    hp = hyperparams
    loss, stats = ppo.ppo_loss(logprobs, vpred, entropy, batch, cliprange=hp.cliprange_low,
                               cliprange_value=hp.cliprange_value, vf_coef=hp.vf_coef,
                               entropy_coef=hp.entropy_coef if algorithm.entropy_bonus else 0.0,
                               policy_tokens=policy_tokens, value_tokens=value_tokens, rows=rows,
                               cliprange_high=hp.cliprange_high, dual_clip_c=algorithm.dual_clip_c,
                               loss_agg_mode=algorithm.loss_agg_mode,
                               kl_loss_coef=hp.kl_loss_coef if algorithm.kl_in_loss else 0.0,
                               kl_loss_fn=kl_loss_fn, with_value=actor_critic.has_critic,
                               policy_term=objective_term(algorithm, hp, policy_tokens, rows))
    masked_new = jnp.where(batch.padding_mask, ppo.INVALID_LOGPROB, logprobs)
    stats["policykl"] = ppo.masked_mean(batch.logprobs - masked_new, ~batch.padding_mask)  # legacy early stop
    return loss, stats


def objective_term(algorithm, hyperparams, policy_tokens, rows):
    """The loss's policy term as ``ppo_loss`` takes it: the configured objective (``loss_type``, docs/algorithm.md
    "Policy objectives") with the traced clip ranges, or None for ``ppo_loss``'s own clipped surrogate
    (``loss_type: ppo`` without the objective options)."""
    if not algorithm.uses_policy_objective:
        return None
    a = algorithm
    params = ppo.ObjectiveParams(
        cliprange_low=hyperparams.cliprange_low, cliprange_high=hyperparams.cliprange_high, dual_clip_c=a.dual_clip_c,
        sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg,
        vespo_k_pos=a.vespo_k_pos, vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg)

    def term(new_logprobs, batch, entropy):
        return ppo.policy_term(a.loss_type, params, new_logprobs, batch.logprobs, batch.advantages,
                               batch.padding_mask, entropy, importance_sampling_level=a.importance_sampling_level,
                               top_entropy_quantile=a.top_entropy_quantile,
                               use_bias_correction_kl=a.use_bias_correction_kl, loss_agg_mode=a.loss_agg_mode,
                               policy_tokens=policy_tokens, rows=rows, behaviour_weights=batch.behaviour_weights,
                               behaviour_logprobs=batch.behaviour_logprobs,
                               off_policy_mask_threshold=a.off_policy_mask_threshold)
    return term


def _take_rows(batch, rows):
    return jax.tree.map(lambda x: x[rows], batch)


def _split_leading(batch, parts):
    return jax.tree.map(lambda x: x.reshape(parts, x.shape[0] // parts, *x.shape[1:]), batch)


def _select(condition, new, old):
    return jax.tree.map(lambda n, o: jnp.where(condition, n, o), new, old)


# --------------------------------------------------------------------------------------------------
# One mini-batch: its gradients, then ONE optimizer step
# --------------------------------------------------------------------------------------------------
def mini_batch_gradients(program, params, frozen, hyperparams, mini: UpdateBatch, mini_size: int):
    """Gradients of the loss over one mini-batch of ``mini_size`` rows, summed over its micro-batches (each
    token-weighted by the mini-batch's counts, so the sum is the mini-batch's gradient exactly).
    -> (grads like ``params``, stats: each f32[micro_batches])."""
    actor_critic, algorithm = program.actor_critic, program.settings.algorithm
    batch_settings, optim = program.settings.batch, program.settings.optim
    policy_tokens = jnp.sum(~mini.padding_mask)
    value_tokens = jnp.sum(~mini.padding_mask_p1)
    if batch_settings.padding_free:
        row_length = mini.query_responses.shape[1]
        packed_length = packed_row_length(batch_settings, row_length)
        packed_rows, packed_chunk = packed_micro_batch_shape(batch_settings, row_length, packed_length=packed_length)
        return packed_gradients(
            lambda part, lp, ent, v: loss_of_outputs(actor_critic, algorithm, hyperparams, lp, ent, v, part,
                                                     policy_tokens, value_tokens, mini_size),
            actor_critic, params, frozen, mini, groups=optim.gradient_accumulation_steps,
            rows_per_micro=packed_rows, logits_chunk_size=packed_chunk, row_length=packed_length)
    grad_fn = jax.value_and_grad(
        lambda p, micro: micro_batch_loss(actor_critic, algorithm, hyperparams, p, micro, policy_tokens,
                                          value_tokens, mini_size, frozen, batch_settings.update_logits_chunk,
                                          batch_settings.prompt_group, batch_settings.prompt_prefix),
        has_aux=True)
    if optim.gradient_accumulation_steps == 1:
        # No accumulator: zero-filling and adding a parameter-sized buffer costs ~3 % of a SmolLM2 update.
        (_, stats), grads = grad_fn(params, mini)
        return grads, jax.tree.map(lambda s: s[None], stats)  # [micro_batches=1, ...] like the scan's

    def micro_step(grad_sum, micro):
        (_, stats), grads = grad_fn(params, micro)
        return jax.tree.map(jnp.add, grad_sum, grads), stats

    return jax.lax.scan(micro_step, jax.tree.map(jnp.zeros_like, params),
                        _split_leading(mini, optim.gradient_accumulation_steps))


def optimizer_step(program, state, grads, stats, stopped, lr, withheld=None):
    """ONE optimizer step of ``state`` on a mini-batch's ``grads`` — skipped when they or the loss are not
    finite (counted), when the legacy ratio threshold or early stop says so, or when ``withheld`` (bool[]: the
    reward failed, or the batch has nothing to train).
    -> (state, stopped: bool[] the legacy early stop of the remaining epochs, stats with ``skipped``)."""
    actor_critic, optim = program.actor_critic, program.settings.optim
    finite = actor_critic.kernels.all_finite(grads) & jnp.all(jnp.isfinite(stats["loss"]))
    skip = stopped
    if optim.ratio_threshold is not None:  # legacy: drop a mini-batch whose ratio blew up
        skip = skip | (jnp.mean(stats["ratio"]) > optim.ratio_threshold)
    apply = finite & ~skip
    if withheld is not None:
        apply = apply & ~withheld
    # Critic warm-up: during the first ``critic_warmup`` updates only the critic's parameters (and their
    # optimizer moments) change; the policy's are kept as they were.
    policy_frozen = state.update_count < optim.critic_warmup if optim.critic_warmup else None
    policy_leaf = (lambda path: actor_critic.owner(path) == "policy") if optim.critic_warmup else None

    # The critic's own learning rate, where it has one: the same schedule, its own base value.
    critic_lr = critic_leaf = None
    if optim.critic_learning_rate is not None:
        critic_lr = learning_rate_at(optim, optim.critic_learning_rate, state.update_count)
        critic_leaf = lambda path: actor_critic.owner(path) == "critic"  # noqa: E731

    def step(params, opt_state):
        return apply_optimizer(program.optimizer, grads, opt_state, params, lr, kept=policy_leaf,
                               frozen=policy_frozen, critic_lr=critic_lr, critic_leaf=critic_leaf)

    # A branch, not where(apply, new, old): with both values live XLA copies every carried parameter and
    # Adam moment at each step; the branch updates them in place.
    params, opt_state = jax.lax.cond(apply, step, lambda p, o: (p, o), state.params, state.opt_state)
    state = state.replace(
        params=params,
        opt_state=opt_state,
        optimizer_steps=state.optimizer_steps + apply.astype(jnp.int32),
        nonfinite_streak=jnp.where(finite, 0, state.nonfinite_streak + (~skip).astype(jnp.int32)),
        nonfinite_total=state.nonfinite_total + (~finite & ~skip).astype(jnp.int32))
    if optim.early_stopping:  # legacy: stop the epochs once the policy KL is too large
        stopped = stopped | (jnp.mean(stats["policykl"]) > 1.5 * optim.target_kl)
    stats["skipped"] = jnp.broadcast_to(~apply, stats["loss"].shape).astype(jnp.float32)
    return state, stopped, stats


# --------------------------------------------------------------------------------------------------
# The update
# --------------------------------------------------------------------------------------------------
def learn(program, state, experience, key, reward_failed=None):
    """One PPO update of ``state`` on ``experience`` (pure; traced inside ``ppojax.rl.program``).

    program: a ``ppojax.rl.program.PPOProgram`` (actor_critic, settings, optimizer). key: PRNG key for the
    epoch permutations. reward_failed: bool[] (None: the reward cannot fail): when True, no optimizer step is
    applied, every other field of the state is returned as it came and the metrics are NaN (0 for integers): the
    update's work is traced once and its result discarded, as a failed reward ends the run anyway.
    An experience whose ``trained`` rows hold no token to train (dynamic sampling kept no group) applies no
    optimizer step either (counted in ``ppo/skipped_steps``); the rest of the update goes on.
    Returns (new state, metrics dict of f32/i32 scalars under TRL's names).
    """
    algorithm, optim = program.settings.algorithm, program.settings.optim
    scores, moments = process_scores(algorithm, experience, state.score_moments)
    batch, rollout_stats, _ = shaped_rewards_and_advantages(algorithm, experience, scores, state.kl_coef,
                                                            reward_weights=program.reward_weights)
    withheld = reward_failed
    if experience.trained is not None:  # nothing to train: Adam's moments alone would still move the weights
        nothing = ~jnp.any(~batch.padding_mask)
        withheld = nothing if withheld is None else withheld | nothing
    batch_size = batch.logprobs.shape[0]
    mini_size = batch_size // optim.num_mini_batches
    lr = learning_rate_at(optim, state.hyperparams.learning_rate, state.update_count)

    def mini_batch_step(carry, rows):
        new, stopped = carry
        grads, stats = mini_batch_gradients(program, new.params, new.frozen, new.hyperparams,
                                            _take_rows(batch, rows), mini_size)
        new, stopped, stats = optimizer_step(program, new, grads, stats, stopped, lr, withheld)
        return (new, stopped), stats

    def epoch_step(carry, epoch_key):
        order = epoch_order(epoch_key, batch_size, optim.num_mini_batches, program.settings.batch.prompt_group)
        return jax.lax.scan(mini_batch_step, carry, order)

    epoch_keys = jax.random.split(key, optim.num_ppo_epochs)
    (new, _), stats = jax.lax.scan(epoch_step, (state, jnp.bool_(False)), epoch_keys)
    metrics = {**rollout_stats, **padding_metrics(batch, program.actor_critic.pad_token_id),
               **step_metrics(stats), "lr": lr}
    if experience.policy_versions is not None:  # how stale the trained tokens are (0 in a synchronous run)
        metrics.update(ppo.staleness_metrics(experience.policy_versions, state.update_count, ~batch.padding_mask))
    new, metrics = after_the_steps(program, state, new, moments, metrics, batch_size)
    if reward_failed is not None:
        # params and opt_state were never stepped (``apply``): only the state's scalars are chosen between
        kept = state.replace(params=new.params, opt_state=new.opt_state)
        new = jax.tree.map(lambda old, now: now if old is now else jnp.where(reward_failed, old, now), kept, new)
        metrics = {name: jnp.where(reward_failed, _nan_of(value), value) for name, value in metrics.items()}
    return new, metrics


def epoch_order(key, batch_size: int, num_mini_batches: int, group: int = 1):
    """The rows of each mini-batch of an epoch: i32[num_mini_batches, batch_size / num_mini_batches], a random
    permutation of the batch's rows, or with ``group`` G > 1 of its groups of G consecutive rows (each group's rows
    kept together and in order, so a mini-batch's forward can run each group's prompt once)."""
    if group == 1:
        return jax.random.permutation(key, batch_size).reshape(num_mini_batches, -1)
    groups = jax.random.permutation(key, batch_size // group)
    return (groups[:, None] * group + jnp.arange(group)).reshape(num_mini_batches, -1)


def step_metrics(stats) -> dict:
    """The update's diagnostics under TRL's names from the mini-batch steps' ``stats`` (leaves f32[epochs,
    mini_batches, micro_batches])."""
    metrics = {}
    for short, name in ppo.UPDATE_METRIC_NAMES.items():
        if short in stats:
            metrics[name] = jnp.mean(stats[short])
    for short, name in ppo.LOSS_METRIC_NAMES.items():
        if short in stats:
            metrics[name] = jnp.mean(jnp.sum(stats[short], axis=-1))
    # TRL's val/ratio_var: the (unbiased) variance of the micro-batches' mean ratios (NaN with one).
    metrics["val/ratio_var"] = jnp.var(stats["ratio"], ddof=1) if stats["ratio"].size > 1 else jnp.float32(jnp.nan)
    metrics["policy/policykl_avg"] = jnp.mean(stats["policykl"])
    for name, values in stats.get("objective", {}).items():  # a policy objective's own, under TRL GRPO's names
        metrics[name] = (jnp.min(values) if name.endswith("_min") else jnp.max(values) if name.endswith("_max")
                         else jnp.mean(values))
    if "packed_micro_batches" in stats:
        metrics["perf/packed_micro_batches"] = jnp.mean(stats["packed_micro_batches"])
    metrics["ppo/skipped_steps"] = jnp.sum(stats["skipped"][..., 0])
    metrics["first_micro_batch/ratio"] = stats["ratio"][0, 0, 0]
    metrics["first_micro_batch/approxkl"] = stats["approxkl"][0, 0, 0]
    return metrics


def after_the_steps(program, before, state, moments, metrics: dict, batch_size: int):
    """The controllers and counters once an update's optimizer steps are done: the KL coefficient (adaptive
    controller) and the score moments move unless every step was skipped for non-finite values; the update and
    episode counts advance. ``before``: the state the update started from. -> (state, metrics)."""
    algorithm, optim = program.settings.algorithm, program.settings.optim
    nonfinite_steps = state.nonfinite_total - before.nonfinite_total
    all_skipped = (nonfinite_steps > 0) & (metrics["ppo/skipped_steps"] >= optim.steps_per_update)
    kl_coef = state.kl_coef
    if algorithm.adaptive_kl:
        mean_kl = metrics["objective/kl"]
        moved = ppo.adaptive_kl_update(kl_coef, mean_kl, batch_size, algorithm.target_kl_for_adaptive,
                                       algorithm.horizon)
        kl_coef = jnp.where(jnp.isfinite(mean_kl) & ~all_skipped, moved, kl_coef)
    moments = _select(all_skipped, state.score_moments, moments)
    state = state.replace(kl_coef=kl_coef, score_moments=moments, update_count=state.update_count + 1,
                          episode=state.episode + batch_size)
    metrics = {**metrics, "ppo/nonfinite_total": state.nonfinite_total, "ppo/nonfinite_steps": nonfinite_steps,
               "objective/kl_coef": before.kl_coef,  # the coefficient this update's rewards used
               "episode": state.episode}
    return state, metrics


def _nan_of(value):
    """NaN of a floating metric's dtype, 0 of an integer one."""
    return jnp.nan if jnp.issubdtype(jnp.result_type(value), jnp.floating) else 0
