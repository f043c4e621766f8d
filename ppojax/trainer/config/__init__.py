"""PPOConfig: every knob of a run, under TRL's names, checked when it is built.

Field names and defaults follow TRL 1.12's ``PPOConfig`` (docs/algorithm.md, "Defaults"); the legacy (TRL <= 0.11) names
are accepted as aliases and mapped on load, and the TRL / transformers ``TrainingArguments`` keys ppojax has no
field for are refused with the field that replaces them (``FOREIGN_KEYS``). Derived sizes (``batch_size``,
``mini_batch_size``, ``micro_batch_size``) are computed by :meth:`PPOConfig.derived`, never stored twice.

Checks run when the config is built, in Python (``PPOConfig(...)``) and from YAML alike, before any model is
loaded: each field's type (no bool where a number is expected, no NaN/inf, no list where a number is
expected) and range, then the checks that need several fields. Every bad value is reported in one
``ConfigError`` naming the field, the value, what was expected and the fix. Checks that need the model or
the devices (vocabulary, position limit, mesh vs devices) happen when the trainer is built.

PPOConfig is flat (``PPOConfig(learning_rate=1e-5, batch_size=32)``, one YAML mapping); its source is split by
concern:

    fields.py      how a field is declared: ``setting`` (default, static, on_resume, rule) and the rules
    sections/      the fields, one module per concern (models, data, run, batches, optimizer, objective,
                   sampling, mesh), each field with its docstring, its description
    schema.py      the sections combined in ``--help`` order (SECTIONS) and the tables derived from the fields'
                   metadata (FIELD_NAMES, STATIC_FIELDS, the on-resume sets, StaticSettings)
    ppo_config.py  PPOConfig: validation, derived batch sizes, (de)serialisation
    checks.py      each value's type and rule, the checks that need several fields
    names.py       legacy aliases, other libraries' keys, unknown keys
    trl_grpo.py    reading a TRL GRPOTrainer config: GRPOConfig's defaults, beta, GRPOConfig's other keys
    yaml_io.py     YAML files and ``key=value`` overrides
    resume.py      which config differences a resumed run tolerates
    help.py        ``ppojax train --help`` and docs/configuration.md (``python -m ppojax.trainer.config``)

Every name other modules use is importable from here. Names with a leading underscore are private to this package.
"""
from ppojax.errors import ConfigError
from ppojax.trainer.config.checks import VALUE_ALIASES, expected_of
from ppojax.trainer.config.fields import (IGNORED, MAY_CHANGE, MUST_MATCH, NON_EMPTY, ON_RESUME, Rule, above, at_least,
                                          between, one_of, registered, setting)
from ppojax.trainer.config.help import alias_help, configuration_markdown, field_help, trl_grpo_reading
from ppojax.trainer.config.names import FOREIGN_KEYS, LEGACY_ALIASES, field_names, normalise_keys
from ppojax.trainer.config.ppo_config import DerivedSizes, PPOConfig
from ppojax.trainer.config.resume import check_compatible, resume_compatibility
from ppojax.trainer.config.schema import (FIELD_NAMES, IGNORED_ON_RESUME_FIELDS, MAY_CHANGE_FIELDS, MUST_MATCH_FIELDS,
                                          SECTIONS, STATIC_FIELDS, StaticSettings)
from ppojax.trainer.config.sections.models import BUILTIN_REWARDS, IN_PLACE_MATMULS, MATMUL_IMPLEMENTATIONS
from ppojax.trainer.config.sections.objective import (ADVANTAGE_ESTIMATOR_NAME, BUILTIN_ADVANTAGE_ESTIMATORS,
                                                      BUILTIN_KL_ESTIMATORS, BUILTIN_POLICY_OBJECTIVES,
                                                      KL_ESTIMATOR_NAME, PER_SEQUENCE_ADVANTAGE_ESTIMATORS,
                                                      POLICY_OBJECTIVE_LEVEL_REASONS, POLICY_OBJECTIVE_NAME,
                                                      SCORE_POSITIONS)
from ppojax.trainer.config.trl_grpo import GMPO_DEFAULTS, GRPO_FOREIGN_KEYS, TRL_GRPO_DEFAULTS
from ppojax.trainer.config.sections.run import REPORT_SINKS
from ppojax.trainer.config.yaml_io import load_yaml_mapping, parse_overrides

__all__ = [
    "ADVANTAGE_ESTIMATOR_NAME", "BUILTIN_ADVANTAGE_ESTIMATORS", "BUILTIN_KL_ESTIMATORS", "BUILTIN_POLICY_OBJECTIVES",
    "BUILTIN_REWARDS", "GMPO_DEFAULTS", "GRPO_FOREIGN_KEYS", "PER_SEQUENCE_ADVANTAGE_ESTIMATORS",
    "POLICY_OBJECTIVE_LEVEL_REASONS", "POLICY_OBJECTIVE_NAME", "TRL_GRPO_DEFAULTS",
    "ConfigError", "DerivedSizes", "FIELD_NAMES", "FOREIGN_KEYS", "IGNORED", "IGNORED_ON_RESUME_FIELDS",
    "IN_PLACE_MATMULS", "KL_ESTIMATOR_NAME", "LEGACY_ALIASES", "MATMUL_IMPLEMENTATIONS", "MAY_CHANGE",
    "MAY_CHANGE_FIELDS", "MUST_MATCH", "MUST_MATCH_FIELDS", "NON_EMPTY", "ON_RESUME", "PPOConfig", "REPORT_SINKS",
    "Rule", "SCORE_POSITIONS", "SECTIONS", "STATIC_FIELDS", "StaticSettings", "VALUE_ALIASES", "above", "at_least",
    "alias_help", "between", "check_compatible", "configuration_markdown", "expected_of", "field_help", "field_names",
    "load_yaml_mapping", "normalise_keys", "one_of", "parse_overrides", "registered", "resume_compatibility",
    "setting", "trl_grpo_reading",
]
