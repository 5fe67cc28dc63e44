"""Fencing: at most one run of a pipeline works on it at a time.

The manifest's exclusive create already guarantees that a checkpoint id commits once.
The lease makes a *second* run fail fast and clearly instead of doing a batch's work for
nothing: ``lease.json`` in the checkpoint store, created with an exclusive create, holding
the owner (the run id: an Airflow retry of the same run may take it over) and an expiry.
An expired lease (its holder died) is taken over; two runs racing for it are decided by
the exclusive create.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from microbatch.checkpoint.layout import Layout
from microbatch.errors import BatchError
from microbatch.storage import AlreadyExistsError, ObjectNotFoundError, ObjectStore

log = logging.getLogger(__name__)
LEASE_KEY = Layout().lease_key


def _read(store: ObjectStore) -> dict | None:
    try:
        return json.loads(store.get(LEASE_KEY))
    except ObjectNotFoundError:
        return None


def acquire(store: ObjectStore, pipeline: str, owner: str, timeout_s: float) -> None:
    now = int(time.time() * 1000)
    body = {"owner": owner, "acquired_ms": now, "expires_ms": now + int(timeout_s * 1000)}
    data = json.dumps(body).encode()
    for _ in range(2):
        try:
            store.create(LEASE_KEY, data)
            return
        except AlreadyExistsError:
            held = _read(store)
            if held is None:
                continue
            if held.get("owner") == owner or held.get("expires_ms", 0) < now:
                log.warning("pipeline %s: taking over lease of %s", pipeline, held.get("owner"))
                store.delete(LEASE_KEY)
                continue
            raise BatchError(
                f"pipeline {pipeline!r} is being run by {held.get('owner')!r} (lease in "
                f"{store.url}/{LEASE_KEY} until epoch ms {held.get('expires_ms')}); only one run "
                "may work on a pipeline. If that run died, wait for the lease to expire or "
                f"run `microbatch unlock` for {pipeline!r}."
            ) from None
    raise BatchError(f"pipeline {pipeline!r}: another run took the lease at the same time")


def release(store: ObjectStore, owner: str) -> None:
    held = _read(store)
    if held is not None and held.get("owner") == owner:
        store.delete(LEASE_KEY)


@contextmanager
def lease(store: ObjectStore, pipeline: str, owner: str, timeout_s: float) -> Iterator[None]:
    """Hold the lease for the block; released on success or ordinary failure.

    An :class:`~microbatch.runtime.faults.InjectedCrash` keeps it held, as a dead
    process would (a rerun with the same ``owner`` takes it over)."""
    from microbatch.runtime.faults import InjectedCrash

    acquire(store, pipeline, owner, timeout_s)
    try:
        yield
    except InjectedCrash:
        raise
    except BaseException:
        release(store, owner)
        raise
    release(store, owner)
