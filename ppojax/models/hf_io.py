"""Hugging Face checkpoint directories <-> ppojax models.

`load_pretrained(path, kind=...)` reads `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`); `save_pretrained(model, cfg, out_dir)` writes a directory that
`transformers.AutoModelForCausalLM` (or `AutoModelForSequenceClassification` for score models) loads with the
same logits. Safetensors are read by memory map with a small reader of the documented format (numpy cannot name
bfloat16; `ml_dtypes` gives it), so no torch is needed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from ppojax import parallel
from ppojax.io.export_dir import check_export_target, write_export_dir
from ppojax.models.kernels import XLA, Kernels
from ppojax.models.config import ModelConfig
from ppojax.models.errors import ModelLoadError
from ppojax.models.families import family_for, hf_to_params, params_to_hf, tensor_name
from ppojax.models.families.keys import LayerStack, stack_on_host
from ppojax.models.transformer import CausalLM, CausalLMWithValueHead, ScoreModel, init_value_head, new_score_head

log = logging.getLogger(__name__)

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


# ------------------------------------------------------------------------------------------------ safetensors


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data) of a .safetensors file.

    Checks that the file is whole: a readable JSON header, and as many data bytes as the header's tensors
    claim (a truncated download or an interrupted copy fails here, naming the file, not later in a reshape).
    """
    size = os.path.getsize(path)
    fix = "re-download or re-save the checkpoint"
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short: {size} bytes); {fix}")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes, the "
                             f"file has {size}; {fix}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is corrupt: its header is not valid JSON ({err}); {fix}") from None
    try:
        if not isinstance(header, dict):
            raise TypeError
        end = max([int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"],
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise ValueError(f"{path} is corrupt: its header does not list tensors with data_offsets; {fix}") from None
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated: its tensors need {end} bytes of data, the file holds "
                         f"{size - 8 - n}; {fix}")
    return header, 8 + n


class SafetensorsCheckpoint:
    """Tensors of one checkpoint (one file, or shards listed by `model.safetensors.index.json`), memory-mapped."""

    def __init__(self, directory: str | os.PathLike):
        d = Path(directory)
        self.directory = d
        index, single = d / SAFE_INDEX, d / SAFE_WEIGHTS
        if index.exists():
            index_data = read_json(index)
            weight_map = index_data.get("weight_map") if isinstance(index_data, dict) else None
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no \"weight_map\" object (tensor name -> shard file); "
                                     f"re-save the checkpoint")
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = [SAFE_WEIGHTS]
        else:
            others = sorted(p.name for p in d.glob("*.safetensors"))
            if len(others) == 1:
                files = others
            else:
                hint = (" (found pytorch_model.bin: re-save it with transformers' save_pretrained, which writes "
                        "safetensors)") if (d / "pytorch_model.bin").exists() else ""
                raise FileNotFoundError(f"no weights in {d}: expected {single} or {index}{hint}")
        self._where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = d / name
            if not path.exists():
                raise FileNotFoundError(f"checkpoint shard {path} (listed in {index}) does not exist")
            header, offset = read_safetensors_header(path)
            header.pop("__metadata__", None)
            for tensor, info in header.items():
                self._where[tensor] = (path, info, offset)
        self._maps: dict[Path, np.memmap] = {}
        self.used: set[str] = set()

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: tuple | None = None) -> np.ndarray:
        """The tensor `name` (a read-only memory-mapped view), checked against `shape` when given."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.directory} "
                           f"(it has {len(self._where)} tensors, e.g. {sorted(self._where)[:5]})")
        path, info, offset = self._where[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        arr = self._maps[path][offset + start: offset + end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)} from "
                             f"config.json; the checkpoint and its config disagree")
        self.used.add(name)
        return arr


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    """Write `tensors` to one .safetensors file (format 'pt' metadata, as transformers expects)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in sorted(tensors):
        a = tensors[name]
        if a.dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: cannot store dtype {a.dtype} in safetensors")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in sorted(tensors):  # one tensor's contiguous copy at a time (the views of an export transpose)
            np.ascontiguousarray(tensors[name]).tofile(f)


# ----------------------------------------------------------------------------------------------------- config


def read_json(file: Path) -> Any:
    """The parsed JSON `file`; `ModelLoadError` naming the file and where it breaks."""
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ModelLoadError(f"{file} is not UTF-8 text (byte {err.start}); re-save or re-download it") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{file} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}; "
                             f"fix or re-download it") from None


def load_config(path: str | os.PathLike) -> ModelConfig:
    """`ModelConfig` of a checkpoint directory (its `config.json`)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} does not exist: expected a Hugging Face checkpoint directory "
                                f"(config.json + model.safetensors)")
    return ModelConfig.from_hf(read_json(file), source=str(file))


def load_tokenizer(path: str | os.PathLike, **kwargs):
    """transformers' `AutoTokenizer.from_pretrained` on the local folder (no hub access)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers imports torch (where installed)

    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)


# ------------------------------------------------------------------------------------------------------- load

_MODEL_CLASSES = {"causal_lm": CausalLM, "value_head": CausalLMWithValueHead, "score": ScoreModel}


def read_params(path: str | os.PathLike, cfg: ModelConfig, kind: str = "causal_lm") -> dict:
    """The checkpoint's weights as a nested dict of numpy arrays in ppojax layout (see `families/keys.py`)."""
    return _read_params(SafetensorsCheckpoint(path), cfg, kind)


def _read_params(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, kind: str, stack=stack_on_host) -> dict:
    family = family_for(cfg.model_type)
    if cfg.tie_word_embeddings and kind in ("causal_lm", "value_head") and _stored_head_differs(ckpt, cfg, kind):
        raise ModelLoadError(
            f"{ckpt.directory}: the config ties the LM head to the embedding (tie_word_embeddings=true) but the "
            f"checkpoint stores a different {family.lm_head}, which transformers then uses untied; load it with "
            f"load_pretrained (which does the same) or pass cfg.replace(tie_word_embeddings=False)")
    params = hf_to_params(cfg, kind, ckpt.get, names=ckpt.names, has=ckpt.__contains__, stack=stack)
    unused = [n for n in ckpt.names if n not in ckpt.used and not n.endswith(family.ignored_tensors)
              and not (cfg.tie_word_embeddings and n == family.lm_head)]
    if unused:
        log.warning("%d tensors of %s were not used for a %s model: %s", len(unused), ckpt.directory, kind,
                    unused[:8])
    return params


def _stored_head_differs(ckpt: SafetensorsCheckpoint, cfg: ModelConfig, kind: str) -> bool:
    """Whether the checkpoint holds an LM head that differs from the embedding (transformers' `tie_weights` then
    leaves the two untied, whatever tie_word_embeddings says)."""
    head = family_for(cfg.model_type).lm_head
    if head not in ckpt:
        return False
    embedding = tensor_name(cfg, kind, ("backbone", "embed", "embedding"), ckpt.names)
    return embedding in ckpt and not np.array_equal(ckpt.get(head), ckpt.get(embedding))


def load_pretrained(path: str | os.PathLike, *, kind: str = "causal_lm", dtype=jnp.float32, param_dtype=None,
                    scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA, seed: int = 0,
                    score_label: int | None = None, mesh=None, rules=None, head_init: str = "random"):
    """Load a Hugging Face checkpoint directory into a ppojax model.

    kind: "causal_lm" -> `CausalLM`; "score" -> `ScoreModel` (reward/value models, `XForSequenceClassification`);
    "value_head" -> `CausalLMWithValueHead`. A head missing from the checkpoint (`v_head.summary.*`, or
    `score.weight` when a score model starts from a causal-LM checkpoint) is initialised randomly from `seed`,
    with a warning (head_init "zeros": a missing head starts at zero instead). dtype: compute dtype;
    param_dtype: storage dtype (default: dtype). remat, kernels, scan_layers: as the model classes'
    (`transformer.Backbone`). score_label: for a classifier with several labels loaded as a "score" model, the
    label whose logit is the score (None: the checkpoint must have one label). mesh, rules: place every weight
    straight into its sharding on `mesh` by `rules` (a `ppojax.parallel.rules` rule table, default
    `TRAIN_RULES`), reading the checkpoint shard by shard: no process or device holds a sharded weight whole, and
    each process reads only its own devices' shards. Without a mesh the weights go to the default device.
    Returns `(model, cfg)`. :func:`abstract_pretrained` with the same arguments gives the same model's
    structure without reading a weight.
    """
    param_dtype = dtype if param_dtype is None else param_dtype
    structure = _open_pretrained(path, kind, score_label, warn=True)
    loaded = _read_params(structure.checkpoint, structure.read_cfg, kind, stack=LayerStack)
    if kind == "score" and "score" in loaded:
        loaded["score"] = _one_score_label(loaded["score"], score_label, path)
    cfg = structure.cfg
    abstract = structure.abstract_model(seed=seed, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                                        remat=remat, kernels=kernels)
    graphdef, state = nnx.split(abstract)
    key = jax.random.key(seed)
    if kind == "value_head" and "v_head" not in loaded:
        log.warning("no v_head.summary.* in %s: value head initialised %s", path,
                    "at zero" if head_init == "zeros" else f"randomly (seed {seed})")
        loaded["v_head"] = jax.tree.map(np.asarray, init_value_head(cfg, key, param_dtype, head_init))
    if kind == "score" and "score" not in loaded:
        log.warning("no score.weight in %s: score head initialised %s", path, "at zero" if head_init == "zeros"
                    else f"randomly (seed {seed}), as transformers' AutoModelForSequenceClassification does")
        loaded["score"] = {"kernel": np.asarray(new_score_head(cfg, key, param_dtype, head_init))}
    state = fill_state(state, loaded, param_dtype, _shardings(state, mesh, rules))
    return nnx.merge(graphdef, state), cfg


def _shardings(state: nnx.State, mesh, rules) -> dict | None:
    """The sharding of every weight of `state` (abstract) by `rules` on `mesh`, as a nested dict like
    `nnx.to_pure_dict(state)`; None without a mesh (the default device)."""
    if mesh is None:
        return None
    return nnx.to_pure_dict(parallel.param_shardings(state, mesh, parallel.TRAIN_RULES if rules is None else rules))


def place(source, target: jax.sharding.Sharding | None, dtype) -> jax.Array:
    """`source` (a host array, a checkpoint's memory-mapped view, or a `LayerStack`) as a `dtype` array in
    `target`, formed shard by shard (`read_shard`): each distinct part this process's devices hold is read and
    converted once, so neither this process nor any device holds the whole array unless its sharding does.
    target None: the default device (uncommitted, as `jax.device_put`; on the CPU the device array is then the
    host array read, not a copy of it)."""
    dtype = np.dtype(dtype)
    if target is None:
        whole = tuple(slice(None) for _ in source.shape)
        return jax.device_put(read_shard(source, whole, dtype)).block_until_ready()
    parts: dict[tuple, np.ndarray] = {}  # a part that several devices hold (replicated over an axis) is read once

    def part(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in parts:
            parts[key] = read_shard(source, index, dtype)
        return parts[key]

    array = jax.make_array_from_callback(tuple(source.shape), target, part)
    return array.block_until_ready()  # one weight's host parts at a time


def read_shard(source, index: tuple, dtype) -> np.ndarray:
    """The part `index` of `source` as a fresh `dtype` array (never a view of the checkpoint's memory map,
    which the device array could otherwise alias on the CPU)."""
    if isinstance(source, LayerStack):
        return source.read(index).astype(dtype, copy=False)  # read() forms a new array
    return np.array(source[index], dtype=dtype)


def abstract_pretrained(path: str | os.PathLike, *, kind: str = "causal_lm", dtype=jnp.float32, param_dtype=None,
                        scan_layers: bool = True, remat: str = "none", kernels: Kernels = XLA, seed: int = 0,
                        score_label: int | None = None, head_init: str = "random"):
    """The model :func:`load_pretrained` returns for the same arguments, abstract (no value is drawn: head_init
    changes nothing here): the same graphdef with `jax.ShapeDtypeStruct` weights (`nnx.eval_shape`), from the
    checkpoint's config.json and tensor names alone (no weight is read; a tied config whose checkpoint stores its
    own LM head reads those two tensors, as `load_pretrained` does). What programs are traced and compiled from
    while the weights load. Returns `(model, cfg)`."""
    param_dtype = dtype if param_dtype is None else param_dtype
    structure = _open_pretrained(path, kind, score_label, warn=False)
    return structure.abstract_model(seed=seed, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers,
                                    remat=remat, kernels=kernels), structure.cfg


@dataclasses.dataclass
class _PretrainedStructure:
    """What a model's structure takes from a checkpoint. read_cfg: the config its tensors are read with (the
    whole classifier head); cfg: the model's (one score label); score_bias: the score head has a bias."""

    checkpoint: SafetensorsCheckpoint
    kind: str
    read_cfg: ModelConfig
    cfg: ModelConfig
    score_bias: bool

    def abstract_model(self, *, seed: int, **options):
        extra = {"bias": True} if self.score_bias else {}
        model_cls = _MODEL_CLASSES[self.kind]
        return nnx.eval_shape(lambda: model_cls(self.cfg, rngs=nnx.Rngs(seed), **options, **extra))


def _open_pretrained(path, kind: str, score_label: int | None, *, warn: bool) -> _PretrainedStructure:
    """The checkpoint's headers and config -> the model's structure (config.json, tensor names; no weights)."""
    if kind not in _MODEL_CLASSES:
        raise ValueError(f"kind {kind!r} is not one of {tuple(_MODEL_CLASSES)}")
    cfg = load_config(path)
    if not Path(path, SAFE_WEIGHTS).exists() and not Path(path, SAFE_INDEX).exists() \
            and not list(Path(path).glob("*.safetensors")):
        raise FileNotFoundError(f"no weights in {path}: expected {Path(path, SAFE_WEIGHTS)} or "
                                f"{Path(path, SAFE_INDEX)}")
    ckpt = SafetensorsCheckpoint(path)
    if cfg.tie_word_embeddings and kind in ("causal_lm", "value_head") and _stored_head_differs(ckpt, cfg, kind):
        if warn:
            log.warning("%s: tie_word_embeddings is true but the checkpoint stores a different %s: using it "
                        "untied, as transformers does", path, family_for(cfg.model_type).lm_head)
        cfg = cfg.replace(tie_word_embeddings=False)
    model_cfg, bias = cfg, False
    if kind == "score":
        model_cfg = one_label_config(cfg, score_label)  # the model has the one output it scores with
        bias = tensor_name(cfg, kind, ("score", "bias"), ckpt.names) in ckpt
    return _PretrainedStructure(ckpt, kind, cfg, model_cfg, bias)


def one_label_config(cfg: ModelConfig, label: int | None = None) -> ModelConfig:
    """`cfg` of a score model with ONE output: label `label` of the original classifier (its name kept), or
    LABEL_0. The key tables read the head's shape from it (`families.keys.score_labels`)."""
    extra = cfg.extra.to_dict() if cfg.extra else {}
    names = extra.get("id2label") or {}
    name = names.get(str(label), f"LABEL_{label}") if label is not None else "LABEL_0"
    extra = {k: v for k, v in extra.items() if k != "num_labels"}
    return cfg.replace(extra={**extra, "id2label": {"0": name}, "label2id": {name: 0}})


def _one_score_label(head: dict, label: int | None, path) -> dict:
    """The score head `{kernel [D, labels], bias [labels]?}` cut to the one output `label` (kernel [D, 1])."""
    labels = head["kernel"].shape[-1]
    if label is None:
        if labels != 1:
            raise ValueError(f"{path} is a classifier with {labels} labels; a score model has one output. Pass "
                             f"score_label (config: reward_model_label) to score with one label's logit.")
        return head
    if not 0 <= label < labels:
        raise ValueError(f"score_label={label} is not an output of {path}, which has {labels} label(s)")
    return {name: np.asarray(value)[..., label:label + 1] for name, value in head.items()}


def fill_state(state: nnx.State, arrays: dict, param_dtype, shardings: dict | None = None) -> nnx.State:
    """Replace the (abstract) values of `state` by `arrays` (same nested layout: host arrays or `LayerStack`s),
    checking every shape, each placed in its sharding of `shardings` (same layout; None: the default device)
    as `param_dtype`."""
    expected = nnx.to_pure_dict(state)
    flat_expected = dict(_flatten(expected))
    flat_given = dict(_flatten(arrays))
    missing = sorted(set(flat_expected) - set(flat_given))
    unexpected = sorted(set(flat_given) - set(flat_expected))
    if missing or unexpected:
        raise ValueError(f"parameter names do not match the model: missing {missing}, unexpected {unexpected}")
    for name, a in flat_given.items():
        if tuple(a.shape) != tuple(flat_expected[name].shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(a.shape)}, the model expects "
                             f"{tuple(flat_expected[name].shape)}")
    if shardings is None:
        values = jax.tree.map(lambda a: place(a, None, param_dtype), arrays)
    else:
        values = jax.tree.map(lambda a, target: place(a, target, param_dtype), arrays, shardings)
    nnx.replace_by_pure_dict(state, values)
    return state


def _flatten(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            yield from _flatten(v, name + ".")
        else:
            yield name, v


# ------------------------------------------------------------------------------------------------------- save


def _kind_of(model) -> str:
    if isinstance(model, CausalLMWithValueHead):
        return "value_head"
    if isinstance(model, CausalLM):
        return "causal_lm"
    if isinstance(model, ScoreModel):
        return "score"
    raise TypeError(f"cannot save a {type(model).__name__}; expected CausalLM, CausalLMWithValueHead or ScoreModel")


def save_pretrained(model, cfg: ModelConfig, out_dir: str | os.PathLike, tokenizer=None, *, params=None,
                    dtype=None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write a transformers checkpoint directory: config.json, model.safetensors (sharded with an index when
    larger than `max_shard_bytes`), and the tokenizer's files when given. The directory is written whole or not
    at all, and only where it is new, empty or an earlier export (`ppojax.io.export_dir`: `ExportDirError`
    otherwise, before anything is written).

    model: a `CausalLM` (-> `XForCausalLM`), `ScoreModel` (-> `XForSequenceClassification`, num_labels = 1) or
    `CausalLMWithValueHead` (-> `XForCausalLM` weights + TRL's `v_head.summary.*`). `params`: optional
    parameters (an `nnx.State` from `nnx.split`, or its pure dict) to write instead of the model's own. dtype: storage
    dtype (default: the parameters' dtype).
    """
    kind = _kind_of(model)
    if kind == "score":  # a ppojax ScoreModel has one output (num_labels = 1)
        cfg = one_label_config(cfg)
    check_export_target(out_dir)  # before any weight is gathered: a directory of other files is refused
    state = nnx.state(model, nnx.Param) if params is None else params
    if isinstance(state, nnx.State):
        state = nnx.to_pure_dict(state)
    pure = jax.tree.map(lambda a: np.asarray(a if dtype is None else jnp.asarray(a, dtype)), state)
    tensors = params_to_hf(cfg, kind, pure)
    some = next(iter(tensors.values()))
    config = cfg.to_hf()
    hf_kind = "causal_lm" if kind == "value_head" else kind
    config["architectures"] = [family_for(cfg.model_type).architectures[cfg.model_type][hf_kind]]
    config["dtype"] = {np.dtype(np.float32): "float32", np.dtype(ml_dtypes.bfloat16): "bfloat16",
                       np.dtype(np.float16): "float16"}.get(some.dtype, "float32")

    def build(out: Path):
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_weights(out, tensors, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))

    return write_export_dir(out_dir, build, kind="model")


def _write_weights(out: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int):
    """The weights into the fresh directory `out`: one file, or shards and their index."""
    total = sum(a.nbytes for a in tensors.values())
    if total <= max_shard_bytes:
        write_safetensors(out / SAFE_WEIGHTS, tensors)
        return
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        if size and size + tensors[name].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += tensors[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, shard)
        weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
