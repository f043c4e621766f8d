"""Environments: the protocol an episode is played against, and the adapter that turns TRL's
``environment_factory`` classes into it.

The protocol (subclass :class:`Environment`; either method may be ``async def``):

    reset(**row) -> Optional[str]
        Starts an episode on one dataset row (every column, the prompt included, as keyword arguments, as TRL
        calls it). A string is appended to the prompt's last user message before the first turn (TRL); None
        leaves the prompt as it is.
    step(action: str) -> Step(observation, reward, done)
        ``action``: the model's message (decoded text, end-of-turn token cut). ``observation``: None, a string
        (the next user message), or a list of chat messages (e.g. ``{"role": "tool", ...}``) to render with the
        chat template before the next turn. ``reward``: this turn's reward, or None. ``done``: the episode ends.
    get_reward() -> float   (optional)
        The episode's final reward, read once after it ends (TRL: an extra reward source of weight 1 named after
        the environment's class).

TRL's environments (any class that is not an :class:`Environment`) are adapted by :class:`ToolEnvironment`: its
``reset`` is the class's ``reset``; every public method other than ``reset`` and ``get_reward`` is a tool (TRL's
rule: ``inspect.getmembers(instance, inspect.ismethod)``, names not starting with ``_``); a step parses the
message's tool calls (``ppojax.agents.parsers``) and answers them with tool messages (``ppojax.agents.tools``); a
message without calls ends the episode, and so does the call after ``max_tool_calling_iterations`` tool turns
(its calls are not run, as in TRL). A run's standalone ``tools`` are a ToolEnvironment without an instance.

What an environment raises in ``reset``/``step`` (or a value of the wrong kind it returns) stops the run: the
callers here raise one ``EnvironmentCallError`` naming the environment class, the method and the dataset row.
A tool's failure is not that: it is an observation. :class:`EnvironmentFactory` checks a class once, when the
run is built (a ``reset``; a schema for every tool method), and hands out reusable instances (TRL's pool:
constructed once, reset for each episode).
"""
from __future__ import annotations

import concurrent.futures
import inspect
import math
from typing import Callable, NamedTuple, Optional, Sequence, Union

from ppojax.agents.calls import call
from ppojax.agents.parsers import ParsedMessage, ToolCallParser, get_tool_call_parser
from ppojax.agents.schemas import callable_name, tool_schemas
from ppojax.agents.tools import DEFAULT_TOOL_TIMEOUT, ToolRunner, tool_table
from ppojax.errors import ConfigError, EnvironmentCallError

__all__ = ["Environment", "EnvironmentFactory", "Observation", "Step", "ToolEnvironment", "environment_name",
           "final_reward", "reset_all", "reset_environment", "step_all", "step_environment", "tool_methods"]

#: None, a string, or a list of chat messages
Observation = Union[str, list]


class Step(NamedTuple):
    """One step's outcome (module docstring)."""

    observation: Optional[Observation]
    reward: Optional[float]
    done: bool


class Environment:
    """Base class of the protocol (module docstring). Subclasses implement ``reset`` and ``step``, sync or async,
    and may define ``get_reward``."""

    def reset(self, **row) -> Optional[str]:
        raise NotImplementedError

    def step(self, action: str) -> Step:
        raise NotImplementedError


RESERVED = ("reset", "get_reward")


def tool_methods(instance) -> list:
    """A TRL environment's tools: its public bound methods other than ``reset`` and ``get_reward``, by name."""
    return [member for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
            if name not in RESERVED and not name.startswith("_")]


def _parser(parser: Union[str, ToolCallParser]) -> ToolCallParser:
    return get_tool_call_parser(parser) if isinstance(parser, str) else parser


class ToolEnvironment(Environment):
    """A TRL-style environment instance (or None: standalone tools only) as the protocol (module docstring).

    instance: the environment object; tools: standalone tool functions offered next to its methods; parser: a
    registered parser name or ``text -> ParsedMessage``; runner: the ToolRunner that runs the calls and counts
    them (shared by the episodes of a run); max_tool_calling_iterations: tool turns before the episode ends
    (None: no limit)."""

    def __init__(self, instance=None, *, tools: Sequence[Callable] = (), parser: Union[str, ToolCallParser] = "hermes",
                 runner: Optional[ToolRunner] = None, max_tool_calling_iterations: Optional[int] = None):
        self.instance = instance
        self.tools = tool_table(list(tools) + (tool_methods(instance) if instance is not None else []))
        self.parser = _parser(parser)
        self.runner = runner if runner is not None else ToolRunner()
        self.max_tool_calling_iterations = max_tool_calling_iterations
        self.iterations = 0
        self.last_message: Optional[ParsedMessage] = None

    @property
    def name(self) -> str:
        return type(self.instance).__name__ if self.instance is not None else "tools"

    @property
    def owns_reward(self) -> bool:
        return callable(getattr(self.instance, "get_reward", None))

    def reset(self, **row) -> Optional[str]:
        self.iterations = 0
        self.last_message = None
        return None if self.instance is None else call(self.instance.reset, (), row)

    def step(self, action: str) -> Step:
        self.last_message = parsed = self.parser(action)
        limit = self.max_tool_calling_iterations
        if not parsed.calls or (limit is not None and self.iterations >= limit):
            return Step(None, None, True)
        self.iterations += 1
        return Step([r.message() for r in self.runner.run(parsed.calls, self.tools)], None, False)

    def get_reward(self):
        if not self.owns_reward:
            raise AttributeError(f"environment {self.name} has no get_reward")
        return call(self.instance.get_reward)


def environment_name(env) -> str:
    """The environment's class name, for messages (the adapted class's, for a ToolEnvironment)."""
    return env.name if isinstance(env, ToolEnvironment) else type(env).__name__


def _fail(env, method: str, row, err: BaseException) -> EnvironmentCallError:
    where = f"on row {row}" if row is not None else "when the run was built"
    return EnvironmentCallError(f"environment {environment_name(env)}.{method} raised {type(err).__name__}: {err} "
                                f"{where}. An environment's error stops the run; fix the environment (a tool's "
                                "error, by contrast, is returned to the model as an observation).")


def _wrong(env, method: str, row, got: str, expected: str) -> EnvironmentCallError:
    return EnvironmentCallError(f"environment {environment_name(env)}.{method} returned {got} on row {row}; "
                                f"expected {expected}.")


def _preview(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def reset_environment(env, row: dict, index: int) -> Optional[Observation]:
    """``env.reset(**row)``'s observation; EnvironmentCallError naming the environment, ``reset`` and row
    ``index`` when it raises or returns something other than None or a string."""
    try:
        observation = call(env.reset, (), dict(row))
    except Exception as err:  # noqa: BLE001 - re-raised naming the environment and the row
        raise _fail(env, "reset", index, err) from err
    if observation is not None and not isinstance(observation, str):
        raise _wrong(env, "reset", index, f"{_preview(observation)} (of type {type(observation).__name__})",
                     "None or a string to append to the prompt")
    return observation


def _is_number(value) -> bool:
    if isinstance(value, bool) or not hasattr(value, "__float__"):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def step_environment(env, action: str, index: int) -> Step:
    """``env.step(action)`` as a Step; EnvironmentCallError naming the environment, ``step`` and row ``index``
    when it raises or returns something other than (observation, reward, done) of the protocol's kinds."""
    try:
        out = call(env.step, (action,))
    except Exception as err:  # noqa: BLE001 - re-raised naming the environment and the row
        raise _fail(env, "step", index, err) from err
    if not isinstance(out, tuple) or len(out) != 3:
        raise _wrong(env, "step", index, _preview(out), "(observation, reward, done)")
    observation, reward, done = out
    if observation is not None and not isinstance(observation, (str, list)):
        raise _wrong(env, "step", index, f"an observation of type {type(observation).__name__}",
                     "None, a string or a list of chat messages")
    if reward is not None and not _is_number(reward):
        raise _wrong(env, "step", index, f"reward {_preview(reward)}", "None or a finite number")
    if type(done).__name__ not in ("bool", "bool_"):
        raise _wrong(env, "step", index, f"done={_preview(done)}", "True or False")
    return Step(observation, None if reward is None else float(reward), bool(done))


def final_reward(env, index: int) -> Optional[float]:
    """``env.get_reward()`` as a float, or None when the environment has none; EnvironmentCallError naming the
    environment, ``get_reward`` and row ``index`` when it raises or returns a non-finite value or a non-number."""
    if isinstance(env, ToolEnvironment):
        if not env.owns_reward:
            return None
    elif not callable(getattr(env, "get_reward", None)):
        return None
    try:
        value = call(env.get_reward)
    except Exception as err:  # noqa: BLE001 - re-raised naming the environment and the row
        raise _fail(env, "get_reward", index, err) from err
    if not _is_number(value):
        raise _wrong(env, "get_reward", index, _preview(value), "a finite number")
    return float(value)


_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _all(fn, envs: Sequence, values: Sequence, indices: Sequence[int]) -> list:
    global _pool
    if not len(envs) == len(values) == len(indices):
        raise ValueError(f"{len(envs)} environments, {len(values)} inputs and {len(indices)} row indices; "
                         "expected one of each per episode.")
    if len(envs) <= 1:
        return [fn(e, v, i) for e, v, i in zip(envs, values, indices)]
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(16, thread_name_prefix="ppojax-environments")
    futures = [_pool.submit(fn, e, v, i) for e, v, i in zip(envs, values, indices)]
    return [f.result() for f in futures]  # the first failing episode in order is the one reported


def reset_all(envs: Sequence, rows: Sequence[dict], indices: Sequence[int]) -> list:
    """``reset_environment`` for B episodes at the same time: B observations."""
    return _all(reset_environment, envs, rows, indices)


def step_all(envs: Sequence, actions: Sequence[str], indices: Sequence[int]) -> list:
    """``step_environment`` for B episodes at the same time: B Steps."""
    return _all(step_environment, envs, actions, indices)


class EnvironmentFactory:
    """An environment class (or any callable returning an environment), checked once, and its pool of instances.

    factory: called with no arguments for each new instance. tools, parser, tool_timeout,
    max_tool_calling_iterations: for TRL-style classes (module docstring); a protocol ``Environment`` takes no
    tools. One instance is made here to check the class (TRL does the same) and kept as the pool's first.

    kind: "tools" (a TRL-style class, adapted) or "protocol"; tool_schemas: the schemas the prompt offers
    (standalone tools then the class's tool methods; [] for a protocol environment); owns_reward: the class has
    ``get_reward``; runner: the ToolRunner the pool's episodes share (its counters are the run's)."""

    def __init__(self, factory: Callable, *, name: Optional[str] = None, tools: Sequence[Callable] = (),
                 parser: Union[str, ToolCallParser] = "hermes", tool_timeout: Optional[float] = DEFAULT_TOOL_TIMEOUT,
                 max_tool_calling_iterations: Optional[int] = None):
        if not callable(factory):
            raise ConfigError(f"environment {name or factory!r} is not a class or a function returning an "
                              f"environment (its type is {type(factory).__name__}).")
        self.factory = factory
        self.label = name or callable_name(factory)
        self.tools = list(tools)
        self.parser = _parser(parser)
        self.runner = ToolRunner(tool_timeout)
        self.max_tool_calling_iterations = max_tool_calling_iterations
        probe = self._construct()
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"environment {self.label} has no reset method; an environment defines "
                              "reset(**row) -> Optional[str], which starts an episode on a dataset row. Fix: add "
                              "one (it may return None).")
        self.owns_reward = callable(getattr(probe, "get_reward", None))
        if isinstance(probe, Environment):
            self.kind = "protocol"
            if type(probe).step is Environment.step or type(probe).reset is Environment.reset:
                raise ConfigError(f"environment {self.label} subclasses ppojax.agents.Environment but does not "
                                  "implement both reset(**row) and step(action). Fix: implement them, or do not "
                                  "subclass Environment to have its public methods offered as tools (TRL's style).")
            if self.tools:
                raise ConfigError(f"environment {self.label} is a ppojax.agents.Environment, which reads the "
                                  "model's messages itself; tools are offered only with TRL-style environments "
                                  "(their public methods are the tools). Fix: drop tools, or call them in step.")
            self.tool_schemas: list = []
        else:
            self.kind = "tools"
            self.tool_schemas = tool_schemas(self.tools + tool_methods(probe),
                                             what=f"environment {self.label}'s tool")
        self._pool = [self._wrap(probe)]

    def _construct(self):
        try:
            return self.factory()
        except Exception as err:  # noqa: BLE001 - the user's constructor; named in the message
            raise EnvironmentCallError(f"environment {self.label}() raised {type(err).__name__}: {err} making "
                                       f"instance {len(getattr(self, '_pool', ()))}; an environment must be "
                                       "constructible without arguments (TRL's environment_factory).") from err

    def _wrap(self, instance):
        if self.kind == "protocol":
            return instance
        return ToolEnvironment(instance, tools=self.tools, parser=self.parser, runner=self.runner,
                               max_tool_calling_iterations=self.max_tool_calling_iterations)

    def take(self, n: int) -> list:
        """n environments for n episodes: the pool's first n instances, made as needed (reset them before use)."""
        while len(self._pool) < n:
            self._pool.append(self._wrap(self._construct()))
        return self._pool[:n]
