"""The rollout: prompts -> the ``Experience`` PPO learns from (SPEC "Rollout", steps 1-8).

Three stages, so that a Python reward function (the only host round trip) overlaps device work:

1. :func:`sample_responses` (jitted): generate ``R`` tokens per left-padded prompt -> ``query_responses``.
2. :func:`experience_forwards` (jitted): truncate, masks, behaviour log-probs (the same
   :func:`ppojax.forward.response_logprobs` the loss uses), reference log-probs, values, and the reward
   model's scores when there is one; ``INVALID_LOGPROB`` on ``padding_mask``, values 0 on
   ``padding_mask_p1``.
3. scores: the reward model's (stage 2), a Python reward function's (:func:`reward_function_scores`, run on
   the host while stage 2 is still computing), or the caller's; then :func:`finalize_scores` applies
   ``missing_eos_penalty``.

:func:`make_experience` runs the three. Every jitted function compiles once per shape and settings: model
graph definitions and :class:`RolloutSettings` are static (hashable) arguments, parameters and data are
traced. Legacy score scaling/normalisation/clipping (SPEC step 9) needs running state across batches and
lives with the trainer (``ppojax.ppo.process_scores``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ppojax import forward
from ppojax.generate import generate
from ppojax.sharding import to_host
from ppojax.ppo.masks import INVALID_LOGPROB, contains_stop_token, response_masks, truncate_response
from ppojax.ppo.shaping import apply_missing_eos_penalty
from ppojax.rewards import call_reward_function


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """Static rollout options (hashable: a jit static argument). Names follow TRL's PPOConfig.

    response_length: R, tokens sampled per prompt.
    pad_token_id: pad id (must differ from the stop token; SPEC keys everything on ``token != pad``).
    temperature, top_k (0 = off), top_p (1.0 = off), greedy: the sampler (SPEC: ``T + 1e-7``).
    stop_token_id: a sequence ends after emitting it (None = never; then there is nothing to truncate).
    missing_eos_penalty: subtracted from the score of responses without the stop token (None = off).
    logprob_chunk_size: time steps per float32 logits chunk in the log-prob forwards (None = all R).
    forward_batch_size: rows per forward pass of the log-prob/value/score forwards (None = whole batch;
        TRL's ``local_rollout_forward_batch_size``); must divide the batch.
    cache_dtype: KV-cache dtype (None = the policy's compute dtype).
    compute_full_kl: also compute ``Experience.full_kl`` (SPEC's legacy ``full`` KL estimator, which needs
        both full distributions; set it when ``kl_estimator == 'full'``).
    """

    response_length: int
    pad_token_id: int
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_id: int | None = None
    missing_eos_penalty: float | None = None
    logprob_chunk_size: int | None = 64
    forward_batch_size: int | None = None
    cache_dtype: Any = None
    compute_full_kl: bool = False

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError(f"RolloutSettings.{name}={getattr(self, name)!r}; expected {expected}.")

        if not isinstance(self.response_length, int) or self.response_length < 1:
            bad("response_length", "an int >= 1")
        if not isinstance(self.pad_token_id, int) or self.pad_token_id < 0:
            bad("pad_token_id", "a non-negative int (add a pad token to the tokenizer if it has none)")
        if self.stop_token_id is not None and self.stop_token_id == self.pad_token_id:
            raise ValueError(f"stop_token_id == pad_token_id == {self.pad_token_id}: SPEC keys masks on "
                             "`token != pad`, so the stop token would be masked away. Add a distinct pad "
                             "token (e.g. tokenizer.add_special_tokens({'pad_token': '[PAD]'})).")
        if not self.greedy and not self.temperature > 0:
            bad("temperature", "> 0 (or greedy=True)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an int >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1] (1.0 = off)")
        for name in ("logprob_chunk_size", "forward_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                bad(name, "None or an int >= 1")

    def generate_kwargs(self):
        """Keyword arguments of :func:`ppojax.generate.generate`."""
        return dict(response_length=self.response_length, pad_token_id=self.pad_token_id,
                    temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, greedy=self.greedy,
                    stop_token_id=self.stop_token_id, cache_dtype=self.cache_dtype)


@struct.dataclass
class Experience:
    """One rollout batch. B prompts, P prompt length, R response length. Masks: True = padding.

    queries:         i32[B, P]    left-padded prompts.
    query_responses: i32[B, P+R]  prompts + UNtruncated sampled responses: the forward input of the loss.
    responses:       i32[B, R]    truncated responses (pad after the first stop token): what was rewarded.
    logprobs:        f32[B, R]    behaviour log-probs of the sampled tokens, INVALID_LOGPROB on padding_mask.
    ref_logprobs:    f32[B, R]    reference-model log-probs, INVALID_LOGPROB on padding_mask.
    values:          f32[B, R]    value of state query + response[:t], 0 on padding_mask_p1.
    scores:          f32[B]       sequence scores (missing_eos_penalty applied).
    last_index:      i32[B]       index of the last real response token (``seq`` of SPEC; -1 if none).
    padding_mask:    bool[B, R]   ``t > last_index`` (policy side).
    padding_mask_p1: bool[B, R]   ``t > last_index + 1`` (value side).
    contains_stop:   bool[B]      whether the response emitted the stop token (all False without one).
    full_kl:         f32[B, R]    sum_v pi (log pi - log pi_ref) over the vocabulary, 0 on padding_mask;
                                  None unless ``RolloutSettings.compute_full_kl``.
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
    full_kl: jax.Array | None = None

    @property
    def num_stop_tokens(self):
        """i32 scalar: responses that emitted the stop token (TRL's ``val/num_eos_tokens``)."""
        return jnp.sum(self.contains_stop.astype(jnp.int32))


def value_head_values(policy, hidden):
    """``policy_value_head`` for a ``CausalLMWithValueHead`` policy: its ``value`` head on the response
    hidden states f[B, R, D] -> f32[B, R] (one backbone pass gives log-probs and values)."""
    return policy.value(hidden)


# --------------------------------------------------------------------------------------------------
# Stage 1: sampling
# --------------------------------------------------------------------------------------------------
def _sample_responses(policy_graphdef, policy_params, queries, key, temperature, settings: RolloutSettings):
    kwargs = dict(settings.generate_kwargs(), temperature=temperature)
    responses = generate(policy_graphdef, policy_params, queries, key, **kwargs)
    return jnp.concatenate([queries.astype(jnp.int32), responses], axis=1)


_sample_responses_jit = jax.jit(_sample_responses, static_argnames=("policy_graphdef", "settings"))


def sample_responses(policy_graphdef, policy_params, queries, key, settings: RolloutSettings):
    """Stage 1 (compiled): queries i32[B, P] -> query_responses i32[B, P+R] (untruncated responses).

    The temperature is passed traced, so sampling at another temperature (e.g. near-greedy sample
    completions) reuses the compiled program; every other setting is static.
    """
    static = dataclasses.replace(settings, temperature=1.0)
    return _sample_responses_jit(policy_graphdef, policy_params, jnp.asarray(queries, jnp.int32), key,
                                 jnp.float32(settings.temperature), static)


# --------------------------------------------------------------------------------------------------
# Stage 2: the forwards
# --------------------------------------------------------------------------------------------------
def _experience_forwards(policy_params, ref_params, value_params, reward_params, query_responses, *,
                         prompt_length, settings: RolloutSettings, policy_graphdef, ref_graphdef=None,
                         value_graphdef=None, reward_graphdef=None, policy_value_head=None):
    pad, temperature = settings.pad_token_id, settings.temperature
    chunk, rows = settings.logprob_chunk_size, settings.forward_batch_size
    ref_graphdef = policy_graphdef if ref_graphdef is None else ref_graphdef
    P = prompt_length
    queries, raw_responses = query_responses[:, :P], query_responses[:, P:]

    responses = truncate_response(raw_responses, settings.stop_token_id, pad)
    masks = response_masks(responses, pad)

    def policy_and_ref_forward(qr):
        lm, ref_lm = nnx.merge(policy_graphdef, policy_params), nnx.merge(ref_graphdef, ref_params)
        hidden = forward.response_hidden(lm, qr, P, pad)
        ref_hidden = forward.response_hidden(ref_lm, qr, P, pad)
        logprobs, _ = forward.logprobs_from_hidden(lm, hidden, qr[:, P:], temperature, chunk_size=chunk)
        ref_logprobs, _ = forward.logprobs_from_hidden(ref_lm, ref_hidden, qr[:, P:], temperature,
                                                       chunk_size=chunk)
        values = None if policy_value_head is None else policy_value_head(lm, hidden).astype(jnp.float32)
        full_kl = None
        if settings.compute_full_kl:
            full_kl = forward.full_kl_from_hidden(lm, hidden, ref_lm, ref_hidden, temperature, chunk_size=chunk)
        return logprobs, ref_logprobs, values, full_kl

    logprobs, ref_logprobs, values, full_kl = forward.map_batch(policy_and_ref_forward, rows, query_responses)
    if value_graphdef is not None:
        values = forward.map_batch(
            lambda qr: forward.response_values(nnx.merge(value_graphdef, value_params), qr, P, pad),
            rows, query_responses)
    if values is None:
        raise ValueError("no value source: pass a value model (value_graphdef/value_params) or a "
                         "policy_value_head.")

    batch = query_responses.shape[0]
    if reward_graphdef is not None:
        postprocessed = jnp.concatenate([queries, responses], axis=1)
        scores = forward.map_batch(
            lambda qr: forward.sequence_scores(nnx.merge(reward_graphdef, reward_params), qr, pad,
                                               prompt_length=P),
            rows, postprocessed)
    else:
        scores = jnp.zeros((batch,), jnp.float32)

    return Experience(
        queries=queries,
        query_responses=query_responses,
        responses=responses,
        logprobs=jnp.where(masks.padding_mask, INVALID_LOGPROB, logprobs),
        ref_logprobs=jnp.where(masks.padding_mask, INVALID_LOGPROB, ref_logprobs),
        values=jnp.where(masks.padding_mask_p1, 0.0, values),
        scores=scores,
        last_index=masks.last_index,
        padding_mask=masks.padding_mask,
        padding_mask_p1=masks.padding_mask_p1,
        contains_stop=contains_stop_token(responses, settings.stop_token_id),
        full_kl=None if full_kl is None else jnp.where(masks.padding_mask, 0.0, full_kl),
    )


#: Stage 2 compiled. Traced: policy/ref/value/reward params (None where unused) and query_responses
#: i32[B, P+R]. Static: prompt_length, settings, the graph definitions, policy_value_head
#: (``(policy_module, hidden f[B,R,D]) -> f32[B,R]``, the hook for a value head on the policy backbone).
#: Returns an :class:`Experience` whose ``scores`` are the reward model's (zeros without one), before
#: ``missing_eos_penalty``.
experience_forwards = jax.jit(
    _experience_forwards,
    static_argnames=("prompt_length", "settings", "policy_graphdef", "ref_graphdef", "value_graphdef",
                     "reward_graphdef", "policy_value_head"))


# --------------------------------------------------------------------------------------------------
# Stage 3: scores
# --------------------------------------------------------------------------------------------------
def decode_rollout_text(tokenizer, queries, responses, pad_token_id):
    """Prompt and completion strings for a reward function (host side).

    queries: int[B, P], responses: int[B, R] TRUNCATED. Pad ids are dropped, and the completion stops at
    its first pad; special tokens (the stop token included) are skipped. -> (prompts, completions).
    """
    queries, responses = np.asarray(queries), np.asarray(responses)
    prompt_ids = [[int(t) for t in row if t != pad_token_id] for row in queries]
    completion_ids = []
    for row in responses:
        pads = np.flatnonzero(row == pad_token_id)
        completion_ids.append([int(t) for t in row[:pads[0] if pads.size else len(row)]])
    prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return list(prompts), list(completions)


def _truncate_np(responses, stop_token_id, pad_token_id):
    """numpy twin of ``ppojax.ppo.masks.truncate_response`` (host side, no device dispatch)."""
    if stop_token_id is None:
        return responses
    is_stop = responses == stop_token_id
    stop_index = np.where(is_stop.any(-1), is_stop.argmax(-1), responses.shape[-1])
    return np.where(np.arange(responses.shape[-1]) > stop_index[:, None], pad_token_id, responses)


def reward_function_scores(reward_fn: Callable[[list[str], list[str]], Sequence[float]], tokenizer,
                           queries, responses, pad_token_id, allow_nonfinite: bool = False):
    """Host round trip: decode, call ``reward_fn(prompts, completions)``, validate -> np.float32[B].
    NaN/inf scores raise, unless ``allow_nonfinite`` (then the update's non-finite guard skips them)."""
    prompts, completions = decode_rollout_text(tokenizer, queries, responses, pad_token_id)
    return call_reward_function(reward_fn, prompts, completions, allow_nonfinite=allow_nonfinite)


def _finalize_scores(experience: Experience, scores, *, stop_token_id, missing_eos_penalty):
    scores = jnp.asarray(scores, jnp.float32)
    scores = apply_missing_eos_penalty(scores, experience.responses, stop_token_id, missing_eos_penalty)
    return experience.replace(scores=scores)


_finalize_scores_jit = jax.jit(_finalize_scores, static_argnames=("stop_token_id", "missing_eos_penalty"))


def finalize_scores(experience: Experience, scores, settings: RolloutSettings) -> Experience:
    """Set ``scores`` f32[B] and apply ``missing_eos_penalty`` (SPEC rollout step 8)."""
    if np.shape(scores) != experience.scores.shape:
        raise ValueError(f"scores have shape {np.shape(scores)}; expected {experience.scores.shape} "
                         "(one per prompt).")
    return _finalize_scores_jit(experience, scores, stop_token_id=settings.stop_token_id,
                                missing_eos_penalty=settings.missing_eos_penalty)


# --------------------------------------------------------------------------------------------------
# All together
# --------------------------------------------------------------------------------------------------
def make_experience(queries, key, settings: RolloutSettings, *, policy_graphdef, policy_params, ref_params,
                    ref_graphdef=None, value_graphdef=None, value_params=None, policy_value_head=None,
                    reward_graphdef=None, reward_params=None, reward_fn=None, tokenizer=None,
                    scores=None, allow_nonfinite_scores: bool = False) -> Experience:
    """SPEC rollout steps 1-8 for one batch of left-padded prompts ``queries`` i32[B, P].

    Models are ``nnx.split`` pairs: the policy (``policy_graphdef``/``policy_params``), the frozen reference
    (``ref_params``, same graph as the policy unless ``ref_graphdef``), the values (a separate ScoreModel
    ``value_graphdef``/``value_params``, or ``policy_value_head``), and exactly one score source: a reward
    ScoreModel (``reward_graphdef``/``reward_params``), a Python ``reward_fn(prompts, completions)`` (needs
    ``tokenizer``), or ``scores`` f32[B] given by the caller. A reward function's NaN/inf scores raise
    ``RewardFunctionError`` unless ``allow_nonfinite_scores`` (PPOConfig ``on_nonfinite_reward='skip'``).
    """
    sources = [name for name, given in (("reward model", reward_graphdef is not None),
                                        ("reward_fn", reward_fn is not None),
                                        ("scores", scores is not None)) if given]
    if len(sources) != 1:
        raise ValueError(f"make_experience needs exactly one score source (reward_graphdef/reward_params, "
                         f"reward_fn, or scores); got {sources or 'none'}.")
    if (value_graphdef is None) == (policy_value_head is None):
        raise ValueError("make_experience needs exactly one value source: value_graphdef/value_params "
                         "(a separate value model) or policy_value_head.")
    if reward_fn is not None and tokenizer is None:
        raise ValueError("reward_fn needs `tokenizer` to decode prompts and completions.")
    if settings.missing_eos_penalty is not None and settings.stop_token_id is None:
        raise ValueError("missing_eos_penalty is set but stop_token_id is None: every response would be "
                         "penalised. Set stop_token_id (e.g. the tokenizer's eos_token_id).")

    queries = jnp.asarray(queries, jnp.int32)
    query_responses = sample_responses(policy_graphdef, policy_params, queries, key, settings)
    experience = experience_forwards(
        policy_params, ref_params, value_params, reward_params, query_responses,
        prompt_length=queries.shape[1], settings=settings, policy_graphdef=policy_graphdef,
        ref_graphdef=ref_graphdef, value_graphdef=value_graphdef, reward_graphdef=reward_graphdef,
        policy_value_head=policy_value_head)
    if reward_fn is not None:
        # Needs only the sampled tokens: runs on the host while the forwards above are still computing
        # (the whole buffer is fetched and sliced in numpy, so nothing waits on the forwards).
        responses = _truncate_np(to_host(query_responses)[:, queries.shape[1]:], settings.stop_token_id,
                                 settings.pad_token_id)
        scores = reward_function_scores(reward_fn, tokenizer, to_host(queries), responses,
                                        settings.pad_token_id, allow_nonfinite=allow_nonfinite_scores)
    elif scores is None:
        scores = experience.scores
    return finalize_scores(experience, scores, settings)
