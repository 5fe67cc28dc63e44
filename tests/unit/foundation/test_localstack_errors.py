"""A service that cannot start says which service and what to do, quickly."""

from __future__ import annotations

import socket

import pytest

from microbatch import ServiceError, Settings
from microbatch.localstack import KafkaBroker, SeaweedFS
from microbatch.localstack.process import free_port_block


def test_kafka_on_a_taken_port_names_the_port_and_the_remedy(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        settings = Settings.from_env(env={}, kafka_bootstrap_servers=f"127.0.0.1:{port}")

        with pytest.raises(ServiceError, match=rf"Kafka: port\(s\) \[{port}\]") as err:
            KafkaBroker(settings, tmp_path).start()

    assert "MICROBATCH_KAFKA_BOOTSTRAP_SERVERS" in str(err.value)


def test_seaweedfs_on_a_taken_port_names_the_port(tmp_path):
    base = free_port_block([0, 1, 2, 3, 4, 10000, 10001, 10002, 10003, 10004])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 2))
        busy.listen()
        settings = Settings.from_env(env={}, s3_endpoint_url=f"http://127.0.0.1:{base}")

        with pytest.raises(ServiceError, match=rf"SeaweedFS: port\(s\) \[{base + 2}\]"):
            SeaweedFS(settings, tmp_path).start()


def test_kafka_without_java_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    port = free_port_block([0, 1])
    settings = Settings.from_env(env={}, kafka_bootstrap_servers=f"127.0.0.1:{port}")

    with pytest.raises(ServiceError, match=r"java.*not found.*openjdk"):
        KafkaBroker(settings, tmp_path).start()


def test_kafka_without_maven_says_how_to_install_it(tmp_path, monkeypatch):
    java = __import__("shutil").which("java")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("JAVA_HOME", str(__import__("pathlib").Path(java).resolve().parents[1]))
    port = free_port_block([0, 1])
    settings = Settings.from_env(
        env={}, kafka_bootstrap_servers=f"127.0.0.1:{port}", home=str(tmp_path / "home")
    )

    with pytest.raises(ServiceError, match=r"Maven.*apt-get install -y maven"):
        KafkaBroker(settings, tmp_path / "kafka").start()


def test_non_loopback_kafka_is_refused_by_the_local_stack(tmp_path):
    settings = Settings.from_env(env={}, kafka_bootstrap_servers="kafka.prod:9092")

    with pytest.raises(ServiceError, match="not on loopback"):
        KafkaBroker(settings, tmp_path).start()


def test_a_server_whose_port_was_taken_fails_its_start_at_once(tmp_path):
    """A server whose listener failed to bind but which stays alive (airflow standalone's
    API server) must fail the start when its log says so, not after the whole timeout.
    (Waiting out the timeout raises a plain ServiceError, which ``raises`` would not take.)
    """
    import sys

    from microbatch.localstack.process import PortTakenError, ServiceProcess

    (tmp_path / "server.log").write_text("an earlier start: Address already in use\n")
    process = ServiceProcess("server", tmp_path)
    script = (
        "import time; print('ERROR: [Errno 98] Address already in use', flush=True); "
        "time.sleep(600)"
    )

    with pytest.raises(PortTakenError, match=r"server: its port was taken") as err:
        process.start(
            [sys.executable, "-c", script],
            ready=lambda: False,
            timeout=120,
            hint="",
            port_taken_marks=("Address already in use",),
        )

    assert "[Errno 98]" in str(err.value)
    assert process.pid() is None, "the server that lost its port was left running"


def test_an_earlier_starts_port_error_in_the_log_is_not_taken_for_this_ones(tmp_path):
    import sys

    from microbatch.localstack.process import ServiceProcess

    (tmp_path / "server.log").write_text("an earlier start: Address already in use\n")
    process = ServiceProcess("server", tmp_path)
    ready_after = iter([False, False, True])

    pid = process.start(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        ready=lambda: next(ready_after),
        timeout=60,
        hint="",
        port_taken_marks=("Address already in use",),
    )

    assert pid == process.pid()
    process.stop()


def test_picked_ports_stay_below_the_kernels_ephemeral_range():
    """Outgoing connections take ports of the ephemeral range: a port picked there can be
    gone before the service binds it (seen: Airflow's API server, [Errno 98])."""
    from microbatch.localstack.process import ephemeral_port_floor

    floor = ephemeral_port_floor()
    for _ in range(50):
        assert free_port_block([0]) < floor
        assert free_port_block([0, 1, 2, 3, 4, 10000, 10004]) + 10004 < floor
