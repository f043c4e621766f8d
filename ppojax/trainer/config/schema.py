"""Every section's fields as one dataclass, :class:`Settings`, in the order ``ppojax train --help`` lists them, and
the tables derived from the fields' metadata: FIELD_NAMES, FIELD_BY_NAME, FIELD_HINTS (their type hints),
STATIC_FIELDS, the on-resume sets, StaticSettings."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, fields

from ppojax.trainer.config.fields import IGNORED, MAY_CHANGE, MUST_MATCH
from ppojax.trainer.config.sections.agents import AgentSettings
from ppojax.trainer.config.sections.asynchronous import AsyncSettings
from ppojax.trainer.config.sections.batches import BatchSettings
from ppojax.trainer.config.sections.data import DataSettings
from ppojax.trainer.config.sections.mesh import MeshSettings
from ppojax.trainer.config.sections.models import LoraSettings, ModelSettings
from ppojax.trainer.config.sections.objective import ObjectiveSettings
from ppojax.trainer.config.sections.offpolicy import OffPolicySettings
from ppojax.trainer.config.sections.optimizer import OptimizerSettings
from ppojax.trainer.config.sections.run import OutputSettings, RunSettings
from ppojax.trainer.config.sections.sampling import SamplingSettings

SECTIONS = (ModelSettings, LoraSettings, DataSettings, RunSettings, BatchSettings, OptimizerSettings,
            ObjectiveSettings, OffPolicySettings, AsyncSettings, SamplingSettings, AgentSettings, OutputSettings,
            MeshSettings)
"""The sections in the order their fields are listed: ``ppojax train --help``, docs/configuration.md,
``PPOConfig.to_dict`` and checkpoints' config.json."""


@dataclass
class Settings(*reversed(SECTIONS)):
    """Every section's fields. A dataclass collects its bases' fields from the last base to the first: the bases
    are SECTIONS reversed so that the fields come in SECTIONS' order."""


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Settings))
FIELD_BY_NAME = {f.name: f for f in fields(Settings)}
FIELD_HINTS = typing.get_type_hints(Settings)

STATIC_FIELDS: tuple[str, ...] = tuple(n for n in FIELD_NAMES if FIELD_BY_NAME[n].metadata["static"])
"""Fields whose value shapes a compiled program (in declaration order)."""
MUST_MATCH_FIELDS = frozenset(n for n in FIELD_NAMES if FIELD_BY_NAME[n].metadata["on_resume"] == MUST_MATCH)
MAY_CHANGE_FIELDS = frozenset(n for n in FIELD_NAMES if FIELD_BY_NAME[n].metadata["on_resume"] == MAY_CHANGE)
IGNORED_ON_RESUME_FIELDS = frozenset(n for n in FIELD_NAMES if FIELD_BY_NAME[n].metadata["on_resume"] == IGNORED)

StaticSettings = dataclasses.make_dataclass(
    "StaticSettings", [(n, FIELD_BY_NAME[n].type) for n in STATIC_FIELDS], frozen=True)
StaticSettings.__module__ = __name__
StaticSettings.__doc__ = ("PPOConfig's static fields (STATIC_FIELDS) as a frozen, hashable view: "
                          "PPOConfig.static_settings().")
