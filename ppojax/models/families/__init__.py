"""Model families registered by `config.json`'s `model_type`: one module per family, each with its config
translation (both ways) and ONE key table from which checkpoint import and export are derived (`keys.py`).

Adding a family: a module like `llama.py` that builds a `Family` and calls `register_family(model_types, family)`,
imported below.
"""

from ppojax.models.errors import ModelLoadError, UnsupportedModelError
from ppojax.models.families.hf_config import SUPPORTED_ACTIVATIONS, SUPPORTED_ROPE_TYPES, HFConfig
from ppojax.models.families.keys import (KINDS, Key, Split, T, Unflatten, hf_to_params, key_table, params_to_hf,
                                         tensor_name)
from ppojax.models.families.registry import (Family, family_for, register_family, supported_model_types,
                                             transformers_classes)

# The built-in families, in the order `supported_model_types()` lists them.
from ppojax.models.families import gpt2, llama, gpt_neox  # noqa: E402, F401, I001  (registration happens on import)

__all__ = [
    "Family", "HFConfig", "KINDS", "Key", "ModelLoadError", "SUPPORTED_ACTIVATIONS", "SUPPORTED_ROPE_TYPES", "Split",
    "T", "Unflatten", "UnsupportedModelError", "family_for", "hf_to_params", "key_table", "params_to_hf",
    "register_family", "supported_model_types", "tensor_name", "transformers_classes",
]
