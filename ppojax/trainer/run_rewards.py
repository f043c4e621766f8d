"""A run's reward source from its config and the trainer's arguments: reward functions resolved by name (built in,
or ``module:function``), Python ones as host calls, JAX ones traced, a reward model's scores, and their weighted sum
(TRL's ``reward_funcs`` with ``reward_weights``).
"""
from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Callable, Optional

from flax import nnx

from ppojax.rl.reward_calls import RewardCall
from ppojax.rl.rewards import (ColumnTable, FunctionScores, ModelScores, RewardSource, TracedScores, WeightedRewards,
                               vader_sentiment_reward)
from ppojax.tasks import math_answers
from ppojax.trainer.config import BUILTIN_REWARDS, ConfigError, PPOConfig

NO_REWARD = ("No reward: set reward_funcs (e.g. [vader] or [my_module:my_reward]) or reward_model_path (a "
             "sequence-classification checkpoint), or pass reward_funcs / reward_model to PPOTrainer.")


def _builtin_reward(name: str) -> Callable:
    """The reward function a built-in name (``config.BUILTIN_REWARDS``) stands for."""
    if name == "vader":
        fn = vader_sentiment_reward()
        fn.__name__ = "vader"
        return fn
    return getattr(math_answers, name)


def resolve_reward_function(spec, field: str = "reward_funcs") -> Callable | TracedScores:
    """A built-in name ('vader', 'gsm8k_strict', ...), 'module:function', or a callable -> a reward function;
    a ``TracedScores`` given, or named by 'module:name', as it is (a JAX reward traced into the program).
    field: the config field that named it (``reward_funcs`` or ``reward_function``), for the messages."""
    if callable(spec) or isinstance(spec, TracedScores):
        return spec
    if spec in BUILTIN_REWARDS:
        return _builtin_reward(spec)
    named = f"{field} entry {spec!r}" if field == "reward_funcs" else f"{field}={spec!r}"
    module_name, sep, attr = str(spec).partition(":")
    if not sep:
        raise ConfigError(f"{named}: expected one of {BUILTIN_REWARDS} or 'module:function' "
                          "(e.g. 'my_rewards:length_reward').")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # noqa: BLE001 - any failure to import the user's module is a config error
        raise ConfigError(f"{named} could not be imported ({type(err).__name__}: {err}); check that the module "
                          "is on PYTHONPATH, imports cleanly and defines that function.") from err
    if not callable(fn) and not isinstance(fn, TracedScores):
        raise ConfigError(f"{named} is a {type(fn).__name__}, not a function f(prompts, completions) -> floats "
                          "(nor a ppojax.rl.rewards.TracedScores).")
    return fn


def reward_field(config) -> str:
    """The config field that names the run's reward functions."""
    return "reward_funcs" if config.reward_funcs is not None else "reward_function"


def reward_calls_of(config: PPOConfig, reward_model, reward_funcs) -> tuple[list, list, list]:
    """The run's reward functions: (Python ones as ``RewardCall``s, JAX ones as ``TracedScores``, the place of
    each in the user's list, Python ones first). From ``reward_funcs`` given to the trainer (callables, specs or
    ``TracedScores``), a callable passed as ``reward_model``, or the config's reward_funcs / reward_function."""
    if reward_funcs is not None:
        given = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
    elif callable(reward_model) and not isinstance(reward_model, nnx.Module):
        given = [reward_model]
    elif reward_model is not None and config.reward_funcs is None:
        given = []  # a reward model given: reward_function does not add to it (reward_funcs does)
    else:
        given = config.reward_function_specs
    resolved = [resolve_reward_function(f, reward_field(config)) for f in given]
    # a reward named by a spec is named after it (what config.reward_names and the metrics say), whatever its kind
    names = [f.rpartition(":")[2] if isinstance(f, str) else None for f in given]
    traced = [i for i, f in enumerate(resolved) if isinstance(f, TracedScores)]
    python = [i for i in range(len(resolved)) if i not in traced]
    calls = [RewardCall.of(resolved[i], names[i]) for i in python]
    sources = [_renamed(resolved[i], names[i]) if names[i] else resolved[i] for i in traced]
    return calls, sources, python + traced


def _renamed(source: TracedScores, name: str) -> TracedScores:
    """A copy of ``source`` reporting as ``name`` (the user's object is left as it is)."""
    renamed = copy.copy(source)
    renamed.names = [name]
    return renamed


def weights_in_part_order(weights, order: list):
    """reward_weights (the user's order: reward_funcs, then the model) in the parts' order (Python functions,
    traced ones, the model)."""
    if weights is None or len(weights) != len(order) + 1 and len(weights) != len(order):
        return weights  # None, or a count WeightedRewards refuses with both numbers
    return [weights[i] for i in order] + list(weights[len(order):])


def combined_reward(parts, weights):
    """One reward source from the run's parts (None without any): a part alone as it is, several (or any
    weights) summed by ``WeightedRewards``."""
    if not parts:
        return None
    if len(parts) == 1 and weights is None:
        return parts[0]
    return WeightedRewards(parts, weights)



class RunRewards:
    """A run's rewards as the trainer's arguments and the config give them, resolved before any model loads.

    calls: the Python reward functions (``RewardCall``s); traced: the JAX ones (``TracedScores``); reward_model: a
    reward model module the caller passed (None: none, or the config's ``reward_model_path``)."""

    def __init__(self, config: PPOConfig, reward_model, reward_funcs):
        self.config = config
        self.calls, self.traced, self._order = reward_calls_of(config, reward_model, reward_funcs)
        self.reward_model = None if callable(reward_model) and not isinstance(reward_model, nnx.Module) \
            else reward_model
        self.has_model = self.reward_model is not None or config.reward_model_path is not None
        self.functions: Optional[FunctionScores] = None

    @property
    def names(self) -> list:
        """The rewards' names in metrics: the Python functions, the traced ones, the reward model's."""
        model = []
        if self.has_model:
            path = self.config.reward_model_path
            model = [Path(path).name if path is not None else "reward_model"]
        return [call.name for call in self.calls] + [n for t in self.traced for n in t.names] + model

    def check_filter_groups_metric(self) -> None:
        """filter_groups_metric must name one of the run's rewards (whose values judge a group)."""
        metric = self.config.filter_groups_metric
        if self.config.filter_groups and metric is not None and self.any and metric not in self.names:
            raise ConfigError(f"filter_groups_metric={metric!r} names none of this run's rewards "
                              f"({', '.join(self.names)}); set it to one of them, or remove it to judge groups by "
                              "the score.")

    @property
    def any(self) -> bool:
        """Whether the run has a reward source at all (the legacy ``step()`` API needs none)."""
        return bool(self.calls) or bool(self.traced) or self.has_model

    def call_on_host(self, tokenizer, pad_token_id: int, table: Optional[ColumnTable], mesh) -> None:
        """The Python functions as one host-called source, after checking that each function's dataset columns are
        in ``table`` (a missing one is said before any model loads)."""
        for call in self.calls:
            as_config_error(call.check_arguments, table.names if table is not None else [])
        if self.calls:
            self.functions = FunctionScores(self.calls, tokenizer, pad_token_id, table=table, mesh=mesh,
                                            allow_nonfinite=self.config.on_nonfinite_reward == "skip",
                                            sole=not self.has_model and not self.traced)

    def source(self, reward_graphdef, pad_token_id: int) -> Optional[RewardSource]:
        """The program's reward source: the functions, the traced rewards and the reward model (``reward_graphdef``,
        None without one), weighted by ``reward_weights`` (None without any reward)."""
        config = self.config
        parts = ([] if self.functions is None else [self.functions]) + self.traced
        if reward_graphdef is not None:
            name = Path(config.reward_model_path).name if config.reward_model_path is not None else "reward_model"
            parts.append(ModelScores(reward_graphdef, pad_token_id, config.local_rollout_forward_batch_size, name=name))
        return as_config_error(combined_reward, parts, weights_in_part_order(config.reward_weights, self._order))


def as_config_error(fn, *args, **kwargs):
    """Run a check, re-raising its ValueError (or TypeError, OSError) as a ConfigError, so that `ppojax train`
    prints the message instead of a traceback."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, OSError) as err:
        raise ConfigError(str(err)) from err
