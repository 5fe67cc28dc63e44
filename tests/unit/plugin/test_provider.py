"""The plugin installed as an Airflow provider (``plugins/pyproject.toml``): Airflow's own
ProvidersManager and plugins manager, in a fresh interpreter configured like the dev
stack (plugins folder = ``plugins/``), see it once, with its connection types."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import json
from airflow import plugins_manager
from airflow.configuration import conf
from airflow.providers_manager import ProvidersManager

pm = ProvidersManager()
info = pm.providers["microbatch-airflow"]
plugins, errors = plugins_manager._get_plugins()
print("RESULT " + json.dumps({
    "version": info.version,
    "name": info.data["name"],
    "hooks": {k: v.hook_class_name for k, v in pm.hooks.items() if k.startswith("microbatch")},
    "hook_names": {k: v.hook_name for k, v in pm.hooks.items() if k.startswith("microbatch")},
    "widgets": sorted(k for k in pm.connection_form_widgets if "microbatch" in k),
    "behaviours": {k: v for k, v in pm.field_behaviours.items() if k.startswith("microbatch")},
    "triggers": sorted(t.trigger_class_name for t in pm.trigger
                       if t.package_name == "microbatch-airflow"),
    "provider_plugins": [p.plugin_class for p in pm.plugins
                         if p.provider_name == "microbatch-airflow"],
    "plugins": [(p.name, str(p.source)) for p in plugins],
    "errors": errors,
    "config": conf.get("microbatch", "pipelines"),
}))
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("airflow-provider")
    env = dict(os.environ) | {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
    }
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=300, check=False, cwd=home)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"probe printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_distribution_declares_the_provider_and_plugin_entry_points():
    dist = importlib.metadata.distribution("microbatch-airflow")
    eps = {(ep.group, ep.value) for ep in dist.entry_points}

    assert (
        "apache_airflow_provider",
        "microbatch_airflow.get_provider_info:get_provider_info",
    ) in eps
    assert ("airflow.plugins", "microbatch_airflow.plugin:MicrobatchPlugin") in eps
    found = importlib.metadata.entry_points(group="apache_airflow_provider")
    assert "microbatch_airflow.get_provider_info:get_provider_info" in {ep.value for ep in found}


def test_providers_manager_lists_the_provider_with_its_connection_types(probe):
    assert probe["version"] == importlib.metadata.version("microbatch-airflow")
    assert probe["name"] == "Microbatch"
    assert probe["hooks"] == {
        "microbatch_kafka": "microbatch_airflow.hooks.MicrobatchKafkaHook",
        "microbatch_s3": "microbatch_airflow.hooks.MicrobatchS3Hook",
        "microbatch_spark": "microbatch_airflow.hooks.MicrobatchSparkHook",
    }
    assert probe["hook_names"]["microbatch_s3"] == "Microbatch S3"
    assert "extra__microbatch_kafka__bootstrap_servers" in probe["widgets"]
    assert "extra__microbatch_s3__endpoint_url" in probe["widgets"]
    assert probe["behaviours"]["microbatch_s3"]["relabeling"]["password"] == "Secret access key"
    assert probe["triggers"] == ["microbatch_airflow.triggers"]
    assert probe["provider_plugins"] == ["microbatch_airflow.plugin.MicrobatchPlugin"]
    assert probe["config"] == ""  # [microbatch] pipelines: the provider's default


def test_the_plugin_is_registered_once_from_the_entry_point_without_errors(probe):
    mine = [(name, source) for name, source in probe["plugins"] if name == "microbatch"]

    assert len(mine) == 1, probe["plugins"]
    assert mine[0][1].startswith("microbatch-airflow=="), mine  # not the plugins folder scan
    assert probe["errors"] == {}


def test_a_hook_reads_its_connection_as_the_operators_do(monkeypatch):
    from microbatch_airflow.hooks import MicrobatchS3Hook, MicrobatchSparkHook

    conn = {"conn_type": "microbatch_s3", "login": "AKIA-TEST", "password": "secret-key",
            "extra": {"endpoint_url": "http://127.0.0.1:8333", "bucket": "lake"}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_MICROBATCH_S3", json.dumps(conn))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_PROD", json.dumps({"conn_type": "microbatch_spark",
                                                              "host": "sc://spark"}))  # fmt: skip

    assert MicrobatchS3Hook().overrides() == {
        "s3_access_key_id": "AKIA-TEST",
        "s3_secret_access_key": "secret-key",
        "s3_endpoint_url": "http://127.0.0.1:8333",
        "s3_bucket": "lake",
    }
    assert MicrobatchSparkHook("spark_prod").overrides() == {"spark_master": "sc://spark"}
