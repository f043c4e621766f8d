"""Tool calls out of an assistant message's text, one parser per chat-template family, behind a registry.

A parser is ``fn(text: str) -> ParsedMessage``: ``text`` is one assistant message as decoded text (the end-of-turn
token already cut); the result holds the message's prose (``content``) and its calls in the order written, each a
:class:`ToolCall` or, where the model wrote something that is not a call, a :class:`MalformedCall` saying what was
wrong. A parser never raises on model output: a malformed call is the model's mistake and goes back to it as an
observation (see ``ppojax.agents.tools``).

Built in:

    hermes   ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per message (the
             Hermes format of Qwen 2.5/3, SmolLM3 and the other ChatML templates with tools; ppojax's
             ``CHATML_TOOLS_TEMPLATE`` for SmolLM2).
    llama3   the message is one JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1/3.2's JSON tool
             calls), optionally after ``<|python_tag|>``; several objects may follow each other, separated by
             ``;`` or whitespace.

``register_tool_call_parser(name, fn)`` adds another; ``get_tool_call_parser(name)`` looks one up.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from ppojax.errors import ConfigError

__all__ = ["MalformedCall", "ParsedMessage", "ToolCall", "ToolCallParser", "get_tool_call_parser",
           "parse_hermes", "parse_llama3", "register_tool_call_parser", "tool_call_parser_names"]


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its keyword arguments (a JSON object)."""

    name: str
    arguments: dict = field(default_factory=dict)

    def message(self) -> dict:
        """The call as a chat-template ``tool_calls`` entry (TRL's and transformers' shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class MalformedCall:
    """Something written as a call that is not one.

    text: the call as written; error: what was wrong (one sentence); expected: the format the parser reads, for
    the observation; name: the tool's name when it could be read, else None."""

    text: str
    error: str
    expected: str
    name: Optional[str] = None


Call = Union[ToolCall, MalformedCall]


@dataclass(frozen=True)
class ParsedMessage:
    """One assistant message: its prose and its calls (well-formed and malformed, in the order written)."""

    content: str
    calls: tuple = ()

    @property
    def tool_calls(self) -> list:
        """The well-formed calls only."""
        return [c for c in self.calls if isinstance(c, ToolCall)]

    def assistant_message(self) -> dict:
        """The message as a chat message (``tool_calls`` present only when it has well-formed calls)."""
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [c.message() for c in self.tool_calls]
        return message


ToolCallParser = Callable[[str], ParsedMessage]


def _type_of(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _call_from_json(raw: str, obj, *, arguments_keys: tuple, expected: str) -> Call:
    """A ToolCall from a decoded JSON value, or a MalformedCall saying which field is wrong."""
    if not isinstance(obj, dict):
        return MalformedCall(raw, f"expected a JSON object, got a JSON {_type_of(obj)}", expected)
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return MalformedCall(raw, 'the "name" field (the tool\'s name, a string) is missing', expected)
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj.get(key) if key else None
    if arguments is None:
        arguments = {}  # a call without arguments (TRL normalises a missing one to {})
    if isinstance(arguments, str):  # arguments written as a JSON string (OpenAI's wire format)
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedCall(raw, f'"{arguments_keys[0]}" must be a JSON object of named arguments, got a JSON '
                             f"{_type_of(arguments)}", expected, name)
    return ToolCall(name, arguments)


def _decode(raw: str, *, arguments_keys: tuple, expected: str) -> Call:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as err:
        return MalformedCall(raw, f"not valid JSON ({err.msg} at line {err.lineno} column {err.colno})", expected)
    return _call_from_json(raw, obj, arguments_keys=arguments_keys, expected=expected)


# ------------------------------------------------------------------------------------------------- hermes
_HERMES_EXPECTED = '<tool_call>{"name": <tool name>, "arguments": {<argument>: <value>, ...}}</tool_call>'
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def parse_hermes(text: str) -> ParsedMessage:
    """Every ``<tool_call>JSON</tool_call>`` block of ``text``; the prose is the text outside the blocks.

    A block whose JSON does not parse, is not an object, lacks ``name`` or has non-object ``arguments`` is a
    MalformedCall; so is a ``<tool_call>`` never closed (a message cut short)."""
    calls: list = []
    prose: list = []
    end = 0
    for match in _HERMES_BLOCK.finditer(text):
        prose.append(text[end:match.start()])
        calls.append(_decode(match.group(1).strip(), arguments_keys=("arguments", "parameters"),
                             expected=_HERMES_EXPECTED))
        end = match.end()
    rest = text[end:]
    opened = rest.find(_HERMES_OPEN)
    if opened >= 0:
        prose.append(rest[:opened])
        calls.append(MalformedCall(rest[opened:].strip(), "<tool_call> is not closed by </tool_call>",
                                   _HERMES_EXPECTED))
    else:
        prose.append(rest)
    return ParsedMessage("".join(prose).strip(), tuple(calls))


# ------------------------------------------------------------------------------------------------- llama3
_LLAMA3_EXPECTED = '{"name": <tool name>, "parameters": {<argument>: <value>, ...}}'
_PYTHON_TAG = "<|python_tag|>"
_LLAMA3_CALL_START = re.compile(r'\{\s*"name"\s*:')
_LLAMA3_END = ("<|eot_id|>", "<|eom_id|>")


def parse_llama3(text: str) -> ParsedMessage:
    """Llama 3.1/3.2's JSON tool calls: the message is a call when it starts with ``{"name":`` or with
    ``<|python_tag|>``; it then holds one or more JSON objects (``name`` and ``parameters``, ``arguments``
    accepted too) separated by ``;`` or whitespace. Anything else is prose with no calls."""
    body = text.strip()
    for marker in _LLAMA3_END:
        body = body.removesuffix(marker).rstrip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    elif not _LLAMA3_CALL_START.match(body):
        return ParsedMessage(text.strip())
    decoder = json.JSONDecoder()
    calls: list = []
    pos = 0
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
        if pos >= len(body):
            break
        try:
            obj, stop = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as err:
            calls.append(MalformedCall(body[pos:], f"not valid JSON ({err.msg} at line {err.lineno} column "
                                       f"{err.colno})", _LLAMA3_EXPECTED))
            break
        calls.append(_call_from_json(body[pos:stop], obj, arguments_keys=("parameters", "arguments"),
                                     expected=_LLAMA3_EXPECTED))
        pos = stop
    if not calls:  # <|python_tag|> and nothing after it
        calls.append(MalformedCall(text.strip(), "<|python_tag|> is not followed by a call", _LLAMA3_EXPECTED))
    return ParsedMessage("", tuple(calls))


# ----------------------------------------------------------------------------------------------- registry
_PARSERS: dict = {"hermes": parse_hermes, "llama3": parse_llama3}


def register_tool_call_parser(name: str, fn: ToolCallParser, *, replace: bool = False) -> None:
    """Make ``fn`` (``text -> ParsedMessage``) available as ``name``. Registering a taken name raises ValueError
    unless ``replace=True``."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"tool-call parser name {name!r}: expected a non-empty string without ':' "
                         "('module:function' names a parser by import path instead).")
    if not callable(fn):
        raise ValueError(f"tool-call parser {name!r}: {fn!r} is not callable (expected fn(text) -> ParsedMessage).")
    if name in _PARSERS and not replace and _PARSERS[name] is not fn:
        raise ValueError(f"a tool-call parser named {name!r} is already registered; pass replace=True to "
                         "replace it.")
    _PARSERS[name] = fn


def tool_call_parser_names() -> list:
    """The registered parsers' names, sorted."""
    return sorted(_PARSERS)


def get_tool_call_parser(name: str) -> ToolCallParser:
    """The parser registered as ``name``; ConfigError listing the registered names otherwise."""
    try:
        return _PARSERS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"tool-call parser {name!r} is not registered; expected one of "
                          f"{tool_call_parser_names()} or 'module:function' (register one with "
                          "ppojax.agents.register_tool_call_parser).") from None
