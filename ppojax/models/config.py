"""`ModelConfig`: one architecture-generic, hashable description of a decoder-only transformer.

It is read from (and written back to) a Hugging Face `config.json` dict. Both the transformers-5 layout
(`rope_parameters`) and the older one (`rope_theta`, `rope_scaling`, `rotary_pct`, `rotary_emb_base`) are read;
`to_hf()` writes the transformers-5 layout plus the legacy `rope_theta`/`rope_scaling` keys.

The config is a frozen dataclass of immutable values (dicts are stored as sorted item tuples), so it can be a
static argument to `jax.jit` and an attribute of an NNX module (part of the graphdef).
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")


class UnsupportedModelError(ValueError):
    """A checkpoint whose architecture or options ppojax does not implement."""


class FrozenDict(tuple):
    """A dict stored as a sorted tuple of (key, value) items: hashable, so configs can be jit-static."""

    def to_dict(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self}


def _freeze(value: Any) -> Any:
    """dict -> FrozenDict, list -> tuple, recursively (so the config stays hashable)."""
    if isinstance(value, dict):
        return FrozenDict(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenDict):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only LM (all sizes static).

    Fields are architecture-generic; `from_hf` fills the per-architecture choices (norm type, gated MLP, biases,
    learned vs rotary positions, parallel residual, ...).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    # normalisation: "rms" (Llama family) or "layer" (LayerNorm with bias: GPT-2, GPT-NeoX)
    norm_type: str = "rms"
    norm_eps: float = 1e-6
    # MLP: gated = down(act(gate(x)) * up(x)) (Llama family); else down(act(up(x))) (GPT-2, GPT-NeoX)
    activation: str = "silu"
    gated_mlp: bool = True
    mlp_bias: bool = False
    # attention
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    attn_scale_by_inverse_layer_idx: bool = False  # GPT-2 option: scores / (layer_idx + 1)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # "full_attention" / "sliding_attention" per layer (None: all
    #                                             layers slide when sliding_window is set)
    # positions: "rope" or "learned" (GPT-2 absolute position embeddings)
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_scaling: FrozenDict | None = None  # frozen dict; rope_type in SUPPORTED_ROPE_TYPES
    partial_rotary_factor: float = 1.0  # GPT-NeoX: rotate only the first fraction of head_dim
    # residual: parallel = x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX); else sequential pre-norm
    parallel_residual: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # anything else of the original config.json we do not interpret, kept for a faithful export
    extra: FrozenDict = FrozenDict()

    def __post_init__(self):
        # accept plain dicts / lists from hand-written configs; store them frozen (hashable)
        for name in ("rope_scaling", "extra"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, _freeze(value) if value else (None if name == "rope_scaling"
                                                                                else FrozenDict()))
        for name in ("layer_types", "eos_token_id"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported; ppojax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.activation not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation {self.activation!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}")
        if self.norm_type not in ("rms", "layer"):
            raise ValueError(f"norm_type must be 'rms' or 'layer', got {self.norm_type!r}")
        if self.position_embedding not in ("rope", "learned"):
            raise ValueError(f"position_embedding must be 'rope' or 'learned', got {self.position_embedding!r}")
        rope_type = self.rope_scaling_dict.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; ppojax supports {', '.join(SUPPORTED_ROPE_TYPES)}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    # ------------------------------------------------------------------ derived
    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return self.rope_scaling.to_dict() if self.rope_scaling else {}

    @property
    def rotary_dim(self) -> int:
        """Number of leading head_dim channels that RoPE rotates (even)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it uses the sliding window."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config dict (`json.load(open("config.json"))` or `PretrainedConfig.to_dict()`).

        Raises `UnsupportedModelError` naming the supported model types / options.
        """
        c = dict(config)
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; ppojax supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gpt2":
            kw = _gpt2_from_hf(c)
        elif model_type == "gpt_neox":
            kw = _neox_from_hf(c)
        else:
            kw = _llama_family_from_hf(c)
        default_bos, default_eos = kw.pop("default_bos"), kw.pop("default_eos")
        eos = c.get("eos_token_id", default_eos)
        kw.update(
            model_type=model_type,
            initializer_range=float(c.get("initializer_range", 0.02)),
            pad_token_id=c.get("pad_token_id"),
            bos_token_id=c.get("bos_token_id", default_bos),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )
        used = kw.pop("_used")
        extra = {k: v for k, v in c.items() if k not in used and k not in _NOT_KEPT}
        kw["extra"] = _freeze(extra)
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """A config dict that transformers' `AutoConfig.for_model(**d)` / `from_pretrained` accepts."""
        d = _thaw(self.extra) if self.extra else {}
        rope = dict(self.rope_scaling_dict)
        rope_type = rope.pop("rope_type", "default")
        rope_parameters = {"rope_type": rope_type, "rope_theta": self.rope_theta, **rope}
        if self.model_type == "gpt2":
            d.update(
                n_embd=self.hidden_size, n_layer=self.num_layers, n_head=self.num_heads,
                n_inner=self.intermediate_size, n_positions=self.max_position_embeddings,
                activation_function=self.activation, layer_norm_epsilon=self.norm_eps,
                scale_attn_by_inverse_layer_idx=self.attn_scale_by_inverse_layer_idx,
            )
        elif self.model_type == "gpt_neox":
            rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
            d.update(
                hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads, intermediate_size=self.intermediate_size,
                max_position_embeddings=self.max_position_embeddings, hidden_act=self.activation,
                layer_norm_eps=self.norm_eps, use_parallel_residual=self.parallel_residual,
                attention_bias=self.qkv_bias, rope_parameters=rope_parameters,
                rotary_pct=self.partial_rotary_factor, rotary_emb_base=self.rope_theta,
            )
        else:
            d.update(
                hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                max_position_embeddings=self.max_position_embeddings, hidden_act=self.activation,
                rms_norm_eps=self.norm_eps, rope_parameters=rope_parameters, rope_theta=self.rope_theta,
            )
            if self.model_type in ("llama", "qwen3"):
                d["attention_bias"] = self.qkv_bias
            if self.model_type == "llama":
                d["mlp_bias"] = self.mlp_bias
            if self.model_type in ("mistral", "qwen2", "qwen3"):
                d["sliding_window"] = self.sliding_window
            if self.model_type in ("qwen2", "qwen3"):
                d["use_sliding_window"] = self.sliding_window is not None
                d["layer_types"] = list(self.layer_types or ("full_attention",) * self.num_layers)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d.update(
            model_type=self.model_type, vocab_size=self.vocab_size,
            tie_word_embeddings=self.tie_word_embeddings, initializer_range=self.initializer_range,
            pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id, eos_token_id=eos,
        )
        return d


# Keys of config.json that are not architecture and need not be kept (transformers re-derives them).
_NOT_KEPT = {
    "transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "rope_scaling",
    "rope_parameters", "rope_theta", "rotary_pct", "rotary_emb_base", "partial_rotary_factor",
    "use_cache", "output_attentions", "output_hidden_states", "return_dict",
}


def _rope_from_hf(c: dict[str, Any], default_theta: float, default_partial: float = 1.0):
    """(rope_theta, rope_scaling frozen dict or None, partial_rotary_factor) from either config layout."""
    params = dict(c.get("rope_parameters") or {})
    legacy = dict(c.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    theta = params.pop("rope_theta", None) or c.get("rope_theta") or c.get("rotary_emb_base") or default_theta
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = c.get("partial_rotary_factor", c.get("rotary_pct", default_partial))
    scaling = {**legacy, **params}
    scaling.pop("type", None)
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    if scaling:
        rope_type = scaling["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported; ppojax supports {', '.join(SUPPORTED_ROPE_TYPES)}")
        if rope_type == "llama3":
            scaling.setdefault("original_max_position_embeddings", c.get("max_position_embeddings"))
            missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in scaling]
            if missing:
                raise ValueError(f"rope_type 'llama3' needs {missing} in rope_parameters/rope_scaling")
        if rope_type == "linear" and "factor" not in scaling:
            raise ValueError("rope_type 'linear' needs 'factor' in rope_parameters/rope_scaling")
    return float(theta), (_freeze(scaling) if scaling else None), float(partial)


def _llama_family_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    mt = c["model_type"]
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or (128 if mt == "qwen3" else hidden // heads)
    theta, scaling, partial = _rope_from_hf(c, 10000.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported for {mt}")
    n_layers = c["num_hidden_layers"]
    sliding_window, layer_types = None, None
    if mt == "mistral":
        sliding_window = c.get("sliding_window", 4096)
    elif mt in ("qwen2", "qwen3"):
        if c.get("use_sliding_window", False):
            sliding_window = c.get("sliding_window", 4096)
            lt = c.get("layer_types")
            if lt is None:
                mwl = c.get("max_window_layers", 28)
                lt = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n_layers)]
            layer_types = tuple(lt)
    if mt == "qwen2":
        qkv_bias, out_bias = True, False
    elif mt == "mistral":
        qkv_bias = out_bias = False
    else:
        qkv_bias = out_bias = bool(c.get("attention_bias", False))
    used = {"hidden_size", "num_attention_heads", "head_dim", "num_hidden_layers", "num_key_value_heads",
            "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act", "attention_bias",
            "mlp_bias", "sliding_window", "use_sliding_window", "layer_types", "max_window_layers",
            "tie_word_embeddings", "vocab_size", "model_type", "initializer_range", "pad_token_id",
            "bos_token_id", "eos_token_id", "pretraining_tp"}
    return dict(
        vocab_size=c["vocab_size"], hidden_size=hidden, num_layers=n_layers, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=c["intermediate_size"],
        max_position_embeddings=c.get("max_position_embeddings", 32768 if mt in ("qwen2", "qwen3") else 2048),
        norm_type="rms", norm_eps=float(c.get("rms_norm_eps", 1e-6)), activation=c.get("hidden_act", "silu"),
        gated_mlp=True, mlp_bias=bool(c.get("mlp_bias", False)) if mt == "llama" else False,
        qkv_bias=qkv_bias, out_bias=out_bias, qk_norm=(mt == "qwen3"),
        sliding_window=sliding_window, layer_types=layer_types,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=1.0,
        parallel_residual=False, tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        default_bos=1 if mt in ("llama", "mistral") else None, default_eos=2 if mt in ("llama", "mistral") else None,
        _used=used,
    )


def _gpt2_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    hidden = c.get("n_embd", c.get("hidden_size", 768))
    heads = c.get("n_head", c.get("num_attention_heads", 12))
    if c.get("add_cross_attention", False):
        raise UnsupportedModelError("GPT-2 with add_cross_attention=True is not supported")
    if not c.get("scale_attn_weights", True):
        raise UnsupportedModelError("GPT-2 with scale_attn_weights=False is not supported")
    used = {"n_embd", "hidden_size", "n_head", "num_attention_heads", "n_layer", "num_hidden_layers", "n_inner",
            "n_positions", "max_position_embeddings", "activation_function", "layer_norm_epsilon",
            "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
            "add_cross_attention", "tie_word_embeddings", "vocab_size", "model_type", "initializer_range",
            "pad_token_id", "bos_token_id", "eos_token_id"}
    return dict(
        vocab_size=c.get("vocab_size", 50257), hidden_size=hidden,
        num_layers=c.get("n_layer", c.get("num_hidden_layers", 12)), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=c.get("n_inner") or 4 * hidden,
        max_position_embeddings=c.get("n_positions", c.get("max_position_embeddings", 1024)),
        norm_type="layer", norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
        activation=c.get("activation_function", "gelu_new"), gated_mlp=False, mlp_bias=True,
        qkv_bias=True, out_bias=True, qk_norm=False,
        attn_scale_by_inverse_layer_idx=bool(c.get("scale_attn_by_inverse_layer_idx", False)),
        position_embedding="learned", parallel_residual=False,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)), default_bos=50256, default_eos=50256,
        _used=used,
    )


def _neox_from_hf(c: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    theta, scaling, partial = _rope_from_hf(c, 10000.0, default_partial=0.25)
    bias = bool(c.get("attention_bias", True))
    used = {"hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "use_parallel_residual", "attention_bias",
            "tie_word_embeddings", "vocab_size", "model_type", "initializer_range", "pad_token_id",
            "bos_token_id", "eos_token_id"}
    return dict(
        vocab_size=c["vocab_size"], hidden_size=hidden, num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, intermediate_size=c["intermediate_size"],
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        norm_type="layer", norm_eps=float(c.get("layer_norm_eps", 1e-5)), activation=c.get("hidden_act", "gelu"),
        gated_mlp=False, mlp_bias=True, qkv_bias=bias, out_bias=bias, qk_norm=False,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
        parallel_residual=bool(c.get("use_parallel_residual", True)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)), default_bos=0, default_eos=2,
        _used=used,
    )
