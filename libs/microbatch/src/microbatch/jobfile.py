"""A job file's pipeline, built with its caller's settings and environment.

A pipeline is named by reference: ``path/to/job.py``, ``path/to/job.py:attr`` or
``package.module:attr``; ``attr`` defaults to ``pipeline``. The attribute is either

- a :class:`~microbatch.runtime.Pipeline`, for a pipeline that needs no configuration, or
- a function ``pipeline(settings, env) -> Pipeline`` that reads its configuration when
  called, never at import: ``settings`` are the caller's resolved
  :class:`~microbatch.settings.Settings`, ``env`` the environment the job's own process
  gets (its ``MICROBATCH_<PIPELINE>_*`` variables). A function without parameters is
  called as it is.

So every caller builds the same pipeline with no global state: the CLI and a spark-submit
run from ``Settings.from_env()`` and ``os.environ``; an Airflow task, the UI page and the
new-data check from the Airflow connections' settings and the environment they hand the
job.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from microbatch.errors import ConfigError
from microbatch.settings import Settings

if TYPE_CHECKING:
    from microbatch.runtime import Pipeline

DEFAULT_ATTRIBUTE = "pipeline"


def load_pipeline(
    ref: str, settings: Settings | None = None, env: Mapping[str, str] | None = None
) -> Pipeline:
    """The Pipeline ``ref`` points at, built for ``settings`` and ``env``.

    ``env`` defaults to ``os.environ``, ``settings`` to ``Settings.from_env(env)``.
    """
    from microbatch.dataflow import Dataflow
    from microbatch.runtime import Pipeline

    target, _, attr = ref.partition(":")
    attr = attr or DEFAULT_ATTRIBUTE
    obj = getattr(_import(target), attr, None)
    if isinstance(obj, Dataflow):
        obj = obj.build()
    if callable(obj) and not isinstance(obj, Pipeline):
        env = os.environ if env is None else env
        obj = _build(obj, Settings.from_env(env) if settings is None else settings, env)
    if not isinstance(obj, Pipeline):
        raise ConfigError(f"{ref!r}: {attr!r} is not a microbatch Pipeline (got {obj!r:.100})")
    return obj


def _import(target: str) -> ModuleType:
    """The module of a job file (run afresh on every call) or of an importable name."""
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(target).resolve()
    if not path.is_file():
        raise ConfigError(f"pipeline file {target!r} does not exist")
    name = f"microbatch_job_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import {target!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _build(factory: Any, settings: Settings, env: Mapping[str, str]) -> Any:
    if not inspect.signature(factory).parameters:
        return factory()
    return factory(settings, env)
