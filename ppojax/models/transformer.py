"""Decoder-only transformers as Flax NNX modules: GPT-2, the Llama family (Llama, Mistral, Qwen2, Qwen3), GPT-NeoX.

One generic pre-norm block covers all of them; `ModelConfig` picks the variant (RMSNorm or LayerNorm, gated or
plain MLP, biases, q/k norm, rotary (partial) or learned positions, parallel residual, sliding window).

Layout. The per-layer weights are STACKED along a leading `layers` axis (`[L, ...]`) and the layers run under
`jax.lax.scan` (one compiled layer body, so 30 layers compile as fast as 1; XLA:CPU copies each layer's slice
out of the stacked weights per call, measured cheaper than unrolling). `scan_layers=False` unrolls a Python loop
instead: for debugging only, it is slower to compile AND to run. Projection kernels keep the head axes separate
(`q.kernel: [L, D, H, hd]`) so that every axis carries a logical name for sharding (see `logical_axes`); the
matmuls themselves run on flattened 2-D operands (see `_dense_in`).

Forward contract (docs/algorithm.md, "Conventions"):
`input_ids i32[B, S]`, `attention_mask bool[B, S]` (True = real token, False = pad),
`position_ids i32[B, S]` (exclusive cumulative sum of the mask for left-padded rows; `position_ids_from_mask`),
and optionally `segment_ids i32[B, S]` for PACKED rows (several sequences side by side in one row, each with its
own positions): a query then attends only to keys of its own segment (no cache). Pad ids are replaced by 0 before
the embedding. Attention is causal AND ignores pad keys; it runs through the kernels' `attention` (XLA's by default,
`attention.py`; a backend's fused kernel where the run chose one). Softmax and norm statistics are float32 whatever the
compute dtype. A query that sees no valid key (a left-pad position) gets a finite, meaningless output (never NaN);
callers ignore pad positions.

Model options (static, part of the graphdef): `dtype` / `param_dtype` (compute / storage; named pairs in
`precision.py`), `remat` ("none" | "full" | "dots", `remat.py`), `scan_layers`, and `kernels`: the backend's
operations, attention included (`kernels.py`: XLA's by default; a run chooses them once when it is built,
`ppojax.backends.kernels_for`).

KV cache: `kv_cache.py` (`KVCache`, `init_cache`, `PromptKV`: a prefix's keys and values).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax.models import kv_int8
from ppojax.models.config import ModelConfig
from ppojax.models.kv_cache import KVCache, PromptKV, read_layer, write_layer, write_slots
from ppojax.models.kernels import XLA, Kernels, check_kernels
from ppojax.models.remat import check_remat, remat_layer

Array = jax.Array

# ----------------------------------------------------------------------------------------- small pure functions


def activation_fn(name: str):
    """The activation of transformers' `ACT2FN[name]`."""
    if name in ("silu", "swish"):
        return jax.nn.silu
    if name == "gelu":  # exact (erf) GELU
        return partial(jax.nn.gelu, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):  # tanh approximation
        return partial(jax.nn.gelu, approximate=True)
    if name == "relu":
        return jax.nn.relu
    raise ValueError(f"unsupported activation {name!r}")


def rms_norm(x: Array, scale: Array, eps: float) -> Array:
    """`scale * x / sqrt(mean(x^2) + eps)`; statistics in float32, result in x.dtype (as transformers)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * xf.astype(x.dtype)


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm over the last axis; statistics in float32, result in x.dtype."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(x.dtype)


def _norm(cfg: ModelConfig, x: Array, p: dict) -> Array:
    if cfg.norm_type == "rms":
        return rms_norm(x, p["scale"], cfg.norm_eps)
    return layer_norm(x, p["scale"], p["bias"], cfg.norm_eps)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies `f32[rotary_dim // 2]` of RoPE, including `linear` and Llama-3 (`llama3`) scaling."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = cfg.rope_scaling_dict
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: Array, position_ids: Array, inv_freq: np.ndarray) -> Array:
    """Rotate the first `2 * len(inv_freq)` channels of `x: [B, S, heads, hd]` (transformers' rotate_half layout).

    Angles and the rotation are computed in float32; the result has x.dtype.
    """
    rot = 2 * inv_freq.shape[0]
    angles = position_ids.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, rot/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, S, 1, rot]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xr = x[..., :rot].astype(jnp.float32)
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = xr * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
    if rot == x.shape[-1]:
        return rotated.astype(x.dtype)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rot:]], axis=-1)


def position_ids_from_mask(attention_mask: Array) -> Array:
    """`i32[B, S]`: exclusive cumulative sum of `attention_mask` (first real token -> 0; left pads -> 0)."""
    m = attention_mask.astype(jnp.int32)
    return jnp.cumsum(m, axis=-1) - m


def last_token_index(attention_mask: Array) -> Array:
    """`i32[B]`: index of the last True of each row of `attention_mask bool[B, S]` (0 for an all-False row)."""
    s = attention_mask.shape[-1]
    idx = jnp.arange(s, dtype=jnp.int32)
    return jnp.max(jnp.where(attention_mask, idx, 0), axis=-1)


def last_token_scores(scores: Array, attention_mask: Array) -> Array:
    """`f32[B]`: per-position scores `f32[B, S]` read at the last non-pad token (rewards of a score model)."""
    idx = last_token_index(attention_mask)
    return jnp.take_along_axis(scores, idx[:, None], axis=-1)[:, 0]


# ------------------------------------------------------------------------------------------------ one layer


def _dense_in(x: Array, kernel: Array, bias: Array | None, dtype, kernels: Kernels) -> Array:
    """x [B, S, D] @ kernel [D, *out] (+ bias [*out]).

    A 2-D matmul on the flattened tokens [B*S, D]: with 3-D activations XLA:CPU fused the backward's
    elementwise math with a 3-D transpose into a strided loop far slower than the math.
    """
    lead = x.shape[:-1]
    out_shape = kernel.shape[1:]
    k2 = kernel.astype(dtype).reshape(kernel.shape[0], -1)
    y = kernels.matmul(x.reshape(-1, x.shape[-1]).astype(dtype), k2).reshape(*lead, *out_shape)
    return y if bias is None else y + bias.astype(dtype)


def _with_lora(y: Array, x: Array, d: dict, n_in: int, dtype, scale: float | None, kernels: Kernels) -> Array:
    """`y + scale * (x @ lora_a) @ lora_b` when the projection `d` carries LoRA adapters, else `y`.

    x: [B, S, *in] (`n_in` input axes), `lora_a [*in, r]`, `lora_b [r, *out]`, y: [B, S, *out]. The rank-r path
    stays two thin 2-D matmuls on the flattened tokens (never the [in, out] product: no weight-sized temporary).
    """
    if "lora_a" not in d:
        return y
    a, b = d["lora_a"], d["lora_b"]
    r = a.shape[-1]
    lead = x.shape[:x.ndim - n_in]
    xa = kernels.matmul(x.reshape(math.prod(lead), -1).astype(dtype), a.astype(dtype).reshape(-1, r))
    delta = kernels.matmul((xa * scale).astype(dtype), b.astype(dtype).reshape(r, -1))
    return y + delta.reshape(*lead, *b.shape[1:]).astype(y.dtype)


def _project(x: Array, d: dict, dtype, lora_scale: float | None, kernels: Kernels, product=None) -> Array:
    """A one-input-axis projection `x [B, S, D] -> [B, S, *out]`: kernel, optional bias, optional LoRA.
    product: the backend's `x2 [N, D] -> [N, prod(out)]` where it took this kernel out of the layer's weights
    (`Kernels.layer_products`; float32 only), else None."""
    if product is not None:
        y = product(x.reshape(-1, x.shape[-1]))
        y = y.reshape(*x.shape[:-1], *y.shape[1:])
    else:
        y = _dense_in(x, d["kernel"], None, dtype, kernels)
    if "bias" in d:
        y = y + d["bias"].astype(dtype)
    return _with_lora(y, x, d, 1, dtype, lora_scale, kernels)


def _block(cfg: ModelConfig, dtype, inv_freq, p: dict, x: Array, positions: Array, mask: Array,
           layer_idx, kv: tuple | None, cache_index, attn_kwargs: dict, lora_scale: float | None = None,
           cache_dtype=None, kernels: Kernels = XLA, products: dict | None = None,
           slots_read: int | None = None, prefix: tuple | None = None):
    """One transformer layer on `x: [B, S, D]` with this layer's weights `p` (no `layers` axis).

    `mask: bool[B, S, T]`. With `kv = (keys, values)` (the whole stacked cache `[L, B, T, K, hd]`), the new keys and
    values are written at `[layer_idx, :, cache_index:cache_index+S]` (`cache_index` i32[] or, one per row,
    i32[B]: `write_slots`) and attention reads that layer's first `slots_read` slots (`mask: bool[B, S,
    slots_read]`; None: all T).
    `attn_kwargs`: the mask hints of `Kernels.attention`. `lora_scale`: alpha / r of the LoRA adapters some
    projections carry (`lora.py`; None without adapters). `cache_dtype`: the dtype of the cache's keys and values
    (`KVCache.dtype`), stored as `kernels` store it. `kernels`: the model's backend operations; `products`: this layer's
    `kernels.layer_products` (projections whose kernels the backend reads where they lie in the stack; absent from `p`).
    `prefix`: this layer's keys and values of tokens before the call's (`[B, Pk, K, hd]` each, a shared prompt's:
    `PromptKV`), which the call's queries also attend to (`mask: bool[B, S, Pk + S]`); only without `kv`.
    Returns `(x, kv, (k, v))`: the call's own keys and values, `[B, S, K, hd]` each, after the position encoding.
    """
    products = products or {}

    def project(x_in, group, name):
        return _project(x_in, p[group][name], dtype, lora_scale, kernels, products.get((group, name)))

    a = p["attn"]
    h = _norm(cfg, x, p["attn_norm"])
    q = project(h, "attn", "q")  # [B, S, H, hd]
    k = project(h, "attn", "k")  # [B, S, K, hd]
    v = project(h, "attn", "v")
    if cfg.qk_norm:
        q = rms_norm(q, a["q_norm"]["scale"], cfg.norm_eps)
        k = rms_norm(k, a["k_norm"]["scale"], cfg.norm_eps)
    if cfg.position_embedding == "rope":
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
    if cfg.attn_scale_by_inverse_layer_idx:
        # GPT-2's scores / (layer_idx + 1): layer_idx is traced under the layer scan and fused kernels take the
        # scale as a constant, so the per-layer factor is folded into q
        q = q * (1.0 / (layer_idx + 1).astype(jnp.float32)).astype(q.dtype)
    scale = cfg.head_dim ** -0.5
    own = (k, v)
    if prefix is not None:
        k = jnp.concatenate([prefix[0].astype(k.dtype), k], axis=1)
        v = jnp.concatenate([prefix[1].astype(v.dtype), v], axis=1)
    o = None
    if kv is not None:
        all_k, all_v = (write_layer(stack, new, layer_idx, cache_index, kernels, cache_dtype)
                        for stack, new in zip(kv, (k, v)))
        kv = (all_k, all_v)
        if not kv_int8.is_int8(all_k):  # a backend's kernel may read the layer's slots where they lie
            o = kernels.cache_attention(q, all_k, all_v, layer_idx, mask, scale=scale,
                                        slots_read=slots_read or all_k.shape[2])
        if o is None:
            k, v = (read_layer(stack, layer_idx, slots_read, dtype, cfg, kernels, cache_dtype) for stack in kv)
    if o is None:
        o = kernels.attention(q, k, v, mask, scale=scale, **attn_kwargs)
    if ("attn", "o") in products:
        attn_out = products["attn", "o"](o.reshape(o.shape[0] * o.shape[1], -1)).reshape(*o.shape[:2], -1)
    else:
        attn_out = kernels.output_projection(o, a["o"]["kernel"].astype(dtype))
    if "bias" in a["o"]:
        attn_out = attn_out + a["o"]["bias"].astype(dtype)
    attn_out = _with_lora(attn_out, o, a["o"], 2, dtype, lora_scale, kernels)

    def mlp(hm):
        act = activation_fn(cfg.activation)
        up = project(hm, "mlp", "up")
        if cfg.gated_mlp:
            up = act(project(hm, "mlp", "gate")) * up
        else:
            up = act(up)
        return project(up, "mlp", "down")

    if cfg.parallel_residual:
        x = x + attn_out + mlp(_norm(cfg, x, p["mlp_norm"]))
    else:
        x = x + attn_out
        x = x + mlp(_norm(cfg, x, p["mlp_norm"]))
    return x, kv, own


@jax.custom_vjp
def matmul_float32_out(x: Array, w: Array) -> Array:
    """x [..., D] @ w [D, V] -> f32[..., V], float32 accumulation; x and w in the compute dtype.

    The float32 output keeps the logits' precision, but autodiff would then run both backward matmuls with a
    float32 cotangent against a bfloat16 operand (promoted to float32 matmuls); the custom VJP rounds the
    cotangent to the compute dtype so the backward matmuls run in it, as the forward's. Identical to autodiff in
    float32.
    """
    return jnp.einsum("...d,dv->...v", x, w, preferred_element_type=jnp.float32)


def _matmul_float32_out_fwd(x, w):
    return matmul_float32_out(x, w), (x, w)


def _matmul_float32_out_bwd(residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = jnp.einsum("...v,dv->...d", g, w, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.einsum("...d,...v->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


matmul_float32_out.defvjp(_matmul_float32_out_fwd, _matmul_float32_out_bwd)


# ----------------------------------------------------------------------------------------------- parameters


def _param(value: Array, axes: tuple) -> nnx.Param:
    """A parameter annotated with logical axis names (no eager sharding: works without a mesh)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class _Init:
    """Random initialisation in the style of transformers' `_init_weights` (normal(0, initializer_range))."""

    def __init__(self, rngs: nnx.Rngs, std: float, param_dtype):
        self.rngs, self.std, self.dtype = rngs, std, param_dtype

    def normal(self, shape, axes, std=None):
        std = self.std if std is None else std
        return _param(std * jax.random.normal(self.rngs.params(), shape, self.dtype), axes)

    def zeros(self, shape, axes):
        return _param(jnp.zeros(shape, self.dtype), axes)

    def ones(self, shape, axes):
        return _param(jnp.ones(shape, self.dtype), axes)


def _norm_params(cfg: ModelConfig, init: _Init, lead: tuple, lead_axes: tuple) -> nnx.Dict:
    d = nnx.Dict(scale=init.ones(lead + (cfg.hidden_size,), lead_axes + ("norm",)))
    if cfg.norm_type == "layer":
        d["bias"] = init.zeros(lead + (cfg.hidden_size,), lead_axes + ("norm",))
    return d


def _dense_params(init: _Init, shape: tuple, axes: tuple, n_in: int, bias: bool, std=None) -> nnx.Dict:
    """kernel `[L, *in, *out]` (+ bias `[L, *out]`); `n_in` = number of input axes after `layers`."""
    d = nnx.Dict(kernel=init.normal(shape, axes, std))
    if bias:
        d["bias"] = init.zeros(shape[:1] + shape[1 + n_in:], axes[:1] + axes[1 + n_in:])
    return d


def _attention_masks(cfg: ModelConfig, input_ids: Array, attention_mask: Array, cache: KVCache | None,
                     prefix: PromptKV | None, segment_ids: Array | None):
    """The attention masks a forward's layers share (True = may attend) and the hints that let a fused kernel skip
    blocks the mask rules out anyway (see `attention.attention`) -> (mask bool[1 or B, S, T], the sliding layers'
    mask or None where no layer slides, the keys' mask bool[B, T] (with a cache: the cache's, this call's tokens
    written in), the cache's write index or None, the kernel's hints {name: value})."""
    s = input_ids.shape[1]
    sliding = np.asarray(cfg.sliding_layers)
    attn_kwargs = {}
    if prefix is not None:  # the prefix's slots first, then the call's: a mask no hint describes
        pk = prefix.key_mask.shape[1]
        q_slot = pk + jnp.arange(s)
        k_slot = jnp.arange(pk + s)
        key_mask = jnp.concatenate([prefix.key_mask.astype(bool), attention_mask], axis=1)
        index = None
    elif cache is None:
        q_slot = jnp.arange(s)
        k_slot = jnp.arange(s)
        key_mask = attention_mask
        index = None
        attn_kwargs["is_causal"] = True
        if sliding.all():
            attn_kwargs["window"] = cfg.sliding_window
        if sliding.all() or not sliding.any():  # then causality, the window and these ids say the whole mask
            packed = jnp.zeros_like(input_ids) if segment_ids is None else segment_ids
            attn_kwargs["segments"] = jnp.where(attention_mask, packed, -1).astype(jnp.int32)
    else:
        index = cache.index
        key_mask = write_slots(cache.key_mask, attention_mask, None, index)
        q_slot = index[..., None] + jnp.arange(s)  # [S], or [B, S] with one index per row
        k_slot = jnp.arange(cache.slots_read)
    q_slot = q_slot.reshape(-1, s)[:, :, None]  # [1 or B, S, 1]
    mask = key_mask[:, None, :k_slot.shape[0]] & (k_slot[None, None, :] <= q_slot)
    if segment_ids is not None:  # packed rows: a query sees its own sequence only
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    window_mask = None
    if sliding.any():
        window_mask = mask & (k_slot[None, None, :] > q_slot - cfg.sliding_window)
    return mask, window_mask, key_mask, index, attn_kwargs


class Backbone(nnx.Module):
    """Embeddings + stacked layers + final norm. `__call__` returns final-normed hidden states.

    Parameters (L = num_layers, D = hidden, H/K = query/kv heads, hd = head_dim, F = intermediate, V = vocab):
      embed.embedding [V, D] (vocab, embed);  pos_embed.embedding [P, D] (positions, embed) for GPT-2
      layers.attn_norm.{scale,bias} [L, D] (layers, norm);  layers.mlp_norm.{scale,bias} likewise
      layers.attn.q.kernel [L, D, H, hd] (layers, embed, heads, head_dim); .bias [L, H, hd]
      layers.attn.{k,v}.kernel [L, D, K, hd] (layers, embed, kv_heads, head_dim); .bias [L, K, hd]
      layers.attn.o.kernel [L, H, hd, D] (layers, heads, head_dim, embed); .bias [L, D]
      layers.attn.{q,k}_norm.scale [L, hd] (layers, head_dim)   (Qwen3)
      layers.mlp.{gate,up}.kernel [L, D, F] (layers, embed, mlp); .bias [L, F]
      layers.mlp.down.kernel [L, F, D] (layers, mlp, embed); .bias [L, D]
      final_norm.{scale,bias} [D] (norm)
    LoRA adapters (`lora.add_lora`, optional) sit beside a projection's kernel: `lora_a [L, *in, r]`
    (layers, *in axes, None), `lora_b [L, r, *out]` (layers, None, *out axes), e.g. `layers.attn.q.lora_a`.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA):
        check_remat(remat)
        check_kernels(kernels)
        self.cfg = cfg
        self.dtype = dtype
        self.scan_layers = scan_layers
        self.remat = remat
        self.kernels = kernels  # the backend's operations (`kernels.py`; static: part of the graphdef)
        self.lora_scale = None  # alpha / r once `lora.add_lora` attaches adapters (static: part of the graphdef)
        init = _Init(rngs, cfg.initializer_range, param_dtype)
        L, D, H, K, hd, F = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size)
        self.embed = nnx.Dict(embedding=init.normal((cfg.vocab_size, D), ("vocab", "embed")))
        if cfg.position_embedding == "learned":
            self.pos_embed = nnx.Dict(
                embedding=init.normal((cfg.max_position_embeddings, D), ("positions", "embed")))
        else:
            self.pos_embed = None
        attn = nnx.Dict(
            q=_dense_params(init, (L, D, H, hd), ("layers", "embed", "heads", "head_dim"), 1, cfg.qkv_bias),
            k=_dense_params(init, (L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), 1, cfg.qkv_bias),
            v=_dense_params(init, (L, D, K, hd), ("layers", "embed", "kv_heads", "head_dim"), 1, cfg.qkv_bias),
            o=_dense_params(init, (L, H, hd, D), ("layers", "heads", "head_dim", "embed"), 2, cfg.out_bias),
        )
        if cfg.qk_norm:
            attn["q_norm"] = nnx.Dict(scale=init.ones((L, hd), ("layers", "head_dim")))
            attn["k_norm"] = nnx.Dict(scale=init.ones((L, hd), ("layers", "head_dim")))
        mlp = nnx.Dict(
            up=_dense_params(init, (L, D, F), ("layers", "embed", "mlp"), 1, cfg.mlp_bias),
            down=_dense_params(init, (L, F, D), ("layers", "mlp", "embed"), 1, cfg.mlp_bias),
        )
        if cfg.gated_mlp:
            mlp["gate"] = _dense_params(init, (L, D, F), ("layers", "embed", "mlp"), 1, cfg.mlp_bias)
        self.layers = nnx.Dict(
            attn_norm=_norm_params(cfg, init, (L,), ("layers",)),
            attn=attn,
            mlp_norm=_norm_params(cfg, init, (L,), ("layers",)),
            mlp=mlp,
        )
        self.final_norm = _norm_params(cfg, init, (), ())

    def embed_tokens(self, input_ids: Array, attention_mask: Array, position_ids: Array) -> Array:
        ids = jnp.where(attention_mask, input_ids, 0)
        x = jnp.take(self.embed["embedding"][...], ids, axis=0).astype(self.dtype)
        if self.pos_embed is not None:
            x = x + jnp.take(self.pos_embed["embedding"][...], position_ids, axis=0, mode="clip").astype(self.dtype)
        return x

    def __call__(self, input_ids: Array, attention_mask: Array, position_ids: Array | None = None,
                 segment_ids: Array | None = None) -> Array:
        """input_ids i32[B, S], attention_mask bool[B, S], position_ids i32[B, S] (default: exclusive cumsum of
        the mask), segment_ids i32[B, S] (packed rows; None = one sequence per row) -> hidden [B, S, D] after the
        final norm, in the compute dtype."""
        return self.forward(input_ids, attention_mask, position_ids, None, segment_ids)[0]

    def forward(self, input_ids: Array, attention_mask: Array, position_ids: Array | None = None,
                cache: KVCache | None = None, segment_ids: Array | None = None, prefix: PromptKV | None = None,
                return_kv: bool = False) -> tuple[Array, KVCache | PromptKV | None]:
        """As `__call__`, with an optional KV cache -> (hidden [B, S, D], updated cache or None).

        With a cache (generation) the weights are read as the kernels read them once per token
        (`Kernels.read_only_layers`): differentiate a forward without one.
        `prefix`: keys and values of tokens that come before these in every row ([L, B, Pk, ...]); the call's tokens
        attend to them (where `prefix.key_mask`) and, causally, to each other; give `position_ids` that go on from
        the prefix's. Differentiable, as the forward that returned them. `return_kv`: the second output is the
        call's own keys and values (`PromptKV` over its S tokens) instead of a cache."""
        cfg = self.cfg
        attention_mask = attention_mask.astype(bool)
        if segment_ids is not None and cache is not None:
            raise ValueError("segment_ids (packed rows) are for forwards without a KV cache")
        if cache is not None and (prefix is not None or return_kv):
            raise ValueError("prefix and return_kv are for forwards without a KV cache")
        if prefix is not None and (segment_ids is not None or position_ids is None):
            raise ValueError("a forward after a prefix takes explicit position_ids and no segment_ids")
        if position_ids is None:
            if cache is not None:
                raise ValueError("position_ids are required when calling the model with a KV cache")
            position_ids = position_ids_from_mask(attention_mask)
        b, s = input_ids.shape
        x = self.embed_tokens(input_ids, attention_mask, position_ids)
        sliding = np.asarray(cfg.sliding_layers)
        mask, window_mask, key_mask, index, attn_kwargs = _attention_masks(cfg, input_ids, attention_mask, cache,
                                                                           prefix, segment_ids)

        inv_freq = rope_inv_freq(cfg) if cfg.position_embedding == "rope" else None
        layers = nnx.to_pure_dict(nnx.state(self.layers))
        kernels = self.kernels
        if self.scan_layers:
            # the backend may read some projection kernels where they lie in the stack (`Kernels.layer_products`)
            layers, split = kernels.split_layer_kernels(layers, b * s, self.dtype)
        else:
            split = None
        restore = lambda layer: layer  # noqa: E731
        if cache is not None:  # generation reads every layer's weights once per token
            layers, restore = kernels.read_only_layers(layers)

        # each layer's input is saved for the backward, stacked over the layers, in the form the kernels carry it
        # (`Kernels.residual_carry`); the layers see the compute dtype
        layer_dtype = x.dtype
        to_stream = kernels.residual_carry(layer_dtype)

        def body(carry, xs):
            x, kv = carry
            p, layer_idx, is_sliding, layer_prefix = xs
            p = restore(p)
            m = jnp.where(is_sliding, window_mask, mask) if sliding.any() else mask
            x, kv, own = _block(cfg, self.dtype, inv_freq, p, x.astype(layer_dtype), position_ids, m, layer_idx, kv,
                                index, attn_kwargs, self.lora_scale, None if cache is None else cache.dtype,
                                kernels, kernels.layer_products(split, layer_idx),
                                None if cache is None else cache.slots_read, layer_prefix)
            return (to_stream(x), kv), (own if return_kv else None)

        # under scan, XLA cannot merge the recomputation into the forward anyway (jax.checkpoint's docs)
        body = remat_layer(body, self.remat, kernels.dots_policy(), prevent_cse=not self.scan_layers)
        kv = None if cache is None else (cache.keys, cache.values)
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        x = to_stream(x)
        prefix_kv = None if prefix is None else (prefix.keys, prefix.values)
        if self.scan_layers:
            (x, kv), owns = jax.lax.scan(body, (x, kv), (layers, layer_ids, jnp.asarray(sliding), prefix_kv))
        else:
            owns = []
            for i in range(cfg.num_layers):
                p_i = jax.tree.map(lambda a: a[i], layers)
                layer_prefix = None if prefix_kv is None else (prefix_kv[0][i], prefix_kv[1][i])
                (x, kv), own = body((x, kv), (p_i, layer_ids[i], jnp.asarray(sliding[i]), layer_prefix))
                owns.append(own)
            owns = jax.tree.map(lambda *a: jnp.stack(a), *owns) if return_kv else None
        x = _norm(cfg, x.astype(layer_dtype), nnx.to_pure_dict(nnx.state(self.final_norm)))
        if return_kv:
            return x, PromptKV(keys=owns[0], values=owns[1], key_mask=attention_mask)
        if cache is not None:
            cache = cache.replace(keys=kv[0], values=kv[1], key_mask=key_mask, index=cache.index + s)
        return x, cache


# ------------------------------------------------------------------------------------------------------ models


class CausalLM(nnx.Module):
    """Backbone + LM head (or tied input embeddings).

    `model(input_ids, attention_mask, position_ids=None, cache=None) -> (hidden [B, S, D], cache)`;
    `model.logits(hidden [..., D]) -> f32[..., V]`. Untied head: `lm_head.kernel [D, V]` (embed, vocab).
    Slice `hidden` to the positions you need before `logits` (e.g. `hidden[:, P-1:-1]` for response tokens):
    the vocabulary projection is the largest matmul of a small model.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA):
        self.cfg = cfg
        self.dtype = dtype
        self.backbone = Backbone(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                                 remat=remat, kernels=kernels)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            init = _Init(rngs, cfg.initializer_range, param_dtype)
            self.lm_head = nnx.Dict(kernel=init.normal((cfg.hidden_size, cfg.vocab_size), ("embed", "vocab")))

    def __call__(self, input_ids: Array, attention_mask: Array, position_ids: Array | None = None,
                 cache: KVCache | None = None, segment_ids: Array | None = None, prefix: PromptKV | None = None,
                 return_kv: bool = False) -> tuple[Array, KVCache | PromptKV | None]:
        return self.backbone.forward(input_ids, attention_mask, position_ids, cache, segment_ids, prefix, return_kv)

    @property
    def kernels(self) -> Kernels:
        """The backend operations the model runs (`kernels.py`)."""
        return self.backbone.kernels

    def logits(self, hidden: Array) -> Array:
        """hidden [..., D] -> logits f32[..., V] (matmul in the compute dtype, float32 accumulation)."""
        tied = self.lm_head is None
        weight = self.backbone.embed["embedding"][...] if tied else self.lm_head["kernel"][...]
        by_backend = self.kernels.head_logits(hidden, weight, tied)
        if by_backend is not None:
            return by_backend
        w = weight.astype(self.dtype)
        return matmul_float32_out(hidden.astype(self.dtype), w.T if tied else w)  # the transpose folds into the dot


def init_value_head(cfg: ModelConfig, key: Array, param_dtype=jnp.float32, init: str = "random") -> dict:
    """A new value head, kernel [D, 1] and bias [1]: "random", torch.nn.Linear's default init as TRL's `ValueHead`
    (both ~ U(-1/sqrt(D), 1/sqrt(D))), or "zeros" (every value starts at 0)."""
    if init == "zeros":
        return {"kernel": jnp.zeros((cfg.hidden_size, 1), param_dtype), "bias": jnp.zeros((1,), param_dtype)}
    if init != "random":
        raise ValueError(f"init={init!r}: a value head starts 'random' or 'zeros'")
    bound = 1.0 / math.sqrt(cfg.hidden_size)
    k1, k2 = jax.random.split(key)
    return {"kernel": jax.random.uniform(k1, (cfg.hidden_size, 1), param_dtype, -bound, bound),
            "bias": jax.random.uniform(k2, (1,), param_dtype, -bound, bound)}


def new_score_head(cfg: ModelConfig, key: Array, param_dtype=jnp.float32, init: str = "random") -> Array:
    """A new score head's kernel [D, 1]: "random", normal(0, initializer_range) as transformers initialises a
    missing score head, or "zeros"."""
    if init == "zeros":
        return jnp.zeros((cfg.hidden_size, 1), param_dtype)
    if init != "random":
        raise ValueError(f"init={init!r}: a score head starts 'random' or 'zeros'")
    return cfg.initializer_range * jax.random.normal(key, (cfg.hidden_size, 1), param_dtype)


class CausalLMWithValueHead(CausalLM):
    """A causal LM with a scalar value head on its final hidden states (TRL's legacy
    `AutoModelForCausalLMWithValueHead`; HF names `v_head.summary.{weight,bias}`).

    `hidden, cache = model(...)`; `model.logits(hidden) -> f32[B, S, V]`; `model.value(hidden) -> f32[B, S]`.
    `v_head.kernel [D, 1]` (embed, None), `v_head.bias [1]` (None,).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA):
        super().__init__(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                         remat=remat, kernels=kernels)
        init = init_value_head(cfg, rngs.params(), param_dtype)
        self.v_head = nnx.Dict(kernel=_param(init["kernel"], ("embed", None)), bias=_param(init["bias"], (None,)))

    def value(self, hidden: Array) -> Array:
        """hidden [B, S, D] -> values f32[B, S] (float32 matmul)."""
        w = self.v_head["kernel"][...].astype(jnp.float32)
        return (hidden.astype(jnp.float32) @ w)[..., 0] + self.v_head["bias"][...].astype(jnp.float32)[0]


class ScoreModel(nnx.Module):
    """Backbone + scalar `score` head: TRL's reward and value models (`XForSequenceClassification`, num_labels=1).

    `model(input_ids, attention_mask, position_ids=None) -> f32[B, S]` per-position scores; the reward of a
    sequence is the score at its last non-pad token (`last_token_scores`). `score.kernel [D, 1]` (embed, None),
    optional `score.bias [1]` (transformers' heads have none).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 bias: bool = False, scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA):
        self.cfg = cfg
        self.dtype = dtype
        self.backbone = Backbone(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                                 remat=remat, kernels=kernels)
        init = _Init(rngs, cfg.initializer_range, param_dtype)
        self.score = nnx.Dict(kernel=init.normal((cfg.hidden_size, 1), ("embed", None)))
        if bias:
            self.score["bias"] = init.zeros((1,), (None,))

    def scores(self, hidden: Array) -> Array:
        """hidden [B, S, D] -> f32[B, S] (float32 matmul)."""
        out = (hidden.astype(jnp.float32) @ self.score["kernel"][...].astype(jnp.float32))[..., 0]
        if "bias" in self.score:
            out = out + self.score["bias"][...].astype(jnp.float32)[0]
        return out

    def __call__(self, input_ids: Array, attention_mask: Array, position_ids: Array | None = None,
                 segment_ids: Array | None = None) -> Array:
        return self.scores(self.backbone(input_ids, attention_mask, position_ids, segment_ids))


# ---------------------------------------------------------------------------------------- functional helpers


def apply_causal_lm(graphdef, params, input_ids, attention_mask, position_ids=None, cache=None):
    """Pure forward of a split `CausalLM`: -> (logits f32[B, S, V], hidden [B, S, D], cache)."""
    model = nnx.merge(graphdef, params)
    hidden, cache = model(input_ids, attention_mask, position_ids, cache)
    return model.logits(hidden), hidden, cache


def apply_causal_lm_with_value(graphdef, params, input_ids, attention_mask, position_ids=None, cache=None):
    """Pure forward of a split `CausalLMWithValueHead`: -> (logits f32[B, S, V], values f32[B, S], cache)."""
    model = nnx.merge(graphdef, params)
    hidden, cache = model(input_ids, attention_mask, position_ids, cache)
    return model.logits(hidden), model.value(hidden), cache


def apply_score_model(graphdef, params, input_ids, attention_mask, position_ids=None):
    """Pure forward of a split `ScoreModel`: -> per-position scores f32[B, S]."""
    return nnx.merge(graphdef, params)(input_ids, attention_mask, position_ids)


def logical_axes(tree):
    """Logical axis names of every parameter.

    `tree`: an NNX module or a `State` (e.g. `nnx.split(model)[1]`). Returns the same structure (a State of
    Variables) whose values are tuples of axis names (`"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp",
    "layers", "norm", "positions"`, or None for an axis of size 1 that is never sharded). Map it to shardings with
    `jax.tree.map(rule, logical_axes(params), is_leaf=lambda x: isinstance(x, tuple))`; the result has the tree
    structure of `params`.
    """
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree

    def axes(v):
        names = v.get_metadata().get("out_sharding")
        if names is None:
            names = (None,) * np.ndim(v.get_value())
        return v.replace(tuple(names))

    return jax.tree.map(axes, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def count_params(tree) -> int:
    state = nnx.state(tree) if isinstance(tree, nnx.Module) else tree
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
