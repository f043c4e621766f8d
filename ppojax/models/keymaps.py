"""Hugging Face tensor names <-> ppojax parameters, one pair of functions per architecture family.

`hf_to_params(cfg, kind, get)` builds the nested dict of numpy arrays that `nnx.to_pure_dict(nnx.state(model))`
has for a ppojax model of this `kind`; `get(name, shape)` returns the checkpoint tensor `name` (checking its
shape, and naming the tensor in any error). `params_to_hf(cfg, kind, params)` is the inverse and returns
`{hf_name: array}` as transformers' `save_pretrained` writes it.

kinds: "causal_lm" (`XForCausalLM`), "score" (`XForSequenceClassification`, num_labels = 1),
"value_head" (TRL's `AutoModelForCausalLMWithValueHead`: causal LM + `v_head.summary.{weight,bias}`),
"backbone" (`XModel`, no head).

transformers' `nn.Linear.weight` is [out, in]; GPT-2's `Conv1D.weight` is [in, out].
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .config import LLAMA_FAMILY, ModelConfig

KINDS = ("causal_lm", "score", "value_head", "backbone")
Getter = Callable[[str, tuple], np.ndarray]

# Name of the backbone inside transformers' task models.
BACKBONE_PREFIX = {"gpt2": "transformer", "gpt_neox": "gpt_neox", **{m: "model" for m in LLAMA_FAMILY}}
# Untied LM head name.
LM_HEAD = {"gpt2": "lm_head.weight", "gpt_neox": "embed_out.weight", **{m: "lm_head.weight" for m in LLAMA_FAMILY}}
# Tensors transformers may store that carry no parameters (buffers of older versions).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias",
                    "rotary_emb.inv_freq")


def _stack(fn, n: int) -> np.ndarray:
    return np.stack([fn(i) for i in range(n)])


# ---------------------------------------------------------------------------------------------- Llama family


def _llama_backbone_from_hf(cfg: ModelConfig, get: Getter, pre: str) -> dict:
    L, D, H, K, hd, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.intermediate_size)
    lay = f"{pre}layers." + "{i}."

    def w(name, shape):  # per-layer tensor, stacked
        return lambda fn: _stack(lambda i: fn(get(lay.format(i=i) + name, shape)), L)

    attn = {
        "q": {"kernel": w("self_attn.q_proj.weight", (H * hd, D))(lambda t: t.T.reshape(D, H, hd))},
        "k": {"kernel": w("self_attn.k_proj.weight", (K * hd, D))(lambda t: t.T.reshape(D, K, hd))},
        "v": {"kernel": w("self_attn.v_proj.weight", (K * hd, D))(lambda t: t.T.reshape(D, K, hd))},
        "o": {"kernel": w("self_attn.o_proj.weight", (D, H * hd))(lambda t: t.T.reshape(H, hd, D))},
    }
    if cfg.qkv_bias:
        attn["q"]["bias"] = w("self_attn.q_proj.bias", (H * hd,))(lambda t: t.reshape(H, hd))
        attn["k"]["bias"] = w("self_attn.k_proj.bias", (K * hd,))(lambda t: t.reshape(K, hd))
        attn["v"]["bias"] = w("self_attn.v_proj.bias", (K * hd,))(lambda t: t.reshape(K, hd))
    if cfg.out_bias:
        attn["o"]["bias"] = w("self_attn.o_proj.bias", (D,))(lambda t: t)
    if cfg.qk_norm:
        attn["q_norm"] = {"scale": w("self_attn.q_norm.weight", (hd,))(lambda t: t)}
        attn["k_norm"] = {"scale": w("self_attn.k_norm.weight", (hd,))(lambda t: t)}
    mlp = {name: {"kernel": w(f"mlp.{name}_proj.weight", (F, D))(lambda t: t.T)} for name in ("gate", "up")}
    mlp["down"] = {"kernel": w("mlp.down_proj.weight", (D, F))(lambda t: t.T)}
    if cfg.mlp_bias:
        for name in ("gate", "up"):
            mlp[name]["bias"] = w(f"mlp.{name}_proj.bias", (F,))(lambda t: t)
        mlp["down"]["bias"] = w("mlp.down_proj.bias", (D,))(lambda t: t)
    return {
        "embed": {"embedding": get(f"{pre}embed_tokens.weight", (cfg.vocab_size, D))},
        "layers": {
            "attn_norm": {"scale": w("input_layernorm.weight", (D,))(lambda t: t)},
            "attn": attn,
            "mlp_norm": {"scale": w("post_attention_layernorm.weight", (D,))(lambda t: t)},
            "mlp": mlp,
        },
        "final_norm": {"scale": get(f"{pre}norm.weight", (D,))},
    }


def _llama_backbone_to_hf(cfg: ModelConfig, p: dict, pre: str) -> dict:
    L, D = cfg.num_layers, cfg.hidden_size
    out = {f"{pre}embed_tokens.weight": p["embed"]["embedding"], f"{pre}norm.weight": p["final_norm"]["scale"]}
    lay, a, m = p["layers"], p["layers"]["attn"], p["layers"]["mlp"]
    for i in range(L):
        n = f"{pre}layers.{i}."
        out[n + "input_layernorm.weight"] = lay["attn_norm"]["scale"][i]
        out[n + "post_attention_layernorm.weight"] = lay["mlp_norm"]["scale"][i]
        for name in ("q", "k", "v"):
            out[n + f"self_attn.{name}_proj.weight"] = a[name]["kernel"][i].reshape(D, -1).T
            if "bias" in a[name]:
                out[n + f"self_attn.{name}_proj.bias"] = a[name]["bias"][i].reshape(-1)
        out[n + "self_attn.o_proj.weight"] = a["o"]["kernel"][i].reshape(-1, D).T
        if "bias" in a["o"]:
            out[n + "self_attn.o_proj.bias"] = a["o"]["bias"][i]
        if "q_norm" in a:
            out[n + "self_attn.q_norm.weight"] = a["q_norm"]["scale"][i]
            out[n + "self_attn.k_norm.weight"] = a["k_norm"]["scale"][i]
        for name in ("gate", "up", "down"):
            out[n + f"mlp.{name}_proj.weight"] = m[name]["kernel"][i].T
            if "bias" in m[name]:
                out[n + f"mlp.{name}_proj.bias"] = m[name]["bias"][i]
    return out


# --------------------------------------------------------------------------------------------------- GPT-2


def _gpt2_backbone_from_hf(cfg: ModelConfig, get: Getter, pre: str) -> dict:
    L, D, H, hd, F = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    lay = f"{pre}h." + "{i}."

    def w(name, shape):
        return lambda fn: _stack(lambda i: fn(get(lay.format(i=i) + name, shape)), L)

    def qkv(j):  # c_attn.weight [D, 3D] (Conv1D: in, out): columns q | k | v
        return w("attn.c_attn.weight", (D, 3 * D))(lambda t: t[:, j * D:(j + 1) * D].reshape(D, H, hd))

    def qkv_bias(j):
        return w("attn.c_attn.bias", (3 * D,))(lambda t: t[j * D:(j + 1) * D].reshape(H, hd))

    def ln(name):
        return {"scale": w(f"{name}.weight", (D,))(lambda t: t), "bias": w(f"{name}.bias", (D,))(lambda t: t)}

    return {
        "embed": {"embedding": get(f"{pre}wte.weight", (cfg.vocab_size, D))},
        "pos_embed": {"embedding": get(f"{pre}wpe.weight", (cfg.max_position_embeddings, D))},
        "layers": {
            "attn_norm": ln("ln_1"),
            "attn": {
                "q": {"kernel": qkv(0), "bias": qkv_bias(0)},
                "k": {"kernel": qkv(1), "bias": qkv_bias(1)},
                "v": {"kernel": qkv(2), "bias": qkv_bias(2)},
                "o": {"kernel": w("attn.c_proj.weight", (D, D))(lambda t: t.reshape(H, hd, D)),
                      "bias": w("attn.c_proj.bias", (D,))(lambda t: t)},
            },
            "mlp_norm": ln("ln_2"),
            "mlp": {
                "up": {"kernel": w("mlp.c_fc.weight", (D, F))(lambda t: t),
                       "bias": w("mlp.c_fc.bias", (F,))(lambda t: t)},
                "down": {"kernel": w("mlp.c_proj.weight", (F, D))(lambda t: t),
                         "bias": w("mlp.c_proj.bias", (D,))(lambda t: t)},
            },
        },
        "final_norm": {"scale": get(f"{pre}ln_f.weight", (D,)), "bias": get(f"{pre}ln_f.bias", (D,))},
    }


def _gpt2_backbone_to_hf(cfg: ModelConfig, p: dict, pre: str) -> dict:
    D = cfg.hidden_size
    lay, a, m = p["layers"], p["layers"]["attn"], p["layers"]["mlp"]
    out = {
        f"{pre}wte.weight": p["embed"]["embedding"], f"{pre}wpe.weight": p["pos_embed"]["embedding"],
        f"{pre}ln_f.weight": p["final_norm"]["scale"], f"{pre}ln_f.bias": p["final_norm"]["bias"],
    }
    for i in range(cfg.num_layers):
        n = f"{pre}h.{i}."
        for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[n + f"{theirs}.weight"] = lay[ours]["scale"][i]
            out[n + f"{theirs}.bias"] = lay[ours]["bias"][i]
        out[n + "attn.c_attn.weight"] = np.concatenate([a[x]["kernel"][i].reshape(D, D) for x in "qkv"], axis=1)
        out[n + "attn.c_attn.bias"] = np.concatenate([a[x]["bias"][i].reshape(D) for x in "qkv"])
        out[n + "attn.c_proj.weight"] = a["o"]["kernel"][i].reshape(D, D)
        out[n + "attn.c_proj.bias"] = a["o"]["bias"][i]
        out[n + "mlp.c_fc.weight"] = m["up"]["kernel"][i]
        out[n + "mlp.c_fc.bias"] = m["up"]["bias"][i]
        out[n + "mlp.c_proj.weight"] = m["down"]["kernel"][i]
        out[n + "mlp.c_proj.bias"] = m["down"]["bias"][i]
    return out


# ------------------------------------------------------------------------------------------------- GPT-NeoX


def _neox_backbone_from_hf(cfg: ModelConfig, get: Getter, pre: str) -> dict:
    L, D, H, hd, F = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    lay = f"{pre}layers." + "{i}."

    def w(name, shape):
        return lambda fn: _stack(lambda i: fn(get(lay.format(i=i) + name, shape)), L)

    def qkv(j):  # query_key_value.weight [3D, D]: rows are (head, q|k|v, head_dim)
        return w("attention.query_key_value.weight", (3 * D, D))(
            lambda t: t.reshape(H, 3, hd, D)[:, j].transpose(2, 0, 1))

    def qkv_bias(j):
        return w("attention.query_key_value.bias", (3 * D,))(lambda t: t.reshape(H, 3, hd)[:, j])

    def ln(name):
        return {"scale": w(f"{name}.weight", (D,))(lambda t: t), "bias": w(f"{name}.bias", (D,))(lambda t: t)}

    attn = {x: {"kernel": qkv(j)} for j, x in enumerate("qkv")}
    attn["o"] = {"kernel": w("attention.dense.weight", (D, D))(lambda t: t.T.reshape(H, hd, D))}
    if cfg.qkv_bias:
        for j, x in enumerate("qkv"):
            attn[x]["bias"] = qkv_bias(j)
    if cfg.out_bias:
        attn["o"]["bias"] = w("attention.dense.bias", (D,))(lambda t: t)
    return {
        "embed": {"embedding": get(f"{pre}embed_in.weight", (cfg.vocab_size, D))},
        "layers": {
            "attn_norm": ln("input_layernorm"),
            "attn": attn,
            "mlp_norm": ln("post_attention_layernorm"),
            "mlp": {
                "up": {"kernel": w("mlp.dense_h_to_4h.weight", (F, D))(lambda t: t.T),
                       "bias": w("mlp.dense_h_to_4h.bias", (F,))(lambda t: t)},
                "down": {"kernel": w("mlp.dense_4h_to_h.weight", (D, F))(lambda t: t.T),
                         "bias": w("mlp.dense_4h_to_h.bias", (D,))(lambda t: t)},
            },
        },
        "final_norm": {"scale": get(f"{pre}final_layer_norm.weight", (D,)),
                       "bias": get(f"{pre}final_layer_norm.bias", (D,))},
    }


def _neox_backbone_to_hf(cfg: ModelConfig, p: dict, pre: str) -> dict:
    D, H, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    lay, a, m = p["layers"], p["layers"]["attn"], p["layers"]["mlp"]
    out = {
        f"{pre}embed_in.weight": p["embed"]["embedding"],
        f"{pre}final_layer_norm.weight": p["final_norm"]["scale"],
        f"{pre}final_layer_norm.bias": p["final_norm"]["bias"],
    }
    for i in range(cfg.num_layers):
        n = f"{pre}layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
            out[n + f"{theirs}.weight"] = lay[ours]["scale"][i]
            out[n + f"{theirs}.bias"] = lay[ours]["bias"][i]
        # [D, H, hd] x3 -> [H, 3, hd, D] -> [3D, D]
        qkv = np.stack([a[x]["kernel"][i].transpose(1, 2, 0) for x in "qkv"], axis=1)
        out[n + "attention.query_key_value.weight"] = qkv.reshape(3 * D, D)
        if "bias" in a["q"]:
            out[n + "attention.query_key_value.bias"] = np.stack([a[x]["bias"][i] for x in "qkv"], 1).reshape(-1)
        out[n + "attention.dense.weight"] = a["o"]["kernel"][i].reshape(H * hd, D).T
        if "bias" in a["o"]:
            out[n + "attention.dense.bias"] = a["o"]["bias"][i]
        out[n + "mlp.dense_h_to_4h.weight"] = m["up"]["kernel"][i].T
        out[n + "mlp.dense_h_to_4h.bias"] = m["up"]["bias"][i]
        out[n + "mlp.dense_4h_to_h.weight"] = m["down"]["kernel"][i].T
        out[n + "mlp.dense_4h_to_h.bias"] = m["down"]["bias"][i]
    return out


# ---------------------------------------------------------------------------------------------------- public

_BACKBONE_FROM_HF = {"gpt2": _gpt2_backbone_from_hf, "gpt_neox": _neox_backbone_from_hf,
                     **{m: _llama_backbone_from_hf for m in LLAMA_FAMILY}}
_BACKBONE_TO_HF = {"gpt2": _gpt2_backbone_to_hf, "gpt_neox": _neox_backbone_to_hf,
                   **{m: _llama_backbone_to_hf for m in LLAMA_FAMILY}}


_EMBED = {"gpt2": "wte.weight", "gpt_neox": "embed_in.weight", **{m: "embed_tokens.weight" for m in LLAMA_FAMILY}}


def backbone_prefix(cfg: ModelConfig, names) -> str:
    """The prefix of backbone tensors in a checkpoint: `model.` (etc.), or '' for a bare `XModel` checkpoint."""
    pre = BACKBONE_PREFIX[cfg.model_type] + "."
    if not any(n.startswith(pre) for n in names) and _EMBED[cfg.model_type] in names:
        return ""
    return pre


def hf_to_params(cfg: ModelConfig, kind: str, get: Getter, names=(), has=lambda name: True) -> dict:
    """Nested dict of arrays in the layout of `nnx.to_pure_dict(nnx.state(model))` for a model of `kind`.

    `names`: all tensor names of the checkpoint (to detect the backbone prefix); `has(name)`: whether it exists.
    A missing `score` / `v_head` (e.g. a score model started from a causal-LM checkpoint) is left out of the
    result; the caller initialises it.
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    pre = backbone_prefix(cfg, names)
    backbone = _BACKBONE_FROM_HF[cfg.model_type](cfg, get, pre)
    D = cfg.hidden_size
    if kind == "backbone":
        return backbone
    if kind == "score":
        params = {"backbone": backbone}
        if has("score.weight"):
            params["score"] = {"kernel": get("score.weight", (1, D)).T}
            if has("score.bias"):
                params["score"]["bias"] = get("score.bias", (1,))
        return params
    params = {"backbone": backbone}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": get(LM_HEAD[cfg.model_type], (cfg.vocab_size, D)).T}
    if kind == "value_head" and has("v_head.summary.weight"):
        params["v_head"] = {"kernel": get("v_head.summary.weight", (1, D)).T,
                            "bias": get("v_head.summary.bias", (1,))}
    return params


def params_to_hf(cfg: ModelConfig, kind: str, params: dict) -> dict[str, np.ndarray]:
    """`{hf_name: array}` for the pure-dict `params` of a model of `kind` (inverse of `hf_to_params`)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    if kind == "backbone":
        return _BACKBONE_TO_HF[cfg.model_type](cfg, params, "")
    pre = BACKBONE_PREFIX[cfg.model_type] + "."
    out = _BACKBONE_TO_HF[cfg.model_type](cfg, params["backbone"], pre)
    if kind == "score":
        out["score.weight"] = params["score"]["kernel"].T
        if "bias" in params["score"]:
            out["score.bias"] = params["score"]["bias"]
        return out
    if not cfg.tie_word_embeddings:
        out[LM_HEAD[cfg.model_type]] = params["lm_head"]["kernel"].T
    if kind == "value_head":
        out["v_head.summary.weight"] = params["v_head"]["kernel"].T
        out["v_head.summary.bias"] = params["v_head"]["bias"]
    return out
