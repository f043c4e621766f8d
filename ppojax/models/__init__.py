"""Flax NNX causal LMs (GPT-2, Llama, Mistral, Qwen2, Qwen3, GPT-NeoX) with value/score heads, KV cache,
logical axis names, and Hugging Face checkpoint import/export.

Typical use::

    model, cfg = load_pretrained("path/to/hf_dir")                 # CausalLM
    graphdef, params = nnx.split(model)
    logits, hidden, _ = jax.jit(apply_causal_lm, static_argnums=0)(graphdef, params, ids, mask)
    save_pretrained(nnx.merge(graphdef, params), cfg, "out_dir", tokenizer=load_tokenizer("path/to/hf_dir"))
"""

from ppojax.models.attention import ATTENTION_IMPLEMENTATIONS
from ppojax.models.config import ModelConfig
from ppojax.models.errors import ModelLoadError, UnsupportedModelError
from ppojax.models.families import Family, family_for, register_family, supported_model_types
from ppojax.models.hf_io import (abstract_pretrained, load_config, load_pretrained, load_tokenizer, read_params,
                                 save_pretrained)
from ppojax.models.transformer import (
    Backbone,
    CausalLM,
    CausalLMWithValueHead,
    ScoreModel,
    apply_causal_lm,
    apply_causal_lm_with_value,
    apply_score_model,
    count_params,
    last_token_index,
    last_token_scores,
    logical_axes,
    new_score_head,
    position_ids_from_mask,
)
from ppojax.models.kernels import XLA, Kernels
from ppojax.models.kv_cache import KVCache, init_cache
from ppojax.models.precision import PRECISIONS, precision_dtypes
from ppojax.models.remat import REMAT_POLICIES

__all__ = [
    "ModelConfig", "ModelLoadError", "UnsupportedModelError",
    "Family", "family_for", "register_family", "supported_model_types",
    "abstract_pretrained", "load_config", "load_pretrained", "load_tokenizer", "read_params", "save_pretrained",
    "Backbone", "CausalLM", "CausalLMWithValueHead", "KVCache", "ScoreModel",
    "apply_causal_lm", "apply_causal_lm_with_value", "apply_score_model", "count_params", "init_cache",
    "last_token_index", "last_token_scores", "logical_axes", "new_score_head", "position_ids_from_mask",
    "Kernels", "XLA",
    "ATTENTION_IMPLEMENTATIONS", "PRECISIONS", "REMAT_POLICIES", "precision_dtypes",
]
