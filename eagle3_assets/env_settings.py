"""Deployment settings from EAGLE3_* environment variables, checked when the code location
loads: a bad value fails there, naming the variable, what was expected and what was found.

Each settings class maps its fields to variables (`env`); the defaults stay in the class, so
a variable that is unset or empty means "the default". Secrets (`secrets`) are never read
here: they become `EnvVar`s that Dagster resolves at run time, so they stay out of config,
logs and metadata.
"""

from __future__ import annotations

import json
import os
import shlex
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

import dagster as dg
from pydantic import BaseModel, ValidationError


class SettingsError(ValueError):
    """One line per bad variable: name, expected, found."""


def comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def named_paths(value: str) -> dict[str, str]:
    """`name=path,name=path`."""
    named = {}
    for item in comma_list(value):
        name, equals, path = item.partition("=")
        if not (name and equals and path):
            raise ValueError(f"expected name=path items separated by commas (not {item!r})")
        named[name] = path
    return named


def _default_parser(annotation: Any) -> Callable[[str], Any]:
    """Lists are shell words (`--enforce-eager --max-num-seqs 8`), dicts JSON objects; pydantic
    parses the rest from the string (ints, floats, booleans such as 1/0/true/false). A parser
    raises ValueError("expected ...")."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _default_parser(args[0]) if len(args) == 1 else str
    if origin is list:
        return shlex.split
    if origin is dict:
        return _json_object
    return str


def _json_object(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise ValueError(f"expected a JSON object ({error})") from None
    if not isinstance(parsed, dict):
        raise ValueError("expected a JSON object")
    return parsed


class EnvSettings(BaseModel):
    """Mixin for settings classes (Dagster resources or plain models) read from variables."""

    env: ClassVar[Mapping[str, str | tuple[str, Callable[[str], Any]]]] = {}
    secrets: ClassVar[Mapping[str, str]] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        variables: dict[str, str] = {}
        problems: list[str] = []
        for field, spec in cls.env.items():
            variable, parse = spec if isinstance(spec, tuple) else (spec, None)
            raw = environ.get(variable, "")
            if not raw.strip():
                continue
            variables[field] = variable
            parse = parse or _default_parser(cls.model_fields[field].annotation)
            try:
                values[field] = parse(raw)
            except ValueError as error:
                problems.append(f"{variable}: {error}, found {raw!r}")
        for field, variable in cls.secrets.items():
            if environ.get(variable):
                values[field] = dg.EnvVar(variable)
        if not problems:
            try:
                return cls(**values)
            except ValidationError as error:
                problems = [_explain(e, variables, values) for e in error.errors()]
        raise SettingsError(f"{cls.__name__}: " + "\n".join(problems))

    @classmethod
    def variables(cls) -> dict[str, str]:
        """field -> variable, secrets included: the settings a deployment can give."""
        named = {f: s if isinstance(s, str) else s[0] for f, s in cls.env.items()}
        return named | dict(cls.secrets)


def _explain(error: Any, variables: dict[str, str], values: dict[str, Any]) -> str:
    field = str(error["loc"][0]) if error["loc"] else ""
    where = variables.get(field, field or "settings")
    message = error["msg"].removeprefix("Value error, ")
    expected = message.removeprefix("Input should be ")
    found = values.get(field, error.get("input"))
    if expected != message:
        return f"{where}: expected {expected}, found {found!r}"
    return f"{where}: {message} (found {found!r})"
