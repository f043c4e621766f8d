"""The fields' descriptions: ``ppojax train --help`` (:func:`field_help`) and docs/configuration.md
(:func:`configuration_markdown`), both read from the docstring under each field in its section's source."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import fields

from ppojax.trainer.config.checks import VALUE_ALIASES
from ppojax.trainer.config.names import LEGACY_ALIASES
from ppojax.trainer.config.ppo_config import PPOConfig
from ppojax.trainer.config.trl_grpo import GMPO_DEFAULTS, TRL_GRPO_DEFAULTS

BETA = ("kl_loss_coef in a TRL GRPOTrainer config (one that sets TRL's loss_type) or with advantage_estimator: "
        "grpo; kl_coef with advantage_estimator: rloo (TRL's RLOO); refused where the file does not say which")
TRL_GRPO_READING = (
    "A config file (or mapping) that sets loss_type to one of TRL's (not ppo) is read as a TRL GRPOTrainer "
    "config: each key it sets means what it means in TRL 1.12, and the fields it leaves out (under every name) "
    "take GRPOConfig's defaults where ppojax's differ: {defaults}; with loss_type gmpo, GMPOConfig's {gmpo}. A "
    "file without TRL's loss_type keeps ppojax's defaults.")


def field_help() -> list[tuple[str, str, str]]:
    """(name, default, description) for every field, for `ppojax train --help`."""
    docs = _field_docstrings()
    return [(f.name, repr(f.default), docs.get(f.name, "")) for f in fields(PPOConfig)]


def alias_help() -> list[tuple[str, str]]:
    """(key, what it is read as) for every other library's name of a field (``ppojax train --help`` and
    docs/configuration.md)."""
    rows = [(key, field) for key, field in LEGACY_ALIASES.items()] + [("beta", BETA)]
    for field, spellings in VALUE_ALIASES.items():
        for spelling, meaning in spellings:
            rows.append((f"{field}: {spelling!r}", f"{field}: {meaning!r}"))
    return rows


def trl_grpo_reading() -> str:
    """How a TRL GRPOTrainer config is read, in words (``ppojax.trainer.config.trl_grpo``)."""
    def listed(values):
        return ", ".join(f"{field}: {value!r}" for field, value in values.items())
    return TRL_GRPO_READING.format(defaults=listed(TRL_GRPO_DEFAULTS), gmpo=listed(GMPO_DEFAULTS))


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
    lines += ["", "## Other libraries' names", "",
              "Keys of legacy TRL, TRL 1.12's GRPOConfig / RLOOConfig and verl that name a field (or a value) are read",
              "as that field (two names of one field with different values are refused). The other keys of TRL and",
              "transformers' `TrainingArguments` are refused with what to set instead.", "",
              "| key | read as |", "|---|---|"]
    lines += [f"| `{key}` | {meaning.replace('|', chr(92) + '|')} |" for key, meaning in alias_help()]
    lines += ["", "### A TRL GRPOTrainer config", "", trl_grpo_reading()]
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
