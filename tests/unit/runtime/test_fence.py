"""The lease on a real local store: one holder, takeovers by compare-and-swap, renewal,
and a stalled holder (a zombie) that learns it was fenced before it can commit.

Takeovers are judged by time the taker itself watched; :class:`World` gives each host a
clock of its own (skewed as a test says) that moves only when a host sleeps, and runs a
holder's renewals as it moves — no test waits for a lease timeout in real time."""

from __future__ import annotations

import errno
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from microbatch.errors import BatchError, LeaseError, StorageError
from microbatch.runtime import fence
from microbatch.runtime.faults import InjectedCrash
from microbatch.runtime.fence import LEASE_KEY, FencedError, Lease, LeaseClock, LeaseState
from microbatch.storage import LocalFileStore


class World:
    """Real time shared by a test's hosts, advanced only by their sleeps (or
    :meth:`advance`); actions registered with :meth:`every` run as it passes them."""

    def __init__(self) -> None:
        self.t = 1_800_000_000.0
        self._timers: list[tuple[float, float, Callable[[], None]]] = []

    def host(self, skew_s: float = 0.0) -> LeaseClock:
        """The clocks of a host whose wall clock is ``skew_s`` ahead of real time."""
        return LeaseClock(
            wall_ms=lambda: int((self.t + skew_s) * 1000),
            monotonic=lambda: self.t - 1_000_000,  # any origin: only differences count
            sleep=self.advance,
        )

    def every(self, period_s: float, action: Callable[[], None]) -> None:
        self._timers.append((self.t + period_s, period_s, action))

    def advance(self, seconds: float) -> None:
        end = self.t + seconds
        while self._timers and min(due for due, _, _ in self._timers) <= end:
            due, period, action = min(self._timers, key=lambda timer: timer[0])
            self._timers.remove((due, period, action))
            self.t = due
            action()
            self._timers.append((due + period, period, action))
        self.t = end


@pytest.fixture
def store(tmp_path: Path) -> LocalFileStore:
    return LocalFileStore(tmp_path / "checkpoints")


def held_by(store: LocalFileStore) -> LeaseState:
    return LeaseState.from_bytes(store.get(LEASE_KEY))


def test_a_second_run_is_refused_naming_the_holder_and_its_expiry(store) -> None:
    fence.acquire(store, "clicks", "run-a", 60)

    with pytest.raises(BatchError, match=r"being run by 'run-a' .* epoch 1, until 20\d\d-"):
        fence.acquire(store, "clicks", "run-b", 60)
    assert held_by(store).owner == "run-a"


def test_an_expired_lease_is_taken_over_and_its_holder_is_fenced(store) -> None:
    zombie = fence.acquire(store, "clicks", "run-a", 0.05)
    time.sleep(0.1)  # run-a stalled past its lease

    successor = fence.acquire(store, "clicks", "run-b", 60)

    assert (held_by(store).owner, held_by(store).epoch) == ("run-b", 2)
    with pytest.raises(FencedError, match=r"'run-a' lost the lease .* to 'run-b' \(epoch 2\)"):
        zombie.check("the commit")
    zombie.release()  # a zombie's release leaves its successor's lease alone
    assert held_by(store) == successor.state and not held_by(store).released


def test_a_retry_of_the_same_run_takes_over_at_once_and_fences_the_stalled_attempt(
    store,
) -> None:
    first = fence.acquire(store, "clicks", "airflow-run-1", 60)

    retry = fence.acquire(store, "clicks", "airflow-run-1", 60)

    assert held_by(store).epoch == 2
    with pytest.raises(FencedError):
        first.check("publishing")
    retry.check("the commit")  # the retry holds it


def test_racing_takers_of_an_expired_lease_leave_exactly_one_holder(store) -> None:
    fence.acquire(store, "clicks", "dead-run", 0.01)
    time.sleep(0.05)
    barrier = threading.Barrier(6)
    won: list[str] = []

    def take(owner: str) -> None:
        barrier.wait()
        try:
            fence.acquire(store, "clicks", owner, 60)
            won.append(owner)
        except BatchError:
            pass

    threads = [threading.Thread(target=take, args=(f"run-{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(won) == 1 and held_by(store).owner == won[0]


def test_a_renewed_lease_outlives_its_timeout_and_release_frees_it(store) -> None:
    with fence.lease(store, "clicks", "run-a", 0.3) as held:
        time.sleep(1.0)  # three timeouts: the renewer kept it
        with pytest.raises(BatchError, match="being run by 'run-a'"):
            fence.acquire(store, "clicks", "run-b", 60)
        held.check("the commit")

    assert held_by(store).released
    assert fence.acquire(store, "clicks", "run-b", 60).state.epoch == 2  # type: ignore[union-attr]


def test_a_crashed_run_keeps_the_lease_only_until_it_expires(store) -> None:
    with pytest.raises(InjectedCrash), fence.lease(store, "clicks", "run-a", 0.2):
        raise InjectedCrash("pipeline 'clicks': injected crash at after_commit")

    with pytest.raises(BatchError, match="being run by 'run-a'"):
        fence.acquire(store, "clicks", "run-b", 60)  # held, as a dead process would
    time.sleep(0.3)  # nobody renews it: it expires, no unlock needed
    assert fence.acquire(store, "clicks", "run-b", 60).state.owner == "run-b"  # type: ignore[union-attr]


class BrokenAfterAcquire(LocalFileStore):
    """A store that fails every write once ``broken`` is set (an S3 outage mid-batch)."""

    broken = False

    def replace(self, key: str, data: bytes, tag: str) -> str:
        if self.broken:
            raise StorageError(f"S3 put of key {key} failed after 6 attempts")
        return super().replace(key, data, tag)


def test_a_failed_release_never_hides_the_error_that_ended_the_batch(tmp_path: Path) -> None:
    store = BrokenAfterAcquire(tmp_path / "checkpoints")

    with pytest.raises(ValueError, match="the real failure"), fence.lease(store, "clicks", "a", 60):
        store.broken = True
        raise ValueError("the real failure")


def test_a_lease_of_an_earlier_version_without_epoch_is_taken_over(store) -> None:
    old = {"owner": "old-run", "acquired_ms": 0, "expires_ms": 1}
    store.put(LEASE_KEY, json.dumps(old).encode())
    world = World()
    start = world.t

    held = Lease(store, "clicks", "new-run", 60, world.host())
    held.acquire()

    assert held_by(store).owner == "new-run" and held_by(store).epoch == 1
    assert 60 <= world.t - start <= 61  # watched for its own timeout: the old one has none


# Clocks that disagree -----------------------------------------------------------------
def test_a_taker_61_s_ahead_never_takes_the_lease_of_a_holder_that_renews(store) -> None:
    world = World()
    holder = fence.acquire(store, "clicks", "run-a", 60, world.host())
    world.every(20, holder.renew)  # its renewal thread, every third of the timeout

    with pytest.raises(LeaseError, match=r"being run by 'run-a' .* changed while this run"):
        fence.acquire(store, "clicks", "run-b", 60, world.host(skew_s=61))

    holder.check("the commit")  # never taken
    assert (held_by(store).owner, held_by(store).epoch) == ("run-a", 1)


def test_a_taker_an_hour_behind_takes_a_dead_runs_lease_after_watching_one_timeout(
    store,
) -> None:
    world = World()
    fence.acquire(store, "clicks", "dead-run", 60, world.host())  # then never renewed
    start = world.t

    successor = fence.acquire(store, "clicks", "run-b", 60, world.host(skew_s=-3600))

    assert successor.state is not None and held_by(store) == successor.state
    assert 60 <= world.t - start <= 61  # one timeout of its own, not an hour


def test_a_dead_runs_lease_is_taken_only_after_the_taker_watched_it_a_whole_timeout(
    store,
) -> None:
    world = World()
    dead = fence.acquire(store, "clicks", "dead-run", 60, world.host())
    world.advance(600)  # long expired by every clock: still, only watching tells
    start = world.t

    fence.acquire(store, "clicks", "run-b", 60, world.host())

    assert 60 <= world.t - start <= 61
    stalled = r"to 'run-b' \(epoch 2\): it stalled past its lease \(last renewed 6\d\d\.\d s ago"
    with pytest.raises(FencedError, match=stalled):
        dead.check("the commit")


def test_a_released_lease_is_taken_at_once_whatever_the_clocks_say(store) -> None:
    world = World()
    fence.acquire(store, "clicks", "run-a", 60, world.host()).release()
    start = world.t

    fence.acquire(store, "clicks", "run-b", 60, world.host(skew_s=-3600))

    assert world.t == start and held_by(store).owner == "run-b"


# What a fenced run is told ------------------------------------------------------------
def test_a_run_fenced_by_a_retry_of_its_own_run_id_is_told_so_not_that_it_stalled(
    store,
) -> None:
    first = fence.acquire(store, "clicks", "scheduled__10:05", 60)
    fence.acquire(store, "clicks", "scheduled__10:05", 60)  # an Airflow retry, a re-trigger

    with pytest.raises(FencedError) as fenced:
        first.check("the commit")

    message = str(fenced.value)
    assert "another attempt with the same run id, 'scheduled__10:05' (epoch 2)" in message
    assert "stalled" not in message


# A renewal thread that fails ----------------------------------------------------------
class FailsOnceUnexpectedly(LocalFileStore):
    """A store whose conditional replace fails once, once armed, with an error that is no
    :class:`StorageError` (a file-descriptor limit in a store that did not wrap it)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.armed = False
        self.failed = threading.Event()

    def replace(self, key: str, data: bytes, tag: str) -> str:
        if self.armed and not self.failed.is_set():
            self.failed.set()
            raise OSError(errno.EMFILE, "Too many open files")
        return super().replace(key, data, tag)


def test_a_renewal_thread_that_fails_unexpectedly_fails_the_next_check_with_its_cause(
    tmp_path: Path,
) -> None:
    store = FailsOnceUnexpectedly(tmp_path / "checkpoints")
    held = Lease(store, "clicks", "run-a", 0.15)
    held.acquire()
    held.start_renewing()
    store.armed = True
    assert store.failed.wait(timeout=5)
    held.stop_renewing()  # joins the thread: it has dealt with the failure

    with pytest.raises(FencedError, match=r"can no longer renew .* Too many open files"):
        held.check("the commit")  # even though the store works again
    held.release()  # it still held the lease: releasing it frees it for the next run at once
    assert held_by(store).released
