"""Model FLOPs of a decoder-only LM's forwards, generation and one PPO update, counted from the model's shapes
(``ModelConfig``). Pure functions of (model dims, B, P, R, epochs); no framework imports. ``ppojax plan`` prints
this count beside XLA's own; divided by measured time and a peak rate, it gives MFU.

Here, beside ``ModelConfig``, because the count is of the models' shapes: the PPO update below is those forwards
times a fixed layout (policy, reference, value and reward models), with nothing of the RL code in it.

Conventions (the usual "model FLOPs" of MFU, e.g. PaLM appendix B, counted exactly rather than as 6N):
- a matmul of [m, k] x [k, n] is 2·m·k·n FLOPs; the MLP is gated (3 matrices, Llama family) or not (2: GPT-2,
  GPT-NeoX); biases, norms, RoPE, softmax, sampling and the optimizer are not counted;
- attention is causal: a query at position i (0-based) attends to i + 1 keys, costing 4·heads·head_dim·(i+1)
  per layer (QKᵀ and AV); left padding is counted (it is computed: shapes are static);
- heads are counted where their output is USED: the LM head on the R positions that score the response
  (``lm_head_positions="response"``; ``"all"`` counts every position, as an implementation computing full
  logits does), the scalar score head (Linear(hidden, 1)) on every position;
- backward = 2 × forward, so a trained forward costs 3× (``train_multiplier``);
- generation with a KV cache: a prefill of P tokens (LM head on its last position), then R-1 decode steps of
  one token each, the step producing token t attending to P + t keys.

One PPO update (docs/algorithm.md, TRL's layout with a separate reward and value model):
- rollout = B × [generation + reference forward (LM head) + value forward + reward forward];
- update  = epochs × B × 3 × [policy forward (LM head) + value forward]  (all mini-batches together cover B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: this module imports nothing at run time
    from ppojax.models.config import ModelConfig


@dataclass(frozen=True)
class Dims:
    """The shapes that set a decoder LM's FLOPs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True

    @classmethod
    def from_model_config(cls, cfg: "ModelConfig") -> "Dims":
        """From a ``ModelConfig`` (any family ppojax loads)."""
        return cls(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                   head_dim=cfg.head_dim, mlp=cfg.intermediate_size, vocab=cfg.vocab_size,
                   tied_embeddings=cfg.tie_word_embeddings, gated_mlp=cfg.gated_mlp)

    @classmethod
    def from_config(cls, cfg: dict) -> "Dims":
        """From HF ``LlamaConfig``-style keys (a Llama ``config.json``, or a dict of its keys)."""
        heads = cfg["num_attention_heads"]
        return cls(
            layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            mlp=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


def layer_matmul_params(d: Dims) -> int:
    """Weights of one block that every token multiplies: q, k, v, o projections and the MLP (gate, up, down; or
    up, down)."""
    q = d.hidden * d.heads * d.head_dim
    kv = 2 * d.hidden * d.kv_heads * d.head_dim
    o = d.heads * d.head_dim * d.hidden
    mlp = (3 if d.gated_mlp else 2) * d.hidden * d.mlp
    return q + kv + o + mlp


def param_count(d: Dims) -> int:
    """All parameters of the causal LM (embeddings once if tied; RMSNorm weights included)."""
    emb = d.vocab * d.hidden
    head = 0 if d.tied_embeddings else d.vocab * d.hidden
    return emb + head + d.layers * (layer_matmul_params(d) + 2 * d.hidden) + d.hidden


def attention(d: Dims, keys: int) -> int:
    """Attention FLOPs of one query over ``keys`` keys, all layers (QKᵀ and AV)."""
    return 4 * d.layers * d.heads * d.head_dim * keys


def backbone_forward(d: Dims, seq_len: int, past: int = 0) -> int:
    """Forward FLOPs of ``seq_len`` tokens through all blocks (no head), after ``past`` cached tokens.
    Query j (0-based within the chunk) attends to past + j + 1 keys."""
    matmul = 2 * layer_matmul_params(d) * d.layers * seq_len
    keys = seq_len * past + seq_len * (seq_len + 1) // 2
    return matmul + attention(d, 1) * keys


def lm_head(d: Dims, positions: int) -> int:
    return 2 * d.hidden * d.vocab * positions


def score_head(d: Dims, positions: int) -> int:
    return 2 * d.hidden * positions


def sequence_forward(d: Dims, seq_len: int, head: str, head_positions: int) -> int:
    """One full forward over a sequence: blocks + ``head`` ("lm" or "score") on ``head_positions``."""
    h = lm_head(d, head_positions) if head == "lm" else score_head(d, head_positions)
    return backbone_forward(d, seq_len) + h


def generation(d: Dims, prompt_length: int, response_length: int) -> int:
    """Sampling ``response_length`` tokens after a ``prompt_length`` prompt, one sequence, with a KV cache."""
    P, R = prompt_length, response_length
    flops = backbone_forward(d, P) + lm_head(d, 1)
    for t in range(1, R):  # the step that produces token t feeds token t-1 (position P + t - 1)
        flops += backbone_forward(d, 1, past=P + t - 1) + lm_head(d, 1)
    return flops


def ppo_update_flops(
    policy: Dims | dict,
    batch_size: int,
    prompt_length: int,
    response_length: int,
    num_ppo_epochs: int,
    value: Dims | dict | None = None,
    reward: Dims | dict | None = None,
    lm_head_positions: str = "response",
    train_multiplier: int = 3,
) -> dict:
    """FLOPs of one PPO update (rollout + optimisation), as a dict of totals and per-part counts.

    ``value`` and ``reward`` default to the policy's dims (the benchmark's "same backbone + score head").
    Keys: ``rollout`` (its parts ``generation``, ``ref_forward``, ``value_forward``, ``reward_forward``),
    ``update``, ``total``, ``per_episode``, and the inputs.
    """
    pd = policy if isinstance(policy, Dims) else Dims.from_config(policy)
    vd = pd if value is None else (value if isinstance(value, Dims) else Dims.from_config(value))
    rd = vd if reward is None else (reward if isinstance(reward, Dims) else Dims.from_config(reward))
    if lm_head_positions not in ("response", "all"):
        raise ValueError(f"lm_head_positions={lm_head_positions!r}: expected 'response' or 'all'")
    B, P, R, E = batch_size, prompt_length, response_length, num_ppo_epochs
    S = P + R
    head_pos = R if lm_head_positions == "response" else S

    gen = B * generation(pd, P, R)
    ref = B * sequence_forward(pd, S, "lm", head_pos)
    val = B * sequence_forward(vd, S, "score", S)
    rew = B * sequence_forward(rd, S, "score", S)
    rollout = gen + ref + val + rew
    policy_fwd = sequence_forward(pd, S, "lm", head_pos)
    value_fwd = sequence_forward(vd, S, "score", S)
    update = E * B * train_multiplier * (policy_fwd + value_fwd)
    return {
        "rollout": rollout,
        "generation": gen,
        "ref_forward": ref,
        "value_forward": val,
        "reward_forward": rew,
        "update": update,
        "total": rollout + update,
        "per_episode": (rollout + update) / B,
        "policy_params": param_count(pd),
        "inputs": dict(batch_size=B, prompt_length=P, response_length=R, num_ppo_epochs=E,
                       lm_head_positions=lm_head_positions, train_multiplier=train_multiplier,
                       policy=asdict(pd)),
    }
