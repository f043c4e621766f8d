"""PPOConfig: every knob of a run, under TRL's names, validated once at the edge.

Field names and defaults follow TRL 1.12's ``PPOConfig`` (SPEC "Defaults"); the legacy (TRL <= 0.11) names
are accepted as aliases and mapped on load. Derived sizes (``batch_size``, ``mini_batch_size``,
``micro_batch_size``, ``num_total_batches``) are computed by :meth:`PPOConfig.derived`, never stored twice.

Batch sizes (global, over all devices and hosts):
    batch_size        prompts per rollout = one PPO update
                      (default: per_device_train_batch_size * gradient_accumulation_steps
                                * num_mini_batches * data-parallel world size, as TRL)
    mini_batch_size   batch_size / num_mini_batches: one optimizer step each
    micro_batch_size  mini_batch_size / gradient_accumulation_steps: one forward/backward each
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from .ppo.advantages import advantage_estimator_names
from .ppo.kl import kl_estimator_names
from .ppo.shaping import SCORE_POSITIONS


class ConfigError(ValueError):
    """A bad configuration value; the message names the value, what was expected and the fix."""


@dataclass
class PPOConfig:
    # ---- models ----
    model_name_or_path: str = "smollm2"
    """Policy: a local Hugging Face checkpoint directory, or 'smollm2' for the bundled SmolLM2-135M-Instruct."""
    reward_model_path: Optional[str] = None
    """A sequence-classification checkpoint scoring (prompt, completion); None when reward_function is set."""
    reward_function: Optional[str] = None
    """A Python reward 'module:function' taking (prompts, completions) -> floats, or 'vader' (sentiment)."""
    value_model_path: Optional[str] = None
    """Value model checkpoint. None: TRL's choice (the reward model), or the policy backbone + a new head."""
    value_head: str = "separate"
    """'separate': a value model of its own (TRL); 'policy': a Linear head on the policy backbone (legacy)."""
    dtype: str = "float32"
    """Parameter and compute dtype: 'float32' or 'bfloat16' (log-softmax, losses and statistics stay float32)."""

    # ---- data ----
    dataset: str = "movie_reviews"
    """Prompts: 'movie_reviews' (bundled), or a local json/jsonl/csv/parquet file or HF datasets directory."""
    dataset_text_field: str = "prompt"
    """Column holding the prompt text."""
    max_prompt_length: int = 32
    """Prompts are left padded to this many tokens; longer ones are filtered out (and counted)."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template before tokenising."""
    num_eval_prompts: int = 0
    """Held-out prompts (taken off the end of the dataset, never trained on), scored before and after
    training with near-greedy decoding (T = 0.01) for summary.json."""

    # ---- run ----
    output_dir: str = "outputs/ppojax"
    run_name: Optional[str] = None
    seed: int = 0
    total_episodes: Optional[int] = None
    """Prompts to train on in all; None: num_train_epochs passes over the dataset."""
    num_train_epochs: float = 1.0

    # ---- batch sizes ----
    per_device_train_batch_size: int = 8
    """TRL's micro-batch per data-parallel device; ignored when batch_size is set."""
    batch_size: Optional[int] = None
    """Global prompts per update; None derives it as TRL does (see module docstring)."""
    gradient_accumulation_steps: int = 1
    num_mini_batches: int = 1
    local_rollout_forward_batch_size: Optional[int] = None
    """Rows per forward pass in the rollout's reference/value/reward forwards (None: the whole batch)."""
    logits_chunk_size: Optional[int] = None
    """Response positions per float32 logits chunk in log-prob computations (bounds [rows, chunk, vocab]
    memory). None: all positions at once when a micro-batch's logits fit in 256 MB per device, else the
    largest chunk that fits (chunks are recomputed in the backward pass instead of stored)."""

    # ---- PPO ----
    num_ppo_epochs: int = 4
    learning_rate: float = 3e-6
    lr_scheduler_type: str = "linear"
    """'linear' (to 0 over the updates, as TRL) or 'constant'."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm (None: off, as TRL's PPO)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_rewards: bool = False
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    """'k1', 'k3', or legacy 'abs', 'mse', 'full'."""
    advantage_estimator: str = "gae"
    """How advantages are computed from the rewards: 'gae' (generalised advantage estimation with the value
    model, PPO)."""
    adaptive_kl: bool = False
    """Legacy adaptive KL controller (Ziegler et al.); kl_coef is its initial value."""
    target_kl_for_adaptive: float = 6.0
    horizon: int = 10000
    score_position: str = "trl"
    """'trl': the score goes on the slot after the last token; 'legacy': on the last token."""
    missing_eos_penalty: Optional[float] = None
    use_score_scaling: bool = False
    use_score_norm: bool = False
    score_clip: Optional[float] = None
    ratio_threshold: Optional[float] = None
    """Legacy: skip a mini-batch whose masked mean ratio exceeds this (None: off)."""
    early_stopping: bool = False
    target_kl: float = 1.0
    """Legacy early stopping: stop the epochs once the policy KL exceeds 1.5 * target_kl."""

    # ---- generation ----
    response_length: int = 53
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    stop_token: Optional[str] = None
    """'eos': stop at the tokenizer's eos token; None: no stop token unless stop_token_id is set."""
    stop_token_id: Optional[int] = None

    # ---- logging, samples, checkpoints ----
    logging_steps: int = 1
    num_sample_generations: int = 10
    """How many times during training to print sample completions (near-greedy, T = 0.01)."""
    save_steps: int = 0
    """Checkpoint every N updates (0: only at the end)."""
    save_total_limit: int = 3
    resume: Optional[str] = None
    """None: start fresh; 'auto': resume from the latest checkpoint in output_dir; or a checkpoint path."""
    max_nonfinite_steps: int = 3
    """Stop after this many optimizer steps in a row skipped for a non-finite loss or gradient."""
    on_nonfinite_reward: str = "error"
    """A reward function returning NaN/inf: 'error' stops with a message naming the prompt; 'skip' lets it
    through, so every optimizer step of that update is skipped (counted in ppo/nonfinite_total) and the run
    goes on. 'skip' needs max_nonfinite_steps > num_ppo_epochs * num_mini_batches (the steps of one update)."""
    report_to: str = "tensorboard"
    compilation_cache_dir: Optional[str] = "auto"
    """JAX's persistent compilation cache: a later run (a resume, a re-run with the same shapes) loads the
    compiled rollout and update instead of compiling them again (benchmarks' first update: tiny 12.3 s ->
    2.35 s, SmolLM2-135M 44.6 s -> 31.8 s).
    'auto': $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/ppojax/xla; a path; or 'none' (off)."""

    # ---- mesh ----
    mesh_data: int = -1
    """Mesh axis sizes; -1 takes the devices left over (at most one axis may be -1)."""
    mesh_fsdp: int = 1
    mesh_tensor: int = 1

    # --------------------------------------------------------------------------------------------------
    @property
    def stop_token_is_eos(self) -> bool:
        return self.stop_token == "eos"

    def derived(self, data_parallel_size: int = 1) -> "DerivedSizes":
        """The global batch sizes of SPEC's update structure, checked to divide."""
        batch = self.batch_size
        if batch is None:
            batch = (self.per_device_train_batch_size * self.gradient_accumulation_steps
                     * self.num_mini_batches * data_parallel_size)
        if batch % self.num_mini_batches:
            raise ConfigError(
                f"batch_size={batch} does not split into num_mini_batches={self.num_mini_batches}; "
                f"choose a batch_size that is a multiple of {self.num_mini_batches}.")
        mini = batch // self.num_mini_batches
        if mini % self.gradient_accumulation_steps:
            raise ConfigError(
                f"mini_batch_size={mini} (batch_size {batch} / num_mini_batches {self.num_mini_batches}) does "
                f"not split into gradient_accumulation_steps={self.gradient_accumulation_steps}; make "
                f"batch_size a multiple of {self.num_mini_batches * self.gradient_accumulation_steps}.")
        micro = mini // self.gradient_accumulation_steps
        if micro % data_parallel_size:
            raise ConfigError(
                f"micro_batch_size={micro} does not split over {data_parallel_size} data-parallel devices; "
                f"make batch_size a multiple of "
                f"{self.num_mini_batches * self.gradient_accumulation_steps * data_parallel_size}.")
        return DerivedSizes(batch_size=batch, mini_batch_size=mini, micro_batch_size=micro)

    def num_updates(self, dataset_size: int, data_parallel_size: int = 1) -> int:
        episodes = self.total_episodes
        if episodes is None:
            episodes = int(self.num_train_epochs * dataset_size)
        return max(1, math.ceil(episodes / self.derived(data_parallel_size).batch_size))

    # ---- validation ----
    def validate(self) -> "PPOConfig":
        """Check every value; raise ConfigError naming the first bad one. Returns self."""
        def need(condition, name, expected):
            if not condition:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected {expected}.")

        for name in ("response_length", "max_prompt_length", "num_ppo_epochs", "num_mini_batches",
                     "gradient_accumulation_steps", "per_device_train_batch_size", "horizon",
                     "logging_steps", "max_nonfinite_steps"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "an integer >= 1")
        need(self.batch_size is None or (isinstance(self.batch_size, int) and self.batch_size >= 1),
             "batch_size", "None or an integer >= 1")
        need(self.logits_chunk_size is None
             or (isinstance(self.logits_chunk_size, int) and self.logits_chunk_size >= 1),
             "logits_chunk_size", "None (sized from a 256 MB budget) or an integer >= 1")
        need(self.learning_rate >= 0, "learning_rate", "a learning rate >= 0")
        need(self.temperature >= 0, "temperature", "a temperature >= 0 (0 is greedy)")
        need(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")
        need(0.0 < self.top_p <= 1.0, "top_p", "a value in (0, 1] (1.0 = off)")
        need(0.0 <= self.gamma <= 1.0, "gamma", "a discount in [0, 1]")
        need(0.0 <= self.lam <= 1.0, "lam", "a GAE lambda in [0, 1]")
        need(self.cliprange > 0, "cliprange", "a clip range > 0")
        need(self.cliprange_value > 0, "cliprange_value", "a clip range > 0")
        need(self.kl_estimator in kl_estimator_names(), "kl_estimator", f"one of {kl_estimator_names()}")
        need(self.advantage_estimator in advantage_estimator_names(), "advantage_estimator",
             f"one of {advantage_estimator_names()}")
        need(self.score_position in SCORE_POSITIONS, "score_position", f"one of {SCORE_POSITIONS}")
        need(self.value_head in ("separate", "policy"), "value_head", "'separate' or 'policy'")
        need(self.dtype in ("float32", "bfloat16"), "dtype", "'float32' or 'bfloat16'")
        need(self.lr_scheduler_type in ("linear", "constant"), "lr_scheduler_type", "'linear' or 'constant'")
        need(self.stop_token in (None, "eos"), "stop_token", "None or 'eos' (or set stop_token_id)")
        need(self.on_nonfinite_reward in ("error", "skip"), "on_nonfinite_reward", "'error' or 'skip'")
        steps_per_update = self.num_ppo_epochs * self.num_mini_batches
        if self.on_nonfinite_reward == "skip" and self.max_nonfinite_steps <= steps_per_update:
            raise ConfigError(
                f"on_nonfinite_reward='skip' with max_nonfinite_steps={self.max_nonfinite_steps}: an update with a "
                f"NaN/inf reward skips all its num_ppo_epochs * num_mini_batches = {steps_per_update} optimizer "
                f"steps, so the first one would stop the run. Set max_nonfinite_steps to more than "
                f"{steps_per_update} (e.g. {2 * steps_per_update + 1} to stop after 3 bad updates in a row).")
        need(self.max_grad_norm is None or self.max_grad_norm > 0, "max_grad_norm", "None or > 0")
        need(isinstance(self.num_eval_prompts, int) and self.num_eval_prompts >= 0, "num_eval_prompts",
             "an integer >= 0")
        need(isinstance(self.save_steps, int) and self.save_steps >= 0, "save_steps", "an integer >= 0 (0: end only)")
        need(self.save_total_limit >= 1, "save_total_limit", "an integer >= 1")
        need(self.target_kl_for_adaptive > 0, "target_kl_for_adaptive", "a target KL > 0")
        axes = (self.mesh_data, self.mesh_fsdp, self.mesh_tensor)
        need(all(a == -1 or a >= 1 for a in axes) and axes.count(-1) <= 1, "mesh_data",
             "mesh sizes >= 1 with at most one -1 among mesh_data/mesh_fsdp/mesh_tensor")
        if self.reward_model_path is not None and self.reward_function is not None:
            raise ConfigError("Both reward_model_path and reward_function are set; keep one of them.")
        self.derived()  # divisibility on one device; the trainer re-checks with the real mesh
        return self

    def static_settings(self) -> "StaticSettings":
        """The fields that shape compiled programs, as a hashable read-only view (a jit static argument)."""
        return StaticSettings(tuple((f.name, getattr(self, f.name)) for f in fields(self)
                                    if f.name not in _NOT_STATIC))

    # ---- (de)serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path=None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PPOConfig":
        """Build from a mapping, translating legacy names and refusing unknown keys."""
        values = normalise_keys(values)
        return cls(**{name: coerce(name, value) for name, value in values.items()}).validate()

    @classmethod
    def from_yaml(cls, path, overrides: Optional[list[str]] = None) -> "PPOConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"Config file {str(path)!r} does not exist; pass the path of a YAML file "
                              "(see configs/ for examples).")
        values = yaml.safe_load(path.read_text()) or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of field: value, got {type(values).__name__}.")
        values.update(parse_overrides(overrides or []))
        return cls.from_dict(values)


_NOT_STATIC = frozenset({"output_dir", "run_name", "resume", "logging_steps", "num_sample_generations",
                         "save_steps", "save_total_limit", "report_to", "compilation_cache_dir", "kl_coef",
                         "total_episodes", "num_train_epochs", "num_eval_prompts"})


@dataclass(frozen=True)
class StaticSettings:
    """A hashable view of the static config fields: ``view.gamma``; ``view.replace(temperature=0.01)``."""

    items: tuple

    def __getattr__(self, name):
        if name == "items":
            raise AttributeError(name)
        for key, value in self.items:
            if key == name:
                return value
        raise AttributeError(f"{name!r} is not a static config field")

    def replace(self, **changes) -> "StaticSettings":
        unknown = set(changes) - {k for k, _ in self.items}
        if unknown:
            raise AttributeError(f"not static config fields: {sorted(unknown)}")
        return StaticSettings(tuple((k, changes.get(k, v)) for k, v in self.items))


@dataclass(frozen=True)
class DerivedSizes:
    batch_size: int
    mini_batch_size: int
    micro_batch_size: int


# Legacy (TRL <= 0.11) and TRL-alternative names -> ppojax's field names.
LEGACY_ALIASES = {
    "ppo_epochs": "num_ppo_epochs",
    "init_kl_coef": "kl_coef",
    "adap_kl_ctrl": "adaptive_kl",
    "target": "target_kl_for_adaptive",
    "kl_penalty": "kl_estimator",
    "model_name": "model_name_or_path",
    "sft_model_path": "model_name_or_path",
    "query_dataset": "dataset",
    "exp_name": "run_name",
    "steps": "total_episodes",
    "forward_batch_size": "local_rollout_forward_batch_size",
    "ent_coef": "entropy_coef",
}
# Legacy values that changed spelling.
LEGACY_VALUES = {"kl_estimator": {"kl": "k1"}}


def field_names() -> list[str]:
    return [f.name for f in fields(PPOConfig)]


def normalise_keys(values: dict[str, Any]) -> dict[str, Any]:
    """Map legacy names to fields, derive num_mini_batches from a legacy mini_batch_size, refuse unknowns."""
    known = set(field_names())
    out: dict[str, Any] = {}
    values = dict(values)
    mini_batch_size = values.pop("mini_batch_size", None)
    for key, value in values.items():
        name = LEGACY_ALIASES.get(key, key)
        if name not in known:
            close = difflib.get_close_matches(key, sorted(known | set(LEGACY_ALIASES)), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"Unknown config key {key!r}.{hint} `ppojax train --help` lists every field.")
        if name in out and out[name] != value:
            raise ConfigError(f"{key!r} and another name for {name!r} are both set, to different values.")
        out[name] = LEGACY_VALUES.get(name, {}).get(value, value)
    if mini_batch_size is not None:
        batch = out.get("batch_size")
        if batch is None or batch % mini_batch_size:
            raise ConfigError(f"mini_batch_size={mini_batch_size} (legacy) needs a batch_size that is a multiple "
                              f"of it; got batch_size={batch}.")
        out["num_mini_batches"] = batch // mini_batch_size
    return out


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML value to the field's type (YAML 1.1 reads '1e-5' as a string), or raise ConfigError."""
    import typing

    hint = typing.get_type_hints(PPOConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    target = args[0] if args else hint
    if value is None:
        if args or hint is type(None):
            return None
        raise ConfigError(f"{name}=None: expected a {target.__name__}.")
    try:
        if target is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            return float(value)
        if target is int and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            if float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if target is bool and isinstance(value, bool):
            return value
        if target is str and isinstance(value, (str, int, float)):
            return str(value)
    except ValueError:
        pass
    raise ConfigError(f"{name}={value!r}: expected a {target.__name__}.")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['key=value', ...] -> {key: YAML-parsed value}."""
    parsed = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"Override {item!r} is not of the form key=value (e.g. learning_rate=1e-5).")
        parsed[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return parsed


def field_help() -> list[tuple[str, str, str]]:
    """(name, default, description) for every field, for `ppojax train --help`."""
    docs = _field_docstrings()
    rows = []
    for f in fields(PPOConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore
        rows.append((f.name, repr(default), docs.get(f.name, "")))
    return rows


def _field_docstrings() -> dict[str, str]:
    """The string literal right under each field in this file's source is its description."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(PPOConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(getattr(following, "value", None), ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())  # type: ignore[attr-defined]
    return docs
