"""The fields' descriptions: ``ppojax train --help`` (:func:`field_help`) and docs/configuration.md
(:func:`configuration_markdown`), both read from the docstring under each field in its section's source."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import fields

from ppojax.trainer.config.ppo_config import PPOConfig


def field_help() -> list[tuple[str, str, str]]:
    """(name, default, description) for every field, for `ppojax train --help`."""
    docs = _field_docstrings()
    return [(f.name, repr(f.default), docs.get(f.name, "")) for f in fields(PPOConfig)]


def configuration_markdown() -> str:
    """docs/configuration.md: every field of PPOConfig with its default, whether changing it recompiles
    (static) and whether a resumed run may change it, and its description; generated from the fields' metadata and
    docstrings (``python -m ppojax.trainer.config > docs/configuration.md``; a test checks the file is current)."""
    lines = ["# Configuration", "",
             "Every field of `PPOConfig` (YAML keys, `key=value` overrides of `ppojax train`, or keyword arguments in",
             "Python), generated from the fields' docstrings by "
             "`python -m ppojax.trainer.config > docs/configuration.md`.",
             "*static*: part of the compiled program (changing it compiles anew); *on resume*: whether a resumed run",
             "must keep it (`must_match`), may change it (`may_change`, reported) or ignores it (`ignored`).", "",
             "| field | default | static | on resume | description |", "|---|---|---|---|---|"]
    docs = _field_docstrings()
    for f in fields(PPOConfig):
        static = "yes" if f.metadata.get("static") else "no"
        on_resume = f.metadata.get("on_resume", "")
        text = docs.get(f.name, "").replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{f.default!r}` | {static} | {on_resume} | {text} |")
    return "\n".join(lines) + "\n"


def _field_docstrings() -> dict[str, str]:
    """The string literal right under each field in its class's source (a section, ppojax.trainer.config.sections)
    is its description."""
    docs = {}
    for cls in PPOConfig.__mro__:
        if not dataclasses.is_dataclass(cls):
            continue
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        for node, following in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)
                    and isinstance(getattr(following, "value", None), ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[node.target.id] = " ".join(following.value.value.split())  # type: ignore[attr-defined]
    return docs
