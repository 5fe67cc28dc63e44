"""Async enrichment throughput against Little's law, next to the usual alternatives.

With ``capacity`` requests in flight and a service latency ``L``, no client can beat
``capacity / L`` elements per second (Little's law). For L = 10 ms, this script measures,
in the same run:

- the ``AsyncOperator`` (through ``run_batch``, ordered and unordered) against an
  in-process ``asyncio.sleep(0.01)`` service and against a real aiohttp service on
  loopback (started here in its own process, stopped at the end);
- a ``ThreadPoolExecutor`` of the same size running the blocking equivalent
  (``time.sleep`` / ``http.client``) and the operator's own ``blocking=True`` mode;
- a plain sequential loop (its bound is ``1 / L``).

Target: ≥ 0.9 of the bound at capacity 100 with the in-process service.

    .venv/bin/python bench/bench_enrich.py [--quick] [--seconds 2.0]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import http.client
import multiprocessing
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from microbatch.enrich import AsyncOperator, Element, NoRetry, run_batch

LATENCY_S = 0.010


# The HTTP service, in its own process so it does not share the client's GIL -------------


def _serve(conn, latency_s: float) -> None:
    import uvloop
    from aiohttp import web

    async def user(request: web.Request) -> web.Response:
        await asyncio.sleep(latency_s)
        return web.Response(text=request.match_info["id"])

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/user/{id}", user)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        conn.send(runner.addresses[0][1])
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # until "stop"
        await runner.cleanup()

    uvloop.run(main())


class HttpService:
    """``GET /user/{id}`` answering after ``latency_s``, on a free loopback port."""

    def __init__(self, latency_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, latency_s), daemon=True)

    def __enter__(self) -> HttpService:
        self._process.start()
        if not self._conn.poll(30):
            raise RuntimeError("the benchmark HTTP service did not start within 30 s")
        self.port = self._conn.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()


# Enrichment functions --------------------------------------------------------------------


async def sleep_invoke(record: int) -> int:
    await asyncio.sleep(LATENCY_S)
    return record


def sleep_blocking(record: int) -> int:
    time.sleep(LATENCY_S)
    return record


class AiohttpInvoke:
    """One aiohttp session per operator, created inside the batch's loop."""

    def __init__(self, port: int, capacity: int) -> None:
        self.port, self.capacity = port, capacity
        self._session = None

    async def __call__(self, record: int) -> str:
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.capacity)
            self._session = aiohttp.ClientSession(connector=connector)
        async with self._session.get(f"http://127.0.0.1:{self.port}/user/{record}") as resp:
            return await resp.text()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


class HttpBlocking:
    """A blocking ``http.client`` GET with one keep-alive connection per thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()

    def __call__(self, record: int) -> str:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port)
        conn.request("GET", f"/user/{record}")
        return conn.getresponse().read().decode()


# Runners: each returns the elapsed seconds for n elements --------------------------------


def operator_run(invoke_factory: Callable[[], object], capacity: int, mode: str, blocking=False):
    def factory() -> AsyncOperator:
        return AsyncOperator(
            invoke_factory(),
            mode=mode,  # type: ignore[arg-type]
            capacity=capacity,
            timeout_s=30.0,
            retry=NoRetry(),
            on_failure="fail",
            blocking=blocking,
        )

    def run(n: int) -> float:
        started = time.perf_counter()
        outcome = run_batch(factory, (Element(i) for i in range(n)))
        elapsed = time.perf_counter() - started
        assert len(outcome.outputs) == n, (len(outcome.outputs), n)
        return elapsed

    return run


def pool_run(fn: Callable[[int], object], capacity: int):
    def run(n: int) -> float:
        with ThreadPoolExecutor(max_workers=capacity) as pool:
            started = time.perf_counter()
            done = sum(1 for _ in pool.map(fn, range(n)))
            elapsed = time.perf_counter() - started
        assert done == n
        return elapsed

    return run


def sequential_run(fn: Callable[[int], object]):
    def run(n: int) -> float:
        started = time.perf_counter()
        for i in range(n):
            fn(i)
        return time.perf_counter() - started

    return run


@dataclass
class Row:
    service: str
    capacity: int
    method: str
    elements: int
    elapsed: float
    bound: float
    target: str = ""

    @property
    def rate(self) -> float:
        return self.elements / self.elapsed


def measure(run: Callable[[int], float], bound: float, seconds: float) -> tuple[int, float]:
    """Size n from a short pilot so each measurement takes about ``seconds``."""
    pilot = max(20, int(bound * 0.2))
    rate = pilot / run(pilot)
    n = max(50, int(rate * seconds))
    return n, run(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="target time per row")
    parser.add_argument("--quick", action="store_true", help="0.5 s per row")
    args = parser.parse_args()
    seconds = 0.5 if args.quick else args.seconds
    rows: list[Row] = []

    def add(service: str, capacity: int, method: str, run, bound: float, target: str = ""):
        n, elapsed = measure(run, bound, seconds)
        rows.append(Row(service, capacity, method, n, elapsed, bound, target))
        r = rows[-1]
        print(f"  {service:<10} cap {capacity:>5}  {method:<28} {r.rate:>9,.0f}/s", flush=True)

    started = time.perf_counter()
    print(f"latency {LATENCY_S * 1000:.0f} ms; about {seconds:.1f} s per measurement")
    add("in-process", 1, "sequential loop", sequential_run(sleep_blocking), 1 / LATENCY_S)
    for capacity in (100, 1000):
        bound = capacity / LATENCY_S
        target = "target ≥ 0.9" if capacity == 100 else ""
        for mode in ("ordered", "unordered"):
            run = operator_run(lambda: sleep_invoke, capacity, mode)
            add("in-process", capacity, f"AsyncOperator {mode}", run, bound, target)
        add("in-process", capacity, "ThreadPoolExecutor", pool_run(sleep_blocking, capacity), bound)
        run = operator_run(lambda: sleep_blocking, capacity, "ordered", blocking=True)
        add("in-process", capacity, "AsyncOperator blocking=True", run, bound)

    print("starting the aiohttp service ...", flush=True)
    with HttpService(LATENCY_S) as service:
        add("http", 1, "sequential loop", sequential_run(HttpBlocking(service.port)), 1 / LATENCY_S)
        for capacity in (100, 1000):
            bound = capacity / LATENCY_S
            for mode in ("ordered", "unordered"):
                invoke = functools.partial(AiohttpInvoke, service.port, capacity)
                add(
                    "http",
                    capacity,
                    f"AsyncOperator {mode}",
                    operator_run(invoke, capacity, mode),
                    bound,
                )
            pool = pool_run(HttpBlocking(service.port), capacity)
            add("http", capacity, "ThreadPoolExecutor", pool, bound)

    print(
        f"\n{'service':<10}  {'cap':>5}  {'method':<28}  {'elements':>8}  {'elem/s':>9}  "
        f"{'bound/s':>9}  {'ratio':>5}  notes"
    )
    print("-" * 100)
    for r in rows:
        print(
            f"{r.service:<10}  {r.capacity:>5}  {r.method:<28}  {r.elements:>8,}  "
            f"{r.rate:>9,.0f}  {r.bound:>9,.0f}  {r.rate / r.bound:>5.2f}  {r.target}"
        )
    print(f"\ntotal {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
