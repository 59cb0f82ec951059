"""Strict, typed reading of a YAML file into nested dataclasses (the job file's and the fleet
file's loaders).

`read_mapping(path, what)` reads the file as a YAML mapping (an unreadable file, a YAML syntax
error or a top level that is not a mapping named with the file and the fix).

`build(cls, mapping, where)` converts a mapping into the dataclass `cls` by its type hints:
an unknown key is answered with the list of valid keys, a value of the wrong type with the
file, the key, the value and the fix, a missing required key by name. `walk(obj, where)` then
runs every dataclass's own `check(where)`, depth first. The supported field types: bool, int,
float (also from YAML's '3e-4' string), str, Literal, Optional, list, tuple, dict[str, str] and
nested dataclasses. A field named `source` is not a key (JobConfig's: the file's name).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from oobleck_hpc.errors import ConfigError, YamlSyntaxError


def read_mapping(path: Path, what: str) -> dict:
    """The YAML mapping in `path` ({} for an empty file); `what` names the file's kind in the
    messages ("YAML job file", "fleet file")."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(str(path), "<file>", f"cannot be read ({e.strerror})",
                          f"pass the path of an existing {what}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        raise YamlSyntaxError.of(str(path), e) from e
    except yaml.YAMLError as e:
        raise ConfigError(str(path), "<file>", f"is not valid YAML ({e})",
                          "correct the YAML (spaces for indentation, 'key: value' with a space "
                          "after the colon, brackets and quotes closed)") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(str(path), "<top>", f"is a {type(data).__name__}, not a mapping",
                          f"write the {what} as 'key: value' lines")
    return data


@dataclass(frozen=True)
class Where:
    """A place in the job file: the file and the dotted key prefix, for messages."""

    source: str
    prefix: str

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def child(self, name: str) -> Where:
        return Where(self.source, self.key(name))

    def fail(self, name: str, value: Any, problem: str, fix: str) -> typing.NoReturn:
        raise ConfigError(self.source, self.key(name), f"value {value!r} {problem}", fix)


def build(cls: type, data: Any, where: Where) -> Any:
    name = where.prefix or "<top>"
    if not isinstance(data, dict):
        raise ConfigError(where.source, name, f"is {data!r}, not a mapping",
                          f"give '{name}' as indented 'key: value' lines")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(where.source, where.key(str(unknown[0])), "is not a known key",
                          f"valid keys here are: {', '.join(fields)}")
    kwargs = {key: convert(hints[key], value, where, key) for key, value in data.items()}
    missing = [k for k, f in fields.items()
               if k not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(where.source, where.key(missing[0]), "is required but missing",
                          f"add '{missing[0]}:' to this section")
    return cls(**kwargs)


def convert(tp: Any, value: Any, where: Where, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return convert(inner, value, where, key)
    if origin is Literal:
        if value not in args:
            where.fail(key, value, "is not one of the choices",
                       f"use one of: {', '.join(map(str, args))}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where.child(key))
    if origin is list:
        if not isinstance(value, list):
            where.fail(key, value, "is not a list", "write it as a YAML list ('- item' lines)")
        return [convert(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            where.fail(key, value, f"is not a list of {len(args)} numbers",
                       f"write it as [{', '.join('x' * len(args))}]")
        return tuple(convert(a, v, where, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            where.fail(key, value, "is not a mapping", "write it as indented 'key: value' lines")
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            where.fail(key, value, "is not true/false", "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            where.fail(key, value, "is not an integer", "write a whole number without quotes")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            where.fail(key, value, "is not a number", "write a number without quotes")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            where.fail(key, value, "is not a string", "write text (quote it if YAML reads it as a number)")
        return value
    raise TypeError(f"config type {tp!r} of {where.key(key)} is not supported")  # a bug, not input


def walk(obj: Any, where: Where) -> None:
    """Run each dataclass's own check(), depth first, with the key path for messages."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            walk(value, where.child(f.name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    walk(item, where.child(f"{f.name}[{i}]"))
    check = getattr(obj, "check", None)
    if check is not None:
        check(where)
