"""Checks shared by every declaration (pipelines, sources, sinks): names and numbers."""

from __future__ import annotations

import re

from microbatch.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def check_name(kind: str, name: str) -> str:
    """A name that can name objects, topics and consumer groups."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            f"{kind} name {name!r} must be 1-100 characters of letters, digits, '_', '.', '-' "
            "(it names objects, topics and consumer groups)"
        )
    return name


def check_positive(what: str, value: float | None, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{what} must be a positive number, got {value!r}")
