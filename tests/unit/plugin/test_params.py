"""The trigger form's params: JSON schema bounds, Airflow's validation, CLI arguments."""

from __future__ import annotations

import pytest
from airflow.sdk import Param
from airflow.sdk.exceptions import ParamValidationError

from microbatch.errors import ConfigError
from microbatch_airflow.params import batch_cli_args, batch_param_schemas, batch_params


def test_schemas_bound_parallelism_by_max_parallelism_and_default_to_a_plain_batch():
    schemas = batch_param_schemas(max_parallelism=64, default_parallelism=2)

    assert schemas["parallelism"] | {"description": ""} == {
        "default": 2,
        "type": "integer",
        "minimum": 1,
        "maximum": 64,
        "title": "Parallelism",
        "description": "",
    }
    assert schemas["max_records"]["type"] == ["null", "integer"]
    assert schemas["max_records"]["default"] is None
    assert schemas["dry_run"] == schemas["dry_run"] | {"type": "boolean", "default": False}


@pytest.mark.parametrize(("name", "value"), [("parallelism", 1), ("parallelism", 64),
                         ("max_records", None), ("max_records", 1), ("dry_run", True)])  # fmt: skip
def test_params_accept_values_inside_the_schema(name, value):
    param: Param = batch_params(64, 2)[name]

    assert param.resolve(value) == value


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("parallelism", 0),
        ("parallelism", 65),
        ("parallelism", "3"),
        ("parallelism", None),
        ("max_records", 0),
        ("max_records", 2.5),
        ("dry_run", "yes"),
    ],
)
def test_params_refuse_values_outside_the_schema(name, value):
    param: Param = batch_params(64, 2)[name]

    with pytest.raises(ParamValidationError):
        param.resolve(value)


@pytest.mark.parametrize(("maxp", "default"), [(0, 1), (8, 0), (8, 9), (8, "2")])
def test_bad_factory_numbers_are_refused_with_the_value(maxp, default):
    with pytest.raises(ConfigError, match="parallelism"):
        batch_param_schemas(maxp, default)


def test_cli_args_carry_only_what_is_set():
    assert batch_cli_args(
        until="2026-01-01T00:05:00+00:00",
        run_id="clickstream/manual__1",
        parallelism=3,
        max_records=None,
        dry_run=True,
    ) == [
        "--until",
        "2026-01-01T00:05:00+00:00",
        "--run-id",
        "clickstream/manual__1",
        "--parallelism",
        "3",
        "--dry-run",
    ]
    assert batch_cli_args(until=None, run_id=None, parallelism=None, max_records=5,
                          dry_run=False) == ["--max-records", "5"]  # fmt: skip
