"""Model families looked up by `config.json`'s `model_type`.

A `Family` is everything ppojax knows about one Hugging Face architecture family: how its `config.json` maps to
`ModelConfig` fields (both ways), its ONE key table (checkpoint tensor <-> ppojax parameter, from which import and
export are both derived in `keys.py`), and the transformers class names it exports as. Adding a family is one
module that builds a `Family` and calls `register_family` (see `llama.py`), plus its import in `__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ppojax.models.errors import UnsupportedModelError

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig
    from ppojax.models.families.hf_config import HFConfig
    from ppojax.models.families.keys import Key

# Model kinds, named after transformers' classes: "causal_lm" (`XForCausalLM`), "score"
# (`XForSequenceClassification`, num_labels = 1), "backbone" (`XModel`, no head). TRL's value-head model
# (`AutoModelForCausalLMWithValueHead`) is exported as the family's "causal_lm" class.
HF_KINDS = ("causal_lm", "score", "backbone")


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture family.

    config_from_hf(HFConfig) -> dict of `ModelConfig` fields (all but model_type, initializer_range,
        pad_token_id and extra, which are generic). Read keys through the `HFConfig` so that the keys it does not
        interpret are kept verbatim for export; refuse (`HFConfig.unsupported`) any value whose effect on
        transformers' forward ppojax does not reproduce.
    config_to_hf(ModelConfig) -> the family's keys of a `config.json` that transformers loads with the same forward.
    backbone_keys(ModelConfig) -> the key table of the backbone: `Key` rows with names relative to the checkpoint
        ("{prefix}layers.{i}.self_attn.q_proj.weight") and paths in `Backbone`'s parameters.
    backbone_prefix: the backbone's attribute in transformers' task models ("model", "transformer", "gpt_neox").
    lm_head: the checkpoint name of the untied LM head ("lm_head.weight").
    architectures: model_type -> {kind in HF_KINDS: transformers class name}, written to `config.json`.
    ignored_tensors: name suffixes of tensors that carry no parameters (buffers older transformers saved).
    """

    name: str
    config_from_hf: Callable[[HFConfig], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    backbone_keys: Callable[[ModelConfig], list[Key]]
    backbone_prefix: str
    lm_head: str
    architectures: Mapping[str, Mapping[str, str]]
    ignored_tensors: tuple[str, ...] = ()


def transformers_classes(base: str) -> dict[str, str]:
    """The usual class names of a transformers family: `{base}ForCausalLM`, `{base}ForSequenceClassification`,
    `{base}Model`."""
    return {"causal_lm": f"{base}ForCausalLM", "score": f"{base}ForSequenceClassification", "backbone": f"{base}Model"}


_FAMILIES: dict[str, Family] = {}


def register_family(model_types: tuple[str, ...] | list[str], family: Family) -> None:
    """Make `family` the implementation of each `model_type` in `model_types`."""
    for model_type in model_types:
        missing = [kind for kind in HF_KINDS if kind not in family.architectures.get(model_type, {})]
        if missing:
            raise ValueError(f"family {family.name!r}: architectures[{model_type!r}] lacks the class names of "
                             f"{missing}")
        if _FAMILIES.get(model_type, family) is not family:
            raise ValueError(f"model_type {model_type!r} is already registered to family "
                             f"{_FAMILIES[model_type].name!r}")
        _FAMILIES[model_type] = family


def supported_model_types() -> tuple[str, ...]:
    """The registered model types, in registration order."""
    return tuple(_FAMILIES)


def family_for(model_type: Any, source: str = "config.json") -> Family:
    """The family registered for `model_type`; `UnsupportedModelError` naming the supported types otherwise."""
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        what = "has no model_type" if model_type is None else f"model_type {model_type!r} is not supported"
        raise UnsupportedModelError(f"{source}: {what}; ppojax supports {', '.join(supported_model_types())}")
    return family
