"""GPT-NeoX / Pythia (transformers 5's `modeling_gpt_neox.py`): LayerNorm blocks, parallel residual, partial RoPE
(`rotary_pct` of head_dim), GELU MLP, and q|k|v fused in `query_key_value` with rows ordered (head, q|k|v, hd)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppojax.models.families.hf_config import HFConfig, rope_parameters, vocab_and_tokens, vocab_and_tokens_to_hf
from ppojax.models.families.keys import Key, Split, T, Unflatten
from ppojax.models.families.registry import Family, register_family, transformers_classes

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig


def config_from_hf(c: HFConfig) -> dict[str, Any]:
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    if hidden % heads:
        raise c.error("hidden_size", hidden, f"expected a multiple of num_attention_heads ({heads})")
    # transformers' attention uses hidden_size // num_attention_heads; only its RoPE reads `head_dim`
    if c.peek("head_dim") not in (None, hidden // heads):
        raise c.unsupported("head_dim", c.peek("head_dim"), f"hidden_size // num_attention_heads "
                                                            f"({hidden // heads})")
    max_positions = c.size("max_position_embeddings", default=2048)
    # GPTNeoXConfig.convert_rope_params_to_dict: `rotary_emb_base` and `rotary_pct` are the fallbacks of the rope
    # dict's rope_theta and partial_rotary_factor (a top-level rope_theta / partial_rotary_factor is not read).
    rope = rope_parameters(c, theta=c.number("rotary_emb_base", 10000.0), partial=c.number("rotary_pct", 0.25),
                           max_position_embeddings=max_positions)
    theta, partial = float(rope.pop("rope_theta")), float(rope.pop("partial_rotary_factor"))
    bias = c.flag("attention_bias", True)
    return dict(
        **vocab_and_tokens(c, tie=False, bos=0, eos=2),
        hidden_size=hidden, num_layers=c.size("num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=c.size("intermediate_size"),
        max_position_embeddings=max_positions, norm_type="layer", norm_eps=c.number("layer_norm_eps", 1e-5),
        activation=c.activation("hidden_act", "gelu"), gated_mlp=False, mlp_bias=True, qkv_bias=bias, out_bias=bias,
        qk_norm=False, position_embedding="rope", rope_theta=theta,
        rope_scaling=rope if rope["rope_type"] != "default" else None, partial_rotary_factor=partial,
        parallel_residual=c.flag("use_parallel_residual", True),
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rope = {"rope_type": "default", **cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": cfg.partial_rotary_factor}
    return dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        hidden_act=cfg.activation, layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_residual,
        attention_bias=cfg.qkv_bias, rope_parameters=rope, rotary_pct=cfg.partial_rotary_factor,
        rotary_emb_base=cfg.rope_theta, **vocab_and_tokens_to_hf(cfg),
    )


def backbone_keys(cfg: ModelConfig) -> list[Key]:
    V, D, H, hd, F = cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    L, A, M = "{prefix}layers.{i}.", ("layers", "attn"), ("layers", "mlp")
    keys = [
        Key("{prefix}embed_in.weight", (V, D), ("embed", "embedding")),
        Key("{prefix}final_layer_norm.weight", (D,), ("final_norm", "scale")),
        Key("{prefix}final_layer_norm.bias", (D,), ("final_norm", "bias")),
    ]
    for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
        keys += [Key(L + f"{theirs}.weight", (D,), ("layers", ours, "scale")),
                 Key(L + f"{theirs}.bias", (D,), ("layers", ours, "bias"))]
    # query_key_value.weight [3D, D] (nn.Linear: out, in): output rows are (head, q|k|v, hd), so the parts
    # interleave: split the heads out first, then take q, k or v of each head
    qkv, parts = L + "attention.query_key_value.", (hd, hd, hd)
    for j, part in enumerate("qkv"):
        keys.append(Key(qkv + "weight", (3 * D, D), A + (part, "kernel"),
                        (Unflatten(0, (H, 3 * hd)), Split(1, parts, j), T((2, 0, 1)))))
        if cfg.qkv_bias:
            keys.append(Key(qkv + "bias", (3 * D,), A + (part, "bias"),
                            (Unflatten(0, (H, 3 * hd)), Split(1, parts, j))))
    keys += [
        Key(L + "attention.dense.weight", (D, D), A + ("o", "kernel"), (T(), Unflatten(0, (H, hd)))),
        Key(L + "mlp.dense_h_to_4h.weight", (F, D), M + ("up", "kernel"), (T(),)),
        Key(L + "mlp.dense_h_to_4h.bias", (F,), M + ("up", "bias")),
        Key(L + "mlp.dense_4h_to_h.weight", (D, F), M + ("down", "kernel"), (T(),)),
        Key(L + "mlp.dense_4h_to_h.bias", (D,), M + ("down", "bias")),
    ]
    if cfg.out_bias:
        keys.append(Key(L + "attention.dense.bias", (D,), A + ("o", "bias")))
    return keys


GPT_NEOX = Family(
    name="gpt_neox",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    backbone_keys=backbone_keys,
    backbone_prefix="gpt_neox",
    lm_head="embed_out.weight",
    architectures={"gpt_neox": transformers_classes("GPTNeoX")},
    ignored_tensors=(".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"),
)
register_family(("gpt_neox",), GPT_NEOX)
