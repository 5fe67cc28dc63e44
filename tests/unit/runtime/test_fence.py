"""The lease on a real local store: one holder, takeovers by compare-and-swap, renewal,
and a stalled holder (a zombie) that learns it was fenced before it can commit."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from microbatch.errors import BatchError, StorageError
from microbatch.runtime import fence
from microbatch.runtime.faults import InjectedCrash
from microbatch.runtime.fence import LEASE_KEY, FencedError, Lease, LeaseState
from microbatch.storage import LocalFileStore


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

    held = Lease(store, "clicks", "new-run", 60)
    held.acquire()

    assert held_by(store).owner == "new-run" and held_by(store).epoch == 1
