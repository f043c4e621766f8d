"""GPT-2 (transformers 5's `modeling_gpt2.py`): LayerNorm blocks, learned absolute positions, GELU MLP, `Conv1D`
weights stored [in, out], and q|k|v fused in one `c_attn` tensor."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppojax.models.families.hf_config import HFConfig, vocab_and_tokens, vocab_and_tokens_to_hf
from ppojax.models.families.keys import Key, Split, Unflatten
from ppojax.models.families.registry import Family, register_family, transformers_classes

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig


def config_from_hf(c: HFConfig) -> dict[str, Any]:
    # Checked, not translated: their default is the only behaviour ppojax has (they stay in `extra`).
    if c.peek("add_cross_attention", False):
        raise c.unsupported("add_cross_attention", True, "decoder-only GPT-2 (add_cross_attention=false)")
    if not c.peek("scale_attn_weights", True):
        raise c.unsupported("scale_attn_weights", False, "scores scaled by 1/sqrt(head_dim) "
                                                         "(scale_attn_weights=true)")
    # `reorder_and_upcast_attn` only upcasts the scores to float32, which ppojax always does.
    hidden = c.size("n_embd", "hidden_size")
    heads = c.size("n_head", "num_attention_heads")
    if hidden % heads:
        raise c.error("n_embd", hidden, f"expected a multiple of n_head ({heads})")
    return dict(
        **vocab_and_tokens(c, tie=True, bos=50256, eos=50256),
        hidden_size=hidden, num_layers=c.size("n_layer", "num_hidden_layers"),
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        intermediate_size=c.optional_size("n_inner", None) or 4 * hidden,
        max_position_embeddings=c.size("n_positions", "max_position_embeddings", default=1024),
        norm_type="layer", norm_eps=c.number("layer_norm_epsilon", 1e-5),
        activation=c.activation("activation_function", "gelu_new"), gated_mlp=False, mlp_bias=True,
        qkv_bias=True, out_bias=True, qk_norm=False,
        attn_scale_by_inverse_layer_idx=c.flag("scale_attn_by_inverse_layer_idx", False),
        position_embedding="learned", parallel_residual=False,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return dict(
        n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
        n_positions=cfg.max_position_embeddings, activation_function=cfg.activation,
        layer_norm_epsilon=cfg.norm_eps, scale_attn_by_inverse_layer_idx=cfg.attn_scale_by_inverse_layer_idx,
        **vocab_and_tokens_to_hf(cfg),
    )


def backbone_keys(cfg: ModelConfig) -> list[Key]:
    V, P, D, H, hd, F = (cfg.vocab_size, cfg.max_position_embeddings, cfg.hidden_size, cfg.num_heads, cfg.head_dim,
                         cfg.intermediate_size)
    L, A, M = "{prefix}h.{i}.", ("layers", "attn"), ("layers", "mlp")
    keys = [
        Key("{prefix}wte.weight", (V, D), ("embed", "embedding")),
        Key("{prefix}wpe.weight", (P, D), ("pos_embed", "embedding")),
        Key("{prefix}ln_f.weight", (D,), ("final_norm", "scale")),
        Key("{prefix}ln_f.bias", (D,), ("final_norm", "bias")),
    ]
    for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
        keys += [Key(L + f"{theirs}.weight", (D,), ("layers", ours, "scale")),
                 Key(L + f"{theirs}.bias", (D,), ("layers", ours, "bias"))]
    # c_attn.weight [D, 3D] (Conv1D: in, out): output columns are q | k | v, each (H, hd)
    for j, part in enumerate("qkv"):
        keys += [Key(L + "attn.c_attn.weight", (D, 3 * D), A + (part, "kernel"),
                     (Split(1, (D, D, D), j), Unflatten(1, (H, hd)))),
                 Key(L + "attn.c_attn.bias", (3 * D,), A + (part, "bias"),
                     (Split(0, (D, D, D), j), Unflatten(0, (H, hd))))]
    keys += [
        Key(L + "attn.c_proj.weight", (D, D), A + ("o", "kernel"), (Unflatten(0, (H, hd)),)),
        Key(L + "attn.c_proj.bias", (D,), A + ("o", "bias")),
        Key(L + "mlp.c_fc.weight", (D, F), M + ("up", "kernel")),
        Key(L + "mlp.c_fc.bias", (F,), M + ("up", "bias")),
        Key(L + "mlp.c_proj.weight", (F, D), M + ("down", "kernel")),
        Key(L + "mlp.c_proj.bias", (D,), M + ("down", "bias")),
    ]
    return keys


GPT2 = Family(
    name="gpt2",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    backbone_keys=backbone_keys,
    backbone_prefix="transformer",
    lm_head="lm_head.weight",
    architectures={"gpt2": {**transformers_classes("GPT2"), "causal_lm": "GPT2LMHeadModel"}},
    ignored_tensors=(".attn.bias", ".attn.masked_bias"),
)
register_family(("gpt2",), GPT2)
