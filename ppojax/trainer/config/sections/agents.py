"""The agents section: tools and environments for multi-turn episodes (TRL 1.12's GRPOTrainer names), and the
fixed sizes of an episode's turns."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, MUST_MATCH, NON_EMPTY, Rule, above, at_least, setting


def _are_specs(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) and ":" in v for v in value)


@dataclass
class AgentSettings:
    """Multi-turn episodes (docs/agents.md): the model calls tools or plays an environment over several turns."""

    tools: Optional[list[str]] = setting(None, static=True, on_resume=MUST_MATCH, rule=Rule(
        _are_specs, "a list of 'module:function' tools",
        "Fix: list them as [my_tools:multiply, my_tools:search] (modules on PYTHONPATH), each with type hints on "
        "every parameter and a docstring describing them."))
    """Tool functions (TRL's ``tools``), each 'module:function' with type hints and a docstring: the model sees
    their schemas through the chat template and calls them; their results come back as tool messages."""
    environment_factory: Optional[str] = setting(None, static=True, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """'module:Class' (TRL's ``environment_factory``): a class with ``reset(**row)`` whose other public methods
    are tools, or a ``ppojax.agents.Environment`` (``reset`` / ``step``). One instance per episode."""
    max_tool_calling_iterations: int = setting(3, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """Tool turns an episode may take (TRL's name); its model turns are one more. A bound is needed: an
    episode's buffers have fixed shapes."""
    tool_call_parser: str = setting("hermes", static=True, on_resume=MAY_CHANGE, rule=NON_EMPTY)
    """How tool calls are read from a message: 'hermes' (``<tool_call>`` JSON: Qwen, SmolLM3, ChatML templates
    with tools), 'llama3' (Llama 3.1/3.2 JSON), or 'module:function'."""
    tool_timeout: float = setting(30.0, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Seconds a tool call may run; past it the model gets a timeout message instead of the result."""
    tool_chat_template: Optional[str] = setting(None, static=True, on_resume=MUST_MATCH, rule=NON_EMPTY)
    """The chat template an agent run renders with: 'chatml' (ppojax's ChatML template with tools, for SmolLM2
    and other ChatML models whose own template ignores tools), a path to a .jinja file, or None: the
    tokenizer's own (refused when it cannot show tools)."""
    turn_length: Optional[int] = setting(None, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Tokens the model may write in one turn (None: response_length)."""
    observation_length: int = setting(64, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Tokens one observation (a tool's answer, an environment's message, with the template's framing) may add;
    an observation that does not fit ends its episode (counted: episodes/observation_overflow)."""

    @property
    def is_agent_run(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None
