"""Reading a config's values from YAML: a config file (:func:`load_yaml_mapping`) and ``key=value`` overrides
(:func:`parse_overrides`). Malformed YAML, duplicate keys and unreadable files are ConfigErrors naming the file,
line and column."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ppojax.errors import ConfigError
from ppojax.trainer.config.checks import value_kind


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                try:
                    key = self.construct_object(key_node, deep=True)
                    seen = first_line.get(key)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    continue
                line = key_node.start_mark.line + 1
                if seen is not None:
                    raise ConfigError(
                        f"{key_node.start_mark.name}:{line}: key {key!r} is given twice (lines {seen} and {line}); "
                        "YAML would silently keep the last one. Keep one of them.")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(where: str, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    position = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None else where
    problem = " ".join(filter(None, [getattr(err, "context", None), getattr(err, "problem", None)])) or str(err)
    return ConfigError(f"{position}: not valid YAML ({problem}). Fix the line (YAML: `key: value`, one per "
                       "line, spaces not tabs for indentation; quote values with ':' or '#').")


def load_yaml_mapping(path) -> dict[str, Any]:
    """A YAML config file as a dict; every way it can be unreadable is a ConfigError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"Config file {str(path)!r} is a directory; pass the path of a YAML file "
                          "(see configs/ for examples).")
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist; pass the path of a YAML file "
                          "(see configs/ for examples).")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start}); "
                          "save the config as UTF-8.") from None
    try:
        values = yaml.load(text, Loader=_loader_for(str(path)))
    except yaml.YAMLError as err:
        raise _yaml_error(str(path), err) from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of field: value (one `key: value` per line), got "
                          f"{value_kind(values)}.")
    return values


def _loader_for(name: str):
    """_StrictLoader whose marks carry ``name`` (PyYAML names a string's stream '<unicode string>')."""
    class Loader(_StrictLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.name = name
    return Loader


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['key=value', ...] -> {key: YAML-parsed value}; a key given twice is an error."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"Override {item!r} is not of the form key=value (e.g. learning_rate=1e-5).")
        if key in parsed:
            raise ConfigError(f"Override key {key!r} is given twice; keep one of them.")
        try:
            parsed[key] = yaml.load(raw, Loader=_loader_for(f"override {item!r}")) if raw.strip() else None
        except yaml.YAMLError as err:
            raise _yaml_error(f"override {item!r}", err) from None
    return parsed
