"""One contract, two backends: a local folder and a real S3 API (SeaweedFS)."""

from __future__ import annotations

import threading
import uuid

import pytest

from microbatch.errors import StorageError
from microbatch.storage import (
    AlreadyExistsError,
    LocalFileStore,
    ObjectNotFoundError,
    ObjectStore,
    PreconditionFailedError,
    S3Store,
    open_store,
)


@pytest.fixture(
    params=["local", pytest.param("s3", marks=pytest.mark.integration)],
)
def store(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        return LocalFileStore(tmp_path / "store")
    settings = request.getfixturevalue("s3_settings")
    return S3Store(settings.s3_bucket, f"contract/{uuid.uuid4().hex}", settings)


def test_put_then_get_returns_the_bytes(store):
    store.put("a/b/c.bin", b"hello")
    assert store.get("a/b/c.bin") == b"hello"
    assert isinstance(store, ObjectStore)


def test_put_existing_key_replaces_it(store):
    store.put("k", b"one")
    store.put("k", b"two")
    assert store.get("k") == b"two"


def test_get_missing_key_raises_not_found_naming_key(store):
    with pytest.raises(ObjectNotFoundError, match="missing/key"):
        store.get("missing/key")


def test_get_range_missing_key_raises_not_found(store):
    with pytest.raises(ObjectNotFoundError):
        store.get_range("missing", 0, 10)


def test_create_new_key_writes_it(store):
    store.create("m/1.json", b"{}")
    assert store.get("m/1.json") == b"{}"


def test_create_existing_key_raises_already_exists_and_keeps_first(store):
    store.create("m/1.json", b"first")
    with pytest.raises(AlreadyExistsError, match=r"m/1\.json"):
        store.create("m/1.json", b"second")
    assert store.get("m/1.json") == b"first"


def test_create_over_plain_put_raises_already_exists(store):
    store.put("x", b"put")
    with pytest.raises(AlreadyExistsError):
        store.create("x", b"create")


def test_racing_creates_exactly_one_wins(store):
    n = 8
    barrier = threading.Barrier(n)
    wins: list[int] = []
    losses: list[int] = []

    def racer(i: int) -> None:
        barrier.wait()
        try:
            store.create("race/manifest", f"writer-{i}".encode())
            wins.append(i)
        except AlreadyExistsError:
            losses.append(i)

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(wins) == 1 and len(losses) == n - 1
    assert store.get("race/manifest") == f"writer-{wins[0]}".encode()


def test_replace_at_the_current_tag_writes_and_returns_a_new_tag(store):
    store.put("lease", b"v1")
    data, tag = store.get_tagged("lease")

    new_tag = store.replace("lease", b"v2", tag)

    assert data == b"v1" and new_tag != tag
    assert store.get_tagged("lease") == (b"v2", new_tag)


def test_replace_or_delete_at_a_stale_tag_fails_and_changes_nothing(store):
    store.put("lease", b"v1")
    _, stale = store.get_tagged("lease")
    store.put("lease", b"v2")  # someone else wrote in between

    with pytest.raises(PreconditionFailedError):
        store.replace("lease", b"v3", stale)
    with pytest.raises(PreconditionFailedError):
        store.delete_if("lease", stale)
    assert store.get("lease") == b"v2"


def test_replace_of_a_missing_key_fails_and_delete_if_of_one_is_fine(store):
    store.put("lease", b"v1")
    _, tag = store.get_tagged("lease")
    store.delete_if("lease", tag)

    assert not store.exists("lease")
    with pytest.raises(PreconditionFailedError):
        store.replace("lease", b"v2", tag)
    store.delete_if("lease", tag)  # gone already: nothing to do


def test_racing_replaces_at_one_tag_exactly_one_wins(store):
    n = 8
    store.put("race/lease", b"start")
    _, tag = store.get_tagged("race/lease")
    barrier = threading.Barrier(n)
    wins: list[int] = []

    def racer(i: int) -> None:
        barrier.wait()
        try:
            store.replace("race/lease", f"writer-{i}".encode(), tag)
            wins.append(i)
        except PreconditionFailedError:
            pass

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert len(wins) == 1
    assert store.get("race/lease") == f"writer-{wins[0]}".encode()


def test_get_range_returns_exact_slice(store):
    data = bytes(range(256)) * 8
    store.put("r", data)
    assert store.get_range("r", 100, 50) == data[100:150]
    assert store.get_range("r", 0, 1) == data[:1]


def test_get_range_past_end_is_truncated(store):
    store.put("r", b"0123456789")
    assert store.get_range("r", 8, 10) == b"89"
    assert store.get_range("r", 20, 5) == b""
    assert store.get_range("r", 3, 0) == b""


def test_list_returns_sorted_keys_under_prefix_only(store):
    for key in ["p/b", "p/a", "p/sub/c", "pq/x", "other"]:
        store.put(key, b"x")
    assert store.list("p/") == ["p/a", "p/b", "p/sub/c"]
    assert store.list("p") == ["p/a", "p/b", "p/sub/c", "pq/x"]
    assert store.list("none/") == []
    assert store.list("") == ["other", "p/a", "p/b", "p/sub/c", "pq/x"]


def test_list_pages_beyond_one_page(store):
    keys = (
        [f"many/{i:04d}" for i in range(1005)]
        if isinstance(store, S3Store)
        else [f"many/{i:04d}" for i in range(50)]
    )
    for key in keys:
        store.put(key, b"")
    assert store.list("many/") == keys


def test_delete_removes_and_missing_is_fine(store):
    store.put("d", b"x")
    store.delete("d")
    assert not store.exists("d")
    store.delete("d")
    store.delete("never/was")


def test_exists_reflects_presence(store):
    assert not store.exists("e")
    store.put("e", b"")
    assert store.exists("e")
    assert store.get("e") == b""


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "./a", "a\\b"])
def test_bad_keys_are_refused_naming_the_key(store, bad):
    with pytest.raises(StorageError):
        store.put(bad, b"x")


def test_open_store_urls(tmp_path, s3_settings):
    local = open_store(tmp_path.as_uri())
    assert isinstance(local, LocalFileStore) and local.root == tmp_path.resolve()
    assert isinstance(open_store(str(tmp_path / "plain")), LocalFileStore)
    s3 = open_store(f"s3://{s3_settings.s3_bucket}/some/prefix", s3_settings)
    assert isinstance(s3, S3Store) and s3.url == f"s3://{s3_settings.s3_bucket}/some/prefix"
    with pytest.raises(StorageError, match="unknown scheme"):
        open_store("gs://bucket/x")
