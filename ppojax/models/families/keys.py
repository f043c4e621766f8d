"""Hugging Face tensor names <-> ppojax parameters, derived from each family's ONE key table, in both directions.

A family declares its backbone as a list of `Key` rows: the checkpoint name (a template: `{prefix}` is the
backbone prefix, `{i}` the layer index of a per-layer tensor), the tensor's shape in the checkpoint, the path of
the ppojax parameter, and a chain of reversible `ops` that turns the checkpoint tensor into the ppojax array.
`hf_to_params` applies the ops (and stacks per-layer tensors along a leading `layers` axis); `params_to_hf` runs
the same rows backwards. This module is the only code that walks a key table; no family writes either direction.

transformers' `nn.Linear.weight` is [out, in] (ppojax kernels are [in, out]: `T()`); GPT-2's `Conv1D.weight` is
already [in, out]. A fused tensor (GPT-2's q|k|v `c_attn`, GPT-NeoX's `query_key_value`) is one row per part, each
taking its part with `Split(axis, sizes, part)` (after an `Unflatten` where the parts interleave, as NeoX's heads
do); the export concatenates the parts back along that axis.

kinds: "causal_lm" (`XForCausalLM`), "score" (`XForSequenceClassification`, num_labels = 1), "value_head" (TRL's
`AutoModelForCausalLMWithValueHead`: causal LM + `v_head.summary.{weight,bias}`), "backbone" (`XModel`, no head).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING, Callable, Iterable

import numpy as np

from ppojax.models.families.registry import Family, family_for

if TYPE_CHECKING:
    from ppojax.models.config import ModelConfig

KINDS = ("causal_lm", "score", "value_head", "backbone")
Getter = Callable[[str, tuple], np.ndarray]
# (a per-layer key's ops, its tensors of every layer) -> the stacked ppojax array
LayerStacker = Callable[[tuple, list], "np.ndarray"]


# --------------------------------------------------------------------------------------------- reversible ops


@dataclasses.dataclass(frozen=True)
class T:
    """Transpose by `perm` (default: reverse the axes, e.g. nn.Linear's [out, in] -> [in, out])."""

    perm: tuple[int, ...] | None = None

    def apply(self, x: np.ndarray) -> np.ndarray:
        return np.transpose(x, self.perm)

    def shape(self, shape: tuple) -> tuple:
        return tuple(shape[p] for p in (self.perm or range(len(shape) - 1, -1, -1)))

    def invert(self, y: np.ndarray) -> np.ndarray:
        return np.transpose(y, None if self.perm is None else tuple(np.argsort(self.perm)))


@dataclasses.dataclass(frozen=True)
class Unflatten:
    """Split axis `axis` into `sizes` (e.g. q_proj's H*hd outputs into (H, hd)); the inverse merges them."""

    axis: int
    sizes: tuple[int, ...]

    def apply(self, x: np.ndarray) -> np.ndarray:
        a = self.axis % x.ndim
        return x.reshape(x.shape[:a] + tuple(self.sizes) + x.shape[a + 1:])

    def shape(self, shape: tuple) -> tuple:
        a = self.axis % len(shape)
        return tuple(shape[:a]) + tuple(self.sizes) + tuple(shape[a + 1:])

    def invert(self, y: np.ndarray) -> np.ndarray:
        a = self.axis % (y.ndim - len(self.sizes) + 1)
        return y.reshape(y.shape[:a] + (-1,) + y.shape[a + len(self.sizes):])


@dataclasses.dataclass(frozen=True)
class Split:
    """Part `index` of a fused tensor whose axis `axis` is the concatenation of parts of `sizes` (e.g. GPT-2's
    `c_attn` columns q | k | v: `Split(1, (D, D, D), j)`); the export concatenates the parts back."""

    axis: int
    sizes: tuple[int, ...]
    index: int

    def apply(self, x: np.ndarray) -> np.ndarray:
        start = sum(self.sizes[:self.index])
        return np.take(x, np.arange(start, start + self.sizes[self.index]), axis=self.axis)

    def shape(self, shape: tuple) -> tuple:
        a = self.axis % len(shape)
        return tuple(shape[:a]) + (self.sizes[self.index],) + tuple(shape[a + 1:])


@dataclasses.dataclass(frozen=True)
class Key:
    """One row of a key table.

    hf: checkpoint name template; "{prefix}" = the backbone prefix ("model." or ""), "{i}" = the layer index of a
        per-layer tensor (stacked along the ppojax array's leading `layers` axis).
    shape: the tensor's shape in the checkpoint (one layer's, for a per-layer tensor).
    path: where the array lives in the model's parameters (`nnx.to_pure_dict(nnx.state(model))`).
    ops: checkpoint tensor -> ppojax array, applied in order; at most one `Split`.
    optional: the tensor may be absent (a head the loader initialises instead).
    """

    hf: str
    shape: tuple[int, ...]
    path: tuple[str, ...]
    ops: tuple[T | Unflatten | Split, ...] = ()
    optional: bool = False

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    def name(self, prefix: str, i: int | None = None) -> str:
        return self.hf.format(prefix=prefix, i=i)


def stack_on_host(ops: tuple, layers: list[np.ndarray]) -> np.ndarray:
    """The per-layer tensors through `ops`, stacked along a new leading `layers` axis (numpy)."""
    return np.stack([apply_ops(ops, x) for x in layers])


class LayerStack:
    """A per-layer key's tensors through its ops, stacked along a leading `layers` axis only when read:
    `read(index)` forms just that part of the stacked array (a layer's tensor through the ops at a time), so a
    sharded load never forms the whole stack (`hf_io.place`). A `LayerStacker`, as `stack_on_host` is.

    shape: `(L, *shape after the ops)`; dtype: the checkpoint tensors'."""

    def __init__(self, ops: tuple, layers: list[np.ndarray]):
        self.ops, self.layers = tuple(ops), list(layers)
        self.shape = (len(self.layers),) + ops_shape(self.ops, self.layers[0].shape)
        self.dtype = self.layers[0].dtype

    def read(self, index: tuple = ()) -> np.ndarray:
        """The part `index` (a tuple of slices, one per leading axis, as `np.ndarray[index]`) of the stacked
        array."""
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        rows = range(len(self.layers))[index[0]]
        return np.stack([apply_ops(self.ops, self.layers[i])[index[1:]] for i in rows])


def apply_ops(ops: Iterable, x: np.ndarray) -> np.ndarray:
    """A checkpoint tensor through a key's ops (views where numpy can: transposes and reshapes)."""
    for op in ops:
        x = op.apply(x)
    return x


def ops_shape(ops: Iterable, shape: tuple) -> tuple:
    """The shape a tensor of `shape` has after `ops` (nothing read)."""
    shape = tuple(shape)
    for op in ops:
        shape = op.shape(shape)
    return shape


def _invert(ops: Iterable, y: np.ndarray) -> np.ndarray:
    for op in reversed(tuple(ops)):
        y = op.invert(y)
    return y


def _around_split(ops: tuple) -> tuple[tuple, Split | None, tuple]:
    """(ops before the `Split`, the `Split` or None, ops after it)."""
    at = [j for j, op in enumerate(ops) if isinstance(op, Split)]
    if not at:
        return ops, None, ()
    return ops[:at[0]], ops[at[0]], ops[at[0] + 1:]


# ----------------------------------------------------------------------------------------- the whole table


def hf_num_labels(config: dict) -> int:
    """Outputs of a sequence classifier with this config.json, as transformers reads it: `num_labels`, else the
    size of `id2label`, else transformers' default, 2 (transformers 5 leaves the default labels out of the file)."""
    return int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)


def score_labels(cfg: ModelConfig) -> int:
    """Outputs of the score head of a checkpoint with this config (:func:`hf_num_labels` of its extra fields)."""
    return hf_num_labels(cfg.extra.to_dict() if cfg.extra else {})


def _head_keys(cfg: ModelConfig, kind: str, family: Family) -> list[Key]:
    """The task heads, shared by all families (transformers names them alike)."""
    D = cfg.hidden_size
    if kind == "score":
        labels = score_labels(cfg)
        return [Key("score.weight", (labels, D), ("score", "kernel"), (T(),), optional=True),
                Key("score.bias", (labels,), ("score", "bias"), optional=True)]
    keys = [] if cfg.tie_word_embeddings else [Key(family.lm_head, (cfg.vocab_size, D), ("lm_head", "kernel"), (T(),))]
    if kind == "value_head":
        keys += [Key("v_head.summary.weight", (1, D), ("v_head", "kernel"), (T(),), optional=True),
                 Key("v_head.summary.bias", (1,), ("v_head", "bias"), optional=True)]
    return keys


def key_table(cfg: ModelConfig, kind: str) -> list[Key]:
    """Every row of a model of `kind`: the family's backbone (under `backbone`, except for kind "backbone") and the
    heads."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    family = family_for(cfg.model_type)
    backbone = family.backbone_keys(cfg)
    if kind == "backbone":
        return backbone
    return [dataclasses.replace(k, path=("backbone",) + k.path) for k in backbone] + _head_keys(cfg, kind, family)


def backbone_prefix(cfg: ModelConfig, kind: str, names: Iterable[str] = ()) -> str:
    """The prefix of backbone tensors in a checkpoint: "model." (etc.), or "" for a bare `XModel` checkpoint."""
    family = family_for(cfg.model_type)
    prefix = family.backbone_prefix + "."
    names = set(names)
    if kind == "backbone" or not names:
        return "" if kind == "backbone" else prefix
    embed = next(k for k in family.backbone_keys(cfg) if k.path == ("embed", "embedding")).name("")
    if not any(n.startswith(prefix) for n in names) and embed in names:
        return ""
    return prefix


def tensor_name(cfg: ModelConfig, kind: str, path: tuple[str, ...], names: Iterable[str] = ()) -> str:
    """The checkpoint name of the (not per-layer) parameter at `path` in a model of `kind`."""
    names = list(names)
    key = next((k for k in key_table(cfg, kind) if k.path == path and not k.per_layer), None)
    if key is None:
        raise ValueError(f"no tensor of a {cfg.model_type} {kind} model maps to {'.'.join(path)}")
    return key.name(backbone_prefix(cfg, kind, names))


def hf_to_params(cfg: ModelConfig, kind: str, get: Getter, names: Iterable[str] = (),
                 has: Callable[[str], bool] = lambda name: True, stack: LayerStacker = stack_on_host) -> dict:
    """Nested dict of arrays in the layout of `nnx.to_pure_dict(nnx.state(model))` for a model of `kind`.

    `get(name, shape)` returns checkpoint tensor `name`, checked against `shape` (naming the tensor in any error);
    `names`: all tensor names of the checkpoint (to detect the backbone prefix); `has(name)`: whether it exists;
    `stack(ops, layers)`: a per-layer key's tensors through its ops, stacked (default: numpy's).
    A missing optional head (`score`, `v_head`) is left out of the result; the caller initialises it.
    """
    prefix = backbone_prefix(cfg, kind, names)
    params: dict = {}
    for key in key_table(cfg, kind):
        if key.optional and not has(key.name(prefix)):
            continue
        if key.per_layer:
            value = stack(key.ops, [get(key.name(prefix, i), key.shape) for i in range(cfg.num_layers)])
        else:
            value = apply_ops(key.ops, get(key.name(prefix), key.shape))
        node = params
        for part in key.path[:-1]:
            node = node.setdefault(part, {})
        node[key.path[-1]] = value
    return params


def params_to_hf(cfg: ModelConfig, kind: str, params: dict) -> dict[str, np.ndarray]:
    """`{hf_name: array}` for the pure-dict `params` of a model of `kind`, as transformers' `save_pretrained`
    names them (the inverse of `hf_to_params`)."""
    prefix = backbone_prefix(cfg, kind)
    out: dict[str, np.ndarray] = {}
    fused: dict[str, dict[int, np.ndarray]] = defaultdict(dict)  # name -> part index -> part
    fused_ops: dict[str, tuple[tuple, Split]] = {}
    shapes: dict[str, tuple] = {}
    for key in key_table(cfg, kind):
        node = params
        for part in key.path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            if key.optional:
                continue
            raise ValueError(f"parameter {'.'.join(key.path)} is missing; a {cfg.model_type} {kind} model has it")
        head, split, tail = _around_split(key.ops)
        for i in range(cfg.num_layers) if key.per_layer else (None,):
            name = key.name(prefix, i)
            shapes[name] = key.shape
            value = np.asarray(node[i] if key.per_layer else node)
            if split is None:
                out[name] = _invert(key.ops, value)
            else:
                fused[name][split.index] = _invert(tail, value)
                fused_ops[name] = (head, split)
    for name, parts in fused.items():
        head, split = fused_ops[name]
        if sorted(parts) != list(range(len(split.sizes))):
            raise ValueError(f"{name}: the key table has parts {sorted(parts)} of a tensor fused from "
                             f"{len(split.sizes)}")
        out[name] = _invert(head, np.concatenate([parts[j] for j in range(len(parts))], axis=split.axis))
    for name, value in out.items():
        if tuple(value.shape) != tuple(shapes[name]):
            raise ValueError(f"tensor {name!r} would be written with shape {tuple(value.shape)}, expected "
                             f"{tuple(shapes[name])} from the model config; the parameters and the config disagree")
    return out
