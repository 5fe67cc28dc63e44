"""A small HTTP user-profile service for the demo: configurable latency and error rate.

``GET /profiles/<user_id>`` → ``{"user_id", "segment", "country"}`` after ``latency_ms``;
with probability ``error_rate`` it answers 503 instead (the pipeline retries). Profiles are
a pure function of the user id, so any run enriches a user the same way::

    python -m microbatch.examples.profile_service --port 8765 --latency-ms 10 --error-rate 0.05

:class:`ProfileService` runs it that way in a subprocess, for the demo, ``make airflow``
and the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

from microbatch.errors import ServiceError
from microbatch.localstack.process import free_port_block

SEGMENTS = ("bronze", "silver", "gold", "platinum")
COUNTRIES = ("DE", "FR", "US", "JP", "BR", "IN")


def profile_of(user_id: str) -> dict[str, str]:
    """The profile of ``user_id`` (stable across processes: CRC-32, not ``hash()``)."""
    h = zlib.crc32(user_id.encode())
    return {
        "user_id": user_id,
        "segment": SEGMENTS[h % len(SEGMENTS)],
        "country": COUNTRIES[(h >> 8) % len(COUNTRIES)],
    }


def make_app(latency_ms: float, error_rate: float, seed: int | None = None):
    from aiohttp import web

    rng = random.Random(seed)
    counts = {"requests": 0, "errors": 0}

    async def get_profile(request: web.Request) -> web.Response:
        counts["requests"] += 1
        if latency_ms:
            await asyncio.sleep(latency_ms / 1000)
        if rng.random() < error_rate:
            counts["errors"] += 1
            return web.json_response({"error": "unavailable, retry"}, status=503)
        return web.json_response(profile_of(request.match_info["user_id"]))

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(counts)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/profiles/{user_id}", get_profile)
    app.router.add_get("/stats", stats)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--latency-ms", type=float, default=10.0)
    p.add_argument("--error-rate", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    app = make_app(args.latency_ms, args.error_rate, args.seed)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


class ProfileService:
    """The profile service in a subprocess on a free loopback port; ready once constructed."""

    def __init__(self, latency_ms: float, error_rate: float, log: Path) -> None:
        self.port = free_port_block([0])
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "microbatch.examples.profile_service",
            "--port",
            str(self.port),
            "--latency-ms",
            str(latency_ms),
            "--error-rate",
            str(error_rate),
        ]
        self.proc = subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        self.stop()
        raise ServiceError(f"profile service did not start on {self.url}; see {log}")

    def stats(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.url}/stats", timeout=5) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


if __name__ == "__main__":
    main()
