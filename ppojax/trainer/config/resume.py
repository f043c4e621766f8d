"""Resuming: which config differences a checkpoint tolerates (each field's ``on_resume``: must_match fields
refuse a change, may_change fields report it, ignored fields are skipped)."""
from __future__ import annotations

import json

from ppojax.errors import CheckpointError, ConfigError
from ppojax.trainer.config.ppo_config import PPOConfig
from ppojax.trainer.config.schema import FIELD_BY_NAME, FIELD_NAMES, IGNORED_ON_RESUME_FIELDS, MAY_CHANGE_FIELDS

_ABSENT = object()


def _json_value(value):
    return json.loads(json.dumps(value, default=str))


def resume_compatibility(saved: dict, now: dict) -> list[str]:
    """Refuse to resume a run whose config differs from the checkpoint's where it matters.

    saved / now: config dicts (``PPOConfig.to_dict()``; a PPOConfig is accepted too). Raises ConfigError
    listing every differing must_match field (and any key that is not a field) as ``name: saved -> now``.
    Returns the differing may_change fields (same format) so the caller can report them; ignored fields
    (output_dir, logging, save_steps, total_episodes, resume, ...) are skipped. A field one side lacks counts
    as its default (checkpoints from older versions stay loadable).
    """
    saved, now = (_json_value(c.to_dict() if isinstance(c, PPOConfig) else dict(c)) for c in (saved, now))
    defaults = _json_value({n: FIELD_BY_NAME[n].default for n in FIELD_NAMES})
    strict, tunable = [], []
    for name in sorted(set(saved) | set(now)):
        if name in IGNORED_ON_RESUME_FIELDS:
            continue
        if name == "per_device_train_batch_size" and saved.get("batch_size") is not None \
                and saved.get("batch_size") == now.get("batch_size"):
            continue  # ignored when the global batch_size is set (and equal)
        a = saved.get(name, defaults.get(name, _ABSENT))
        b = now.get(name, defaults.get(name, _ABSENT))
        if a == b:
            continue
        line = f"  {name}: {'<absent>' if a is _ABSENT else repr(a)} -> {'<absent>' if b is _ABSENT else repr(b)}"
        (tunable if name in MAY_CHANGE_FIELDS else strict).append(line)
    if strict:
        raise ConfigError(
            "The checkpoint was written by a run with a different configuration "
            f"({len(strict)} field(s) that must match differ; saved -> now):\n" + "\n".join(strict)
            + "\nUse the checkpoint's values (its config.json), or start a fresh run (resume: null, or another "
              "output_dir).")
    return [line.strip() for line in tunable]


def check_compatible(saved_config, config) -> list[str]:
    """:func:`resume_compatibility` on dicts or PPOConfigs (``to_dict()``), raising `CheckpointError` where a field
    that must match differs: the checkpoint cannot be resumed with this config."""
    from ppojax.io.checkpoint import config_as_dict  # noqa: PLC0415 - imports JAX; checking a config does not

    try:
        return resume_compatibility(config_as_dict(saved_config), config_as_dict(config))
    except ConfigError as err:
        raise CheckpointError(str(err)) from None
