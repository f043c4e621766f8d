"""Reading a Hugging Face `config.json` dict the way transformers 5 does, for the families' `config_from_hf`.

`HFConfig` wraps the dict: it records which keys a family interpreted (the others are kept verbatim in
`ModelConfig.extra`, so an export writes them back), checks types, and words every error with the file name.
`rope_parameters` resolves RoPE with transformers' precedence; `attention_layer_types` reads `layer_types`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppojax.models.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig

_REQUIRED = object()

# transformers' ACT2FN names that `transformer.activation_fn` computes.
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu")
# RoPE variants ppojax computes (`transformer.rope_inv_freq`).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Keys each RoPE variant needs in its parameters (transformers' `validate_rope`).
_ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")}
# transformers' legacy layer-type names (configuration_utils._LEGACY_LAYER_TYPE_REMAP, for the types ppojax has).
_LEGACY_LAYER_TYPES = {"attention": "full_attention"}


class HFConfig:
    """A `config.json` dict being translated into `ModelConfig` fields.

    `get` marks a key as interpreted (`used`); `peek` reads a key that is only checked, so it stays in `extra`.
    `source` (the file) starts every error message.
    """

    def __init__(self, data: dict[str, Any], source: str = "config.json"):
        if not isinstance(data, dict):
            raise ModelLoadError(f"{source}: expected a JSON object of config keys, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.used: set[str] = set()

    @property
    def model_type(self) -> str:
        return self.data.get("model_type")

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.data.get(key, default)

    def peek(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    # ----------------------------------------------------------------------------------------- typed reads
    def size(self, *keys: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        """An integer >= `minimum` read from the first of `keys` present (aliases, e.g. "n_embd", "hidden_size");
        `default` when none is present (required when no default is given)."""
        for key in keys:
            if key in self.data:
                value = self.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                    raise self.error(key, value, "expected a positive integer" if minimum == 1 else
                                     f"expected an integer >= {minimum}")
                return value
            self.used.add(key)
        if default is _REQUIRED:
            raise ModelLoadError(f"{self.source}: required key {keys[0]!r} is missing (model_type "
                                 f"{self.model_type!r} needs it); add it to the file")
        return default

    def optional_size(self, key: str, default: int | None) -> int | None:
        """A positive integer, or None where the key is null (absent: `default`)."""
        if self.peek(key, default) is None:
            self.used.add(key)
            return None
        return self.size(key, default=default)

    def number(self, key: str, default: float) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, value, "expected a number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, value, "expected true or false")
        return value

    def activation(self, key: str, default: str) -> str:
        value = self.get(key, default)
        if value not in SUPPORTED_ACTIVATIONS:
            raise self.unsupported(key, value, ", ".join(SUPPORTED_ACTIVATIONS))
        return value

    # ------------------------------------------------------------------------------------------------ errors
    def error(self, key: str, value: Any, expected: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {key}={value!r}: {expected}")

    def unsupported(self, key: str, value: Any, supported: str, where: str = "") -> UnsupportedModelError:
        """An option transformers applies and ppojax does not: loading would silently change the model."""
        where = f" (read from {where})" if where else ""
        return UnsupportedModelError(f"{self.source}: {key} {value!r} is not supported for model_type "
                                     f"{self.model_type!r}{where}; ppojax supports {supported}")


def rope_parameters(c: HFConfig, *, theta: float, partial: float | None, max_position_embeddings: int
                    ) -> dict[str, Any]:
    """The RoPE parameters transformers 5 computes from `config.json` (with `rope_type` and `rope_theta`).

    transformers' precedence (configuration_utils `convert_rope_params_to_dict`, modeling_rope_utils
    `standardize_rope_params`, which the model's rotary embedding calls again once the config is built):
    a non-empty legacy `rope_scaling` replaces `rope_parameters` entirely; `rope_theta` / `partial_rotary_factor`
    inside the dict win over `theta` / `partial` (the family's fallbacks, e.g. the top-level `rope_theta`);
    `type` is the legacy name of `rope_type`; for `llama3` a top-level `original_max_position_embeddings` wins over
    the dict's, and `max_position_embeddings` is the default.
    """
    scaling, params = c.get("rope_scaling"), c.get("rope_parameters")
    chosen = "rope_scaling" if scaling else "rope_parameters"
    rope = scaling or params or {}
    if not isinstance(rope, dict):
        raise c.error(chosen, rope, "expected an object of RoPE parameters")
    if any(isinstance(v, dict) for v in rope.values()):
        raise c.unsupported(chosen, rope, "one set of RoPE parameters for all layers (not one per layer type)")
    rope = dict(rope)
    rope.setdefault("rope_theta", theta)
    if partial is not None:
        rope.setdefault("partial_rotary_factor", partial)
    legacy_type = rope.pop("type", "default")
    rope.setdefault("rope_type", legacy_type)
    if rope["rope_type"] == "llama3":
        if "original_max_position_embeddings" in c:
            rope["original_max_position_embeddings"] = c.get("original_max_position_embeddings")
        else:
            rope.setdefault("original_max_position_embeddings", max_position_embeddings)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise c.unsupported("rope_type", rope["rope_type"], f"rope_type {', '.join(SUPPORTED_ROPE_TYPES)}",
                            where=chosen)
    missing = [k for k in _ROPE_NEEDS.get(rope["rope_type"], ()) if rope.get(k) is None]
    if missing:
        raise c.error(chosen, rope, f"rope_type {rope['rope_type']!r} needs {missing}")
    for key in ("rope_theta", "partial_rotary_factor", "factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        if key in rope and (isinstance(rope[key], bool) or not isinstance(rope[key], (int, float))):
            raise c.error(f"{chosen}.{key}", rope[key], "expected a number")
    return rope


def vocab_and_tokens(c: HFConfig, *, tie: bool, bos: int | None, eos: int | None) -> dict[str, Any]:
    """The `ModelConfig` fields of the standard keys vocab_size, tie_word_embeddings, bos/eos_token_id (the
    arguments are the model type's transformers defaults)."""
    return dict(vocab_size=c.size("vocab_size"), tie_word_embeddings=c.flag("tie_word_embeddings", tie),
                bos_token_id=c.get("bos_token_id", bos), eos_token_id=c.get("eos_token_id", eos))


def vocab_and_tokens_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of `vocab_and_tokens`."""
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                bos_token_id=cfg.bos_token_id, eos_token_id=eos)


def attention_layer_types(c: HFConfig, num_layers: int) -> tuple[str, ...] | None:
    """`layer_types` ("full_attention" / "sliding_attention" per layer, legacy names mapped), or None if absent."""
    types = c.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        raise c.error("layer_types", types, f"expected a list of {num_layers} layer types (one per layer)")
    types = tuple(_LEGACY_LAYER_TYPES.get(t, t) for t in types)
    other = sorted({t for t in types if t not in ("full_attention", "sliding_attention")}, key=str)
    if other:
        raise c.unsupported("layer_types", other, "'full_attention' and 'sliding_attention' layers")
    return types
