"""Fencing: one run works on a pipeline at a time, and a run that lost its turn stops.

The lease is one object, the layout's ``lease.json``: ``{owner, epoch, acquired_ms,
expires_ms, released}``. It changes only by compare-and-swap — the store's ``replace`` at
the tag the writer last read (S3 ``If-Match``) — so of racing writers exactly one wins:

- **acquire**: create it, or take over one that expired, was released, or is held by the
  same owner (an Airflow retry of the same run id), bumping ``epoch``; a live lease of
  another owner refuses the run, naming the holder and when its lease expires;
- **renew**: a thread of the holder extends ``expires_ms`` every third of the timeout; a
  dead or stalled run stops renewing, so its lease expires within ``lease_timeout_s``
  (default 60 s) and the next run proceeds on its own — no manual unlock;
- **check** (before the commit, the publish and GC): renew now, synchronously. It
  succeeds only if nobody took the lease over since this run's last write: a run that
  stalled past its expiry (a zombie) learns here that it was fenced, and stops;
- **release**: a swap to ``released`` at the holder's tag, so a zombie's release can never
  end its successor's lease.

What a zombie can still do is bounded by the rest of the protocol: every object it stages
has an attempt-unique name (it overwrites nothing a winner wrote), a checkpoint id commits
once (exclusive create, and only the id after the newest), and publishing acts only on
what a committed manifest names.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from microbatch.checkpoint.layout import Layout
from microbatch.errors import LeaseError, StorageError
from microbatch.storage import (
    AlreadyExistsError,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailedError,
)

log = logging.getLogger(__name__)
LEASE_KEY = Layout().lease_key


class FencedError(LeaseError):
    """This run no longer holds the pipeline's lease: another run took over."""


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """The lease object's body."""

    owner: str
    epoch: int
    acquired_ms: int
    expires_ms: int
    released: bool = False

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LeaseState:
        body = json.loads(data)
        return cls(
            owner=str(body.get("owner")),
            epoch=int(body.get("epoch", 0)),  # leases of earlier versions had no epoch
            acquired_ms=int(body.get("acquired_ms", 0)),
            expires_ms=int(body.get("expires_ms", 0)),
            released=bool(body.get("released", False)),
        )

    def has_expired(self, now_ms: int) -> bool:
        """Has the holder stopped renewing for longer than its timeout at ``now_ms``? Then
        the next run takes the lease over (the rule :meth:`Lease.acquire` applies)."""
        return self.expires_ms < now_ms


def _now_ms() -> int:
    return int(time.time() * 1000)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


class Lease:
    """One run's hold on a pipeline (see the module docstring)."""

    def __init__(self, store: ObjectStore, pipeline: str, owner: str, timeout_s: float) -> None:
        self.store, self.pipeline, self.owner = store, pipeline, owner
        self.timeout_ms = int(timeout_s * 1000)
        self.state: LeaseState | None = None
        self._tag: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: str | None = None  # why the renewer found the lease gone

    @property
    def where(self) -> str:
        return f"{self.store.url}/{LEASE_KEY}"

    # Acquire --------------------------------------------------------------------------
    def acquire(self) -> None:
        for _ in range(3):
            now = _now_ms()
            try:
                held, tag = self._read()
            except ObjectNotFoundError:
                if self._create(LeaseState(self.owner, 1, now, now + self.timeout_ms)):
                    return
                continue
            if not (held.owner == self.owner or held.released or held.expires_ms < now):
                raise LeaseError(
                    f"pipeline {self.pipeline!r} is being run by {held.owner!r} (lease in "
                    f"{self.where}, epoch {held.epoch}, until {_iso(held.expires_ms)}); only "
                    "one run may work on a pipeline. If that run died, its lease expires "
                    "then (the pipeline's lease_timeout_s after its last renewal) and the "
                    f"next run proceeds; `microbatch unlock` for {self.pipeline!r} ends it now."
                )
            if held.owner != self.owner and not held.released:
                log.warning(
                    "pipeline %s: taking over the lease of %s (epoch %s, expired %s)",
                    self.pipeline, held.owner, held.epoch, _iso(held.expires_ms),
                )  # fmt: skip
            mine = LeaseState(self.owner, held.epoch + 1, now, now + self.timeout_ms)
            try:
                self._tag = self.store.replace(LEASE_KEY, mine.to_bytes(), tag)
            except PreconditionFailedError:
                continue  # another run changed it meanwhile: look again
            self.state = mine
            return
        raise LeaseError(
            f"pipeline {self.pipeline!r}: another run took the lease in {self.where} at the "
            "same time; only one may work on a pipeline"
        )

    def _create(self, state: LeaseState) -> bool:
        try:
            self.store.create(LEASE_KEY, state.to_bytes())
        except AlreadyExistsError:
            return False
        data, tag = self.store.get_tagged(LEASE_KEY)
        if LeaseState.from_bytes(data) != state:  # taken over between create and read
            return False
        self.state, self._tag = state, tag
        return True

    def _read(self) -> tuple[LeaseState, str]:
        data, tag = self.store.get_tagged(LEASE_KEY)
        return LeaseState.from_bytes(data), tag

    # Renew and check ------------------------------------------------------------------
    def renew(self) -> None:
        """Extend the lease; :class:`FencedError` if another run took it over."""
        with self._lock:
            if self.state is None or self._tag is None:
                raise FencedError(f"pipeline {self.pipeline!r}: {self.owner!r} holds no lease")
            now = _now_ms()
            state = dataclasses.replace(self.state, expires_ms=now + self.timeout_ms)
            try:
                self._tag = self.store.replace(LEASE_KEY, state.to_bytes(), self._tag)
            except PreconditionFailedError:
                self.lost = self._holder_now()
                raise FencedError(self._fenced_message()) from None
            self.state = state

    def check(self, before: str) -> None:
        """Prove, by renewing now, that this run still holds the lease before ``before``
        (the commit, the publish, GC); :class:`FencedError` if not."""
        if self.lost is not None:
            raise FencedError(f"{self._fenced_message()} (found before {before})")
        try:
            self.renew()
        except FencedError as e:
            raise FencedError(f"{e} (found before {before})") from None

    def _holder_now(self) -> str:
        try:
            held, _ = self._read()
        except (ObjectNotFoundError, StorageError):
            return "nobody (the lease was removed)"
        return f"{held.owner!r} (epoch {held.epoch})"

    def _fenced_message(self) -> str:
        epoch = None if self.state is None else self.state.epoch
        return (
            f"pipeline {self.pipeline!r}: run {self.owner!r} lost the lease (its epoch {epoch}) "
            f"to {self.lost}: it stalled past its lease and another run took over, so this "
            "attempt stops; nothing it staged is used, and the newer run (or the next one) "
            "carries on"
        )

    def start_renewing(self) -> None:
        interval = max(self.timeout_ms / 3000, 0.05)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except FencedError:
                    log.error("%s", self._fenced_message())
                    return
                except StorageError as e:  # keep trying until it expires: check() decides
                    log.warning("pipeline %s: renewing the lease failed: %s", self.pipeline, e)

        self._renewer = threading.Thread(target=loop, name=f"lease-{self.pipeline}", daemon=True)
        self._renewer.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None

    # Release --------------------------------------------------------------------------
    def release(self) -> None:
        """Mark the lease released, only if this run still holds it."""
        self.stop_renewing()
        with self._lock:
            if self.state is None or self._tag is None or self.lost is not None:
                return
            released = dataclasses.replace(self.state, released=True, expires_ms=_now_ms())
            try:
                self.store.replace(LEASE_KEY, released.to_bytes(), self._tag)
            except PreconditionFailedError:
                log.warning("pipeline %s: the lease was taken over before release", self.pipeline)
            self.state = None


def read_lease(store: ObjectStore) -> LeaseState | None:
    """The lease as stored, None if no run ever took it (or `microbatch unlock` removed
    it): for showing who holds a pipeline. Read-only; taking it is :meth:`Lease.acquire`."""
    try:
        return LeaseState.from_bytes(store.get(LEASE_KEY))
    except ObjectNotFoundError:
        return None


def acquire(store: ObjectStore, pipeline: str, owner: str, timeout_s: float) -> Lease:
    """Take the lease (no renewal thread): for tools and tests."""
    held = Lease(store, pipeline, owner, timeout_s)
    held.acquire()
    return held


def release(store: ObjectStore, owner: str) -> None:
    """Release the lease if ``owner`` holds it (conditional, like :meth:`Lease.release`)."""
    try:
        data, tag = store.get_tagged(LEASE_KEY)
    except ObjectNotFoundError:
        return
    held = LeaseState.from_bytes(data)
    if held.owner == owner and not held.released:
        released = dataclasses.replace(held, released=True, expires_ms=_now_ms())
        with suppress(PreconditionFailedError):
            store.replace(LEASE_KEY, released.to_bytes(), tag)


@contextmanager
def lease(store: ObjectStore, pipeline: str, owner: str, timeout_s: float) -> Iterator[Lease]:
    """Hold the lease for the block, renewed in the background; released on success or an
    ordinary failure. A failure to release (the store is down) is logged, never raised
    over the block's own error.

    An :class:`~microbatch.runtime.faults.InjectedCrash` stops the renewal but keeps the
    lease, as a dead process would (a rerun with the same ``owner`` takes it over, any
    other once it expires)."""
    from microbatch.runtime.faults import InjectedCrash

    held = Lease(store, pipeline, owner, timeout_s)
    held.acquire()
    held.start_renewing()
    try:
        yield held
    except InjectedCrash:
        held.stop_renewing()
        raise
    except BaseException:
        _release_quietly(held)
        raise
    _release_quietly(held)


def _release_quietly(held: Lease) -> None:
    try:
        held.release()
    except StorageError as e:
        log.warning(
            "pipeline %s: could not release the lease (%s); it expires on its own", held.pipeline, e
        )
