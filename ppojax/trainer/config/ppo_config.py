"""PPOConfig: every section's fields (schema.Settings) with what a config does: it checks itself when built,
derives the update's batch sizes and the static settings of the compiled programs, names its rewards, and reads
and writes dicts and YAML."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from ppojax.errors import ConfigError
from ppojax.io.strict_json import write_text_atomic
from ppojax.trainer.config.checks import (agent_problems, async_problems, checked_value,
                                          dynamic_sampling_problems, estimator_problems, objective_problems,
                                          off_policy_problems, problems_together, registry_problems)
from ppojax.trainer.config.names import normalise_keys
from ppojax.trainer.config.schema import FIELD_NAMES, STATIC_FIELDS, Settings, StaticSettings
from ppojax.trainer.config.sections.run import REPORT_SINKS
from ppojax.trainer.config.yaml_io import load_yaml_mapping, parse_overrides


@dataclass
class PPOConfig(Settings):
    """Every knob of a run under TRL's names (the fields: ppojax.trainer.config.sections), checked when built."""

    def __post_init__(self):
        self.validate()

    @property
    def stop_token_is_eos(self) -> bool:
        return self.stop_token == "eos"

    @property
    def report_sinks(self) -> tuple[str, ...]:
        """report_to as the sinks to open: () for 'none'; 'all': tensorboard, and wandb when installed."""
        names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
        if "all" in names:
            return tuple(s for s in REPORT_SINKS if s != "wandb" or importlib.util.find_spec("wandb"))
        return tuple(dict.fromkeys(n for n in names if n != "none"))

    def static_settings(self) -> "StaticSettings":
        """The static fields only, as a hashable, immutable view (a ``jax.jit`` static argument): equal
        for configs that differ only in non-static fields (output_dir, kl_coef, ...)."""
        def hashable(v):
            return tuple(v) if isinstance(v, list) else v  # lora_target_modules

        return StaticSettings(**{name: hashable(getattr(self, name)) for name in STATIC_FIELDS})

    def derived(self, data_parallel_size: int = 1, *, mesh_known: bool = True) -> "DerivedSizes":
        """The global batch sizes of the update structure (docs/algorithm.md, "Update structure"), checked to divide.

        mesh_known=False (a config checked before the devices are known): a batch_size derived from
        per_device_train_batch_size may grow with the mesh, so rollout_slots is checked against it later."""
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
        groups = self.num_generations
        if batch % (groups * data_parallel_size):
            per_device = (f" with the same number of prompts on each of {data_parallel_size} data-parallel devices"
                          if data_parallel_size > 1 else "")
            raise ConfigError(
                f"batch_size={batch} (samples) does not split into num_generations={groups} samples of each "
                f"prompt{per_device}; make batch_size a multiple of {groups * data_parallel_size}.")
        per_round = self._prompts_per_round(batch // groups, data_parallel_size)
        sampled, what = ((per_round * groups, "rows a generation round (gen_batch_size x num_generations)")
                         if self.filter_groups else (batch, "rows (batch_size) a rollout"))
        if self.rollout_slots > sampled and (mesh_known or self.batch_size is not None):
            raise ConfigError(
                f"rollout_slots={self.rollout_slots} is more than the {sampled} {what} samples; "
                f"set rollout_slots to at most {sampled} (0: decode all rows together).")
        return DerivedSizes(batch_size=batch, mini_batch_size=mini, micro_batch_size=micro,
                            prompts_per_batch=batch // groups, prompts_per_round=per_round)

    def _prompts_per_round(self, prompts_per_batch: int, data_parallel_size: int) -> int:
        """The prompts a generation round samples: gen_batch_size with filter_groups (checked to split over the
        data-parallel devices and to be able to fill the batch), else the batch's."""
        if not self.filter_groups:
            return prompts_per_batch
        per_round = self.gen_batch_size or prompts_per_batch
        if per_round % data_parallel_size:
            raise ConfigError(
                f"gen_batch_size={per_round} prompts do not split over {data_parallel_size} data-parallel devices "
                f"(each device samples whole groups); make gen_batch_size a multiple of {data_parallel_size}.")
        if per_round * self.max_num_gen_batches < prompts_per_batch:
            raise ConfigError(
                f"max_num_gen_batches={self.max_num_gen_batches} rounds of gen_batch_size={per_round} prompts can "
                f"never fill an update's {prompts_per_batch} prompts (batch_size / num_generations); raise "
                f"gen_batch_size to at least {-(-prompts_per_batch // self.max_num_gen_batches)} or "
                "max_num_gen_batches.")
        return per_round

    def num_updates(self, dataset_size: int, data_parallel_size: int = 1) -> int:
        episodes = self.total_episodes
        if episodes is None:  # episodes are samples: num_generations per prompt
            episodes = int(self.num_train_epochs * dataset_size) * self.num_generations
        return max(1, math.ceil(episodes / self.derived(data_parallel_size).batch_size))

    # ---- validation ----
    def validate(self) -> "PPOConfig":
        """Check (and normalise) every value; raise one ConfigError listing every bad one. Returns self.

        Runs at construction; call it again after changing a field by hand."""
        problems = []
        for name in FIELD_NAMES:
            try:
                setattr(self, name, checked_value(name, getattr(self, name)))
            except ConfigError as err:
                problems.append(str(err))
        if not problems:  # the checks below need every value well typed
            problems += problems_together(self)
        if not problems:  # a registered name's message lists the registry: only once the rest is right
            problems += [str(err) for err in registry_problems(self)]
        if not problems:
            problems += (estimator_problems(self) + objective_problems(self) + off_policy_problems(self)
                         + dynamic_sampling_problems(self) + agent_problems(self) + async_problems(self))
        if len(problems) == 1:
            raise ConfigError(problems[0])
        if problems:
            raise ConfigError(f"{len(problems)} config values are not valid:\n"
                              + "\n".join("  - " + p.replace("\n", "\n    ") for p in problems))
        return self

    @property
    def reward_function_specs(self) -> list[str]:
        """reward_funcs (or reward_function) as a list of specs."""
        specs = self.reward_funcs if self.reward_funcs is not None else self.reward_function
        return [] if specs is None else [specs] if isinstance(specs, str) else list(specs)

    @property
    def reward_names(self) -> list[str]:
        """The rewards' names, in reward_weights' order: the functions, then the reward model's folder name."""
        names = [spec.rpartition(":")[2] for spec in self.reward_function_specs]
        if self.reward_model_path is not None:
            names.append(Path(self.reward_model_path).name or "reward_model")
        return names

    def check_reward_source(self) -> "PPOConfig":
        """For a training run (the CLI): one reward source must be set. (The legacy ``step()`` API takes
        scores from the caller, so a config without one is valid in itself.) An environment_factory may be the
        source (its get_reward; a class without one is refused when the run is built)."""
        if (self.reward_model_path is None and self.reward_function is None and self.reward_funcs is None
                and self.environment_factory is None):
            raise ConfigError(
                "No reward source: set reward_funcs (a list of 'module:function' or built-in reward functions), "
                "reward_function ('vader', or 'module:function' taking (prompts, completions) -> floats) or "
                "reward_model_path (a sequence-classification checkpoint), or an environment_factory whose "
                "environment has get_reward().")
        return self

    # ---- (de)serialisation ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, path=None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            write_text_atomic(path, text)
        return text

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "PPOConfig":
        """Build from a mapping, translating legacy names and refusing unknown keys (all in one message)."""
        return cls(**normalise_keys(values))

    @classmethod
    def from_yaml(cls, path, overrides: Optional[list[str]] = None) -> "PPOConfig":
        """Build from a YAML file plus ``key=value`` overrides; malformed YAML and duplicate keys are errors
        naming the file, line and column."""
        values = load_yaml_mapping(path)
        values.update(parse_overrides(overrides or []))
        return cls.from_dict(values)


@dataclass(frozen=True)
class DerivedSizes:
    batch_size: int         # rollout rows (samples) per update
    mini_batch_size: int
    micro_batch_size: int
    prompts_per_batch: int  # batch_size / num_generations
    prompts_per_round: int  # prompts a generation round samples: gen_batch_size with filter_groups, else the batch's
