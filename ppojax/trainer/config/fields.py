"""How a PPOConfig field is declared: :func:`setting` (its default and metadata) and the :class:`Rule` its value
must satisfy beyond its type, with the helpers that build the common rules.

Every field is declared with :func:`setting`: its default, and metadata that the rest of ppojax derives from
instead of copying field lists by hand:

    static     the value shapes a compiled program (a ``jax.jit`` static argument): ``PPOConfig.static_settings``
    on_resume  'must_match' / 'may_change' / 'ignored' when a run resumes from a checkpoint:
               ``resume_compatibility`` (resume.py)
    rule       what the value must satisfy beyond its type (checked with the type when the config is built:
               checks.py)

and a docstring under it, its description (``ppojax train --help`` and docs/configuration.md: help.py).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

MUST_MATCH = "must_match"  # a resumed run refuses a different value (models, data, shapes, batch structure)
MAY_CHANGE = "may_change"  # a resumed run may use another value (reported): learning rate, clip ranges, ...
IGNORED = "ignored"        # where and how long to run, what to log
ON_RESUME = (MUST_MATCH, MAY_CHANGE, IGNORED)


@dataclass(frozen=True)
class Rule:
    """What a field's value must satisfy beyond its type.

    ok: the predicate (called on a value of the field's type, never on None).
    expected: what a good value is, e.g. '{a} >= 0' ({a} becomes 'an integer' or 'a number').
    fix: how to fix a bad value ('' for the generic "set NAME to EXPECTED").
    registry: for a name looked up in a registry of ppojax.core, the registered names (a function: a
        notebook may register more before the config is built; see ``registered``).
    """

    ok: Callable[[Any], bool]
    expected: str
    fix: str = ""
    registry: Optional[Callable[[], tuple]] = None


def at_least(low, fix: str = "") -> Rule:
    return Rule(lambda v: v >= low, f"{{a}} >= {low}", fix)


def above(low, fix: str = "") -> Rule:
    return Rule(lambda v: v > low, f"{{a}} > {low}", fix)


def between(low, high, *, open_low=False, open_high=False) -> Rule:
    def ok(v):
        return (low < v if open_low else low <= v) and (v < high if open_high else v <= high)
    return Rule(ok, f"{{a}} in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}")


def one_of(*choices, fix: str = "") -> Rule:
    words = " or ".join(map(repr, choices)) if len(choices) <= 2 else "one of " + ", ".join(map(repr, choices))
    return Rule(lambda v: v in choices, words, fix)


NON_EMPTY = Rule(lambda v: v.strip() != "", "a non-empty string")


def registered(what: str, module: str, names_function: str, builtin: tuple) -> Rule:
    """A name that must be registered in ``ppojax.core.<module>`` (listed by its ``names_function()``).

    Importing that module imports JAX, which takes seconds, and a config is checked before that. Until the
    module is imported nothing but its built-in names can be registered there, so the check reads ``builtin``
    then (tests/test_config.py checks ``builtin`` equals what the module registers by itself); once it is
    imported (a notebook that registered its own estimator), the registry itself.
    """
    def names() -> tuple:
        loaded = sys.modules.get(f"ppojax.core.{module}")
        return tuple(getattr(loaded, names_function)()) if loaded is not None else builtin
    return Rule(lambda v: v in names(), f"one of the registered {what}", registry=names)


def setting(default, *, static: bool, on_resume: str, rule: Optional[Rule] = None):
    """A PPOConfig field: its default and its metadata (see the module docstring)."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume={on_resume!r}: expected one of {ON_RESUME}")
    return dataclasses.field(default=default, metadata={"static": static, "on_resume": on_resume, "rule": rule})
