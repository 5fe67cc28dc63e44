"""A real HTTP enrichment service (aiohttp) on a free loopback port, and its client.

The service runs in a background thread with its own event loop, so the operator under
test (in the test's loop, or in Spark workers) talks to it over real sockets. Its knobs
are plain attributes the test sets between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from microbatch.enrich import AsyncOperator, FixedDelay, retry_on_exception


class EnrichService:
    """``GET /user/{id}`` → ``{"id", "name"}`` with latency, 503s and hanging ids.

    - ``latency_s``: every request waits this long;
    - ``fail_first``: the first N requests of each id answer 503;
    - ``error_rate``: then a seeded random fraction of requests answer 503;
    - ``error_ids``: these ids always answer 503; ``slow_ids`` wait ``slow_s`` (or until
      :meth:`release`) before answering.
    """

    def __init__(self) -> None:
        self.latency_s = 0.0
        self.fail_first = 0
        self.error_rate = 0.0
        self.error_ids: set[int] = set()
        self.slow_ids: set[int] = set()
        self.slow_s = 30.0
        self.calls: Counter[int] = Counter()
        self._rng = random.Random(7)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._release: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name="enrich-service")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the enrichment test service did not start within 10 s")

    def release(self) -> None:
        """Let every hanging request answer now."""
        assert self._loop is not None and self._release is not None
        self._loop.call_soon_threadsafe(self._release.set)

    def stop(self) -> None:
        if self._thread is None:
            return
        assert self._loop is not None and self._stop is not None
        self.release()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._thread = None

    def _serve(self, ready: threading.Event) -> None:
        asyncio.run(self._main(ready))

    async def _main(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._release, self._stop = asyncio.Event(), asyncio.Event()
        app = web.Application()
        app.router.add_get("/user/{id}", self._user)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    async def _user(self, request: web.Request) -> web.Response:
        user = int(request.match_info["id"])
        self.calls[user] += 1
        if user in self.slow_ids:
            assert self._release is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._release.wait(), self.slow_s)
        elif self.latency_s:
            await asyncio.sleep(self.latency_s)
        failing = self.calls[user] <= self.fail_first or user in self.error_ids
        if failing or (self.error_rate and self._rng.random() < self.error_rate):
            return web.Response(status=503, text="try again")
        return web.json_response({"id": user, "name": f"user-{user}"})


class ServiceUnavailable(Exception):
    """The service answered 5xx."""


class UserLookup:
    """The async enrichment function: one HTTP GET per record, one session per loop."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self._session.get(f"{self.base_url}/user/{record['id']}") as response:
            if response.status >= 500:
                raise ServiceUnavailable(f"HTTP {response.status} for id {record['id']}")
            response.raise_for_status()
            return {**record, **(await response.json())}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def is_5xx(exc: BaseException) -> bool:
    return isinstance(exc, ServiceUnavailable)


def http_operator(
    base_url: str,
    *,
    mode: str = "unordered",
    capacity: int = 20,
    timeout_s: float | None = 5.0,
    max_attempts: int = 3,
) -> AsyncOperator:
    """Operator factory; use with functools.partial (picklable for Spark)."""
    return AsyncOperator(
        UserLookup(base_url),
        mode=mode,  # type: ignore[arg-type]
        capacity=capacity,
        timeout_s=timeout_s,
        retry=FixedDelay(0.01, max_attempts, predicates=(retry_on_exception(is_5xx),)),
        on_failure="dead_letter",
    )


def operator_factory(base_url: str, **options: Any):
    return functools.partial(http_operator, base_url, **options)


@pytest.fixture
def service() -> Iterator[EnrichService]:
    svc = EnrichService()
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()
