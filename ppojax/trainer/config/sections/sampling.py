"""The sampling section: how the rollout samples responses (length, temperature, top-k/p, stop tokens) and how
its decode loop is laid out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, MUST_MATCH, above, at_least, between, one_of, setting


@dataclass
class SamplingSettings:
    """The rollout's sampling."""

    response_length: int = setting(53, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Tokens sampled per prompt (responses are padded after the stop token to this length)."""
    temperature: float = setting(0.7, static=True, on_resume=MAY_CHANGE, rule=above(0, fix=(
        "Fix: PPO learns from sampled responses, so it needs a sampling temperature > 0; for near-greedy "
        "sampling use a small one such as 0.01 (the default is 0.7).")))
    """Sampling temperature (> 0: PPO needs sampled responses; near-greedy: e.g. 0.01)."""
    top_k: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Sample only among the k most likely tokens (0: off)."""
    top_p: float = setting(1.0, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_low=True))
    """Nucleus sampling: the smallest token set holding this probability (1.0: off)."""
    stop_token: Optional[str] = setting(None, static=True, on_resume=MAY_CHANGE, rule=one_of(
        "eos", fix="Fix: write stop_token: eos to stop at the tokenizer's eos token, or set stop_token_id."))
    """'eos': stop at the tokenizer's eos token; None: no stop token unless stop_token_id is set."""
    stop_token_id: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Token id that ends a response (instead of stop_token; must be in the vocabulary, not the pad id)."""
    rollout_slots: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """0: the rollout decodes all rows together until the longest response is done. S >= 1 (at most the
    batch_size): continuous batching, S sequences decoded at a time, each finished one replaced by the next
    waiting prompt, so the decode work follows the sum of the response lengths instead of batch x the longest.
    Same tokens for the same seed; pays when a few responses run much longer than most (docs/algorithm.md). On a
    mesh each data-parallel shard has ceil(S / shards) slots of its own, refilled from its own rows. In an
    agent run: the KV cache's rows, each playing one episode at a time and taking the next waiting one when its
    episode ends (docs/agents.md)."""
    decode_segments: int = setting(4, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """The decode loop as this many loops of about equal steps, each one's attention reading only the KV-cache
    slots filled by its end (prompt + tokens so far) instead of all prompt + response_length. Same tokens; each
    segment is one more compiled loop body (none where a cut would save fewer than 128 slots a step). 1: one loop
    over the whole cache. Not used with rollout_slots by single responses; an agent run's episodes cut their loop
    over every row alike (docs/agents.md)."""
    kv_cache_dtype: str = setting("auto", static=True, on_resume=MAY_CHANGE, rule=one_of(
        "auto", "int8", fix="Fix: 'auto' keeps the keys and values in the policy's compute dtype (bfloat16 under "
        "precision bfloat16 or mixed); 'int8' stores 8-bit codes with their scales."))
    """How the rollout's KV cache stores keys and values: 'auto' (the policy's compute dtype: bfloat16 under
    precision 'bfloat16' or 'mixed', float32 otherwise) or 'int8' (8-bit codes and a float32 scale per 16 channels
    of each token's kv head: 5/8 of a bfloat16 cache at head_dim 64; the sampled tokens' log-probs move about 3x as
    much as a bfloat16 cache moves them, docs/performance.md)."""
