"""A small HTTP user-profile service for the demo: configurable latency and error rate.

``GET /profiles/<user_id>`` → ``{"user_id", "segment", "country"}`` after ``latency_ms``;
with probability ``error_rate`` it answers 503 instead (the pipeline retries). Profiles are
a pure function of the user id, so any run enriches a user the same way::

    python -m microbatch.examples.profile_service --port 8765 --latency-ms 10 --error-rate 0.05
"""

from __future__ import annotations

import argparse
import asyncio
import random
import zlib

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


if __name__ == "__main__":
    main()
