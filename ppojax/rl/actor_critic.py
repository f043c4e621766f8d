"""The one owner of the model forwards PPO needs: policy and reference log-probs, values, full-vocabulary KL.

Both the rollout (behaviour and reference log-probs, values) and the loss (fresh log-probs, entropy, values)
call :class:`ActorCritic`, so the two always compute the same quantities the same way.

Value layouts (``value_head`` in the config):
- 'separate' (TRL): the value function is a ScoreModel of its own (backbone + ``score`` head), usually
  initialised from the reward model. Trainable params: ``{"policy": ..., "value": ...}``.
- 'policy' (legacy ``AutoModelForCausalLMWithValueHead``): the policy is a ``CausalLMWithValueHead`` whose
  ``value(hidden)`` head reads the policy's own final hidden states (one backbone pass gives log-probs and
  values). Trainable params: ``{"policy": ...}``.
- no critic (``has_critic=False``: the critic-free advantage estimators grpo, rloo, reinforce_pp): no value
  function at all; values are zeros and nothing computes them. Trainable params: ``{"policy": ...}``.

:class:`ActorCritic` is static (hashable): a ``jax.jit`` static argument; parameters always travel
separately, as explicit inputs. Every method is pure; call it inside ``jit``.

LoRA (``lora_r`` > 0, ``ppojax.models.lora``): the trainable ``params["policy"]`` hold ONLY the adapters and the
frozen base weights are ``frozen["base"]``. The policy is ``base + adapters`` (``policy_graphdef`` has the
adapters), the reference is ``base`` alone under ``base_graphdef`` (the adapters off: no copy of the policy), and
the sampler reads the adapters merged into the base kernels once per call (:meth:`sampling_policy`). The optimizer,
the update and the checkpoints see ``params`` and so work on the adapters only, with no special case.

Frozen models (``state.frozen``): ``"ref"`` (a copy of the initial policy, the caller's reference model, or None
under LoRA), ``"base"`` (LoRA only), ``"reward"`` (the reward model, or None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from ppojax.models.kernels import XLA, Kernels
from ppojax.models.lora import heads, merge_lora
from ppojax.rl import forward


@dataclass(frozen=True)
class ActorCritic:
    """policy_graphdef: graphdef of a ``CausalLM`` (a ``CausalLMWithValueHead`` when value_graphdef is
    None); value_graphdef: graphdef of a ``ScoreModel`` or None; ref_graphdef: graphdef of the frozen
    reference (None: the policy's). temperature: the sampling temperature the log-probs are taken at.
    has_critic: False for the critic-free estimators (then value_graphdef is None and there is no head).
    base_graphdef, lora_scale: under LoRA, the graphdef of the policy WITHOUT adapters (its weights are
    ``frozen["base"]``) and the adapters' alpha / r; None otherwise. kernels: the backend's operations the models
    were built with (``ppojax.models.kernels``), for the update's own reductions (``Kernels.all_finite``)."""

    policy_graphdef: Any
    value_graphdef: Optional[Any]
    pad_token_id: int
    temperature: float
    ref_graphdef: Optional[Any] = None
    has_critic: bool = True
    base_graphdef: Optional[Any] = None
    lora_scale: Optional[float] = None
    kernels: Kernels = XLA

    @property
    def has_value_head(self) -> bool:
        return self.has_critic and self.value_graphdef is None

    def owner(self, path) -> Optional[str]:
        """Whose a pytree path into the trainable params (or an optimizer state mirroring them) is: 'critic'
        (under ``"value"``, a separate value model, or the policy's ``"v_head"``), 'policy', or None (a leaf
        of neither, e.g. Adam's step count)."""
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][:2]
        if keys[:1] == ["value"] or keys == ["policy", "v_head"]:
            return "critic"
        return "policy" if keys[:1] == ["policy"] else None

    @property
    def lora(self) -> bool:
        return self.base_graphdef is not None

    def policy(self, params, frozen=None):
        """The policy module: ``params["policy"]``, or under LoRA ``frozen["base"]`` + the adapters."""
        if self.lora:
            return nnx.merge(self.policy_graphdef, frozen["base"], params["policy"])
        return nnx.merge(self.policy_graphdef, params["policy"])

    def reference(self, frozen, params=None):
        """The reference module: ``frozen["ref"]``, or under LoRA without one the base weights (adapters off;
        a legacy value head, which the reference never reads, comes from ``params`` to complete the graph)."""
        if frozen.get("ref") is not None:
            return nnx.merge(self.ref_graphdef or self.policy_graphdef, frozen["ref"])
        return nnx.merge(self.base_graphdef, frozen["base"], heads(params["policy"]))

    def sampling_policy(self, params, frozen):
        """(graphdef, weights) the sampler and the export read: the policy itself, or under LoRA the base graph
        with the adapters merged into its kernels (``W + scale * A @ B``: the decode loop then runs plain
        projections; the log-probs PPO uses still come from :meth:`evaluate` / :meth:`rollout_forwards`)."""
        if not self.lora:
            return self.policy_graphdef, params["policy"]
        return self.base_graphdef, merge_lora(frozen["base"], params["policy"], self.lora_scale)

    def _values_at(self, policy, hidden, params, layout):
        """Values at ``layout``'s read positions f32[b, T]: zeros without a critic, the policy's head on its
        ``hidden`` states, or the separate value model's own forward."""
        if not self.has_critic:
            return jnp.zeros(hidden.shape[:2], jnp.float32)
        if self.has_value_head:
            return policy.value(hidden).astype(jnp.float32)
        return layout.scores(nnx.merge(self.value_graphdef, params["value"]))

    # ---- the loss ----
    def evaluate(self, params, query_responses, prompt_length, *, frozen=None, logits_chunk_size=None,
                 with_entropy=True, prompt_group=1, prompt_prefix=0):
        """Fresh log-probs, entropy and values of a rollout's responses, unmasked (``frozen``: the state's
        frozen models; needed under LoRA, where the policy's base weights live there). prompt_group: G > 1 when
        rows ``[kG, (k+1)G)`` share a prompt, which the policy's forward then runs once (``forward.row_layout``);
        prompt_prefix: q > 0 when every prompt starts with the same q real tokens, run once for all.

        query_responses: i32[B, P+R] -> (logprobs f32[B, R], entropy f32[B, R] or None, values f32[B, R]).
        """
        layout = forward.row_layout(query_responses, prompt_length, self.pad_token_id, prompt_group, prompt_prefix)
        return self.evaluate_layout(params, layout, frozen=frozen, logits_chunk_size=logits_chunk_size,
                                    with_entropy=with_entropy)

    def evaluate_layout(self, params, layout, *, frozen=None, logits_chunk_size=None, with_entropy=True):
        """:meth:`evaluate` at the read positions of a ``forward.Layout`` (padded rows, or packed ones
        [N, S] from ``ppojax.rl.packing.packed_layout``, whose outputs ``packing.unpack_responses`` puts back in
        the padded response layout). -> (logprobs, entropy or None, values), f32[b, T] each."""
        policy = self.policy(params, frozen)
        hidden = layout.hidden(policy)
        logprobs, entropy = forward.logprobs_from_hidden(policy, hidden, layout.tokens, self.temperature,
                                                         chunk_size=logits_chunk_size, with_entropy=with_entropy)
        return logprobs, entropy, self._values_at(policy, hidden, params, layout)

    # ---- the rollout ----
    def rollout_forwards(self, params, frozen, query_responses, prompt_length, *, logits_chunk_size=None,
                         forward_batch_size=None, with_full_kl=False, behaviour_logprobs=None, prompt_group=1,
                         prompt_prefix=0):
        """Behaviour and reference log-probs, values and (optionally) the full-vocabulary KL, unmasked.

        frozen: the state's frozen models (the reference, and the base weights under LoRA).
        query_responses: i32[B, P+R]. Rows go through the models ``forward_batch_size`` at a time
        (TRL's ``local_rollout_forward_batch_size``; None = all at once).
        behaviour_logprobs: f32[B, R] already known (the sampler's): returned as the log-probs; the policy
        forward then runs only when the value head or the full KL needs its hidden states.
        prompt_group, prompt_prefix: as :meth:`evaluate` (``forward_batch_size`` then a multiple of the group).
        Returns (logprobs, ref_logprobs, values, full_kl or None), each f32[B, R].
        """
        def outputs(qr):
            layout = forward.row_layout(qr, prompt_length, self.pad_token_id, prompt_group, prompt_prefix)
            return self.rollout_outputs(params, frozen, layout, logits_chunk_size=logits_chunk_size,
                                        with_full_kl=with_full_kl,
                                        with_logprobs=behaviour_logprobs is None)

        logprobs, ref_logprobs, values, full_kl = forward.map_batch(outputs, forward_batch_size, query_responses)
        if behaviour_logprobs is not None:
            logprobs = behaviour_logprobs.astype(jnp.float32)
        return logprobs, ref_logprobs, values, full_kl

    def rollout_outputs(self, params, frozen, layout, *, logits_chunk_size=None, with_full_kl=False,
                        with_logprobs=True):
        """The rollout's forwards at a ``forward.Layout``'s read positions: (logprobs or None without
        ``with_logprobs``, ref_logprobs, values, full_kl or None), f32[b, T] each, unmasked. The policy's forward
        runs only when the log-probs, the value head or the full KL need it."""
        policy, ref = self.policy(params, frozen), self.reference(frozen, params)
        ref_hidden = layout.hidden(ref)
        ref_logprobs, _ = forward.logprobs_from_hidden(ref, ref_hidden, layout.tokens, self.temperature,
                                                       chunk_size=logits_chunk_size)
        logprobs = values = full_kl = None
        if with_logprobs or self.has_value_head or with_full_kl:
            hidden = layout.hidden(policy)
            if with_logprobs:
                logprobs, _ = forward.logprobs_from_hidden(policy, hidden, layout.tokens, self.temperature,
                                                           chunk_size=logits_chunk_size)
            if with_full_kl:
                full_kl = forward.full_kl_from_hidden(policy, hidden, ref, ref_hidden, self.temperature,
                                                      chunk_size=logits_chunk_size)
            if self.has_value_head:
                values = policy.value(hidden).astype(jnp.float32)
        if values is None:
            values = (layout.scores(nnx.merge(self.value_graphdef, params["value"])) if self.has_critic
                      else jnp.zeros_like(ref_logprobs))
        return logprobs, ref_logprobs, values, full_kl


def sampling_weights(actor_critic: ActorCritic, params, frozen):
    """:meth:`ActorCritic.sampling_policy`'s weights outside a program (samples, evaluation, export): compiled
    once, so the LoRA merge is one program rather than op by op."""
    if not actor_critic.lora:
        return params["policy"]
    return _sampling_weights_jit(actor_critic, params, frozen)


_sampling_weights_jit = jax.jit(lambda ac, params, frozen: ac.sampling_policy(params, frozen)[1], static_argnums=0)
