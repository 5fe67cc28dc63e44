"""Fencing: one run works on a pipeline at a time, and a run that lost its turn stops.

The lease is one object, the layout's ``lease.json``: ``{owner, epoch, acquired_ms,
expires_ms, timeout_ms, renewals, released}``. It changes only by compare-and-swap — the
store's ``replace`` at the tag the writer last read (S3 ``If-Match``) — so of racing
writers exactly one wins:

- **acquire**: create it, or take over one that was released or is held by the same owner
  (an Airflow retry of the same run id), bumping ``epoch``. Another owner's lease is taken
  over only after this run has *watched* it stay the same record (same epoch, same
  renewal) for the holder's whole timeout on its own monotonic clock: a holder that lives
  renews within a third of that, so the record changes and the run is refused. Expiry is
  never judged by comparing the holder's ``expires_ms`` with this host's clock, so clocks
  that disagree cannot hand a renewing holder's lease to another run, nor make a dead
  run's lease last for as long as the clocks are apart. A lease that looks live by this
  host's clock (it expires within one timeout from now) is refused at once, without
  watching: that only delays, by at most one timeout, a takeover the watch then allows;
- **renew**: a thread of the holder rewrites the record (``renewals`` + 1, a new
  ``expires_ms`` for people) every third of the timeout; a dead or stalled run stops
  renewing, and the next run takes over after watching it for one timeout — no manual
  unlock. If the thread itself fails (anything but a store error, which it retries), the
  run can no longer renew and its next check says so;
- **check** (before the commit, the publish and GC): renew now, synchronously. It
  succeeds only if nobody took the lease over since this run's last write: a run that
  stalled past its lease (a zombie) learns here that it was fenced, and stops;
- **release**: a swap to ``released`` at the holder's tag, so a zombie's release can never
  end its successor's lease; a released lease is taken at once.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from microbatch.checkpoint.layout import Layout
from microbatch.errors import LeaseError, StorageError, error_text
from microbatch.storage import (
    AlreadyExistsError,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailedError,
)

log = logging.getLogger(__name__)
LEASE_KEY = Layout().lease_key
#: How far two hosts' clocks may disagree before a lease's expiry, read with this host's
#: clock, is treated as telling nothing (the holder wrote it more than one timeout ahead).
CLOCK_TOLERANCE_MS = 1_000
#: Racing takers: how many lost compare-and-swaps before a run gives up.
MAX_RACES = 3


class FencedError(LeaseError):
    """This run no longer holds the pipeline's lease: another run took over, or it can no
    longer renew it."""


def _now_ms() -> int:
    return int(time.time() * 1000)


def poll_s(timeout_ms: int) -> float:
    """How often a run watching another run's lease looks at it again: ten times per
    timeout, at most once a second (a GET each), at least every 10 ms."""
    return min(max(timeout_ms / 10_000, 0.01), 1.0)


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class LeaseClock:
    """The clocks a lease reads, injectable so tests can skew and advance them.

    ``wall_ms`` only stamps what the lease records for people (when it was taken, when it
    expires by the holder's clock); every decision about elapsed time is made on
    ``monotonic`` (seconds, this process only); ``sleep`` waits between looks at another
    run's lease."""

    wall_ms: Callable[[], int] = _now_ms
    monotonic: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


@dataclasses.dataclass(frozen=True)
class LeaseState:
    """The lease object's body. ``timeout_ms`` and ``renewals`` are 0 in leases written
    by earlier versions."""

    owner: str
    epoch: int
    acquired_ms: int
    expires_ms: int
    released: bool = False
    timeout_ms: int = 0  # the holder's lease timeout: how long a taker must watch it
    renewals: int = 0  # bumped by every renewal, so each renewal is a different record

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
            timeout_ms=int(body.get("timeout_ms", 0)),
            renewals=int(body.get("renewals", 0)),
        )

    def has_expired(self, now_ms: int) -> bool:
        """Has the holder stopped renewing, as far as ``now_ms`` on the *holder's* clock
        tells? For showing a lease to people; a taker decides by watching it
        (:meth:`Lease.acquire`)."""
        return self.expires_ms < now_ms


@dataclasses.dataclass(frozen=True)
class _Sighting:
    """One record of another run's lease as this run first saw it, and when (monotonic)."""

    tag: str
    since: float


class Lease:
    """One run's hold on a pipeline (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        pipeline: str,
        owner: str,
        timeout_s: float,
        clock: LeaseClock | None = None,
    ) -> None:
        self.store, self.pipeline, self.owner = store, pipeline, owner
        self.timeout_ms = int(timeout_s * 1000)
        self.clock = clock or LeaseClock()
        self.state: LeaseState | None = None
        self._tag: str | None = None
        self._renewed_at: float | None = None  # monotonic time of the last write that won
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost: str | None = None  # why this run can no longer count on the lease
        self._taken_over = False  # another run holds it now: release must not try

    @property
    def where(self) -> str:
        return f"{self.store.url}/{LEASE_KEY}"

    # Acquire --------------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease: at once when it is free, released or this owner's; after
        watching it unchanged for the holder's timeout when another run holds it and it
        looks expired (or its expiry is beyond what the holder's timeout allows, so this
        host's clock is behind); a :class:`LeaseError` when the holder is alive."""
        sighting: _Sighting | None = None
        races = 0
        while True:
            try:
                held, tag = self._read()
            except ObjectNotFoundError:
                if self._create():
                    return
                races = self._lost_race(races)
                continue
            if not (held.owner == self.owner or held.released):
                if sighting is not None and sighting.tag != tag:
                    raise LeaseError(self._held_message(held, self._watched_s(sighting)))
                if sighting is None and self._looks_live(held):
                    raise LeaseError(self._held_message(held))
                if sighting is None:
                    sighting = _Sighting(tag, self.clock.monotonic())
                    self._log_watching(held)
                if self._watched_s(sighting) * 1000 < self._timeout_of(held):
                    self.clock.sleep(poll_s(self._timeout_of(held)))
                    continue
                log.warning(
                    "pipeline %s: taking over the lease of %s (epoch %s): it stayed the same "
                    "for %.1f s, its whole timeout",
                    self.pipeline, held.owner, held.epoch, self._watched_s(sighting),
                )  # fmt: skip
            if self._take(held, tag):
                return
            races, sighting = self._lost_race(races), None

    def _create(self) -> bool:
        mine = self._fresh(1)
        try:
            self.store.create(LEASE_KEY, mine.to_bytes())
        except AlreadyExistsError:
            return False
        data, tag = self.store.get_tagged(LEASE_KEY)
        if LeaseState.from_bytes(data) != mine:  # taken over between create and read
            return False
        self._won(mine, tag)
        return True

    def _take(self, held: LeaseState, tag: str) -> bool:
        """Replace ``held`` (still at ``tag``) by this run's lease; False if it changed."""
        mine = self._fresh(held.epoch + 1)
        try:
            new_tag = self.store.replace(LEASE_KEY, mine.to_bytes(), tag)
        except PreconditionFailedError:
            return False  # another run changed it meanwhile: look again
        self._won(mine, new_tag)
        return True

    def _fresh(self, epoch: int) -> LeaseState:
        now = self.clock.wall_ms()
        return LeaseState(self.owner, epoch, now, now + self.timeout_ms, timeout_ms=self.timeout_ms)

    def _won(self, state: LeaseState, tag: str) -> None:
        self.state, self._tag = state, tag
        self._renewed_at = self.clock.monotonic()

    def _lost_race(self, races: int) -> int:
        if races + 1 >= MAX_RACES:
            raise LeaseError(
                f"pipeline {self.pipeline!r}: another run took the lease in {self.where} at "
                "the same time; only one may work on a pipeline"
            )
        return races + 1

    def _timeout_of(self, held: LeaseState) -> int:
        """The holder's timeout (it renews within a third of it); this run's own for a
        lease of an earlier version, which did not record it."""
        return held.timeout_ms or self.timeout_ms

    def _looks_live(self, held: LeaseState) -> bool:
        """Does ``held`` expire within one of its timeouts from now on this host's clock?
        Only ever used to refuse at once, never to take over."""
        remaining = held.expires_ms - self.clock.wall_ms()
        return 0 <= remaining <= self._timeout_of(held) + CLOCK_TOLERANCE_MS

    def _watched_s(self, sighting: _Sighting) -> float:
        return self.clock.monotonic() - sighting.since

    def _log_watching(self, held: LeaseState) -> None:
        behind = held.expires_ms - self.clock.wall_ms() > 0
        log.warning(
            "pipeline %s: the lease of %s (epoch %s) %s; watching it for %.1f s (its timeout) "
            "before taking it over, unless its holder renews it meanwhile",
            self.pipeline, held.owner, held.epoch,
            "expires further ahead than its timeout allows (this host's clock is behind)"
            if behind else f"expired at {_iso(held.expires_ms)} by this host's clock",
            self._timeout_of(held) / 1000,
        )  # fmt: skip

    def _held_message(self, held: LeaseState, watched_s: float | None = None) -> str:
        if watched_s is None:
            seen = f"until {_iso(held.expires_ms)}"
        else:
            seen = f"it changed while this run watched it for {watched_s:.1f} s: its holder lives"
        timeout_s = self._timeout_of(held) / 1000
        return (
            f"pipeline {self.pipeline!r} is being run by {held.owner!r} (lease in "
            f"{self.where}, epoch {held.epoch}, {seen}); only one run may work on a pipeline. "
            "Try again when that run has finished. If it died, the next run takes the lease "
            f"over after watching it unchanged for {timeout_s:g} s (lease_timeout_s); "
            f"`microbatch unlock` for {self.pipeline!r} ends it now."
        )

    def _read(self) -> tuple[LeaseState, str]:
        data, tag = self.store.get_tagged(LEASE_KEY)
        return LeaseState.from_bytes(data), tag

    # Renew and check ------------------------------------------------------------------
    def renew(self) -> None:
        """Extend the lease; :class:`FencedError` if another run took it over."""
        with self._lock:
            if self.state is None or self._tag is None:
                raise FencedError(f"pipeline {self.pipeline!r}: {self.owner!r} holds no lease")
            state = dataclasses.replace(
                self.state,
                expires_ms=self.clock.wall_ms() + self.timeout_ms,
                renewals=self.state.renewals + 1,
            )
            try:
                self._tag = self.store.replace(LEASE_KEY, state.to_bytes(), self._tag)
            except PreconditionFailedError:
                self._taken_over = True
                self.lost = self._fenced_message(self._holder_now())
                raise FencedError(self.lost) from None
            self.state = state
            self._renewed_at = self.clock.monotonic()

    def check(self, before: str) -> None:
        """Prove, by renewing now, that this run still holds the lease before ``before``
        (the commit, the publish, GC); :class:`FencedError` if not, or if this run can no
        longer renew it."""
        if self.lost is not None:
            raise FencedError(f"{self.lost} (found before {before})")
        try:
            self.renew()
        except FencedError as e:
            raise FencedError(f"{e} (found before {before})") from None

    def _holder_now(self) -> LeaseState | None:
        try:
            held, _ = self._read()
        except (ObjectNotFoundError, StorageError):
            return None
        return held

    def _fenced_message(self, holder: LeaseState | None) -> str:
        """Why this run lost the lease, as far as it can tell: the same run id taking it
        again (a retry, a second trigger), or this run's own renewals stopping."""
        epoch = None if self.state is None else self.state.epoch
        lost = f"pipeline {self.pipeline!r}: run {self.owner!r} lost the lease (its epoch {epoch})"
        tail = "; nothing it staged is used, and the newer attempt (or the next run) carries on"
        if holder is None:
            return f"{lost}: the lease in {self.where} was removed (`microbatch unlock`?){tail}"
        winner = f"{holder.owner!r} (epoch {holder.epoch})"
        if holder.owner == self.owner:
            return (
                f"{lost} to another attempt with the same run id, {winner}: an Airflow retry "
                f"or a second trigger of the same run took it over, so this attempt stops{tail}"
            )
        since = None if self._renewed_at is None else self.clock.monotonic() - self._renewed_at
        if since is not None and since * 1000 > self.timeout_ms:
            return (
                f"{lost} to {winner}: it stalled past its lease (last renewed {since:.1f} s "
                f"ago, lease_timeout_s {self.timeout_ms / 1000:g}) and another run took over, "
                f"so this attempt stops{tail}"
            )
        return (
            f"{lost} to {winner}, which took it over {since or 0:.1f} s after this run last "
            f"renewed it, so this attempt stops{tail}"
        )

    def _renewal_failed(self, error: Exception) -> None:
        """The renewal thread hit something it cannot retry: from here on this run cannot
        keep its lease, so its next check fails rather than finding out too late."""
        with self._lock:
            if self.lost is None:
                self.lost = (
                    f"pipeline {self.pipeline!r}: run {self.owner!r} can no longer renew its "
                    f"lease in {self.where}: the renewal thread failed ({error_text(error)}). "
                    "Another run may take the lease over while this one works, so this "
                    "attempt stops; nothing it staged is used, and a rerun carries on"
                )
        log.error("%s", self.lost, exc_info=error)

    def start_renewing(self) -> None:
        interval = max(self.timeout_ms / 3000, 0.05)

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.renew()
                except FencedError:
                    log.error("%s", self.lost)
                    return
                except StorageError as e:  # keep trying until it expires: check() decides
                    log.warning("pipeline %s: renewing the lease failed: %s", self.pipeline, e)
                except Exception as e:  # anything else would end this thread silently
                    self._renewal_failed(e)
                    return

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
            if self.state is None or self._tag is None or self._taken_over:
                return
            released = dataclasses.replace(
                self.state, released=True, expires_ms=self.clock.wall_ms()
            )
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


def acquire(
    store: ObjectStore,
    pipeline: str,
    owner: str,
    timeout_s: float,
    clock: LeaseClock | None = None,
) -> Lease:
    """Take the lease (no renewal thread): for tools and tests."""
    held = Lease(store, pipeline, owner, timeout_s, clock)
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
    lease, as a dead process would (a rerun with the same ``owner`` takes it over at once,
    any other after watching it unchanged for its timeout)."""
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
            "pipeline %s: could not release the lease (%s); the next run takes it over after "
            "watching it for its timeout",
            held.pipeline,
            e,
        )
