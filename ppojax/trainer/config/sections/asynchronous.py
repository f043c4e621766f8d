"""The asynchronous section: how far the policy that sampled a batch may lag behind the one that learns from it
(docs/async.md; ``ppojax.rl.pipeline``).

TRL's AsyncGRPOTrainer and AReaL call the bound ``max_staleness``. Pair it with a correction from the off-policy
section (``use_decoupled_loss``, or ``vllm_importance_sampling_correction``): without one, the clipped ratio is
taken against the stale sampler's own log-probs, which is plain PPO on stale data.
"""
from __future__ import annotations

from dataclasses import dataclass

from ppojax.trainer.config.fields import MAY_CHANGE, MUST_MATCH, at_least, setting


@dataclass
class AsyncSettings:
    """Asynchronous RL: the rollout runs ahead of the update by a bounded number of policy versions."""

    max_staleness: int = setting(0, static=True, on_resume=MUST_MATCH, rule=at_least(0))
    """Each update learns from the batch sampled max_staleness updates earlier (TRL's and AReaL's name): the run
    keeps that many sampled, scored batches in flight (in the train state, so checkpoints carry them), filled by
    sampling the first max_staleness batches with the initial policy before update 1. 0: synchronous (each update
    learns from its own samples). Needs behaviour_logprobs: sampler (the behaviour policy's log-probs are the
    sampler's, kept with the batch); single-turn runs without filter_groups."""
    rollout_devices: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """With max_staleness >= 1: the devices that sample (the first ones of the host); the others train, on the
    mesh the mesh_* fields describe. The rollout and the update of an iteration then run at the same time on their
    own devices, the policy copied device to device after each update. 0: every device samples and trains, in
    one program. A checkpoint is the same either way (resuming may change this). One process only."""
    in_flight_weight_updates: bool = setting(False, static=True, on_resume=MUST_MATCH)
    """With max_staleness = k >= 1 (PipelineRL's in-flight weight updates): each batch's decode is spread over
    k + 1 updates, a chunk of about (response_length - 1) / (k + 1) decode steps per update, each chunk sampled by
    that update's policy on the KV cache the earlier chunks left (not recomputed). The batch is learned by the
    update that decodes its last chunk, so its newest tokens are on-policy and its oldest k versions behind
    (each token's version is recorded). The decode states in flight live in the train state. With rollout_slots
    the chunks are cut by sequences done (chunk j ends when (j + 1) / (k + 1) of the batch's are). Not with
    rollout_devices."""
