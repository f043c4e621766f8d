"""Tools and environments for multi-turn episodes, host side (TRL 1.12's ``tools``, ``environment_factory`` and
``max_tool_calling_iterations``; docs/agents.md).

    schemas.py       a tool's JSON schema from its type hints and docstring (transformers' get_json_schema, as TRL)
    parsers.py       tool calls out of a message's text: ``hermes``, ``llama3``, and a registry for more
    calls.py         calling a user's function, sync or async, with a time limit
    tools.py         running the tool calls of a batch: observation texts and counters, never exceptions
    environments.py  the environment protocol (reset/step), the adapter for TRL's environment classes, the pool
    episodes.py      a batch of episodes between model turns: environments stepped, observations as template tokens
    templates.py     whether a chat template shows tools; a ChatML template with tools (for SmolLM2)
    demonstrations.py  written episodes laid out as sampled ones, for a warm start before RL
    loading.py       tools, environments and parsers named 'module:name' in a config

Nothing here touches the model or JAX: the multi-turn sampler (``ppojax.rl.episodes``) calls it between turns.
"""
from ppojax.agents.calls import CallTimeout
from ppojax.agents.episodes import ChatRenderer, EpisodeHost, TemplateRewritesHistory
from ppojax.agents.environments import (Environment, EnvironmentFactory, Step, ToolEnvironment, final_reward,
                                        reset_all, reset_environment, step_all, step_environment, tool_methods)
from ppojax.agents.loading import import_named, load_environment, load_tool_call_parser, load_tools
from ppojax.agents.parsers import (MalformedCall, ParsedMessage, ToolCall, get_tool_call_parser, parse_hermes,
                                   parse_llama3, register_tool_call_parser, tool_call_parser_names)
from ppojax.agents.schemas import tool_schema, tool_schemas
from ppojax.agents.templates import CHATML_TOOLS_TEMPLATE, check_tool_template, supports_tool_calling
from ppojax.agents.tools import DEFAULT_TOOL_TIMEOUT, ToolCounters, ToolResult, ToolRunner, tool_table

__all__ = [
    "CHATML_TOOLS_TEMPLATE", "CallTimeout", "ChatRenderer", "DEFAULT_TOOL_TIMEOUT", "Environment",
    "EnvironmentFactory", "EpisodeHost", "TemplateRewritesHistory",
    "MalformedCall", "ParsedMessage", "Step", "ToolCall", "ToolCounters", "ToolEnvironment", "ToolResult",
    "ToolRunner", "check_tool_template", "final_reward", "get_tool_call_parser", "import_named", "load_environment",
    "load_tool_call_parser", "load_tools", "parse_hermes", "parse_llama3", "register_tool_call_parser",
    "reset_all", "reset_environment", "step_all", "step_environment", "supports_tool_calling", "tool_call_parser_names",
    "tool_methods", "tool_schema", "tool_schemas", "tool_table",
]
