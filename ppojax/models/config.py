"""`ModelConfig`: one architecture-generic, hashable description of a decoder-only transformer.

It is read from (and written back to) a Hugging Face `config.json` dict by the family registered for its
`model_type` (`families/`), which follows transformers 5's reading of each key or refuses the checkpoint. Both the
transformers-5 layout (`rope_parameters`) and the older one (`rope_theta`, `rope_scaling`, `rotary_pct`,
`rotary_emb_base`) are read; `to_hf()` writes the transformers-5 layout plus the legacy `rope_theta` (and
`rotary_pct`/`rotary_emb_base` for GPT-NeoX).

The config is a frozen dataclass of immutable values (dicts are stored as sorted item tuples), so it can be a
static argument to `jax.jit` and an attribute of an NNX module (part of the graphdef).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ppojax.models.errors import ModelLoadError, UnsupportedModelError
from ppojax.models.families import SUPPORTED_ACTIVATIONS, SUPPORTED_ROPE_TYPES, HFConfig, family_for

__all__ = ["FrozenDict", "ModelConfig", "ModelLoadError", "SUPPORTED_ACTIVATIONS", "SUPPORTED_ROPE_TYPES",
           "UnsupportedModelError"]


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
        family_for(self.model_type, "ModelConfig")  # registered, or UnsupportedModelError listing them
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
    def from_hf(cls, config: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a Hugging Face config dict (`json.load(open("config.json"))` or `PretrainedConfig.to_dict()`).

        `source` names the dict's file in error messages. Raises `UnsupportedModelError` naming the supported model
        types / options, `ModelLoadError` for a missing or mistyped key.
        """
        c = HFConfig(config, source)
        family = family_for(c.get("model_type"), source)
        if c.peek("quantization_config") is not None:
            raise c.unsupported("quantization_config", c.peek("quantization_config"),
                                "unquantized checkpoints (dequantize it with transformers first)")
        kw = family.config_from_hf(c)
        # the keys every family shares; `to_hf` writes the same ones
        kw.update(model_type=c.model_type, initializer_range=c.number("initializer_range", 0.02),
                  pad_token_id=c.get("pad_token_id"))
        kw["extra"] = _freeze({k: v for k, v in config.items() if k not in c.used and k not in _NOT_KEPT})
        try:
            return cls(**kw)
        except UnsupportedModelError as err:
            raise UnsupportedModelError(f"{source}: {err}") from None
        except ValueError as err:
            raise ModelLoadError(f"{source}: {err}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config dict that transformers' `AutoConfig.for_model(**d)` / `from_pretrained` accepts."""
        d = _thaw(self.extra) if self.extra else {}
        d.update(family_for(self.model_type).config_to_hf(self))
        d.update(model_type=self.model_type, initializer_range=self.initializer_range, pad_token_id=self.pad_token_id)
        return d


# Keys of config.json that are not architecture and need not be kept (transformers re-derives them).
_NOT_KEPT = {
    "transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict",
}
