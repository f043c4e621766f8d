"""The Llama family: llama, mistral, qwen2, qwen3 (transformers 5's `modeling_{llama,mistral,qwen2,qwen3}.py`).

Pre-norm RMSNorm blocks, gated SiLU MLP, RoPE, grouped-query attention. What differs per model type:
- llama:   `attention_bias` on q, k, v and o; `mlp_bias`.
- mistral: no biases; a sliding window on every layer, or per layer when `layer_types` is given (transformers then
           loads the checkpoint as Ministral, which reads `layer_types`).
- qwen2:   biases on q, k, v (not o); a sliding window only with `use_sliding_window`, on the layers `layer_types`
           names (default: from `max_window_layers` on).
- qwen3:   as qwen2 but `attention_bias` on q, k, v and o, RMSNorm on q and k per head, head_dim 128 by default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppojax.models.families.hf_config import (HFConfig, attention_layer_types, rope_parameters, vocab_and_tokens,
                        vocab_and_tokens_to_hf)
from ppojax.models.families.keys import Key, T, Unflatten
from ppojax.models.families.registry import Family, register_family, transformers_classes

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# transformers 5's defaults (configuration_<type>.py) for the keys whose default differs per model type.
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, num_key_value_heads=None, head_dim=None, bos=1, eos=2),
    "mistral": dict(max_position_embeddings=4096 * 32, num_key_value_heads=8, head_dim=None, bos=1, eos=2),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=None, bos=None, eos=None),
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=128, bos=None, eos=None),
}


def config_from_hf(c: HFConfig) -> dict[str, Any]:
    mt = c.model_type
    defaults = _DEFAULTS[mt]
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    n_layers = c.size("num_hidden_layers")
    kv_heads = c.optional_size("num_key_value_heads", defaults["num_key_value_heads"]) or heads
    head_dim = c.optional_size("head_dim", defaults["head_dim"]) or hidden // heads
    max_positions = c.size("max_position_embeddings", default=defaults["max_position_embeddings"])

    rope = rope_parameters(c, theta=c.number("rope_theta", 10000.0), partial=c.get("partial_rotary_factor"),
                           max_position_embeddings=max_positions)
    theta = float(rope.pop("rope_theta"))
    partial = rope.pop("partial_rotary_factor", 1.0)
    # transformers' default RoPE of these models rotates the whole head_dim whatever partial_rotary_factor says;
    # its scaled variants honour the factor and then fail on the shapes, so refuse rather than guess.
    if rope["rope_type"] != "default" and partial != 1.0:
        raise c.unsupported("partial_rotary_factor", partial, f"1.0 with rope_type {rope['rope_type']!r}")

    sliding_window, layer_types = _attention_windows(c, n_layers)

    if mt == "qwen2":
        qkv_bias, out_bias = True, False
    elif mt == "mistral":
        qkv_bias = out_bias = False
    else:
        qkv_bias = out_bias = c.flag("attention_bias", False)
    return dict(
        **vocab_and_tokens(c, tie=False, bos=defaults["bos"], eos=defaults["eos"]),
        hidden_size=hidden, num_layers=n_layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=c.size("intermediate_size"), max_position_embeddings=max_positions,
        norm_type="rms", norm_eps=c.number("rms_norm_eps", 1e-6), activation=c.activation("hidden_act", "silu"),
        gated_mlp=True, mlp_bias=c.flag("mlp_bias", False) if mt == "llama" else False,
        qkv_bias=qkv_bias, out_bias=out_bias, qk_norm=(mt == "qwen3"),
        sliding_window=sliding_window, layer_types=layer_types,
        position_embedding="rope", rope_theta=theta, rope_scaling=rope if rope["rope_type"] != "default" else None,
        partial_rotary_factor=1.0, parallel_residual=False,
    )


def _attention_windows(c: HFConfig, n_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers 5 applies them; layer_types None: every layer alike."""
    mt = c.model_type
    if mt == "llama":
        # LlamaModel's attention has no window, but transformers' KV cache keeps only `sliding_window` keys on the
        # layers it takes as sliding (cache_utils.get_layer_types_and_kwargs: those layer_types names, else all
        # when sliding_window is set), so its generate() disagrees with its own forward: refuse such a config.
        window, types = c.peek("sliding_window"), c.peek("layer_types")
        key, value = ("layer_types", types) if isinstance(types, list) else ("sliding_window", window)
        if (isinstance(types, list) and "sliding_attention" in types) or (types is None and window is not None):
            raise c.unsupported(key, value, "no sliding window for llama (transformers applies it in the KV cache "
                                "of generate() but not in the forward); remove the key or use model_type mistral")
        return None, None
    layer_types = attention_layer_types(c, n_layers)
    if mt == "mistral":
        window = c.get("sliding_window", 4096)
        # transformers loads a mistral config with a layer_types key as Ministral, which honours it per layer but
        # fails without a sliding_window or a head_dim
        if "layer_types" in c and (window is None or c.peek("head_dim") is None):
            raise c.unsupported("layer_types", c.peek("layer_types"), "layer_types in a mistral config only "
                                "with a sliding_window and a head_dim (transformers cannot run it without them)")
        needs = "a sliding_window"
    else:  # qwen2, qwen3 (Qwen2Config.__post_init__)
        window = c.get("sliding_window", 4096)
        if not c.flag("use_sliding_window", False):
            window = None
        max_window_layers = c.size("max_window_layers", default=28, minimum=0)
        if layer_types is None and window is not None:
            layer_types = tuple("sliding_attention" if i >= max_window_layers else "full_attention"
                                for i in range(n_layers))
        needs = "use_sliding_window=true and a sliding_window"
    if window is None:
        if layer_types is not None and "sliding_attention" in layer_types:
            # transformers fails on these ("Could not find a `sliding_window`"): nothing to match, so refuse
            raise c.unsupported("layer_types", list(layer_types), f"'sliding_attention' layers only with {needs}")
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise c.error("sliding_window", window, "expected a positive integer or null")
    return window, layer_types


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    rope = {"rope_type": "default", **cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
    d = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings, hidden_act=cfg.activation, rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope, rope_theta=cfg.rope_theta, **vocab_and_tokens_to_hf(cfg),
    )
    mt = cfg.model_type
    if mt in ("llama", "qwen3"):
        d["attention_bias"] = cfg.qkv_bias
    if mt == "llama":
        d["mlp_bias"] = cfg.mlp_bias
    if mt in ("mistral", "qwen2", "qwen3"):
        d["sliding_window"] = cfg.sliding_window
    if mt == "mistral" and cfg.layer_types is not None and cfg.sliding_window is not None:  # read as Ministral
        d["layer_types"] = list(cfg.layer_types)
    if mt in ("qwen2", "qwen3"):
        d["use_sliding_window"] = cfg.sliding_window is not None
        d["layer_types"] = list(cfg.layer_types or ("full_attention",) * cfg.num_layers)
    return d


def backbone_keys(cfg: ModelConfig) -> list[Key]:
    V, D, H, K, hd, F = (cfg.vocab_size, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size)
    L, A, M = "{prefix}layers.{i}.", ("layers", "attn"), ("layers", "mlp")
    keys = [
        Key("{prefix}embed_tokens.weight", (V, D), ("embed", "embedding")),
        Key("{prefix}norm.weight", (D,), ("final_norm", "scale")),
        Key(L + "input_layernorm.weight", (D,), ("layers", "attn_norm", "scale")),
        Key(L + "post_attention_layernorm.weight", (D,), ("layers", "mlp_norm", "scale")),
        # nn.Linear [out, in] -> [in, out] with the heads split out: q [D, H, hd], k/v [D, K, hd], o [H, hd, D]
        Key(L + "self_attn.q_proj.weight", (H * hd, D), A + ("q", "kernel"), (T(), Unflatten(1, (H, hd)))),
        Key(L + "self_attn.k_proj.weight", (K * hd, D), A + ("k", "kernel"), (T(), Unflatten(1, (K, hd)))),
        Key(L + "self_attn.v_proj.weight", (K * hd, D), A + ("v", "kernel"), (T(), Unflatten(1, (K, hd)))),
        Key(L + "self_attn.o_proj.weight", (D, H * hd), A + ("o", "kernel"), (T(), Unflatten(0, (H, hd)))),
        Key(L + "mlp.gate_proj.weight", (F, D), M + ("gate", "kernel"), (T(),)),
        Key(L + "mlp.up_proj.weight", (F, D), M + ("up", "kernel"), (T(),)),
        Key(L + "mlp.down_proj.weight", (D, F), M + ("down", "kernel"), (T(),)),
    ]
    if cfg.qkv_bias:
        keys += [Key(L + "self_attn.q_proj.bias", (H * hd,), A + ("q", "bias"), (Unflatten(0, (H, hd)),)),
                 Key(L + "self_attn.k_proj.bias", (K * hd,), A + ("k", "bias"), (Unflatten(0, (K, hd)),)),
                 Key(L + "self_attn.v_proj.bias", (K * hd,), A + ("v", "bias"), (Unflatten(0, (K, hd)),))]
    if cfg.out_bias:
        keys.append(Key(L + "self_attn.o_proj.bias", (D,), A + ("o", "bias")))
    if cfg.qk_norm:
        keys += [Key(L + "self_attn.q_norm.weight", (hd,), A + ("q_norm", "scale")),
                 Key(L + "self_attn.k_norm.weight", (hd,), A + ("k_norm", "scale"))]
    if cfg.mlp_bias:
        keys += [Key(L + "mlp.gate_proj.bias", (F,), M + ("gate", "bias")),
                 Key(L + "mlp.up_proj.bias", (F,), M + ("up", "bias")),
                 Key(L + "mlp.down_proj.bias", (D,), M + ("down", "bias"))]
    return keys


LLAMA = Family(
    name="llama",
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    backbone_keys=backbone_keys,
    backbone_prefix="model",
    lm_head="lm_head.weight",
    architectures={mt: transformers_classes(base) for mt, base in
                   (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))},
    ignored_tensors=("rotary_emb.inv_freq",),
)
register_family(MODEL_TYPES, LLAMA)
