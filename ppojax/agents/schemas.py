"""A tool's JSON schema, read from its signature and docstring exactly as TRL reads it.

TRL's ``GRPOTrainer(tools=[...])`` hands the functions to ``tokenizer.apply_chat_template(tools=...)``, which turns
each callable into a schema with ``transformers.utils.get_json_schema``; ppojax calls the same function, so a
tool's schema (and therefore the prompt the model sees) is byte-for-byte TRL's:

    {"type": "function",
     "function": {"name": fn.__name__, "description": <docstring's first paragraph>,
                  "parameters": {"type": "object", "properties": {arg: {"type": ..., "description": ...}},
                                 "required": [args without a default]},
                  "return": {"type": ...}}}

What transformers cannot turn into a schema (a parameter without a type hint, no docstring, a parameter the
docstring's ``Args:`` section does not describe) is refused here, when the run is built, with a ``ConfigError``
naming the tool and the fix, instead of failing at the first prompt.
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterable

from ppojax.errors import ConfigError

__all__ = ["callable_name", "tool_name", "tool_schema", "tool_schemas"]

_DOCSTRING_FIX = ("Fix: give it a Google-style docstring: a one-line description, then an `Args:` section with "
                  "one `name: description` line per parameter (TRL and transformers build the tool's schema from it).")
_HINT_FIX = "Fix: annotate every parameter with its type (e.g. `def search(query: str, limit: int = 5) -> str`)."


def callable_name(fn) -> str:
    """``module.qualname`` of a function or method, for messages; the class name for other callables."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


def _sentence(err: BaseException) -> str:
    """transformers' message without its closing "!" or ".", for ours to continue."""
    return str(err).rstrip("!. ")


def tool_name(fn: Callable) -> str:
    """The name the model calls a tool by: the function's ``__name__`` (TRL's key for its tool dicts)."""
    return fn.__name__


def tool_schema(fn: Callable, *, what: str = "tool") -> dict:
    """``fn``'s JSON schema (``get_json_schema(fn)``, the module docstring's shape).

    what: how messages name the value ("tool", "environment MyEnv's tool method"). Raises ConfigError when ``fn``
    is not a function, or transformers cannot build its schema (missing type hint or docstring)."""
    if not callable(fn) or not hasattr(fn, "__name__"):
        raise ConfigError(f"{what} {fn!r} is not a function (its type is {type(fn).__name__}); a tool is a Python "
                          "function (sync or async) with type hints and a Google-style docstring.")
    if inspect.isclass(fn):
        raise ConfigError(f"{what} {callable_name(fn)} is a class; pass it as an environment "
                          "(environment_factory), or pass a function as a tool.")
    # transformers imports torch where installed (seconds), and advises at import that its models need it where not
    from transformers.utils import get_json_schema  # noqa: PLC0415
    from transformers.utils.chat_template_utils import (  # noqa: PLC0415
        DocstringParsingException, TypeHintParsingException)

    named = f"{what} {callable_name(fn)}"
    try:
        return get_json_schema(fn)
    except TypeHintParsingException as err:
        raise ConfigError(f"{named} cannot be described to the model: {_sentence(err)}. {_HINT_FIX}") from err
    except DocstringParsingException as err:
        raise ConfigError(f"{named} cannot be described to the model: {_sentence(err)}. {_DOCSTRING_FIX}") from err
    except Exception as err:  # noqa: BLE001 - any other reason transformers gives is the same user mistake
        raise ConfigError(f"{named} cannot be described to the model ({type(err).__name__}: {err}). "
                          f"{_HINT_FIX} {_DOCSTRING_FIX}") from err


def tool_schemas(tools: Iterable[Callable], *, what: str = "tool") -> list[dict]:
    """The schemas of ``tools`` in order; ConfigError for one that has none (see :func:`tool_schema`) or for two
    tools under one name (the model could not tell them apart)."""
    tools = list(tools)
    schemas = [tool_schema(fn, what=what) for fn in tools]
    seen: dict = {}
    for fn in tools:
        other = seen.setdefault(tool_name(fn), fn)
        if other != fn:
            raise ConfigError(f"two tools are named {tool_name(fn)!r} ({callable_name(other)} and "
                              f"{callable_name(fn)}); the model calls a tool by name. Fix: rename one.")
    return schemas
