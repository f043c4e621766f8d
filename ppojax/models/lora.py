"""LoRA adapters (Hu et al. 2021) on the stacked projection kernels, in PEFT's conventions.

An adapted projection computes `y = x @ W + scale * (x @ A) @ B` with `scale = alpha / r` (PEFT's `LoraConfig(r,
lora_alpha)`, rsLoRA off). A is drawn as PEFT draws it (`kaiming_uniform(a=sqrt(5))`: U(-1/sqrt(in), 1/sqrt(in)))
and B is zero, so a freshly adapted model computes exactly the base model.

Layout. The adapters sit beside the kernel they adapt, stacked over layers like it (`transformer.Backbone`):
`layers.attn.q.lora_a [L, D, r]`, `layers.attn.q.lora_b [L, r, H, hd]`; for `o [L, H, hd, D]`: `lora_a [L, H, hd,
r]`, `lora_b [L, r, D]`. They are `nnx.LoRAParam`s (Flax's own LoRA variable type, a `Param`), so
`nnx.split(model, nnx.LoRAParam, ...)` separates adapters from base weights, and they carry logical axis names
(`lora_a`: the kernel's input axes then None; `lora_b`: None then its output axes) so that the sharding rules
place them as their kernel.

Why not `nnx.LoRA` / `nnx.LoRALinear` or qwix: both wrap a module's 2-D matmul (a `Linear`, or an intercepted
`dot_general` of a named module), while here every layer's projections are raw kernels of ONE Backbone module,
stacked `[L, ...]` and run under `lax.scan` on a pure dict; the adapters have to live in that dict, with the same
stacking, and the rank-r path is two matmuls in `transformer._with_lora`.

Targets are named as PEFT / transformers name the modules (`q_proj`, `o_proj`, `down_proj`, GPT-2's `c_proj`, ...),
derived from each family's key table (`families/keys.py`): a per-layer `*.weight` of an unfused projection. Fused
ones (GPT-2's `c_attn`, GPT-NeoX's `query_key_value`) are refused: PEFT adapts the fused matrix with ONE A shared by
q, k and v, which ppojax's separate q/k/v kernels cannot express.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ppojax.models.config import ModelConfig
from ppojax.models.families.keys import Split, T, key_table

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear projection of the blocks (never the LM head)

# input axes (after `layers`) of each projection kernel: `o` reads [H, hd], the others one axis
_INPUT_AXES = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha (scale = alpha / r), target module names (resolved, e.g. ("q_proj", "v_proj")), and the dropout
    recorded for PEFT (`adapter_config.json`); PPO runs the adapters without dropout, as TRL does."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class Target:
    """One adaptable projection: its path under `backbone` (e.g. ("layers", "attn", "q")), its input axis count,
    the transformers module name template ("{prefix}layers.{i}.self_attn.q_proj") and whether transformers stores
    its weight [in, out] (GPT-2's Conv1D; PEFT's fan_in_fan_out) rather than nn.Linear's [out, in]."""

    path: tuple[str, ...]
    n_in: int
    hf_module: str
    fan_in_fan_out: bool

    @property
    def name(self) -> str:
        return self.hf_module.rsplit(".", 1)[-1]


def _projection_keys(cfg: ModelConfig):
    for key in key_table(cfg, "backbone"):
        if (key.per_layer and key.path[0] == "layers" and key.path[-1] == "kernel" and key.hf.endswith(".weight")
                and key.path[-2] in _INPUT_AXES):
            yield key


def available_targets(cfg: ModelConfig) -> dict[str, list[Target]]:
    """PEFT target name -> the projections it adapts (GPT-2's `c_proj` names two), for this model's family."""
    out: dict[str, list[Target]] = {}
    for key in _projection_keys(cfg):
        if any(isinstance(op, Split) for op in key.ops):
            continue
        target = Target(key.path[:-1], _INPUT_AXES[key.path[-2]], key.hf[:-len(".weight")],
                        fan_in_fan_out=not (key.ops and isinstance(key.ops[0], T)))
        out.setdefault(target.name, []).append(target)
    return out


def fused_modules(cfg: ModelConfig) -> list[str]:
    """Names of fused projections (one transformers module holding q|k|v), which LoRA cannot target here."""
    names = {key.hf[:-len(".weight")].rsplit(".", 1)[-1] for key in _projection_keys(cfg)
             if any(isinstance(op, Split) for op in key.ops)}
    return sorted(names)


def resolve_target_modules(cfg: ModelConfig, requested: str | Sequence[str]) -> tuple[str, ...]:
    """`lora_target_modules` ('all-linear', or names) -> the names, checked against the model's family.

    Raises ValueError naming every unknown or fused name, the names this model has and the fix."""
    available = available_targets(cfg)
    fused = fused_modules(cfg)
    names = [requested] if isinstance(requested, str) else list(requested)
    if names == [ALL_LINEAR]:
        if fused:
            raise ValueError(
                f"lora_target_modules='all-linear' on a {cfg.model_type} model includes the fused "
                f"{', '.join(fused)} (q|k|v in one matrix: PEFT adapts it with one A shared by q, k and v, which "
                f"ppojax's separate q/k/v projections cannot express). Fix: list the modules to adapt, from "
                f"{sorted(available)}.")
        return tuple(available)
    problems = []
    for name in names:
        if name in fused:
            problems.append(f"{name!r} is a fused q|k|v projection in {cfg.model_type} (PEFT adapts it with one A "
                            "shared by q, k and v; ppojax's projections are separate)")
        elif name not in available:
            problems.append(f"{name!r} is not a projection of a {cfg.model_type} model")
    if problems:
        raise ValueError(f"lora_target_modules={list(names)!r}: {'; '.join(problems)}. Fix: use names from "
                         f"{sorted(available)}, or 'all-linear'.")
    if len(set(names)) != len(names):
        raise ValueError(f"lora_target_modules={list(names)!r} names a module twice; list each once.")
    return tuple(names)


# ------------------------------------------------------------------------------------------- adapters on a model


def _projection(backbone, path: tuple[str, ...]):
    node = backbone
    for part in path:
        node = getattr(node, part) if isinstance(node, nnx.Module) else node[part]
    return node


def add_lora(model, spec: LoraSpec, key: jax.Array):
    """Attach LoRA adapters to `model` (a `CausalLM` or `ScoreModel`; changed in place and returned).

    For each projection of `spec.target_modules`: `lora_a [L, *in, r]` ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's
    kaiming_uniform(a=sqrt(5))), `lora_b [L, r, *out]` = 0, in the kernel's parameter dtype; and
    `backbone.lora_scale = alpha / r`. The model then computes the base model exactly, until B moves."""
    backbone = model.backbone
    if backbone.lora_scale is not None:
        raise ValueError("the model already has LoRA adapters")
    available = available_targets(model.cfg)
    targets = [t for name in spec.target_modules for t in available[name]]
    kernels = [_projection(backbone, target.path)["kernel"] for target in targets]
    shapes = tuple((kernel.shape, target.n_in, jnp.dtype(kernel.dtype)) for kernel, target in zip(kernels, targets))
    adapters = _initial_adapters(key, shapes, spec.rank)
    for target, kernel, (a, b) in zip(targets, kernels, adapters):
        proj = _projection(backbone, target.path)
        axes = tuple(kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim)
        n_in = target.n_in
        proj["lora_a"] = nnx.LoRAParam(a, out_sharding=axes[:1 + n_in] + (None,), eager_sharding=False)
        proj["lora_b"] = nnx.LoRAParam(b, out_sharding=axes[:1] + (None,) + axes[1 + n_in:], eager_sharding=False)
    backbone.lora_scale = spec.scale
    return model


@functools.partial(jax.jit, static_argnums=(1, 2))
def _initial_adapters(key, shapes: tuple, rank: int) -> list:
    """[(lora_a, lora_b)] for kernels of `shapes` ((shape, n_in, dtype) each): A ~ U(-1/sqrt(in), 1/sqrt(in))
    with one key of `split(key, len(shapes))` each, B = 0. One program for every adapter (a draw per shape
    would compile a program per shape)."""
    out = []
    for (shape, n_in, dtype), k in zip(shapes, jax.random.split(key, len(shapes))):
        in_shape, out_shape = shape[1:1 + n_in], shape[1 + n_in:]
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        out.append((jax.random.uniform(k, (shape[0], *in_shape, rank), dtype, -bound, bound),
                    jnp.zeros((shape[0], rank, *out_shape), dtype)))
    return out


# Heads a model gets new, so they train with the adapters (PEFT's modules_to_save): the legacy value head.
TRAINED_HEADS = nnx.PathContains("v_head")
TRAINABLE = nnx.Any(nnx.LoRAParam, TRAINED_HEADS)


def with_lora(model, spec: LoraSpec, key: jax.Array):
    """Split `model` for LoRA training -> (base_graphdef, lora_graphdef, trainable, base).

    trainable: the adapters, and a legacy value head (`v_head`) if the model has one (it is new: it trains);
    base: every other weight, frozen. `nnx.merge(lora_graphdef, base, trainable)` is the adapted model;
    `nnx.merge(base_graphdef, base, heads(trainable))` the model as given (adapters off). `base` holds the very
    arrays of `model` (no copy); the caller's `model` gets no adapters.
    """
    base_graphdef, state = nnx.split(model)
    model = add_lora(nnx.merge(base_graphdef, state), spec, key)  # a new module on the same arrays
    lora_graphdef, trainable, base = nnx.split(model, TRAINABLE, ...)
    return base_graphdef, lora_graphdef, trainable, base


def heads(trainable: nnx.State) -> nnx.State:
    """The trained heads of `trainable` (no adapters): what the base graph needs besides the frozen base."""
    return nnx.split_state(trainable, nnx.LoRAParam, ...)[1]


def _adapted_projections(adapters_pure: dict, prefix=()):
    """(path, {"lora_a", "lora_b"}) of every adapted projection in a pure dict of adapters."""
    if "lora_a" in adapters_pure:
        yield prefix, adapters_pure
        return
    for name, child in adapters_pure.items():
        if isinstance(child, dict):
            yield from _adapted_projections(child, prefix + (name,))


def lora_delta(a: jax.Array, b: jax.Array, scale: float, kernel_shape: tuple) -> jax.Array:
    """scale * A @ B as a kernel: a [L, *in, r], b [L, r, *out] -> f32[L, *in, *out] (float32 accumulation)."""
    L, r = a.shape[0], a.shape[-1]
    ab = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r).astype(jnp.float32), b.reshape(L, r, -1).astype(jnp.float32))
    return (scale * ab).reshape(kernel_shape)


def merge_lora(base: nnx.State, adapters: nnx.State, scale: float) -> nnx.State:
    """The base State with every adapted kernel replaced by `W + scale * A @ B` (in W's dtype), plus the trained
    heads of `adapters` (`heads`): the State of the model without adapters that computes what the adapted model
    computes (sampling, the merged HF export). Pure: traces under `jit`; `base` is not changed."""
    flat = dict(nnx.to_flat_state(base)) | dict(nnx.to_flat_state(heads(adapters)))
    for path, ab in _adapted_projections(nnx.to_pure_dict(adapters)):
        var = flat[path + ("kernel",)]
        kernel = var.get_value()
        merged = kernel.astype(jnp.float32) + lora_delta(ab["lora_a"], ab["lora_b"], scale, kernel.shape)
        flat[path + ("kernel",)] = var.replace(merged.astype(kernel.dtype))
    return nnx.from_flat_state(list(flat.items()))

