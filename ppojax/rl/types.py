"""The data that flows between PPO's phases, in one place.

    prompts i32[B, P] --sample--> query_responses i32[B, P+R] --forwards + reward--> Experience
    Experience --shaped rewards, advantages--> UpdateBatch --epochs x mini-batches x micro-batches--> TrainState

``B`` rollout rows, ``P`` prompt length (left padded), ``R`` response length, all static. Masks named
``padding_mask*`` are True on padding.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from ppojax.core.controllers import RunningMoments
from ppojax.rl.settings import Hyperparams

NO_ROW = -1
"""A prompt's row in the run's prompt table is unknown: a Python reward sees no dataset columns for it."""


class Prompts(NamedTuple):
    """A batch of prompts with their rows in the run's prompt table (through which Python rewards receive the
    dataset's columns). input_ids: i32[B, P] left-padded; rows: i32[B] (``NO_ROW`` where unknown)."""

    input_ids: Any
    rows: Any


def as_prompts(prompts) -> Prompts:
    """Prompts as given to a train step: ``Prompts``, or bare token ids i32[..., B, P] (rows unknown)."""
    if isinstance(prompts, Prompts):
        return Prompts(jnp.asarray(prompts.input_ids, jnp.int32), jnp.asarray(prompts.rows, jnp.int32))
    ids = jnp.asarray(prompts, jnp.int32)
    return Prompts(ids, jnp.full(ids.shape[:-1], NO_ROW, jnp.int32))


@struct.dataclass
class Experience:
    """One rollout batch (docs/algorithm.md, "Rollout").

    queries:         i32[B, P]    left-padded prompts.
    query_responses: i32[B, P+R]  prompts + UNtruncated sampled responses: the forward input of the loss.
    responses:       i32[B, R]    truncated responses (pad after the first stop token): what was rewarded.
    logprobs:        f32[B, R]    behaviour log-probs of the sampled tokens, INVALID_LOGPROB on padding_mask.
    ref_logprobs:    f32[B, R]    reference-model log-probs, INVALID_LOGPROB on padding_mask.
    values:          f32[B, R]    value of state query + response[:t], 0 on padding_mask_p1 (all 0 when the
                                  advantage estimator uses no critic).
    scores:          f32[B]       sequence scores as the reward source returned them, missing_eos_penalty
                                  applied (TRL's ``objective/scores``); legacy score processing happens in
                                  the update, which sees the state's running moments.
    last_index:      i32[B]       index of the last real response token (``seq`` in docs/algorithm.md; -1 if none).
    padding_mask:    bool[B, R]   ``t > last_index`` (policy side).
    padding_mask_p1: bool[B, R]   ``t > last_index + 1`` (value side).
    contains_stop:   bool[B]      whether the response emitted the stop token (all False without one).
    num_eos_tokens:  i32[]        eos tokens in the UNtruncated responses (TRL's ``val/num_eos_tokens``).
    full_kl:         f32[B, R]    sum_v pi (log pi - log pi_ref) over the vocabulary, 0 on padding_mask;
                                  None unless the KL estimator needs it.
    reward_components: {name: f32[B]}  each reward's own values before weighting (NaN where it does not apply),
                                  for the ``rewards/<name>/*`` metrics; None for caller-given scores.
    trained:         bool[B]      the rows the loss trains on (None: all). Dynamic sampling's batch, where the
                                  bound on rounds stopped it before it was full, holds dropped groups in its
                                  free slots, False here (``ppojax.rl.dynamic_sampling``).
    proximal_logprobs: f32[B, R]  the training policy's own forward over the sampled tokens (pi_prox, the
                                  ratio's denominator) when ``logprobs`` are the sampler's (the behaviour
                                  policy's) and an off-policy correction weighs one against the other
                                  (docs/algorithm.md, "Off-policy corrections"); INVALID_LOGPROB on padding_mask;
                                  None otherwise (``logprobs`` are then the ratio's denominator).
    policy_versions: i32[B, R]    the policy version (``TrainState.update_count``) that sampled each token: the
                                  update's own in a synchronous run (None: unknown, no staleness metrics).
    environment_mask: bool[B, R]  True on the tokens a multi-turn episode's environment wrote into the response
                                  (tool results, observations), not the policy; None: single-turn. The update
                                  leaves them out of every loss, the KL, the entropy and every token count, and
                                  the advantage estimators' scans pass through them (docs/algorithm.md, GAE).
    """

    queries: jax.Array
    query_responses: jax.Array
    responses: jax.Array
    logprobs: jax.Array
    ref_logprobs: jax.Array
    values: jax.Array
    scores: jax.Array
    last_index: jax.Array
    padding_mask: jax.Array
    padding_mask_p1: jax.Array
    contains_stop: jax.Array
    num_eos_tokens: jax.Array | None = None
    full_kl: jax.Array | None = None
    reward_components: dict | None = None
    trained: jax.Array | None = None
    proximal_logprobs: jax.Array | None = None
    policy_versions: jax.Array | None = None
    environment_mask: jax.Array | None = None

    @property
    def num_stop_tokens(self):
        """i32 scalar: responses that emitted the stop token."""
        return jnp.sum(self.contains_stop.astype(jnp.int32))


class UpdateBatch(NamedTuple):
    """Per-row tensors the loss reads; all share the leading batch axis [B, ...]."""

    query_responses: jax.Array  # i32[B, P+R]
    logprobs: jax.Array         # f32[B, R]  pi_old, the ratio's denominator (INVALID_LOGPROB on padding): the
    #                                        behaviour log-probs, or the proximal ones under an off-policy correction
    values: jax.Array           # f32[B, R]  rollout values (0 on padding_mask_p1; 0 without a critic)
    advantages: jax.Array       # f32[B, R]  whitened, 0 on padding
    returns: jax.Array          # f32[B, R]
    padding_mask: jax.Array     # bool[B, R] True = padding
    padding_mask_p1: jax.Array  # bool[B, R]
    ref_logprobs: Any = None    # f32[B, R]  reference log-probs (INVALID_LOGPROB on padding): KL-in-loss term
    behaviour_logprobs: Any = None  # f32[B, R] the behaviour (sampler's) log-probs where they are not ``logprobs``
    #                                         (INVALID_LOGPROB on padding): off_policy_mask_threshold reads them
    behaviour_weights: Any = None   # f32[B, R] the off-policy behaviour weights sg(pi_prox / pi_behav) (None: off)


@struct.dataclass
class TrainState:
    """Everything one PPO iteration reads and changes; the input and output of ``train_step``.

    params:         the trainable pytree of an :class:`~ppojax.rl.actor_critic.ActorCritic`
                    (``{"policy": ..., "value": ...}``, or ``{"policy": ...}`` with a value head).
    opt_state:      the optimizer's state of ``params``.
    frozen:         models that never train, ``{"ref": params | None, "reward": params | None}``: passed
                    through every step unchanged (donated and aliased, never copied), and left out of
                    checkpoints (they are rebuilt from the config).
    kl_coef:        f32[] the KL penalty coefficient (the adaptive controller moves it in the program).
    hyperparams:    the traced learning rate, clip ranges and loss coefficients
                    (:class:`ppojax.rl.settings.Hyperparams`): set them with ``state.replace(hyperparams=...)``
                    between steps, no recompilation.
    score_moments:  running mean/std of the scores (legacy ``use_score_scaling``).
    update_count:   i32[] PPO iterations done (drives the learning-rate schedule).
    optimizer_steps: i32[] optimizer steps applied.
    nonfinite_streak / nonfinite_total: i32[] optimizer steps skipped for a non-finite loss or gradient.
    episode:        i32[] episodes (sampled responses: prompts x ``num_generations``) trained on so far (TRL's
                    ``episode``).
    in_flight:      an asynchronous run's sampled batches not learned yet, oldest first
                    (``ppojax.rl.pipeline.SampledBatch`` with a leading [max_staleness] axis); None when synchronous.
    """

    params: Any
    opt_state: Any
    frozen: Any
    kl_coef: jax.Array
    hyperparams: Hyperparams
    score_moments: RunningMoments
    update_count: jax.Array
    optimizer_steps: jax.Array
    nonfinite_streak: jax.Array
    nonfinite_total: jax.Array
    episode: jax.Array
    in_flight: Any = None

    def without_frozen(self) -> "TrainState":
        """The state a checkpoint stores (the frozen models are rebuilt from the config)."""
        return self.replace(frozen=None)


def init_train_state(params, optimizer, *, hyperparams: Hyperparams, frozen=None, kl_coef=0.05,
                     in_flight=None) -> TrainState:
    """A fresh state: optimizer initialised on ``params``, counters at 0, score moments at mean 0 / std 1.

    hyperparams: the traced hyperparameters (``Hyperparams.from_config(config)`` or ``Hyperparams.create(...)``).
    in_flight: an asynchronous run's queue shapes (``ppojax.rl.in_flight_updates.in_flight_shapes``): zeros of
    them, which ``ppojax.rl.in_flight_updates.fill_queue`` replaces with the first batches; None: synchronous."""
    def zero():  # distinct buffers: the state is donated, and one buffer may not be donated twice
        return jnp.zeros((), jnp.int32)

    return TrainState(params=params, opt_state=optimizer.init(params), frozen=frozen,
                      kl_coef=jnp.asarray(kl_coef, jnp.float32),
                      hyperparams=jax.tree.map(lambda x: jnp.array(x, jnp.float32), hyperparams),
                      score_moments=RunningMoments.create(),
                      update_count=zero(), optimizer_steps=zero(), nonfinite_streak=zero(),
                      nonfinite_total=zero(), episode=zero(),
                      in_flight=None if in_flight is None else jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                                                                            in_flight))
