"""The trainable pair PPO updates: a policy and a value function, as graphdefs plus a parameter pytree.

Two layouts (``value_head`` in the config):
- 'separate' (TRL): the value function is a ScoreModel of its own (backbone + ``score`` head), usually
  initialised from the reward model. Trainable params: ``{"policy": ..., "value": ...}``.
- 'policy' (legacy ``AutoModelForCausalLMWithValueHead``): the policy is a ``CausalLMWithValueHead`` whose
  ``value(hidden)`` head reads the policy's own final hidden states (one backbone pass gives log-probs and
  values). Trainable params: ``{"policy": ...}``.

:class:`ActorCritic` is static (hashable) so it can be a static argument of ``jax.jit``; the parameters
always travel separately, as explicit inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from . import forward


@dataclass(frozen=True)
class ActorCritic:
    """Static description of how to evaluate the policy and value on a rollout.

    policy_graphdef: graphdef of a ``CausalLM``; value_graphdef: graphdef of a ``ScoreModel``, or None
    when the policy is a ``CausalLMWithValueHead``. logits_chunk_size bounds the [B, chunk, V] logits held at once.
    """

    policy_graphdef: Any
    value_graphdef: Optional[Any]
    pad_token_id: int
    temperature: float
    logits_chunk_size: Optional[int] = None

    @property
    def has_value_head(self) -> bool:
        return self.value_graphdef is None

    def policy(self, params):
        """The merged policy module (call inside jit)."""
        return nnx.merge(self.policy_graphdef, params["policy"])

    def evaluate(self, params, query_responses, prompt_length, with_entropy=True):
        """Fresh log-probs, entropy and values of a rollout's responses, unmasked.

        query_responses: i32[B, P+R] -> (logprobs f32[B, R], entropy f32[B, R] or None, values f32[B, R]).
        """
        policy = self.policy(params)
        hidden = forward.response_hidden(policy, query_responses, prompt_length, self.pad_token_id)
        tokens = query_responses[:, prompt_length:]
        logprobs, entropy = forward.logprobs_from_hidden(
            policy, hidden, tokens, self.temperature, chunk_size=self.logits_chunk_size,
            with_entropy=with_entropy)
        if self.has_value_head:
            values = policy.value(hidden).astype(jnp.float32)
        else:
            value_model = nnx.merge(self.value_graphdef, params["value"])
            values = forward.response_values(value_model, query_responses, prompt_length, self.pad_token_id)
        return logprobs, entropy, values

    def values(self, params, query_responses, prompt_length):
        """Values alone (the rollout needs no policy log-probs from a separate value model). f32[B, R]."""
        if self.has_value_head:
            policy = self.policy(params)
            hidden = forward.response_hidden(policy, query_responses, prompt_length, self.pad_token_id)
            return policy.value(hidden).astype(jnp.float32)
        value_model = nnx.merge(self.value_graphdef, params["value"])
        return forward.response_values(value_model, query_responses, prompt_length, self.pad_token_id)
