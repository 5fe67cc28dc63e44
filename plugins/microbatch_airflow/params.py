"""The trigger-form parameters of a pipeline DAG, as JSON schema (Airflow ``Param``).

==============  =====================================  =================================
param           schema                                 meaning
==============  =====================================  =================================
``parallelism`` integer, ``1..max_parallelism``        operator instances for this batch
``max_records`` null or integer ``≥ 1``                cap on records in this batch
``dry_run``     boolean                                plan only: log the offset ranges
                                                       and lag, commit nothing
==============  =====================================  =================================

Airflow validates a run's ``conf`` against these before the run exists: a manual trigger
with ``parallelism: 0`` is refused by the UI, the REST API and ``dag.test``.
"""

from __future__ import annotations

from typing import Any

from microbatch.errors import ConfigError


def check_parallelism_bounds(max_parallelism: int, default_parallelism: int) -> None:
    """Validate the factory's numbers before they become a schema."""
    if not isinstance(max_parallelism, int) or not 1 <= max_parallelism <= 32768:
        raise ConfigError(f"max_parallelism must be an int in 1..32768, got {max_parallelism!r}")
    if not isinstance(default_parallelism, int) or not (
        1 <= default_parallelism <= max_parallelism
    ):
        raise ConfigError(
            f"default_parallelism must be an int in 1..{max_parallelism} (max_parallelism), "
            f"got {default_parallelism!r}"
        )


def batch_param_schemas(max_parallelism: int, default_parallelism: int) -> dict[str, dict]:
    """``{name: (default and) JSON schema}`` — plain data, unit-testable without Airflow."""
    check_parallelism_bounds(max_parallelism, default_parallelism)
    return {
        "parallelism": {
            "default": default_parallelism,
            "type": "integer",
            "minimum": 1,
            "maximum": max_parallelism,
            "title": "Parallelism",
            "description": (
                f"Operator instances for this batch (1..{max_parallelism}). A replayed batch "
                "keeps the parallelism it was planned with."
            ),
        },
        "max_records": {
            "default": None,
            "type": ["null", "integer"],
            "minimum": 1,
            "title": "Max records",
            "description": "Cap on records read in this batch; empty means the pipeline's own.",
        },
        "dry_run": {
            "default": False,
            "type": "boolean",
            "title": "Dry run",
            "description": "Plan only: log the offset ranges and lag, commit nothing.",
        },
    }


def batch_params(max_parallelism: int, default_parallelism: int) -> dict[str, Any]:
    """The DAG's ``params``: one :class:`airflow.sdk.Param` per schema above."""
    from airflow.sdk import Param

    params = {}
    for name, schema in batch_param_schemas(max_parallelism, default_parallelism).items():
        schema = dict(schema)
        default = schema.pop("default")
        params[name] = Param(default, **schema)
    return params


def batch_cli_args(
    *,
    until: str | None,
    run_id: str | None,
    parallelism: int | None,
    max_records: int | None,
    dry_run: bool,
    interval_start: str | None = None,
    backfill: bool = False,
    accept_kafka_repeats: bool = False,
) -> list[str]:
    """The ``microbatch run`` arguments for one batch (see ``docs/runtime.md``)."""
    args: list[str] = []
    if interval_start:
        args += ["--interval-start", interval_start]
    if until:
        args += ["--until", until]
    if backfill:
        args.append("--backfill")
        if accept_kafka_repeats:
            args.append("--accept-kafka-repeats")
    if run_id:
        args += ["--run-id", run_id]
    if parallelism is not None:
        args += ["--parallelism", str(int(parallelism))]
    if max_records is not None:
        args += ["--max-records", str(int(max_records))]
    if dry_run:
        args.append("--dry-run")
    return args
