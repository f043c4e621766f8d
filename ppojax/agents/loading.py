"""Tools, environments and tool-call parsers named in a config: ``module:name``, as reward functions are named.

``load_tools(["my_tools:search", "my_tools:calculator"])`` imports each function and checks that it has a schema;
``load_environment("my_envs:Wordle")`` imports the class and checks it (``EnvironmentFactory``);
``load_tool_call_parser("hermes" | "my_parsers:parse")`` finds a parser. Everything that cannot be used is refused
here, when the run is built, with a ``ConfigError`` naming the value and the fix. A Python object (a function, a
class) given instead of a name is taken as it is, as TRL takes ``tools`` and ``environment_factory``.
"""
from __future__ import annotations

import importlib
from typing import Callable, Iterable, Optional, Sequence, Union

from ppojax.agents.environments import EnvironmentFactory
from ppojax.agents.parsers import ToolCallParser, get_tool_call_parser, tool_call_parser_names
from ppojax.agents.schemas import tool_schemas
from ppojax.agents.tools import DEFAULT_TOOL_TIMEOUT
from ppojax.errors import ConfigError

__all__ = ["import_named", "load_environment", "load_tool_call_parser", "load_tools"]


def import_named(spec: str, what: str, example: str) -> object:
    """The object ``spec`` = 'module:name' names ('module:Outer.inner' reaches an attribute of an attribute).

    what: how messages name the value ("tool", "environment"); example: a 'module:name' to show in them."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {spec!r}: expected 'module:name' (e.g. {example!r}), the module importable "
                          "from PYTHONPATH.")
    try:
        value = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import the user's module is a config error
        raise ConfigError(f"{what} {spec!r} could not be imported ({type(err).__name__}: {err}); check that the "
                          "module is on PYTHONPATH and imports cleanly.") from err
    for part in attr.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}; check the name after "
                              "the ':'.") from None
    return value


def load_tools(specs: Optional[Iterable[Union[str, Callable]]]) -> list:
    """The tool functions ``specs`` names ('module:function' strings or functions), each checked for a schema
    (type hints and a Google-style docstring, ``ppojax.agents.schemas``) and no two under one name."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    tools = []
    for spec in specs:
        tool = spec if callable(spec) else import_named(spec, "tool", "my_tools:search")
        if not callable(tool):
            raise ConfigError(f"tool {spec!r} is not a function (it is {_preview(tool)}, of type "
                              f"{type(tool).__name__}); name a function with type hints and a Google-style "
                              "docstring.")
        tools.append(tool)
    tool_schemas(tools)  # refuses what has no schema, and duplicate names
    return tools


def _preview(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def load_tool_call_parser(spec: Union[str, ToolCallParser]) -> ToolCallParser:
    """A registered parser's name ('hermes', 'llama3', ...), 'module:function', or a parser function."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and ":" in spec:
        fn = import_named(spec, "tool-call parser", "my_parsers:parse_calls")
        if not callable(fn):
            raise ConfigError(f"tool-call parser {spec!r} is not a function (its type is {type(fn).__name__}); "
                              "expected a function "
                              f"text -> ppojax.agents.ParsedMessage, or one of {tool_call_parser_names()}.")
        return fn
    return get_tool_call_parser(spec)


def load_environment(spec: Union[str, Callable], *, tools: Sequence[Union[str, Callable]] = (),
                     parser: Union[str, ToolCallParser] = "hermes",
                     tool_timeout: Optional[float] = DEFAULT_TOOL_TIMEOUT,
                     max_tool_calling_iterations: Optional[int] = None) -> EnvironmentFactory:
    """The environment ``spec`` names ('module:Class', or a class / factory function), checked
    (``EnvironmentFactory``: a ``reset``; a schema for every tool method; a constructor that runs).

    tools: standalone tools offered next to a TRL-style environment's methods (``load_tools``' specs); parser: see
    ``load_tool_call_parser``; tool_timeout: seconds per tool call; max_tool_calling_iterations: tool turns per
    episode (None: no limit)."""
    factory = spec if callable(spec) else import_named(spec, "environment", "my_envs:Wordle")
    if max_tool_calling_iterations is not None and (isinstance(max_tool_calling_iterations, bool) or
                                                    not isinstance(max_tool_calling_iterations, int) or
                                                    max_tool_calling_iterations < 0):
        raise ConfigError(f"max_tool_calling_iterations={max_tool_calling_iterations!r}: expected a whole number "
                          ">= 0, or None for no limit.")
    return EnvironmentFactory(factory, name=spec if isinstance(spec, str) else None, tools=load_tools(tools),
                              parser=load_tool_call_parser(parser), tool_timeout=tool_timeout,
                              max_tool_calling_iterations=max_tool_calling_iterations)
