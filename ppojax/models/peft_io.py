"""LoRA adapters -> a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`).

`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)` then computes what the
ppojax policy computes. PEFT's format: per layer and adapted module, `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (nn.Linear layout, for GPT-2's Conv1D modules too), scaling alpha / r.
The in/out axes flatten in the order the family's key table unflattens them (C order), so a ppojax
`lora_a [L, *in, r]` becomes `lora_A[i] = lora_a[i].reshape(in, r).T`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from flax import nnx

from ppojax.io.export_dir import check_export_target, write_export_dir
from ppojax.models.config import ModelConfig
from ppojax.models.families.keys import backbone_prefix
from ppojax.models.hf_io import write_safetensors
from ppojax.models.lora import LoraSpec, available_targets

PEFT_PREFIX = "base_model.model."


def adapter_tensors(adapters, cfg: ModelConfig, spec: LoraSpec) -> dict[str, np.ndarray]:
    """`{PEFT tensor name: array}` of the adapters (an nnx State or pure dict of a CausalLM's adapters)."""
    pure = nnx.to_pure_dict(adapters) if isinstance(adapters, nnx.State) else adapters
    prefix = backbone_prefix(cfg, "causal_lm")
    out = {}
    for name in spec.target_modules:
        for target in available_targets(cfg)[name]:
            node = pure["backbone"]
            for part in target.path:
                node = node[part]
            a, b = np.asarray(node["lora_a"], np.float32), np.asarray(node["lora_b"], np.float32)
            r = a.shape[-1]
            for i in range(a.shape[0]):
                module = PEFT_PREFIX + target.hf_module.format(prefix=prefix, i=i)
                out[f"{module}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, r).T)
                out[f"{module}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(r, -1).T)
    return out


def adapter_config(cfg: ModelConfig, spec: LoraSpec, base_model_name_or_path: str | None = None) -> dict:
    """PEFT's `LoraConfig` as `adapter_config.json` holds it (task CAUSAL_LM, no bias, rsLoRA / DoRA off)."""
    fan_in_fan_out = any(t.fan_in_fan_out for n in spec.target_modules for t in available_targets(cfg)[n])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": sorted(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def save_peft_adapter(adapters, cfg: ModelConfig, spec: LoraSpec, out_dir: str | os.PathLike, *,
                      base_model_name_or_path: str | None = None, tokenizer=None) -> Path:
    """Write the PEFT adapter directory (float32 tensors; the tokenizer too when given), whole or not at all, and
    not into a directory of other files (`ppojax.io.export_dir`). Returns the directory."""
    check_export_target(out_dir)
    tensors = adapter_tensors(adapters, cfg, spec)

    def build(out: Path):
        write_safetensors(out / "adapter_model.safetensors", tensors, metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(
            json.dumps(adapter_config(cfg, spec, base_model_name_or_path), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(out)

    return write_export_dir(out_dir, build, kind="peft_adapter")
